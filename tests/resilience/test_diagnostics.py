"""Tests of `myria doctor`: a healthy host passes, an injected slow or wrong GEMM is flagged.

Expected figures are generous floors (a loaded 2-core host still clears them by a wide margin);
the only time-based assertions are the pass/fail thresholds that are the feature itself.
"""

from __future__ import annotations

import json
import socket
import threading

import pytest
import torch

from myria.cli import main
from myria.errors import ConfigError
from myria.resilience import decision
from myria.resilience import diagnostics as dg
from myria.sim.measure.collective import bus_bandwidth, busbw_factor

# Floors a healthy host clears even when other jobs share its cores (healthy here: GEMM
# ~0.1-0.3 TFLOP/s, copy ~5-10 GB/s, gloo busbw ~0.5-1 GB/s, hop latency ~0.1-5 ms).
GENEROUS = {
    "gemm_tflops": 0.02,
    "membw_gbs": 0.2,
    "all_reduce_busbw_gbs": 0.005,
    "all_to_all_busbw_gbs": 0.005,
    "all_gather_busbw_gbs": 0.005,
    "reduce_scatter_busbw_gbs": 0.005,
    "neighbor_all_reduce_busbw_gbs": 0.005,
    "p2p_latency_max_us": 1e6,
}


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch, tmp_path):
    for var in (dg.FAULT_ENV, "MYRIA_HOSTS", "MYRIA_HOST_INDEX", "SLURM_STEP_NODELIST",
                "SLURMD_NODENAME", "MYRIA_DOCTOR_PORT"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("MYRIA_CACHE", str(tmp_path / "cache"))


def _by(report, name, rank=None):
    found = [c for c in report.checks if c.name == name and c.rank == rank]
    assert len(found) == 1, (name, rank, report.checks)
    return found[0]


# --------------------------------------------------------------------------------- quick tests


def test_bus_bandwidth_follows_nccl_tests():
    assert busbw_factor("all_reduce", 4) == pytest.approx(1.5)
    assert busbw_factor("all_reduce", 2) == pytest.approx(1.0)
    for op in ("all_to_all", "all_gather", "reduce_scatter"):
        assert busbw_factor(op, 4) == pytest.approx(0.75)
    assert bus_bandwidth("all_reduce", 10.0, 8) == pytest.approx(17.5)
    with pytest.raises(ValueError):
        busbw_factor("broadcast_all", 2)


def test_parse_faults():
    assert dg.parse_faults(None) == []
    faults = dg.parse_faults("slow-gemm:rank=1, wrong-gemm,slow-gemm:fraction=0.1")
    assert [f.describe() for f in faults] == ["slow-gemm:rank=1", "wrong-gemm",
                                              "slow-gemm:fraction=0.1"]
    assert faults[0].applies(1) and not faults[0].applies(0) and faults[1].applies(5)
    for bad in ("slow_gemm", "wrong-gemm:rank=x", "wrong-gemm:step=3", "slow-gemm:fraction=2"):
        with pytest.raises(ConfigError):
            dg.parse_faults(bad)


def test_gemm_correctness_flags_wrong_gemm_only_on_its_rank():
    cpu = torch.device("cpu")
    ok = dg.check_gemm_correctness(cpu, "float32", rank=0)
    assert ok.status == "pass" and ok.measured < ok.expected
    faults = dg.parse_faults("wrong-gemm:rank=1")
    assert dg.check_gemm_correctness(cpu, "float32", rank=0, faults=faults).status == "pass"
    bad = dg.check_gemm_correctness(cpu, "float32", rank=1, faults=faults)
    assert bad.status == "fail"
    assert "wrong-gemm" in bad.reason and "> bound" in bad.reason
    assert dg.check_gemm_correctness(cpu, "bfloat16").status == "pass"


def test_slow_gemm_runs_below_the_floor():
    cpu = torch.device("cpu")
    slow = dg.parse_faults("slow-gemm")[0]
    expected = 0.05
    tflops = dg.measure_gemm_tflops(cpu, "float32", n=256, seconds=0.0, reps=1, slow=slow,
                                    expected_tflops=expected)
    # The hook sleeps each GEMM up to the time it would take at 25% of the expected figure.
    assert tflops <= 0.25 * expected * 1.001
    c = dg.throughput_check("gemm-throughput", 0, tflops, expected, "test", 0.5, "TFLOP/s")
    assert c.status == "fail" and "below the 50% floor" in c.reason


def test_neighbor_grouping_and_host_lists(monkeypatch):
    assert dg.neighbor_group(1, 0) == [0]
    assert dg.neighbor_group(4, 3) == [2, 3]
    assert dg.neighbor_group(5, 1) == [0, 1]
    assert dg.neighbor_group(5, 4) == [2, 3, 4] == dg.neighbor_group(5, 2)
    assert dg.neighbor_group(3, 0) == [0, 1, 2]
    assert dg.expand_nodelist("gpu[08-10,12],login1,r[1-2]n[1-2]") == [
        "gpu08", "gpu09", "gpu10", "gpu12", "login1", "r1n1", "r1n2", "r2n1", "r2n2"]
    assert dg.discover_hosts()[0] == [socket.gethostname()]
    monkeypatch.setenv("SLURM_STEP_NODELIST", "node[1-4]")
    monkeypatch.setenv("SLURMD_NODENAME", "node3")
    assert dg.discover_hosts() == (["node1", "node2", "node3", "node4"], 2,
                                   "SLURM_STEP_NODELIST")
    assert dg.discover_hosts(["a", "b"], 1) == (["a", "b"], 1, "--peer-hosts")
    with pytest.raises(ConfigError):
        dg.discover_hosts(["a", "b"], 2)


def test_report_pass_fail_and_json_round_trip():
    checks = [dg.Check("gemm-correctness", "pass", "ok", 0, 1e-7, 1e-4),
              dg.Check("neighbor-all-reduce", "skip", "skipped: single host")]
    report = dg.HostReport("h", 1, "cpu", "gloo", "float32", checks)
    assert report.passed
    again = dg.HostReport.from_dict(json.loads(report.to_json()))
    assert again == report
    report.checks.append(dg.Check("gemm-throughput", "fail", "0.01 is 5% of 0.2", 0))
    assert not report.passed and "gemm-throughput[rank 0]" in report.summary
    assert json.loads(report.to_json())["passed"] is False
    assert not dg.HostReport("h", 1, "cpu", "gloo", "float32", []).passed


def test_bad_usage_is_a_clear_error(capsys):
    assert main(["doctor", "--expect", "gemm_tflops"]) == 2
    assert main(["doctor", "--expect", "bogus=1"]) == 2
    err = capsys.readouterr().err
    assert "KEY=VALUE" in err and "unknown expected figure 'bogus'" in err
    with pytest.raises(ConfigError):
        dg.run_diagnostics(0)
    assert main(["doctor", "--collectives", "allreduce"]) == 2
    assert "(did you mean 'all_reduce'?)" in capsys.readouterr().err
    # a tolerance outside (0, 1] is one message, below as above; a port is 1-65535, with one
    # host too; a host index is inside a list of several hosts
    for args, said in (
            (["--tolerance", "-1"], "tolerance=-1.0 must be a fraction in (0, 1]"),
            (["--tolerance", "5"], "tolerance=5.0 must be a fraction in (0, 1]"),
            (["--peer-hosts", "localhost,otherhost", "--host-index", "0",
              "--peer-port", "99999999"], "peer port 99999999: not a port number (1-65535)"),
            (["--peer-port", "0"], "peer port 0: not a port number (1-65535)"),
            (["--peer-hosts", "localhost,otherhost", "--host-index", "5"],
             "host index 5 is outside the host list of 2 hosts (--peer-hosts)")):
        assert main(["doctor", "--nproc", "1", *args]) == 2, args
        err = capsys.readouterr().err
        assert said in err and err.count("\n") == 1, (args, err)
    import torch

    if not torch.cuda.is_available():   # the missing GPU, not a process count, is named
        assert main(["doctor", "--device", "cuda"]) == 2
        assert "--device cuda: no CUDA device is available" in capsys.readouterr().err


def test_a_host_index_or_peer_port_with_one_host_is_noted_not_refused(monkeypatch):
    """A generic `srun myria doctor --peer-port 30000 --host-index $SLURM_NODEID` on a one-node
    allocation: the neighbour check is skipped, the unused options named in its reason."""
    for k in ("MYRIA_HOSTS", "MYRIA_HOST_INDEX", "MYRIA_DOCTOR_PORT"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("SLURM_STEP_NODELIST", "node7")
    skipped, cfg = dg._neighbour_plan(None, 0, 30000, "node7")
    assert cfg is None and skipped.status == "skip", skipped
    assert skipped.reason == ("skipped: single host (the host list from SLURM_STEP_NODELIST; "
                              "--host-index 0 and --peer-port 30000 not used)"), skipped.reason
    monkeypatch.delenv("SLURM_STEP_NODELIST")
    skipped, _ = dg._neighbour_plan(None, 3, None, "h")
    assert skipped.reason == ("skipped: single host (no --peer-hosts, MYRIA_HOSTS or Slurm step "
                              "node list; --host-index 3 not used)"), skipped.reason
    assert dg._neighbour_plan(["a", "b"], 1, 30000, "b") == \
        (None, {"group_hosts": ["a", "b"], "pos": 1, "port": 30000})


def _kill(rank=1, at=1000.0, **kw):
    """A supervisor Fault.to_dict() of a SIGKILLed rank."""
    return {"kind": "exit", "ranks": [rank], "attempt": 0, "fault_at": at, "last_step": 7,
            "cause": "signal SIGKILL", "evidence": f"rank {rank} (pid 9) ended with signal "
            "SIGKILL; its last heartbeat: step 7, phase forward; ranks [0] still running", **kw}


def test_diagnostics_are_skipped_only_when_they_cannot_tell_anything():
    """Issue 26: before a restart, skip the diagnostics when the host passed them within the
    TTL and the fault does not point at the hardware; otherwise run them, with the reason."""
    now, ttl = 1000.0, 3600.0
    ok = {"at": now - 42, "passed": True, "path": "r.json"}
    d = decision.decide(_kill(), [], ok, now=now, ttl_s=ttl)
    assert not d.run and d.reason.startswith("skipped: host passed 42 s ago") and \
        d.last_pass_age_s == 42
    # (fault, previous faults, detections, newest report) -> the reason it runs
    runs = [
        (_kill(), [], [], None, "no full diagnostics of this host on record"),
        (_kill(), [], [], {**ok, "at": now - ttl - 1}, "host passed 3601 s ago, more than"),
        (_kill(), [], [], {**ok, "passed": False}, "newest diagnostics of this host failed"),
        (_kill(), [], [{"kind": "sdc", "rank": 1, "step": 6, "evidence": {"check": "at rest"}}],
         ok, "sdc verdict at step 6 on rank 1 (at rest)"),
        (_kill(evidence="rank 1 (pid 9) ended with signal SIGBUS at step 7"), [], [], ok,
         "died of SIGBUS"),
        (_kill(cause="RuntimeError: CUDA error: uncorrectable ECC error encountered"), [], [],
         ok, "its error names the hardware ('CUDA error'"),
        (_kill(kind="traffic-stopped"), [], [], ok, "traffic stopped"),
        (_kill(kind="hang", cause="no progress: no progress for 5.1 s"), [], [], ok,
         "no progress while its process lived"),
        (_kill(), [_kill(at=900.0)], [], ok, "rank 1 faulted again (before: exit at step 7"),
        (_kill(), [_kill(0, at=800.0), _kill(0, at=900.0)], [], ok, "fault 3 on this host"),
    ]
    for fault, prev, dets, last, why in runs:
        d = decision.decide(fault, prev, last, now=now, ttl_s=ttl, detections=dets)
        assert d.run and why in d.reason, (why, d)
    # a different rank after an earlier fault, and two faults an hour apart: still skipped
    assert not decision.decide(_kill(), [_kill(0, at=900.0)], ok, now=now, ttl_s=ttl).run
    assert not decision.decide(_kill(), [_kill(0, at=now - ttl - 10), _kill(0, at=900.0)], ok,
                         now=now, ttl_s=ttl).run
    assert decision.decide(_kill(), [], ok, now=now, ttl_s=0).run
    from myria.config import ResilienceConfig

    assert ResilienceConfig().diagnostics_ttl_s == decision.DEFAULT_TTL_S   # the documented default
    assert decision.decide(_kill(), [], ok, now=now, ttl_s=ttl, hook=True).run


def test_the_newest_full_report_of_the_host_is_found_in_the_run_and_the_cache(tmp_path):
    """Reports the supervisor wrote (RUN_DIR/diagnostics) and `myria doctor`'s in the host cache
    count; one of a test hook, of fewer local ranks, or of another host does not."""
    import time

    from myria.device import cache_dir

    host = socket.gethostname()
    run = tmp_path / "run"

    def write(path, *, ago, nproc=2, faults=(), passed=True, name=host):
        checks = [dg.Check("gemm-correctness", "pass" if passed else "fail", "x", 0)]
        r = dg.HostReport(name, nproc, "cpu", "gloo", "float32", checks, faults=list(faults),
                          started_at=dg._dt.datetime.fromtimestamp(time.time() - ago)
                          .isoformat(timespec="seconds"), duration_s=1.0)
        r.write_json(path)

    write(run / "diagnostics" / f"{host}-attempt0.json", ago=300)
    write(cache_dir() / "doctor" / f"{host}-20990101-000000.json", ago=100)
    for kw in ({"nproc": 1}, {"faults": ["wrong-gemm"], "passed": False}):
        write(cache_dir() / "doctor" / f"{host}-{len(kw)}.json", ago=10, **kw)
    found = decision.newest_report(host, 2, [run / "diagnostics", cache_dir() / "doctor"])
    assert found["passed"] and found["path"].endswith("20990101-000000.json")
    assert 95 <= time.time() - found["at"] <= 110, found
    d = decision.decide_for_supervisor(run, host, 2, _kill(at=time.time()), [], 3600.0, since=0.0)
    assert not d.run and "skipped: host passed" in d.reason, d
    assert decision.decide_for_supervisor(run, host, 4, _kill(at=time.time()), [], 3600.0, 0.0).run
    write(run / "diagnostics" / f"{host}-attempt1.json", ago=5, passed=False)
    d = decision.decide_for_supervisor(run, host, 2, _kill(at=time.time()), [], 3600.0, since=0.0)
    assert d.run and "failed" in d.reason, d


# ------------------------------------------------------------------ multi-process (spawned)


def _expect_args(expected: dict[str, float]) -> list[str]:
    return [a for k, v in expected.items() for a in ("--expect", f"{k}={v}")]


@pytest.mark.slow
def test_cli_healthy_host_passes_and_writes_json(tmp_path, capfd, monkeypatch):
    """A healthy host passes with a --timeout shorter than one rank's compute checks (each
    GEMM measured for 1.5 s): the other rank waits for them in the rendezvous and the barrier,
    which is no hang while the computing rank makes progress; nothing but the table shows."""
    import functools

    monkeypatch.setattr(dg, "run_diagnostics",
                        functools.partial(dg.run_diagnostics, gemm_seconds=1.5))
    path = tmp_path / "doctor.json"
    rc = main(["doctor", "--nproc", "2", "--timeout", "1", "--json", str(path), "--collectives",
               "all_reduce,all_to_all,all_gather,reduce_scatter", *_expect_args(GENEROUS)])
    out, err = capfd.readouterr()
    report = json.loads(path.read_text())
    assert rc == 0, out
    assert err == "", err     # no traceback, no c10d warning
    assert report["passed"] is True and "PASS" in out and str(path) in out
    statuses = {(c["name"], c["rank"]): c["status"] for c in report["checks"]}
    for name in ("gemm-correctness", "gemm-throughput"):
        assert statuses[(name, 0)] == statuses[(name, 1)] == "pass"
    for name in ("memory-bandwidth", "all-reduce", "all-to-all", "all-gather", "reduce-scatter",
                 "p2p-loopback"):
        assert statuses[(name, None)] == "pass", name
    skip = next(c for c in report["checks"] if c["name"] == "neighbor-all-reduce")
    assert skip["status"] == "skip" and "single host" in skip["reason"]
    ar = next(c for c in report["checks"] if c["name"] == "all-reduce")["details"]
    assert ar["busbw_gbs"] == pytest.approx(ar["algbw_gbs"] * 2 * (2 - 1) / 2)
    assert ar["correct"] and report["faults"] == []


@pytest.mark.slow
def test_injected_slow_and_wrong_gemm_are_flagged(monkeypatch, tmp_path):
    monkeypatch.setenv(dg.FAULT_ENV, "slow-gemm:rank=0,wrong-gemm:rank=1")
    report = dg.run_diagnostics(2, GENEROUS, timeout_s=60)
    assert not report.passed
    slow = _by(report, "gemm-throughput", 0)
    assert slow.status == "fail" and "slow-gemm" in slow.reason and "floor" in slow.reason
    assert slow.measured <= 0.25 * GENEROUS["gemm_tflops"] * 1.001
    wrong = _by(report, "gemm-correctness", 1)
    assert wrong.status == "fail" and "wrong-gemm" in wrong.reason
    # Each fault hits only its rank, and nothing else fails.
    assert _by(report, "gemm-correctness", 0).status == "pass"
    assert _by(report, "gemm-throughput", 1).status == "pass"
    assert {(c.name, c.rank) for c in report.failures} == {("gemm-throughput", 0),
                                                           ("gemm-correctness", 1),
                                                           ("golden", 1)}
    assert _by(report, "golden", 0).status == "pass"
    # The slow rank was measured three times before it failed (against a configured figure).
    assert len(slow.details["samples"]) == 3
    assert report.faults == ["slow-gemm:rank=0", "wrong-gemm:rank=1"]
    saved = json.loads(report.write_json(tmp_path / "r.json").read_text())
    assert saved["passed"] is False and "FAIL" in saved["summary"]


@pytest.mark.slow
def test_neighbor_all_reduce_between_two_hosts():
    # Two "hosts" on 127.0.0.1, one local rank each, run side by side as the supervisor would.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    reports: dict[int, dg.HostReport] = {}

    def host(i: int) -> None:
        reports[i] = dg.run_diagnostics(1, GENEROUS, timeout_s=60,
                                        peer_hosts=["127.0.0.1", "127.0.0.1"], host_index=i,
                                        peer_port=port)

    threads = [threading.Thread(target=host, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=90)
    assert set(reports) == {0, 1}
    for i, report in reports.items():
        c = _by(report, "neighbor-all-reduce")
        assert c.status == "pass", (i, c.reason)
        assert c.details["group"] == ["127.0.0.1", "127.0.0.1"] and c.details["position"] == i
        assert c.details["correct"] and c.details["world"] == 2
        assert _by(report, "p2p-loopback").status == "skip"
        assert report.passed, report.summary


class _Proc:
    """A local rank's process as `_collect` sees it."""

    def __init__(self):
        self.exitcode, self.terminated = None, False

    def is_alive(self):
        return not self.terminated

    def terminate(self):
        self.terminated = True


def test_a_slow_rank_that_makes_progress_is_not_hung_one_without_is():
    """The doctor's time limit counts time without progress: a busy host's ranks keep
    reporting phases past it and pass; a rank that reports nothing for the limit fails."""
    import queue
    import threading
    import time

    def feed(q, plan):
        t0 = time.time()
        for at, msg in plan:
            time.sleep(max(0.0, t0 + at - time.time()))
            q.put(msg)

    q = queue.Queue()
    slow = [(0.15 * i, ("phase", 0, f"check {i}")) for i in range(1, 9)] + \
        [(1.3, ("done", 0)), (1.35, ("done", 1))]
    threading.Thread(target=feed, args=(q, slow), daemon=True).start()
    procs = {0: _Proc(), 1: _Proc()}
    checks = dg._collect(procs, q, threading.Event(), 2, time.time() + 0.5)
    assert not [c for c in checks if c.name == "workers"], checks
    q = queue.Queue()
    threading.Thread(target=feed, args=(q, [(0.1, ("done", 1))]), daemon=True).start()
    procs = {0: _Proc(), 1: _Proc()}
    t0 = time.time()
    checks = dg._collect(procs, q, threading.Event(), 2, time.time() + 0.5)
    hung = [c for c in checks if c.name == "workers"]
    assert len(hung) == 1 and "local rank 0: did not finish in time" in hung[0].reason, checks
    assert procs[0].terminated and time.time() - t0 < 2
