"""Per-rank step-time jitter of lock-step ranks, measured: the spread and the tail that
`overlap.sync_wait` prices.

    .venv/bin/python bench/sim_rank_jitter.py [--steps 60] [--nproc 4] [--reps 2]

Trains the tiny data-parallel model of bench/stragglers.py (no fault) on `--nproc` processes,
reads each rank's compute-only time per step from the event timer (`observe.analyze.step_table`:
waits excluded) and pairs the ranks by step, as the straggler detector does: x = log(compute of a
rank / median of the ranks at that step), so whatever slows every rank at once cancels. Reports
the core spread (1.4826 x MAD), how often and by how much a rank exceeds 3 core spreads (the
tail: share, mean excess in spreads), and the measured mean of each step's slowest rank against
what a normal law of the same spread predicts (E[max of N normals]). The first 3 steps (warm-up)
are dropped. Writes bench/results/sim_rank_jitter.json.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from stragglers import ROOT, TINY  # noqa: E402

OUT = ROOT / "bench" / "results" / "sim_rank_jitter.json"
WARMUP = 3


def ratios(run_dir: Path) -> tuple[list[float], list[float]]:
    """(every rank's log ratio to its step's median, each step's largest ratio)."""
    from myria.observe.analyze import load_run, step_table

    table = step_table(load_run(run_dir))
    steps = sorted(set.intersection(*(set(t) for t in table.values())))[WARMUP:]
    xs, tops = [], []
    for s in steps:
        comp = [table[r][s]["compute_s"] for r in table]
        med = statistics.median(comp)
        row = [math.log(c / med) for c in comp if c > 0 and med > 0]
        xs += row
        tops.append(max(row))
    return xs, tops


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--reps", type=int, default=2)
    a = ap.parse_args()
    from myria.sim.overlap import expected_max_normal

    tmp = Path(tempfile.mkdtemp(prefix="myria-bench-jitter-"))
    data = tmp / "tiny"
    xs: list[float] = []
    tops: list[float] = []
    t0 = time.time()
    load0 = os.getloadavg()[0]
    try:
        subprocess.run([sys.executable, "-m", "myria", "prepare", "--corpus", "demo",
                        "--max-docs", "20", "--vocab-size", "1024", "--out", str(data),
                        "--quiet"], check=True)
        env = {k: v for k, v in os.environ.items() if k != "MYRIA_FAULT"}
        for i in range(a.reps):
            run = tmp / f"run{i}"
            subprocess.run([sys.executable, "-m", "myria", "train", "--run-dir", str(run),
                            f"--data.path={data}", *TINY, f"--training.steps={a.steps}",
                            "--nproc", str(a.nproc)], cwd=ROOT, env=env, check=True,
                           capture_output=True)
            x, top = ratios(run)
            xs += x
            tops += top
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    med = statistics.median(xs)
    sigma = 1.4826 * statistics.median(abs(x - med) for x in xs)
    tail = [x / sigma - 3 for x in xs if x > 3 * sigma]
    res = {
        "command": "bench/sim_rank_jitter.py " + " ".join(sys.argv[1:]),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": f"{os.cpu_count()} cores {platform.machine()}, load average {load0:.1f} "
                   f"at start, {os.getloadavg()[0]:.1f} at end",
        "nproc": a.nproc, "steps_per_run": a.steps, "runs": a.reps, "samples": len(xs),
        "core_sigma": sigma, "std": statistics.pstdev(xs),
        "tail_share": len(tail) / len(xs),
        "tail_mean_excess_sigmas": statistics.mean(tail) if tail else 0.0,
        "slowest_rank_mean": statistics.mean(tops),
        "slowest_rank_normal_prediction": sigma * expected_max_normal(a.nproc),
        "wall_s": round(time.time() - t0),
    }
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(res, indent=1))
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
