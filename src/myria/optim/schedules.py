"""Learning-rate schedules: linear warm-up, then cosine, linear or constant decay, or
warmup-stable-decay (wsd: the peak until the last `decay_fraction` of the horizon, then linear
to the minimum; Hu et al. 2024, MiniCPM).

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
from myria.config.resume_rules import decay_start

SCHEDULES = ("cosine", "linear", "constant", "wsd")


def lr_lambda(step: int, warmup: int, total: int, schedule: str = "cosine",
              min_ratio: float = 0.0, decay_fraction: float = 0.2) -> float:
    """Learning-rate multiplier for 0-based optimizer step `step`.

    Steps 0..warmup-1 rise linearly as (step+1)/warmup. From `warmup` on, the multiplier goes
    from 1 to `min_ratio` at step `total` (cosine or linear), or stays 1 (constant); wsd stays
    1 until `total - decay_fraction x total`, then falls linearly to `min_ratio` at `total`.
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown lr schedule {schedule!r}; valid: {', '.join(SCHEDULES)}")
    if step < warmup:
        return (step + 1) / warmup
    if schedule == "constant":
        return 1.0
    start = decay_start(schedule, warmup, total, decay_fraction)
    if step < start:   # wsd's stable phase
        return 1.0
    progress = min(1.0, (step - start) / max(1, total - start))
    if schedule == "cosine":
        return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
    return min_ratio + (1.0 - min_ratio) * (1.0 - progress)


def _multiplier(cfg: OptimizerConfig, total_steps: int):
    return functools.partial(lr_lambda, warmup=cfg.warmup_steps,
                             total=cfg.decay_steps or total_steps, schedule=cfg.schedule,
                             min_ratio=cfg.min_lr_ratio, decay_fraction=cfg.decay_fraction)


def build_scheduler(optimizer: Optimizer, cfg: OptimizerConfig, total_steps: int) -> LambdaLR:
    """A LambdaLR applying `cfg`'s warm-up and decay; the decay ends at `cfg.decay_steps`, or
    at `total_steps` when that is 0."""
    return LambdaLR(optimizer, _multiplier(cfg, total_steps))


def apply_config(optimizers: list[Optimizer], schedulers: list[LambdaLR], cfg: OptimizerConfig,
                 total_steps: int) -> float:
    """After a checkpoint's optimizer and scheduler state were loaded (which bring back the
    hyperparameters they were saved with): make `cfg` the one that trains from here on. The
    peak lr, betas, eps and weight decay go into every param group, the schedule's shape into
    each scheduler, keeping its step count; returns the lr of the next step."""
    fn = _multiplier(cfg, total_steps)
    for opt, sched in zip(optimizers, schedulers, strict=True):
        sched.lr_lambdas = [fn] * len(opt.param_groups)
        sched.base_lrs = [cfg.lr] * len(opt.param_groups)
        lr = cfg.lr * fn(sched.last_epoch)
        for g in opt.param_groups:
            g.update(lr=lr, initial_lr=cfg.lr, eps=cfg.eps)
            if "betas" in g:
                g["betas"] = (cfg.beta1, cfg.beta2)
            if g.get("name", "decay" if g.get("weight_decay") else "") == "decay":
                g["weight_decay"] = cfg.weight_decay  # norms and biases stay at 0
        sched._last_lr = [lr] * len(opt.param_groups)
    return cfg.lr * fn(schedulers[0].last_epoch) if schedulers else cfg.lr
