"""The dry run's predicted step beside the measured one, for every temporal mixer, on this CPU.

    PYTHONPATH=src .venv/bin/python bench/mixer_prediction.py [--data DIR] [--steps 10]

For configs/demo.toml's model (2 processes, the demo corpus; prepared into a temporary
directory unless --data names one) with softmax attention and each other mixer the dry run
prices (retention, Griffin's RG-LRU with local attention, block-sparse and linear attention,
a Gated DeltaNet hybrid): `myria train --dry-run` gives the predicted step ("step X s"), then
`myria train` runs --steps steps and the median step time after the first two is the measured
one. The machine is shared: run it on a quiet host. Writes bench/results/mixer_prediction.json
and prints the markdown table of bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench" / "results" / "mixer_prediction.json"

MIXERS = {
    "softmax attention": [],
    "retnet": ["--model.arch=retnet", "--model.kv_heads=0"],
    "griffin RRA, window 128": ["--model.arch=griffin", "--model.attention_window=128"],
    "block_sparse, window 64": ["--model.attention=block_sparse",
                                "--model.attention_window=64"],
    "linear attention": ["--model.attention=linear"],
    "hybrid DDDA": ["--model.arch=hybrid", "--model.block_pattern=DDDA"],
}


def myria(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    env.pop("MYRIA_FAULT", None)
    p = subprocess.run([sys.executable, "-m", "myria", *args], env=env, capture_output=True,
                       text=True, cwd=ROOT)
    if p.returncode:
        raise SystemExit(f"myria {' '.join(args)} failed:\n{p.stdout[-2000:]}\n"
                         f"{p.stderr[-3000:]}")
    return p


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", help="a prepared demo corpus (default: prepared here)")
    ap.add_argument("--steps", type=int, default=10)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="mixer-prediction-"))
    data = args.data or str(tmp / "data")
    if not args.data:
        myria("prepare", "--corpus", "demo", "--out", data, "--quiet")
    base = ["--config", "configs/demo.toml", "--nproc", "2", f"--data.path={data}"]
    rows = []
    for name, over in MIXERS.items():
        dry = myria("train", *base, *over, "--dry-run").stdout
        pred = float(re.search(r"step ([\d.]+) s, MFU", dry).group(1))
        run = tmp / re.sub(r"\W+", "-", name)
        t0 = time.perf_counter()
        myria("train", *base, *over, "--run-dir", str(run), f"--training.steps={args.steps}",
              "--training.eval_interval=0", "--checkpoint.interval=0",
              "--logging.tensorboard=false")
        wall = time.perf_counter() - t0
        steps = [json.loads(x)["step_time_s"] for x in
                 (run / "metrics.jsonl").read_text().splitlines() if '"loss"' in x]
        measured = statistics.median(steps[2:])
        rows.append({"mixer": name, "overrides": over, "predicted_step_s": pred,
                     "measured_step_s": measured, "error": pred / measured - 1,
                     "run_wall_s": wall})
        print(f"{name}: predicted {pred:.3g} s, measured {measured:.3g} s "
              f"({100 * (pred / measured - 1):+.1f}%)", flush=True)
    rec = {"command": "bench/mixer_prediction.py", "steps": args.steps,
           "machine": f"{platform.machine()} {os.cpu_count()} cores",
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "rows": rows}
    OUT.write_text(json.dumps(rec, indent=1) + "\n")
    print("\n| mixer | predicted step s | measured step s (median) | error |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['mixer']} | {r['predicted_step_s']:.3g} | {r['measured_step_s']:.3g} | "
              f"{100 * r['error']:+.1f}% |")


if __name__ == "__main__":
    main()
