"""Shrink without a spare, grow back with one (`resilience.shrink`, pure DDP): the survivors
of a lost replica go on as a smaller group on the same global batch, losses within the layout
tests' reduction-order tolerance of the run that never failed, and the run grows back to its
full size once the spare the supervisor starts is ready."""

from __future__ import annotations

import json

import numpy as np
import pytest

from myria.data.loader import BatchLoader
from myria.layout import Layout
from myria.train.rejoin import choose
from tests.conftest import TINY, run_cli


@pytest.mark.parametrize("global_batch,micro,dp", [(16, 4, 3), (6, 2, 2), (16, 2, 3),
                                                   (8, 2, 4), (12, 1, 5)])
def test_shares_cover_the_global_batch_once(global_batch, micro, dp):
    lay = Layout(dp_shard=dp)
    shares = [lay.share(global_batch, micro, r).microbatches for r in range(dp)]
    assert {lay.share(global_batch, micro, r).loss_divisor for r in range(dp)} == {
        global_batch / micro / dp}
    assert [i for s in shares for i in s] == list(range(global_batch // micro))
    sizes = [len(s) for s in shares]
    assert max(sizes) - min(sizes) <= 1 and min(sizes) >= 1
    if global_batch % (dp * micro) == 0:   # the usual run: equal contiguous slices, as before
        assert len(set(sizes)) == 1


def test_an_uneven_loader_reads_every_sample_of_the_step_once(tiny_data):
    from myria.data.dataset import TokenDataset

    ds = TokenDataset(tiny_data, 64)
    full = BatchLoader(ds, 16, 4, 0, 1, seed=3, prefetch=0)
    parts = [BatchLoader(ds, 16, 4, r, 3, seed=3, prefetch=0,
                         microbatches=Layout(dp_shard=3).share(16, 4, r).microbatches)
             for r in range(3)]
    for step in (0, 7):
        got = np.concatenate([p.indices(step) for p in parts])
        assert np.array_equal(got, full.indices(step))
        assert [p.make_batch(step).inputs.shape[0] for p in parts] == [2, 1, 1]


def _info(rank, own=(), holds=None, held=(), fresh=False, ring=None):
    return {"rank": rank, "fresh": fresh, "own": list(own), "holds": holds,
            "held": {s: {} for s in held}, "ring": ring}


def test_a_new_rank_of_replicas_takes_a_survivors_own_copy():
    # grown back from 2 ranks to 3: the survivors' ring had 2 ranks, so rank 1 of the shrunk
    # ring "holds rank 0" in its numbering, not the new rank 2's state
    infos = [_info(0, (37, 38), 1, (37, 38), ring=2), _info(1, (38,), 0, (38,), ring=2),
             _info(2, fresh=True)]
    assert choose(infos) is None   # not replicas: no copy of rank 2 anywhere
    assert choose(infos, replicas=True) == {"step": 38, "sources": {2: 0}, "replica": [2]}
    # a shrunk attempt: survivors only, each its own copy
    assert choose(infos[:2]) == {"step": 38, "sources": {}, "replica": []}


def test_shrink_is_refused_in_one_line_on_a_sharded_layout(tmp_path, tiny_data):
    # the shipped demo shards the model (zero2): a survivor cannot stand in for a lost shard
    p = run_cli("supervise", "--config", "configs/demo.toml", "--run-dir", str(tmp_path),
                "--nproc", "4", f"--data.path={tiny_data}", "--resilience.recovery=in-job",
                "--resilience.shrink=true", check=False)
    assert p.returncode == 2, p.stderr
    err = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert len(err) == 1 and "resilience.shrink" in err[0] and "'zero2'" in err[0], err
    assert "Traceback" not in p.stderr


STEPS = 120
SHRINK = [*TINY, "--training.global_batch=6", f"--training.steps={STEPS}",
          "--training.data_parallel=ddp", "--checkpoint.interval=40",
          "--training.eval_interval=0"]


def _losses(run_dir):
    out = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        if "loss" in r and "step" in r:
            out[r["step"]] = r["loss"]
    return out


@pytest.mark.slow
def test_a_lost_replica_shrinks_the_run_and_a_ready_spare_grows_it_back(tmp_path, tiny_data):
    ref = tmp_path / "ref"
    run_cli("train", "--run-dir", str(ref), "--nproc", "3", f"--data.path={tiny_data}",
            *SHRINK)
    run = tmp_path / "run"
    p = run_cli("supervise", "--run-dir", str(run), "--nproc", "3", f"--data.path={tiny_data}",
                *SHRINK, "--resilience.heartbeat_s=0.5", "--resilience.hang_timeout_s=20",
                "--resilience.diagnose=false", "--resilience.recovery=in-job",
                "--resilience.shrink=true", "--resilience.sdc_interval=2",  # checks while shrunk
                env={"MYRIA_FAULT": "kill:rank=1:step=5"},
                timeout=400)
    out = p.stdout + p.stderr   # survivors say the run shrinks: nothing replaces rank 1 yet
    assert all("grows back" in x for x in out.splitlines()
               if "the supervisor replaces rank(s) [1]" in x), out   # only when the spare is in
    assert "the run goes on without rank(s) [1] (2 of 3 ranks, no spare ready)" in out, out
    s = json.loads((run / "supervisor_summary.json").read_text())
    assert s["status"] == "succeeded" and s["final_step"] == STEPS, s
    f = s["faults"][0]
    # one fault: the compute check recomputes a partner's microbatch with the same loss
    # divisor also when the shares differ (2 and 1); it once named both ranks (sdc, restart)
    assert len(s["faults"]) == 1 and f["recovery"] == "in-job: shrink", s["faults"]
    assert f["fault_to_first_step_s"] < 10, f
    # 3 microbatches of the global batch on 2 ranks: 2 and 1, the same batch as on 3
    shrink, grow = s["resizes"]
    assert shrink["kind"] == "shrink" and shrink["ranks"] == [0, 2], s["resizes"]
    assert grow["kind"] == "grow" and grow["ranks"] == [0, 1, 2], s["resizes"]
    assert grow["resumed_from"] > f["resumed_from"] and grow["to_first_step_s"] < 10, grow
    log = (run / "supervisor.log").read_text()
    assert "ACTION in-job shrink" in log and "ACTION in-job grow" in log
    assert "ACTION stop the worker group" not in log   # nobody restarted
    # the summary counts what the log counts: attempts used by the shrink and the grow
    assert s["attempts"] == 2 and "2 attempt(s) after the first (1 shrink, 1 grow)" in log
    # every step's loss within the layout tests' reduction-order tolerance of the run that
    # never failed (before the fault: the same bits)
    got, want = _losses(run), _losses(ref)
    assert sorted(got) == sorted(want) == list(range(1, STEPS + 1))
    for step in want:
        assert abs(got[step] - want[step]) <= 1e-4 * abs(want[step]), (step, got, want)
    assert all(got[k] == want[k] for k in range(1, 6))
    g = s["goodput"]   # the ledger still adds up across both resizes
    assert g["accounted_s"] == pytest.approx(g["wall_s"], rel=0.01), g
