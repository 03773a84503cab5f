"""Retention by validity: a damaged checkpoint is quarantined, never counted, pruned into or named
by `latest`; the newest loadable checkpoint is never deleted; a resumed run's history is truthful.

Unit tests drive CheckpointManager directly (one process, no training); the end-to-end tests
damage the newest checkpoint of a real run with keep = 1, 2, 3 and every checkpoint, resume,
and compare with the uninterrupted run bit for bit.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from myria.errors import CheckpointError
from myria.train.checkpoint.pipeline import CheckpointManager
from myria.train.metrics import set_aside_after
from tests.conftest import TINY, final_params
from tests.conftest import train as train_job
from tests.resilience.test_checkpoint import Target


def flip(path):
    """Flip 16 bytes in the middle of the checkpoint's largest shard (same size)."""
    victim = max((q for q in path.iterdir() if q.suffix == ".distcp"),
                 key=lambda q: q.stat().st_size)
    data = bytearray(victim.read_bytes())
    mid = len(data) // 2
    data[mid:mid + 16] = bytes(x ^ 0xFF for x in data[mid:mid + 16])
    victim.write_bytes(bytes(data))


def loadable(mgr):
    return [p.name for p in mgr.committed() if mgr.verify(p) is None]


def check_invariants(mgr, newest_loadable_before):
    """`latest` names a loadable checkpoint; the newest loadable one was not lost."""
    ok = loadable(mgr)
    latest = mgr.dir / "latest"
    if ok:
        assert latest.read_text().strip() == ok[-1]
    else:
        assert not latest.exists()
    if newest_loadable_before:  # still there, or a newer loadable one exists
        assert newest_loadable_before in ok or (ok and ok[-1] > newest_loadable_before)
    assert all(mgr.verify(p) is None for p in mgr.committed()), "a damaged one is counted"


@pytest.mark.parametrize("keep", [1, 2, 3])
def test_damaged_newest_is_quarantined_and_good_ones_survive(tmp_path, keep):
    mgr = CheckpointManager(tmp_path / "ck", keep=3)
    t = Target()
    for step in (40, 80, 120):
        mgr.save(step, t, {"step_state": step})
        t.update()
    flip(mgr.path_for(120))
    # a new process resumes: 120 is damaged, moved aside, `latest` names what it loads
    mgr = CheckpointManager(tmp_path / "ck", keep=keep)
    before = loadable(mgr)[-1] if loadable(mgr) else None
    chosen = mgr.choose_resume()
    assert chosen == mgr.path_for(80)
    q = mgr.quarantined()
    assert [p.name for p in q] == ["step_00000120"]
    assert "fails its checksum" in json.loads((q[0] / "QUARANTINED.json").read_text())["reason"]
    check_invariants(mgr, before)
    # training goes on: 81 (stop), then 120 saved again into a fresh directory
    for step in (81, 120):
        before = loadable(mgr)[-1] if loadable(mgr) else None
        assert mgr.save(step, t, {})
        t.update()
        check_invariants(mgr, before)
        assert len(mgr.committed()) <= keep
    assert [p.name for p in mgr.committed()][-1] == "step_00000120"
    assert mgr.verify(mgr.path_for(120)) is None
    assert [p.name for p in mgr.quarantined()] == ["step_00000120"]  # the damaged one kept


def test_keep_one_with_damaged_newest_never_drops_the_loadable_one(tmp_path):
    """The reported data loss: keep=1 deleted 80 and 81 and kept the damaged 120."""
    mgr = CheckpointManager(tmp_path / "ck", keep=3)
    t = Target()
    for step in (80, 120):
        mgr.save(step, t, {})
    flip(mgr.path_for(120))
    mgr = CheckpointManager(tmp_path / "ck", keep=1)
    assert mgr.choose_resume() == mgr.path_for(80)
    assert mgr.save(81, t, {})
    assert [p.name for p in mgr.committed()] == ["step_00000081"]
    assert (mgr.dir / "latest").read_text().strip() == "step_00000081"


