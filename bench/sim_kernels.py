"""Attention kernels of the performance model against their published microbenchmarks.

    .venv/bin/python bench/sim_kernels.py

For every table of src/myria/sim/data/kernel_benchmarks.toml (FlashAttention-3 paper, H100):
the model's FlashAttention rate (whose two constants per direction come from these tables,
hardware.FLASH_ATTENTION) and its unfused-attention rate (nothing fitted: GEMMs on the roofline
plus the softmax's memory passes) beside the published figures, as executed TFLOP/s (a causal
unfused kernel computes every score: twice the causal count it is published with). Writes
bench/results/sim_kernels.json.
"""

from __future__ import annotations

import json
import platform
import sys
import time
from pathlib import Path

from myria.sim.calibration import FLASH_KERNEL, attention_tflops, kernel_tables
from myria.sim.hardware import FLASH_GENERATION

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
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps({"command": "bench/sim_kernels.py", "date": time.strftime(
        "%Y-%m-%d"), "machine": f"{platform.machine()} CPU, {platform.python_version()} (the "
        "model is analytic: no GPU involved)", "mean_abs_error_from_1k": summary, "rows": rs},
        indent=1))
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
