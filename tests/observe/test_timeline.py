"""The event timer, the merged timeline and blame: 4-rank CPU runs with and without a slowed rank.

One run per layout is shared by the tests of this module (tiny model, 10 steps).
"""

from __future__ import annotations

import json
import shutil
import statistics

import pytest

from myria.observe.analyze import blame_report, load_run, step_table
from myria.observe.report import write_report
from tests.conftest import OBSERVE_ARGS as ARGS
from tests.conftest import OBSERVE_STEPS as STEPS
from tests.conftest import run_cli
from tests.conftest import train4 as train


def write_events(run_dir):
    """Hand-made events of 3 ranks: rank 1 arrives 30 ms late at every all-reduce of 4 steps."""
    ev = run_dir / "events"
    ev.mkdir()
    for r in range(3):
        lines = [json.dumps({"header": {"rank": r, "world": 3, "host": "h",
                                        "coord": {"dp": r}}})]
        for s in range(1, 5):
            base = s * 1_000_000
            late = 30_000 if r == 1 else 0
            lines.append(json.dumps({"n": "step", "c": "step", "s": s, "t0": base,
                                     "t1": base + 100_000, "th": 0}))
            lines.append(json.dumps({"n": "forward", "c": "compute", "s": s, "m": 0,
                                     "t0": base, "t1": base + 40_000 + late, "th": 0}))
            lines.append(json.dumps({"n": "all_reduce", "c": "comm", "s": s, "th": 0,
                                     "t0": base + 40_000 + late, "t1": base + 75_000,
                                     "a": {"dim": "dp", "group": [0, 1, 2], "seq": s}}))
        (ev / f"rank{r:05d}.jsonl").write_text("\n".join(lines) + "\n")
    return ev


def test_of_two_ranks_the_one_late_every_step_stands_out_and_jitter_does_not(tmp_path):
    """Two ranks (the median of two is their mean): one late by 20 ms +- 2 ms at each of 12
    steps stands out; the same two ranks with only the jitter (either one late) do not."""
    import random

    def run_of(d, late_ms):
        rng = random.Random(0)
        ev = d / "events"
        ev.mkdir(parents=True)
        lines = {r: [json.dumps({"header": {"rank": r, "world": 2, "host": "h",
                                            "coord": {"dp": r}}})] for r in (0, 1)}
        for s in range(1, 13):
            base = s * 1_000_000
            comp = {r: 40_000 + rng.randint(0, 4_000) + (late_ms * 1000 if r == 1 else 0)
                    for r in (0, 1)}
            end = max(comp.values()) + 5_000
            for r in (0, 1):
                lines[r] += [json.dumps({"n": "step", "c": "step", "s": s, "t0": base,
                                         "t1": base + end, "th": 0}),
                             json.dumps({"n": "forward", "c": "compute", "s": s, "m": 0,
                                         "t0": base, "t1": base + comp[r], "th": 0}),
                             json.dumps({"n": "all_reduce", "c": "comm", "s": s, "th": 0,
                                         "t0": base + comp[r], "t1": base + end,
                                         "a": {"dim": "dp", "group": [0, 1], "seq": s}})]
        for r in (0, 1):
            (ev / f"rank{r:05d}.jsonl").write_text("\n".join(lines[r]) + "\n")
        return blame_report(load_run(d))

    late = run_of(tmp_path / "late", 20)
    assert late["most_blamed_rank"] == 1 and late["standout_ranks"] == [1], late["noise_s"]
    clean = run_of(tmp_path / "clean", 0)
    assert clean["standout_ranks"] == [], (clean["excess_blame_s"], clean["noise_s"])


def test_unit_blame_attributes_waiting_to_the_late_rank(tmp_path):
    ev = write_events(tmp_path)
    run = load_run(tmp_path)
    b = blame_report(run)
    by = {x["rank"]: x for x in b["ranks"]}
    assert b["most_blamed_rank"] == 1 and b["steps"] == 3  # step 1 is the warm-up
    assert by[1]["blamed_s"] == pytest.approx(3 * 2 * 0.030)
    assert by[0]["waited_s"] == pytest.approx(3 * 0.030) and by[1]["waited_s"] == 0
    assert by[0]["blamed_s"] == 0 and by[2]["blamed_s"] == 0
    # every step waited on rank 1, whichever rank's step was longest
    assert [x["critical_rank"] for x in b["per_step"]] == [1, 1, 1]
    table = step_table(run)
    assert table[1][2]["compute_s"] == pytest.approx(0.070)   # waits are not compute
    assert table[0][2]["comm_s"]["dp"] == pytest.approx(0.035)
    # a truncated and a missing file are reported, not fatal
    f = ev / "rank00002.jsonl"
    f.write_text(f.read_text()[:-20])
    (ev / "rank00001.jsonl").unlink()
    out = write_report(tmp_path, predict=False)
    b = json.loads((out / "blame.json").read_text())
    assert b["missing_ranks"] == [1] and b["truncated_ranks"] == [2]
    html = (out / "index.html").read_text()
    assert "rank 1: no events file" in html and "no prediction: skipped (--no-prediction)" in html
    # a file where the report directory goes: one line, no traceback
    import shutil

    shutil.rmtree(out)
    out.write_text("")
    from myria.errors import DataError

    with pytest.raises(DataError, match="cannot write the report to .*a file has that name"):
        write_report(tmp_path, predict=False)


