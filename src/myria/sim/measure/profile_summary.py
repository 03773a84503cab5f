"""What a model's CPU profile must hold (the GEMM and attention ops a model runs, those a profile
lacks) and a readable summary of a profile's figures."""

from __future__ import annotations

from dataclasses import dataclass, field

from myria.sim.cpu_profile import CpuProfile, key_str
from myria.sim.op_timing import rate_key
from myria.sim.operators import LayerShape, Op, head_ops, layer_ops


def shape_ops(shape: LayerShape, pp: int = 1) -> list[Op]:
    """Every GEMM and attention op a model of `shape` runs on any of `pp` pipeline stages."""
    ops = [op for op in layer_ops(shape) if op.kind in ("gemm", "attn")]
    ends = [(True, True)] if pp == 1 else [(True, False), (False, True)]
    for first, last in ends:
        ops += [op for op in head_ops(shape, first, last) if op.kind in ("gemm", "attn")]
    return ops


def missing_ops(shape: LayerShape, profile: CpuProfile | None, pp: int = 1) -> list[Op]:
    """Ops of `shape` whose exact rate is not in `profile` (one per key)."""
    have = {k for k, _ in profile.rates} if profile else set()
    have |= {(k[0], k[2], k[1], k[3]) for k in have if len(k) == 4}
    out: dict[tuple, Op] = {}
    for op in shape_ops(shape, pp):
        k = rate_key(op)
        if k not in have:
            out.setdefault(k, op)
    return list(out.values())


@dataclass
class Summary:
    """Human-readable view of a profile (for reports)."""

    threads: int
    gemm_gflops: dict = field(default_factory=dict)
    attn_gflops: dict = field(default_factory=dict)
    elementwise_gbs: float = 0.0
    eager_bw_gbs: dict = field(default_factory=dict)
    host_ms: dict = field(default_factory=dict)
    kernel_overhead_us: float = 0.0
    optimizer_ns_per_param: float = 0.0
    gloo: dict = field(default_factory=dict)
    fsdp_ms: dict = field(default_factory=dict)
    fsdp_context_ms: dict = field(default_factory=dict)


def summarize(profile: CpuProfile, shape: LayerShape | None = None, pp: int = 1) -> Summary:
    """Readable figures of `profile` (with `shape`: only the rates that model uses)."""
    keep = None
    if shape is not None:
        keep = {rate_key(op) for op in shape_ops(shape, pp)}
        keep |= {(k[0], k[2], k[1], k[3]) for k in keep if len(k) == 4}
        keep |= {("bw", "eltwise"), ("bw", "head"), ("host", "block"), ("host", "head")}
    s = Summary(threads=profile.threads,
                elementwise_gbs=profile.elementwise_bw / 1e9,
                kernel_overhead_us=profile.kernel_overhead_s * 1e6,
                optimizer_ns_per_param=profile.optimizer_s_per_param * 1e9)
    for k, r in profile.rates:
        if keep is not None and k not in keep:
            continue
        if k[0] == "bw":
            s.eager_bw_gbs[k[1]] = r / 1e9
        elif k[0] == "host":
            s.host_ms[k[1]] = r * 1e3
        else:
            (s.attn_gflops if k[0].startswith("attn") else s.gemm_gflops)[key_str(k)] = r / 1e9
    for op, a, b in profile.gloo:
        s.gloo[op] = {"alpha_us": a * 1e6, "bw_gbs": b / 1e9}
    if profile.fsdp_context:
        s.fsdp_context_ms = {k: round(t * 1e3, 2) for k, t in zip(
            ("block per microbatch", "block reduce per step", "ends per microbatch",
             "ends reduce per step"), profile.fsdp_context)}
    else:
        for nbytes, *ts in profile.fsdp:
            s.fsdp_ms[f"{nbytes / 2**20:.1f} MiB"] = {k: round(t * 1e3, 2) for k, t in
                                                       zip(("block", "root", "reduce"), ts)}
    return s
