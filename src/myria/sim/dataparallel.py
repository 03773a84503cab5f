"""Data-parallel traffic of a step: the collectives of a layout's busiest stage (whole and in
the buckets Megatron-Core and FSDP cut them into), what each ZeRO stage exposes per microbatch
and per step, and myria's eager FSDP2 (timed per unit on a measured CPU). `s` is the step
model's shared state (`perf.Step`; not imported here, as perf imports this module)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

from myria.sim import collectives as coll
from myria.sim.collectives import layout_groups
from myria.sim.hardware import Hardware
from myria.sim.memory import stage_params
from myria.sim.operators import LayerShape
from myria.sim.overlap import (
    Buckets,
    buckets_exposed,
    comm_cost,
    dp_bucket_params,
    fsdp_buckets,
    grad_reduce_exposed,
    megatron_buckets,
)


@dataclass(frozen=True)
class DataParallel:
    """A layout's data-parallel collectives for its busiest stage (`dp_collectives`): whole
    (t_*: one collective each) and in the buckets the frameworks cut them into (b_*:
    Megatron-Core's for ZeRO 0-1, f_*: FSDP's units for ZeRO 2-3)."""

    dense0: float
    expert0: float
    shard_n: int
    t_grad: float
    t_rs: float
    t_ag: float
    t_rep: float
    b_ar: Buckets
    b_rs: Buckets
    b_ag: Buckets
    f_rs: Buckets
    f_ag: Buckets


def stage_kinds(pp: int) -> tuple:
    """(kind, first, last) of the pipeline ranks the model prices: one, or first/mid/last."""
    return (("only", True, True),) if pp == 1 else \
        (("first", True, False), ("mid", False, False), ("last", False, True))


@lru_cache(maxsize=16384)
def dp_collectives(shape: LayerShape, hw: Hardware, gkey: tuple, hsdp: int,
                    n_layers: tuple, overlap_dp: bool, w_b: int) -> DataParallel:
    """The data-parallel state per device of the busiest (first) stage and its collectives
    (the rank holding the most parameters, under uneven stages)."""
    _, cp, ep, dp, pp = gkey
    groups = layout_groups(hw, *gkey, hsdp)
    layers = dict(n_layers)
    kinds = stage_kinds(pp)
    dense0, expert0 = max((stage_params(shape, layers[k], f, la, ep) for k, f, la in kinds),
                          key=sum)
    g_b = GRAD_BYTES
    t_grad = coll.allreduce(dense0 * g_b, groups["dp"])[0] + \
        coll.allreduce(expert0 * g_b, groups["edp"])[0]
    # sharded data parallel (ZeRO 1-3, FSDP): collectives over the shard group; under HSDP the
    # replicas then all-reduce their gradient shards once per step
    shard_n = groups["dps"].n
    t_rs = coll.reduce_scatter(dense0 * g_b, groups["dps"])[0] + \
        coll.reduce_scatter(expert0 * g_b, groups["edp"])[0]
    t_ag = coll.all_gather(dense0 * w_b, groups["dps"])[0] + \
        coll.all_gather(expert0 * w_b, groups["edp"])[0]
    t_rep = coll.allreduce(dense0 * g_b / shard_n, groups["dpr"])[0] if hsdp else 0.0
    # the same collectives in the buckets the frameworks cut them into (docs/performance_model.md):
    # Megatron-Core's for ZeRO 0-1 (one bucket without overlap), FSDP's units for ZeRO 2-3
    k0 = max((k for k, _, _ in kinds), key=lambda k: sum(
        stage_params(shape, layers[k], k in ("first", "only"), k in ("last", "only"), ep)))
    block = stage_params(shape, 1, False, False, ep)
    mega = dp_bucket_params(dp * cp) if overlap_dp else math.inf
    grps = (groups["dps"], groups["edp"])
    return DataParallel(
        dense0, expert0, shard_n, t_grad, t_rs, t_ag, t_rep,
        megatron_buckets(coll.allreduce, dense0, expert0, g_b, (groups["dp"], groups["edp"]),
                         mega),
        megatron_buckets(coll.reduce_scatter, dense0, expert0, g_b, grps, mega),
        megatron_buckets(coll.all_gather, dense0, expert0, w_b, grps, mega),
        fsdp_buckets(coll.reduce_scatter, dense0, expert0, layers[k0], block, g_b, grps),
        fsdp_buckets(coll.all_gather, dense0, expert0, layers[k0], block, w_b, grps))


GRAD_BYTES = 4   # gradients reduce in fp32
NO_BUCKETS = Buckets()   # no traffic (frozen: shared)


def stage_zero(s, F: float, B: float, nl: float, first: bool, last: bool
                ) -> tuple[float, float]:
    """(cost, hidden seconds) of one microbatch's sharded data-parallel traffic on a stage."""
    run, tr = s.run, s.run.training
    dp, cp, pp = run.dp, run.parallel.cp, run.parallel.pp
    if tr.zero_stage >= 3 and dp * cp > 1 and s.eager:
        return fsdp2_microbatch(s.shape, nl, first, last, pp, run.parallel.ep, s.w_b,
                                 s.groups, s.hw.mem_bw * s.eff.mem, s.hw.cpu), 0.0
    if not (tr.zero_stage >= 2 and dp * cp > 1 and not s.eager):
        return 0.0, 0.0
    # FSDP units every microbatch: without a pipeline its gradients are reduce-scattered
    # (under one, or with `reduce_once`, once per step: `deferred`) behind its backward;
    # resharding after forward also gathers each unit before its forward (behind the
    # forward) and again before its backward (behind the backward); without resharding the
    # parameters are gathered once per step (`dp_time`)
    rs = NO_BUCKETS if deferred_reduce(s) else s.dpc.f_rs
    ag = s.dpc.f_ag if tr.zero_stage >= 3 and tr.reshard_after_forward else NO_BUCKETS
    bwd = rs + ag
    if not run.overlap.dp:
        return ag.total + bwd.total, 0.0
    e_f, e_b = buckets_exposed(ag, F), buckets_exposed(bwd, B)
    return (comm_cost(ag.total, e_f, s.k_dp) + comm_cost(bwd.total, e_b, s.k_dp),
            ag.total - e_f + bwd.total - e_b)


