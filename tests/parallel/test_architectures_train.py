"""Each sub-quadratic architecture trains with the real trainer on 2 gloo ranks, data parallel
and tensor parallel (heads split over tp), to the same losses, and its loss goes down; a
Griffin run stopped and resumed from its checkpoint continues bit for bit.

Griffin also runs pp2 (its mixed layer types split into stages). (A pure pp2 run cannot resume
on main either, whatever the model: the checkpoint check compares all keys with one stage's.)"""

from __future__ import annotations

import pytest

from tests.conftest import TINY, losses, train

pytestmark = pytest.mark.slow

STEPS = 6
BASE = [*TINY, "--model.kv_heads=0", f"--training.steps={STEPS}", "--checkpoint.interval=0",
        "--optimizer.lr=1e-2"]
ARCHS = {
    "block_sparse": ["--model.attention=block_sparse", "--model.attention_window=16",
                     "--model.global_tokens=4", "--model.chunk_size=16"],
    "linear": ["--model.attention=linear", "--model.chunk_size=16"],
    "retnet": ["--model.arch=retnet", "--model.chunk_size=16"],
    "griffin": ["--model.arch=griffin", "--model.attention_window=32", "--model.layers=3"],
}


def _train(run_dir, data, extra, *more):
    train(run_dir, data, *BASE, *extra, *more, nproc=2)
    return losses(run_dir)


@pytest.fixture(scope="module")
def dp2(tmp_path_factory, tiny_data):
    """Losses of each architecture's data-parallel run (made when first asked for)."""
    tmp, done = tmp_path_factory.mktemp("arch_dp2"), {}

    def get(name):
        if name not in done:
            done[name] = _train(tmp / name, tiny_data, ARCHS[name])
        return done[name]
    return get


@pytest.mark.parametrize("name", list(ARCHS))
def test_trains_data_and_tensor_parallel(name, dp2, tmp_path, tiny_data):
    dp = dp2(name)
    tp = _train(tmp_path / "tp2", tiny_data, ARCHS[name], "--parallel.tp=2")
    assert sorted(dp) == sorted(tp) == list(range(1, STEPS + 1))
    for s in dp:   # the same model and batches: tensor parallelism changes only rounding
        assert abs(dp[s] - tp[s]) <= 1e-4 * dp[s], (s, dp[s], tp[s])
    assert dp[STEPS] < dp[1] - 0.2, dp


def test_griffin_pipeline_parallel(dp2, tmp_path, tiny_data):
    """pp2 splits Griffin's mixed layers (R, R | A) into stages: the same losses as dp2."""
    pp = _train(tmp_path / "pp2", tiny_data, ARCHS["griffin"], "--parallel.pp=2")
    dp = dp2("griffin")
    for s in dp:
        assert abs(dp[s] - pp[s]) <= 1e-4 * dp[s], (s, dp[s], pp[s])


def test_griffin_resumes_bit_for_bit(dp2, tmp_path, tiny_data):
    """A data-parallel Griffin run stopped after 3 steps resumes from its checkpoint to the
    same losses, bit for bit, as the run that never stopped."""
    d = tmp_path / "resumed"
    _train(d, tiny_data, ARCHS["griffin"], "--checkpoint.interval=3", "--stop-after", "3")
    assert max(losses(d)) == 3
    assert _train(d, tiny_data, ARCHS["griffin"], "--checkpoint.interval=3") == dp2("griffin")
