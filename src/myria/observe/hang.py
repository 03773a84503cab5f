"""The hang report: what every rank was doing when a job stopped making progress.

The supervisor (or a user: `kill -USR1 PID`) asks each worker for a dump; a worker's dump thread
writes RUN_DIR/hang/rankNNNNN.json with its open events (innermost last) and its last completed
event (myria.observe.events). `merge` reads them and names the rank stuck outside any
collective, or that wrote nothing (frozen, dead, or not running Python), and the collective the
others wait in; the result goes to RUN_DIR/report/hang.json.

Beside each rank's open events the report holds its Python stack (`stacks`, and `stack`, the
innermost frames of its main thread, on each stuck or waiting rank): taken with py-spy where
the `py-spy` command is installed and may attach (it reads a process from outside, so a frozen
or GIL-holding one answers too), else with the standard library's faulthandler, which each worker
registers on a real-time signal (`STACK_SIGNAL`, `listen_for_stacks`) and which dumps every
thread from the signal handler in C, also while the main thread waits inside a collective.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
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
                     + f", during step {s['step']})"
                     + (f" at {s['stack'][0].strip()}" if s.get("stack") else ""))
    if rep["silent_ranks"]:
        parts.append(f"rank(s) {rep['silent_ranks']} wrote nothing (frozen, dead or outside "
                     "Python)")
    for r, a in sorted(rep.get("alive", {}).items()):
        where = a["stack"][0].strip() if a["stack"] else "?"
        parts.append(f"rank {r} wrote no event dump; its stack is in {where}"
                     + (" (a collective: it waits for another rank)" if a["in_collective"]
                        else ""))
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


# -- Python stacks ----------------------------------------------------------------------------
# Not SIGUSR1 (the event dump, myria.observe.events) nor SIGUSR2 (the parent-death signal that
# myria.train.launch turns into a clean stop): faulthandler's handler replaces Python's, so sharing
# SIGUSR2 left workers without their stop when the launcher died. Real-time signals are unused by
# torch and gloo; SIGRTMIN + 4 stays clear of those glibc keeps below SIGRTMIN.
STACK_SIGNAL = signal.SIGRTMIN + 4
_STACK_FH = None


def stack_file(run_dir: str | Path, rank: int) -> Path:
    return rundir.hang_file(run_dir, rank).with_suffix(".stack.txt")


def listen_for_stacks(run_dir: str | Path, rank: int | None = None) -> None:
    """Dump every thread's Python stack to RUN_DIR/hang/rankNNNNN.stack.txt on STACK_SIGNAL
    (faulthandler). Call early in a worker; RANK from the environment by default."""
    global _STACK_FH
    import faulthandler

    if _STACK_FH is not None:
        return
    rank = int(os.environ.get("RANK", 0)) if rank is None else rank
    path = stack_file(run_dir, rank)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        _STACK_FH = open(path, "a")  # append: the requester truncates it before each dump
    except OSError:
        return
    faulthandler.register(STACK_SIGNAL, file=_STACK_FH, all_threads=True, chain=False)
    import atexit

    atexit.register(_stop_listening, path)


def _stop_listening(path: Path) -> None:
    """At a worker's exit: a stack file no dump was written to goes (an empty file in hang/ would
    read as a hang that never happened), and the hang folder with it when nothing else is in
    it."""
    global _STACK_FH
    import faulthandler

    faulthandler.unregister(STACK_SIGNAL)
    if _STACK_FH is not None:
        _STACK_FH.close()
        _STACK_FH = None
    try:
        if path.stat().st_size == 0:
            path.unlink()
            path.parent.rmdir()
    except OSError:   # written, or the folder holds other ranks' files
        pass


def main_thread_frames(text: str, tool: str) -> list[str]:
    """The main thread's frames, innermost first, from a py-spy or faulthandler dump."""
    blocks, cur = [], None
    for line in text.splitlines():
        if line.startswith(("Thread ", "Current thread ")):
            cur = [line]
            blocks.append(cur)
        elif cur is not None and line.strip():
            cur.append(line.strip())
    if not blocks:
        return []
    if tool == "py-spy":
        main = next((b for b in blocks if "MainThread" in b[0]), blocks[0])
    else:  # faulthandler lists the newest thread first: the main thread is the last
        main = blocks[-1]
    return main[1:]


def _py_spy(pids: dict[int, int], timeout_s: float) -> dict[int, str]:
    exe = shutil.which("py-spy")
    if not exe:
        return {}
    procs = {r: subprocess.Popen([exe, "dump", "--pid", str(pid)], stdout=subprocess.PIPE,
                                 stderr=subprocess.DEVNULL, text=True)
             for r, pid in pids.items()}
    out = {}
    for r, p in procs.items():
        try:
            text, _ = p.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            p.kill()
            continue
        if p.returncode == 0 and text.strip():
            out[r] = text
    return out


def request_stacks(pids: dict[int, int], run_dir: str | Path,
                   timeout_s: float = 5.0) -> dict[int, dict]:
    """Each rank's Python stack: {rank: {"tool", "text", "main"}}; py-spy first, faulthandler
    (STACK_SIGNAL to a worker that called `listen_for_stacks`) for the ranks it could not read."""
    got = {r: {"tool": "py-spy", "text": t} for r, t in _py_spy(pids, timeout_s).items()}
    rest = {r: pid for r, pid in pids.items() if r not in got}
    for r, pid in rest.items():
        path = stack_file(run_dir, r)
        if not path.exists():
            continue  # no handler registered: the signal would end the process
        try:
            os.truncate(path, 0)
            os.kill(pid, STACK_SIGNAL)
        except OSError:
            continue
    deadline = time.time() + timeout_s
    sizes: dict[int, int] = {}
    while rest and time.time() < deadline:
        time.sleep(0.1)
        for r in list(rest):
            try:
                n = stack_file(run_dir, r).stat().st_size
            except OSError:
                continue
            if n and sizes.get(r) == n:  # written and no longer growing
                got[r] = {"tool": "faulthandler",
                          "text": stack_file(run_dir, r).read_text(errors="replace")}
                del rest[r]
            sizes[r] = n
    for d in got.values():
        d["main"] = main_thread_frames(d["text"], d["tool"])
    return got


COLLECTIVE_FRAME = "torch/distributed/"   # a stack frame of a collective (its file's path)


def add_stacks(rep: dict, stacks: dict[int, dict], frames: int = 8) -> dict:
    """Put each rank's stack in the report, and its main thread's innermost frames beside the
    collective it waits in (or the event it is stuck in)."""
    rep["stacks"] = {r: {"tool": d["tool"], "main": d["main"], "text": d["text"]}
                     for r, d in sorted(stacks.items())}
    for part in ("waiting", "stuck"):
        for r, entry in rep.get(part, {}).items():
            if r in stacks:
                entry["stack"] = stacks[r]["main"][:frames]
    # a rank that wrote no event dump but whose stack was read is alive: where its stack is
    # in torch.distributed it waits for another rank (one on a host the job lost, say), so it
    # is no suspect; it stays silent where nothing was read
    alive = {r: stacks[r]["main"][:frames] for r in rep.get("silent_ranks", []) if r in stacks}
    rep["silent_ranks"] = [r for r in rep.get("silent_ranks", []) if r not in alive]
    rep["alive"] = {r: {"stack": st, "in_collective": any(COLLECTIVE_FRAME in x for x in st)}
                    for r, st in alive.items()}
    rep["suspects"] = [r for r in rep.get("suspects", [])
                       if not (r in rep["alive"] and rep["alive"][r]["in_collective"])]
    rep["stack_ranks"] = sorted(stacks)
    return rep
