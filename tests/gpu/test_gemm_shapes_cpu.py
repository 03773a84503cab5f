"""bench/gpu_gemm_shapes.py: its fit, and the whole script at toy sizes on the CPU (`--cpu`).

Not marked `gpu`: it runs in the normal suite, so the measurement a lent GPU makes of
GEMM_HALF_DIM never rots. The GPU figures themselves come from bench/gpu/run.sh.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import ROOT, bench_module


def _script():
    return bench_module("gpu_gemm_shapes")


@pytest.mark.parametrize("half_dim", [0.0, 24.0, 96.0])
def test_the_fit_recovers_the_half_dimension_that_made_the_rates(half_dim):
    from myria.sim.op_timing import shape_factor

    dims = [(m, 6144, 12288) for m in (64, 128, 256, 512, 1024, 2048)]
    pts = [(d, 300e12 * shape_factor(d, half_dim)) for d in dims]
    fit = _script().fit_half_dim(pts)
    assert fit["half_dim"] == pytest.approx(half_dim, abs=0.05)
    assert fit["large_gemm_flops"] == pytest.approx(300e12, rel=1e-3)
    assert fit["rms_log_residual"] < 1e-3
    # a noisy measurement still lands near it, and says how far the curve is from the points
    noisy = [(d, r * (1.03 if i % 2 else 0.97)) for i, (d, r) in enumerate(pts)]
    fit = _script().fit_half_dim(noisy)
    assert abs(fit["half_dim"] - half_dim) < 12 and 0.02 < fit["rms_log_residual"] < 0.04


def test_the_ladder_gemms_are_the_models_own_at_tp8():
    tp, gemms = _script().ladder_gemms(cpu=False)
    assert tp == 8
    # GPT-3 175B (hidden 12,288, ffn 49,152, 96 heads of 128) at sequence 2,048, micro-batch 1
    assert gemms == [("qkv", 2048, 4608, 12288), ("attn_out", 2048, 12288, 1536),
                     ("fc1", 2048, 6144, 12288), ("fc2", 2048, 12288, 6144)]


def test_gemm_shapes_cpu_mode(tmp_path):
    out = tmp_path / "gemm.json"
    p = subprocess.run([sys.executable, "bench/gpu_gemm_shapes.py", "--cpu", "--seconds",
                        "0.02", "--out", str(out)],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    r = json.loads(out.read_text())
    assert [x["gemm"] for x in r["pieces"]] == ["qkv", "attn_out", "fc1", "fc2"]
    for x in r["pieces"]:
        assert x["whole_s"] > 0 and x["pieces_s"] > 0 and x["model_ratio_at_prior"] > 1
        assert x["measured_ratio"] == pytest.approx(x["pieces_s"] / x["whole_s"])
    assert [x["m"] for x in r["sweep"]] == [16, 32, 64, 128, 256]
    assert r["fit"]["half_dim"] >= 0 and r["prior_half_dim"] == 32.0
    assert "fitted GEMM_HALF_DIM" in p.stdout and "say nothing of a GPU" in p.stdout
