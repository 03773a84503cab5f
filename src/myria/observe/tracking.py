"""Experiment trackers: a run's metrics, config and report figures in Weights & Biases and MLflow.

`[logging] trackers = "wandb,mlflow"` (either or both). Rank 0's metrics sink (`train.metrics`)
hands every training row and validation loss to `Tracker.log` / `Tracker.log_eval`;
`myria report` adds its figures (`log_report`). One run directory is one tracker run: the run
ids are kept in RUN_DIR/tracking.json, chosen before the first contact, so a restart, a resume
and every attempt continue the same runs; tracking.json also holds, per tracker, the last step
it accepted, so each step goes to each tracker once, and a tracker that could not start or
failed (a missing package, an unreachable server) gets the steps it missed from
RUN_DIR/metrics.jsonl the next time the trackers start (a resume, or `myria report` of a
finished run), as does a tracker added on a resume; tracking.json is written after each batch
of that catch-up, so an interrupted one resumes where it stopped.
W&B runs offline unless asked (`logging.wandb_mode`; auto: online when WANDB_API_KEY is set),
its files under RUN_DIR/wandb; MLflow writes to RUN_DIR/mlruns unless `logging.mlflow_uri`
names a server or database, which it gives a few seconds (`MLFLOW_HTTP` below) rather
than MLflow's minutes of retries. A tracker that does not start or fails says so in one line
and is dropped: the run never stops for its tracker. The trackers run in a process
and session of their own (`start` returns a `Client` that writes JSON lines to its stdin),
which holds RUN_DIR/tracking.lock while it lives and reads its stdin on a thread into an
unbounded queue, so the trainer's writes never wait on a tracker (a catch-up of thousands of
rows, a slow server). Why: docs/observability.md, "Experiment
trackers (`myria.observe.tracking`)" at its end.
"""

from __future__ import annotations

import json
import logging
import math
import os
import queue
import re
import threading
import time
import uuid
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from myria import rundir
from myria.errors import first_line
from myria.fsutil import atomic_write

log = logging.getLogger("myria")
STATE = "tracking.json"   # under RUN_DIR
TRACKERS = ("wandb", "mlflow")
# An MLflow server that does not answer: 2 retries of 5 s each (MLflow's default, 7 retries of
# 120 s with backoff, keeps the tracker process going for minutes after the run); the
# environment's own settings win. The 5 s are for opening the run and sending metrics (small
# requests); `myria report`'s figure uploads get MLFLOW_ARTIFACT_TIMEOUT_S instead.
MLFLOW_HTTP = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
               "MLFLOW_HTTP_REQUEST_TIMEOUT": "5"}
MLFLOW_ARTIFACT_TIMEOUT_S = "120"
# The package each tracker needs; `pip install 'myria[tracking]'` installs both.
PACKAGES = {"wandb": "wandb", "mlflow": "mlflow-skinny"}
BATCH = 1000   # metrics per catch-up batch: MLflow's log_batch takes at most 1000
LATER = "the next time the trackers start (a resume, or myria report of a finished run)"


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


def _why(name: str, e: Exception) -> str:
    """One line on why tracker `name` did not start, with the install command when its package
    is missing (a missing module inside an installed package is a broken install: no command)."""
    if isinstance(e, ModuleNotFoundError) and e.name == name:
        return f"{e}; pip install {PACKAGES[name]} (or 'myria[tracking]')"
    # a client's connection error ends, deep in a long line, with the system's reason
    errno = re.findall(r"\[Errno -?\d+\] ([^'\")\]]+)", str(e))
    return f"{errno[-1]}: {first_line(e, 100)}" if errno else first_line(e)


def _eval_values(val_loss: float, by_source: dict | None) -> dict[str, float]:
    return {"val/loss": float(val_loss),
            **{f"val/loss/{k}": float(v) for k, v in (by_source or {}).items()}}


