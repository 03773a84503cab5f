"""The hang report: what every rank was doing when a job stopped making progress.

The supervisor (or a user: `kill -USR1 PID`) asks each worker for a dump; a worker's dump thread
writes RUN_DIR/hang/rankNNNNN.json with its open events (innermost last) and its last completed
event (myria.observe.events). `merge` reads them and names the rank stuck outside any
collective, or that wrote nothing (frozen, dead, or not running Python), and the collective the
others wait in; the result goes to RUN_DIR/report/hang.json.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections import Counter
from pathlib import Path

from myria import rundir
from myria.fsutil import atomic_write

WAITING = ("comm", "wait", "p2p")


def request(pids: dict[int, int], run_dir: str | Path, timeout_s: float = 3.0) -> float:
    """Send SIGUSR1 to each rank's process and wait up to `timeout_s` for their dumps; return
    the time of the request (dumps older than it are stale)."""
    t = time.time()
    for pid in pids.values():
        try:
            os.kill(pid, signal.SIGUSR1)
        except (ProcessLookupError, PermissionError):
            pass
    deadline = t + timeout_s
    while time.time() < deadline:
        fresh = [r for r in pids if _fresh(rundir.hang_file(run_dir, r), t)]
        if len(fresh) == len(pids):
            break
        time.sleep(0.05)
    return t


def _fresh(path: Path, since: float) -> bool:
    try:
        return path.stat().st_mtime >= since - 0.5
    except OSError:
        return False


def merge(run_dir: str | Path, ranks: list[int], since: float) -> dict:
    """The merged hang report of `ranks` from dumps written after `since`."""
    dumps: dict[int, dict] = {}
    for r in ranks:
        path = rundir.hang_file(run_dir, r)
        if _fresh(path, since):
            try:
                dumps[r] = json.loads(path.read_text())
            except (OSError, ValueError):
                pass
    silent = [r for r in ranks if r not in dumps]
    waiting, stuck = {}, {}
    for r, d in dumps.items():
        inner = [e for e in d.get("open", []) if e.get("c") in WAITING]
        if inner:
            e = inner[-1]
            a = e.get("a") or {}
            waiting[r] = {"collective": a.get("of", e["n"]), "dim": a.get("dim"),
                          "seq": a.get("seq"), "group": a.get("group"),
                          "since_s": round(e.get("open_for_s", 0.0), 3), "step": e.get("s")}
        else:
            opened = d.get("open", [])
            stuck[r] = {"in": opened[-1]["n"] if opened else None,
                        "since_s": round(opened[-1].get("open_for_s", 0.0), 3) if opened
                        else None, "step": d.get("step"), "last": (d.get("last") or {}).get("n")}
    common = Counter((w["collective"], w["dim"], w["seq"]) for w in waiting.values())
    coll = None
    if common:
        (name, dim, seq), n = common.most_common(1)[0]
        coll = {"name": name, "dim": dim, "seq": seq, "ranks": sorted(
            r for r, w in waiting.items() if (w["collective"], w["dim"], w["seq"]) ==
            (name, dim, seq))}
    return {"requested_at": since, "stuck_ranks": sorted(stuck), "silent_ranks": silent,
            "stuck": stuck, "waiting": waiting, "collective": coll,
            "suspects": sorted(stuck) + silent, "ranks": dumps}


def summary_line(rep: dict) -> str:
    """One line for a log: the rank(s) stuck and what the others wait in."""
    parts = []
    for r, s in sorted(rep["stuck"].items()):
        parts.append(f"rank {r} is stuck outside any collective (in {s['in'] or 'no event'}"
                     + (f" for {s['since_s']:.1f} s" if s["since_s"] is not None else "")
                     + f", step {s['step']})")
    if rep["silent_ranks"]:
        parts.append(f"rank(s) {rep['silent_ranks']} wrote nothing (frozen, dead or outside "
                     "Python)")
    c = rep["collective"]
    if c:
        parts.append(f"ranks {c['ranks']} wait in {c['name']} (mesh dim {c['dim']}, "
                     f"sequence {c['seq']})")
    return "; ".join(parts) or "every rank answered and none waits in a collective"


def write(run_dir: str | Path, rep: dict) -> Path:
    out = rundir.report_dir(run_dir) / "hang.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(out, json.dumps(rep, indent=1))
    return out
