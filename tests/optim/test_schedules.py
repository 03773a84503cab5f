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