def mlflow_uri(configured: str, run_dir: str | Path) -> str:
    """Where a run's MLflow records go: `logging.mlflow_uri`, else a file store in the run."""
    return configured or (Path(run_dir) / "mlruns").resolve().as_uri()


def read_state(path: Path) -> dict:
    """A tracking.json: the run ids (`wandb_id`, `mlflow_id`) and each tracker's positions
    (`sent`, `sent_eval`: tracker -> the last step it accepted); empty positions when the file
    is missing or unreadable. The single-position form (`sent_step`, `sent_eval_step`) is the
    position of each tracker whose run id the file holds: one without a run id never started,
    so it has accepted no step."""
    try:
        state = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        state = {}
    if not isinstance(state, dict):
        state = {}
    for key, single in (("sent", "sent_step"), ("sent_eval", "sent_eval_step")):
        if single in state:
            at = state.pop(single)
            state.setdefault(key, {n: at for n in TRACKERS if f"{n}_id" in state})
        if not isinstance(state.get(key), dict):
            state[key] = {}
    return state


def summary_lines(run_dir: str | Path, logging_cfg: dict) -> list[str]:
    """Where each tracker that took the run's steps holds them (for the end-of-run summary):
    the W&B files and run id, the MLflow store and run id, with the last step each accepted."""
    run_dir = Path(run_dir)
    state = read_state(run_dir / STATE)
    sent = state["sent"]
    out = []
    for name, key, where in (
            ("wandb", "wandb_id", str(run_dir / "wandb")),
            ("mlflow", "mlflow_id", mlflow_uri(str(logging_cfg.get("mlflow_uri") or ""),
                                               run_dir))):
        if state.get(key):
            at = sent.get(name)
            out.append(f"{name + ':':<13}{where} (run {state[key]}"
                       + (f", to step {at})" if at else ", no step sent yet)"))
    return out


def _lines_back(path: Path, chunk: int = 1 << 16) -> Iterator[bytes]:
    """The lines of a file, last first, read a chunk at a time from its end."""
    try:
        fh = open(path, "rb")
    except OSError:
        return
    with fh:
        end = fh.seek(0, os.SEEK_END)
        tail = b""
        while end > 0:
            start = max(0, end - chunk)
            fh.seek(start)
            lines = (fh.read(end - start) + tail).split(b"\n")
            end, tail = start, lines.pop(0)
            yield from reversed(lines)
        yield tail


def _row(line: str | bytes) -> dict | None:
    """A row of metrics.jsonl with a whole-number step, else None (a cut or foreign line)."""
    try:
        row = json.loads(line)
    except ValueError:
        return None
    ok = isinstance(row, dict) and type(row.get("step")) is int
    return row if ok else None


def _entry(row: dict) -> tuple[str, int, dict[str, float]] | None:
    """What a row of metrics.jsonl sends: (position kind, step, values), or None."""
    if "loss" in row:
        return "sent", row["step"], _numbers(row, "train/")
    if isinstance(row.get("val_loss"), (int, float)):
        return "sent_eval", row["step"], _eval_values(row["val_loss"],
                                                      row.get("val_loss_by_source"))
    return None


def _order(kind: str, step: int) -> tuple[int, bool]:
    """Where a row stands in metrics.jsonl: by step, a step's validation after its training."""
    return step, kind == "sent_eval"