def test_a_reader_quarantines_and_points_latest_at_what_it_uses(tmp_path, caplog):
    """export and generate (CheckpointStore.latest_valid) move a damaged and a manifest-less
    checkpoint aside as train does, saying so, and `latest` names the one they use; a garbage
    .metadata is read as one CheckpointError line."""
    from myria.train.checkpoint.store import CheckpointStore

    mgr = CheckpointManager(tmp_path / "ck", keep=3)
    t = Target()
    for step in (40, 80, 120):
        mgr.save(step, t, {})
    flip(mgr.path_for(120))
    (mgr.path_for(80) / "meta.json").unlink()
    with caplog.at_level("WARNING", logger="myria"):
        assert CheckpointStore(tmp_path / "ck").latest_valid() == mgr.path_for(40)
    assert "step_00000080 is damaged (its meta.json is missing" in caplog.text
    assert [p.name for p in mgr.quarantined()] == ["step_00000080", "step_00000120"]
    assert (mgr.dir / "latest").read_text().strip() == "step_00000040"
    (mgr.path_for(40) / ".metadata").write_bytes(b"\x80garbage")
    with pytest.raises(CheckpointError, match="could not be read") as e:
        mgr.load(mgr.path_for(40), Target(seed=99))
    assert "\n" not in str(e.value)


def test_damage_found_while_pruning_is_quarantined_not_counted(tmp_path):
    mgr = CheckpointManager(tmp_path / "ck", keep=2)
    t = Target()
    for step in (1, 2):
        mgr.save(step, t, {})
    flip(mgr.path_for(2))
    mgr = CheckpointManager(tmp_path / "ck", keep=2)  # knows nothing of 1 and 2
    mgr._verified.clear()
    mgr.save(3, t, {})
    assert [p.name for p in mgr.committed()] == ["step_00000001", "step_00000003"]
    assert [p.name for p in mgr.quarantined()] == ["step_00000002"]


def test_a_checkpoint_whose_manifest_was_removed_is_kept_aside_not_deleted(tmp_path):
    """A step directory without meta.json (removed by hand after its commit) is not loaded,
    and saving that step again does not delete it: it goes to quarantine/ with its reason."""
    mgr = CheckpointManager(tmp_path / "ck", keep=3)
    t = Target()
    for step in (4, 8):
        mgr.save(step, t, {})
    (mgr.path_for(8) / "meta.json").unlink()
    mgr = CheckpointManager(tmp_path / "ck", keep=3)
    assert mgr.choose_resume().name == "step_00000004"
    assert [p.name for p in mgr.quarantined()] == ["step_00000008"]
    why = json.loads((mgr.dir / "quarantine" / "step_00000008" / "QUARANTINED.json").read_text())
    assert "meta.json is missing" in why["reason"]
    # the same on the save of that step, without a resume in between
    (mgr.path_for(4) / "meta.json").unlink()
    mgr.save(4, t, {})
    assert sorted(p.name for p in mgr.quarantined()) == ["step_00000004", "step_00000008"]
    assert (mgr.path_for(4) / "meta.json").exists()


def test_every_checkpoint_damaged_stops_with_one_clear_error(tmp_path):
    mgr = CheckpointManager(tmp_path / "ck", keep=3)
    t = Target()
    for step in (4, 8):
        mgr.save(step, t, {})
        flip(mgr.path_for(step))
    mgr = CheckpointManager(tmp_path / "ck", keep=3)
    with pytest.raises(CheckpointError) as e:
        mgr.choose_resume()
    msg = str(e.value)
    assert "step_00000004" in msg and "step_00000008" in msg and "--resume-from" in msg
    assert "--start-fresh" in msg and "fails its checksum" in msg
    assert not (mgr.dir / "latest").exists()
    # nothing was deleted, and asking again still refuses: no silent restart from step 0
    assert len(mgr.quarantined()) == 2
    with pytest.raises(CheckpointError):
        CheckpointManager(tmp_path / "ck").choose_resume()
    # an explicit fresh start is allowed, remembered, and keeps the damaged ones
    assert CheckpointManager(tmp_path / "ck").choose_resume(allow_fresh=True) is None
    assert CheckpointManager(tmp_path / "ck").choose_resume() is None
    assert len(mgr.quarantined()) == 2