def accumulates_whole(run) -> bool:
    """Whether sharded (ZeRO 2-3) gradients accumulate whole over a step and reduce once:
    under a pipeline (torch.distributed.pipelining), and in myria's trainer
    (`training.reduce_once`) over several microbatches (one reduces as it goes)."""
    return run.parallel.pp > 1 or (run.training.reduce_once and run.microbatches > 1)


def deferred_reduce(s) -> bool:
    """The gradient reduce-scatter waits for the step's last backward (`accumulates_whole`),
    in the analytic model (the eager CPU runtime is priced from measurements)."""
    return accumulates_whole(s.run) and s.run.training.zero_stage >= 2 and not s.eager


def dp_time(s, F0: float, B0: float, hidden: list) -> float:
    """Data-parallel communication after (or overlapped with) the pipeline; the seconds it
    hides are appended to `hidden`."""
    run, dpc, k_dp = s.run, s.dpc, s.k_dp
    tr, par, ov = run.training, run.parallel, run.overlap
    dp, cp, ep, pp, v = run.dp, par.cp, par.ep, par.pp, par.vpp

    def step_cost(t: float, exposed: float) -> float:
        hidden.append(max(0.0, t - exposed))
        return comm_cost(t, exposed, k_dp)

    def behind(b: Buckets, t_hide: float) -> float:
        return step_cost(b.total, grad_reduce_exposed(b, t_hide, pp, v)) if ov.dp \
            else b.total

    if dp * cp <= 1 and ep <= 1:
        t_dp = 0.0
    elif tr.zero_stage == 0:
        t_dp = behind(dpc.b_ar, B0) if ov.dp else dpc.t_grad
    elif tr.zero_stage == 1 or (tr.zero_stage == 2 and s.eager):
        # whole gradients accumulate over the microbatches: one reduce-scatter per step, then
        # the updated shards are all-gathered (myria's eager "zero2" is FSDP2 without
        # resharding after forward under no_sync: gradients accumulate whole, as here)
        t_dp = behind(dpc.b_rs, B0) + behind(dpc.b_ag, F0) if ov.dp else dpc.t_rs + dpc.t_ag
    elif tr.zero_stage == 2 or (tr.zero_stage >= 3 and not tr.reshard_after_forward
                                and not s.eager):
        # gradients were reduce-scattered per microbatch (`stage_zero`); the updated
        # parameter shards are all-gathered once per step, unit by unit, behind the first
        # forward (ZeRO-2, FSDP without resharding)
        t_dp = behind(dpc.f_ag, F0)
    elif s.eager:
        t_dp = eager_fsdp_reduce(s)
    else:
        t_dp = 0.0  # ZeRO-3 traffic is charged per microbatch (`stage_zero`)
    if deferred_reduce(s) and dp * cp > 1:
        # each stage's accumulated gradients, reduce-scattered after its last backward (the
        # interleaved chunks' during the remaining chunks' backward)
        t_dp += behind(dpc.f_rs, B0)
    if dpc.t_rep:  # HSDP: the replicas all-reduce their gradient shards after the last backward
        t_dp += step_cost(dpc.t_rep, max(dpc.t_rep / dpc.f_rs.n, dpc.t_rep - B0)) if ov.dp \
            else dpc.t_rep
    if pp > 1 and s.cfg.tie_embeddings and not ov.dp:
        # the tied embedding's gradient is summed between the first and last stage
        emb = s.cfg.vocab_size * s.cfg.hidden / par.tp * GRAD_BYTES
        t_dp += coll.allreduce(emb, coll.make_group(s.hw, 2, par.tp * cp * dp * (pp - 1)))[0]
    return t_dp