class Tracker:
    """Rank 0's connection to the trackers of one run directory."""

    def __init__(self, run_dir: Path, logging_cfg, config: dict):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / STATE
        self.cfg = logging_cfg
        self.state = read_state(self.path)
        self.name = logging_cfg.run_name or self.run_dir.resolve().name
        self.backends: dict[str, Any] = {}
        self._caught_up = False
        # whether MLFLOW_HTTP_REQUEST_TIMEOUT is this process's (MLFLOW_HTTP) or the user's
        self.mlflow_timeout_ours = False
        if "mlflow" in names(logging_cfg.trackers):
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # the local default store
            self.mlflow_timeout_ours = "MLFLOW_HTTP_REQUEST_TIMEOUT" not in os.environ
            for k, v in MLFLOW_HTTP.items():
                os.environ.setdefault(k, v)
        failed = []
        for n in names(logging_cfg.trackers):
            try:
                self.backends[n] = getattr(self, f"_open_{n}")(config)
            except Exception as e:  # an unreachable server, a broken install: warn, go on
                failed.append(f"{n} ({_why(n, e)})")
        if failed:   # one line, while the run goes on
            log.warning("myria: tracker%s not started: %s; the run's steps stay in %s, sent "
                        "%s", "" if len(failed) == 1 else "s", ", ".join(failed),
                        rundir.METRICS, LATER)
        self._save()

    # -- state ------------------------------------------------------------------------------
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
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        uri = mlflow_uri(self.cfg.mlflow_uri, self.run_dir)
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

    def _send(self, entries: list[tuple[str, int, dict[str, float]]]) -> None:
        """Entries (kind, step, values), in the order of metrics.jsonl, to each open tracker
        that has not accepted them ("sent": training rows, "sent_eval": validation losses): to
        W&B a row at a time, to MLflow in one `log_batch`. A tracker's position moves only past
        what it accepted; one that fails is dropped for this process."""
        for n, b in list(self.backends.items()):
            todo = [e for e in entries if e[1] > self.state[e[0]].get(n, 0)]
            if not todo:
                continue
            try:
                if n == "wandb":
                    for kind, step, values in todo:
                        b.log(values, step=step)
                        self.state[kind][n] = step
                else:
                    from mlflow.entities import Metric

                    ms = int(time.time() * 1000)
                    b.log_batch(self.state["mlflow_id"],
                                metrics=[Metric(k, v, ms, step) for _, step, values in todo
                                         for k, v in values.items()])
                    for kind, step, _ in todo:
                        self.state[kind][n] = step
            except Exception as e:
                log.warning("myria: tracker %s dropped after an error (the steps it missed are "
                            "sent %s): %s", n, LATER, first_line(e))
                self.backends.pop(n)

    def _behind(self, before: tuple[int, bool]) -> bool:
        """Whether metrics.jsonl holds a row before `before` (`_order`) that an open tracker
        has not accepted. Each tracker has accepted a leading part of the file (live rows in
        order, a catch-up in file order), so the file is read from its end only until a
        training row every open tracker has."""
        low = {k: min(self.state[k].get(n, 0) for n in self.backends)
               for k in ("sent", "sent_eval")}
        for line in _lines_back(self.run_dir / rundir.METRICS):
            row = _row(line)
            e = row and _entry(row)
            if not e or _order(e[0], e[1]) >= before:
                continue
            if e[1] > low[e[0]]:
                return True
            if e[0] == "sent":
                return False
        return False

    def _catch_up(self, before: tuple[int, bool] = (math.inf, True)) -> None:
        """Send each open tracker the rows of RUN_DIR/metrics.jsonl before `before` (the first
        live message, which the rows after it follow) that it has not accepted: the steps of
        an attempt it missed. The file is streamed, in batches of up to BATCH metrics, with
        tracking.json written after each, and not read past its tail when no tracker is
        behind. Called at this process's first message from the trainer: by then the trainer
        has set aside the rows of an abandoned timeline (`train.metrics.set_aside_after`), and
        every row it has handed over is in the file."""
        if self._caught_up:
            return
        self._caught_up = True
        if not self.backends or not self._behind(before):
            return
        batch, size = [], 0
        try:
            fh = open(self.run_dir / rundir.METRICS, encoding="utf-8", errors="replace")
        except OSError:
            return
        with fh:
            for line in fh:
                row = _row(line)
                e = row and _entry(row)
                if not e or _order(e[0], e[1]) >= before:
                    continue
                if batch and size + len(e[2]) > BATCH:
                    self._send(batch)
                    self._save()
                    batch, size = [], 0
                    if not self.backends:
                        return
                batch.append(e)
                size += len(e[2])
        if batch:
            self._send(batch)
            self._save()

    # -- what the metrics sink calls --------------------------------------------------------
    def log(self, row: dict) -> None:
        """A training row of metrics.jsonl, to each tracker that has not had its step."""
        step = int(row["step"])
        self._catch_up(_order("sent", step))
        self._send([("sent", step, _numbers(row, "train/"))])
        self._save()

    def log_eval(self, step: int, val_loss: float, by_source: dict | None = None) -> None:
        """A validation loss (and each source's, for a mixture), to each tracker that has not
        had it."""
        self._catch_up(_order("sent_eval", step))
        self._send([("sent_eval", step, _eval_values(val_loss, by_source))])
        self._save()

    def close(self, finished: bool = False) -> None:
        """Flush and detach; `finished`: the run reached its last step."""
        self._catch_up()
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
CLOSE_WAIT_S = 15.0        # a finished run's wait for its tracker process


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
        """Tell the tracker process to close the runs. After the last step, wait up to
        CLOSE_WAIT_S for it, so that what it says (a tracker that did not start) comes before
        the run's own last lines; otherwise (a stop, a failure) let it finish on its own."""
        import subprocess

        self._send({"op": "close", "finished": finished})
        if self.proc is None:
            return
        proc, self.proc = self.proc, None
        proc.stdin.close()
        if finished:
            try:
                proc.wait(CLOSE_WAIT_S)
            except subprocess.TimeoutExpired:
                log.warning("myria: the tracker process (pid %d) is still sending; it finishes "
                            "on its own", proc.pid)


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


