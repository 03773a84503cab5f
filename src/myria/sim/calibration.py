"""Calibration of the performance model: error on the published runs, the one fitted constant,
and the model's own uncertainty estimated by leave-one-out cross-validation.

The calibration set is Narayanan et al. 2021, Table 1 (`data/calibration_runs.toml`). Only
E_GEMM is fitted on it. `loo_errors` refits E_GEMM on all rows but one and predicts the one
left out, for each row: the spread of those held-out errors is what the planner reports as the
uncertainty of a prediction (`uncertainty()`, stored in `data/uncertainty.json` by
`bench/sim_calibration.py --cv`).
"""

from __future__ import annotations

import dataclasses
import statistics
from pathlib import Path

from myria.sim.operators import Efficiency
from myria.sim.perf import simulate


def errors(runs, hws, eff: Efficiency) -> list[float]:
    """Relative iteration-time error (predicted / measured - 1) of each run."""
    return [simulate(r, hw=h, eff=eff).iteration_time_s / r.measured["iteration_time_s"] - 1
            for r, h in zip(runs, hws)]


def mae(errs: list[float]) -> float:
    return sum(abs(e) for e in errs) / len(errs)


def fit_gemm(runs, hws, base: Efficiency, lo: float = 0.40, hi: float = 1.0,
             step: float = 0.0025) -> tuple[float, float]:
    """Grid search of E_GEMM (the only fitted constant) minimising the MAE; (E_GEMM, MAE)."""
    best = (float("inf"), base.gemm)
    g = lo
    while g <= hi + 1e-12:
        m = mae(errors(runs, hws, dataclasses.replace(base, gemm=round(g, 4))))
        best = min(best, (m, round(g, 4)))
        g += step
    return best[1], best[0]


def loo_errors(runs, hws, base: Efficiency, step: float = 0.005) -> list[float]:
    """Held-out error of each run with E_GEMM refitted on the others."""
    out = []
    for i in range(len(runs)):
        rest = [r for j, r in enumerate(runs) if j != i]
        rest_hw = [h for j, h in enumerate(hws) if j != i]
        g, _ = fit_gemm(rest, rest_hw, base, step=step)
        out.append(errors([runs[i]], [hws[i]], dataclasses.replace(base, gemm=g))[0])
    return out


# -- kernel microbenchmarks ----------------------------------------------------------------------
KERNEL_BENCHMARKS = Path(__file__).resolve().parent / "data" / "kernel_benchmarks.toml"
FLASH_KERNEL = {"hopper": "flash-attention-3", "ampere": "flash-attention-2"}


def kernel_tables(kind: str = "attention") -> list[dict]:
    """The published kernel tables of one kind (data/kernel_benchmarks.toml): "attention"
    (the tables without a kind) or "memory" (norms, activations, RoPE, softmax, loss)."""
    import tomllib

    return [t for t in tomllib.loads(KERNEL_BENCHMARKS.read_text())["table"]
            if t.get("kind", "attention") == kind]


def memory_points() -> list[dict]:
    """Every published point of the memory-bound kernel tables, one dict per (table,
    implementation, size): bytes moved, kernels, the device's datasheet bandwidth (bytes/s) and
    the published time of one call in seconds (from `ms`, or from `gbs` as the source counts
    it)."""
    out = []
    for tab in kernel_tables("memory"):
        bw = tab["bandwidth_gbs"] * 1e9
        for imp in tab["impl"]:
            sizes = imp.get("sizes", tab["sizes"])
            for i, size in enumerate(sizes):
                n = tab["elements_per_size"] * size
                nbytes = imp["bytes_per_element"] * n
                if "ms" in imp:
                    t = imp["ms"][i] * 1e-3
                else:
                    t = tab["gbs_bytes_per_element"] * n / (imp["gbs"][i] * 1e9)
                out.append({"family": tab["family"], "op_class": tab["op_class"],
                            "direction": tab["direction"],
                            "device": tab["device"], "source": tab["source"],
                            "impl": imp["name"], "fused": imp["fused"], "size": size,
                            "outlier": imp.get("outlier", ""),
                            "elements": n, "bytes": nbytes, "kernels": imp["kernels"],
                            "bandwidth": bw, "timed": "ms" in imp, "published_s": t})
    return out


