"""Where a 1-process `myria train` step spends its time beside the model's compute: a cProfile
of `myria.train.trainer.train` on the demo config, grouped.

    python bench/step_profile.py [--config configs/demo.toml] [--steps 4] [--out FILE]

Groups, as shares of the time inside `train_step`: the at-rest checksums
(`train.checksums.sums`, called by the silent-corruption ledger every step), the rest of the
integrity guard, the watchers' own Python (event timer, heartbeat, goodput ledger, the
watchers), the interception of `torch.distributed` (`observe.comm`), and the framework's own
Python (the time of myria's frames outside the model, `myria/models`: not the torch calls they
make). The config as
`bench/train_throughput.py` measures the trainer (`bench_config`). Writes
bench/results/step_profile.json.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import platform
import pstats
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from myria.train.trainer import train  # noqa: E402
from train_throughput import bench_config  # noqa: E402  (bench/, this script's folder)

WATCHERS = ("observe/events.py", "train/heartbeat.py", "observe/goodput.py",
            "train/watchers.py")
GUARD = ("train/integrity.py", "train/sdc.py")


def grouped(stats: pstats.Stats) -> dict[str, float]:
    """Seconds per group (module docstring) and in `train_step`."""
    out = {"train_step": 0.0, "checksums": 0.0, "guard_python": 0.0, "watchers_python": 0.0,
           "comm_python": 0.0, "framework_python": 0.0}
    for (file, _, name), (_, _, tottime, cumtime, _) in stats.stats.items():
        file = file.replace("\\", "/")
        if "/myria/" not in file:
            continue
        if "/myria/models/" not in file:
            out["framework_python"] += tottime
        if file.endswith("train/trainer.py") and name == "train_step":
            out["train_step"] += cumtime
        if file.endswith("train/checksums.py") and name == "sums":
            out["checksums"] += cumtime
        if file.endswith(GUARD):
            out["guard_python"] += tottime
        if file.endswith(WATCHERS):
            out["watchers_python"] += tottime
        if file.endswith("observe/comm.py"):
            out["comm_python"] += tottime
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(ROOT / "configs" / "demo.toml"))
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "step_profile.json"))
    args = ap.parse_args()
    cfg = bench_config(args.config, args.steps)
    prof = cProfile.Profile()
    with tempfile.TemporaryDirectory() as d:
        prof.enable()
        train(cfg, d)
        prof.disable()
    seconds = grouped(pstats.Stats(prof))
    step = seconds["train_step"]
    result = {
        "date": time.strftime("%Y-%m-%d %H:%M"), "config": args.config, "steps": args.steps,
        "machine": f"{platform.machine()}, {torch.get_num_threads()} threads, "
                   f"torch {torch.__version__}",
        "seconds": {k: round(v, 3) for k, v in seconds.items()},
        "share_of_train_step": {k: round(v / step, 5) for k, v in seconds.items()
                                if k != "train_step"} if step else {},
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"train_step: {step:.2f} s over {args.steps} steps")
    for k, v in result["share_of_train_step"].items():
        print(f"{k:<18}{100 * v:7.2f}%")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
