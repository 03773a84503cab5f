"""Detection rules on synthetic heartbeats and stderr: each fault is found, with its evidence."""

from __future__ import annotations

from myria.resilience.watch import Watchdog


def rec(rank, seq, step, phase="forward-backward", progress=None, comm=0, coll="",
        inside=False, attempt=0):
    return {"rank": rank, "seq": seq, "step": step, "phase": phase, "pid": 100 + rank,
            "host": "h", "progress": step * 10 if progress is None else progress,
            "comm_bytes": comm, "collective": coll, "in_collective": inside, "phase_s": 0.0,
            "attempt": attempt}


def dog(**kw):
    args = dict(heartbeat_s=1.0, missed=3, hang_timeout_s=10.0, startup_timeout_s=100.0, now=0.0)
    args.update(kw)
    return Watchdog([0, 1], **args)


def test_healthy_progress_raises_nothing():
    w = dog()
    for t in range(60):
        found = w.heartbeats({0: rec(0, t, t, comm=t * 100), 1: rec(1, t, t, comm=t * 100)},
                             now=float(t))
        assert found == []


def test_missed_heartbeats_name_the_rank_once():
    w = dog()
    w.heartbeats({0: rec(0, 0, 1), 1: rec(1, 0, 1)}, now=1.0)
    for t in range(2, 5):
        assert w.heartbeats({0: rec(0, t, t), 1: rec(1, 0, 1)}, now=float(t)) == []
    found = w.heartbeats({0: rec(0, 5, 5), 1: rec(1, 0, 1)}, now=4.5)
    assert [d.kind for d in found] == ["missed-heartbeats"] and found[0].ranks == [1]
    assert "dead or frozen" in found[0].evidence and found[0].fault_at == 1.0
    assert w.heartbeats({0: rec(0, 6, 6), 1: rec(1, 0, 1)}, now=5.0) == []  # reported once


def test_late_heartbeats_of_a_process_that_computes_are_not_a_death():
    """A loaded host (or a long call holding the GIL) delays a rank's heartbeats while its
    process keeps computing: not `missed-heartbeats` until the hang timeout. A process that
    used no CPU meanwhile, or cannot run (stopped), is reported at the usual limit."""
    cpu = {100: 0.0, 101: 0.0}
    w = dog(cpu=lambda pid: cpu[pid])
    w.heartbeats({0: rec(0, 0, 1), 1: rec(1, 0, 1)}, now=1.0)
    cpu[100] = 0.2                    # rank 0 computes (0.2 s of CPU in 3.5 s); rank 1 does not
    found = w.heartbeats({0: rec(0, 0, 1), 1: rec(1, 0, 1)}, now=4.5)
    assert [(d.kind, d.ranks) for d in found] == [("missed-heartbeats", [1])]
    assert [d.ranks for d in w.heartbeats({0: rec(0, 0, 1)}, now=6.0)] == [[0]]   # 0.2 < 0.25
    w = dog(cpu=lambda pid: cpu[pid])
    cpu[100] = 0.0
    w.heartbeats({0: rec(0, 0, 1)}, now=1.0)
    cpu[100] = 0.6                    # 0.6 s in 8 s: >= 0.05 x 8
    assert w.heartbeats({0: rec(0, 0, 1)}, now=9.0) == []
    cpu[100] = 5.0                    # ... but the hang timeout (10 s) bounds the wait
    found = w.heartbeats({0: rec(0, 0, 1), 1: rec(1, 0, 1)}, now=11.5)
    assert [(d.kind, d.ranks) for d in found] == [("missed-heartbeats", [0])]
    # said as what it is: a computing rank past the hang timeout, not a dead one
    assert "computing all along" in found[0].evidence and "dead" not in found[0].evidence
    w = dog(cpu=lambda pid: None)     # stopped (SIGSTOP) or gone: no grace
    w.heartbeats({0: rec(0, 0, 1), 1: rec(1, 0, 1)}, now=1.0)
    assert {tuple(d.ranks) for d in w.heartbeats({}, now=4.5)} == {(0,), (1,)}


