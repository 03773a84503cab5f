"""Whether the supervisor runs this host's diagnostics before a restart, and why: only when they
can tell something. A host that passed them within `resilience.diagnostics_ttl_s` and a fault
that does not point at the hardware (a killed or crashed process, a software hang) are not
diagnosed again; a hardware signal or error line, the same rank failing again, or repeated
faults on the host are. The decision and its reason are recorded with the fault."""

from __future__ import annotations

import datetime as _dt
import json
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from myria.resilience.checks.hooks import FAULT_ENV

DEFAULT_TTL_S = 3600.0
"""resilience.diagnostics_ttl_s's default: how long a pass is trusted (why an hour:
docs/robustness.md, "When the diagnostics run"); 0 runs them before every restart."""

HOST_FAULTS = 3          # this many faults on the host within the TTL: diagnose (repeated)
HARDWARE_SIGNALS = ("SIGBUS", "SIGILL")   # a machine check's poisoned page, a broken CPU
# what a rank's last error line says when the device, its memory or a link failed
HARDWARE_WORDS = re.compile(
    r"CUDA error|NCCL error|\bECC\b|\bXid\b|uncorrectable|illegal memory access|NVLink|"
    r"PCIe|SilentCorruption|replicas diverged|changed at rest", re.IGNORECASE)


@dataclass
class Decision:
    """Whether to run the diagnostics before a restart, and why (recorded with the fault)."""

    run: bool
    reason: str
    last_pass_age_s: float | None = None


def _report_time(d: dict[str, Any], path: Path) -> float:
    """When a report's checks ended: its start (local time) plus its duration, else its mtime."""
    try:
        return _dt.datetime.fromisoformat(d["started_at"]).timestamp() + \
            float(d.get("duration_s") or 0.0)
    except (KeyError, TypeError, ValueError):
        return path.stat().st_mtime


def newest_report(host: str, nproc: int, dirs: Sequence[Path], newest: int = 20
                  ) -> dict[str, Any] | None:
    """The newest full diagnostics report of `host` in `dirs` (the run's diagnostics/ and the
    host cache's doctor/, where `myria doctor` writes): {"at", "passed", "path"}. Reports of a
    test hook (MYRIA_DOCTOR_FAULT) or of fewer local ranks than `nproc` do not count."""
    files: list[tuple[float, Path]] = []
    for d in dirs:
        try:
            files += [(p.stat().st_mtime, p) for p in Path(d).glob(f"{host}-*.json")]
        except OSError:
            continue
    best: dict[str, Any] | None = None
    for _, p in sorted(files, reverse=True)[:newest]:
        try:
            r = json.loads(p.read_text())
        except (OSError, ValueError):
            continue
        if not isinstance(r, dict) or r.get("host") != host or r.get("faults") or \
                int(r.get("nproc") or 0) < nproc or not r.get("checks"):
            continue
        at = _report_time(r, p)
        if best is None or at > best["at"]:
            best = {"at": at, "passed": bool(r.get("passed")), "path": str(p)}
    return best


def _signal_of(fault: dict[str, Any]) -> str:
    first = str(fault.get("evidence", "")).split(";")[0]
    m = re.search(r"signal (SIG[A-Z0-9]+)", first)
    return m.group(1) if m else ""