def test_slow_link_is_blamed_on_communication_on_its_host(tmp_path):
    """A host's link found slow by its supervisor's probe (a slow-link detection at step 3):
    the report blames communication on that host, with its ranks' time in collectives per
    step before and from then (2 hosts x 1 rank; the ring's all-reduce slows both alike)."""
    from myria import detections

    ev = tmp_path / "events"
    ev.mkdir()
    for r, host in enumerate(("h0", "h1")):
        lines = [json.dumps({"header": {"rank": r, "world": 2, "host": host,
                                        "coord": {"dp": r}}})]
        for s in range(1, 6):
            base, comm = s * 1_000_000, 300_000 if s >= 3 else 30_000
            lines += [json.dumps({"n": "step", "c": "step", "s": s, "t0": base,
                                  "t1": base + 40_000 + comm, "th": 0}),
                      json.dumps({"n": "forward", "c": "compute", "s": s, "m": 0, "t0": base,
                                  "t1": base + 40_000, "th": 0}),
                      json.dumps({"n": "all_reduce", "c": "comm", "s": s, "th": 0,
                                  "t0": base + 40_000, "t1": base + 40_000 + comm,
                                  "a": {"dim": "dp", "group": [0, 1], "seq": s}})]
        (ev / f"rank{r:05d}.jsonl").write_text("\n".join(lines) + "\n")
    detections.record(tmp_path, "slow-link", None, "h1", 3,
                      {"ranks": [1], "evidence": "0.7 MB/s to the rendezvous host"}, "none")
    p = run_cli("report", str(tmp_path), "--no-prediction")
    assert f"report of {tmp_path}: 4 step(s) analysed (step 1, the warm-up, left out), 2 " \
        "rank(s);" in p.stdout, p.stdout
    assert ("blame: communication on h1 (ranks [1]): its link is degraded from step 3 (0.7 "
            "MB/s to the rendezvous host); its ranks' collectives took 0.300 s per step from "
            "then, 0.030 s before") in p.stdout, p.stdout
    b = json.loads((tmp_path / "report" / "blame.json").read_text())
    assert b["slow_links"][0]["host"] == "h1" and b["standout_ranks"] == []
    assert "id=slow-links" in (tmp_path / "report" / "index.html").read_text()


@pytest.mark.slow
def test_slowed_rank_is_blamed_and_stands_out(slow_dp):
    out = write_report(slow_dp, predict=False)
    b = json.loads((out / "blame.json").read_text())
    assert {"ranks", "most_blamed_rank", "steps"} <= set(b)
    assert b["most_blamed_rank"] == 2 and b["standout_ranks"] == [2], b["excess_blame_s"]
    assert b["steps"] == STEPS - 1
    for r in b["ranks"]:
        assert set(r) >= {"rank", "coord", "compute_s", "blamed_s", "waited_s"}
    comp = {r["rank"]: r["compute_s"] for r in b["ranks"]}
    others = statistics.median(v for k, v in comp.items() if k != 2)
    assert comp[2] > 1.25 * others  # the heat map's row of rank 2 stands out
    assert b["whatif_saving_s"] > 0
    waited = {r["rank"]: r["waited_s"] for r in b["ranks"]}
    assert waited[2] < min(v for k, v in waited.items() if k != 2)


@pytest.mark.slow
def test_clean_run_blames_no_rank_beyond_the_noise(clean_dp):
    b = json.loads((write_report(clean_dp, predict=False) / "blame.json").read_text())
    assert b["standout_ranks"] == [], (b["excess_blame_s"], b["noise_s"])
    assert all(v <= b["noise_s"] for v in b["excess_blame_s"].values())


