"""The run directory: the interface between the worker side and the tools above it.

Every path under RUN_DIR that more than one part of myria reads or writes is named here:

    config.json              the resolved config of the run (rank 0, at start)
    config_changes.jsonl     fields changed on resume: step, field, old and new value
    metrics.jsonl            one row per logged step (rank 0); metrics.abandoned.jsonl holds
                             rows of steps redone after a rollback
    checkpoints/             two-stage checkpoints (myria.train.checkpoint)
    events/rankNNNNN.jsonl   each rank's timed events (myria.observe.events)
    hang/rankNNNNN.json      what each rank was doing when a hang dump was requested
    report/                  `myria report` output: index.html, trace.json, blame.json, PNGs,
                             hang.json (the supervisor's merged hang report)
    events.jsonl             detections (stragglers, corruption, numerical faults, health)
    offload/rankNNNNN/       the nvme tier's optimizer-state files (parallel.offload = nvme,
                             unless parallel.offload_dir puts them elsewhere)
    offload_stats/rankNNNNN.json  the nvme tier's I/O per rank: bytes, times, exposed waits,
                             peak resident memory
    supervisor.log, supervisor_summary.json, logs/, faults/
"""

from __future__ import annotations

import json
from pathlib import Path

CONFIG = "config.json"
CONFIG_CHANGES = "config_changes.jsonl"
METRICS = "metrics.jsonl"
METRICS_ABANDONED = "metrics.abandoned.jsonl"
CHECKPOINTS = "checkpoints"
EVENTS_DIR = "events"
HANG_DIR = "hang"
REPORT_DIR = "report"
DETECTIONS = "events.jsonl"
OFFLOAD_DIR = "offload"
OFFLOAD_STATS = "offload_stats"


def events_file(run_dir: str | Path, rank: int) -> Path:
    return Path(run_dir) / EVENTS_DIR / f"rank{rank:05d}.jsonl"


def hang_file(run_dir: str | Path, rank: int) -> Path:
    return Path(run_dir) / HANG_DIR / f"rank{rank:05d}.json"


def report_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / REPORT_DIR


def offload_stats_file(run_dir: str | Path, rank: int) -> Path:
    return Path(run_dir) / OFFLOAD_STATS / f"rank{rank:05d}.json"


def read_jsonl(path: str | Path) -> list[dict]:
    """The JSON objects of a JSON-lines file of the run directory; a line cut by a crash (or
    otherwise unparsable) is skipped, a missing file is empty."""
    path = Path(path)
    out = []
    if path.exists():
        for line in path.read_text(errors="replace").splitlines():
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if isinstance(row, dict):
                out.append(row)
    return out