def _drained(lines: Iterable[str]) -> Iterator[str]:
    """`lines`, read from now on by a thread of their own into an unbounded queue: the pipe
    from the trainer is always drained, so its writes never wait on the trackers (nor on the
    previous attempt's tracker process holding the lock)."""
    q: queue.SimpleQueue = queue.SimpleQueue()

    def read() -> None:
        try:
            for line in lines:
                q.put(line)
        finally:
            q.put(None)

    threading.Thread(target=read, name="tracking-input", daemon=True).start()
    return iter(q.get, None)


def serve(run_dir: Path, lines: Iterable[str]) -> None:
    """The tracker process: messages from the trainer (JSON lines) until the end of input."""
    from types import SimpleNamespace

    messages = _drained(lines)
    lock = _locked(run_dir)
    tracker, finished = None, False
    try:
        for line in messages:
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
    """Add `myria report`'s figures (PNG files) to the run's trackers (those its config.json
    names); the trackers that took them. A tracker behind a finished run first gets the steps
    it missed; an unfinished run's rows are left to its resume, which may set aside those past
    its checkpoint."""
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
    if t.state.get("finished"):
        t._catch_up()
    t._caught_up = True   # an unfinished run: close() sends nothing either
    short = os.environ.get("MLFLOW_HTTP_REQUEST_TIMEOUT")
    if t.mlflow_timeout_ours:
        os.environ["MLFLOW_HTTP_REQUEST_TIMEOUT"] = MLFLOW_ARTIFACT_TIMEOUT_S
    for n, b in t.backends.items():
        try:
            if n == "wandb":
                import wandb

                b.log({f"report/{f.stem}": wandb.Image(str(f)) for f in figures},
                      step=t.state["sent"].get(n, 0))
            else:
                for f in figures:
                    b.log_artifact(t.state["mlflow_id"], str(f), "report")
            done.append(n)
        except Exception as e:
            log.warning("report figures not sent to %s: %s", n, e)
    if t.mlflow_timeout_ours and short is not None:
        os.environ["MLFLOW_HTTP_REQUEST_TIMEOUT"] = short
    t.close(finished=t.state.get("finished", False))
    lock.close()
    return done


if __name__ == "__main__":
    import signal
    import sys

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the end of input ends it, after a flush
    serve(Path(sys.argv[1]), sys.stdin)