def fit_memory_tables() -> dict:
    """The achievable fractions of HBM bandwidth, fitted to the memory-bound kernel tables.

    Per implementation of a table: with x = bytes / datasheet bandwidth (the time at peak), the
    least-squares line t = x / E + c over its sizes gives its bandwidth fraction E and its fixed
    time per call c (timed tables with three sizes or more); a table of throughputs gives E
    point by point (its mean) and no c. E_MEM is the median E of the fused implementations;
    E_MEM_EAGER, per class of operator (`op_class`: norm, rope, softmax, pointwise), the median
    E of the unfused (eager PyTorch) implementations of that class, and "all" over every one;
    the launch overhead of a kernel is the median of c / kernels per call over each group.
    Implementations marked `outlier` in the tables are fitted but left out of the medians.
    """
    groups: dict[tuple, list[dict]] = {}
    for p in memory_points():
        groups.setdefault((p["source"], p["impl"]), []).append(p)
    impls = []
    for (_, name), pts in groups.items():
        xs = [p["bytes"] / p["bandwidth"] for p in pts]
        ts = [p["published_s"] for p in pts]
        c = None
        if pts[0]["timed"] and len(pts) >= 3:
            slope, c = statistics.linear_regression(xs, ts)
            e = 1.0 / slope
        else:
            e = sum(x / t for x, t in zip(xs, ts)) / len(xs)
        impls.append({"family": pts[0]["family"], "op_class": pts[0]["op_class"],
                      "direction": pts[0]["direction"],
                      "device": pts[0]["device"], "impl": name, "fused": pts[0]["fused"],
                      "kernels": pts[0]["kernels"], "e_mem": e, "intercept_s": c,
                      "outlier": pts[0]["outlier"]})

    def med(fused: bool, key: str, op_class: str = "") -> float:
        vals = [(i[key] / i["kernels"] if key == "intercept_s" else i[key]) for i in impls
                if i["fused"] == fused and i[key] is not None and not i["outlier"]
                and i["op_class"] == (op_class or i["op_class"])]
        return statistics.median(vals)

    classes = sorted({i["op_class"] for i in impls if not i["fused"]})
    return {"impls": impls, "fused": med(True, "e_mem"),
            "eager": {"all": med(False, "e_mem"),
                      **{c: med(False, "e_mem", c) for c in classes}},
            "overhead_fused_s": med(True, "intercept_s"),
            "overhead_eager_s": med(False, "intercept_s")}


def attention_tflops(device: str, direction: str, seq: int, flash: bool,
                     head_dim: int = 128, hidden: int = 2048, version: str = "auto") -> float:
    """The model's attention-kernel rate in the setting of the published microbenchmarks
    (batch x seq = 16k tokens, `hidden` split in heads of `head_dim`): TFLOP/s of the FLOPs the
    kernels execute (FlashAttention: the causal half; unfused attention: every score), forward
    or backward (2.5x the forward FLOPs), from the operators' roofline times; `version` is the
    FlashAttention's (`kernels.flash_version`)."""
    from myria.config import ModelConfig
    from myria.sim.hardware import build_hardware
    from myria.sim.op_timing import timed_layer_ops
    from myria.sim.operators import layer_shape
    from myria.sim.perf import efficiency_for
    from myria.sim.runspec import ClusterSpec

    hw = build_hardware(ClusterSpec(gpu=device, gpus=8), "bf16")
    b = max(1, 16384 // seq)
    cfg = ModelConfig(arch="gpt", layers=1, hidden=hidden, heads=hidden // head_dim,
                      seq_len=seq, vocab_size=1024)
    shape = layer_shape(cfg, b, flash=flash, fused=False, dropout=0.0)
    ops = timed_layer_ops(shape, hw.peak_flops, hw.mem_bw, efficiency_for(hw, version))
    t = sum(o.time for o in ops if o.attn_core and o.phase == direction)
    flops = 4 * b * seq * seq * hidden * (0.5 if flash else 1.0) * \
        (2.5 if direction == "bwd" else 1.0)
    return flops / t / 1e12


def memory_kernel_time(point: dict, eff: Efficiency | None = None) -> float:
    """The model's time for one published memory-bound kernel call (a `memory_points` entry):
    the operator's bytes at E_MEM (fused) or at E_MEM_EAGER of its class (eager) of the
    device's datasheet bandwidth, plus the launch gap of each kernel, as `op_time` prices every
    memory-bound operator of a layer."""
    from myria.sim.op_timing import op_time
    from myria.sim.operators import DEFAULT_EFFICIENCY, Op

    op = Op(point["family"], "mem", point["direction"], bytes=point["bytes"],
            kernels=point["kernels"], eager="" if point["fused"] else point["op_class"])
    return op_time(op, 1.0, point["bandwidth"], eff or DEFAULT_EFFICIENCY)[0]
