"""Fault detection from heartbeats and worker stderr: dead, frozen, hung, silent or alarming ranks.

Once per monitor interval the supervisor feeds a `Watchdog` the newest heartbeat of each local
rank (the record of `myria.observe.heartbeat_store`) and the new lines of each worker's stderr;
it returns `Detection`s (`missed-heartbeats`, `no-heartbeat`, `hang`, `traffic-stopped`,
`alarm`), each with the evidence a person needs to believe it. Times are the supervisor's own
clock (when it saw a heartbeat change), so worker clocks may drift. The watchdog only detects;
the supervisor decides what to do. Rules and defaults: docs/robustness.md, "Detection".
"""

from __future__ import annotations

import os
import re
import signal
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Any

from myria.fsutil import proc_stat
from myria.train.launch import PEER_LOST

# Phases in which a rank is not expected to make progress on its own.
FINISHED = ("done", "stopped", "exit", "failed")
# Phases that may legitimately last long: judged against the start-up timeout.
STARTUP = ("init", "resume", "checkpoint-flush")


# A rank whose heartbeats are late is still working, not dead or frozen, when its process can
# run and used at least this share of the silence in CPU time: a loaded host starves its
# heartbeat thread, a long call holding the GIL blocks it. A stopped or hung process uses none.
BUSY_SHARE = 0.05


def ended(rank: int, pid: Any, how: str, last: dict) -> str:
    """How a rank's process ended, with where its last heartbeat put it (the heartbeat is
    sent every heartbeat_s, so the process may have gone a step or two further)."""
    return (f"rank {rank} (pid {pid}) ended with {how}; its last heartbeat: step "
            f"{last.get('step')}, phase {last.get('phase')}")


def cpu_seconds(pid: Any) -> float | None:
    """CPU time (user + system, s) of local process `pid` while it can run; None when it cannot
    (stopped, traced, a zombie, gone) or /proc cannot tell."""
    try:
        fields = proc_stat(int(pid))
        if fields is None or fields[0] in "TtZXx":
            return None
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (ValueError, TypeError, IndexError):
        return None


_EXCEPTION = re.compile(r"^([A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt|Failure)"
                        r"|[\w.]*CheckpointException)\b")


_RANK_PREFIX = re.compile(r"^\[rank\d+\]:\s?")


@dataclass
class Detection:
    """One detected fault and the evidence for it."""

    kind: str
    ranks: list[int]
    detected_at: float
    fault_at: float
    evidence: str
    details: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class _Rank:
    seq: int = -1
    seen_at: float = 0.0          # when the newest heartbeat arrived
    cpu_seen: float | None = None  # its process's CPU time then (`Watchdog.cpu`)
    record: dict[str, Any] | None = None
    progress: int = -1
    progress_at: float = 0.0
    comm_bytes: int = -1
    comm_at: float = 0.0
    had_traffic: bool = False
    alarms: list[tuple[float, str]] = field(default_factory=list)
    tail: deque = field(default_factory=lambda: deque(maxlen=200))


