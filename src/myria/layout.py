"""The parallel layout of a run, shared by the trainer, `--dry-run`, the simulator and the planner.

`Layout` is the one description of how a run's ranks are arranged: its degrees (a dict:
``layout["tp"]``), pipeline interleaving and schedule; it resolves itself from a config and a
world size, validates itself against a model and a batch, and gives each rank's coordinates, the
process groups of every dimension and (on the trainer's side) the DeviceMesh, all in one mesh
order. Beside it: the schedule names and what each means, which pipeline ranks hold which
stages, how the layers are split into stages, and the checks a layout must pass. Pure Python and
numpy (no torch), so the analytic performance model can use it without importing the trainer.

Schedule names (the same to every part of myria):

- ``gpipe``: all forwards, then all backwards (one stage per rank);
- ``1f1b``: one forward, one backward in the steady state (one stage per rank);
- ``interleaved-1f1b``: 1F1B over ``vpp`` looped chunks per rank (Narayanan et al. 2021);
- ``zero-bubble``: torch's interleaved zero-bubble schedule (Qi et al. 2023's ZB-H1 order with
  the backward split into input- and weight-gradient halves), one or more looped chunks per
  rank (``vpp`` >= 1);
- ``zbv``: zero-bubble in a V shape: exactly two chunks per rank, stages r and 2p-1-r on rank r.

Stages need not hold equal numbers of layers: ``split_layers`` balances their forward FLOPs,
so the last stage, which also runs the output layer, holds fewer layers when the output layer is
heavy (e.g. 126 layers on 16 stages: 8 layers on most stages, 7 on the last ones).
torch.distributed.pipelining runs such uneven stages as they are (a ``PipelineStage`` wraps any
sub-module; only the activation shape between stages must agree), and so does myria's trainer.
"""

from __future__ import annotations

from functools import lru_cache

from myria.config import ModelConfig
from myria.errors import ConfigError
from myria.models.flops import forward_flops_per_token

# The mesh's dimensions, outermost first: consecutive ranks fill tp, then cp, then the
# data-parallel shard and replica dimensions, then pp (Megatron-LM's order; the trainer's
# DeviceMesh, the placement of ranks on hosts and the simulator's communicators all use it)
MESH_ORDER = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
SCHEDULE_NAMES = ("gpipe", "1f1b", "interleaved-1f1b", "zero-bubble", "zbv")
SINGLE_STAGE = ("gpipe", "1f1b")              # one stage (chunk) per rank
ZERO_BUBBLE = ("zero-bubble", "zbv")          # backward split into input and weight gradients