@pytest.mark.slow
def test_trace_has_a_track_per_rank_with_the_expected_events(slow_dp):
    trace = json.loads((write_report(slow_dp, predict=False) / "trace.json").read_text())
    ev = trace["traceEvents"]
    names = {e["tid"]: e["args"]["name"] for e in ev if e.get("name") == "thread_name"
             and "background" not in e["args"]["name"]}
    assert sorted(names) == [0, 1, 2, 3]  # one track per rank (+ helper-thread tracks)
    assert names[2].startswith("rank 2 (dp2, pp0, cp0, tp0, ep0)")
    accum = 16 // (4 * 2)  # global batch / (dp x micro batch)
    for r in range(4):
        mine = [e for e in ev if e.get("tid") == r and e["ph"] == "X"]
        fwd = [e for e in mine if e["name"].startswith("forward mb")]
        bwd = [e for e in mine if e["name"].startswith("backward mb")]
        assert len(fwd) == len(bwd) == STEPS * accum, r
        assert all(e["dur"] >= 0 and isinstance(e["ts"], int) for e in mine)
    # every collective is seen by every rank of the group (FSDP's gathers and scatters)
    colls = {r: sorted((e["args"]["seq"], e["name"]) for e in ev if e.get("tid") == r and
                       e.get("cat") == "comm" and e["args"].get("dim") == "dp_shard")
             for r in range(4)}
    assert colls[0] and all(colls[r] == colls[0] for r in range(4))
    kinds = {n for _, n in colls[0]}
    assert {"all_gather_single", "reduce_scatter_single", "all_reduce"} <= kinds


@pytest.mark.slow
def test_pipeline_run_blames_the_slowed_stage_rank(tmp_path, tiny_data):
    # dp2 x pp2, rank 1 (stage 0) slowed: the next stage waits for it, then its data-parallel
    # peer waits for the next stage; that waiting is chased back to rank 1. 3x: at smaller
    # factors a loaded host's contention can make another rank compute as long (the runs are
    # in docs/observability.md)
    run = train(tmp_path / "pp", tiny_data, "--parallel.pp=2", fault="slow:rank=1:factor=3")
    b = json.loads((write_report(run, predict=False) / "blame.json").read_text())
    assert b["most_blamed_rank"] == 1, b["ranks"]
    comp = {r["rank"]: r["compute_s"] for r in b["ranks"]}
    assert comp[1] > 1.25 * comp[0]  # in the heat map, against its peer of the same stage
    trace = json.loads((run / "report" / "trace.json").read_text())
    flows = [e for e in trace["traceEvents"] if e["ph"] in ("s", "f")]
    assert flows and len(flows) % 2 == 0  # pipeline send -> receive arrows


def test_report_of_a_directory_that_is_not_a_run(tmp_path):
    p = run_cli("report", str(tmp_path), check=False)
    assert p.returncode == 2 and "not a myria run directory" in p.stderr
    assert "Traceback" not in p.stderr


