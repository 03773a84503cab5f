"""`myria train`'s row of bench/train_throughput.py for two source trees, alternately.

    python bench/train_ab.py BEFORE_TREE AFTER_TREE [--config C] [--steps 6] [--warmup 2]
                             [--rounds 3] [--override=--training.global_batch=4 ...]

A tree is a checkout (e.g. `git worktree add /tmp/before main`). Each run is a fresh process that
calls the tree's own `bench/train_throughput.myria_loop` with the tree's `src/` first on
`sys.path`; the order of the two trees is swapped each round. Prints, per run, tokens/s on the
wall clock (the median step after warm-up, as train_throughput.py) and tokens per CPU-second
(the process CPU time of each measured step, all threads), which the load of a shared host
changes less than the wall clock.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def child(tree: str, config: str, steps: int, warmup: int, overrides: list[str]) -> None:
    spec = importlib.util.spec_from_file_location("tt", Path(tree) / "bench" /
                                                  "train_throughput.py")
    tt = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tt)   # puts TREE/src first on sys.path
    from myria.train import metrics

    marks: list[float] = []
    init, lap = metrics.StepTimer.__init__, metrics.StepTimer.lap

    def init2(self, *a, **k):
        init(self, *a, **k)
        marks.append(time.process_time())

    def lap2(self, *a, **k):
        out = lap(self, *a, **k)
        marks.append(time.process_time())
        return out

    metrics.StepTimer.__init__, metrics.StepTimer.lap = init2, lap2
    cfg = tt.config_mod.load(config, [f"--training.steps={steps}", "--checkpoint.interval=0",
                                      "--logging.progress=false", "--logging.tensorboard=false",
                                      "--data.prefetch=2", *overrides])
    cfg.checkpoint.resume = False
    wall = tt.myria_loop(cfg, steps, warmup)
    cpu = [b - a for a, b in zip(marks, marks[1:])][warmup:steps]
    tokens = cfg.training.global_batch * cfg.model.seq_len
    print(f"{wall:.1f} {tokens / statistics.median(cpu):.1f}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("before")
    ap.add_argument("after")
    ap.add_argument("--config", default=str(ROOT / "configs" / "demo.toml"))
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--override", action="append", default=[],
                    help="a config override, as --override=--training.global_batch=4")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.before, args.config, args.steps, args.warmup, args.override)
        return 0
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "MYRIA_FAULT")}
    print("round tree tokens/s(wall) tokens/CPU-s load")
    for r in range(args.rounds):
        order = ("before", "after") if r % 2 == 0 else ("after", "before")
        for name in order:
            tree = getattr(args, name)
            out = subprocess.run(
                [sys.executable, __file__, tree, tree, "--child", "--config", args.config,
                 "--steps", str(args.steps), "--warmup", str(args.warmup),
                 *(f"--override={o}" for o in args.override)],
                env=env, check=True, capture_output=True, text=True).stdout.split()
            print(f"{r + 1} {name} {out[-2]} {out[-1]} {os.getloadavg()[0]:.1f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
