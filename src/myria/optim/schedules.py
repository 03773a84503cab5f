"""Learning-rate schedules: linear warm-up, then cosine, linear or constant decay.

`lr_lambda` is the multiplier of the peak learning rate for an optimizer step; `LambdaLR`
calls it with the index of the step about to run (0 for the first step). Warm-up reaches the
peak on the last warm-up step, so no step runs at lr = 0. Decay then goes from the peak at
step `warmup` to `min_ratio` at step `total` and stays there.
"""

from __future__ import annotations

import functools
import math

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR

from myria.config import OptimizerConfig

SCHEDULES = ("cosine", "linear", "constant")


def lr_lambda(step: int, warmup: int, total: int, schedule: str = "cosine",
              min_ratio: float = 0.0) -> float:
    """Learning-rate multiplier for 0-based optimizer step `step`.

    Steps 0..warmup-1 rise linearly as (step+1)/warmup. From `warmup` on, the multiplier goes
    from 1 to `min_ratio` at step `total` (cosine or linear), or stays 1 (constant).
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown lr schedule {schedule!r}; valid: {', '.join(SCHEDULES)}")
    if step < warmup:
        return (step + 1) / warmup
    if schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    if schedule == "cosine":
        return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
    return min_ratio + (1.0 - min_ratio) * (1.0 - progress)


def build_scheduler(optimizer: Optimizer, cfg: OptimizerConfig, total_steps: int) -> LambdaLR:
    """A LambdaLR applying `cfg`'s warm-up and decay over `total_steps` optimizer steps."""
    fn = functools.partial(lr_lambda, warmup=cfg.warmup_steps, total=total_steps,
                           schedule=cfg.schedule, min_ratio=cfg.min_lr_ratio)
    return LambdaLR(optimizer, fn)