def test_metrics_of_abandoned_steps_are_set_aside(tmp_path):
    rows = [{"step": s, "loss": 10.0 - s} for s in range(1, 7)] + [{"step": 4, "val_loss": 3}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows)
                                            + '{"step": 7, "lo')  # cut by a crash
    assert set_aside_after(tmp_path, 3) == 5
    kept = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in kept] == [1, 2, 3]
    gone = [json.loads(x) for x in
            (tmp_path / "metrics.abandoned.jsonl").read_text().splitlines()]
    assert [r.get("step") for r in gone] == [4, 5, 6, 4, None]
    assert all(r["resumed_from"] == 3 for r in gone)
    assert set_aside_after(tmp_path, 3) == 0
    # the config changes of the abandoned timeline too: a run resumed at 4 changed lr from
    # step 5, at 8 from step 9; resumed at 4 again, step 9's change goes aside, step 5's stays
    # (the same resume applies it again)
    from myria.train.metrics import MetricsLogger

    (tmp_path / "config_changes.jsonl").write_text("".join(
        json.dumps({"step": s, "field": "optimizer.lr", "old": 1, "new": s}) + "\n"
        for s in (5, 9)))
    MetricsLogger(tmp_path, 12, 4, enabled=True, tensorboard=False, progress=False)
    kept = [json.loads(x) for x in (tmp_path / "config_changes.jsonl").read_text().splitlines()]
    gone = [json.loads(x) for x in
            (tmp_path / "config_changes.abandoned.jsonl").read_text().splitlines()]
    assert [r["step"] for r in kept] == [5] and [r["step"] for r in gone] == [9]


def test_a_skipped_steps_nan_is_written_as_strict_json(tmp_path, capsys):
    """metrics.jsonl stays strict JSON (jq, browsers, pandas) when a step's loss is not finite:
    null in the file, and the run's summary line says the step was skipped."""
    from myria.train.cli import _summary
    from myria.train.metrics import MetricsLogger

    m = MetricsLogger(tmp_path, 3, 0, enabled=True, tensorboard=False, progress=False)
    row = {"tokens_per_s": 100.0, "step_time_s": 1.0, "data_wait_s": 0.0, "lr": 1e-3,
           "mfu": None}
    m.log({**row, "step": 1, "loss": 5.0, "grad_norm": float("inf"), "skipped": False,
           "loss_by_source": {"web": float("nan")}})
    m.log({**row, "step": 2, "loss": float("nan"), "grad_norm": float("nan"), "skipped": True})
    m.log({**row, "step": 3, "loss": float("inf"), "grad_norm": 1.0, "skipped": True})
    m.close()

    def strict(const):
        raise AssertionError(f"{const} is not JSON")

    rows = [json.loads(x, parse_constant=strict)
            for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["grad_norm"] == "inf" and rows[0]["loss_by_source"] == {"web": None}
    assert rows[1]["loss"] is None and rows[1]["skipped"] is True and rows[2]["loss"] == "inf"
    _summary(tmp_path)
    assert "loss 5.000 -> inf (step skipped)" in capsys.readouterr().out


# -- end to end: a damaged newest checkpoint of a real run ---------------------------------------

def train(run_dir, data, *extra, nproc=1, check=True):
    return train_job(run_dir, data, *TINY, "--training.steps=12", "--checkpoint.interval=4",
                     *extra, nproc=nproc, check=check)


def rows(run_dir):
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()
            if "loss" in x]


@pytest.fixture(scope="module")
def straight(tmp_path_factory, tiny_data):
    """12 steps, checkpoints at 4, 8, 12, all kept."""
    d = tmp_path_factory.mktemp("straight")
    train(d, tiny_data, "--checkpoint.keep=3")
    return d


def same_as_straight(run, straight):
    got, ref = rows(run), rows(straight)
    assert [r["step"] for r in got] == list(range(1, 13)), "each step exactly once"
    assert [r["loss"] for r in got] == [r["loss"] for r in ref]  # exact floats
    pa, pb = final_params(straight), final_params(run)
    assert pa.keys() == pb.keys() and all(torch.equal(pa[k], pb[k]) for k in pa)
    mgr = CheckpointManager(run / "checkpoints")
    ok = mgr.committed()
    assert ok and all(mgr.verify(p) is None for p in ok)
    assert (run / "checkpoints" / "latest").read_text().strip() == ok[-1].name


@pytest.mark.parametrize("keep", [1, pytest.param(2, marks=pytest.mark.slow),
                                  pytest.param(3, marks=pytest.mark.slow)])
