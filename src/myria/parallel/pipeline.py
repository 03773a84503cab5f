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
from myria.layout import SCHEDULE_NAMES, SINGLE_STAGE, split_layers, stage_ids

SCHEDULES = {
    "gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved-1f1b": ScheduleInterleaved1F1B,
    "zero-bubble": ScheduleInterleavedZeroBubble, "zbv": ScheduleZBVZeroBubble,
}
assert tuple(SCHEDULES) == SCHEDULE_NAMES


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
    for st in stages:
        _no_gradient_handoff_in_eval(st)
    cls = SCHEDULES[schedule]
    if schedule in SINGLE_STAGE:
        return cls(stages[0], n_microbatches=n_microbatches, loss_fn=loss_fn)
    return cls(stages, n_microbatches=n_microbatches, loss_fn=loss_fn)


def _no_gradient_handoff_in_eval(stage: PipelineStage) -> None:
    """torch 2.13's multi-stage executor hands a gradient from a stage to the previous one on
    the same rank (the V-schedule's two adjacent stages, `zbv`) after each backward action,
    also in the schedule's forward-only `eval`, where the stage refuses it (it has no
    backward): without a backward the handoff carries nothing and is skipped."""
    get, put = stage.get_local_bwd_output, stage.set_local_bwd_input

    def get_local_bwd_output(mb_index):
        return get(mb_index) if stage.has_backward else ()

    def set_local_bwd_input(grads, mb_index):
        if stage.has_backward:
            put(grads, mb_index)

    stage.get_local_bwd_output = get_local_bwd_output
    stage.set_local_bwd_input = set_local_bwd_input


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


class TiedEmbedding:
    """A tied embedding across pipeline stages, as Megatron-LM keeps it: the first stage's input
    embedding and the last stage's output layer are two copies of one (vocab, hidden) tensor,
    initialised (or imported) equal; after each step's backward their gradients are summed
    between the two stages (`sum_grads`), so both copies see the gradient of the tied tensor
    and stay equal under the same optimizer. The last stage's copy (`copy`) is left out of the
    gradient norm, which counts the tied tensor once as on one process.

    Every rank builds it (the group of the first and last stage's ranks is made collectively);
    a rank that holds neither end has nothing to do. When one rank holds both ends (ZBV), the
    sum is local."""

    def __init__(self, parts: list[nn.Module], ids: list[int], n_stages: int, dims) -> None:
        import torch.distributed as dist

        self.params: list[nn.Parameter] = []
        self.copy: nn.Parameter | None = None
        for part, s in zip(parts, ids):
            if s == 0:
                self.params.append(part.tok_embeddings.weight)
            if s == n_stages - 1:
                self.copy = part.output.weight
                self.params.append(self.copy)
        lay, names = dims.layout, dims.mesh.mesh_dim_names
        pp = lay.pp
        first, last = (next(r for r in range(pp) if s in stage_ids(r, pp, lay.vpp, lay.schedule))
                       for s in (0, n_stages - 1))
        self.group = None
        if first == last:
            return
        if pp == 2:
            self.group = dims.pp_group
            return
        ranks = dims.mesh.mesh.movedim(names.index("pp"), -1).reshape(-1, pp)
        self.group, _ = dist.new_subgroups_by_enumeration(
            [[int(r[first]), int(r[last])] for r in ranks])

    @torch.no_grad()
    def sum_grads(self) -> None:
        """Sum the two copies' gradients (local shards: both ends shard the tensor alike)."""
        import torch.distributed as dist

        from myria.tensors import local_grad

        # each placed as its parameter (the embedding's comes out replicated under tensor
        # parallelism), so that both ends hold the same slice
        grads = [local_grad(p) for p in self.params if p.grad is not None]
        if len(grads) == 2:
            grads[0].add_(grads[1])
            grads[1].copy_(grads[0])
        elif grads and self.group is not None:
            dist.all_reduce(grads[0], group=self.group)

    # The optimizer state of the last stage's copy is checkpointed under the embedding's name,
    # as one process names the tied tensor's: a checkpoint then moves between a pipeline and
    # any other layout (both ends save the same values; DCP keeps one).
    _KINDS = ("state.", "param_groups.")

    def optim_to_checkpoint(self, sd: dict) -> dict:
        """The flat optimizer state dict `sd` with the copy's entries under the embedding's
        name."""
        if self.copy is None:
            return sd
        out = {}
        for k, v in sd.items():
            for kind in self._KINDS:
                if k.startswith(kind + "output.weight."):
                    k = kind + "tok_embeddings.weight." + k[len(kind + "output.weight."):]
            out.setdefault(k, v)
        return out

    def optim_from_checkpoint(self, sd: dict) -> dict:
        """`sd` (as `optim_to_checkpoint` left it) with the copy's entries back under its
        name."""
        if self.copy is None:
            return sd
        out = dict(sd)
        for k, v in sd.items():
            for kind in self._KINDS:
                if k.startswith(kind + "tok_embeddings.weight."):
                    out[kind + "output.weight." + k[len(kind + "tok_embeddings.weight."):]] = v
        return out
