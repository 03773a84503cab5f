"""Operator times: each operator's roofline (its FLOPs at the device's GEMM or attention rate,
its bytes at the memory bandwidth, plus the launch overhead) or, on a measured device, the rate
measured for its shape; a layer's and the head's operators timed once per shape."""

from __future__ import annotations

import dataclasses
import math
from functools import lru_cache

from myria.sim.operators import Efficiency, LayerShape, Op, head_ops, layer_ops


def shape_factor(dims: tuple, half_dim: float) -> float:
    """Share of a GEMM kernel's time doing useful work: prod d / (d + half_dim)."""
    f = 1.0
    for d in dims:
        f *= d / (d + half_dim) if d > 0 else 0.0
    return f


def flash_efficiency(op: Op, eff: Efficiency) -> float:
    """Achieved fraction of the dense peak of a FlashAttention kernel (`Efficiency.flash`):
    r_inf * s / (s + s_half) along the key length, times the head-dimension factor."""
    from myria.sim.hardware import FLASH_HEAD_DIM_HALF as c

    s_q, s_kv, hd = op.dims
    i = 0 if op.phase == "fwd" else 1
    r = eff.flash[i] * s_kv / (s_kv + eff.flash_half_seq[i])
    return r * min(1.0, hd / (hd + c) / (128 / (128 + c)))


def rate_key(op: Op) -> tuple:
    """Key of an op in a measured rate table: (layout, M, N, K) or (attn-*, batch, s_q, s_kv,
    head_dim, query heads per key/value head); ("bw", layout) for memory-bound kernels (their
    achieved bytes/s)."""
    if op.kind == "mem":
        return ("bw", op.layout)
    if op.kind == "host":
        return ("host", op.layout)
    if op.kind == "attn":
        return (op.layout or f"attn-{op.phase}", int(op.batch),
                *(int(d) for d in op.dims), int(op.gqa))
    layout = op.layout or ("tn" if op.wgrad else "nn" if op.name.endswith(".dgrad") else "nt")
    return (layout, *(int(d) for d in op.dims))


@lru_cache(maxsize=64)
def _rate_index(rates: tuple) -> dict:
    return dict(rates)


def measured_rate(op: Op, rates: tuple) -> float | None:
    """Achieved FLOP/s of `op` from a measured table: its own shape, else an interpolation.

    Shapes not measured take the inverse-square-distance mean (in log2 of the dimensions) of
    the four nearest measured shapes of the same layout (of any GEMM layout if none).
    """
    if not rates:
        return None
    key = rate_key(op)
    index = _rate_index(rates)
    if key in index:
        return index[key]
    if key[0] in ("bw", "host"):
        return None
    if op.kind == "gemm" and (key[0], key[2], key[1], key[3]) in index:
        # the same product with M and N swapped: autograd picks either orientation for a
        # weight gradient (x^T dy or dy^T x), at the same cost
        return index[(key[0], key[2], key[1], key[3])]
    same = [(k, r) for k, r in rates if k[0] == key[0] and len(k) == len(key)]
    if not same and op.kind == "gemm":
        same = [(k, r) for k, r in rates if len(k) == 4 and not k[0].startswith("attn")]
    if not same:
        return None
    logs = [math.log2(max(1.0, float(d))) for d in key[1:]]

    def dist(k: tuple) -> float:
        return sum((a - math.log2(max(1.0, float(b)))) ** 2 for a, b in zip(logs, k[1:]))

    near = sorted(same, key=lambda kr: dist(kr[0]))[:4]
    w = [1.0 / (dist(k) + 1e-3) for k, _ in near]
    return sum(wi * r for wi, (_, r) in zip(w, near)) / sum(w)


