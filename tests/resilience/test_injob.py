"""In-job recovery (`resilience.recovery = "in-job"`): survivors stay, a hot spare takes the
lost rank's state from its ring neighbour's memory, and the run ends bit for bit as one that
never failed; with both copies of a shard gone it falls back to the restart from disk."""

from __future__ import annotations

import json

import pytest

from myria.train.rejoin import choose
from tests.conftest import TINY, assert_bit_equal, run_cli

STEPS = 12
COMMON = [*TINY, f"--training.steps={STEPS}", "--checkpoint.interval=4",
          "--resilience.heartbeat_s=0.5", "--resilience.hang_timeout_s=20",
          "--resilience.backoff_s=0.2", "--resilience.diagnose=false",
          "--resilience.recovery=in-job"]


def _info(rank, own=(), holds=None, held=(), fresh=False):
    return {"rank": rank, "fresh": fresh, "own": list(own), "holds": holds,
            "held": {s: {} for s in held}}


def test_no_heartbeat_of_a_new_attempt_carries_the_old_first_step():
    """A survivor going on into a new attempt in-job resets its progress before it takes the
    attempt's number: a heartbeat sent in between (the sender reads the attempt, then the
    progress) never says the new attempt has finished a step, which would make the supervisor
    treat a failure before its first step as one after it."""
    import time

    from myria.train.heartbeat import Progress
    from myria.train.rejoin import InJob

    class Beat:   # the heartbeat, with its sender run each time the attempt is set
        def __init__(self):
            self.progress, self.ledger, self.sent = Progress(1), None, []
            self.progress.step_done(10, 1.0)   # the previous attempt's steps

        def __setattr__(self, name, value):
            object.__setattr__(self, name, value)
            if name == "attempt":
                self.sent.append(self.progress.record(attempt=value))

    hb = Beat()
    injob = InJob.__new__(InJob)
    injob.attempt, injob.run_dir = 1, None
    injob._new_attempt(hb, time.time())
    assert [(r["attempt"], r["first_step_at"], r["resumed_from"]) for r in hb.sent] == \
        [(1, 0.0, -1)]


def test_the_step_every_rank_holds_and_who_sends_it():
    # rank 2 lost; rank 3 holds its copy of steps 5 and 6; a survivor a step behind decides
    infos = [_info(0, (4, 5, 6), 3, (5, 6)), _info(1, (4, 5, 6), 0, (5, 6)),
             _info(2, fresh=True), _info(3, (4, 5, 6), 2, (5, 6))]
    assert choose(infos) == {"step": 6, "sources": {2: 3}, "replica": []}
    infos[1]["own"] = [3, 4, 5]   # its snapshot of step 6 never finished
    assert choose(infos) == {"step": 5, "sources": {2: 3}, "replica": []}
    infos[3]["held"] = {4: {}}    # the holder's newer copies did not verify
    assert choose(infos) == {"step": 4, "sources": {2: 3}, "replica": []}
    # a rank and its holder both lost: no copy of rank 2 is left -> the checkpoint on disk
    infos[3] = _info(3, fresh=True)
    assert choose(infos) is None
    # snapshots off: survivors hold nothing -> the checkpoint on disk
    assert choose([_info(0), _info(1, fresh=True)]) is None


def test_across_hosts_a_lost_hosts_ranks_are_held_on_the_other_host(monkeypatch):
    # 2 hosts x 2 ranks: the ring steps by the ranks per host, so host 1's ranks 2 and 3 are
    # held by host 0's ranks 0 and 1, and both survive host 1's loss
    from myria.train.peer import ring_stride

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert ring_stride(4) == 2
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert ring_stride(4) == 1    # one host: the next rank
    infos = [_info(0, (5, 6), 2, (5, 6)), _info(1, (5, 6), 3, (5, 6)),
             _info(2, fresh=True), _info(3, fresh=True)]
    for i in infos[:2]:
        i["stride"] = 2
    assert choose(infos) == {"step": 6, "sources": {2: 0, 3: 1}, "replica": []}


def test_a_held_copy_damaged_after_its_check_is_refused():
    # `bitflip:target=peer` damages the newest copy a rank holds for its left neighbour after
    # its CRC-32 was taken; recovery must not offer it, and takes the older copy instead
    import torch

    from myria.faults import parse
    from myria.train import peer
    from myria.train.integrity import flip_held
    from myria.train.rejoin import _describe

    def copy(step, value):
        state = {"model/w": torch.full((4,), value)}
        layout, n = peer.layout_of(state)
        buf = torch.empty(n, dtype=torch.uint8)
        peer.pack(state, buf, layout)
        return {"from": 0, "step": step, "meta": {"step": step, "layout": layout},
                "buf": buf, "crc": peer.crc32(buf)}

    class Ring:   # what the hook reads of a PeerSnapshots
        held_by_step = {5: copy(5, 1.0), 6: copy(6, 2.0)}
        held = held_by_step[6]

        def wait(self):
            return True

    assert parse("bitflip:rank=1:step=5:target=peer")[0].params["target"] == "peer"
    ring = Ring()
    assert flip_held(ring, 1) == 6
    w = peer.unpack(ring.held["meta"], ring.held["buf"])["model/w"]
    assert w[0] != 2.0 and torch.equal(w[1:], torch.full((3,), 2.0))
    kept = {"rank": 1, "left": 0, "world": 2, "own": {5: copy(5, 3.0), 6: copy(6, 4.0)},
            "held": ring.held_by_step}
    info = _describe(kept, 1)
    assert sorted(info["held"]) == [5] and info["refused"] == [6], info
    assert choose([_info(0, fresh=True), info]) == {"step": 5, "sources": {0: 1},
                                                    "replica": []}


