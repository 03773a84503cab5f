"""Cost of the always-on event timer: the demo config with `observe.enabled` on and off.

    .venv/bin/python bench/timeline_overhead.py [--rounds 3] [--steps 12] [--nproc 2]

Each round trains the demo model twice from scratch on the demo corpus, timer on and timer off,
in alternating order (on first in odd rounds), and takes the median step time of the steps
after the warm-up (step 3 on) from metrics.jsonl. The overhead of a round is on / off - 1; the
headline is the median over rounds, with every round shown. Writes
bench/results/timeline_overhead.json and prints a Markdown table. Needs data/demo
(`myria prepare --corpus demo --out data/demo`).
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
OUT = ROOT / "bench" / "results" / "timeline_overhead.json"


def run(enabled: bool, steps: int, nproc: int, data: str) -> dict:
    d = Path(tempfile.mkdtemp(prefix="myria-bench-timeline-"))
    try:
        args = [sys.executable, "-m", "myria", "train", "--config", "configs/demo.toml",
                "--run-dir", str(d), f"--data.path={data}", f"--training.steps={steps}",
                "--checkpoint.interval=0", "--logging.tensorboard=false",
                f"--observe.enabled={'true' if enabled else 'false'}", "--nproc", str(nproc)]
        env = {k: v for k, v in os.environ.items() if k != "MYRIA_FAULT"}
        subprocess.run(args, cwd=ROOT, env=env, check=True, capture_output=True, text=True)
        rows = [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()]
        times = [r["step_time_s"] for r in rows if "loss" in r and r["step"] >= 3]
        n_events = sum(1 for f in (d / "events").glob("*.jsonl")
                       for _ in f.open()) if enabled else 0
        return {"median_step_s": statistics.median(times), "steps": len(times),
                "events": n_events}
    finally:
        shutil.rmtree(d, ignore_errors=True)


def per_event_cost_us(n: int = 20000) -> float:
    """Median cost of recording one span (begin + end + the writer's share), in µs."""
    from myria.observe.events import Recorder

    d = Path(tempfile.mkdtemp(prefix="myria-bench-rec-"))
    try:
        rec = Recorder(d, 0, 1, enabled=True, flush_s=0.2)
        rec.start({"bench": True})
        costs = []
        for _ in range(5):
            t0 = time.perf_counter()
            for i in range(n):
                with rec.span("forward", "compute", mb=i % 4):
                    pass
            costs.append((time.perf_counter() - t0) / n * 1e6)
        rec.close()
        return statistics.median(costs)
    finally:
        shutil.rmtree(d, ignore_errors=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--data", default="data/demo")
    args = ap.parse_args(argv)
    if not (ROOT / args.data / "index.json").exists():
        print(f"no {args.data}: run `myria prepare --corpus demo --out data/demo` first")
        return 2
    rounds = []
    for i in range(args.rounds):
        order = (True, False) if i % 2 == 0 else (False, True)
        res = {}
        for enabled in order:
            res["on" if enabled else "off"] = run(enabled, args.steps, args.nproc, args.data)
        over = res["on"]["median_step_s"] / res["off"]["median_step_s"] - 1
        rounds.append({"on": res["on"], "off": res["off"], "overhead": over,
                       "order": "on,off" if order[0] else "off,on",
                       "loadavg": os.getloadavg()[0]})
        print(f"round {i + 1}: timer on {res['on']['median_step_s'] * 1e3:.1f} ms, off "
              f"{res['off']['median_step_s'] * 1e3:.1f} ms per step -> {over:+.2%} "
              f"({res['on']['events']} events)", flush=True)
    head = statistics.median(r["overhead"] for r in rounds)
    cost = per_event_cost_us()
    per_step = statistics.median(r["on"]["events"] for r in rounds) / args.steps / args.nproc
    step_s = statistics.median(r["off"]["median_step_s"] for r in rounds)
    implied = per_step * cost * 1e-6 / step_s
    print(f"recording one event costs {cost:.1f} us; {per_step:.0f} events per rank and step "
          f"-> {implied:.4%} of a {step_s * 1e3:.0f} ms step")
    out = {"command": "bench/timeline_overhead.py " + " ".join(argv or sys.argv[1:]),
           "machine": f"{platform.machine()}, {os.cpu_count()} cores, shared",
           "date": time.strftime("%Y-%m-%d"), "nproc": args.nproc, "steps": args.steps,
           "rounds": rounds, "median_overhead": head, "target": "< 1% of step time",
           "met": head < 0.01, "per_event_cost_us": cost, "events_per_rank_step": per_step,
           "implied_overhead": implied}
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(out, indent=1))
    print("\n| round | order | timer on, ms/step | timer off, ms/step | overhead |\n"
          "|---|---|---|---|---|")
    for i, r in enumerate(rounds, 1):
        print(f"| {i} | {r['order']} | {r['on']['median_step_s'] * 1e3:.1f} | "
              f"{r['off']['median_step_s'] * 1e3:.1f} | {r['overhead']:+.2%} |")
    print(f"\nmedian overhead {head:+.2%} (target < 1%: {'met' if head < 0.01 else 'MISSED'});"
          f" implied by the per-event cost {implied:.4%}; wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
