"""Per-layer and head sums of timed operators (`Phase`): one microbatch's forward, backward and
weight-gradient seconds of a layer (or the embedding and output layer) by category, with each
TP, CP and EP collective's exposed part and the cost of the kernels it cuts into pieces. The
rules: docs/performance_model.md, "Step model (`perf.py`)".
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

from myria.sim import collectives as coll
from myria.sim.collectives import layout_groups
from myria.sim.hardware import Hardware
from myria.sim.op_timing import (
    ring_attention_time,
    split_gemm_time,
    timed_head_ops,
    timed_layer_ops,
)
from myria.sim.operators import Efficiency, LayerShape, Op
from myria.sim.overlap import chunked_exposed, comm_cost, overlap_interference


@dataclass
class Phase:
    """Per-layer (or head) sums for one microbatch."""

    fwd: float = 0.0
    bwd: float = 0.0
    wgrad: float = 0.0
    attn_core_fwd: float = 0.0
    fwd_cat: dict = field(default_factory=dict)
    bwd_cat: dict = field(default_factory=dict)
    comm_detail: dict = field(default_factory=dict)


def split_costs(ops: tuple[Op, ...], overlap_tp: bool, tp: int, hw: Hardware,
                 eff: Efficiency, cp: int = 1) -> dict[str, float]:
    """Seconds each kernel loses when overlapped communication cuts it into pieces: a TP
    collective pipelined against the GEMM that consumes its gathered input (all-gather) or
    produces its scattered output (reduce-scatter) needs the GEMM cut along the tokens, one
    piece per chunk of the collective (`op_timing.split_gemm_time`; `tp_chunks`). A GEMM that
    a collective merely runs beside (bulk) is not cut; neither is a GEMM paired with a
    collective overlapped whether or not overlap.tp is set (`Op.always_overlap`). Context
    parallelism's ring hides its K/V exchange by running the FlashAttention kernels one key
    block at a time (`op_timing.ring_attention_time`), always."""
    out = {}
    if cp > 1:
        out = {op.name: ring_attention_time(op, cp, hw.peak_flops, hw.mem_bw, eff) - op.time
               for op in ops if op.kind == "attn" and op.attn_core}
    if not overlap_tp or tp <= 1:
        return out
    cut = {op.pair: tp_chunks(op, tp) for op in ops
           if op.kind == "comm" and op.group == "tp" and op.pair and not op.always_overlap
           and tp_chunks(op, tp) > 1}
    out.update({op.name: split_gemm_time(op, cut[op.name], hw.peak_flops, hw.mem_bw, eff)
                - op.time for op in ops if op.name in cut and op.kind == "gemm"})
    return out


def tp_chunks(op: Op, tp: int) -> int:
    """Pieces a TP collective is cut into under overlap.tp (`Op.chunks`: ring exchange = tp)."""
    return tp if op.chunks == 0 else op.chunks


def sum_ops(ops: tuple[Op, ...], overlap_tp: bool, tp: int, cp: int,
             groups: dict[str, coll.Group], hw: Hardware,
             split: dict[str, float] | None = None) -> Phase:
    ph = Phase()
    split = split or {}
    by_name = {op.name: op.time for op in ops if op.kind != "comm"}
    busy = sum(o.time for o in ops if o.kind != "comm") or 1.0
    mem_share = sum(o.time for o in ops if o.kind != "comm" and o.category == "memory") / busy
    attn_time = {ph: sum(o.time + split.get(o.name, 0.0) for o in ops
                         if o.attn_core and o.phase == ph) for ph in ("fwd", "bwd")}
    for op in ops:
        cat = op.category
        if op.kind == "comm":
            fn = coll.COLLECTIVES[op.coll]
            t, algo = fn(op.bytes, groups[op.group])
            if op.group == "tp":
                hide = by_name.get(op.pair, 0.0)
                if op.always_overlap or (overlap_tp and op.pair and tp_chunks(op, tp) == 1):
                    exposed = max(0.0, t - hide)   # beside an independent GEMM (bulk)
                elif overlap_tp and op.pair:
                    exposed = chunked_exposed(t, tp_chunks(op, tp), hide)
                else:
                    exposed = t
            elif op.group == "cp":
                exposed = max(0.0, t - (cp - 1) / cp * attn_time[op.phase])
            else:
                exposed = t
            ph.comm_detail[op.group] = algo
            # TransformerEngine's ring exchange moves its chunks by copy engine (one SM)
            ring = overlap_tp and op.pair and op.chunks == 0 and not op.always_overlap
            val = comm_cost(t, exposed, overlap_interference(
                hw, round(mem_share, 2), groups[op.group], 1 if ring and op.group == "tp" else 0))
        else:
            val = op.time + split.get(op.name, 0.0)
            if op.wgrad:
                ph.wgrad += val
            if op.attn_core and op.phase == "fwd":
                ph.attn_core_fwd += val
        if op.phase == "fwd":
            ph.fwd += val
            ph.fwd_cat[cat] = ph.fwd_cat.get(cat, 0.0) + val
        else:
            ph.bwd += val
            ph.bwd_cat[cat] = ph.bwd_cat.get(cat, 0.0) + val
    return ph


@lru_cache(maxsize=16384)
def layer_summary(shape: LayerShape, hw: Hardware, eff: Efficiency, overlap_tp: bool,
                   groups_key: tuple) -> Phase:
    groups = layout_groups(hw, *groups_key)
    ops = timed_layer_ops(shape, hw.peak_flops, hw.mem_bw, eff)
    return sum_ops(ops, overlap_tp, shape.tp, shape.cp, groups, hw,
                    split_costs(ops, overlap_tp, shape.tp, hw, eff, shape.cp))


@lru_cache(maxsize=16384)
def head_summary(shape: LayerShape, first: bool, last: bool, hw: Hardware, eff: Efficiency,
                  overlap_tp: bool, groups_key: tuple) -> Phase:
    groups = layout_groups(hw, *groups_key)
    ops = timed_head_ops(shape, first, last, hw.peak_flops, hw.mem_bw, eff)
    return sum_ops(ops, overlap_tp, shape.tp, shape.cp, groups, hw,
                    split_costs(ops, overlap_tp, shape.tp, hw, eff, shape.cp))
