"""The goodput ledger, the recovery phases and the hang report's stacks."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from myria.observe import goodput, hang
from myria.train import heartbeat
from tests.conftest import TINY, run_cli


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t

    def tick(self, s):
        self.t += s


def test_steps_at_under_half_the_usual_pace_book_their_excess_as_slow(tmp_path):
    """A row whose steps took more than SLOW_FACTOR x the median of the process's earlier rows
    (from the PACE_MIN-th row) books the time beyond that median as `slow`; a row within the
    factor, the first rows (start-up and warm-up set no pace) and a row without a step (an
    evaluation's) book none."""
    c = Clock()
    led = goodput.Ledger(tmp_path, attempt=0, clock=c)
    led.ready(rank=0)
    hb = heartbeat.Heartbeat(0, ledger=led)
    hb.resumed(0)
    step = 0

    def row(seconds_per_step, steps=1):
        nonlocal step
        for _ in range(steps):
            step += 1
            hb.phase("forward-backward")
            c.tick(seconds_per_step)
            hb.step_done(step, seconds_per_step)
        hb.phase("metrics")
        return led.row({"step": step, "data_wait_s": 0.0, "time": c()})["goodput"]

    first = row(9.0)    # the first step: compiling, caches, no pace yet
    assert "slow" not in first and first["productive"] == 9.0
    for _ in range(goodput.PACE_MIN):
        assert "slow" not in row(1.0)
    hb.phase("eval")
    c.tick(3.0)
    assert led.row({"step": step, "time": c()})["goodput"] == {"eval": 3.0}
    assert row(1.9, steps=2) == {"productive": 3.8}         # within the factor
    assert row(5.0) == {"productive": 1.0, "slow": 4.0}     # a stall: 4 s beyond the usual 1 s
    assert row(3.0, steps=3) == {"productive": 3.0, "slow": 6.0}
    assert "slow" not in row(1.0)


def test_ledger_rows_tile_the_process_time_and_mark_redone_steps(tmp_path):
    (tmp_path / "metrics.abandoned.jsonl").write_text(
        json.dumps({"step": 3, "loss": 1.0, "resumed_from": 2}) + "\n")
    c = Clock()
    led = goodput.Ledger(tmp_path, attempt=1, clock=c)
    c.tick(2.0)
    led.ready(rank=0)
    hb = heartbeat.Heartbeat(0, ledger=led)   # no store: the ledger is told, nothing is sent
    hb.phase("resume")
    c.tick(1.0)
    hb.resumed(2)
    c.tick(0.5)
    rows = []
    for step in (3, 4):            # step 3 was done by the killed attempt: redone
        hb.phase("data")
        c.tick(0.25)
        hb.phase("forward-backward")
        c.tick(1.0)
        hb.step_done(step, 1.0)
        hb.phase("metrics")
        rows.append(led.row({"step": step, "data_wait_s": 0.25, "time": c()}))
        hb.phase("checkpoint")
        c.tick(0.75)
    first, second = rows[0]["goodput"], rows[1]["goodput"]
    # attempt 1: its start-up is recovery; the first row covers process start to its end
    assert first == {"recovery": 3.5, "data_wait": 0.25, "redone": 1.0}
    assert second == {"productive": 1.0, "data_wait": 0.25, "checkpoint": 0.75}
    assert rows[1]["goodput_since"] == rows[0]["time"] and rows[0]["attempt"] == 1
    marks = json.loads(goodput.marks_file(tmp_path, 1, 0).read_text())
    assert marks["model_built"] - marks["process_start"] == 2.0
    assert marks["first_step"] - marks["restored"] == 1.75


def test_summary_tiles_wall_time_by_attempts_and_faults(tmp_path):
    rows = [
        {"step": 1, "time": 14.0, "goodput_since": 2.0, "attempt": 0,
         "goodput": {"startup": 10.0, "productive": 2.0}},
        {"step": 2, "time": 16.0, "goodput_since": 14.0, "attempt": 0,
         "goodput": {"productive": 2.0}},
        {"step": 2, "time": 40.0, "goodput_since": 30.0, "attempt": 1,
         "goodput": {"recovery": 8.0, "redone": 2.0}},
        {"step": 3, "time": 42.0, "goodput_since": 40.0, "attempt": 1,
         "goodput": {"productive": 1.5}},     # 0.5 s no category explains
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    fault = {"attempt": 0, "fault_at": 17.0, "detected_at": 18.0}
    s = goodput.summarize(tmp_path, 0.0, 45.0, [fault],
                          [{"first_step": 3, "cost_s_per_step": 0.5}])
    sec = s["seconds"]
    assert sec["startup"] == 12.0            # before the first worker, and its start-up
    assert sec["lost"] == 1.0 and sec["detection"] == 1.0
    assert sec["recovery"] == 12.0 + 8.0     # detection to the new process, then its start-up
    assert sec["redone"] == 2.0 and sec["shutdown"] == 3.0 and sec["other"] == 0.5
    assert sec["productive"] == 5.0 and sec["straggler"] == 0.5
    assert s["accounted_s"] == pytest.approx(45.0)
    assert s["ettr"] == pytest.approx(5.0 / 45, abs=1e-4)
    starts = [seg["t"] for seg in s["timeline"]]
    assert starts == sorted(starts) and s["timeline"][0]["s"] == {"startup": 2.0}
    # a job stopped before any row or fault (its hosts never gathered) was all start-up
    empty = tmp_path / "empty"
    empty.mkdir()
    s = goodput.summarize(empty, 0.0, 11.0, [])
    assert {k: v for k, v in s["seconds"].items() if v} == {"startup": 11.0}, s["seconds"]


def test_a_second_supervised_job_keeps_the_first_ones_ledger_and_faults(tmp_path):
    """Two supervised jobs on one run directory (the second resumed what the first stopped):
    the newest summary is the second's, both are kept, and the report's ledger is both jobs'
    back to back, each fault numbered by its job."""
    from myria import rundir
    from myria.observe import report_sections as sections
    def ledger(wall, productive, startup):
        return {"wall_s": wall, "accounted_s": wall, "ettr": productive / wall,
                "seconds": dict(dict.fromkeys(goodput.CATEGORIES, 0.0), productive=productive,
                                startup=startup, shutdown=wall - productive - startup),
                "timeline": [{"t": 0.0, "dt": startup, "s": {"startup": startup}},
                             {"t": startup, "dt": productive, "s": {"productive": productive}}]}

    first = {"job": "slurm-101", "started_at": 1000.0, "status": "stopped",
             "goodput": ledger(100.0, 60.0, 10.0),
             "faults": [{"kind": "crash", "ranks": [1], "last_step": 11, "time_lost_s": 9.0}]}
    second = {"job": "slurm-102", "started_at": 5000.0, "status": "succeeded",
              "goodput": ledger(50.0, 40.0, 5.0), "faults": []}
    rundir.write_job_summary(tmp_path, first)
    rundir.write_job_summary(tmp_path, second)
    newest = json.loads((tmp_path / rundir.SUPERVISOR_SUMMARY).read_text())
    assert newest["job"] == "slurm-102"
    assert sorted(p.name for p in (tmp_path / rundir.SUPERVISOR_JOBS).iterdir()) == [
        "slurm-101.json", "slurm-102.json"]
    led, faults = sections.goodput_ledger(tmp_path)
    assert led["jobs"] == 2 and led["job_starts"] == [0.0, 100.0]
    assert led["wall_s"] == 150.0 and led["seconds"]["productive"] == 100.0
    assert led["ettr"] == pytest.approx(100.0 / 150.0, abs=1e-4)
    assert [seg["t"] for seg in led["timeline"]] == [0.0, 10.0, 100.0, 105.0]
    assert [(f["job"], f["last_step"]) for f in faults] == [(1, 11)]
    out = tmp_path / "report"
    out.mkdir()
    page = sections.recovery_section(tmp_path, out)
    assert "of 2 supervised jobs" in page and "<th>job</th>" in page
    # each category of the table in words; every category has them
    assert "<td>startup</td><td>15.0</td><td>10.0%</td><td>processes starting" in page, page
    assert set(goodput.MEANING) == set(goodput.CATEGORIES)
    from myria.observe.report import goodput_line

    assert goodput_line(json.loads((out / "goodput.json").read_text())) == (
        "goodput: ETTR 0.667 over 150.0 s of wall time (2 supervised jobs back to back); "
        "1 fault(s), 9.0 s lost to them")
    # a fault whose lost time was not measured (a job that failed) is not counted as 0 s
    unmeasured = {"ledger": {"ettr": 0.5, "wall_s": 10.0}, "faults": [{"time_lost_s": None}]}
    assert goodput_line(unmeasured).endswith("1 fault(s), their lost time not measured")
    # and each fault in a line of its own (a lost host's are said by lost_host_lines)
    from myria.observe.report import fault_lines

    assert fault_lines({"faults": [
        {"kind": "exit", "ranks": [1], "last_step": 4, "recovery": "restart",
         "resumed_from": 4, "time_lost_s": 9.3},
        {"kind": "exit", "ranks": [0, 1], "last_step": 6, "resumed_from": None},
        {"kind": "exit", "hosts_lost": ["h2"]}]}) == [
        "fault: exit of rank(s) [1] after step 4; restart from step 4, 9.3 s lost",
        "fault: exit of rank 0 (rank(s) [1] stopped after it) after step 6; not recovered (the "
        "job ended)"]
    # one job's ledger stays as it was; a job id that is no file name is made one
    assert goodput.combine([first["goodput"]])["wall_s"] == 100.0
    assert rundir.job_summary_file(tmp_path, "a/b c").name == "a_b_c.json"


def test_breakdown_phases_add_up_to_the_time_lost():
    f = {"fault_at": 10.0, "detected_at": 11.0, "stopped_at": 11.5, "decided_at": 20.0,
         "backoff_done_at": 21.0, "restarted_at": 21.0, "regained_at": 60.0}
    marks = {0: {"entered": 28.0, "pg_ready": 30.0, "model_built": 33.0, "restored": 34.0},
             1: {"entered": 29.0, "pg_ready": 30.5, "model_built": 32.0, "restored": 35.0}}
    b = goodput.breakdown(f, marks)
    assert b == {"detection": 1.0, "teardown": 0.5, "decision": 8.5, "backoff": 1.0,
                 "start_processes": 8.0, "process_groups": 1.5, "build_model": 2.5,
                 "restore": 2.0, "redo_steps": 25.0}
    assert sum(b.values()) == pytest.approx(f["regained_at"] - f["fault_at"])


WAITER = """
import sys, threading, time
from myria.observe import hang
hang.listen_for_stacks(sys.argv[1], rank=3)
def wait_in_collective():
    time.sleep(60)
print("ready", flush=True)
wait_in_collective()
"""


def test_a_rank_ending_without_a_stack_dump_leaves_no_empty_file(tmp_path):
    """Every worker opens its stack file at start (faulthandler needs it open before the
    signal); one that ends with nothing dumped removes it and the empty hang folder, one whose
    stack was dumped keeps it."""
    code = ("import os, sys\nfrom myria.observe import hang\n"
            "hang.listen_for_stacks(sys.argv[1], rank=int(sys.argv[2]))\n"
            "assert hang.stack_file(sys.argv[1], int(sys.argv[2])).exists()\n"
            "if sys.argv[3] == 'dump':\n    os.kill(os.getpid(), hang.STACK_SIGNAL)\n")
    subprocess.run([sys.executable, "-c", code, str(tmp_path), "0", "none"], check=True)
    assert not (tmp_path / "hang").exists()
    subprocess.run([sys.executable, "-c", code, str(tmp_path), "1", "dump"], check=True)
    subprocess.run([sys.executable, "-c", code, str(tmp_path), "2", "none"], check=True)
    assert [p.name for p in (tmp_path / "hang").iterdir()] == ["rank00001.stack.txt"]
    assert "File " in hang.stack_file(tmp_path, 1).read_text()


def test_hang_stacks_name_the_function_each_rank_waits_in(tmp_path, monkeypatch):
    monkeypatch.setattr(hang.shutil, "which", lambda name: None)  # the faulthandler path
    p = subprocess.Popen([sys.executable, "-c", WAITER, str(tmp_path)], stdout=subprocess.PIPE,
                         text=True)
    try:
        assert p.stdout.readline().strip() == "ready"
        time.sleep(0.2)
        stacks = hang.request_stacks({3: p.pid}, tmp_path)
        assert p.poll() is None  # the stack signal did not end it
    finally:
        p.kill()
    assert stacks[3]["tool"] == "faulthandler"
    assert "wait_in_collective" in stacks[3]["main"][0], stacks[3]["main"]
    rep = hang.add_stacks({"waiting": {3: {"collective": "all_reduce"}}, "stuck": {}}, stacks)
    assert rep["waiting"][3]["stack"][0] == stacks[3]["main"][0] and rep["stack_ranks"] == [3]


@pytest.mark.slow
def test_supervised_fault_run_ledger_sums_to_wall_time(tmp_path, tiny_data):
    """A killed worker under `myria supervise`: the ledger accounts for the wall time within
    1% (no more than 1% left as `other`), every recovery phase is filled in and adds up to the
    fault's time lost, and `myria report` draws it."""
    run_cli("supervise", "--run-dir", str(tmp_path), "--nproc", "2", f"--data.path={tiny_data}",
            *TINY, "--training.steps=10", "--checkpoint.interval=4",
            "--resilience.heartbeat_s=0.5", "--resilience.backoff_s=0.2",
            "--resilience.diagnose=false", "--resilience.memory_snapshot_interval=1",
            env={"MYRIA_FAULT": "kill:rank=1:step=6"},
            timeout=400)
    s = json.loads((tmp_path / "supervisor_summary.json").read_text())
    g = s["goodput"]
    assert g["accounted_s"] == pytest.approx(s["wall_s"], rel=0.01)
    assert g["seconds"]["other"] <= 0.01 * s["wall_s"], g["seconds"]
    assert g["seconds"]["detection"] > 0 and g["seconds"]["recovery"] > 0
    assert g["seconds"]["redone"] > 0  # the steps lost after the newest committed checkpoint
    # the ledger's step time (first runs, their slow part, redone runs, data waits) is the
    # steps' recorded time (kept and set-aside rows) less the peer snapshots' copies, which the
    # ledger counts apart
    rows = [r for name in ("metrics.jsonl", "metrics.abandoned.jsonl")
            for r in map(json.loads, (tmp_path / name).read_text().splitlines())
            if "step_time_s" in r]
    steps = sum(g["seconds"][k] for k in ("productive", "slow", "redone", "data_wait"))
    recorded = sum(r["step_time_s"] for r in rows)
    assert 0.8 * recorded <= steps <= recorded + 0.05, (steps, recorded)
    f = s["faults"][0]
    # every step once, and the lost ones (from the newest committed checkpoint: step 4, or
    # none when a loaded host had not yet committed its overlapped copy by step 6) again
    assert f["resumed_from"] in (0, 4), f
    assert len(rows) == 10 + 6 - f["resumed_from"] and g["seconds"]["productive"] > 0
    assert 0 < g["ettr"] < 1 and s["effective_training_time_ratio"] == g["ettr"]
    ph = f["recovery_phases"]
    assert set(ph) == set(goodput.RECOVERY_PHASES) and min(ph.values()) >= 0, ph
    assert ph["start_processes"] > 0 and ph["redo_steps"] > 0
    assert sum(ph.values()) == pytest.approx(f["time_lost_s"], abs=0.01)
    # the ring neighbour held each rank's state after every step of the last attempt
    for rank in (0, 1):
        p = json.loads((tmp_path / "peer" / f"rank{rank:05d}.json").read_text())
        assert p["holds_rank"] == 1 - rank and p["held_step"] == 10, p
        assert p["snapshots"] == 10 - f["resumed_from"] and p["crc_failures"] == 0, p
    run_cli("report", str(tmp_path), "--no-prediction")
    page = (tmp_path / "report" / "index.html").read_text()
    assert "id=goodput" in page and "id=recoveries" in page and f"ETTR {g['ettr']:.4f}" in page
    # the fault said at the top as the console says it; every step of the run analysed, those
    # before the restart too (the restart's set-up collectives are numbered step 0)
    assert "<ul id=summary><li>run: 2 rank(s)" in page and "<li>fault: exit of rank 1" in page, \
        page[:3000]
    blame = json.loads((tmp_path / "report" / "blame.json").read_text())
    assert blame["steps"] == 10 - 1, blame["steps"]   # less the warm-up step
    from myria.observe.report_sections import fault_steps

    assert fault_steps(tmp_path) == [6]   # marked on the curves


def test_the_summary_line_counts_attempts_as_the_log_numbers_them():
    """Each attempt after the first (a restart, an in-job recovery, a shrink, a grow) uses one of
    resilience.max_restarts and is numbered so in the log; the summary line counts the same."""
    from myria.resilience.summary import attempts_line

    faults = [{"restarted_at": 1.0, "recovery": "restart"},
              {"restarted_at": 2.0, "recovery": "in-job: spare"},
              {"restarted_at": 3.0, "recovery": "in-job: shrink"},
              {"restarted_at": 0.0, "recovery": "restart"}]   # the job ended before it
    s = {"faults": faults, "attempts": 4, "resizes": [{"kind": "shrink"}, {"kind": "grow"}]}
    assert attempts_line(s) == ("4 attempt(s) after the first (1 restart, 1 in-job recovery, "
                                "1 shrink, 1 grow)")
    assert attempts_line({"faults": [], "attempts": 0}) == "no restart"
    # a multi-host job restarted by a new rendezvous round: its supervisor numbered no
    # attempt, the fault's restart counts
    assert attempts_line({"faults": [{"restarted_at": 5.0, "recovery": "restart"}],
                          "attempts": 0, "restarts": 1}) == \
        "1 attempt(s) after the first (1 restart)"


def test_the_time_between_two_starts_by_hand_is_no_ones(tmp_path):
    """`myria train` stopped and started again by hand (no supervisor): each start's rows tile
    its own time; the 20 s between the two starts are not the run's, so ETTR is over 12 s."""
    from myria.observe.report_sections import goodput_ledger

    rows = []
    for since, steps in ((100.0, 3), (126.0, 3)):   # 20 s between 106 and 126
        t = since
        for s in range(steps):
            gp = {"startup": 1.0, "productive": 1.0} if s == 0 else {"productive": 2.0}
            rows.append({"step": s + 1, "loss": 1.0, "goodput_since": t, "time": t + 2.0,
                         "goodput": gp, "attempt": 0})
            t += 2.0
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert goodput.process_spans(goodput.ledger_rows(tmp_path, 0.0)) == [(100.0, 106.0),
                                                                         (126.0, 132.0)]
    led, faults = goodput_ledger(tmp_path, summaries=[])
    assert led["wall_s"] == 12.0 and led["seconds"]["other"] == 0.0 and not faults
    assert led["ettr"] == pytest.approx(10.0 / 12.0, abs=1e-4)
    assert led["jobs"] == 2 and "myria train" in led["what"]
    # a straggler the report found costs its time per step from its first step on, as a
    # supervisor's ledger counts it: 0.5 s on each of steps 2-3 of both starts
    led, _ = goodput_ledger(tmp_path, summaries=[],
                            stragglers=[{"cost_s_per_step": 0.5, "first_step": 2}])
    assert led["seconds"]["straggler"] == 2.0 and led["seconds"]["productive"] == 8.0


def test_a_rank_without_a_dump_whose_stack_waits_in_a_collective_is_no_suspect():
    """A rank that wrote no event dump but whose stack was read is alive: in torch.distributed
    it waits for another rank (one on a lost host) and is no suspect; without a stack it is
    silent, a suspect."""
    rep = {"stuck": {}, "waiting": {}, "collective": None, "silent_ranks": [0, 1],
           "suspects": [0, 1]}
    frame = ("reduce_scatter_single (/venv/lib/python3.11/site-packages/torch/distributed/"
             "distributed_c10d.py:4321)")
    hang.add_stacks(rep, {0: {"tool": "py-spy", "main": [frame, "step (myria/x.py:1)"],
                              "text": ""}})
    assert rep["silent_ranks"] == [1] and rep["suspects"] == [1]
    assert rep["alive"][0]["in_collective"]
    line = hang.summary_line(rep)
    assert "rank(s) [1] wrote nothing" in line and "rank 0 wrote no event dump; its stack is " \
        "in reduce_scatter_single" in line and "it waits for another rank" in line, line


def test_stacks_taken_at_another_fault_are_not_called_a_hang():
    """The supervisor takes the ranks' stacks for a hang and for a host dropping out of the
    rendezvous; the report says which (an old report without the field is a hang's)."""
    from myria.observe.report_sections import hang_html, hang_title

    rep = {"stuck": {}, "waiting": {}, "collective": None, "silent_ranks": [],
           "suspects": [], "stuck_ranks": []}
    assert hang_title(rep) == "the run hung"
    assert hang_title({**rep, "fault": "hang"}) == "the run hung"
    other = {**rep, "fault": "membership-change"}
    assert hang_title(other) == "the ranks' stacks at the membership change"
    page = hang_html(other)
    assert "<h2 id=hang>The ranks&#x27; stacks at the membership change</h2>" in page
    assert "before the membership change" in page and "the hang" not in page, page