class Layout(dict):
    """Degrees by mesh dimension (`dp_replicate`, `dp_shard`, `dp` = their product, `tp`,
    `pp`, `cp`, `ep`) as a dict, plus `vpp`, `schedule` and `sequence_parallel`."""

    def __init__(self, dp_replicate: int = 1, dp_shard: int = 1, tp: int = 1, pp: int = 1,
                 cp: int = 1, ep: int = 1, vpp: int = 1, schedule: str = "1f1b",
                 sequence_parallel: bool = False):
        super().__init__(dp_replicate=dp_replicate, dp_shard=dp_shard,
                         dp=dp_replicate * dp_shard, tp=tp, pp=pp, cp=cp, ep=ep)
        self.vpp, self.schedule, self.sequence_parallel = vpp, schedule, sequence_parallel

    @classmethod
    def resolve(cls, par, world_size: int) -> Layout:
        """The layout of a `ParallelConfig` on `world_size` ranks (dp_shard = -1 fills the
        rest), or a ConfigError saying which product does not match."""
        other = par.dp_replicate * par.tp * par.pp * par.cp
        if par.dp_shard == -1:
            if world_size % other:
                raise ConfigError(
                    f"world size {world_size} is not divisible by parallel.dp_replicate*tp*pp*cp"
                    f" = {other}; choose degrees whose product divides the number of processes")
            shard = world_size // other
        else:
            shard = par.dp_shard
        if other * shard != world_size:
            raise ConfigError(
                f"parallel layout dp_replicate={par.dp_replicate} x dp_shard={shard} x "
                f"tp={par.tp} x pp={par.pp} x cp={par.cp} = {other * shard} processes, but the "
                f"world size is {world_size}; set parallel.dp_shard=-1 to fill it or change "
                "--nproc")
        return cls(par.dp_replicate, shard, par.tp, par.pp, par.cp, par.ep, par.vpp,
                   par.schedule, par.sequence_parallel)

    @property
    def world(self) -> int:
        return self["dp"] * self["tp"] * self["pp"] * self["cp"]

    def validate(self, model: ModelConfig, global_batch: int | None = None,
                 micro_batch: int | None = None, microbatches: int | None = None) -> None:
        """The checks every part of myria applies to a layout (ConfigError, one line each):
        pipeline (stages, schedule, microbatches), tensor/context splits, batch split."""
        validate_pipeline(model.layers, self["pp"], self.vpp, self.schedule, microbatches)
        validate_degrees(model, self["tp"], self["cp"], self.sequence_parallel)
        if global_batch is not None and micro_batch is not None:
            validate_batch(global_batch, micro_batch, self["dp"])

    def grid(self, cluster=None):
        """The global ranks as a numpy array with one axis per dimension of `MESH_ORDER`:
        consecutive ranks fill tp first, or placed by topology given a
        `myria.parallel.placement.Cluster`."""
        import numpy as np

        sizes = [self[d] for d in MESH_ORDER]
        if cluster is None:
            return np.arange(self.world, dtype=np.int64).reshape(sizes)
        from myria.parallel.placement import place

        return place(self, cluster)

    def coord(self, rank: int, cluster=None) -> dict[str, int]:
        """`rank`'s index along every dimension."""
        from myria.parallel.placement import coordinates

        return coordinates(self.grid(cluster))[rank]

    def groups(self, dim: str, cluster=None) -> list[list[int]]:
        """The process groups along `dim`, each in group-rank order."""
        from myria.parallel.placement import groups

        return groups(self.grid(cluster), dim)

    def mesh(self, device_type: str, cluster=None):
        """The trainer's DeviceMesh over the non-trivial dimensions (None for one process)."""
        from myria.parallel.mesh import build_mesh

        return build_mesh(self, device_type, cluster)


def stage_ids(pp_rank: int, pp: int, vpp: int, schedule: str) -> list[int]:
    """Global indices of the stages held by pipeline rank `pp_rank`."""
    if schedule == "zbv":
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + i * pp for i in range(vpp)]


def strides(degrees: dict[str, int]) -> dict[str, int]:
    """Rank distance between neighbours along each mesh dimension (`MESH_ORDER`) for the given
    degrees (missing dimensions are 1): tp 1, cp tp, dp_shard tp x cp, ..."""
    out, step = {}, 1
    for name in reversed(MESH_ORDER):
        out[name] = step
        step *= degrees.get(name, 1)
    return out


def validate_pipeline(layers: int, pp: int, vpp: int, schedule: str,
                      microbatches: int | None = None, where: str = "parallel") -> None:
    """Raise ConfigError for a pipeline layout no schedule can run, naming the fields."""
    if schedule not in SCHEDULE_NAMES:
        raise ConfigError(f"{where}.schedule = {schedule!r}: must be one of "
                          f"{', '.join(SCHEDULE_NAMES)}")
    if schedule in SINGLE_STAGE and vpp != 1:
        raise ConfigError(f"{where}.vpp = {vpp} needs an interleaved schedule "
                          f"(interleaved-1f1b, zero-bubble or zbv), not {where}.schedule = "
                          f"{schedule!r}, which runs one stage per rank")
    if schedule == "zbv" and vpp != 2:
        raise ConfigError(f"{where}.schedule = 'zbv' holds exactly two stages per rank (a V): "
                          f"set {where}.vpp = 2 (got {vpp})")
    if pp * vpp > layers:
        raise ConfigError(f"model.layers = {layers} cannot fill pp x vpp = {pp * vpp} pipeline "
                          "stages: every stage needs a layer; use fewer stages or more layers")
    if pp > 1 and microbatches is not None and schedule not in SINGLE_STAGE and \
            microbatches % pp:
        raise ConfigError(
            f"the {schedule} schedule needs the microbatches per step ({microbatches} = "
            f"global_batch / (dp x micro_batch)) to be a multiple of {where}.pp = {pp}")


