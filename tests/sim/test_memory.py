"""Memory model: Korthikanti et al. 2022 activation formulas, ZeRO, pipeline schedules."""

from __future__ import annotations

import pytest

from myria.config import ModelConfig
from myria.sim.memory import in_flight_microbatches, layer_activation_bytes
from myria.sim.operators import layer_shape

GPT = ModelConfig(arch="gpt", vocab_size=51200, layers=24, hidden=2048, heads=16, seq_len=2048)


def shape(**kw):
    return layer_shape(GPT, kw.pop("b", 2), dropout=0.1, **kw)


def test_korthikanti_formulas():
    s, b, h, a = 2048, 2, 2048, 16
    sbh = s * b * h
    # no parallelism: sbh (34 + 5 a s / h)
    assert layer_activation_bytes(shape(), "none") == pytest.approx(sbh * (34 + 5 * a * s / h))
    for t in (2, 4, 8):
        # tensor parallel: sbh (10 + 24/t + 5 a s / (h t))
        assert layer_activation_bytes(shape(tp=t), "none") == pytest.approx(
            sbh * (10 + 24 / t + 5 * a * s / (h * t)))
        # tensor + sequence parallel: sbh/t (34 + 5 a s / h)
        assert layer_activation_bytes(shape(tp=t, sp=True), "none") == pytest.approx(
            sbh / t * (34 + 5 * a * s / h))
        # selective recomputation with sequence parallel: 34 sbh / t
        assert layer_activation_bytes(shape(tp=t, sp=True), "selective") == pytest.approx(
            34 * sbh / t)
    # full recomputation: the layer input, 2 sbh
    assert layer_activation_bytes(shape(tp=8), "full") == pytest.approx(2 * sbh)


def test_flash_attention_drops_the_score_matrix():
    plain = layer_activation_bytes(shape(), "none")
    flash = layer_activation_bytes(shape(flash=True), "none")
    assert flash < plain
    assert flash == pytest.approx(layer_activation_bytes(shape(), "selective"), rel=0.01)


def test_in_flight_microbatches():
    assert in_flight_microbatches("gpipe", 4, 1, 16) == 16
    assert in_flight_microbatches("1f1b", 4, 1, 16) == 4
    assert in_flight_microbatches("1f1b", 4, 1, 2) == 2
    assert in_flight_microbatches("interleaved-1f1b", 4, 2, 16) == pytest.approx(
        4 * (1 + 3 / 8))
    assert in_flight_microbatches("1f1b", 1, 1, 16) == 1


def test_model_state_bytes(calibration):
    from myria.sim.perf import simulate

    r = calibration[0]   # 1.7B, pure data parallel: 2 + 4 + 12 bytes per parameter
    res = simulate(r)
    n = res.memory.params_per_device
    assert res.memory.weights == pytest.approx(2 * n)
    assert res.memory.gradients == pytest.approx(4 * n)
    assert res.memory.optimizer == pytest.approx(12 * n)
    z1 = simulate(r.replace(training={"zero_stage": 1}))
    assert z1.memory.optimizer == pytest.approx(12 * n / 32)
    z3 = simulate(r.replace(training={"zero_stage": 3}))
    assert z3.memory.weights == pytest.approx(2 * n / 32)


def test_offload_moves_optimizer_to_host(calibration):
    from myria.sim.perf import simulate

    r = calibration[0].replace(training={"zero_stage": 1})
    off = simulate(r.replace(training={"offload": "cpu"}))
    on = simulate(r)
    assert off.memory.optimizer == 0 and off.memory.host_bytes_per_node > 0
    assert off.memory_gb_per_gpu < on.memory_gb_per_gpu
    assert off.breakdown["offload"] > 0 and off.iteration_time_s > on.iteration_time_s


def test_unfitting_layout_flagged(calibration):
    from myria.sim.perf import simulate

    big = calibration[-1].replace(training={"recompute": "none"})   # 1T without recompute
    res = simulate(big)
    assert not res.fits and any("GB per device" in w for w in res.warnings)
