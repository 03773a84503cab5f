"""The parallel layout of a run, shared by the trainer, `--dry-run`, the simulator and the planner.

`Layout` is the one frozen description of how a run's ranks are arranged: the degree of every
mesh dimension (`MESH_ORDER`) and of expert parallelism, pipeline interleaving and schedule,
sequence parallelism. `Layout.resolve(parallel_config, world_size)` builds it; it computes the
microbatch count (`microbatches`, the one place) and holds every rule a layout must pass
(`check`; `trainer=False` for the simulator and planner relaxes the rules that are limits of
myria's trainer rather than of the layout). Pure Python (no torch): the torch side is
`myria.parallel.dims.ParallelDims`, the placement on hosts `myria.parallel.placement`.

Schedule names (the same to every part of myria):

- ``gpipe``: all forwards, then all backwards (one stage per rank);
- ``1f1b``: one forward, one backward in the steady state (one stage per rank);
- ``interleaved-1f1b``: 1F1B over ``vpp`` looped chunks per rank (Narayanan et al. 2021);
- ``zero-bubble``: torch's interleaved zero-bubble schedule (ZB-H1 order, Qi et al. 2023, the
  backward split into input- and weight-gradient halves), ``vpp`` >= 1 looped chunks per rank;
- ``zbv``: zero-bubble in a V shape: exactly two chunks per rank, stages r and 2p-1-r on rank r.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import NamedTuple

from myria.config import Config, ModelConfig
from myria.errors import ConfigError
from myria.models.flops import forward_flops_per_token

# The mesh's dimensions, outermost first: consecutive ranks fill tp, then cp, then the
# data-parallel shard and replica dimensions, then pp (Megatron-LM's order; the trainer's
# DeviceMesh, the placement of ranks on hosts and the simulator's communicators all use it)
MESH_ORDER = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
SCHEDULE_NAMES = ("gpipe", "1f1b", "interleaved-1f1b", "zero-bubble", "zbv")
SINGLE_STAGE = ("gpipe", "1f1b")              # one stage (chunk) per rank
ZERO_BUBBLE = ("zero-bubble", "zbv")          # backward split into input and weight gradients
DEGREES = (*MESH_ORDER, "dp", "ep")


class Share(NamedTuple):
    """A data-parallel rank's part of a step's global batch (`Layout.share`)."""

    microbatches: range      # indices of the step's microbatches this rank trains
    loss_divisor: float      # what each of their losses is divided by


@dataclass(frozen=True)
class Layout:
    """How a run's ranks are arranged: degrees by mesh dimension, pipeline interleaving and
    schedule, sequence parallelism. Frozen; `check` holds every rule a layout must pass.

    `dp` = dp_replicate x dp_shard (the data-parallel ranks); context-parallel ranks share the
    data of their sequence. `layout["tp"]` reads a degree by name (for code that walks the mesh
    dimensions); `as_dict()` is the whole description (what checkpoints record).
    """

    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    vpp: int = 1
    schedule: str = "1f1b"
    sequence_parallel: bool = False

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    @property
    def stages(self) -> int:
        return self.pp * self.vpp

    def __getitem__(self, dim: str) -> int:
        """The degree of mesh dimension `dim` (or `dp`, `ep`)."""
        if dim not in DEGREES:
            raise KeyError(dim)
        return getattr(self, dim)

    def get(self, dim: str, default: int = 1) -> int:
        return getattr(self, dim) if dim in DEGREES else default

    def degrees(self) -> dict[str, int]:
        """{dim: degree} of every dimension (MESH_ORDER, then dp and ep)."""
        return {d: getattr(self, d) for d in DEGREES}

    def as_dict(self) -> dict:
        return {**self.degrees(), "vpp": self.vpp, "schedule": self.schedule,
                "sequence_parallel": self.sequence_parallel}

    def short(self) -> str:
        """"tp2xpp2"-style name of the non-trivial degrees ("single" for one process)."""
        parts = [f"{d}{getattr(self, d)}" for d in ("dp_replicate", "dp_shard", "tp", "pp",
                                                     "cp", "ep") if getattr(self, d) > 1]
        return "x".join(parts) or "single"

    @classmethod
    def of(cls, par, dp_shard: int | None = None) -> Layout:
        """The layout a `ParallelConfig` names (dp_shard given explicitly or as configured)."""
        return cls(par.dp_replicate, par.dp_shard if dp_shard is None else dp_shard, par.tp,
                   par.pp, par.cp, par.ep, par.vpp, par.schedule,
                   bool(par.sequence_parallel and par.tp > 1))

    @staticmethod
    def fewest_processes(par) -> int:
        """The fewest processes a `ParallelConfig` runs on: dp_shard = -1 filled with the
        fewest shard ranks, the expert-parallel degree (experts are spread over them)."""
        shard = par.dp_shard if par.dp_shard > 0 else par.ep
        return par.dp_replicate * par.tp * par.pp * par.cp * shard

    @classmethod
    def resolve(cls, par, world_size: int) -> Layout:
        """The layout of a `ParallelConfig` on `world_size` ranks (dp_shard = -1 fills the
        rest), or a ConfigError saying which product does not match."""
        if world_size < 1:
            raise ConfigError(f"the number of processes must be >= 1 (got {world_size})")
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
        return cls.of(par, shard)

    def microbatches(self, global_batch: int, micro_batch: int, shrunk: bool = False) -> int:
        """Microbatches per step on each data-parallel rank (gradient accumulation, and what a
        pipeline schedule interleaves): global_batch / (dp x micro_batch), checked to divide;
        in a run shrunk after a lost replica (`shrink_refusal`) the largest share (`share`)."""
        if shrunk and global_batch % (self.dp * micro_batch):
            return len(self.share(global_batch, micro_batch, 0).microbatches)
        if global_batch % (self.dp * micro_batch):
            raise ConfigError(
                f"training.global_batch = {global_batch} must be divisible by data-parallel "
                f"ranks ({self.dp}) x training.micro_batch ({micro_batch}) = "
                f"{self.dp * micro_batch}")
        return global_batch // (self.dp * micro_batch)

    def share(self, global_batch: int, micro_batch: int, dp_rank: int) -> Share:
        """The microbatches of a step's global batch (global_batch / micro_batch of them, in
        order) that data-parallel rank `dp_rank` trains, and what each microbatch's loss is
        divided by so that the data-parallel average is the global batch's mean.

        A contiguous run, the first (microbatches % dp) ranks one more: equal shares when dp
        divides them, unequal only in a run shrunk after a lost replica, which keeps the global
        batch and so the data of every step. The divisor is microbatches / dp, the share's own
        size when the shares are equal."""
        total = global_batch // micro_batch
        per, extra = divmod(total, self.dp)
        first = dp_rank * per + min(dp_rank, extra)
        return Share(range(first, first + per + (dp_rank < extra)), total / self.dp)

    def shrink_refusal(self, cfg: Config, world_size: int) -> str | None:
        """Why this layout cannot go on with one data-parallel replica fewer after a lost
        rank (`resilience.shrink`), or None. Only full replicas can: pure DDP over every rank
        (each survivor holds the whole model and optimizer state, so nothing is resharded),
        with at least one microbatch of the global batch for each of the ranks left."""
        if cfg.training.data_parallel != "ddp" or self.dp != world_size or self.ep > 1:
            return (f"it needs full replicas: training.data_parallel = 'ddp' over every rank "
                    f"(not {cfg.training.data_parallel!r}, layout {self.short()})")
        if world_size < 3:
            return f"it needs --nproc >= 3 (two ranks left to form a group), not {world_size}"
        if cfg.training.global_batch // cfg.training.micro_batch < world_size - 1:
            return (f"training.global_batch / training.micro_batch = "
                    f"{cfg.training.global_batch // cfg.training.micro_batch} microbatches "
                    f"cannot give each of {world_size - 1} ranks one")
        return None

    def shards_with_fsdp(self, cfg: Config, device_type: str) -> bool:
        """Whether the trainer shards the model with FSDP2, and so applies its mixed-precision
        and CPU-offload policies: over the data and context ranks (not under DDP, not with the
        zero-bubble schedules, whose gradients the engine all-reduces itself), and on a lone
        process that computes in bf16 or offloads to the host (a one-rank mesh: as on N
        ranks)."""
        t, p = cfg.training, cfg.parallel
        if t.data_parallel == "ddp" or self.manual_reduce(t.data_parallel):
            return False
        if self.dp * self.cp > 1:
            return True
        return p.offload != "nvme" and (wants_bf16(cfg, device_type) or p.offload == "cpu")

    def computes_in_bf16(self, cfg: Config, device_type: str) -> bool:
        """Whether the run computes in bf16: the trainer applies bf16 only through FSDP2's
        mixed-precision policy, so where training.dtype asks for it and FSDP2 shards."""
        return wants_bf16(cfg, device_type) and self.shards_with_fsdp(cfg, device_type)

    def no_bf16_reason(self, cfg: Config) -> str:
        """What keeps this layout from computing in bf16 (no FSDP2, so no mixed-precision
        policy), in words naming the setting; "" if nothing does."""
        t, p = cfg.training, cfg.parallel
        if t.data_parallel == "ddp":
            return "training.data_parallel = 'ddp' (DDP applies no mixed-precision policy)"
        if self.manual_reduce(t.data_parallel):
            return (f"parallel.schedule = {self.schedule!r} with data parallelism (the engine "
                    "reduces its gradients itself, without FSDP2)")
        if p.offload == "nvme" and self.dp * self.cp <= 1:
            return "parallel.offload = 'nvme' on one data-parallel rank (no FSDP2)"
        return ""

    def manual_reduce(self, data_parallel: str) -> bool:
        """Whether the trainer all-reduces data-parallel gradients itself, unsharded: torch
        2.13's zero-bubble schedules compute weight gradients after FSDP2 has reduced them."""
        return (self.dp * self.cp > 1 and data_parallel != "ddp" and self.pp > 1
                and self.schedule in ZERO_BUBBLE)

    def check(self, cfg: Config, device_type: str = "cpu", trainer: bool = True,
              shrunk: bool = False) -> None:
        """Every rule a layout must pass, as one-line ConfigErrors naming the fields.

        `cfg` gives the model, batch, data-parallel engine, optimizer and the [parallel]
        options; `trainer=False` (the simulator and planner) relaxes the rules that are limits
        of myria's trainer in this version rather than of the layout itself, so that layouts
        other frameworks run can still be priced (each such rule says so below). `shrunk`:
        the layout of a run that lost a replica (`shrink_refusal`), whose shares may differ.
        """
        m, t, p = cfg.model, cfg.training, cfg.parallel
        tp, cp, pp, ep = self.tp, self.cp, self.pp, self.ep
        only_trainer = trainer   # the trainer's own limits apply
        # -- the batch and the pipeline -----------------------------------------------------
        n_micro = self.microbatches(t.global_batch, t.micro_batch, shrunk)
        validate_pipeline(m.layers, pp, self.vpp, self.schedule, n_micro)
        validate_degrees(m, tp, cp, self.sequence_parallel, vocab=only_trainer)
        # -- experts ---------------------------------------------------------------------------
        if ep > 1:
            if not m.experts:
                raise ConfigError(f"parallel.ep = {ep} needs a mixture-of-experts model "
                                  "(model.experts > 0)")
            if m.experts % ep:
                raise ConfigError(f"parallel.ep = {ep} must divide model.experts = {m.experts}")
            # myria's experts borrow the FSDP shard ranks; Megatron-LM's borrow dp x cp
            if only_trainer and self.dp_shard % ep:
                raise ConfigError(f"parallel.ep = {ep} must divide the data-parallel sharding "
                                  f"degree parallel.dp_shard = {self.dp_shard} (experts are "
                                  "spread over the FSDP shard ranks; dp_replicate copies them)")
            if not only_trainer and (self.dp * cp) % ep:
                raise ConfigError(f"parallel.ep = {ep} must divide the data-parallel (x cp) "
                                  f"ranks {self.dp * cp}: experts are spread over them")
        tier = p.offload
        if p.offload_params and tier != "nvme":
            raise ConfigError("parallel.offload_params = true needs parallel.offload = 'nvme' "
                              "(the parameters go to the same files as the optimizer state)")
        if not only_trainer:
            return
        # -- limits of myria's trainer in this version (relaxed for the simulator) -------------
        if cp > 1 and p.cp_impl == "torch" and (device_type != "cuda"
                                                 or 0 < m.attention_window < m.seq_len):
            raise ConfigError("parallel.cp_impl = 'torch' (torch's context_parallel) needs CUDA "
                              "and full causal attention in torch 2.13; use cp_impl = 'ring'")
        if ep > 1 and t.data_parallel == "ddp":
            raise ConfigError("parallel.ep > 1 needs training.data_parallel = 'fsdp' or 'zero2' "
                              "(DDP would average different experts together)")
        if m.experts and (tp > 1 or pp > 1 or cp > 1):
            raise ConfigError("mixture-of-experts models run with data and expert parallelism "
                              "(tp = pp = cp = 1) in this version")
        if t.data_parallel == "ddp" and (tp > 1 or pp > 1 or cp > 1):
            raise ConfigError("training.data_parallel = 'ddp' works with pure data "
                              "parallelism; use 'fsdp' or 'zero2' with tp, pp or cp")
        # (the nvme tier on one rank is left to say fp32 in its start line: the tier runs on
        # CPU processes in this version, and a bf16 GPU config's dry run with it is a plan)
        if only_trainer and t.dtype == "bfloat16" and p.offload != "nvme" and \
                not self.computes_in_bf16(cfg, device_type):
            raise ConfigError(f"training.dtype = 'bfloat16' with {self.no_bf16_reason(cfg)}: "
                              "myria computes in bf16 through FSDP2's mixed-precision policy "
                              "only, so this would train in fp32; set training.dtype = "
                              "'float32', or use training.data_parallel = 'fsdp' or 'zero2'")
        if m.document_mask and (pp > 1 or (cp > 1 and p.cp_impl == "torch")):
            raise ConfigError("model.document_mask runs without pipeline parallelism (pp = 1) "
                              "and, under context parallelism, with parallel.cp_impl = 'ring'")
        if tier == "cpu" and (t.data_parallel == "ddp"
                              or (self.dp * cp <= 1 and device_type != "cuda")):
            raise ConfigError("parallel.offload = 'cpu' is FSDP2's CPUOffloadPolicy: it needs "
                              "training.data_parallel = 'fsdp' or 'zero2' over more than one "
                              f"data-parallel (x cp) rank (this layout has {self.dp * cp}), or "
                              "a GPU; on CPU processes without data parallelism use "
                              "parallel.offload = 'nvme'")
        if tier == "nvme" and device_type != "cpu":
            # the moments sit in host buffers: the update would need a per-chunk copy to the
            # device (or a host-side update, as ZeRO-Offload does), not written yet
            raise ConfigError(f"parallel.offload = 'nvme' runs on CPU in this version, not on "
                              f"{device_type}; use parallel.offload = 'cpu' (FSDP2's host "
                              "offload)")
        if tier == "nvme" and p.offload_dir and not Path(p.offload_dir).parent.exists():
            # creating it with its parents would put the files on whatever disk holds them
            raise ConfigError(f"parallel.offload_dir {p.offload_dir!r}: "
                              f"{str(Path(p.offload_dir).parent)!r} does not exist (a mistyped "
                              "path, or a disk that is not mounted?)")
        if tier == "nvme" and cfg.optimizer.name != "adamw":
            raise ConfigError(f"parallel.offload = 'nvme' supports optimizer.name = 'adamw', "
                              f"not {cfg.optimizer.name!r}")
        if p.offload_params:
            many = {d: getattr(self, d) for d in ("dp", "tp", "pp", "cp", "ep")
                    if getattr(self, d) > 1}
            if many:
                raise ConfigError("parallel.offload_params = true runs on one process (no "
                                  "data, tensor, pipeline, context or expert parallelism), not "
                                  + ", ".join(f"{k}={v}" for k, v in many.items()))
            if m.tie_embeddings or p.compile or device_type != "cpu":
                raise ConfigError("parallel.offload_params = true runs on CPU without "
                                  "model.tie_embeddings or parallel.compile in this version")
            if p.activation_checkpoint == "none":
                # a dropped block is read back into another slab: what autograd saved in
                # forward (views of the weights) would point at other data
                raise ConfigError("parallel.offload_params = true needs "
                                  "parallel.activation_checkpoint = 'full' or 'selective' (each "
                                  "block's forward is recomputed from the parameters read back)")


