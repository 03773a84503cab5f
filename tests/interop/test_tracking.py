"""[logging] trackers: a supervised run killed once is one W&B run (offline) and one MLflow run
(local store), each step logged once, read back through MLflow's client and W&B's offline
files; `myria report` adds its figures to both."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from tests.conftest import TINY, run_cli

STEPS = 10


def wandb_records(path: Path):
    """The protobuf records of a W&B offline run file (run-ID.wandb: a 7-byte header, then
    LevelDB-log framing: 32 KiB blocks of chunks, each crc32, length, type FULL/FIRST/MIDDLE/
    LAST), read without a network or the W&B service."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, block, pos, buf = path.read_bytes(), 32768, 7, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _, n, kind = struct.unpack("<IHB", data[pos:pos + 7])
        buf += data[pos + 7:pos + 7 + n]
        pos += 7 + n
        if kind in (1, 4):
            rec = pb.Record()
            rec.ParseFromString(buf)
            buf = b""
            yield rec


@pytest.mark.slow
def test_supervised_run_with_a_kill_is_one_tracker_run(tmp_path, tiny_data, monkeypatch):
    pytest.importorskip("wandb")
    pytest.importorskip("mlflow")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # reading the local store back
    run = tmp_path / "run"
    run_cli("supervise", "--run-dir", str(run), "--nproc", "2", f"--data.path={tiny_data}",
            *TINY, f"--training.steps={STEPS}", "--checkpoint.interval=3",
            "--logging.trackers=wandb,mlflow", "--logging.project=interop",
            "--resilience.heartbeat_s=0.5", "--resilience.backoff_s=0.2",
            "--resilience.diagnose=false", env={"MYRIA_FAULT": "kill:rank=0:step=8"},
            timeout=400)
    summary = json.loads((run / "supervisor_summary.json").read_text())
    assert summary["status"] == "succeeded" and summary["restarts"] == 1, summary
    p = run_cli("report", str(run))
    assert "figures sent to the run's wandb and mlflow run" in p.stdout
    check_one_run_each(run)


def check_one_run_each(run: Path) -> None:
    state = json.loads((run / "tracking.json").read_text())
    from mlflow.tracking import MlflowClient

    client = MlflowClient((run / "mlruns").resolve().as_uri())
    exp = client.get_experiment_by_name("interop")
    runs = client.search_runs([exp.experiment_id])
    assert [r.info.run_id for r in runs] == [state["mlflow_id"]]
    assert runs[0].info.status == "FINISHED" and runs[0].data.params["training.steps"] == "10"
    steps = [m.step for m in client.get_metric_history(state["mlflow_id"], "train/loss")]
    assert sorted(steps) == list(range(1, STEPS + 1))
    rows = {json.loads(x)["step"]: json.loads(x) for x in
            (run / "metrics.jsonl").read_text().splitlines() if '"loss"' in x}
    got = {m.step: m.value for m in client.get_metric_history(state["mlflow_id"], "train/loss")}
    assert got == {s: r["loss"] for s, r in rows.items()}
    assert {a.path for a in client.list_artifacts(state["mlflow_id"], "report")} >= \
        {"report/curves.png"}

    files = sorted((run / "wandb").glob("offline-run-*/run-*.wandb"))
    assert {f.parent.name.rsplit("-", 1)[1] for f in files} == {state["wandb_id"]}
    assert len(files) >= 3  # the first attempt, the restart, the report
    logged, images = [], set()
    for f in files:
        for rec in wandb_records(f):
            if rec.WhichOneof("record_type") == "history":
                items = {i.key or "/".join(i.nested_key): json.loads(i.value_json)
                         for i in rec.history.item}
                if "train/loss" in items:
                    logged.append(items["_step"])
                    assert items["train/loss"] == rows[items["_step"]]["loss"]
                images |= {i.key or i.nested_key[0] for i in rec.history.item
                           if (i.key or i.nested_key[0]).startswith("report/")}
    assert sorted(logged) == list(range(1, STEPS + 1))
    assert "report/curves" in images