def test_resume_past_a_damaged_newest_checkpoint(tmp_path, tiny_data, straight, keep):
    run = tmp_path / "run"
    shutil.copytree(straight, run)
    flip(run / "checkpoints" / "step_00000012")
    # resume from 8, stop after 9 (as the report's run did), then finish
    p = train(run, tiny_data, f"--checkpoint.keep={keep}", "--stop-after", "9")
    assert "is damaged" in p.stderr and "resumed from" in p.stdout and "step 8" in p.stdout
    mgr = CheckpointManager(run / "checkpoints")
    names = [x.name for x in mgr.committed()]
    assert names[-1] == "step_00000009" and len(names) <= keep
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_00000009"
    assert [x.name for x in mgr.quarantined()] == ["step_00000012"]
    assert max(r["step"] for r in rows(run)) == 9
    train(run, tiny_data, f"--checkpoint.keep={keep}")
    same_as_straight(run, straight)
    abandoned = (run / "metrics.abandoned.jsonl").read_text().splitlines()
    assert sorted(json.loads(x)["step"] for x in abandoned) == [9, 10, 11, 12]


def test_every_checkpoint_damaged_then_fresh_start(tmp_path, tiny_data, straight):
    run = tmp_path / "run"
    shutil.copytree(straight, run)
    for s in (4, 8, 12):
        flip(run / "checkpoints" / f"step_{s:08d}")
    p = train(run, tiny_data, check=False)
    assert p.returncode == 2 and "Traceback" not in p.stderr
    err = [x for x in p.stderr.splitlines() if "error:" in x]
    assert len(err) == 1 and "step_00000012" in err[0] and "--start-fresh" in err[0], p.stderr
    assert not list((run / "checkpoints").glob("step_*"))  # all moved aside, none deleted
    assert len(list((run / "checkpoints" / "quarantine").glob("step_*"))) == 3
    p = train(run, tiny_data, check=False)  # asked again: still no silent restart
    assert p.returncode == 2
    # loading a damaged one anyway, as the refusal offers, when it cannot be read: one line
    for f in (run / "checkpoints" / "quarantine" / "step_00000012").glob("*.distcp"):
        f.write_bytes(f.read_bytes()[:100])
    p = train(run, tiny_data, "--resume-from", "12", "--training.steps=13", check=False)
    err = [x for x in p.stderr.splitlines() if "error:" in x]
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
    assert len(err) == 1 and "could not be read" in err[0] and "--start-fresh" in err[0], err
    train(run, tiny_data, "--start-fresh")
    same_as_straight(run, straight)  # from step 0 with the same seed: the straight run again
    # asked again with checkpoints that verify: it resumes, and says --start-fresh did nothing
    p = train(run, tiny_data, "--start-fresh", "--training.steps=13")
    assert "--start-fresh applies only when every checkpoint is damaged; step_00000012 " \
        "verifies" in p.stdout, p.stdout
    # a fresh start on purpose: the checkpoints go aside, said as such (not "damaged")
    train(run, tiny_data, "--checkpoint.resume=false", "--training.steps=1")
    why = [json.loads((q / "QUARANTINED.json").read_text())["reason"]
           for q in (run / "checkpoints" / "quarantine").iterdir()
           if q.name.startswith("step_00000013")]
    assert why and why[0].startswith("a fresh start of the run directory"), why


@pytest.mark.slow
def test_two_ranks_resume_past_a_damaged_checkpoint_bitwise(tmp_path, tiny_data):
    ref, run = tmp_path / "ref", tmp_path / "run"
    train(ref, tiny_data, nproc=2)
    shutil.copytree(ref, run)
    flip(run / "checkpoints" / "step_00000012")
    train(run, tiny_data, "--checkpoint.keep=1", nproc=2)
    same_as_straight(run, ref)


def test_tensorboard_shows_one_value_per_step_after_a_rollback(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from myria.train.metrics import MetricsLogger

    def log(start, end, loss):
        m = MetricsLogger(tmp_path, 6, start, True, tensorboard=True, progress=False)
        for s in range(start + 1, end + 1):
            m.log({"step": s, "loss": loss + s, "lr": 0.1, "grad_norm": 1.0,
                   "tokens_per_s": 1.0, "step_time_s": 0.1, "data_wait_s": 0.0, "mfu": None})
        m.close()

    log(0, 6, 100.0)   # the abandoned timeline
    log(3, 6, 200.0)   # resumed from step 3
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    got = [(e.step, e.value) for e in acc.Scalars("train/loss")]
    assert got == [(1, 101.0), (2, 102.0), (3, 103.0), (4, 204.0), (5, 205.0), (6, 206.0)]
    kept = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["loss"] for r in kept] == [101.0, 102.0, 103.0, 204.0, 205.0, 206.0]
