"""Cost of issue 10's checks on the demo model: replica checksums, the numerical guard,
synchronised garbage collection, and the straggler detector.

    .venv/bin/python bench/integrity.py [--steps 24] [--nproc 2]

Trains the demo config (`configs/demo.toml`, data/demo) with data_parallel = ddp (every
parameter has replicas, the most expensive case for the checksum) in three runs, in turn:
`sdc_interval = 1` (a check every step) with synchronised GC every 10 steps, and both off
(`sdc_interval = 0`, `gc_interval = 0`: Python's automatic collector). From the event files:
the median replica check and GC pause; from metrics.jsonl: the median and worst step time after
the warm-up. The numerical guard adds no collective on a good step (it judges the global loss
and gradient norm the trainer has anyway; one all-gather of a flag only on a bad step), so its
cost is the loss all-reduce it moved before the update, unchanged in count. The straggler
detector runs in the supervisor, off the training path: its time to score the run is reported.
Writes bench/results/integrity.json and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench" / "results" / "integrity.json"


def train(tag: str, steps: int, nproc: int, extra: list[str], data: str) -> dict:
    d = Path(tempfile.mkdtemp(prefix=f"myria-bench-integrity-{tag}-"))
    try:
        args = [sys.executable, "-m", "myria", "train", "--config", "configs/demo.toml",
                "--run-dir", str(d), f"--data.path={data}", f"--training.steps={steps}",
                "--checkpoint.interval=0", "--logging.tensorboard=false",
                "--training.data_parallel=ddp", "--nproc", str(nproc), *extra]
        env = {k: v for k, v in os.environ.items() if k != "MYRIA_FAULT"}
        subprocess.run(args, cwd=ROOT, env=env, check=True, capture_output=True, text=True)
        rows = [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()]
        times = [r["step_time_s"] for r in rows if "loss" in r and r["step"] >= 3]
        spans: dict[str, list[float]] = {"replica_check": [], "gc": []}
        for f in (d / "events").glob("*.jsonl"):
            for line in f.open():
                try:
                    e = json.loads(line)
                except ValueError:
                    continue
                if e.get("n") in spans and "t1" in e:
                    spans[e["n"]].append((e["t1"] - e["t0"]) / 1e6)
        t0 = time.perf_counter()
        from myria.observe.straggler import default_window, detect_dir

        detect_dir(d, window=default_window(steps))
        detect_s = time.perf_counter() - t0
        return {"median_step_s": statistics.median(times), "max_step_s": max(times),
                "steps": len(times),
                "replica_check_s": statistics.median(spans["replica_check"])
                if spans["replica_check"] else None,
                "replica_checks": len(spans["replica_check"]),
                "gc_pause_s": statistics.median(spans["gc"]) if spans["gc"] else None,
                "gc_pauses": len(spans["gc"]), "straggler_detect_s": round(detect_s, 4)}
    finally:
        shutil.rmtree(d, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--data", default="data/demo")
    a = ap.parse_args()
    if not (ROOT / a.data / "index.json").exists():
        sys.exit(f"{a.data} is missing: myria prepare --corpus demo --out {a.data}")
    runs = {
        "checks on (sdc every step, GC every 10)":
            train("on", a.steps, a.nproc, ["--resilience.sdc_interval=1",
                                           "--training.gc_interval=10"], a.data),
        "checks off (automatic GC)":
            train("off", a.steps, a.nproc, ["--resilience.sdc_interval=0",
                                            "--training.gc_interval=0"], a.data),
    }
    on, off = runs["checks on (sdc every step, GC every 10)"], runs["checks off (automatic GC)"]
    res = {"command": "bench/integrity.py " + " ".join(sys.argv[1:]),
           "date": time.strftime("%Y-%m-%d"),
           "machine": f"{os.cpu_count()} cores {platform.machine()}, load average at start "
                      f"{os.getloadavg()[0]:.1f}", "runs": runs,
           "replica_check_fraction_of_step": on["replica_check_s"] / on["median_step_s"],
           "step_time_ratio_on_off": on["median_step_s"] / off["median_step_s"]}
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(res, indent=1))
    print("| run | median step (s) | worst step (s) | replica check (s) | GC pause (s) |\n"
          "|---|---|---|---|---|")
    for k, r in runs.items():
        print(f"| {k} | {r['median_step_s']:.3f} | {r['max_step_s']:.3f} | "
              f"{r['replica_check_s'] if r['replica_check_s'] is not None else '-'} | "
              f"{r['gc_pause_s'] if r['gc_pause_s'] is not None else '-'} |")
    print(f"\nreplica check: {100 * res['replica_check_fraction_of_step']:.2f}% of a step when "
          f"run every step; straggler scoring of the run {on['straggler_detect_s']} s "
          "(in the supervisor, not in the step)")


if __name__ == "__main__":
    main()
