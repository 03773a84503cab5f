"""Heartbeats reach the supervisor's TCPStore with step, phase and traffic; fault hooks parse
and fire once per run directory."""

from __future__ import annotations

import json
import time

import pytest
import torch
import torch.distributed as dist

from myria import faults
from myria.observe import comm, events
from myria.observe import heartbeat_store as store
from myria.resilience.agent import serve_tcp_store
from myria.resilience.policy import parse_expect
from myria.train import heartbeat


def wait_for(pred, timeout=10.0):
    end = time.time() + timeout
    while time.time() < end:
        v = pred()
        if v:
            return v
        time.sleep(0.02)
    raise AssertionError("condition not met in time")


def test_heartbeats_arrive_with_progress(monkeypatch):
    server, port = serve_tcp_store()
    reader = store.TCPHeartbeatStore(server)
    monkeypatch.setenv(store.ENV_STORE, f"tcp://127.0.0.1:{port}")
    monkeypatch.setenv(store.ENV_PERIOD, "0.05")
    monkeypatch.setenv(store.ENV_JOB, "t1")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    hb = heartbeat.start(rank=3)
    try:
        hb.resumed(10)
        hb.phase("forward-backward")
        hb.step_done(11, 1234.0)
        k = store.key("t1", 3)

        def newest():
            v = reader.get_many([k])[0]
            rec = json.loads(v) if v else None
            return rec if rec and rec["step"] == 11 else None

        rec = wait_for(newest)
        assert rec["rank"] == 3 and rec["attempt"] == 2 and rec["resumed_from"] == 10
        assert rec["phase"] == "forward-backward" and rec["tokens_per_s"] == 1234.0
        assert rec["mem_bytes"] > 0 and rec["first_step_at"] > 0
        seq = rec["seq"]
        wait_for(lambda: json.loads(reader.get_many([k])[0])["seq"] > seq + 2)
    finally:
        hb.close("done")
    assert not comm.installed()  # the last subscriber left: torch's own functions are back
    assert json.loads(reader.get_many([k])[0])["phase"] == "done"
    assert reader.get_many([store.key("t1", 4)]) == [None]


