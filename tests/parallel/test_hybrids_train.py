"""A Gated DeltaNet + Mamba-2 + attention + RG-LRU hybrid trains with the real trainer under
FSDP x TP2 and TP2 x PP2 on 4 gloo ranks to the losses of one process (1e-4), and a run
stopped and resumed from its checkpoint continues bit for bit. The other layouts and their
mixes are in bench/hybrids.py --layouts (bench/RESULTS.md)."""

from __future__ import annotations

import pytest

from tests.conftest import TINY, assert_bit_equal, losses, run_cli

pytestmark = pytest.mark.slow

STEPS = 6
HYBRID = [*TINY, "--model.layers=4", "--model.arch=hybrid", "--model.block_pattern=DMAR",
          "--model.chunk_size=16", "--model.ssm_state=16", f"--training.steps={STEPS}",
          "--checkpoint.interval=0", "--optimizer.lr=1e-2"]


def _train(run_dir, data, *more, nproc=1):
    run_cli("train", "--run-dir", str(run_dir), f"--data.path={data}", *HYBRID, *more,
            *(["--nproc", str(nproc)] if nproc > 1 else []))
    return losses(run_dir)


def test_hybrid_layouts_match_one_process_and_resume_bitwise(tmp_path, tiny_data):
    ref = _train(tmp_path / "ref", tiny_data)
    assert sorted(ref) == list(range(1, STEPS + 1)) and ref[STEPS] < ref[1] - 0.2, ref
    for name, extra in {"dp2xtp2": ["--parallel.tp=2"],
                        "tp2xpp2": ["--parallel.tp=2", "--parallel.pp=2"]}.items():
        got = _train(tmp_path / name, tiny_data, *extra, nproc=4)
        assert sorted(got) == sorted(ref)
        for s in ref:
            assert abs(got[s] - ref[s]) <= 1e-4 * ref[s], (name, s, got[s], ref[s])
    d = tmp_path / "resumed"
    _train(d, tiny_data, "--checkpoint.interval=3", "--stop-after", "3")
    assert max(losses(d)) == 3
    _train(d, tiny_data, "--checkpoint.interval=3")
    assert_bit_equal(d, tmp_path / "ref", STEPS)
