"""myria across hosts on the emulated cluster (`myria cluster`: network-namespace hosts under a
real Slurm), launched the way a user does it: `sbatch` of the shipped scripts/myria.sbatch.

One case per behaviour: 2 hosts x 2 processes train bit-equal to the same 4 ranks on one host
(and `myria report` shows both hosts); a lost host is replaced by the allocation's spare node
and the run ends bit-equal to a clean one, by the full restart or in-job (the spare takes the
lost ranks over, the survivors stay); a partition is detected (the host drops out of the
rendezvous, or a hang), each of the cut-off host's workers stops on the fence and says so, and
the run ends bit-equal. Root and Debian's slurm/munge packages are needed
(`make cluster-packages`); without them the module skips in one line. Every test takes the
emulated cluster down on its way out, failures included, and checks nothing of it is left.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from myria import cluster
from tests.conftest import ROOT, TINY, assert_bit_equal, run_cli

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(bool(cluster.missing()),
                                 reason=f"emulated cluster: {cluster.missing()}")]

STEPS = 12
ARGS = [*TINY, f"--training.steps={STEPS}", "--checkpoint.interval=4",
        "--training.eval_interval=0", "--training.init_timeout_s=60",
        "--resilience.diagnose=false", "--resilience.hang_timeout_s=10"]
SCRIPT = ROOT / "scripts" / "myria.sbatch"
JOB_ENV = {"MYRIA": f"{sys.executable} -m myria", "OMP_NUM_THREADS": "1"}
# The host faults land after step 6 of 12: the first attempt's steps after it are slowed (rank 0
# computes 30x as long) so that the job cannot end before its fault on a quick host. The slowed
# steps change no number, and the restarted attempts run at full speed.
HOLD = {"MYRIA_FAULT": "slow:rank=0:factor=30:step=7:attempt=0"}


def _nothing_left() -> None:
    assert not [n for n in cluster._netns_list() if n.startswith(cluster.PREFIX)]
    ours = subprocess.run(["pgrep", "-f", str(cluster.state_dir())], capture_output=True,
                          text=True).stdout.split()
    assert not ours, f"processes of the emulated cluster left running: {ours}"


@pytest.fixture
def hosts3():
    """Three emulated hosts (h0, h1, h2) under Slurm, taken down after the test."""
    try:
        cluster.up(3, quiet=True)
        yield cluster
    finally:
        cluster.down(quiet=True)
        _nothing_left()


@pytest.fixture(scope="module")
def one_host(tiny_data, tmp_path_factory) -> Path:
    """The reference: the same 4 ranks on this one host, one thread each."""
    out = tmp_path_factory.mktemp("cluster") / "one-host"
    run_cli("supervise", "--run-dir", str(out), "--nproc", "4", f"--data.path={tiny_data}",
            *ARGS, env={"OMP_NUM_THREADS": "1"}, timeout=600)
    return out


def _submit(run_dir: Path, data: Path, nodes: int, *extra: str, **env) -> int:
    return cluster.sbatch(SCRIPT, nodes, ["--run-dir", str(run_dir), "--nproc", "2",
                                          f"--data.path={data}", *ARGS, *extra],
                          run_dir.parent / f"{run_dir.name}.out", {**JOB_ENV, **env})


def _wait_step(run_dir: Path, step: int, timeout: float = 300, checkpoint: bool = True) -> None:
    end = time.time() + timeout
    while time.time() < end:
        p = run_dir / "metrics.jsonl"
        rows = [json.loads(x) for x in p.read_text().splitlines()] if p.exists() else []
        if any(r.get("step", 0) >= step and "loss" in r for r in rows) and \
                (not checkpoint or (run_dir / "checkpoints" / "step_00000004").is_dir()):
            return
        time.sleep(0.5)
    raise AssertionError(f"step {step} not reached in {timeout} s")


def _out(run_dir: Path) -> str:
    p = run_dir.parent / f"{run_dir.name}.out"
    return p.read_text(errors="replace") if p.exists() else ""


def _seconds(hms: str) -> int:
    h, m, s = map(int, hms.split(":"))
    return 3600 * h + 60 * m + s


def _members(run_dir: Path) -> list[str]:
    """The hosts of the job's first rendezvous round, as the supervisor logged them."""
    line = next(x for x in (run_dir / "supervisor.log").read_text().splitlines()
                if "hosts in this round:" in x)
    return line.split("hosts in this round: ")[1].split(", ")