def test_one_interception_feeds_heartbeat_and_timeline_with_one_byte_rule(tmp_path):
    """Each collective is published once by myria.observe.comm: the heartbeat's counters and
    the event timer both subscribe and agree on its bytes."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    torch_own = dist.all_reduce, dist.distributed_c10d.Work.wait
    try:
        hb = heartbeat.Heartbeat(0)
        comm.subscribe(hb.progress)
        rec = events.install(tmp_path, 0, 1)
        rec.start({})
        dist.all_reduce(torch.ones(1000))
        out = torch.empty(10)
        dist.all_gather_into_tensor(out, torch.ones(10))
        dist.all_reduce(torch.ones(5), async_op=True).wait()
        p = hb.progress
        assert p.collectives == 3 and p.collective == "all_reduce"
        assert p.comm_bytes == 4000 + 40 + 20 and not p.in_collective
        hb.step_done(1, 0.0)
        assert p.step_bytes == 4060
        with hb.phase("optimizer"):   # one call: the heartbeat's phase and the timer's span
            assert p.phase == "optimizer"
        rec.close()
        rows = [json.loads(x) for x in rec.path.read_text().splitlines()[1:]]
        comms = [r for r in rows if r["c"] == "comm"]
        assert [(r["n"], r["a"]["bytes"]) for r in comms] == [
            ("all_reduce", 4000), ("all_gather_into_tensor", 40), ("all_reduce", 20)]
        assert all(r["t1"] >= r["t0"] for r in comms) and comms[2]["a"].get("async")
        assert [r["a"]["of"] for r in rows if r["c"] == "wait"] == ["all_reduce"]
        assert [r["n"] for r in rows if r["c"] == "compute"] == ["optimizer"]
    finally:
        comm.unsubscribe(hb.progress)
        events.uninstall()
        dist.destroy_process_group()
    assert not comm.installed()
    assert (dist.all_reduce, dist.distributed_c10d.Work.wait) == torch_own


def test_fault_specs_parse_and_fire_once(tmp_path):
    fs = faults.parse("kill:rank=1:step=5, stop:rank=0:step=3,diskfull:step=4")
    assert [(f.kind, f.params) for f in fs] == [
        ("kill", {"rank": 1, "step": 5}), ("stop", {"rank": 0, "step": 3}),
        ("diskfull", {"step": 4})]
    for bad in ("explode:step=1", "kill:rank=x:step=1", "hang:rank=1"):
        with pytest.raises(ValueError):
            faults.parse(bad)
    inj = faults.FaultInjector(tmp_path, 1, "kill:rank=1:step=5,raise:rank=0:step=5")
    assert inj.due("kill", 4) is None and inj.due("raise", 5) is None
    f = inj.due("kill", 5)
    inj.mark(f)
    assert inj.due("kill", 5) is None  # a restarted job does not repeat it
    assert faults.FaultInjector(tmp_path, 1, "kill:rank=1:step=5").due("kill", 5) is None
    r0 = faults.FaultInjector(tmp_path, 0, "raise:rank=0:step=5")
    with pytest.raises(RuntimeError, match="injected fault"):
        r0.at_step_start(5)
    r0.at_step_start(5)  # fired already: inert


def test_a_fault_that_cannot_fire_is_named_with_why(tmp_path):
    """Before a job starts, each MYRIA_FAULT item it can never fire is one note: a rank not in
    the job, a step past its end (a kill after the last step never comes; a checkpoint hook on
    the last step does), or a marker of this run directory saying it fired before."""
    text = ("kill:rank=4:step=2,kill:rank=1:step=10,diskfull:step=10,raise:rank=0:step=9,"
            "slow:rank=1:factor=2:step=10,corrupt-checkpoint:step=11")
    (tmp_path / "faults").mkdir()
    (tmp_path / "faults" / "raise_rank0_step9").write_text("fired by rank 0\n")
    assert faults.unreachable(text, 10, 4, tmp_path) == [
        "note: MYRIA_FAULT item 'kill:rank=4:step=2' will not fire: rank=4, and the job has 4 "
        "rank(s), 0 to 3",
        "note: MYRIA_FAULT item 'kill:rank=1:step=10' will not fire: step=10, and the run ends "
        "at step 10 (it fires once that many steps are done, before the next)",
        "note: MYRIA_FAULT item 'raise:rank=0:step=9' will not fire: it fired in this run "
        f"directory before ({tmp_path / 'faults' / 'raise_rank0_step9'}; once per run "
        "directory)",
        "note: MYRIA_FAULT item 'corrupt-checkpoint:step=11' will not fire: step=11, and the "
        "run ends at step 10"]
    assert faults.unreachable(None, 10, 4, tmp_path) == []
    # a misspelt kind: the error names it and the valid kinds, as `myria supervise` says it
    with pytest.raises(faults.FaultSpecError, match="item 'bitflp:rank=0:step=2': unknown "
                       "fault 'bitflp'; valid: kill, "):
        faults.unreachable("bitflp:rank=0:step=2", 10, 4, tmp_path)


def test_a_faults_attempt_is_the_jobs_round_across_hosts(tmp_path, monkeypatch):
    """`attempt=A` in a multi-host job is the rendezvous round (each host's agent counts its
    own restarts: a host whose workers were restarted for a membership change still says 0);
    the events headers carry the same number (`rundir.job_attempt`)."""
    from myria.rundir import FENCE_ENV, JOB_ATTEMPT_ENV, job_attempt

    spec = "slow:rank=0:factor=30:step=7:attempt=0"
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    assert faults.FaultInjector(tmp_path, 0, spec).slow() == (30.0, 7)
    monkeypatch.setenv(FENCE_ENV, "slurm-3:1")   # round 1, this host's agent still at 0
    assert faults.FaultInjector(tmp_path, 0, spec).slow() is None and job_attempt() == 1
    monkeypatch.setenv(FENCE_ENV, "slurm-3:0")   # an in-job attempt joined inside round 0
    monkeypatch.setenv(JOB_ATTEMPT_ENV, "1")
    assert faults.FaultInjector(tmp_path, 0, spec).slow() is None and job_attempt() == 1
    monkeypatch.delenv(JOB_ATTEMPT_ENV)
    monkeypatch.setenv(FENCE_ENV, "slurm-3:0")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    assert faults.FaultInjector(tmp_path, 0, spec).slow() == (30.0, 7)


def test_doctor_expectations_parse():
    assert parse_expect("gemm_tflops=0.02, membw_gbs=1") == {"gemm_tflops": 0.02,
                                                             "membw_gbs": 1.0}
    from myria.errors import ConfigError
    with pytest.raises(ConfigError, match="unknown key"):
        parse_expect("gemm=1")
