"""`myria report` on a run without events, its learning-rate curve, and its prediction: priced
from this CPU's measured figures (the eager per-operator profile), not from the matmul peak."""

from __future__ import annotations

import json

import pytest

from myria import config as mconfig
from myria import device
from myria.observe import report
from myria.observe import report_sections as sections
from tests.conftest import TINY, run_cli

STEPS = 4


@pytest.fixture(scope="module")
def quiet_run(tmp_path_factory, tiny_data):
    """A tiny 1-process run trained with the event timer off (observe.enabled = false)."""
    run = tmp_path_factory.mktemp("no_events") / "run"
    run_cli("train", "--run-dir", str(run), f"--data.path={tiny_data}", *TINY, "--nproc", "1",
            f"--training.steps={STEPS}", "--checkpoint.interval=0", "--observe.enabled=false")
    assert not (run / "events").exists()
    return run


@pytest.mark.slow   # one tiny training run (a launcher and a worker), shared
def test_report_of_a_run_without_events_says_so_in_one_line(quiet_run):
    p = run_cli("report", str(quiet_run), "--no-prediction")
    lines = p.stdout.splitlines()
    assert "observe.enabled = false" in lines[0] and "no events" in lines[0]
    assert not any("missing:" in x for x in lines), p.stdout
    page = (quiet_run / "report" / "index.html").read_text()
    assert "id=no-events" in page and "observe.enabled = false" in page
    # not "Missing: none"
    assert "<li>none</li>" not in page.split("<h2>Missing event data</h2>")[1]
    assert "id=\"blame\"" not in page                                    # no empty table
    assert "trace.json" not in page and "trace.json" not in p.stdout     # no empty timeline
    # the curves beside the loss: the learning rate metrics.jsonl records at every step
    rows = [json.loads(x) for x in (quiet_run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r.get("lr")] == list(range(1, STEPS + 1))
    assert report.CURVES[:2] == ("loss", "lr") and "Loss, learning rate" in page
    assert (quiet_run / "report" / "curves.png").stat().st_size > 10_000


@pytest.mark.slow
def test_prediction_uses_the_measured_profile_of_the_runs_layout(quiet_run, tmp_path,
                                                                  monkeypatch):
    from myria.sim.measure import cpu
    from myria.sim.perf import simulate_config
    from tests.sim.test_cpu import synthetic_profile

    # a pinned core peak (no measurement) and a profile the test controls
    monkeypatch.setenv("MYRIA_CACHE", str(tmp_path))
    core = {"value": 0.05, "quantile": 0.9, "calls": 100, "n": 512,
            "q10_q50_q90": [0.05] * 3, "measured_at": "2026-01-01T00:00:00", "loadavg": 0.0}
    (tmp_path / "machine_figures.json").write_text(json.dumps(
        {device.cpu_key(1): {device.CORE_PEAK: core}}))
    cfg = mconfig.from_dict(json.loads((quiet_run / "config.json").read_text()))
    threads = cfg.training.threads or cpu.default_threads(1)   # the run's own thread count
    prof = synthetic_profile(threads=threads, gflops=20.0, nproc=1)
    asked = []

    def measured_profile(cfg, nproc, spec, gpus_per_node=0):
        asked.append((nproc, spec.peak_fp32_tflops))
        return prof
    monkeypatch.setattr(cpu, "measured_profile", measured_profile)
    monkeypatch.setattr(cpu, "load_profile", lambda *a, **k: prof)
    monkeypatch.setattr(cpu, "missing_ops", lambda *a, **k: [])
    out = report.write_report(quiet_run, predict=True)
    pred = json.loads((out / "prediction.json").read_text())
    assert asked and asked[0][0] == 1                     # one process: from its stats files
    spec = device.cpu_device_spec()
    want = simulate_config(cfg, 1, spec, cpu_profile=prof).iteration_time_s
    peak_only = simulate_config(cfg, 1, spec).iteration_time_s   # no cached profile here
    assert pred["iteration_time_s"] == pytest.approx(want) and want != pytest.approx(peak_only)
    assert pred["threads"] == threads and pred["figures"] == prof.source
    assert pred["measured_from"] == "metrics.jsonl" and pred["measured_step_s"] > 0
    assert "predicted step" in (out / "index.html").read_text()


def test_a_prediction_from_figures_of_a_busy_host_says_so():
    from myria.sim.cpu_profile import CpuProfile

    wall = CpuProfile(threads=2, nproc=1, clock="wall", loadavg=9.0)
    assert "load average 9.0" in sections.busy_figures(wall)
    assert sections.busy_figures(CpuProfile(threads=2, nproc=1, clock="wall", loadavg=2.3)) == ""
    cpu_time = CpuProfile(threads=1, nproc=2, clock="thread CPU time", loadavg=9.0)
    assert sections.busy_figures(cpu_time) == ""     # timed on CPU time: a quiet host's figure
    line = sections.prediction_line({"iteration_time_s": 2.0, "mfu": 0.5, "device": "cpu",
                                     "processes": 1, "threads": 2, "measured_step_s": 4.0,
                                     "measured_mfu": 0.25, "caveat": "busy"})
    assert line.endswith("measured median step 4000 ms, MFU 25.0%: prediction -50% [busy]")


def test_the_report_line_names_every_detection_of_the_run(tmp_path):
    """A step skipped for a non-finite loss and a straggler warning are in the run's
    detections; `myria report` says them (the summary's faults hold only restarts)."""
    from myria import detections
    from myria.observe.report import detections_line

    assert detections_line(tmp_path) == ""
    detections.record(tmp_path, "nonfinite", 0, "h", 8, {}, "skip")
    detections.record(tmp_path, "straggler", 1, "h", 11, {}, "warn")
    detections.record(tmp_path, "straggler", 1, "h", 5, {}, "warn")
    detections.record(tmp_path, "health", 1, "h", 5, {}, "passed with warnings, no action")
    assert detections_line(tmp_path) == (
        "detected: non-finite loss or gradient at step 8 (skip); straggler at steps 5, 11 "
        "(warn); host self-check finding at step 5 (passed with warnings, no action)")


def test_prediction_and_measurement_side_by_side_in_the_measured_categories():
    """The page compares like with like: the prediction's parts summed into the categories a
    rank's events tell apart (the data-parallel mesh dims are the prediction's DP)."""
    import pytest

    from myria.observe.report import side_by_side

    got = side_by_side({"compute_gemm": 0.010, "compute_attention": 0.002,
                        "dp_comm_exposed": 0.003, "pp_bubble": 0.001, "tp_comm_exposed": 0.0},
                       {"compute": 0.020, "exposed comm (dp_shard)": 0.004, "checkpoint": 0.001})
    assert list(got) == ["compute", "exposed comm (dp)", "idle / bubble", "checkpoint"]
    assert got["compute"] == (pytest.approx(0.012), 0.020)
    assert got["exposed comm (dp)"] == (0.003, 0.004)
    assert got["idle / bubble"] == (0.001, None) and got["checkpoint"] == (None, 0.001)


def test_the_loss_curve_has_each_sources_training_loss_without_skipped_steps():
    """A mixture's `loss_by_source` becomes one curve per source under the loss; a skipped
    step's non-finite loss (null or "inf" in metrics.jsonl) is no point of it."""
    from myria.observe.report import source_losses

    rows = [{"step": 1, "loss": 5.0, "loss_by_source": {"web": 5.5, "code": 4.5}},
            {"step": 2, "loss": None, "loss_by_source": {"web": None, "code": "inf"}},
            {"step": 3, "loss": 4.0, "loss_by_source": {"code": 3.5, "web": 4.25}},
            {"step": 4, "loss": 3.9}]
    assert source_losses(rows) == {"web": [(1, 5.5), (3, 4.25)], "code": [(1, 4.5), (3, 3.5)]}
    assert source_losses([{"step": 1, "loss": 5.0}]) == {}


def test_unreadable_metrics_lines_are_named_and_invent_no_restart(tmp_path):
    """A garbled line and a row whose step is not a number: left out of the figures and named
    in one note, never a traceback; the row lost from a process's ledger leaves its time to
    `other` in the same span, not a second start of `myria train`."""
    from myria.observe import goodput
    from myria.observe.report import unfinished_line, unreadable_line
    from myria.observe.report_sections import metrics_rows

    rows = []
    for s in range(4):
        gp = {"startup": 1.0, "productive": 1.0} if s == 0 else {"productive": 2.0}
        rows.append(json.dumps({"step": s + 1, "loss": 1.0, "goodput_since": 100.0 + 2 * s,
                                "time": 102.0 + 2 * s, "goodput": gp, "attempt": 0}))
    rows[2] = '{"step": 3, "loss": 8.12, garbage'
    rows.insert(1, '{"step": "3", "loss": 8.1}')
    (tmp_path / "metrics.jsonl").write_text("\n".join(rows) + "\n")
    (tmp_path / "config.json").write_text(json.dumps({"training": {"steps": 4}}))
    assert unreadable_line(tmp_path) == (
        "note: 2 unreadable line(s) of metrics.jsonl left out of the figures (line 2, 4; a "
        "line cut by a crash is the usual cause)")
    assert [r["step"] for r in metrics_rows(tmp_path)] == [1, 2, 4]
    assert unfinished_line(tmp_path) is None
    assert goodput.process_spans(goodput.ledger_rows(tmp_path, 0.0)) == [(100.0, 108.0)]
    led, _ = sections.goodput_ledger(tmp_path, summaries=[])
    assert led["jobs"] == 1 and led["wall_s"] == 8.0 and led["seconds"]["other"] == 2.0, led


def test_the_measured_mfu_is_that_of_the_measured_median_step():
    """The prediction line's measured MFU belongs to the measured step beside it (events'
    median, here 2.0 s), not to another set of rows (metrics.jsonl's fourth on)."""
    from myria.observe.report_sections import measured_step

    table = {0: {1: {"step_s": 9.0}, 2: {"step_s": 2.0}, 3: {"step_s": 2.0}, 4: {"step_s": 3.0}}}
    metrics = [{"step": s, "mfu": 0.5 / t, "step_time_s": t}
               for s, t in ((1, 9.0), (2, 2.0), (3, 2.0), (4, 3.0), (5, 1.0))]
    got = measured_step(table, metrics)
    assert got["measured_step_s"] == 2.0 and got["measured_mfu"] == pytest.approx(0.25)
    assert measured_step({}, metrics)["measured_step_s"] == 2.0   # metrics' rows 4-5: 3.0, 1.0
