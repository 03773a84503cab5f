"""RUN_DIR/events.jsonl: every detection (straggler, corruption, numerical fault, health, a host's
degraded link, an idle spare lost, a damaged checkpoint or a failed save), one JSON line each,
appended atomically:

    {"kind": "straggler" | "sdc" | "nonfinite" | "loss_spike" | "health" | "slow-link" |
             "spare-lost" | "checkpoint", "rank": R, "host": H, "step": S, "evidence": {...},
     "action": "...", "time": t}

One module owns the file so that every detector writes the same shape.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from myria import rundir

KINDS = ("straggler", "sdc", "nonfinite", "loss_spike", "health", "slow-link", "spare-lost",
         "checkpoint")
# Each kind in words, for one-line summaries.
WORDS = {"straggler": "straggler", "sdc": "silent data corruption",
         "nonfinite": "non-finite loss or gradient", "loss_spike": "loss spike",
         "health": "host self-check finding", "slow-link": "slow link",
         "spare-lost": "idle spare lost", "checkpoint": "damaged checkpoint or failed save"}


def record(run_dir: str | Path, kind: str, rank: int | None, host: str, step: int,
           evidence: dict[str, Any], action: str) -> dict:
    """Append one detection to RUN_DIR/events.jsonl (one write of one line, O_APPEND)."""
    if kind not in KINDS:
        raise ValueError(f"unknown detection kind {kind!r}; valid: {', '.join(KINDS)}")
    row = {"kind": kind, "rank": rank, "host": host, "step": step, "evidence": evidence,
           "action": action, "time": time.time()}
    path = Path(run_dir) / rundir.DETECTIONS
    path.parent.mkdir(parents=True, exist_ok=True)
    data = (json.dumps(row) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    return row


def read(run_dir: str | Path, kind: str | None = None) -> list[dict]:
    """The detections of a run (optionally of one kind); a line cut by a crash is skipped."""
    rows = rundir.read_jsonl(Path(run_dir) / rundir.DETECTIONS)
    return [r for r in rows if kind is None or r.get("kind") == kind]