def op_time(op: Op, peak_flops: float, mem_bw: float, eff: Efficiency) -> tuple[float, str]:
    """Roofline time of a compute op on one device, and whether it is compute- or memory-bound.

    On a measured device (`eff.rates`) GEMMs and attention take their measured rate for their
    shape: the measurement already holds whatever memory traffic the kernel needs.
    """
    if op.kind == "host":   # measured seconds of Python/autograd time per pass (CPU, eager)
        return (measured_rate(op, eff.rates) or 0.0), "host"
    overhead = eff.kernel_overhead_s * op.kernels
    bw = (measured_rate(op, eff.rates) if op.kind == "mem" and op.layout else None) or \
        mem_bw * (next((f for c, f in eff.mem_eager if c == op.eager), eff.mem)
                  if op.eager else eff.mem)
    t_mem = op.bytes / bw
    if op.kind in ("gemm", "attn"):
        rate = measured_rate(op, eff.rates)
        if rate:
            return op.flops / rate + overhead, "compute"
        if op.kind == "attn" and eff.flash:
            kappa = flash_efficiency(op, eff)
        else:
            kappa = eff.gemm * shape_factor(op.dims, eff.half_dim)
        t_cmp = op.flops / (peak_flops * kappa) if kappa > 0 else float("inf")
        if t_cmp >= t_mem:
            return t_cmp + overhead, "compute"
        return t_mem + overhead, "memory"
    return t_mem + overhead, "memory"


def split_gemm_time(op: Op, pieces: int, peak_flops: float, mem_bw: float, eff: Efficiency
                    ) -> float:
    """Time of GEMM `op` cut into `pieces` along its token dimension (M of a forward or data
    gradient, K of a weight gradient), as tensor-parallel overlap runs it so that each piece's
    collective can start while the next computes: each piece priced by the same roofline (its
    shorter dimension runs at the lower efficiency of `shape_factor`, or its measured rate),
    reads the whole weight again and pays its own launch."""
    if pieces <= 1 or op.kind != "gemm":
        return op.time
    m, n, k = op.dims
    whole = m * k + k * n + m * n
    i = 2 if op.wgrad else 0
    dims = list(op.dims)
    dims[i] = dims[i] / pieces
    pm, pn, pk = dims
    e = op.bytes / whole if whole else 0.0
    piece = dataclasses.replace(op, flops=op.flops / pieces, dims=tuple(dims),
                                bytes=e * (pm * pk + pk * pn + pm * pn), time=0.0)
    return pieces * op_time(piece, peak_flops, mem_bw, eff)[0]


def ring_attention_time(op: Op, pieces: int, peak_flops: float, mem_bw: float,
                        eff: Efficiency) -> float:
    """Time of attention kernel `op` run as ring attention runs it under context parallelism:
    one kernel per key/value block that arrives around the ring (`pieces` = cp), each over
    s_kv / cp keys, so at FlashAttention's lower rate for the shorter key length
    (`flash_efficiency`, or the measured rate of that shape), with its own launch; each block
    reads the query-side tensors again (taken as half the whole kernel's traffic: Q, O, dO, dQ
    against K, V, dK, dV) and its share of the key/value side."""
    if pieces <= 1 or op.kind != "attn":
        return op.time
    s_q, s_kv, hd = op.dims
    piece = dataclasses.replace(op, flops=op.flops / pieces, dims=(s_q, s_kv / pieces, hd),
                                bytes=op.bytes / 2 + op.bytes / (2 * pieces), time=0.0)
    return pieces * op_time(piece, peak_flops, mem_bw, eff)[0]


@lru_cache(maxsize=65536)
def timed_layer_ops(shape: LayerShape, peak_flops: float, mem_bw: float, eff: Efficiency
                    ) -> tuple[Op, ...]:
    """`layer_ops` with each compute op's roofline time filled in (comm ops left at 0)."""
    ops = layer_ops(shape)
    for op in ops:
        if op.kind != "comm":
            op.time, op.bound = op_time(op, peak_flops, mem_bw, eff)
    return tuple(ops)


@lru_cache(maxsize=4096)
def timed_head_ops(shape: LayerShape, first: bool, last: bool, peak_flops: float,
                   mem_bw: float, eff: Efficiency) -> tuple[Op, ...]:
    """`head_ops` with roofline times."""
    ops = head_ops(shape, first, last)
    for op in ops:
        if op.kind != "comm":
            op.time, op.bound = op_time(op, peak_flops, mem_bw, eff)
    return tuple(ops)