@pytest.mark.slow
def test_report_on_a_copy_with_a_killed_rank(slow_dp, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(slow_dp, run, ignore=shutil.ignore_patterns("report"))
    (run / "events" / "rank00003.jsonl").unlink()
    p = run_cli("report", str(run))
    assert "rank 3: no events file" in p.stdout
    b = json.loads((run / "report" / "blame.json").read_text())
    assert b["missing_ranks"] == [3] and len(b["ranks"]) == 3


@pytest.mark.slow
def test_hang_report_names_the_frozen_rank_and_the_collective(tmp_path, tiny_data):
    run = tmp_path / "hang"
    run_cli("supervise", "--run-dir", str(run), "--nproc", "4", f"--data.path={tiny_data}",
            *ARGS, "--training.steps=8", "--resilience.heartbeat_s=0.5",
            "--resilience.hang_timeout_s=5", "--resilience.backoff_s=0.2",
            "--resilience.diagnose=false", env={"MYRIA_FAULT": "hang:rank=2:step=4"},
            timeout=600)
    rep = json.loads((run / "report" / "hang.json").read_text())
    assert rep["stuck_ranks"] == [2] and rep["silent_ranks"] == [], rep
    assert rep["stuck"]["2"]["in"] == "step" if isinstance(next(iter(rep["stuck"])), str) \
        else rep["stuck"][2]["in"] == "step"
    c = rep["collective"]
    assert c["ranks"] == [0, 1, 3] and c["name"] and c["dim"], c
    log = (run / "supervisor.log").read_text()
    assert "HANG REPORT rank 2 is stuck outside any collective" in log
    assert f"ranks [0, 1, 3] wait in {c['name']}" in log
    assert "rank 2 (pid" in log and "phase step-start" in log, log   # not the last checkpoint
    # the report's page leads with the supervisor's line and rank 2's stack, rank 2 in red
    from myria.observe.hang import summary_line

    p = run_cli("report", str(run), "--no-prediction")
    line = summary_line({**rep, "stuck": {int(k): v for k, v in rep["stuck"].items()}})
    # the supervisor restarted it, and it trained to its end: said, not "before the hang"
    assert f"the run hung: {line}; restarted, it trained on to step 8" in p.stdout, p.stdout
    page = (run / "report" / "index.html").read_text()
    import html

    hung = page.split("<h2 id=hang>The run hung</h2>")[1].split("<h2>")[0]
    assert html.escape(line) in hung and "<h3>rank 2: stuck outside any collective" in hung
    assert "restarted after the hang and trained on to step 8" in hung
    assert "at_step_start" in hung.split("<pre class=stack>")[1], hung
    hot = [r for r in page.split("<table id=\"blame\">")[1].split("</table>")[0]
           .split("<tr") if r.startswith(" class=hot")]
    assert hot and all(r.startswith(" class=hot><td>2</td>") for r in hot), hot


def test_clock_offset_through_the_store_corrects_a_skewed_host():
    import threading
    import time

    import torch.distributed as dist

    from myria.observe.events import measure_clock_offset

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    client = dist.TCPStore("127.0.0.1", store.port, is_master=False)  # rank 1's own connection
    skew_us = 5_000_000  # rank 1's host clock runs 5 s ahead

    def rank0():
        measure_clock_offset(store, 0, 2)

    t = threading.Thread(target=rank0, daemon=True)
    t.start()
    off = measure_clock_offset(client, 1, 2, clock=lambda: time.time_ns() // 1000 + skew_us)
    t.join(timeout=30)
    assert abs(off - skew_us) < 50_000, off  # within the round trip through the store


def test_a_report_of_an_unfinished_run_says_so(tmp_path):
    from myria.observe.report import unfinished_line

    (tmp_path / "config.json").write_text(json.dumps({"training": {"steps": 10}}))
    rows = [{"step": s, "loss": 1.0} for s in range(1, 5)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert "reached step 4 of training.steps = 10" in unfinished_line(tmp_path)
    rows = [{"step": s, "loss": 1.0} for s in range(1, 11)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert unfinished_line(tmp_path) is None


def test_a_paused_recorder_records_nothing_inside(tmp_path):
    """Work between steps that a step's breakdown must not count (a pipelined evaluation's
    forwards) is not recorded; recording resumes after, nested pauses included."""
    from myria.observe.events import Recorder

    rec = Recorder(tmp_path, 0, 1, flush_s=60)
    with rec.compute("forward", mb=0):
        pass
    from myria.observe import comm

    with rec.paused():
        with rec.paused():
            with rec.compute("forward", mb=1):
                pass
        with rec.compute("forward", mb=2):
            pass
        # an asynchronous collective issued while paused (FSDP's all-gather in an evaluation)
        op = comm.Op("all_gather_into_tensor", "collective", (0, 1), 1024, async_op=True)
        op.t1 = op.t0
        rec.started(op)
        rec.ended(op)
    with rec.compute("backward", mb=0):
        pass
    assert [(e["n"], e.get("m")) for e in rec._events] == [("forward", 0), ("backward", 0)]


def test_a_finished_step_reaches_the_file_without_waiting_for_the_flush_interval(tmp_path):
    """A rank killed mid-step (a supervisor's restart kills the whole group at once) leaves in
    its event file every step it finished: the writer flushes at each step's end, not only
    every `flush_s` seconds."""
    import json
    import time

    from myria import rundir
    from myria.observe.events import Recorder

    rec = Recorder(tmp_path, 0, 1, flush_s=60)
    rec.start({"attempt": 0})
    try:
        rec.step = 1
        with rec.compute("forward", mb=0):
            pass
        ev = rec.begin("step", "step")
        rec.end(ev)
        path = rundir.events_file(tmp_path, 0)
        deadline = time.time() + 10
        while time.time() < deadline and '"c":"step"' not in path.read_text():
            time.sleep(0.01)
        lines = [json.loads(x) for x in path.read_text().splitlines()[1:]]
        assert [(e["n"], e["s"]) for e in lines] == [("forward", 1), ("step", 1)]
        with rec.compute("forward", mb=0):   # no step ended: it waits for the interval
            pass
        time.sleep(0.3)
        assert len(path.read_text().splitlines()) == 3
    finally:
        rec.close()
    assert len(path.read_text().splitlines()) == 4
