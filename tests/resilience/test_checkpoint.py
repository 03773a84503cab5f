"""Two-stage checkpoints in one process: snapshot isolation, one save in flight, failed saves,
checksum-verified resume, and the same files whichever way they were written."""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from pathlib import Path

import pytest
import torch

from myria.faults import FaultInjector
from myria.train.checkpoint.pipeline import CheckpointManager, SaveError


class Target:
    """Something shaped like the Engine's checkpoint state."""

    def __init__(self, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.w = torch.randn(256, 64, generator=g)
        self.b = torch.randn(64, generator=g)
        self.m = torch.zeros(256, 64)
        self.lr = 0.1

    def state_dict(self):
        return {"model": {"w": self.w, "b": self.b},
                "optim": {"state.w.exp_avg": self.m, "param_groups.w.lr": self.lr}}

    def load_state_dict(self, state):
        self.w.copy_(state["model"]["w"])
        self.b.copy_(state["model"]["b"])
        self.m.copy_(state["optim"]["state.w.exp_avg"])
        self.lr = state["optim"]["param_groups.w.lr"]

    def update(self):
        self.w.add_(1.0)
        self.m.add_(2.0)
        self.lr *= 0.5


def loaded(path):
    t = Target(seed=99)
    meta = CheckpointManager(path.parent).load(path, t)
    return t, meta


@pytest.mark.parametrize("overlap", [False, True])
def test_snapshot_is_isolated_from_later_updates(tmp_path, overlap):
    mgr = CheckpointManager(tmp_path / "ck", async_save=True, overlap=overlap)
    t = Target()
    w0, m0, lr0 = t.w.clone(), t.m.clone(), t.lr
    assert mgr.save(3, t, {"scheduler": {}}) is True
    mgr.before_update()          # the loop calls this just before the optimizer step
    t.update()
    assert mgr.wait() is True
    got, meta = loaded(mgr.path_for(3))
    assert torch.equal(got.w, w0) and torch.equal(got.m, m0) and got.lr == lr0
    assert meta["step"] == 3 and set(meta["checksums"]) == set(meta["files"])
    assert mgr.history[0].ok and mgr.history[0].bytes == (256 * 64 * 2 + 64) * 4


def test_buffers_are_reused_and_one_save_is_in_flight(tmp_path):
    mgr = CheckpointManager(tmp_path / "ck", keep=5, async_save=True, overlap=True)
    t = Target()
    mgr.save(1, t, {})
    ptrs = {k: v[1].data_ptr() for k, v in mgr._leaves.items()}
    mgr.before_update()
    t.update()
    mgr.save(2, t, {})           # waits for save 1 first
    assert mgr.history[0].ok is True  # finished before save 2 began
    assert {k: v[1].data_ptr() for k, v in mgr._leaves.items()} == ptrs
    mgr.before_update()
    t.update()
    assert mgr.wait() is True
    assert [p.name for p in mgr.committed()] == ["step_00000001", "step_00000002"]
    assert (tmp_path / "ck" / "latest").read_text().strip() == "step_00000002"


def test_failed_save_keeps_previous_and_later_saves_work(tmp_path):
    faults = FaultInjector(tmp_path, 0, "diskfull:step=4")
    mgr = CheckpointManager(tmp_path / "ck", faults=faults, async_save=True, overlap=True)
    t = Target()
    for step in (2, 4, 6):
        mgr.save(step, t, {})
        mgr.before_update()
        t.update()
        mgr.wait()
    assert [r.ok for r in mgr.history] == [True, False, True]
    assert "No space left on device" in mgr.history[1].error
    names = sorted(p.name for p in (tmp_path / "ck").iterdir())
    assert names == ["latest", "step_00000002", "step_00000006"]


@pytest.mark.parametrize("async_save", [False, True])
def test_failed_saves_in_a_row_stop_the_run(tmp_path, caplog, async_save):
    """Issue 29: a full disk never ends in success. One failed save is logged in one line (no
    "previous checkpoint is kept" when there is none); the second in a row raises SaveError
    (exit 4) at the latest at the next save; a failed final save raises at require_saved."""
    faults = FaultInjector(tmp_path, 0, "diskfull:step=2,diskfull:step=4,diskfull:step=9")
    mgr = CheckpointManager(tmp_path / "ck", faults=faults, async_save=async_save,
                            max_failures=2)
    t = Target()
    with caplog.at_level("ERROR", logger="myria"):
        mgr.save(2, t, {})
        mgr.wait()
    line = caplog.records[-1].getMessage()
    assert "checkpoint of step 2 failed on rank 0: No space left on device (injected fault) in " \
        in line and "no checkpoint of this run is saved yet" in line and "is kept" not in line
    assert "at least 0.1 MiB" in line and " free" in line and "\n" not in line
    with pytest.raises(SaveError) as e:
        mgr.save(4, t, {})
        mgr.save(6, t, {})  # asynchronous: the outcome of 4 is known when 6 begins
    assert e.value.exit_code == 4
    assert "2 checkpoint saves in a row failed" in str(e.value)
    assert "no checkpoint of this run was saved" in str(e.value)
    # a success resets the count; a failed final save is an error even alone
    mgr = CheckpointManager(tmp_path / "ck", faults=faults, async_save=async_save,
                            max_failures=0)
    assert mgr.save(8, t, {})
    mgr.require_saved(8)
    mgr.save(9, t, {})
    with pytest.raises(SaveError, match="training stopped at step 9 but its checkpoint could "
                       "not be saved: .*No space left on device.* the newest saved checkpoint "
                       "is step_00000008"):
        mgr.require_saved(9)


class _Inline(threading.Thread):
    """A save's thread that runs to its end as it starts: its failure is counted before
    `save` goes on (what a busy host's thread switch can do)."""

    def start(self):
        self.run()

    def join(self, timeout=None):
        pass


@pytest.mark.parametrize("inline", [False, True])
def test_the_failure_that_stops_the_run_stops_it_at_once(tmp_path, monkeypatch, inline):
    """With one failed save behind it, an asynchronous save is waited for: its failure (the
    second in a row) raises SaveError in the save itself, before a step it could not keep is
    trained. The first save is not waited for even when its thread fails before `save`
    returns."""
    if inline:
        from myria.train.checkpoint import pipeline

        monkeypatch.setattr(pipeline.threading, "Thread", _Inline)
    faults = FaultInjector(tmp_path, 0, "diskfull:step=2,diskfull:step=4")
    mgr = CheckpointManager(tmp_path / "ck", faults=faults, async_save=True, overlap=True,
                            max_failures=2)
    t = Target()
    assert mgr.save(2, t, {}) is True   # under way; the first failure is known later
    mgr.wait()
    with pytest.raises(SaveError, match="training stopped at step 4: 2 checkpoint saves"):
        mgr.save(4, t, {})


def test_bit_flip_is_caught_by_checksum_and_skipped(tmp_path, caplog):
    faults = FaultInjector(tmp_path, 0, "corrupt-checkpoint:step=2")
    mgr = CheckpointManager(tmp_path / "ck", faults=faults, async_save=False)
    t = Target()
    assert mgr.save(1, t, {})
    t.update()
    assert mgr.save(2, t, {})
    p2 = mgr.path_for(2)
    meta = json.loads((p2 / "meta.json").read_text())
    assert all((p2 / n).stat().st_size == s for n, s in meta["files"].items())  # same sizes
    assert "fails its checksum" in mgr.verify(p2)
    with caplog.at_level("WARNING", logger="myria"):
        assert mgr.choose_resume() == mgr.path_for(1)
    assert "is damaged" in caplog.text and "quarantine" in caplog.text
    # a truncated file is caught by its size without reading it
    victim = next(p for p in mgr.path_for(1).iterdir() if p.suffix == ".distcp")
    victim.write_bytes(victim.read_bytes()[:-10])
    assert "bytes, expected" in mgr.verify(mgr.path_for(1), checksums=False)
    assert mgr.latest_valid() is None


def test_sync_and_async_saves_load_the_same_state(tmp_path):
    t = Target()
    a = CheckpointManager(tmp_path / "a", async_save=False)
    b = CheckpointManager(tmp_path / "b", async_save=True, overlap=True)
    a.save(5, t, {"x": 1})
    b.save(5, t, {"x": 1})
    b.wait()
    ta, _ = loaded(a.path_for(5))
    tb, _ = loaded(b.path_for(5))
    for k in ("w", "b", "m"):
        assert torch.equal(getattr(ta, k), getattr(tb, k))
    assert ta.lr == tb.lr == t.lr


def test_leftover_temporary_directories_are_removed(tmp_path):
    """A save whose writer process is gone leaves a temporary directory the next manager
    removes; one whose writer is alive (here: this process) is another writer's, kept."""
    host = socket.gethostname()
    dead = tmp_path / "ck" / f"step_00000009.{2**22 + 12345}-00ff00ff@{host}.tmp"
    live = tmp_path / "ck" / f"step_00000009.{os.getpid()}-12345678@{host}.tmp"
    for d in (dead, live):
        d.mkdir(parents=True)
        (d / "__0_0.distcp").write_bytes(b"partial")
    mgr = CheckpointManager(tmp_path / "ck")
    assert not dead.exists() and live.exists() and mgr.committed() == []


def _gated_dcp_save(monkeypatch, thread_name: str):
    """Hold the DCP write of the save running on thread `thread_name` until the gate opens
    (its temporary directory exists by then)."""
    from myria.train.checkpoint import pipeline as ck

    gate, real = threading.Event(), ck.dcp.save

    def save(state, storage_writer, **kw):
        if threading.current_thread().name == thread_name:
            Path(storage_writer.path).mkdir(parents=True, exist_ok=True)
            gate.wait(60)
        return real(state, storage_writer=storage_writer, **kw)

    monkeypatch.setattr(ck.dcp, "save", save)
    return gate


def test_a_new_manager_leaves_a_live_writers_save_alone(tmp_path, monkeypatch):
    gate = _gated_dcp_save(monkeypatch, "myria-ckpt-3")
    a = CheckpointManager(tmp_path / "ck", async_save=True)
    a.save(3, Target(), {})
    deadline = time.time() + 30
    while not a.tmp_for(3).exists() and time.time() < deadline:
        time.sleep(0.01)
    CheckpointManager(tmp_path / "ck")   # another writer starting on the same directory
    assert a.tmp_for(3).exists()
    gate.set()
    assert a.wait() is True and a.committed() == [a.path_for(3)]


def test_an_abandoned_save_never_commits_over_a_new_attempt(tmp_path, monkeypatch):
    """In-job recovery gives up on a save in flight (`settle`); a new manager saves the same
    step; when the abandoned one finishes, it neither commits over the new checkpoint nor
    touches its files."""
    gate = _gated_dcp_save(monkeypatch, "myria-ckpt-3")
    old, new = Target(seed=1), Target(seed=2)
    a = CheckpointManager(tmp_path / "ck", async_save=True)
    a.save(3, old, {})
    assert a.settle(0.05) is False
    b = CheckpointManager(tmp_path / "ck", async_save=False)
    assert b.save(3, new, {})
    thread = next(t for t in threading.enumerate() if t.name == "myria-ckpt-3")
    gate.set()
    thread.join(60)
    assert a.history[-1].ok is False and "abandoned" in a.history[-1].error
    got, _ = loaded(b.path_for(3))
    assert torch.equal(got.w, new.w) and b.committed() == [b.path_for(3)]
    assert not list((tmp_path / "ck").glob("*.tmp"))


def test_a_snapshot_that_differs_from_the_state_written_is_never_committed(tmp_path):
    """A bit of the live state flips after the save began and before its overlapped copy
    (`bitflip` due at the next step defers the copy until `before_update`): the copy differs
    from what was written when the save began, the save fails and its files are kept aside
    in quarantine/, never loaded."""
    faults = FaultInjector(tmp_path, 0, "bitflip:rank=0:step=3:target=param")
    mgr = CheckpointManager(tmp_path / "ck", faults=faults, async_save=True, overlap=True)
    t = Target()
    assert mgr.save(2, t, {}) and mgr.wait() is True
    mgr.save(3, t, {})
    t.w.view(torch.int32)[0, 0] ^= 1 << 22   # the fault, before the copy
    mgr.before_update()
    assert mgr.wait() is False
    assert "differs from the state the optimizer wrote once copied" in mgr.history[-1].error
    assert "model/w" in mgr.history[-1].error
    assert mgr.committed() == [mgr.path_for(2)]
    q = mgr.quarantined()
    assert len(q) == 1 and q[0].name.startswith("step_00000003.") and mgr.choose_resume() == \
        mgr.path_for(2)


def test_checkpoints_after_the_last_clean_check_are_not_resumed_from(tmp_path):
    """A fault found after a commit (the compute check at step 8, the last clean one at step 4):
    the checkpoint of step 6 holds state computed since, so the resume quarantines it and goes
    to step 4; in-job recovery rolls back no further than step 4 either."""
    from myria.train.checkpoint.store import mark_suspect
    from myria.train.rejoin import choose

    mgr = CheckpointManager(tmp_path / "ck", async_save=False)
    t = Target()
    for step in (2, 4, 6):
        assert mgr.save(step, t, {})
        t.update()
    mark_suspect(tmp_path / "ck", 4, 8, "a recomputed microbatch differs")
    assert mgr.choose_resume() == mgr.path_for(4)
    (q,) = mgr.quarantined()
    why = json.loads((q / "QUARANTINED.json").read_text())["reason"]
    assert q.name == "step_00000006" and "after the last clean check (step 4)" in why
    assert mgr.choose_resume() == mgr.path_for(4) and mgr.drop_suspect() is None  # once
    info = {"fresh": False, "own": [4, 5, 6], "holds": None, "held": {}}
    infos = [dict(info, rank=0), dict(info, rank=1)]
    assert choose(infos)["step"] == 6 and choose(infos, cap=4)["step"] == 4
