"""`myria simulate-network` as a user runs it: NCCL's collectives on a 1,024-GPU non-blocking
fat-tree and the 12,288-GPU MegaScale case (<= 60 s), each through the CLI in its
own process (imports included in the wall time).

    PYTHONPATH=src .venv/bin/python bench/network_nccl.py [--label after]

Only flags that every version of the CLI accepts are passed, so the same script measures the
code before and after a change (point PYTHONPATH at the other tree). Writes
bench/results/network_nccl-LABEL.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

OUT = Path(__file__).resolve().parent / "results"
# the 3-tier fabric its RESULTS rows were measured on (fat-tree is the planner's 2-tier one)
FAT = ["--topology", "fat-tree-3tier-k32", "--gpus", "1024", "--collective", "all-reduce"]
CASES = [
    ("ring 1G adaptive", FAT + ["--bytes", "1G", "--algorithm", "ring", "--routing", "adaptive"]),
    ("ring 1G ecmp", FAT + ["--bytes", "1G", "--algorithm", "ring", "--routing", "ecmp"]),
    ("defaults 1G adaptive", FAT + ["--bytes", "1G", "--routing", "adaptive"]),
    ("defaults 1G ecmp", FAT + ["--bytes", "1G", "--routing", "ecmp"]),
    ("ring 8G adaptive", FAT + ["--bytes", "8G", "--algorithm", "ring", "--routing", "adaptive"]),
    ("ring 8G ecmp", FAT + ["--bytes", "8G", "--algorithm", "ring", "--routing", "ecmp"]),
    ("tree 1G ecmp", FAT + ["--bytes", "1G", "--algorithm", "tree", "--routing", "ecmp"]),
    ("megascale 12,288 two-stage ecmp", ["--topology", "megascale", "--gpus", "12288",
                                         "--collective", "all-reduce", "--bytes", "1G",
                                         "--algorithm", "two-stage-ring", "--routing", "ecmp"]),
]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--label", default="after")
    label = ap.parse_args().label
    rows = []
    for name, argv in CASES:
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "myria", "simulate-network", *argv,
                               "--json"], capture_output=True, text=True, env=os.environ)
        wall = time.perf_counter() - t0
        if proc.returncode:
            print(f"{name}: exit {proc.returncode}: {proc.stderr.strip()}")
            continue
        out = json.loads(proc.stdout)
        row = {"case": name, "command": "myria simulate-network " + " ".join(argv),
               "algorithm": out["algorithm"], "protocol": out.get("protocol", "simple"),
               "busbw_gbs": out["busbw_gbs"],
               "ideal_busbw_gbs": out["ideal_busbw_gbs"],
               "of_ideal": out["busbw_gbs"] / out["ideal_busbw_gbs"],
               "fabric_efficiency": out["fabric_efficiency"], "flows": out["flows"],
               "completion_ms": out["completion_time_s"] * 1e3, "wall_s": wall}
        rows.append(row)
        print(f"{name:<34} {row['algorithm']:<15} busbw {row['busbw_gbs']:6.1f} / "
              f"{row['ideal_busbw_gbs']:6.1f} GB/s ({row['of_ideal']:6.1%}), fabric eff "
              f"{row['fabric_efficiency']:6.1%}, {row['flows']:>9,} flows, wall {wall:5.2f} s",
              flush=True)
    OUT.mkdir(parents=True, exist_ok=True)
    path = OUT / f"network_nccl-{label}.json"
    path.write_text(json.dumps({
        "label": label, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": f"{platform.machine()} {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}",
        "python": sys.version.split()[0], "rows": rows}, indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