class Watchdog:
    """Turns heartbeats and stderr lines of one attempt into detections."""

    def __init__(self, ranks: list[int], heartbeat_s: float, missed: int, hang_timeout_s: float,
                 traffic_timeout_s: float = 0.0, startup_timeout_s: float = 300.0,
                 keywords: tuple[str, ...] = ("Traceback", "CUDA error", "NCCL error",
                                              "out of memory"),
                 attempt: int = 0, now: float | None = None, cpu=None) -> None:
        self.ranks = list(ranks)
        self.cpu = cpu    # pid -> CPU seconds or None (`cpu_seconds`): late is not dead if busy
        self.period = heartbeat_s
        self.missed = missed
        self.hang_timeout = hang_timeout_s
        self.traffic_timeout = traffic_timeout_s or hang_timeout_s
        self.startup_timeout = startup_timeout_s
        self.keywords = tuple(k for k in keywords if k)
        self.attempt = attempt
        self.started = time.time() if now is None else now
        self.state = {r: _Rank() for r in self.ranks}
        self.fired: set[tuple[str, int]] = set()

    # -- inputs ------------------------------------------------------------------------------
    def heartbeats(self, records: dict[int, dict[str, Any] | None],
                   now: float | None = None) -> list[Detection]:
        """Take the newest record of each rank; return what is wrong now."""
        now = time.time() if now is None else now
        for r, rec in records.items():
            st = self.state.get(r)
            if st is None or rec is None or rec.get("attempt", self.attempt) != self.attempt:
                continue
            if rec.get("seq", 0) != st.seq:
                st.seq, st.seen_at, st.record = rec.get("seq", 0), now, rec
                st.cpu_seen = self.cpu(rec.get("pid")) if self.cpu else None
            if rec.get("progress", 0) != st.progress:
                st.progress, st.progress_at = rec.get("progress", 0), now
            cb = int(rec.get("comm_bytes", 0))
            if cb != st.comm_bytes:
                if st.comm_bytes >= 0 and cb > st.comm_bytes:
                    st.had_traffic = True
                st.comm_bytes, st.comm_at = cb, now
        return self._check(now)

    def stderr(self, rank: int, lines: list[str], now: float | None = None) -> list[Detection]:
        """Scan new stderr lines of `rank` for alarm keywords."""
        now = time.time() if now is None else now
        out = []
        st = self.state.get(rank)
        for line in lines:
            line = _RANK_PREFIX.sub("", line)  # torch prefixes a worker's traceback lines
            if st is not None and line.strip():
                st.tail.append(line.rstrip())
            hit = next((k for k in self.keywords if k in line), None)
            if hit is None or st is None:
                continue
            st.alarms.append((now, line.strip()))
            out.append(Detection("alarm", [rank], now, now,
                                 f"rank {rank} wrote {hit!r} to stderr: {line.strip()[:300]}",
                                 {"keyword": hit}))
        return out

    # -- what the records say ----------------------------------------------------------------
    def last(self, rank: int) -> dict[str, Any] | None:
        st = self.state.get(rank)
        return st.record if st else None

    def progressed_since(self, rank: int, t: float) -> bool:
        st = self.state.get(rank)
        return bool(st and st.progress_at > t)

    def cause_line(self, rank: int) -> str:
        """The most telling stderr line of `rank`: its last exception, else its last alarm."""
        st = self.state.get(rank)
        if not st:
            return ""
        for line in reversed(st.tail):
            if _EXCEPTION.match(line.strip()):
                return line.strip()[:300]
        lines = [ln for _, ln in st.alarms if ln and not ln.startswith("Traceback")]
        return (lines or [ln for _, ln in st.alarms] or [""])[-1][:300]

    def is_secondary(self, rank: int) -> bool:
        """True when the rank's last error reads as a consequence of another rank's failure."""
        line = self.cause_line(rank)
        return bool(line) and any(s in line for s in PEER_LOST)

    def exit_detection(self, failures: dict, ranks: list[int], now: float) -> Detection:
        """The `exit` detection of torch elastic's failures (rank -> ProcessFailure) among this
        host's `ranks`: the culprit first (killed by a signal from outside < failed by itself <
        failed because of a peer < SIGTERM, which the agent sends stopping the others), then
        the rest in time order, with each one's exit, step, phase and stderr line."""
        def order(r):
            f = failures[r]
            if f.exitcode == -signal.SIGTERM:
                kind = 3
            elif f.exitcode < 0:
                kind = 0
            else:
                kind = 2 if self.is_secondary(r) else 1
            return (kind, f.timestamp, r)

        failed = sorted(failures, key=order)
        parts = []
        for r in failed:
            f = failures[r]
            how = f"signal {f.signal_name()}" if f.exitcode < 0 else f"exit code {f.exitcode}"
            last = self.last(r) or {}
            cause = self.cause_line(r)
            parts.append(ended(r, f.pid, how, last) + (f"; stderr: {cause}" if cause else ""))
        others = [r for r in ranks if r not in failures]
        evidence = "; ".join(parts) + (f"; ranks {others} still running" if others else "")
        return Detection("exit", failed, now, self.state[failed[0]].seen_at or now, evidence,
                         {"exitcodes": {r: failures[r].exitcode for r in failed}})

    def describe(self, rank: int, now: float) -> str:
        rec = self.last(rank)
        if rec is None:
            return f"rank {rank}: no heartbeat yet"
        where = f"in collective {rec['collective']}" if rec.get("in_collective") else \
            (f"not in a collective (last: {rec['collective']})" if rec.get("collective")
             else "not in a collective")
        in_phase = rec.get("phase_s", 0) + now - self.state[rank].seen_at
        return (f"rank {rank} (pid {rec.get('pid')}, {rec.get('host')}): step "
                f"{rec.get('step')}, phase {rec.get('phase')} for {in_phase:.1f} s, {where}")

    def _check(self, now: float) -> list[Detection]:
        out: list[Detection] = []
        for r in self.ranks:
            st = self.state[r]
            rec = st.record
            if rec is None:
                if now - self.started > self.startup_timeout and ("none", r) not in self.fired:
                    self.fired.add(("none", r))
                    out.append(Detection(
                        "no-heartbeat", [r], now, self.started,
                        f"rank {r} sent no heartbeat in {now - self.started:.1f} s since start "
                        f"(start-up timeout {self.startup_timeout:.0f} s)"))
                continue
            if rec.get("phase") in FINISHED:
                continue
            silent = now - st.seen_at
            if silent > self.missed * self.period and ("missed", r) not in self.fired:
                busy = self._busy(st, silent)
                if silent <= self.hang_timeout and busy:
                    continue   # late but computing: judged again at the next check
                self.fired.add(("missed", r))
                verdict = (f"computing all along (its process used CPU) but silent past the "
                           f"hang timeout ({self.hang_timeout:g} s): a call that holds the "
                           "interpreter, or a host that starves it" if busy else
                           "dead or frozen")
                out.append(Detection(
                    "missed-heartbeats", [r], now, st.seen_at,
                    f"rank {r} (pid {rec.get('pid')}, {rec.get('host')}) sent no heartbeat for "
                    f"{silent:.1f} s = {silent / self.period:.1f} periods of {self.period:g} s "
                    f"(limit {self.missed}): {verdict}; last seen after step {rec.get('step')}"
                    f", phase {rec.get('phase')}",
                    {"last": rec, "silent_s": silent, "busy": busy}))
        hang = self._hang(now)
        if hang:
            out.append(hang)
        out.extend(self._traffic(now))
        return out

    def _busy(self, st: _Rank, silent: float) -> bool:
        """Whether a rank silent for `silent` s still computes (BUSY_SHARE); needs `cpu`."""
        if self.cpu is None or st.cpu_seen is None:
            return False
        cpu = self.cpu(st.record.get("pid"))
        return cpu is not None and cpu - st.cpu_seen >= BUSY_SHARE * silent

    def _hang(self, now: float) -> Detection | None:
        stuck = []
        for r in self.ranks:
            st = self.state[r]
            rec = st.record
            if rec is None or rec.get("phase") in FINISHED:
                continue
            if now - st.seen_at > self.missed * self.period:
                continue  # not alive: reported as missed heartbeats
            limit = self.startup_timeout if rec.get("phase") in STARTUP else self.hang_timeout
            if now - st.progress_at > limit:
                stuck.append(r)
        if not stuck or ("hang", -1) in self.fired:
            return None
        self.fired.add(("hang", -1))
        alive = [r for r in self.ranks if self.state[r].record is not None]
        inside = [r for r in alive if self.state[r].record.get("in_collective")]
        outside = [r for r in alive if r not in inside]
        coll = sorted({self.state[r].record.get("collective") for r in inside} - {""})
        since = min(self.state[r].progress_at for r in stuck)
        lines = [self.describe(r, now) for r in alive]
        if inside and outside:
            verdict = (f"ranks {inside} wait inside {', '.join(coll) or 'a collective'}; ranks "
                       f"{outside} never joined it: suspect {outside}")
            suspects = outside
        elif inside:
            verdict = f"all ranks inside {', '.join(coll) or 'a collective'}"
            suspects = inside
        else:
            verdict = "no rank is inside a collective"
            suspects = stuck
        return Detection(
            "hang", suspects, now, since,
            f"no progress for {now - since:.1f} s (hang_timeout_s {self.hang_timeout:g}) while "
            f"heartbeats continue; {verdict}. " + "; ".join(lines),
            {"stuck": stuck, "inside": inside, "outside": outside, "collectives": coll,
             "records": {r: self.state[r].record for r in alive}})

    def _traffic(self, now: float) -> list[Detection]:
        out = []
        for r in self.ranks:
            st = self.state[r]
            rec = st.record
            if rec is None or not st.had_traffic or rec.get("phase") in FINISHED + STARTUP:
                continue
            if now - st.seen_at > self.missed * self.period:
                continue
            if self.traffic_timeout >= self.hang_timeout and \
                    now - st.progress_at > self.missed * self.period:
                # no progress either: a stall, which the hang rule judges with more evidence
                # (the ranks inside and outside the collective). A rank's bytes stop before
                # its last phase change (a collective ends, then the next phase starts), so
                # at equal timeouts this rule would see the stall first and name it by chance
                continue
            if now - st.comm_at > self.traffic_timeout and ("traffic", r) not in self.fired:
                self.fired.add(("traffic", r))
                out.append(Detection(
                    "traffic-stopped", [r], now, st.comm_at,
                    f"rank {r} moved no bytes for {now - st.comm_at:.1f} s (total "
                    f"{st.comm_bytes:,} B, {rec.get('step_bytes', 0):,} B in its last step); "
                    + self.describe(r, now)))
        return out
