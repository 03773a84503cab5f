"""A Gated DeltaNet + Mamba-2 + attention + RG-LRU hybrid trains with the real trainer under
TP2 x PP2 on 4 gloo ranks (heads split in every mixer, the mixed layers split into stages) to
the losses of one process (1e-4); a run stopped and resumed from its checkpoint continues bit
for bit, and `myria generate` decodes from its checkpoint. The other layouts and their mixes
(FSDP, TP2, PP2, HSDP) are in bench/hybrids.py --layouts (bench/RESULTS.md)."""

from __future__ import annotations

import pytest

from tests.conftest import TINY, assert_bit_equal, losses, run_cli, train

pytestmark = pytest.mark.slow

STEPS = 6
HYBRID = [*TINY, "--model.layers=4", "--model.arch=hybrid", "--model.block_pattern=DMAR",
          "--model.chunk_size=16", "--model.ssm_state=16", f"--training.steps={STEPS}",
          "--checkpoint.interval=0", "--optimizer.lr=1e-2"]


def _train(run_dir, data, *more, nproc=1):
    train(run_dir, data, *HYBRID, *more, nproc=nproc)
    return losses(run_dir)


@pytest.fixture(scope="module")
def ref(tmp_path_factory, tiny_data):
    d = tmp_path_factory.mktemp("hybrid") / "ref"
    got = _train(d, tiny_data)
    assert sorted(got) == list(range(1, STEPS + 1)) and got[STEPS] < got[1] - 0.2, got
    return d, got


def test_hybrid_tp2_pp2_matches_one_process(ref, tmp_path, tiny_data):
    got = _train(tmp_path / "tp2xpp2", tiny_data, "--parallel.tp=2", "--parallel.pp=2",
                 nproc=4)
    assert sorted(got) == sorted(ref[1])
    for s, want in ref[1].items():
        assert abs(got[s] - want) <= 1e-4 * want, (s, got[s], want)


def test_hybrid_resumes_bit_for_bit_and_generates(ref, tmp_path, tiny_data):
    d = tmp_path / "resumed"
    _train(d, tiny_data, "--checkpoint.interval=3", "--stop-after", "3")
    assert max(losses(d)) == 3
    _train(d, tiny_data, "--checkpoint.interval=3")
    assert_bit_equal(d, ref[0], STEPS)
    out = run_cli("generate", "--run-dir", str(d), "--prompt", "My fellow citizens",
                  "--max-new-tokens", "8", "--temperature", "0").stdout
    assert out.startswith("My fellow citizens") and "8 tokens in" in out, out
