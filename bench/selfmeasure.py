"""A peak first measured on a loaded host does not survive.

    .venv/bin/python bench/selfmeasure.py [--steps 10] [--nproc 2] [--busy 2]

1. With an empty cache ($MYRIA_CACHE in a temporary directory) and `--busy` busy-loop processes
   loading the host, this CPU's fp32 peak is measured the way `myria train` does on first use:
   the figure a one-shot cache would have kept for good.
2. The busy loops stop; the demo model trains for `--steps` steps with that cache. Its MFU
   (median of the logged rows after the warm-up) is computed by the trainer against the peak it
   now holds: since 2026-11-26 the pinned core peak (measured once, under load, on its CPU time)
   x threads; before, the cached best, raised by its own start-up probes.
3. Fresh measurements in other empty caches, one before the demo trains (after the busy loops
   stopped) and one after, give the reference peak (the higher: a reference must be quiet too);
   the demo's tokens/s against it gives the reference MFU.

Reported: the loaded, trainer and reference peaks; the MFU a one-shot cache would print (against
the loaded peak), the trainer's MFU, the reference MFU, and the trainer's MFU / reference - 1
(the target: within 10%). Writes bench/results/selfmeasure.json.
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
OUT = ROOT / "bench" / "results" / "selfmeasure.json"


def peak(cache: Path, threads: int) -> float:
    code = ("from myria.device import cpu_device_spec; "
            f"print(cpu_device_spec(threads={threads}).peak_fp32_tflops)")
    env = dict(os.environ, MYRIA_CACHE=str(cache))
    return float(subprocess.run([sys.executable, "-c", code], env=env, check=True,
                                capture_output=True, text=True).stdout.split()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--busy", type=int, default=2)
    ap.add_argument("--data", default="data/demo")
    a = ap.parse_args()
    threads = max(1, (os.cpu_count() or 1) // a.nproc)   # the trainer's threads per rank
    tmp = Path(tempfile.mkdtemp(prefix="myria-bench-selfmeasure-"))
    try:
        loaded_cache, quiet_cache = tmp / "loaded", tmp / "quiet"
        busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
                for _ in range(a.busy)]
        try:
            time.sleep(1.0)
            loaded = peak(loaded_cache, threads)
        finally:
            for p in busy:
                p.kill()
                p.wait()
        time.sleep(2.0)
        quiet_before = peak(tmp / "quiet-before", threads)
        run = tmp / "run"
        env = {k: v for k, v in os.environ.items() if k != "MYRIA_FAULT"}
        env["MYRIA_CACHE"] = str(loaded_cache)
        subprocess.run([sys.executable, "-m", "myria", "train", "--config", "configs/demo.toml",
                        "--run-dir", str(run), f"--data.path={a.data}",
                        f"--training.steps={a.steps}", "--checkpoint.interval=0",
                        "--logging.tensorboard=false", "--nproc", str(a.nproc)],
                       cwd=ROOT, env=env, check=True, capture_output=True, text=True)
        rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
        rows = [r for r in rows if "loss" in r and r["step"] >= 3]
        mfu = statistics.median(r["mfu"] for r in rows)
        trainer_peak = peak(loaded_cache, threads)   # the figure the trainer divided by
        quiet = max(quiet_before, peak(quiet_cache, threads))
        ref_mfu = mfu * trainer_peak / quiet
        one_shot_mfu = mfu * trainer_peak / loaded
        res = {"command": "bench/selfmeasure.py " + " ".join(sys.argv[1:]),
               "date": time.strftime("%Y-%m-%d"),
               "machine": f"{os.cpu_count()} cores {platform.machine()}, load average at end "
                          f"{os.getloadavg()[0]:.1f}",
               "threads_per_rank": threads, "loaded_peak_tflops": loaded,
               "trainer_peak_tflops": trainer_peak, "quiet_peak_tflops": quiet,
               "mfu_one_shot_cache": one_shot_mfu, "mfu_trainer": mfu, "mfu_reference": ref_mfu,
               "trainer_vs_reference": mfu / ref_mfu - 1}
        OUT.parent.mkdir(parents=True, exist_ok=True)
        prev = json.loads(OUT.read_text()) if OUT.exists() else {}
        prev[f"nproc{a.nproc}_busy{a.busy}"] = res
        OUT.write_text(json.dumps(prev, indent=1))
        print("| peak measured under load | trainer's peak | fresh quiet peak | MFU, one-shot "
              "cache | MFU, trainer | MFU, reference | trainer vs reference |\n"
              "|---|---|---|---|---|---|---|")
        print(f"| {loaded:.4f} | {trainer_peak:.4f} | {quiet:.4f} | {one_shot_mfu:.1%} | "
              f"{mfu:.1%} | {ref_mfu:.1%} | {mfu / ref_mfu - 1:+.1%} |")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
