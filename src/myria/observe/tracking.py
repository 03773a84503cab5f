"""Experiment trackers: a run's metrics, config and report figures in Weights & Biases and MLflow.

`[logging] trackers = "wandb,mlflow"` (either or both). Rank 0's metrics sink (`train.metrics`)
hands every training row and validation loss to `Tracker.log` / `Tracker.log_eval`;
`myria report` adds its figures (`log_report`). One run directory is one tracker run: the run
ids are kept in RUN_DIR/tracking.json, chosen before the first contact, so a restart, a resume
and every attempt continue the same runs; tracking.json also holds the last step sent, so each
step goes to the trackers once. W&B runs offline unless asked (`logging.wandb_mode`; auto:
online when WANDB_API_KEY is set), its files under RUN_DIR/wandb; MLflow writes to
RUN_DIR/mlruns unless `logging.mlflow_uri` names a server or database. A tracker that fails
warns once and is dropped: the run never stops for its tracker. The trackers run in a process
and session of their own (`start` returns a `Client` that writes JSON lines to its stdin),
which holds RUN_DIR/tracking.lock while it lives. Why: docs/observability.md, "Experiment
trackers (`myria.observe.tracking`)" at its end.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
import uuid
from pathlib import Path
from typing import Any

from myria.fsutil import atomic_write

log = logging.getLogger("myria")
STATE = "tracking.json"   # under RUN_DIR
TRACKERS = ("wandb", "mlflow")


def names(spec: str) -> list[str]:
    """The trackers of `logging.trackers` ("wandb,mlflow"), in order, without blanks."""
    return [n.strip().lower() for n in spec.split(",") if n.strip()]


def _flat(d: dict, prefix: str = "") -> dict[str, Any]:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _numbers(row: dict, prefix: str = "") -> dict[str, float]:
    """The finite numbers of a metrics row (nested tables flattened), `step` and `time` left."""
    return {f"{prefix}{k}": float(v) for k, v in _flat(row).items()
            if k not in ("step", "time") and isinstance(v, (int, float))
            and not isinstance(v, bool) and math.isfinite(v)}


class Tracker:
    """Rank 0's connection to the trackers of one run directory."""

    def __init__(self, run_dir: Path, logging_cfg, config: dict):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / STATE
        self.state = self._read()
        self.cfg = logging_cfg
        self.name = logging_cfg.run_name or self.run_dir.resolve().name
        self.backends: dict[str, Any] = {}
        for n in names(logging_cfg.trackers):
            try:
                self.backends[n] = getattr(self, f"_open_{n}")(config)
            except Exception as e:  # an unreachable server, a broken install: warn, go on
                log.warning("tracker %s not started: %s", n, e)
        self._save()

    # -- state ------------------------------------------------------------------------------
    def _read(self) -> dict:
        try:
            return json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}

    def _save(self) -> None:
        try:
            atomic_write(self.path, json.dumps(self.state, indent=1))
        except OSError as e:
            log.warning("%s not written: %s", self.path, e)

    # -- backends ---------------------------------------------------------------------------
    def _open_wandb(self, config: dict):
        os.environ.setdefault("WANDB_SILENT", "true")
        import wandb

        mode = self.cfg.wandb_mode
        if mode == "auto":
            mode = "online" if os.environ.get("WANDB_API_KEY") else "offline"
        if "wandb_id" not in self.state:  # chosen and kept before the first contact
            self.state["wandb_id"] = uuid.uuid4().hex[:12]
            self._save()
        return wandb.init(project=self.cfg.project, name=self.name, id=self.state["wandb_id"],
                          resume="allow", dir=str(self.run_dir), mode=mode, config=config,
                          settings=wandb.Settings(console="off", x_disable_stats=True))

    def _open_mlflow(self, config: dict):
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # the local default store
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        uri = self.cfg.mlflow_uri or (self.run_dir / "mlruns").resolve().as_uri()
        client = MlflowClient(uri)
        if "mlflow_id" not in self.state:
            exp = client.get_experiment_by_name(self.cfg.project)
            exp_id = exp.experiment_id if exp else client.create_experiment(self.cfg.project)
            self.state["mlflow_id"] = client.create_run(exp_id, run_name=self.name).info.run_id
            self._save()
            params = [Param(k, str(v)[:6000]) for k, v in _flat(config).items()]
            for i in range(0, len(params), 100):  # MLflow takes at most 100 params per batch
                client.log_batch(self.state["mlflow_id"], params=params[i:i + 100])
        else:
            client.update_run(self.state["mlflow_id"], status="RUNNING")
        return client

    def _send(self, step: int, values: dict[str, float]) -> None:
        for n, b in list(self.backends.items()):
            try:
                if n == "wandb":
                    b.log(values, step=step)
                else:
                    from mlflow.entities import Metric

                    ms = int(time.time() * 1000)
                    b.log_batch(self.state["mlflow_id"],
                                metrics=[Metric(k, v, ms, step) for k, v in values.items()])
            except Exception as e:
                log.warning("tracker %s dropped after an error: %s", n, e)
                self.backends.pop(n)

    # -- what the metrics sink calls --------------------------------------------------------
    def log(self, row: dict) -> None:
        """A training row of metrics.jsonl, unless its step was sent before."""
        step = int(row["step"])
        if step <= self.state.get("sent_step", 0):
            return
        self._send(step, _numbers(row, "train/"))
        self.state["sent_step"] = step
        self._save()

    def log_eval(self, step: int, val_loss: float, by_source: dict | None = None) -> None:
        """A validation loss (and each source's, for a mixture), unless sent before."""
        if step <= self.state.get("sent_eval_step", 0):
            return
        values = {"val/loss": float(val_loss),
                  **{f"val/loss/{k}": float(v) for k, v in (by_source or {}).items()}}
        self._send(step, values)
        self.state["sent_eval_step"] = step
        self._save()

    def close(self, finished: bool = False) -> None:
        """Flush and detach; `finished`: the run reached its last step."""
        if finished:
            self.state["finished"] = True
            self._save()
        for n, b in self.backends.items():
            try:
                if n == "wandb":
                    b.finish(exit_code=0 if finished else 1)
                elif finished:
                    b.set_terminated(self.state["mlflow_id"], "FINISHED")
            except Exception as e:
                log.warning("tracker %s did not close cleanly: %s", n, e)
        self.backends = {}