def supervise(run_dir, data, fault, *extra):
    return run_cli("supervise", "--run-dir", str(run_dir), "--nproc", "2",
                   f"--data.path={data}", *COMMON, *extra, env={"MYRIA_FAULT": fault},
                   timeout=400)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, tiny_data):
    """The same job, uninterrupted, under plain `myria train`."""
    d = tmp_path_factory.mktemp("ref")
    run_cli("train", "--run-dir", str(d), "--nproc", "2", f"--data.path={tiny_data}", *COMMON)
    return d


def check_bit_equal(run, reference):
    assert_bit_equal(run, reference, STEPS)


@pytest.mark.slow
def test_a_spare_takes_the_lost_rank_from_peer_memory(tmp_path, tiny_data, reference):
    # a kill, then (second behaviour, same job) a rank that raises: it ends through its
    # run's close, which must leave its shared-memory snapshot for its replacement to map
    supervise(tmp_path, tiny_data, "kill:rank=1:step=5,raise:rank=0:step=9",
              "--resilience.spares=1")
    s = json.loads((tmp_path / "supervisor_summary.json").read_text())
    log = (tmp_path / "supervisor.log").read_text()
    assert s["status"] == "succeeded" and s["final_step"] == STEPS, s
    f, g2 = s["faults"][0], s["faults"][-1]
    assert len(s["faults"]) == 2 and f["recovery"] == "in-job: spare", f
    # the raise came with its step-9 snapshot exchange in flight: it is let finish before
    # the abort (PeerSnapshots.settle), so nothing is redone (cutting it would resume from 8,
    # and a raising rank left waiting would end in the hang timeout and a restart)
    assert g2["recovery"] == "in-job: spare" and g2["resumed_from"] == 9, g2
    assert g2["lost_steps"] == 0, g2
    assert "ACTION in-job recovery (attempt 1" in log and "hot spare 0" in log
    assert "ACTION stop the worker group" not in log   # the survivor stayed
    # it resumed from the step both snapshots hold (the one the kill interrupted, or the
    # one before if rank 1's last snapshot had not reached its holder), not the checkpoint
    assert f["resumed_from"] in (4, 5) and f["lost_steps"] in (0, 1), f
    restored = json.loads((tmp_path / "peer" / "injob.json").read_text())
    assert restored[0]["step"] == f["resumed_from"] and restored[0]["sources"] == {"1": 0}
    assert restored[0]["copy"] == {"1": "mapped"}  # one host: the lost rank's shared file
    assert restored[-1]["copy"] == {"0": "mapped"}, restored  # the raising rank's file
    # nothing stopped (the announcement only), no diagnostics, no back-off, no disk
    p = f["recovery_phases"]
    assert p["teardown"] < 0.5 and p["decision"] == p["backoff"] == 0.0, p
    # the spare's own way to its restore (started processes, process groups, model) quicker
    # than the job's own start (the spare was started then): against its peers in the same
    # run, so the claim holds on a loaded host too, where a bound in seconds does not. The
    # detection is the heartbeat's, not the spare's; the restore and the redone step are a
    # restart's too.
    start = s["goodput"]["seconds"]["startup"]
    ready = p["start_processes"] + p["process_groups"] + p["build_model"]
    assert ready < start, (p, start)
    assert sum(p.values()) == pytest.approx(f["time_lost_s"], abs=0.05), (p, f)
    # the ledger still adds up, with the recovery in it
    g = s["goodput"]
    assert g["accounted_s"] == pytest.approx(g["wall_s"], rel=0.01), g
    assert g["seconds"]["detection"] > 0 and g["seconds"]["recovery"] > 0, g
    check_bit_equal(tmp_path, reference)


