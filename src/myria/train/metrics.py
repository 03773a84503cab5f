"""Step metrics: tokens/s, MFU, data wait, loss; written as JSONL and TensorBoard, shown live.

MFU = model FLOPs per step / (step time x number of devices x peak FLOP/s per device), with the
model FLOPs from `myria.models.flops` (the same numbers the planner uses) and the peak from
`myria.device` (datasheet, or measured on a CPU). An unknown peak gives MFU None, never a guess.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

from myria import rundir
from myria.fsutil import atomic_write


class MetricsLogger:
    """Rank 0's metrics sink: RUN_DIR/metrics.jsonl, TensorBoard scalars, a live progress line."""

    def __init__(self, run_dir: Path, total_steps: int, start_step: int, enabled: bool,
                 tensorboard: bool = True, progress: bool = True, tracker: Any = None):
        self.enabled = enabled
        self.tracker = tracker  # W&B / MLflow (myria.observe.tracking), rank 0 only
        self._last = start_step
        self.total = total_steps
        self.start = start_step
        self._tb = None
        self._progress = None
        self._fh = None
        self._t0 = time.monotonic()
        self._first: tuple[int, float] | None = None   # (step, time) of the first row logged
        if not enabled:
            return
        run_dir.mkdir(parents=True, exist_ok=True)
        set_aside_after(run_dir, start_step)
        # the changes a resume at start_step applies begin at start_step + 1 (train.resume)
        set_aside_after(run_dir, start_step + 1, rundir.CONFIG_CHANGES,
                        rundir.CONFIG_CHANGES_ABANDONED)
        self._fh = open(run_dir / rundir.METRICS, "a")
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
                # purge_step: TensorBoard drops the abandoned timeline's points from this step on
                self._tb = SummaryWriter(str(run_dir / rundir.TENSORBOARD),
                                         purge_step=start_step + 1)
            except Exception:  # tensorboard is optional at run time
                self._tb = None
        if progress and sys.stderr.isatty():
            from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn
            self._progress = Progress(
                TextColumn("step {task.completed}/{task.total}"), BarColumn(),
                TextColumn("{task.fields[info]}"), TimeRemainingColumn(), transient=False)
            self._task = self._progress.add_task("train", total=total_steps,
                                                 completed=start_step, info="")
            self._progress.start()

    def log(self, row: dict[str, Any]) -> None:
        if not self.enabled:
            return
        self._fh.write(_line(row))
        self._fh.flush()
        self._last = row["step"]
        if self.tracker is not None:
            self.tracker.log(row)
        if self._tb is not None:
            for k, v in row.items():
                if k in NOT_SCALARS:
                    continue
                if isinstance(v, dict):   # a mixture's figures per source: train/KEY/SOURCE
                    for name, x in v.items():
                        if _finite(x):
                            self._tb.add_scalar(f"train/{k}/{name}", x, row["step"])
                elif _finite(v):
                    self._tb.add_scalar(f"train/{k}", v, row["step"])
        info = format_row(row)
        if self._progress is not None:
            self._progress.update(self._task, completed=row["step"], info=info)
        else:   # a file (Slurm, nohup): the time the bar would show, in the line
            print(f"step {row['step']:>6}/{self.total}  {info}  {self._times(row['step'])}",
                  flush=True)

    def _times(self, step: int) -> str:
        """Elapsed time of this process's training and the time left at the pace of the
        steps since the first logged row (start-up excluded), e.g. 'elapsed 0:12:03 left
        1:40:10'."""
        now = time.monotonic()
        if self._first is None:
            self._first = (step, now)
        s0, t0 = self._first
        if step > s0:
            pace = (now - t0) / (step - s0)
        else:
            pace = (now - self._t0) / max(1, step - self.start)
        left = max(0, self.total - step) * pace
        return f"elapsed {_hms(now - self._t0)}  left {_hms(left)}"

    def log_eval(self, step: int, val_loss: float, by_source: dict | None = None,
                 ledger: dict | None = None) -> None:
        """The validation loss, and for a data mixture each source's (`val_loss_by_source`);
        `ledger`: the goodput ledger's fields for the time since the previous row
        (`goodput.Ledger.row`)."""
        if not self.enabled:
            return
        row = {"step": step, "val_loss": val_loss, **(ledger or {})}
        if by_source:
            row["val_loss_by_source"] = by_source
        self._fh.write(_line(row))
        self._fh.flush()
        if self.tracker is not None:
            self.tracker.log_eval(step, val_loss, by_source)
        if self._tb is not None:
            self._tb.add_scalar("val/loss", val_loss, step)
            for cat, v in ((ledger or {}).get("goodput") or {}).items():   # the eval's time
                if _finite(v):
                    self._tb.add_scalar(f"val/goodput/{cat}", v, step)
            for name, v in (by_source or {}).items():
                self._tb.add_scalar(f"val/loss/{name}", v, step)
        msg = f"step {step:>6}/{self.total}  val_loss {val_loss:.4f}" + "".join(
            f"  {name} {v:.4f}" for name, v in (by_source or {}).items())
        if self._progress is not None:
            self._progress.console.print(msg)
        else:
            print(msg, flush=True)

    def close(self) -> None:
        if self.tracker is not None:  # finished: the last step was logged
            self.tracker.close(self._last >= self.total)
        if self._progress is not None:
            self._progress.stop()
        if self._tb is not None:
            self._tb.close()
        if self._fh is not None:
            self._fh.close()