LOCK = "tracking.lock"     # under RUN_DIR, held by the live tracker process


class Client:
    """The trainer's side: the same calls as `Tracker`, sent to the tracker process."""

    def __init__(self, run_dir: Path, config: dict):
        import subprocess
        import sys

        self.proc = subprocess.Popen([sys.executable, "-m", "myria.observe.tracking",
                                      str(run_dir)], stdin=subprocess.PIPE,
                                     start_new_session=True)
        self._send({"op": "open", "config": config})

    def _send(self, msg: dict) -> None:
        if self.proc is None:
            return
        try:
            self.proc.stdin.write((json.dumps(msg) + "\n").encode())
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError) as e:
            log.warning("tracker process gone (%s): metrics go to metrics.jsonl only", e)
            self.proc = None

    def log(self, row: dict) -> None:
        self._send({"op": "log", "row": row})

    def log_eval(self, step: int, val_loss: float, by_source: dict | None = None) -> None:
        self._send({"op": "eval", "step": step, "val_loss": val_loss, "by_source": by_source})

    def close(self, finished: bool = False) -> None:
        """Tell the tracker process to close the runs and let it finish on its own."""
        self._send({"op": "close", "finished": finished})
        if self.proc is not None:
            self.proc.stdin.close()
            self.proc = None


def start(logging_cfg, run_dir: Path, config: dict, is_main: bool) -> Client | None:
    """The run's tracker process on rank 0 when `logging.trackers` names any, else None."""
    if not is_main or not names(logging_cfg.trackers):
        return None
    return Client(Path(run_dir), config)


def _locked(run_dir: Path):
    """RUN_DIR/tracking.lock, held (blocking until a previous tracker process is done)."""
    import fcntl

    fh = open(run_dir / LOCK, "a")
    fcntl.flock(fh, fcntl.LOCK_EX)
    return fh


def serve(run_dir: Path, lines) -> None:
    """The tracker process: messages from the trainer (JSON lines) until the end of input."""
    from types import SimpleNamespace

    lock = _locked(run_dir)
    tracker, finished = None, False
    try:
        for line in lines:
            try:
                msg = json.loads(line)
            except ValueError:  # a line cut by the trainer's death
                continue
            if msg["op"] == "open":
                cfg = msg["config"]
                tracker = Tracker(run_dir, SimpleNamespace(**cfg["logging"]), cfg)
            elif tracker is None:
                continue
            elif msg["op"] == "log":
                tracker.log(msg["row"])
            elif msg["op"] == "eval":
                tracker.log_eval(msg["step"], msg["val_loss"], msg["by_source"])
            elif msg["op"] == "close":
                finished = msg["finished"]
    finally:
        if tracker is not None:
            tracker.close(finished)
        lock.close()


def log_report(run_dir: Path, figures: list[Path]) -> list[str]:
    """Add `myria report`'s figures (PNG files) and its page to the run's trackers (those its
    config.json names); the trackers that took them."""
    from types import SimpleNamespace

    from myria import config as config_mod
    from myria import rundir

    try:
        cfg = json.loads((run_dir / rundir.CONFIG).read_text())
    except (OSError, ValueError):
        return []
    logging_cfg = SimpleNamespace(**{**config_mod.LoggingConfig().__dict__,
                                     **cfg.get("logging", {})})
    if not names(logging_cfg.trackers):
        return []
    done = []
    lock = _locked(run_dir)
    t = Tracker(run_dir, logging_cfg, cfg)
    step = t.state.get("sent_step", 0)
    for n, b in t.backends.items():
        try:
            if n == "wandb":
                import wandb

                b.log({f"report/{f.stem}": wandb.Image(str(f)) for f in figures}, step=step)
            else:
                for f in figures:
                    b.log_artifact(t.state["mlflow_id"], str(f), "report")
            done.append(n)
        except Exception as e:
            log.warning("report figures not sent to %s: %s", n, e)
    t.close(finished=t.state.get("finished", False))
    lock.close()
    return done


if __name__ == "__main__":
    import signal
    import sys

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the end of input ends it, after a flush
    serve(Path(sys.argv[1]), sys.stdin)