@pytest.mark.slow
def test_a_damaged_peer_copy_is_refused_and_recorded(tmp_path, tiny_data, reference):
    """Rank 0's copy of rank 1's step-6 snapshot is damaged after its check, then rank 1
    fails: recovery refuses that copy (an older one serves), records the damage as a
    detection, and the supervisor does not call the fault undetected."""
    supervise(tmp_path, tiny_data, "bitflip:rank=0:step=6:target=peer,raise:rank=1:step=6")
    s = json.loads((tmp_path / "supervisor_summary.json").read_text())
    assert s["status"] == "succeeded" and s["undetected_hooks"] == [], s
    found = [json.loads(x) for x in (tmp_path / "events.jsonl").read_text().splitlines()]
    peer = [d for d in found if d["kind"] == "checkpoint"
            and d["evidence"].get("peer_snapshot_of_rank") == 1]
    assert peer and peer[0]["rank"] == 0 and peer[0]["step"] == 6, found
    assert s["faults"][0]["resumed_from"] < 6, s["faults"]
    check_bit_equal(tmp_path, reference)


@pytest.mark.slow
def test_both_copies_lost_falls_back_to_the_checkpoint(tmp_path, tiny_data, reference):
    # rank 0 and rank 1 hold each other's copy: both killed at once, nothing in memory is left.
    # At step 10 the step-4 checkpoint is committed (the step-8 save waited for it before it
    # began); the overlapped step-8 save may or may not be, so the run resumes from the newest
    # committed when the workers died, which is 4 or 8
    supervise(tmp_path, tiny_data, "kill:rank=0:step=10,kill:rank=1:step=10")
    s = json.loads((tmp_path / "supervisor_summary.json").read_text())
    log = (tmp_path / "supervisor.log").read_text()
    assert s["status"] == "succeeded" and s["final_step"] == STEPS, s
    assert "the worker group restarts from the newest checkpoint" in log
    assert "ACTION stop the worker group" in log
    last = s["faults"][-1]
    assert last["newest_committed"] in ("step_00000004", "step_00000008"), last
    assert last["recovery"] == "restart" and \
        last["resumed_from"] == int(last["newest_committed"].split("_")[1]), last
    check_bit_equal(tmp_path, reference)


@pytest.mark.slow
def test_without_snapshots_every_rank_loads_the_checkpoint_in_job(tmp_path, tiny_data,
                                                                   reference):
    # step 10: the step-4 checkpoint is committed, the overlapped step-8 one may be (see above);
    # rank 0 lives on, so it may still commit step 8 after the fault is seen
    supervise(tmp_path, tiny_data, "kill:rank=1:step=10",
              "--resilience.memory_snapshot_interval=0")
    s = json.loads((tmp_path / "supervisor_summary.json").read_text())
    f = s["faults"][0]
    assert s["status"] == "succeeded" and len(s["faults"]) == 1, s
    assert f["recovery"] == "in-job: fresh process" and f["resumed_from"] in (4, 8), f
    restored = json.loads((tmp_path / "peer" / "injob.json").read_text())
    assert restored[0]["step"] is None and "rank 0: no snapshot" in restored[0]["facts"]
    check_bit_equal(tmp_path, reference)


@pytest.mark.slow
def test_a_frozen_rank_is_killed_and_replaced_in_job(tmp_path, tiny_data, reference):
    supervise(tmp_path, tiny_data, "stop:rank=1:step=5", "--resilience.spares=1")
    s = json.loads((tmp_path / "supervisor_summary.json").read_text())
    f = s["faults"][0]
    assert s["status"] == "succeeded" and len(s["faults"]) == 1, s
    assert f["kind"] == "missed-heartbeats" and f["recovery"] == "in-job: spare", f
    assert "in-job: kill the frozen rank 1" in f["action"], f
    check_bit_equal(tmp_path, reference)


def test_an_idle_spare_that_dies_is_said_and_started_again(tmp_path, monkeypatch, caplog):
    """A hot spare that dies while no rank needs it is reported at once (exit status, its log,
    a detection) and replaced; one that keeps dying is left after SPARE_RESTARTS deaths."""
    import logging
    import subprocess
    import sys
    from types import SimpleNamespace

    from myria import detections
    from myria.resilience import injob

    sup = SimpleNamespace(run_dir=tmp_path, host="h", max_step=7)
    rec = injob.InJobRecovery(sup)
    started = []

    def start():   # a spare that exits at once with status 3, as a broken one would
        i = rec.next_spare
        rec.next_spare += 1
        rec.spares[i] = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
        started.append(i)
    monkeypatch.setattr(rec, "_start_spare", start)
    start()
    caplog.set_level(logging.WARNING, "myria.supervisor")
    for _ in range(injob.SPARE_RESTARTS + 2):
        for p in rec.spares.values():
            p.wait()
        rec.check_idle_spares()
    assert started == list(range(injob.SPARE_RESTARTS + 1))   # the first and 3 restarts
    lines = [r.getMessage() for r in caplog.records if "died while idle" in r.getMessage()]
    assert len(lines) == injob.SPARE_RESTARTS + 1 and "exit 3" in lines[0] and \
        "spare0.log" in lines[0] and lines[0].endswith("starting another")
    assert "not started again after 4 deaths" in lines[-1]
    rows = detections.read(tmp_path, "spare-lost")
    assert [r["evidence"]["exit"] for r in rows] == [3] * 4 and rows[0]["step"] == 7
