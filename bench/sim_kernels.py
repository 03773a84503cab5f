"""Kernels of the performance model against their published microbenchmarks.

    .venv/bin/python bench/sim_kernels.py

Attention: for every attention table of src/myria/sim/data/kernel_benchmarks.toml
(FlashAttention-3 paper, H100): the model's FlashAttention rate (whose two constants per
direction come from these tables, hardware.FLASH_ATTENTION) and its unfused-attention rate
(nothing fitted: GEMMs on the roofline plus the softmax's memory passes) beside the published
figures, as executed TFLOP/s (a causal unfused kernel computes every score: twice the causal
count it is published with).

Memory-bound kernels: for every point of the memory tables (Liger-Kernel's benchmark data on
A100 and B200, QuACK's H100 figures; norms, RoPE, SwiGLU, softmax, cross-entropy), fused and
unfused, the model's time (bytes counted per implementation, read from the tables; E_MEM,
E_MEM_EAGER per operator class and the launch gap per kernel fitted to the same tables,
hardware.MEMORY_EFFICIENCY) beside the published one, the mean |error| per implementation, and
the published and modelled speedup of the fused kernel over the eager code at each size.
Writes bench/results/sim_kernels.json.
"""

from __future__ import annotations

import json
import platform
import sys
import time
from pathlib import Path

from myria.sim.calibration import (
    FLASH_KERNEL,
    attention_tflops,
    fit_memory_tables,
    kernel_tables,
    memory_kernel_time,
    memory_points,
)
from myria.sim.hardware import FLASH_GENERATION, KERNEL_LAUNCH_S, MEMORY_EFFICIENCY

OUT = Path(__file__).resolve().parent / "results" / "sim_kernels.json"


def rows() -> list[dict]:
    out = []
    for tab in kernel_tables():
        dev = tab["device"]
        flash_name = FLASH_KERNEL[FLASH_GENERATION[dev]]
        for kernel, flash in (("standard", False), (flash_name, True)):
            for s, pub in zip(tab["seq"], tab["tflops"][kernel]):
                executed = pub * (2 if tab["causal"] and not flash else 1)
                model = attention_tflops(dev, tab["direction"], s, flash, tab["head_dim"])
                out.append({"source": tab["source"], "device": dev, "kernel": kernel,
                            "direction": tab["direction"], "causal": tab["causal"], "seq": s,
                            "published_tflops": pub, "published_executed_tflops": executed,
                            "model_tflops": model, "error": model / executed - 1})
    return out


def memory_rows() -> list[dict]:
    out = []
    for p in memory_points():
        model = memory_kernel_time(p)
        out.append({**p, "model_s": model, "error": model / p["published_s"] - 1,
                    "published_gbs": p["bytes"] / p["published_s"] / 1e9,
                    "model_gbs": p["bytes"] / model / 1e9})
    return out


def speedups(rs: list[dict]) -> list[dict]:
    """Published and modelled time of the eager code over the fused kernel, per size."""
    out = []
    keyed = {}
    for r in rs:
        keyed.setdefault((r["source"], r["size"]), []).append(r)
    for (_, size), pair in keyed.items():
        fused = [r for r in pair if r["fused"]]
        eager = [r for r in pair if not r["fused"]]
        if len(fused) == 1 and len(eager) == 1:
            f, e = fused[0], eager[0]
            out.append({"outlier": f["outlier"] or e["outlier"],
                        "family": f["family"], "direction": f["direction"],
                        "device": f["device"], "size": size, "fused": f["impl"],
                        "published": e["published_s"] / f["published_s"],
                        "model": e["model_s"] / f["model_s"]})
    return out