def eager_fsdp_reduce(s) -> float:
    """myria's eager FSDP2 (ZeRO-3) gradient reduction once per step, under no_sync."""
    hw, dpc, par = s.hw, s.dpc, s.run.parallel
    if fsdp_context(hw.cpu, s.groups["dp"], par.pp):
        _, block_rs, _, ends_rs = fsdp_context(hw.cpu, s.groups["dp"], par.pp)
        return s.n_layers[s.kinds[0][0]] * block_rs + ends_rs
    if hw.cpu is not None and hw.cpu.fsdp and s.groups["dp"].k <= 1:
        # each unit reduce-scatters its accumulated gradients once per step (the last
        # microbatch), as timed on this machine per unit
        nl0 = s.n_layers[s.kinds[0][0]]
        block = sum(stage_params(s.shape, 1, False, False, par.ep))
        root = dpc.dense0 + dpc.expert0 - nl0 * block
        return nl0 * hw.cpu.fsdp_time(block * GRAD_BYTES, "reduce") + \
            (hw.cpu.fsdp_time(root * GRAD_BYTES, "reduce") if root > 0 else 0.0)
    # one reduce-scatter of the accumulated gradients, after chunk_cat copies them into the
    # reduce-scatter input (read + write, fp32)
    return dpc.t_rs + 2 * (dpc.dense0 + dpc.expert0) * GRAD_BYTES / (hw.mem_bw * s.eff.mem)


def fsdp_context(cpu, grp, pp: int) -> tuple:
    """FSDP2 measured around this model's own block and ends (`cpu._fsdp_in_context`), when it
    applies: one host, no pipeline. Empty otherwise."""
    return cpu.fsdp_context if cpu is not None and grp.k <= 1 and pp == 1 else ()


def fsdp2_microbatch(shape: LayerShape, n_layers: float, first: bool, last: bool, pp: int,
                      ep: int, w_b: int, groups: dict, mem_rate: float, cpu=None) -> float:
    """FSDP2 traffic of one microbatch on one rank (myria's `apply_fsdp`, no overlap on CPU).

    Every block is all-gathered for its forward and again for its backward (resharded after
    forward); the root module (embeddings, final norm, head) once per microbatch when pp = 1
    (kept unsharded until its backward), twice under pipelining. Each all-gather copies the
    local shard in and the gathered parameters out (torch's foreach_all_gather and
    split_with_sizes_copy: read + write each); on a measured CPU FSDP2 itself is timed per unit
    (`cpu._fsdp_unit_points`: gathers, copies and hooks of a block or the root).
    """
    from myria.sim.memory import stage_params

    grp = groups["dp"]
    n = max(1, grp.n)
    if fsdp_context(cpu, grp, pp):
        block_mb, _, ends_mb, _ = fsdp_context(cpu, grp, pp)
        return n_layers * block_mb + (ends_mb if first or last else 0.0)
    blocks = sum(stage_params(shape, n_layers, False, False, ep))
    root = sum(stage_params(shape, n_layers, first, last, ep)) - blocks
    per_block = blocks / max(1.0, n_layers)
    root_kind = "root" if pp == 1 else "block"   # myria reshards the root only under pp
    t = 0.0
    for params, units, kind in ((per_block, n_layers, "block"), (root, 1 if root else 0,
                                                                 root_kind)):
        if not units:
            continue
        measured = cpu.fsdp_time(params * w_b, kind) if cpu is not None and grp.k <= 1 \
            else None
        if measured is not None:
            # FSDP2 timed on this machine per unit and microbatch (gathers, copies, hooks)
            t += units * measured
        else:
            gathers = 2 if kind == "block" else 1
            ag = coll.all_gather(params * w_b, grp)[0]
            t += units * gathers * (ag + 2 * params * w_b * (1 + 1 / n) / mem_rate)
    return t