# -- in-process: each tracker's own position, catching up, a tracker that does not start ------

class _Backend:
    """A tracker run recording what it was sent, a (step, sorted keys) per row: W&B's `log`
    and MLflow's `log_batch` (its metrics split into rows by step and kind, its calls counted);
    `fail_at`: the step it raises at (ConnectionError, or `fail_with`)."""

    def __init__(self, got: list, fail_at: int | None = None, fail_with=None):
        self.got, self.fail_at, self.fail_with = got, fail_at, fail_with
        self.batches, self.artifacts = 0, []

    def log(self, values, step):
        if step == self.fail_at:
            raise self.fail_with or ConnectionError("[Errno 104] Connection reset by peer")
        self.got.append((step, sorted(values)))

    def log_batch(self, run_id, metrics):
        self.batches += 1
        rows: dict = {}
        for m in metrics:
            rows.setdefault((m.step, m.key.split("/")[0]), {})[m.key] = m.value
        if any(step == self.fail_at for step, _ in rows):
            raise self.fail_with or ConnectionError("[Errno 104] Connection reset by peer")
        for (step, _), values in rows.items():
            self.log(values, step)

    def log_artifact(self, run_id, path, where):
        import os

        self.artifacts.append((path, os.environ.get("MLFLOW_HTTP_REQUEST_TIMEOUT")))

    def finish(self, exit_code):
        pass

    def set_terminated(self, run_id, status):
        pass


@pytest.fixture(autouse=True)
def _mlflow_env(monkeypatch):
    """The MLflow settings a Tracker sets in this process, restored after each test."""
    from myria.observe import tracking

    for k in [*tracking.MLFLOW_HTTP, "MLFLOW_ALLOW_FILE_STORE"]:
        monkeypatch.setenv(k, "")
        monkeypatch.delenv(k)


def _backends(monkeypatch, wandb=None, mlflow=None):
    """Tracker's W&B and MLflow runs replaced by `wandb` and `mlflow` (a _Backend, or an
    exception raised when it opens)."""
    from myria.observe import tracking

    def opener(backend, key):
        def open_(self, config):
            if isinstance(backend, Exception):
                raise backend
            self.state.setdefault(key, "id")
            return backend
        return open_

    monkeypatch.setattr(tracking.Tracker, "_open_wandb", opener(wandb, "wandb_id"))
    monkeypatch.setattr(tracking.Tracker, "_open_mlflow", opener(mlflow, "mlflow_id"))


def _cfg(trackers="wandb,mlflow"):
    from types import SimpleNamespace

    return SimpleNamespace(trackers=trackers, run_name="", project="p", wandb_mode="offline",
                           mlflow_uri="")


def _row(s: int) -> dict:
    return {"step": s, "loss": 7.0 - s, "lr": 1e-3, "grad_norm": 1.0, "time": 0.0}


def _attempt(run: Path, monkeypatch, steps, *, wandb=None, mlflow=None, eval_at=()):
    """One attempt of the trainer: each step's row (and eval row) appended to metrics.jsonl,
    then handed to a Tracker of `wandb` and `mlflow` (a _Backend, or an exception raised when
    it opens)."""
    from myria.observe import tracking

    _backends(monkeypatch, wandb, mlflow)
    cfg = _cfg()
    t = tracking.Tracker(run, cfg, {})
    for s in steps:
        row = {"step": s, "loss": 7.0 - s, "time": 0.0}
        with open(run / "metrics.jsonl", "a") as fh:
            fh.write(json.dumps(row) + "\n" +
                     (json.dumps({"step": s, "val_loss": 8.0 - s}) + "\n" if s in eval_at
                      else ""))
        t.log(row)
        if s in eval_at:
            t.log_eval(s, 8.0 - s)
    t.close(finished=True)
    return json.loads((run / "tracking.json").read_text())