def fence_round(run_dir: Path) -> int:
    """The job's current rendezvous round, as the first host recorded it (fence.json)."""
    return int(json.loads((run_dir / "fence.json").read_text())["generation"])


def _completed_bit_equal(run_dir: Path, job: int, one_host: Path) -> dict:
    """Slurm's COMPLETED, the run bit-equal to one host's and summarised as succeeded; the
    job's summary."""
    assert cluster.wait_job(job, 600) == "COMPLETED", _out(run_dir)[-4000:]
    assert_bit_equal(run_dir, one_host, STEPS)
    s = json.loads((run_dir / "supervisor_summary.json").read_text())
    assert s["status"] == "succeeded", s["host_status"]
    return s


def test_two_hosts_bit_equal_to_one_host(hosts3, tiny_data, one_host, tmp_path):
    """Two hosts train as one; a third node of the allocation waits as a spare the job never
    needs, and leaves with it: exit 0, the job not requeued, COMPLETED."""
    run = tmp_path / "two-hosts"
    job = _submit(run, tiny_data, 3, MYRIA_NNODES="2")
    end = time.time() + 120   # the job's supervisors own the run directory ...
    while time.time() < end and "slurm-" not in ((run / "run.lock").read_text()
                                                 if (run / "run.lock").exists() else ""):
        time.sleep(0.2)
    # ... and a second job on it from another host is refused, in one line
    other = cluster.exec_on("h2", [sys.executable, "-m", "myria", "supervise", "--run-dir",
                                   str(run), "--nproc", "2", f"--data.path={tiny_data}", *ARGS],
                            capture=True, timeout=120)
    assert other.returncode == 2 and "is in use by" in other.stderr, other.stderr[-2000:]
    assert "Traceback" not in other.stderr
    s = _completed_bit_equal(run, job, one_host)
    assert s["job"] == f"slurm-{job}"
    first, second = _members(run)
    spare = ({"h0", "h1", "h2"} - {first, second}).pop()
    # every host's part, merged
    assert s["placement"] == {first: [0, 1], second: [2, 3], spare: []}, s["placement"]
    assert s["host_status"][spare] == "spare-unused", s["host_status"]
    log = (run / "supervisor.log").read_text()
    assert f"myria-supervisor[{first}]" in log and f"myria-supervisor[{second}]" in log
    assert f"myria-supervisor[{spare}] INFO the job ended without needing this spare host" in log
    assert "already trained" not in _out(run), _out(run)[-2000:]   # never run again
    rep = run_cli("report", str(run), "--no-prediction").stdout
    assert f"hosts: {first} ranks [0, 1]; {second} ranks [2, 3]" in rep, rep[:3000]
    # each host's workers' output under its own name in the shared run directory
    for host in (first, second):
        assert len(list((run / "logs" / host).rglob("stderr.log"))) == 2, host


def test_lost_host_replaced_by_spare(hosts3, tiny_data, one_host, tmp_path):
    """3 nodes for a 2-host job: one waits as the spare. A host of the job (the second: the
    rendezvous store lives on h0, which is first whenever it is in the round) is killed
    outright: the survivor detects it, the spare takes its place, training resumes from the
    newest checkpoint and ends bit-equal."""
    run = tmp_path / "lost-host"
    job = _submit(run, tiny_data, 3, MYRIA_NNODES="2", **HOLD)
    _wait_step(run, 6)
    first, lost = _members(run)   # the first two to join; h0 too may come last and wait
    spare = ({"h0", "h1", "h2"} - {first, lost}).pop()
    assert f"SPARE: {spare} waits" in (run / "supervisor.log").read_text()
    newest = max(p.name for p in (run / "checkpoints").iterdir()     # committed ones only
                 if re.fullmatch(r"step_\d+", p.name))
    cluster.kill_host(lost)
    s = _completed_bit_equal(run, job, one_host)
    lo, hi = sorted((first, spare))   # a round's ranks follow its hosts' names
    assert s["placement"] == {lo: [0, 1], hi: [2, 3]}
    f = s["faults"][0]
    assert f["host"] == first and f["kind"] == "exit" and f["hosts_lost"] == [lost], f
    rep = run_cli("report", str(run), "--no-prediction").stdout   # names the host lost
    assert f"host {lost} lost at step {f['last_step']}, found on {first} (exit)" in rep, rep
    assert f["resumed_from"] >= int(newest.split("_")[1])   # nothing committed lost
    assert os.path.exists(run / "checkpoints" / f"step_{STEPS:08d}")


