"""Learning-rate schedule values at warm-up, peak, midpoint and end."""

from __future__ import annotations

import math

import pytest
import torch

from myria.config import OptimizerConfig
from myria.optim import build_scheduler, lr_lambda


def test_warmup_is_linear_and_reaches_peak():
    assert lr_lambda(0, 10, 100, "cosine", 0.1) == pytest.approx(0.1)
    assert lr_lambda(4, 10, 100, "cosine", 0.1) == pytest.approx(0.5)
    assert lr_lambda(9, 10, 100, "cosine", 0.1) == pytest.approx(1.0)
    assert lr_lambda(10, 10, 100, "cosine", 0.1) == pytest.approx(1.0)


@pytest.mark.parametrize("schedule,mid", [("cosine", 0.55), ("linear", 0.55), ("constant", 1.0)])
def test_decay_shapes(schedule, mid):
    w, total, lo = 10, 110, 0.1
    assert lr_lambda(w, w, total, schedule, lo) == pytest.approx(1.0)
    assert lr_lambda(60, w, total, schedule, lo) == pytest.approx(mid)
    end = 1.0 if schedule == "constant" else lo
    assert lr_lambda(total, w, total, schedule, lo) == pytest.approx(end)
    assert lr_lambda(total + 50, w, total, schedule, lo) == pytest.approx(end)


def test_cosine_quarter_and_no_warmup():
    # A quarter of the way through the decay: 0.5 * (1 + cos(pi/4)).
    expect = 0.5 * (1 + math.cos(math.pi / 4))
    assert lr_lambda(25, 0, 100, "cosine", 0.0) == pytest.approx(expect)
    assert lr_lambda(0, 0, 100, "linear", 0.0) == pytest.approx(1.0)
    assert lr_lambda(75, 0, 100, "linear", 0.2) == pytest.approx(0.2 + 0.8 * 0.25)
    values = [lr_lambda(s, 5, 50, "cosine", 0.1) for s in range(5, 51)]
    assert all(a >= b for a, b in zip(values, values[1:], strict=False))
    with pytest.raises(ValueError, match="schedule"):
        lr_lambda(0, 0, 10, "step", 0.0)


def test_build_scheduler_drives_optimizer_lr():
    p = torch.nn.Parameter(torch.zeros(2))
    cfg = OptimizerConfig(lr=1e-2, warmup_steps=4, schedule="cosine", min_lr_ratio=0.1)
    opt = torch.optim.SGD([p], lr=cfg.lr)
    sched = build_scheduler(opt, cfg, total_steps=20)
    seen = []
    for _ in range(21):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert seen[0] == pytest.approx(2.5e-3)   # first step already trains (1/4 of peak)
    assert seen[3] == pytest.approx(1e-2)
    assert seen[20] == pytest.approx(1e-3)
    state = sched.state_dict()
    assert state["last_epoch"] == 21


def test_apply_config_overrides_the_loaded_optimizer_and_schedule():
    """Resuming loads the checkpoint's param groups and scheduler (its lr and base_lrs): the
    new config must be what trains next, at the same point of the schedule."""
    from myria.optim import build_optimizer
    from myria.optim.schedules import apply_config

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    old = OptimizerConfig(lr=3e-3, warmup_steps=2, min_lr_ratio=0.1)
    opt = build_optimizer(model, old)
    sched = build_scheduler(opt, old, total_steps=10)
    for _ in range(10):
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
        sched.step()
    new = OptimizerConfig(lr=1e-5, warmup_steps=2, min_lr_ratio=0.1, weight_decay=0.5,
                          beta2=0.99, decay_steps=10)
    opt2 = build_optimizer(model, new)
    sched2 = build_scheduler(opt2, new, total_steps=30)
    opt2.load_state_dict(opt.state_dict())
    sched2.load_state_dict(sched.state_dict())
    assert opt2.param_groups[0]["lr"] == pytest.approx(3e-4)  # the bug: the old lr comes back
    assert apply_config([opt2], [sched2], new, 30) == pytest.approx(1e-6)
    decay, no_decay = opt2.param_groups
    assert decay["lr"] == no_decay["lr"] == pytest.approx(1e-6) and sched2.get_last_lr()[0] == \
        pytest.approx(1e-6)
    assert decay["weight_decay"] == 0.5 and no_decay["weight_decay"] == 0.0
    assert decay["betas"] == (0.9, 0.99)
    model(torch.randn(2, 4)).sum().backward()
    opt2.step()
    sched2.step()
    assert opt2.param_groups[0]["lr"] == pytest.approx(1e-6)  # decay horizon 10 kept: minimum
    # stretched over 30 steps instead: the lr rises back up the cosine
    stretched = OptimizerConfig(lr=1e-5, warmup_steps=2, min_lr_ratio=0.1)
    assert apply_config([opt2], [sched2], stretched, 30) == pytest.approx(
        1e-5 * lr_lambda(11, 2, 30, "cosine", 0.1))


def test_wsd_is_flat_at_the_peak_then_decays_linearly_over_its_last_fraction():
    w, total, lo, frac = 10, 110, 0.1, 0.2     # decays over steps 88..110
    assert lr_lambda(5, w, total, "wsd", lo, frac) == pytest.approx(0.6)
    assert all(lr_lambda(s, w, total, "wsd", lo, frac) == 1.0 for s in range(9, 89))
    assert lr_lambda(99, w, total, "wsd", lo, frac) == pytest.approx(1 - 0.9 * 11 / 22)
    assert lr_lambda(total, w, total, "wsd", lo, frac) == pytest.approx(lo)


def test_wsd_run_extended_in_its_stable_phase_decays_at_the_new_end():
    from myria.config import Config
    from myria.config.resume_rules import resume_changes

    prev = {"optimizer": {"schedule": "wsd", "decay_steps": 0, "warmup_steps": 10,
                          "decay_fraction": 0.2}, "training": {"steps": 100}}
    cfg = Config()
    cfg.optimizer.schedule, cfg.optimizer.warmup_steps = "wsd", 10
    cfg.training.steps = 200
    resume_changes(prev, cfg, 50)            # stable phase: the horizon moves to 200
    assert cfg.optimizer.decay_steps == 0
    cfg.training.steps = 200
    resume_changes(prev, cfg, 90)            # decaying since step 80: the horizon stays
    assert cfg.optimizer.decay_steps == 100
