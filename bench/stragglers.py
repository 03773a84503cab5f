"""Straggler detection on this host: detection delay and false alarms against the slowdown.

    .venv/bin/python bench/stragglers.py [--factors 1.0 1.1 1.2 1.5] [--reps 3] [--steps 24]
                                         [--busy 0] [--window 5] [--windows 2]

Each repetition trains the tiny 4-rank data-parallel model (the tests' model, 4 processes on
this machine's 2 cores: already oversubscribed) for `--steps` steps with rank 3 slowed by the
`slow` fault hook (factor 1.0 = a clean run), then runs the detector with the given window on
the event files. `--busy N` adds N busy-loop processes for the whole run (a loaded host).
Reported per factor: how often rank 3 was named, the detection step (steps after the slowdown,
which starts at step 1), and false alarms (any other rank named; any rank in a clean run).
Writes bench/results/stragglers.json and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
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
OUT = ROOT / "bench" / "results" / "stragglers.json"
TINY = ["--model.vocab_size=1024", "--model.layers=2", "--model.hidden=64", "--model.heads=4",
        "--model.kv_heads=2", "--model.seq_len=64", "--training.global_batch=16",
        "--training.micro_batch=2", "--optimizer.warmup_steps=4", "--logging.tensorboard=false",
        "--checkpoint.interval=0", "--training.eval_interval=0"]


def _spin(stop):
    while not stop.is_set():
        sum(i * i for i in range(10000))


def one(factor: float, steps: int, data: Path, window: int, windows: int) -> dict:
    from myria.observe.analyze import load_run
    from myria.observe.straggler import detect

    d = Path(tempfile.mkdtemp(prefix="myria-bench-straggler-"))
    try:
        env = {k: v for k, v in os.environ.items() if k != "MYRIA_FAULT"}
        if factor != 1.0:
            env["MYRIA_FAULT"] = f"slow:rank=3:factor={factor}"
        subprocess.run([sys.executable, "-m", "myria", "train", "--run-dir", str(d / "run"),
                        f"--data.path={data}", *TINY, f"--training.steps={steps}",
                        "--nproc", "4"], cwd=ROOT, env=env, check=True, capture_output=True)
        found = detect(load_run(d / "run"), window=window, windows=windows)
        named = [s.rank for s in found]
        hit = next((s for s in found if s.rank == 3), None) if factor != 1.0 else None
        return {"named": named, "detected_step": hit.detected_step if hit else None,
                "slowdown": round(hit.slowdown, 3) if hit else None,
                "false_alarms": [r for r in named if factor == 1.0 or r != 3]}
    finally:
        shutil.rmtree(d, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--factors", type=float, nargs="+", default=[1.0, 1.1, 1.2, 1.5])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--busy", type=int, default=0, help="busy-loop processes loading the host")
    ap.add_argument("--window", type=int, default=5)
    ap.add_argument("--windows", type=int, default=2)
    a = ap.parse_args()
    data = Path(tempfile.mkdtemp(prefix="myria-bench-data-")) / "tiny"
    subprocess.run([sys.executable, "-m", "myria", "prepare", "--corpus", "demo", "--max-docs",
                    "20", "--vocab-size", "1024", "--out", str(data), "--quiet"], check=True)
    stop = mp.Event()
    spinners = [mp.Process(target=_spin, args=(stop,), daemon=True) for _ in range(a.busy)]
    for p in spinners:
        p.start()
    rows = []
    t0 = time.time()
    try:
        for f in a.factors:
            runs = []
            for i in range(a.reps):
                runs.append(one(f, a.steps, data, a.window, a.windows))
                print(f"factor {f} rep {i + 1}: {runs[-1]}", file=sys.stderr, flush=True)
            delays = [r["detected_step"] - 1 for r in runs if r["detected_step"] is not None]
            rows.append({"factor": f, "runs": runs,
                         "detected": sum(r["detected_step"] is not None for r in runs),
                         "median_delay_steps": statistics.median(delays) if delays else None,
                         "false_alarm_runs": sum(bool(r["false_alarms"]) for r in runs)})
    finally:
        stop.set()
        for p in spinners:
            p.join(timeout=5)
        shutil.rmtree(data.parent, ignore_errors=True)
    res = {"command": "bench/stragglers.py " + " ".join(sys.argv[1:]),
           "date": time.strftime("%Y-%m-%d"), "machine": f"{os.cpu_count()} cores "
           f"{platform.machine()}, load average at start {os.getloadavg()[0]:.1f}",
           "busy_processes": a.busy, "steps": a.steps, "window": a.window,
           "windows": a.windows, "K": a.window * a.windows, "wall_s": round(time.time() - t0),
           "rows": rows}
    OUT.parent.mkdir(parents=True, exist_ok=True)
    prev = json.loads(OUT.read_text()) if OUT.exists() else {}
    prev[f"busy{a.busy}"] = res
    OUT.write_text(json.dumps(prev, indent=1))
    print(f"| slowdown factor | named (of {a.reps}) | median delay (steps) | runs with a false "
          f"alarm |\n|---|---|---|---|")
    for r in rows:
        det = "clean run" if r["factor"] == 1.0 else str(r["detected"])
        print(f"| {r['factor']} | {det} | {r['median_delay_steps']} | {r['false_alarm_runs']} |")


if __name__ == "__main__":
    main()