def validate_batch(global_batch: int, micro_batch: int, dp: int) -> None:
    """Raise ConfigError unless the data-parallel ranks split the batch into whole
    microbatches."""
    if global_batch % (dp * micro_batch):
        raise ConfigError(
            f"training.global_batch = {global_batch} must be divisible by data-parallel ranks "
            f"({dp}) x training.micro_batch ({micro_batch}) = {dp * micro_batch}")


def validate_degrees(m: ModelConfig, tp: int, cp: int, sequence_parallel: bool) -> None:
    """Raise ConfigError when tensor or context parallelism cannot split the model's tensors
    (the rules of Megatron-LM and of myria's trainer alike)."""
    if cp > 1 and (m.arch in ("retnet", "griffin") or m.attention != "softmax"):
        raise ConfigError(f"parallel.cp = {cp} (ring attention) needs softmax attention in "
                          f"llama or gpt; model.arch = {m.arch!r}, model.attention = "
                          f"{m.attention!r} runs with parallel.cp = 1")
    if m.heads % tp or m.n_kv_heads % tp:
        raise ConfigError(f"parallel.tp = {tp} must divide model.heads = {m.heads} and the "
                          f"key/value heads = {m.n_kv_heads}")
    if tp > 1 and m.ffn_dim % tp:
        raise ConfigError(f"the MLP width {m.ffn_dim} must be divisible by parallel.tp = {tp}")
    if tp > 1 and sequence_parallel and m.seq_len % tp:
        raise ConfigError(f"model.seq_len = {m.seq_len} must be divisible by parallel.tp = {tp} "
                          "for sequence parallelism")
    if cp > 1 and m.seq_len % (2 * cp):
        raise ConfigError(f"model.seq_len = {m.seq_len} must be divisible by 2 x parallel.cp = "
                          f"{2 * cp} (each context-parallel rank holds a head and a tail chunk, "
                          "which balances the causal work)")


def split_layers(cfg: ModelConfig, n_stages: int) -> list[list[int]]:
    """Contiguous layer ranges per stage that minimise the most expensive stage.

    Costs are forward FLOPs per token: every block costs the same; the first stage adds the
    embedding lookup (about one FLOP per element, negligible) and the last adds the final norm
    and head (2 h V), expressed in blocks. Among splits with the same most expensive stage the
    one found first (earliest stages fullest) is kept.
    """
    f = forward_flops_per_token(cfg)
    per_layer = (f.total - f.logits) / cfg.layers
    return [list(r) for r in _split(cfg.layers, round(f.logits / per_layer, 9), n_stages)]


@lru_cache(maxsize=1024)
def _split(n: int, head: float, n_stages: int) -> tuple[range, ...]:
    """`split_layers` for n layers of cost 1 and a last-stage extra cost `head`."""
    def cost(stage: int, lo: int, hi: int) -> float:
        return (hi - lo) + (head if stage == n_stages - 1 else 0.0)

    # best[s][i]: minimal max-cost of placing layers [0, i) on stages [0, s)
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(n_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(n_stages + 1)]
    best[0][0] = 0.0
    for s in range(1, n_stages + 1):
        for i in range(s, n - (n_stages - s) + 1):
            for j in range(s - 1, i):
                c = max(best[s - 1][j], cost(s - 1, j, i))
                if c < best[s][i]:
                    best[s][i], cut[s][i] = c, j
    ranges, i = [], n
    for s in range(n_stages, 0, -1):
        j = cut[s][i]
        ranges.append(range(j, i))
        i = j
    return tuple(ranges[::-1])


def stage_layers(cfg: ModelConfig, pp: int, vpp: int) -> list[int]:
    """Layers per pipeline stage (pp x vpp stages, in order), as the trainer splits them."""
    if pp * vpp == 1:
        return [cfg.layers]
    return [len(x) for x in split_layers(cfg, pp * vpp)]


def rank_layers(cfg: ModelConfig, pp: int, vpp: int, schedule: str) -> list[int]:
    """Layers held by each pipeline rank (summed over its chunks), in rank order."""
    per_stage = stage_layers(cfg, pp, vpp)
    return [sum(per_stage[s] for s in stage_ids(r, pp, vpp, schedule)) for r in range(pp)]