def test_a_tracker_that_did_not_start_or_failed_gets_its_missed_steps_on_resume(
        tmp_path, monkeypatch, caplog):
    """A tracker's position moves only past what it accepted: one whose package is missing
    (said in one line, with the install command) or that failed mid-run gets the steps it
    missed from metrics.jsonl when a resume starts it; the others get no step twice."""
    pytest.importorskip("mlflow")
    run = tmp_path / "run"
    run.mkdir()
    w, m = [], []
    missing = ModuleNotFoundError("No module named 'mlflow'", name="mlflow")
    state = _attempt(run, monkeypatch, [1, 2], wandb=_Backend(w), mlflow=missing, eval_at=[2])
    said = [r.getMessage() for r in caplog.records if "not started" in r.getMessage()]
    assert len(said) == 1 and "\n" not in said[0], said
    assert "mlflow (No module named 'mlflow'; pip install mlflow-skinny (or " \
        "'myria[tracking]'))" in said[0], said
    assert "sent the next time the trackers start (a resume, or myria report" in said[0]
    assert state["sent"] == {"wandb": 2} and state["sent_eval"] == {"wandb": 2}, state
    # resumed: MLflow now starts and gets steps 1-2 first; W&B fails at step 4
    state = _attempt(run, monkeypatch, [3, 4], wandb=_Backend(w, fail_at=4),
                     mlflow=_Backend(m), eval_at=[4])
    assert state["sent"] == {"wandb": 3, "mlflow": 4} and state["sent_eval"] == \
        {"wandb": 2, "mlflow": 4}, state
    state = _attempt(run, monkeypatch, [5], wandb=_Backend(w), mlflow=_Backend(m))
    train = ["train/loss"]
    assert w == [(1, train), (2, train), (2, ["val/loss"]), (3, train), (4, train),
                 (4, ["val/loss"]), (5, train)], w
    assert m == [(1, train), (2, train), (2, ["val/loss"]), (3, train), (4, train),
                 (4, ["val/loss"]), (5, train)], m
    assert state["sent"] == {"wandb": 5, "mlflow": 5}


def test_a_tracking_json_of_one_position_is_the_position_of_the_trackers_it_names(
        tmp_path, monkeypatch):
    """The single-position form of tracking.json is the position of each tracker whose run id
    it holds; a tracker it does not name (added on this resume, or it never started) gets
    every step; the end-of-run summary reads it alike."""
    from myria.observe.tracking import summary_lines

    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps(_row(s)) + "\n" for s in (1, 2)))
    (run / "tracking.json").write_text(json.dumps({"sent_step": 2, "sent_eval_step": 0,
                                                   "wandb_id": "w"}))
    (wb,) = summary_lines(run, {})
    assert wb.endswith("(run w, to step 2)"), wb
    w, m = [], []
    state = _attempt(run, monkeypatch, [3], wandb=_Backend(w), mlflow=_Backend(m))
    assert [s for s, _ in w] == [3] and [s for s, _ in m] == [1, 2, 3], (w, m)
    assert state["sent"] == {"wandb": 3, "mlflow": 3} and "sent_step" not in state


