"""An optimisation ladder priced from first principles (no training table used).

    PYTHONPATH=src .venv/bin/python bench/sim_ladder.py

MegaScale's 175B layout (src/myria/sim/data/expert_layouts.toml) on 256 A100 (tp 8, pp 8,
vpp 2, 256 sequences), starting from Megatron-style training without FlashAttention, fused
kernels or any overlap, then adding one technique at a time as MegaScale's section 3 lists
them. Prints each step's MFU and gain and the breakdown; every gain must be positive.
"""

from __future__ import annotations

import sys

from myria.sim import perf, runspec

STEPS = [("baseline", {}),
         ("+parallel block", {"model": {"parallel_block": True}}),
         ("+tp overlap", {"overlap": {"tp": True}}),
         ("+efficient operators (FlashAttention, fused)",
          {"kernels": {"flash_attention": True, "fused_ops": True}}),
         ("+pp/dp overlap", {"overlap": {"pp": True, "dp": True}}),
         ("+LAMB, batch x3", {"training": {"global_batch": 768, "optimizer": "lamb"}})]


def main() -> int:
    path = runspec.calibration_path().with_name("expert_layouts.toml")
    r = {x.name: x for x in runspec.load(path)}["megascale-175b"]
    cur = r.replace(cluster={"gpus": 256},
                    training={"global_batch": 256, "optimizer": "adam",
                              "recompute": "selective"},
                    parallel={"pp": 8, "tp": 8, "vpp": 2},
                    overlap={"tp": False, "pp": False, "dp": False},
                    kernels={"flash_attention": False, "fused_ops": False})
    prev = None
    for name, change in STEPS:
        if change:
            cur = cur.replace(**change)
        res = perf.simulate(cur)
        t = res.iteration_time_s
        gain = f"{res.mfu / prev - 1:+.1%}" if prev else ""
        big = ", ".join(f"{k} {v / t:.1%}" for k, v in res.breakdown.items() if v > 0.01 * t)
        print(f"{name:<46} MFU {res.mfu:.3f} {gain:>7}   {big}")
        prev = res.mfu
    return 0


if __name__ == "__main__":
    sys.exit(main())
