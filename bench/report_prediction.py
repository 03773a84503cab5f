"""`myria report`'s predicted step beside the demo's measured one, and the MFU the meter prints.

    python bench/report_prediction.py --nproc 2 --steps 20 --short 8 [--src DIR] [--tag after]

Trains configs/demo.toml (`make demo`'s model) for --steps steps through the CLI on a fresh
run directory, then runs `myria report` on it and reads its prediction (report/prediction.json,
or the page's "predicted step" line for code before it existed). `--src` runs another checkout's
`src` (e.g. an export of an older commit: the "before" figures). MYRIA_CACHE is a fresh
directory per invocation unless --cache is given, as on a fresh clone.

The machine is shared: the measured median step includes the time other jobs held the cores.
A quiet-host equivalent comes from CPU time: with --short, a second, shorter run gives the CPU
seconds (user + system, all processes) per rank and step as the difference of the two runs'
CPU time over the difference of their steps (start-up cancels out). With one thread per rank
this is the step a quiet host would take (the ranks' waits for each other sleep in gloo); with
several threads per rank it is CPU time per thread, an upper bound (idle OpenMP threads spin).
Prints one table row and appends the record to bench/results/report_prediction.json.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench" / "results" / "report_prediction.json"


def children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def myria(src: Path, cache: Path, *args: str) -> tuple[subprocess.CompletedProcess, float, float]:
    """Run `python -m myria ARGS` with `src` first on the path: (process, wall s, CPU s)."""
    env = dict(os.environ, PYTHONPATH=str(src), MYRIA_CACHE=str(cache))
    env.pop("MYRIA_FAULT", None)
    c0, t0 = children_cpu(), time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "myria", *args], env=env, capture_output=True,
                       text=True, cwd=ROOT)
    if p.returncode:
        raise SystemExit(f"myria {' '.join(args)} failed:\n{p.stdout[-2000:]}\n{p.stderr[-3000:]}")
    return p, time.perf_counter() - t0, children_cpu() - c0


def train(src: Path, cache: Path, data: str, nproc: int, steps: int) -> tuple[Path, float]:
    run = Path(tempfile.mkdtemp(prefix=f"mfu-demo-{nproc}p-")) / "run"
    _, _, cpu = myria(src, cache, "train", "--config", "configs/demo.toml", "--run-dir", str(run),
                      "--nproc", str(nproc), f"--data.path={data}", f"--training.steps={steps}",
                      "--checkpoint.interval=0", "--logging.tensorboard=false",
                      "--logging.progress=false")
    return run, cpu


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--short", type=int, default=0, help="steps of the second run (CPU time)")
    ap.add_argument("--data", default="/tmp/mfu-data")
    ap.add_argument("--src", default=str(ROOT / "src"))
    ap.add_argument("--cache", default="")
    ap.add_argument("--tag", default="")
    a = ap.parse_args()
    src = Path(a.src)
    cache = Path(a.cache or tempfile.mkdtemp(prefix="mfu-cache-"))
    la0 = os.getloadavg()[0]
    run, cpu_long = train(src, cache, a.data, a.nproc, a.steps)
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "loss" in r]
    steady = rows[3:]
    step_s = statistics.median(r["step_time_s"] for r in steady)
    mfu = statistics.median(r["mfu"] for r in steady) if steady[0].get("mfu") else None
    la1 = os.getloadavg()[0]
    rep, rep_wall, _ = myria(src, cache, "report", str(run))
    pj = run / "report" / "prediction.json"
    if pj.exists():
        pred = json.loads(pj.read_text())
        pred_s, pred_mfu = pred["iteration_time_s"], pred["mfu"]
    else:
        html = (run / "report" / "index.html").read_text()
        m = re.search(r"predicted step ([\d.]+) ms on \w+ \(MFU ([\d.]+)%", html)
        pred_s, pred_mfu = float(m.group(1)) / 1e3, float(m.group(2)) / 100
    cpu_step = None
    if a.short:
        _, cpu_short = train(src, cache, a.data, a.nproc, a.short)
        cpu_step = (cpu_long - cpu_short) / ((a.steps - a.short) * a.nproc)
    rec = {"tag": a.tag, "date": time.strftime("%Y-%m-%d %H:%M"), "nproc": a.nproc,
           "steps": a.steps, "short": a.short, "src": str(src),
           "measured_step_s": step_s, "measured_mfu": mfu, "predicted_step_s": pred_s,
           "predicted_mfu": pred_mfu, "cpu_s_per_rank_step": cpu_step,
           "report_s": rep_wall, "loadavg": [la0, la1, os.getloadavg()[0]],
           "report_stdout": rep.stdout.splitlines()[-3:]}
    OUT.parent.mkdir(parents=True, exist_ok=True)
    old = json.loads(OUT.read_text()) if OUT.exists() else []
    OUT.write_text(json.dumps(old + [rec], indent=1))
    cs = f"{cpu_step:.2f}" if cpu_step else "-"
    ms = f"{mfu:.1%}" if mfu is not None else "-"
    print(f"| {a.tag} | {a.nproc} | {step_s:.2f} | {cs} | {pred_s:.2f} | "
          f"{pred_s / step_s - 1:+.0%} | "
          + (f"{pred_s / cpu_step - 1:+.0%}" if cpu_step else "-") +
          f" | {ms} | {pred_mfu:.1%} | {rep_wall:.0f} | {la0:.1f}-{rec['loadavg'][2]:.1f} |")


if __name__ == "__main__":
    main()
