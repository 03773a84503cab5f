"""The shipped large configs are layouts myria's trainer runs well at the scale their comments
name, and the dry-run's advice for a poor layout is settings the trainer takes that reach the
figure it quotes."""

from __future__ import annotations

import re

import pytest

from myria import config as C
from myria import device
from myria.sim.perf import simulate_config


@pytest.mark.parametrize("path,gpus", [("configs/gpt3-175b.toml", 1024),
                                       ("configs/megascale-175b-lamb.toml", 12288),
                                       ("configs/llama3-8b.toml", 64)])
def test_shipped_config_fits_and_is_not_a_poor_layout(path, gpus):
    cfg = C.load(path)
    r = simulate_config(cfg, gpus, device.planning_device(cfg.training.dtype), gpus_per_node=8)
    assert r.fits, r.memory.gb()
    assert r.mfu > 0.4, r.mfu


@pytest.mark.parametrize("path,gpus,poor", [("configs/gpt3-175b.toml", 1024, []),
                                            ("configs/llama3-8b.toml", 64, ["parallel.tp=8"])])
def test_poor_layout_advice_is_settings_the_trainer_takes(path, gpus, poor):
    """With a pipeline (GPT-3) and without (Llama 3 8B, where FSDP's per-microbatch gathers
    dominate): the advice names settings the trainer takes, and the figure it quotes is the
    one the dry run gives once they are applied."""
    from myria.train.cli import better_layout

    spec = device.planning_device("bfloat16")
    cfg = C.load(path, ["training.data_parallel=fsdp", *poor])
    pred = simulate_config(cfg, gpus, spec, gpus_per_node=8)
    line = better_layout(cfg, gpus, 8, spec, pred)
    assert line and "ZeRO stage" not in line, line   # no setting the trainer has no name for
    quoted = float(re.search(r"far below the ([\d.]+)%", line).group(1))
    overrides = [o[2:] for o in re.findall(r"--[a-z_]+\.[a-z_]+=\S+", line)]
    assert "training.data_parallel=zero2" in overrides, line
    fixed = C.load(path, ["training.data_parallel=fsdp", *poor, *overrides])
    after = simulate_config(fixed, gpus, spec, gpus_per_node=8)
    assert abs(100 * after.mfu - quoted) < 0.05, (after.mfu, line)