def test_the_trainers_writes_never_wait_on_a_tracker_catching_up(tmp_path, monkeypatch):
    """While a tracker takes its time (a catch-up of thousands of rows, a slow server), or the
    previous attempt's tracker process still holds the lock, the tracker process drains its
    input: a trainer writing far more than a pipe holds is never blocked; the live rows follow
    the caught-up ones, in order, each once."""
    pytest.importorskip("mlflow")
    import os
    import threading

    from myria.observe import tracking

    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps(_row(s)) + "\n" for s in (1, 2)))
    release, got = threading.Event(), []

    class Slow(_Backend):
        def log_batch(self, run_id, metrics):
            release.wait(20)
            super().log_batch(run_id, metrics)

    _backends(monkeypatch, mlflow=Slow(got))
    previous = tracking._locked(run)   # the previous attempt's tracker process, still sending
    r, w = os.pipe()
    server = threading.Thread(target=tracking.serve,
                              args=(run, open(r, encoding="utf-8")), daemon=True)
    server.start()
    os.set_blocking(w, False)
    msgs = [{"op": "open", "config": {"logging": vars(_cfg("mlflow"))}}]
    msgs += [{"op": "log", "row": {**_row(s), "pad": "x" * 500}} for s in range(3, 503)]
    data = "".join(json.dumps(m) + "\n" for m in msgs).encode()
    assert len(data) > 4 * 65536
    try:
        view, deadline = memoryview(data), 10.0
        import time

        t0 = time.monotonic()
        while view:
            try:
                view = view[os.write(w, view):]
            except BlockingIOError:   # full: the reader has not caught up yet, or never will
                assert time.monotonic() - t0 < deadline, "the pipe is not drained"
                time.sleep(0.01)
    finally:
        previous.close()
        release.set()
        os.close(w)
    server.join(20)
    assert not server.is_alive()
    assert [s for s, _ in got] == list(range(1, 503))


def test_an_interrupted_catch_up_goes_on_where_it_stopped(tmp_path, monkeypatch):
    """A catch-up is sent in batches (MLflow: up to 1000 metrics a call), tracking.json
    written after each: the process killed mid-way, the next catch-up sends only the rest,
    no step twice."""
    pytest.importorskip("mlflow")
    from myria.observe import tracking

    run = tmp_path / "run"
    run.mkdir()
    n = 1000
    (run / "metrics.jsonl").write_text("".join(json.dumps(_row(s)) + "\n"
                                               for s in range(1, n + 1)))
    got = []
    killed = _Backend(got, fail_at=700, fail_with=KeyboardInterrupt())   # not an Exception
    _backends(monkeypatch, mlflow=killed)
    with pytest.raises(KeyboardInterrupt):
        tracking.Tracker(run, _cfg("mlflow"), {}).close()
    at = json.loads((run / "tracking.json").read_text())["sent"]["mlflow"]
    assert 0 < at < 700 and [s for s, _ in got] == list(range(1, at + 1)), at
    batches = killed.batches
    assert batches <= 700 * 3 // 1000 + 2, batches   # 3 metrics a row, 1000 a call
    rest = _Backend(got)
    _backends(monkeypatch, mlflow=rest)
    tracking.Tracker(run, _cfg("mlflow"), {}).close()
    assert [s for s, _ in got] == list(range(1, n + 1))


def test_no_tracker_behind_reads_only_the_tail_of_metrics(tmp_path, monkeypatch):
    """A start where every tracker has the file's steps reads metrics.jsonl from its end only
    up to the last step they have (the live row that started it comes next)."""
    pytest.importorskip("mlflow")
    from myria.observe import tracking

    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps(_row(s)) + "\n"
                                               for s in range(1, 5001)) + "not json\n")
    (run / "tracking.json").write_text(json.dumps({"mlflow_id": "m", "sent": {"mlflow": 4999},
                                                   "sent_eval": {}}))
    read = []
    lines_back = tracking._lines_back
    monkeypatch.setattr(tracking, "_lines_back", lambda p: (read.append(x) or x
                                                            for x in lines_back(p)))
    got = []
    _backends(monkeypatch, mlflow=_Backend(got))
    t = tracking.Tracker(run, _cfg("mlflow"), {})
    t.log(_row(5000))
    assert got == [(5000, ["train/grad_norm", "train/loss", "train/lr"])] and len(read) < 5


