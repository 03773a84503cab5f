"""MFU convention (72 B s l h^2 ...) and the calibration error bound."""

from __future__ import annotations

import pytest

from myria.models.flops import megatron_gpt_flops_per_iteration, model_flops_per_token
from myria.sim.perf import simulate


def test_model_flops_equal_megatron_formula(calibration):
    for r in calibration:
        cfg = r.model_config()
        b, s = r.training.global_batch, cfg.seq_len
        want = megatron_gpt_flops_per_iteration(b, s, cfg.layers, cfg.hidden, cfg.vocab_size)
        assert model_flops_per_token(cfg, "megatron") * b * s == pytest.approx(want, rel=1e-12)
        res = simulate(r)
        assert res.details["megatron_flops_per_iteration"] == pytest.approx(want, rel=1e-12)
        # the paper's hardware figure counts the recompute forward: 96 instead of 72
        assert res.details["hardware_flops_per_iteration"] == pytest.approx(want * 96 / 72,
                                                                            rel=1e-9)
        t = res.iteration_time_s
        assert res.mfu_megatron == pytest.approx(want / t / r.cluster.gpus / 312e12)
        # one MFU convention with the live meter: model_flops_per_token(cfg) ("dense")
        dense = model_flops_per_token(cfg) * b * s
        assert res.details["model_flops_per_iteration"] == pytest.approx(dense, rel=1e-12)
        assert res.tflops_per_gpu == pytest.approx(dense / t / r.cluster.gpus / 1e12)
        assert res.mfu == pytest.approx(res.tflops_per_gpu / 312.0)
        assert res.mfu > res.mfu_megatron  # the output layer at 3x, not 2.25x


def test_calibration_error(calibration):
    errs = []
    for r in calibration:
        res = simulate(r)
        err = res.iteration_time_s / r.measured["iteration_time_s"] - 1
        assert abs(err) < 0.10, (r.name, err)
        errs.append(abs(err))
        assert res.fits, r.name   # these runs happened, so they fit in 80 GB
    assert sum(errs) / len(errs) <= 0.05


def test_the_fitted_constant_is_at_its_fit(calibration):
    """E_GEMM, the one fitted constant, is the calibration's optimum for the model as it is:
    a change to the model that moves the optimum must refit it (`bench/sim_calibration.py
    --fit`), or the stored figure describes another model."""
    from myria.sim.calibration import fit_gemm
    from myria.sim.hardware import build_hardware
    from myria.sim.operators import DEFAULT_EFFICIENCY

    hws = [build_hardware(r.cluster, r.training.precision) for r in calibration]
    best, _ = fit_gemm(calibration, hws, DEFAULT_EFFICIENCY)
    assert DEFAULT_EFFICIENCY.gemm == pytest.approx(best, abs=0.0026), best


def test_breakdown_sums_to_iteration_time(calibration, llama):
    for r in [*calibration, llama]:
        res = simulate(r)
        assert sum(res.breakdown.values()) == pytest.approx(res.iteration_time_s, rel=1e-9)
        assert all(v >= 0 for v in res.breakdown.values())
        j = res.to_json()
        for key in ("name", "iteration_time_s", "mfu", "tokens_per_s", "tflops_per_gpu",
                    "hardware_tflops_per_gpu", "memory_gb_per_gpu", "fits", "breakdown"):
            assert key in j
        assert j["tokens_per_s"] == pytest.approx(
            r.training.global_batch * r.model.seq_len / j["iteration_time_s"])


def test_band_is_the_jackknife_plus_quantile_and_json_carries_it(capsys):
    import json

    from myria.cli import main
    from myria.sim.band import UNCERTAINTY, band_from, uncertainty

    stored = json.loads(UNCERTAINTY.read_text())
    errs = list(stored["held_out_errors"].values())
    # ceil((n + 1) 0.9) = 10th of 10 |held-out errors|: the largest, not the 90th percentile
    assert len(errs) == 10 and stored["nominal_coverage"] == 0.9
    assert stored["band"] == pytest.approx(max(abs(e) for e in errs))
    assert band_from(errs) == pytest.approx(stored["band"])
    assert band_from(errs, 0.5) == sorted(abs(e) for e in errs)[5]
    # each row's held-out error lies inside the band built from the other nine rows
    inside = sum(abs(e) <= band_from(errs[:i] + errs[i + 1:]) for i, e in enumerate(errs))
    assert inside >= 8
    assert main(["simulate", "--json", "--run", "megatron-lm-2021-1.7b"]) == 0
    j = json.loads(capsys.readouterr().out.splitlines()[0])
    b = uncertainty()
    assert j["band"] == pytest.approx(b) and j["band_nominal_coverage"] == 0.9
    assert j["iteration_time_low_s"] == pytest.approx(j["iteration_time_s"] * (1 - b))
    assert j["mfu_low"] < j["mfu"] < j["mfu_high"]
    # the leave-one-out error the band comes from is reported with it, and in the table
    mae = sum(abs(e) for e in errs) / len(errs)
    assert j["band_held_out_mae"] == pytest.approx(mae) and mae < b
    assert main(["simulate", "--run", "megatron-lm-2021-1.7b"]) == 0
    assert f"leave-one-out mean absolute error {mae:.2%}" in capsys.readouterr().out


def test_hardware_flops_count_the_causal_attention_flash_attention_runs(calibration):
    """MFU charges attention for every key; what runs under causal FlashAttention is the causal
    count (about half the attention), unfused attention the whole score matrix."""
    from myria.models.flops import forward_flops_per_token

    run = calibration[0].replace(model={"seq_len": 16384},
                                 kernels={"flash_attention": True, "flash_version": "fa2"},
                                 training={"recompute": "none"})
    res = simulate(run)
    cfg = run.model_config()
    tokens = run.training.global_batch * cfg.seq_len
    fw, fc = forward_flops_per_token(cfg, "dense"), forward_flops_per_token(cfg, "causal")
    skipped = 3 * (fw.attn_scores + fw.attn_values - fc.attn_scores - fc.attn_values) * tokens
    dense = res.details["model_flops_per_iteration"]
    assert res.details["hardware_flops_per_iteration"] == pytest.approx(dense - skipped)
    assert res.mfu_causal == pytest.approx(res.mfu * (dense - skipped) / dense)
    assert res.mfu - res.mfu_causal > 0.05   # a long sequence: attention is a large share
    unfused = simulate(run.replace(kernels={"flash_attention": False}))
    assert unfused.details["hardware_flops_per_iteration"] == pytest.approx(dense)