def memory_report() -> dict:
    rs = memory_rows()
    fit = fit_memory_tables()
    print(f"\nmemory-bound kernels: model E_MEM {MEMORY_EFFICIENCY['fused']} (fused), "
          f"E_MEM_EAGER {MEMORY_EFFICIENCY['eager']}, {KERNEL_LAUNCH_S * 1e6:g} us per kernel")
    print(f"{'family':<22}{'dir':<5}{'device':<16}{'impl':<20}{'size':>8}{'published':>11}"
          f"{'model':>10}{'error':>8}{'pub GB/s':>10}")
    for r in rs:
        print(f"{r['family']:<22}{r['direction']:<5}{r['device'][:15]:<16}{r['impl']:<20}"
              f"{r['size']:>8}{r['published_s'] * 1e6:>9.1f}us{r['model_s'] * 1e6:>8.1f}us"
              f"{r['error']:>+8.1%}{r['published_gbs']:>10.0f}{'  *' if r['outlier'] else ''}")
    print("\nfitted per implementation (t = bytes / (bandwidth E) + c):")
    for i in fit["impls"]:
        c = f"{i['intercept_s'] * 1e6:6.1f} us" if i["intercept_s"] is not None else "     -   "
        print(f"  {i['family']:<22}{i['direction']:<5}{i['device'][:15]:<16}{i['impl']:<20}"
              f"E {i['e_mem']:.3f}  c {c}{'  * ' + i['outlier'] if i['outlier'] else ''}")
    eager = ", ".join(f"{k} {v:.3f}" for k, v in fit["eager"].items())
    print(f"medians: fused E {fit['fused']:.3f}; eager E {eager}; launch per kernel "
          f"{fit['overhead_fused_s'] * 1e6:.1f} us fused, {fit['overhead_eager_s'] * 1e6:.1f} "
          "us eager")
    print("* outlier: shown, not used in the medians nor in the mean errors below")
    by_impl = {}
    for r in rs:
        by_impl.setdefault(f"{r['family']} {r['direction']} {r['device']} {r['impl']}",
                           []).append(abs(r["error"]))
    summary = {k: sum(v) / len(v) for k, v in by_impl.items()}
    groups = {"fused": [abs(r["error"]) for r in rs if r["fused"] and not r["outlier"]],
              "eager": [abs(r["error"]) for r in rs if not r["fused"] and not r["outlier"]]}
    overall = {k: sum(v) / len(v) for k, v in groups.items()}
    print("mean |error| per implementation: " + "; ".join(f"{k} {v:.1%}" for k, v in
                                                          summary.items()))
    print(f"mean |error|: fused {overall['fused']:.1%} over {len(groups['fused'])} points, "
          f"eager {overall['eager']:.1%} over {len(groups['eager'])} points")
    sp = speedups(rs)
    print("\nspeedup of the fused kernel over the eager code (published / model):")
    for x in sp:
        print(f"  {x['family']:<14}{x['direction']:<5}{x['device'][:15]:<16}{x['size']:>8}"
              f"{x['published']:>7.2f}x{x['model']:>7.2f}x{'  *' if x['outlier'] else ''}")
    ratio_err = [abs(x["model"] / x["published"] - 1) for x in sp if not x["outlier"]]
    print(f"mean |error| of the speedup {sum(ratio_err) / len(ratio_err):.1%} over "
          f"{len(ratio_err)} sizes (outliers left out)")
    return {"fit": {k: v for k, v in fit.items()},
            "model_constants": {"mem": MEMORY_EFFICIENCY["fused"],
                                "mem_eager": MEMORY_EFFICIENCY["eager"],
                                "kernel_overhead_s": KERNEL_LAUNCH_S},
            "read": "published times and throughputs; bytes per element counted from each "
                    "implementation's operations (comments in kernel_benchmarks.toml)",
            "fitted": "E_MEM (median of the fused implementations), E_MEM_EAGER per class "
                      "(median of the eager ones), launch per eager kernel (median intercept "
                      "per kernel): all from these tables",
            "mean_abs_error_per_impl": summary, "mean_abs_error": overall,
            "speedups": sp, "mean_abs_speedup_error": sum(ratio_err) / len(ratio_err),
            "rows": rs}


def main() -> int:
    rs = rows()
    print(f"{'kernel':<20}{'dir':<5}{'mask':<8}{'seq':>7}{'published':>11}{'model':>9}"
          f"{'error':>8}")
    for r in rs:
        print(f"{r['kernel']:<20}{r['direction']:<5}{'causal' if r['causal'] else 'none':<8}"
              f"{r['seq']:>7}{r['published_executed_tflops']:>11.0f}{r['model_tflops']:>9.0f}"
              f"{r['error']:>+8.1%}")
    summary = {}
    for kernel in sorted({r["kernel"] for r in rs}):
        errs = [abs(r["error"]) for r in rs if r["kernel"] == kernel and r["seq"] >= 1024
                and (r["causal"] or r["direction"] == "bwd")]
        summary[kernel] = sum(errs) / len(errs)
        print(f"{kernel}: mean |error| {summary[kernel]:.1%} over {len(errs)} points "
              "(sequences >= 1k; forward with the causal mask a decoder runs, backward as "
              "published without)")
    memory = memory_report()
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps({"command": "bench/sim_kernels.py", "date": time.strftime(
        "%Y-%m-%d"), "machine": f"{platform.machine()} CPU, {platform.python_version()} (the "
        "model is analytic: no GPU involved)", "mean_abs_error_from_1k": summary, "rows": rs,
        "memory": memory}, indent=1))
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