def test_cpu_seconds_of_a_running_a_sleeping_and_a_stopped_process():
    import os
    import signal
    import subprocess
    import sys
    import time

    from myria.resilience.watch import cpu_seconds

    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    idle = subprocess.Popen(["sleep", "30"])
    try:
        time.sleep(0.3)
        a, i = cpu_seconds(busy.pid), cpu_seconds(idle.pid)
        time.sleep(0.7)
        assert cpu_seconds(busy.pid) - a > 0.05 and cpu_seconds(idle.pid) - i < 0.02
        os.kill(busy.pid, signal.SIGSTOP)
        time.sleep(0.1)
        assert cpu_seconds(busy.pid) is None           # stopped: cannot run
    finally:
        busy.kill()
        idle.kill()
        busy.wait()
        idle.wait()
    assert cpu_seconds(busy.pid) is None and cpu_seconds("x") is None


def test_hang_names_collective_and_the_rank_outside_it():
    w = dog(hang_timeout_s=5.0)
    for t in range(0, 12):  # heartbeats keep coming, nothing moves after t=1
        found = w.heartbeats({
            0: rec(0, t, 4, progress=40, coll="all_gather_single", inside=True),
            1: rec(1, t, 4, phase="data", progress=41, coll="all_reduce")}, now=float(t))
        if found:
            break
    hang = [d for d in found if d.kind == "hang"]
    assert hang and t == 6
    assert hang[0].ranks == [1]
    assert "ranks [0] wait inside all_gather_single" in hang[0].evidence
    assert "suspect [1]" in hang[0].evidence


def test_startup_and_finished_phases_are_not_hangs():
    w = dog(hang_timeout_s=2.0)
    for t in range(30):
        assert w.heartbeats({0: rec(0, t, 0, phase="init", progress=1),
                             1: rec(1, t, 9, phase="done", progress=5)}, now=float(t)) == []


def test_traffic_stopped():
    w = dog(hang_timeout_s=100.0, traffic_timeout_s=3.0)
    w.heartbeats({0: rec(0, 0, 1, comm=10), 1: rec(1, 0, 1, comm=10)}, now=0.0)
    w.heartbeats({0: rec(0, 1, 2, comm=20), 1: rec(1, 1, 2, comm=20)}, now=1.0)
    found = []
    for t in range(2, 8):  # rank 1 keeps stepping (progress) but moves no more bytes
        found += w.heartbeats({0: rec(0, t, t, comm=20 + t), 1: rec(1, t, t, comm=20)},
                              now=float(t))
    assert [(d.kind, d.ranks) for d in found] == [("traffic-stopped", [1])]


def test_a_rank_stuck_after_its_last_collective_is_a_hang_not_stopped_traffic():
    """At the default (traffic timeout = hang timeout) a rank frozen at a step's start moved
    its last bytes before its last phase change: its traffic stops first, yet the stall is the
    hang rule's, which names the rank that never joined the collective the other waits in."""
    w = dog(hang_timeout_s=5.0)
    found = []
    for t in range(0, 14):
        stuck = t >= 3                     # rank 0: last bytes at t=2, step-start from t=3
        r0 = rec(0, t, 3 if stuck else t, phase="step-start" if stuck else "forward-backward",
                 progress=30 if stuck else t * 10, comm=200 if stuck else t * 100,
                 coll="all_reduce")
        r1 = rec(1, t, 3 if stuck else t, progress=31 if stuck else t * 10,
                 comm=300 if stuck else t * 100, coll="all_gather_single", inside=stuck)
        found += w.heartbeats({0: r0, 1: r1}, now=float(t))
    assert [(d.kind, d.ranks) for d in found] == [("hang", [0])], found
    assert "ranks [1] wait inside all_gather_single" in found[0].evidence


def test_stale_attempt_is_ignored_and_no_heartbeat_is_reported():
    w = dog(attempt=1, startup_timeout_s=5.0)
    found = w.heartbeats({0: rec(0, 0, 3, attempt=0), 1: rec(1, 0, 3, attempt=0)}, now=6.0)
    assert sorted(d.ranks[0] for d in found if d.kind == "no-heartbeat") == [0, 1]


def test_stderr_alarms_and_cause_line():
    w = dog()
    lines = ["[rank1]: Traceback (most recent call last):", '[rank1]:   File "x.py", line 1',
             "[rank1]: RuntimeError: CUDA error: an illegal memory access was encountered"]
    found = w.stderr(1, lines, now=3.0)
    assert [d.details["keyword"] for d in found] == ["Traceback", "CUDA error"]
    assert w.cause_line(1).startswith("RuntimeError: CUDA error")
    w.stderr(0, ["RuntimeError: Connection closed by peer [127.0.0.1]:1"], now=3.0)
    assert w.is_secondary(0) and not w.is_secondary(1)
    assert w.stderr(0, ["step 5 loss 3.2"], now=4.0) == []
