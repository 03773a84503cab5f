"""Pipeline parallelism: split the model into FLOP-balanced stages and run torch's schedules.

The model is cut into pp x vpp contiguous stages of layers; the first stage also holds the
embeddings and the last the final norm and output head, so they get fewer layers when the head
is heavy (its cost is counted in layer-equivalents from `myria.models.flops`). Stage `s` lives on
pipeline rank `s % pp` (looped/interleaved placement), except for the ZBV schedule whose V shape
puts stages r and 2p-1-r on rank r. The schedules are torch.distributed.pipelining's: GPipe,
1F1B, interleaved 1F1B, interleaved zero-bubble and ZBV zero-bubble; their sends and receives
are asynchronous, which is the overlap of pipeline communication with compute.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import (
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
)

from myria.config import ModelConfig
from myria.errors import ConfigError
from myria.models.flops import forward_flops_per_token

SCHEDULES = {
    "gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved-1f1b": ScheduleInterleaved1F1B,
    "zero-bubble": ScheduleInterleavedZeroBubble, "zbv": ScheduleZBVZeroBubble,
}
SINGLE_STAGE = ("gpipe", "1f1b")


def stage_ids(pp_rank: int, pp: int, vpp: int, schedule: str) -> list[int]:
    """Global indices of the stages held by pipeline rank `pp_rank`."""
    if schedule == "zbv":
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + i * pp for i in range(vpp)]


def validate(cfg: ModelConfig, pp: int, vpp: int, schedule: str, n_microbatches: int) -> None:
    """Clear errors for layouts the schedules cannot run."""
    if schedule in SINGLE_STAGE and vpp != 1:
        raise ConfigError(f"parallel.schedule = {schedule!r} runs one stage per rank; set "
                          "parallel.vpp = 1 or use interleaved-1f1b / zero-bubble / zbv")
    if schedule == "zbv" and vpp != 2:
        raise ConfigError("parallel.schedule = 'zbv' holds exactly two stages per rank (a V): "
                          f"set parallel.vpp = 2 (got {vpp})")
    stages = pp * vpp
    if cfg.layers < stages:
        raise ConfigError(f"model.layers = {cfg.layers} cannot fill pp x vpp = {stages} "
                          "pipeline stages; use fewer stages or more layers")
    if cfg.tie_embeddings:
        raise ConfigError("model.tie_embeddings is not supported with pipeline parallelism "
                          "(the embedding and the head live on different stages)")
    if schedule not in SINGLE_STAGE and n_microbatches % pp:
        raise ConfigError(
            f"the {schedule} schedule needs the microbatches per step ({n_microbatches} = "
            f"global_batch / (dp x micro_batch)) to be a multiple of parallel.pp = {pp}")


def split_layers(cfg: ModelConfig, n_stages: int) -> list[list[int]]:
    """Contiguous layer ranges per stage that minimise the most expensive stage.

    Costs are forward FLOPs per token: every block costs the same; the first stage adds the
    embedding lookup (about one FLOP per element, negligible) and the last adds the final norm
    and head (2 h V), expressed in blocks.
    """
    f = forward_flops_per_token(cfg)
    per_layer = (f.total - f.logits) / cfg.layers
    head = f.logits / per_layer
    n = cfg.layers

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
        ranges.append(list(range(j, i)))
        i = j
    return ranges[::-1]


def stage_module(model: nn.Module, layers: list[int], first: bool, last: bool) -> nn.Module:
    """A copy of the (meta) model that keeps only `layers` and, if first/last, the ends."""
    m = copy.deepcopy(model)
    keep = {str(i) for i in layers}
    for name in list(m.layers.keys()):
        if name not in keep:
            del m.layers[name]
    if not first:
        m.tok_embeddings = None
        m.pos_embeddings = None
    if not last:
        m.norm = None
        m.output = None
    return m


def build_stages(model: nn.Module, cfg: ModelConfig, pp_rank: int, pp: int, vpp: int,
                 schedule: str) -> tuple[list[nn.Module], list[int]]:
    """The stage modules of this rank (still on the meta device) and their stage indices."""
    n_stages = pp * vpp
    ranges = split_layers(cfg, n_stages)
    ids = stage_ids(pp_rank, pp, vpp, schedule)
    parts = [stage_module(model, ranges[s], s == 0, s == n_stages - 1) for s in ids]
    return parts, ids


def build_schedule(parts: list[nn.Module], ids: list[int], n_stages: int, schedule: str,
                   n_microbatches: int, loss_fn: Callable, device: torch.device,
                   group) -> object:
    """Wrap each part in a PipelineStage and build the named schedule over them."""
    stages = [PipelineStage(p, s, n_stages, device, group=group) for p, s in zip(parts, ids)]
    cls = SCHEDULES[schedule]
    if schedule in SINGLE_STAGE:
        return cls(stages[0], n_microbatches=n_microbatches, loss_fn=loss_fn)
    return cls(stages, n_microbatches=n_microbatches, loss_fn=loss_fn)


def bubble_fraction(pp: int, vpp: int, n_microbatches: int, schedule: str,
                    relative_to: str = "step") -> float:
    """Theoretical idle share of a rank, for equal stages and backward = 2 x forward.

    The bubble, in units of one microbatch's compute on a rank (forward + backward of all its
    chunks), is b = (p-1)/v for GPipe, 1F1B and interleaved 1F1B (v = 1 for the first two), and
    b = (p-1)/(3v) for the zero-bubble schedules, whose weight-gradient half of the backward (W)
    fills the warm-up and cool-down (ZB-H1: (p-1)(F + B - W) per chunk with F = B = W; ZBV
    reaches it once n_microbatches >= 2p). `relative_to="compute"` returns b/m, Narayanan et
    al.'s bubble ratio (p-1)/(v m) (bubble time over ideal compute time); the default "step"
    returns b/(m+b), the idle fraction of the step.
    """
    v = vpp if schedule not in SINGLE_STAGE else 1
    b = (pp - 1) / v
    if schedule in ("zero-bubble", "zbv"):
        b /= 3
    if relative_to == "compute":
        return b / n_microbatches
    if relative_to != "step":
        raise ValueError(f"relative_to must be 'step' or 'compute', got {relative_to!r}")
    return b / (n_microbatches + b)