def wants_bf16(cfg: Config, device_type: str) -> bool:
    """Whether training.dtype asks for bf16 compute on `device_type` (auto: bf16 on CUDA,
    fp32 elsewhere)."""
    d = cfg.training.dtype
    return d == "bfloat16" or (d == "auto" and device_type == "cuda")


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
    """Raise ConfigError for a pipeline layout no schedule can run, naming the fields (part of
    `Layout.check`)."""
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


def validate_degrees(m: ModelConfig, tp: int, cp: int, sequence_parallel: bool,
                     vocab: bool = False) -> None:
    """Raise ConfigError when tensor or context parallelism cannot split the model's tensors
    (the rules of Megatron-LM and of myria's trainer alike; part of `Layout.check`, and the
    planner's quick filter of degrees), naming every problem at once; `vocab`: also the
    trainer's split of the embedding and head by vocabulary."""
    if cp > 1 and m.arch == "hybrid" and set(m.block_pattern) - {"A"}:
        raise ConfigError(f"parallel.cp = {cp} (ring attention) cannot split the recurrent "
                          f"layers of model.block_pattern = {m.block_pattern!r} (D, M and R "
                          "carry a state along the sequence); use parallel.cp = 1")
    if cp > 1 and (m.arch in ("retnet", "griffin") or m.attention != "softmax"):
        raise ConfigError(f"parallel.cp = {cp} (ring attention) needs softmax attention in "
                          f"llama or gpt; model.arch = {m.arch!r}, model.attention = "
                          f"{m.attention!r} runs with parallel.cp = 1")
    problems = []
    if m.heads % tp or m.n_kv_heads % tp:
        problems.append(f"parallel.tp = {tp} must divide model.heads = {m.heads} and the "
                        f"key/value heads = {m.n_kv_heads}")
    if tp > 1 and m.ffn_dim % tp:
        problems.append(f"the MLP width {m.ffn_dim} (model.ffn_hidden"
                        + ("" if m.ffn_hidden else ", derived from model.hidden when unset")
                        + f") must be divisible by parallel.tp = {tp}")
    if tp > 1 and sequence_parallel and m.seq_len % tp:
        problems.append(f"model.seq_len = {m.seq_len} must be divisible by parallel.tp = {tp} "
                        "for sequence parallelism (or parallel.sequence_parallel = false)")
    if vocab and tp > 1 and m.vocab_size % tp:
        problems.append(f"model.vocab_size = {m.vocab_size} must be divisible by "
                        f"parallel.tp = {tp} (the embedding and head are split by vocabulary)")
    if cp > 1 and m.seq_len % (2 * cp):
        problems.append(f"model.seq_len = {m.seq_len} must be divisible by 2 x parallel.cp = "
                        f"{2 * cp} (each context-parallel rank holds a head and a tail chunk, "
                        "which balances the causal work)")
    if problems:
        raise ConfigError("; and ".join(problems))


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

