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