def hardware_reason(fault: dict[str, Any], previous: Sequence[dict[str, Any]],
                    detections: Sequence[dict[str, Any]], now: float, ttl_s: float) -> str:
    """Why this fault points at the hardware ('' when it does not). `fault` and `previous`
    (the job's earlier faults on this host) are the supervisor's Fault.to_dict()s; `detections`
    are events.jsonl rows (myria.detections) written since the failed attempt started."""
    for d in detections:
        if d.get("kind") == "sdc":
            return (f"sdc verdict at step {d.get('step')} on rank {d.get('rank')} "
                    f"({d.get('evidence', {}).get('check', 'replicas')})")
        if d.get("kind") == "health" and d.get("action") != "none":
            return "a health check of this host failed during the attempt"
    kind = fault.get("kind")
    if kind == "traffic-stopped":
        return "a rank's traffic stopped (a link or NIC)"
    if kind == "hang":   # alive but stuck: a device or link that stopped answering
        return "a rank made no progress while its process lived (a stuck device or link)"
    sig = _signal_of(fault)
    if sig in HARDWARE_SIGNALS:
        return f"the rank died of {sig} (a memory or CPU fault)"
    cause = str(fault.get("cause", ""))
    if m := HARDWARE_WORDS.search(cause):
        return f"its error names the hardware ({m.group(0)!r}: {cause[:120]})"
    ranks = list(fault.get("ranks") or [])
    culprit = ranks[0] if ranks else None
    for p in previous:
        if culprit is not None and (p.get("ranks") or [None])[0] == culprit:
            return (f"rank {culprit} faulted again (before: {p.get('kind')} at step "
                    f"{p.get('last_step')}, attempt {p.get('attempt')})")
    recent = [p for p in previous if now - float(p.get("fault_at") or 0) <= ttl_s]
    if len(recent) + 1 >= HOST_FAULTS:
        return f"fault {len(recent) + 1} on this host within {ttl_s:g} s"
    return ""


def decide(fault: dict[str, Any], previous: Sequence[dict[str, Any]],
           last: dict[str, Any] | None, *, now: float, ttl_s: float,
           detections: Sequence[dict[str, Any]] = (), hook: bool = False) -> Decision:
    """Run the diagnostics before a restart, or skip them: skip only when this host passed a
    full diagnostic (`last`, from newest_report) within `ttl_s` and the fault does not point at
    the hardware (hardware_reason)."""
    if ttl_s <= 0:
        return Decision(True, "run: resilience.diagnostics_ttl_s = 0 (always)")
    if hook:
        return Decision(True, f"run: test hook {FAULT_ENV} pending")
    if why := hardware_reason(fault, previous, detections, now, ttl_s):
        return Decision(True, f"run: {why}")
    if last is None:
        return Decision(True, f"run: no full diagnostics of this host on record (pass within "
                              f"{ttl_s:g} s skips them)")
    age = max(0.0, now - float(last["at"]))
    if not last["passed"]:
        return Decision(True, f"run: the newest diagnostics of this host failed {age:.0f} s ago",
                        age)
    if age > ttl_s:
        return Decision(True, f"run: host passed {age:.0f} s ago, more than "
                              f"resilience.diagnostics_ttl_s = {ttl_s:g}", age)
    return Decision(False, f"skipped: host passed {age:.0f} s ago (within "
                           f"resilience.diagnostics_ttl_s = {ttl_s:g}; {last['path']}) and the "
                           f"fault ({fault.get('kind')}: {str(fault.get('cause'))[:80]}) does not "
                           "point at the hardware", age)


def decide_for_supervisor(run_dir: Path, host: str, nproc: int, fault: dict[str, Any],
                          previous: Sequence[dict[str, Any]], ttl_s: float, since: float,
                          hook: bool = False) -> Decision:
    """decide() with the evidence a supervisor has: the run's and the host cache's reports and
    the detections the workers recorded since `since` (the failed attempt's start)."""
    from myria import detections as det
    from myria import rundir
    from myria.device import cache_dir

    now = time.time()
    if ttl_s <= 0 or hook:
        return decide(fault, previous, None, now=now, ttl_s=ttl_s, hook=hook)
    rows = [r for r in det.read(run_dir) if float(r.get("time") or 0) >= since]
    last = newest_report(host, nproc, [Path(run_dir) / rundir.DIAGNOSTICS_DIR,
                                       cache_dir() / "doctor"])
    return decide(fault, previous, last, now=now, ttl_s=ttl_s, detections=rows)