# Row fields that are not curves: wall-clock stamps and the attempt number.
NOT_SCALARS = frozenset({"step", "time", "goodput_since", "attempt"})


def _line(row: dict[str, Any]) -> str:
    """One line of metrics.jsonl, strict JSON: a skipped step's non-finite loss is null."""
    return json.dumps(rundir.json_safe(row), allow_nan=False) + "\n"


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _hms(seconds: float) -> str:
    s = int(round(seconds))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


def set_aside_after(run_dir: Path, step: int, name: str = rundir.METRICS,
                    side: str = rundir.METRICS_ABANDONED) -> int:
    """Move the rows of steps after `step` from metrics.jsonl (`name`) to
    metrics.abandoned.jsonl (`side`).

    A run resumed from step S redoes the steps after S: the rows an abandoned timeline wrote
    for them (a crash after the last checkpoint, a rollback past a damaged one) are moved to the
    side file, tagged with the resume step, so metrics.jsonl keeps one row per step, the one the
    final model went through; config_changes.jsonl likewise keeps the changes of the timeline
    that trains. Returns the number of rows moved.
    """
    path = run_dir / name
    if not path.exists():
        return 0
    keep, gone = [], []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:  # a line cut by a crash mid-write
            gone.append(json.dumps({"unparsable": line, "resumed_from": step}))
            continue
        if int(row.get("step", 0)) > step:
            gone.append(json.dumps(dict(row, resumed_from=step)))
        else:
            keep.append(line)
    if not gone:
        return 0
    with open(run_dir / side, "a") as fh:
        fh.write("\n".join(gone) + "\n")
        fh.flush()
        os.fsync(fh.fileno())
    atomic_write(path, "".join(x + "\n" for x in keep))
    return len(gone)


def format_row(row: dict[str, Any]) -> str:
    mfu = row.get("mfu")
    mfu_s = f"{100 * mfu:5.1f}%" if mfu is not None else "  n/a"
    by = row.get("loss_by_source")
    per = " (" + ", ".join(f"{n} {v:.4f}" for n, v in by.items()) + ")" if by else ""
    return (f"loss {row['loss']:.4f}{per}  {row['tokens_per_s']:,.0f} tok/s  MFU {mfu_s}  "
            f"step {row['step_time_s'] * 1000:.0f} ms  data {row['data_wait_s'] * 1000:.1f} ms  "
            f"lr {row['lr']:.2e}  gnorm {row['grad_norm']:.3f}")


class StepTimer:
    """Wall time of one step; on GPU call `sync` first so queued kernels are counted."""

    def __init__(self, sync=None):
        self.sync = sync or (lambda: None)
        self.t0 = time.perf_counter()

    def lap(self) -> float:
        self.sync()
        t = time.perf_counter()
        dt, self.t0 = t - self.t0, t
        return dt


def mfu(flops_per_token: float, tokens_per_s: float, devices: int,
        peak_tflops: float | None) -> float | None:
    """Model FLOPs utilisation, or None when the peak is unknown."""
    if not peak_tflops:
        return None
    return flops_per_token * tokens_per_s / (devices * peak_tflops * 1e12)