def test_partition_detected_as_hang_and_fenced(hosts3, tiny_data, one_host, tmp_path):
    """A host of the job cut off at the switch for longer than the hang timeout, then healed:
    the first host detects it (the host drops out of the rendezvous, or no progress: a hang)
    with its ranks' stacks, goes on with the spare, and each of the cut-off host's workers stops
    on the fence (exit 75) without writing; the run ends bit-equal, the Slurm job COMPLETED."""
    run = tmp_path / "partition"
    job = _submit(run, tiny_data, 3, MYRIA_NNODES="2", **HOLD)
    _wait_step(run, 6)
    first, cut = _members(run)
    cluster.partition(cut)
    assert "link cut (partition)" in cluster.faults_of(cut)   # `myria cluster status` says it
    end = time.time() + 120
    while time.time() < end and "round 1 of the rendezvous" not in \
            (run / "supervisor.log").read_text():
        time.sleep(0.5)
    time.sleep(3)
    cluster.partition(cut, heal=True)
    s = _completed_bit_equal(run, job, one_host)
    f = next((f for f in s["faults"] if f["host"] == first), None)
    assert f is not None, (s["faults"], s["host_status"], _out(run)[-3000:])
    assert f["kind"] in ("hang", "traffic-stopped", "membership-change") and \
        "hang report" in f["action"], f
    assert json.loads((run / "report" / "hang.json").read_text())
    # the round after it is the first host's next attempt (its workers' number), so its
    # recovery is split into phases and booked, not left to `other`
    assert f["attempt"] < fence_round(run) and f.get("recovery_phases"), f
    g = s["goodput"]["seconds"]
    assert g["recovery"] > 0 and g["other"] < 0.05 * s["wall_s"], g
    # and its workers' logs go to a folder of their own: the first round's are kept
    rounds = {p.name for p in (run / "logs" / first).glob("*/attempt_*")}
    assert {"attempt_0", f"attempt_{fence_round(run)}"} <= rounds, rounds
    fence = json.loads((run / "fence.json").read_text())
    assert fence["generation"] >= 1 and cut not in fence["hosts"]
    # each of the cut-off host's workers stopped on the fence and says so (exit 75 from
    # myria.rundir.fence_guard, which every write of a worker's failure path goes through),
    # none killed first by its own agent
    logs = [p.read_text(errors="replace") for p in (run / "logs").rglob("stderr.log")]
    said = sorted(int(m.group(1)) for t in logs
                  for m in re.finditer(rf"rank (\d+) on {cut}: fenced: .* exiting without "
                                       "writing", t))
    assert said == [2, 3], said