def test_the_report_catches_up_only_a_finished_run(tmp_path, monkeypatch):
    """`myria report` sends a behind tracker the steps it missed only when the run finished
    (an unfinished run's resume may set aside the rows past its checkpoint); its figure
    uploads get MLFLOW_ARTIFACT_TIMEOUT_S, not the few seconds of a metrics request."""
    pytest.importorskip("mlflow")
    from myria.observe import tracking

    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"logging": {"trackers": "mlflow"}}))
    (run / "metrics.jsonl").write_text("".join(json.dumps(_row(s)) + "\n" for s in (1, 2)))
    (run / "tracking.json").write_text(json.dumps({"mlflow_id": "m", "sent": {"mlflow": 1}}))
    fig = tmp_path / "curves.png"
    got = []
    _backends(monkeypatch, mlflow=(b := _Backend(got)))
    assert tracking.log_report(run, [fig]) == ["mlflow"]
    assert got == [] and b.artifacts == [(str(fig), tracking.MLFLOW_ARTIFACT_TIMEOUT_S)]
    assert json.loads((run / "tracking.json").read_text())["sent"] == {"mlflow": 1}
    state = json.loads((run / "tracking.json").read_text())
    (run / "tracking.json").write_text(json.dumps({**state, "finished": True}))
    assert tracking.log_report(run, [fig]) == ["mlflow"]
    assert [s for s, _ in got] == [2]


def test_a_missing_package_names_its_install_and_a_broken_one_does_not():
    from myria.observe.tracking import _why

    said = _why("mlflow", ModuleNotFoundError("No module named 'mlflow'", name="mlflow"))
    assert said.endswith("pip install mlflow-skinny (or 'myria[tracking]')"), said
    said = _why("mlflow", ModuleNotFoundError("No module named 'mlflow.entities'",
                                              name="mlflow.entities"))
    assert said == "No module named 'mlflow.entities'", said


def test_an_unreachable_mlflow_server_is_one_line_within_seconds(tmp_path, monkeypatch,
                                                                 caplog):
    """MLflow's default retries would keep the tracker process going for minutes after the
    run; the tracker gives a server that refuses a few seconds and says so in one line."""
    import time
    from types import SimpleNamespace

    pytest.importorskip("mlflow")
    import mlflow  # noqa: F401 - imported before the clock starts

    from myria.observe import tracking
    from myria.train.launch import free_port

    for k in tracking.MLFLOW_HTTP:   # the tracker's defaults, removed again after the test
        monkeypatch.setenv(k, "")
        monkeypatch.delenv(k)
    cfg = SimpleNamespace(trackers="mlflow", run_name="", project="p", wandb_mode="offline",
                          mlflow_uri=f"http://127.0.0.1:{free_port()}")
    t0 = time.monotonic()
    t = tracking.Tracker(tmp_path, cfg, {})
    assert time.monotonic() - t0 < 30 and t.backends == {}
    said = [r.getMessage() for r in caplog.records if "not started" in r.getMessage()]
    assert len(said) == 1 and "\n" not in said[0] and \
        "tracker not started: mlflow (Connection refused: " in said[0], said


def test_the_summary_names_where_each_tracker_holds_the_run(tmp_path):
    """The end-of-run summary lists each tracker that took the run (its store and run id and
    the last step it accepted); none when no tracker ran."""
    import json

    from myria.observe.tracking import STATE, summary_lines

    assert summary_lines(tmp_path, {}) == []
    (tmp_path / STATE).write_text(json.dumps({"wandb_id": "abc", "mlflow_id": "r1",
                                              "sent": {"wandb": 7}}))
    wb, mf = summary_lines(tmp_path, {"mlflow_uri": "http://mlflow:5000"})
    assert wb == f"wandb:       {tmp_path / 'wandb'} (run abc, to step 7)", wb
    assert mf == "mlflow:      http://mlflow:5000 (run r1, no step sent yet)", mf
    (mf,) = summary_lines(tmp_path, {})[1:]
    assert mf.startswith(f"mlflow:      file://{(tmp_path / 'mlruns').resolve()}"), mf