def test_lost_host_taken_over_in_job(hosts3, tiny_data, one_host, tmp_path):
    """In-job recovery across hosts: a host of the job is killed outright; the spare node's
    supervisor takes its ranks over, the other host's workers stay (same pids), the lost
    ranks' state comes from the survivors' memory over the network (CRC-checked on arrival),
    and the run ends bit-equal to one host's with one restart-free recovery."""
    run = tmp_path / "injob"
    job = _submit(run, tiny_data, 3, "--resilience.recovery=in-job", MYRIA_NNODES="2",
                  **HOLD)
    _wait_step(run, 6, checkpoint=False)
    # which two hosts make the first round is a race (a loaded host's supervisor comes last
    # and waits as the spare, h0 too); ranks follow the hosts' names, so the second member
    # runs ranks 2 and 3 and is never h0, where the rendezvous store lives
    first, lost = _members(run)
    spare = ({"h0", "h1", "h2"} - {first, lost}).pop()
    cluster.kill_host(lost)
    s = _completed_bit_equal(run, job, one_host)
    assert s["placement"] == {first: [0, 1], spare: [2, 3]}
    f = next(f for f in s["faults"] if f["kind"] == "host-lost")
    assert f["host"] == spare and f["recovery"] == "in-job: host takeover" and f["ranks"] == [2, 3]
    assert f["hosts_lost"] == [lost], f
    # the step reached comes from the run directory (the spare watched no worker); the
    # survivors' memory holds the last step or the one before
    assert f["last_step"] >= 6 and 0 <= f["lost_steps"] <= 1, f
    log = (run / "supervisor.log").read_text()
    said = "\n".join(ln for ln in log.splitlines() if " DEBUG " not in ln)
    assert " ACTION restart" not in log and "stop the worker group" not in log, said
    # the survivor knows which host it replaces (else its agent restarts for the waiting spare)
    assert f"FOLLOW attempt {f['attempt'] + 1} (host {lost}'s ranks [2, 3] taken over by " \
        f"{spare})" in log, said
    # the spare leaves once its takeover's workers are done, not at the rendezvous's 60 s
    # timeout (which it would wait out whenever the store outlives the members: h0 the spare)
    said_at = {k: max(ln[:8] for ln in log.splitlines()
                      if f"myria-supervisor[{spare}]" in ln and k in ln)
               for k in ("ended with exit 0", "summary:")}
    gap = _seconds(said_at["summary:"]) - _seconds(said_at["ended with exit 0"])
    assert 0 <= gap % 86400 < 30, (said_at, log[-3000:])
    restored = json.loads((run / "peer" / "injob.json").read_text())
    assert restored[-1]["copy"] == {"2": "sent", "3": "sent"}   # over the network
    assert restored[-1]["sources"] == {"2": 0, "3": 1}           # held on the other host
    # the step restored is the fault's resume point: the last step, or the one before when the
    # host died while its newest snapshot was still on the way to its neighbour
    assert restored[-1]["step"] == f["resumed_from"] >= 5, (restored[-1], f)
    said = [p.read_text(errors="replace") for p in (run / "logs").rglob("stderr.log")]
    assert sum("joining attempt" in t for t in said) == 2, said   # the first host's workers stayed


def test_injected_faults_are_shown_and_a_second_cluster_refused(hosts3, tmp_path, monkeypatch,
                                                                capsys):
    """`status` names each fault injected on a host; a bad rate is one line; a cluster of
    another state directory is refused while this one is up (the namespaces' names are the
    machine's: it would take them over and orphan this one's daemons)."""
    h = cluster.hosts()[1]
    assert cluster.faults_of(h) == []
    cluster.slow_link(h, "1mbit")
    cluster.fail_diagnostics(h)
    assert cluster.faults_of(h) == ["link limited to 1Mbit", "diagnostics made to fail"]
    cluster.slow_link(h, "off")
    cluster.fail_diagnostics(h, heal=True)
    assert cluster.faults_of(h) == []
    with pytest.raises(cluster.ClusterError, match="a rate as tc writes it"):
        cluster.slow_link(h, "fast")
    # a killed host comes back: Slurm takes it into service again, commands run on it
    cluster.kill_host(h)
    with pytest.raises(cluster.ClusterError, match=f"host {h} is down"):
        cluster.exec_on(h, ["true"])
    cluster.revive(h)
    assert cluster.node_states()[h] == "idle"
    assert cluster.exec_on(h, ["hostname"], capture=True).stdout.strip() == h
    with pytest.raises(cluster.ClusterError, match=f"revive {h}: it is up"):
        cluster.revive(h)
    first = str(cluster.state_dir())
    monkeypatch.setenv(cluster.STATE_ENV, str(tmp_path / "other"))
    with pytest.raises(cluster.ClusterError, match=f"the cluster of .*={first} is up"):
        cluster.up(2, quiet=True)
    from myria.cli import main

    assert main(["cluster", "status"]) == 0
    assert f"down here; the cluster of {cluster.STATE_ENV}={first} is up" in \
        capsys.readouterr().out
    monkeypatch.setenv(cluster.STATE_ENV, first)
