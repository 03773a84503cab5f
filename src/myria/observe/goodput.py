"""The goodput ledger: every second of a run's wall time, attributed to productive steps or to a
named loss; and the milestones of each restart, from which a recovery's time splits into phases.

Worker side (`Ledger`, fed the heartbeat phases of the training loop by `train.heartbeat`): each
metrics row carries `goodput`, the seconds of each category since the previous row, summing to
the wall time since it; each process writes its milestones to
RUN_DIR/goodput/attemptA-rankRRRRR.json. Supervisor side (`summarize`, torch-free): the
supervisor's wall time tiled by its attempts and faults; ETTR = productive / wall. `breakdown`
splits one recovery into phases that add up to the fault's time lost. The categories:
docs/robustness.md, "The goodput ledger".
"""

from __future__ import annotations

import json
import os
import statistics
import time
from collections import defaultdict, deque
from pathlib import Path
from typing import Any

DIR = "goodput"
# the categories, in the order the report stacks them
CATEGORIES = ("productive", "startup", "data_wait", "checkpoint", "eval", "straggler", "slow",
              "detection", "recovery", "lost", "redone", "shutdown", "other")
# each category in words, as the report's ledger table gives it
MEANING = {"productive": "training steps run for the first time",
           "startup": "processes starting, process groups, model build, first restore",
           "data_wait": "steps waiting for their batch",
           "checkpoint": "snapshot waits, saves, the final flush, peer snapshots",
           "eval": "evaluation",
           "straggler": "what detected stragglers cost every step",
           "slow": "steps at under half the run's usual pace (a slowed link, a healed "
                   "partition, a stall no detector named): their time beyond the usual",
           "detection": "a fault until it was detected",
           "recovery": "detection until the restarted processes trained again",
           "lost": "from the last logged step to a fault: the step in flight, thrown away",
           "redone": "steps run again after a restart (an earlier attempt had run them, "
                     "past its last checkpoint)",
           "shutdown": "after the last step: the final checkpoint's flush, processes ending",
           "other": "what nothing accounts for"}
# heartbeat phase -> ledger category (phases not named here count as step time)
PHASES = {"init": None, "resume": None, "snapshot-wait": "checkpoint",
          "checkpoint": "checkpoint", "checkpoint-flush": "checkpoint", "eval": "eval",
          "peer-snapshot": "checkpoint"}
RECOVERY_PHASES = ("detection", "teardown", "decision", "backoff", "start_processes",
                   "process_groups", "build_model", "restore", "redo_steps")
# `slow`: a metrics row whose steps took on average more than SLOW_FACTOR x the median of the
# process's last PACE_WINDOW rows (judged from the PACE_MIN-th row, so that start-up and
# warm-up rows set no pace) books its time beyond that median as `slow`. A median, and a
# factor well above the step-to-step noise of a loaded host, so that only a stall counts; the
# step time deviation of Google's ML goodput measurement, with a robust norm.
SLOW_FACTOR = 2.0
PACE_WINDOW = 50
PACE_MIN = 5


def process_start_time() -> float:
    """Wall time this process started (Linux /proc), else now."""
    from myria.fsutil import proc_stat

    try:
        ticks = int(proc_stat()[19])
        with open("/proc/stat") as fh:
            btime = next(int(x.split()[1]) for x in fh if x.startswith("btime"))
        t = btime + ticks / os.sysconf("SC_CLK_TCK")
        return t if t <= time.time() else time.time()
    except (OSError, ValueError, IndexError, TypeError, StopIteration):
        return time.time()


def marks_file(run_dir: str | Path, attempt: int, rank: int) -> Path:
    return Path(run_dir) / DIR / f"attempt{attempt}-rank{rank:05d}.json"


class Ledger:
    """This process's wall time by category, closed into a metrics row every logging interval."""

    def __init__(self, run_dir: str | Path, attempt: int | None = None, clock=time.time) -> None:
        self.run_dir = Path(run_dir)
        self.clock = clock
        from myria import rundir

        # the job's attempt as every record of this process says it (across hosts: the round)
        self.attempt = rundir.job_attempt() if attempt is None else attempt
        t0 = process_start_time() if clock is time.time else clock()
        self.marks: dict[str, float] = {"process_start": t0, "entered": clock()}
        self.rank: int | None = None
        self.start_cat = "recovery" if self.attempt > 0 else "startup"
        self.cat = self.start_cat
        self.since = t0      # start of the open segment
        self.row_since = t0  # start of the interval the next row covers
        self.acc: dict[str, float] = defaultdict(float)
        self.start_step = 0
        self.step = 0
        self._row_step = 0   # the step of the previous row
        self._pace: deque[float] = deque(maxlen=PACE_WINDOW)   # seconds per step, per row
        self._high_water: int | None = None

    # -- the tiling --------------------------------------------------------------------------
    def _close(self, now: float) -> None:
        self.acc[self.cat] += max(0.0, now - self.since)
        self.since = now

    def enter(self, cat: str) -> None:
        if cat == self.cat:
            return
        self._close(self.clock())
        self.cat = cat

    def phase(self, name: str) -> None:
        if name == "resume":
            self.mark("model_built")
        if "first_step" not in self.marks and name in PHASES:
            return  # start-up goes on until the first step begins
        self.enter(PHASES.get(name) or "step")

    def mark(self, name: str, write: bool = False) -> None:
        self.marks.setdefault(name, self.clock())
        if write and self.rank is not None:
            try:
                from myria.fsutil import atomic_write

                path = marks_file(self.run_dir, self.attempt, self.rank)
                path.parent.mkdir(parents=True, exist_ok=True)
                atomic_write(path, json.dumps({"attempt": self.attempt, "rank": self.rank,
                                               "start_step": self.start_step, **self.marks}))
            except OSError:
                pass  # evidence only

    def ready(self, rank: int) -> None:
        """This process's rank, and the `pg_ready` milestone: call once its process group is up."""
        self.rank = rank
        self.mark("pg_ready")

    def resumed(self, step: int) -> None:
        self.start_step = self.step = self._row_step = step
        self.mark("restored", write=True)

    def step_done(self, step: int) -> None:
        self.step = step
        if "first_step" not in self.marks:
            self.mark("first_step", write=True)

    def high_water(self) -> int:
        """The furthest step an abandoned timeline reached (rows set aside on resume)."""
        if self._high_water is None:
            from myria import rundir

            best = 0
            path = self.run_dir / rundir.METRICS_ABANDONED
            if path.exists():
                for line in path.read_text().splitlines():
                    try:
                        best = max(best, int(json.loads(line).get("step", 0)))
                    except (ValueError, TypeError, AttributeError):
                        continue
            self._high_water = best
        return self._high_water

    def row(self, row: dict[str, Any]) -> dict[str, Any]:
        """`row` plus `goodput` (seconds per category since the previous row) and `attempt`."""
        now = self.clock()
        self._close(now)
        acc, self.acc = self.acc, defaultdict(float)
        step_s = acc.pop("step", 0.0)
        wait = min(step_s, max(0.0, float(row.get("data_wait_s") or 0.0)))
        kind = "redone" if self.step <= self.high_water() else "productive"
        work = step_s - wait
        steps, self._row_step = self.step - self._row_step, self.step
        if kind == "productive" and steps > 0:
            per = work / steps
            usual = statistics.median(self._pace) if len(self._pace) >= PACE_MIN - 1 else None
            self._pace.append(per)
            if usual is not None and per > SLOW_FACTOR * usual:
                acc["slow"] += (per - usual) * steps
                work = usual * steps
        acc[kind] += work
        acc["data_wait"] += wait
        out = {c: round(acc[c], 6) for c in CATEGORIES if acc.get(c)}
        start, self.row_since = self.row_since, now
        return dict(row, goodput=out, goodput_since=round(start, 6), attempt=self.attempt)


# -- supervisor side -------------------------------------------------------------------------
def read_marks(run_dir: str | Path, attempt: int) -> dict[int, dict]:
    out = {}
    for p in sorted((Path(run_dir) / DIR).glob(f"attempt{attempt}-rank*.json")):
        try:
            d = json.loads(p.read_text())
            out[int(d["rank"])] = d
        except (OSError, ValueError, KeyError):
            continue
    return out


def breakdown(f: dict, marks: dict[int, dict]) -> dict[str, float] | None:
    """Seconds of each phase of the recovery from fault `f` (a Fault.to_dict() with the
    supervisor's timestamps), given the next attempt's milestones per rank; None if it did not
    resume. Each phase ends when the slowest rank reached its milestone."""
    if not f.get("regained_at") or not f.get("restarted_at") or not marks:
        return None

    def latest(name: str, floor: float) -> float:
        vals = [m[name] for m in marks.values() if m.get(name)]
        return max([floor, *vals])

    t = [f["fault_at"], f["detected_at"]]
    t.append(max(t[-1], f.get("stopped_at") or t[-1]))
    t.append(max(t[-1], f.get("decided_at") or t[-1]))
    t.append(max(t[-1], f.get("backoff_done_at") or t[-1]))
    for name in ("entered", "pg_ready", "model_built", "restored"):
        t.append(latest(name, t[-1]))
    t.append(max(t[-1], f["regained_at"]))
    # the supervisor stops the group first, then runs the diagnostics (the decision)
    out = dict(zip(RECOVERY_PHASES, (b - a for a, b in zip(t, t[1:], strict=False)),
                   strict=True))
    return {k: round(v, 3) for k, v in out.items()}


def ledger_rows(run_dir: Path, since: float) -> list[dict]:
    """The metrics rows with a ledger written since `since` (kept and set-aside), by time."""
    from myria import rundir

    rows = []
    for name in (rundir.METRICS, rundir.METRICS_ABANDONED):
        path = run_dir / name
        if not path.exists():
            continue
        for line in path.read_text().splitlines():
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if isinstance(row, dict) and "goodput" in row and row.get("time", 0) >= since:
                rows.append(row)
    rows.sort(key=lambda r: r["time"])
    return rows


def summarize(run_dir: str | Path, started_at: float, ended_at: float, faults: list[dict],
              stragglers: list[dict] | None = None) -> dict[str, Any]:
    """The supervisor's ledger: seconds per category over [started_at, ended_at], ETTR and a
    timeline of segments (start offset, seconds per category) for the report's stacked bar.

    `faults` are Fault.to_dict()s in order (attempt, fault_at, detected_at); `stragglers` are
    {"cost_s_per_step", "first_step"} of each detected straggler."""
    run_dir = Path(run_dir)
    rows = ledger_rows(run_dir, started_at)
    # a straggler's measured cost per step, on each step after it was first seen, is time the
    # job lost to it: moved out of the row's productive time
    for r in rows:
        gp = r["goodput"] = dict(r["goodput"])
        for st in stragglers or []:
            if "productive" in gp and int(r["step"]) >= int(st.get("first_step", 0)):
                cost = min(gp["productive"], float(st.get("cost_s_per_step", 0.0)))
                gp["productive"] -= cost
                gp["straggler"] = gp.get("straggler", 0.0) + cost
    timeline: list[tuple[float, float, dict[str, float]]] = []
    cursor = started_at

    def add(t0: float, t1: float, cats: dict[str, float]) -> None:
        # a segment [t0, t1]: what starts before the cursor or ends after ended_at is cut,
        # scaled down in proportion; a gap before it is `other`
        nonlocal cursor
        t1 = min(t1, ended_at)
        if t1 <= cursor:
            return
        if t0 > cursor:
            timeline.append((cursor, t0, {"other": t0 - cursor}))
        else:
            t0 = cursor
        total = sum(cats.values())
        keep = (t1 - t0) / total if total > 0 else 0.0
        seg = {k: v * min(1.0, keep) for k, v in cats.items() if v > 0}
        if total < t1 - t0:
            seg["other"] = seg.get("other", 0.0) + (t1 - t0 - total)
        for head in ("startup", "recovery"):  # a row's start-up came first: its own segment
            if head in seg and len(seg) > 1:
                v = seg.pop(head)
                timeline.append((t0, t0 + v, {head: v}))
                t0 += v
        timeline.append((t0, t1, seg))
        cursor = t1

    by_attempt: dict[int, list[dict]] = defaultdict(list)
    for r in rows:
        by_attempt[int(r.get("attempt", 0))].append(r)
    attempts = sorted(set(by_attempt) | {int(f.get("attempt", 0)) for f in faults} | {0})
    fault_of = {int(f.get("attempt", 0)): f for f in faults}
    for a in attempts:
        rs = by_attempt.get(a, [])
        if rs:
            first = rs[0]["goodput_since"]
            add(cursor, first, {"startup" if a == 0 else "recovery": max(0.0, first - cursor)})
            for r in rs:
                add(r["goodput_since"], r["time"], dict(r["goodput"]))
        f = fault_of.get(a)
        if f is None:
            continue
        # the part of a step in flight is lost; an attempt that never logged a row was all
        # start-up
        cat = "lost" if rs else "startup" if a == 0 else "recovery"
        add(cursor, f["fault_at"], {cat: max(0.0, f["fault_at"] - cursor)})
        add(f["fault_at"], f["detected_at"],
            {"detection": max(0.0, f["detected_at"] - f["fault_at"])})
    # after the last row or fault the job was ending; a job that never logged a row nor met a
    # fault (stopped while its hosts gathered, its workers starting) was starting all along
    add(cursor, ended_at, {"shutdown" if rows or faults else "startup":
                           max(0.0, ended_at - cursor)})

    seconds = defaultdict(float)
    for _, _, seg in timeline:
        for k, v in seg.items():
            seconds[k] += v
    wall = ended_at - started_at
    out = {c: round(seconds.get(c, 0.0), 3) for c in CATEGORIES}
    return {
        "wall_s": round(wall, 3), "seconds": out,
        "accounted_s": round(sum(seconds.values()), 3),
        "ettr": round(seconds["productive"] / wall, 4) if wall > 0 else 0.0,
        "timeline": [{"t": round(t0 - started_at, 3), "dt": round(t1 - t0, 3),
                      "s": {k: round(v, 4) for k, v in seg.items() if v > 0}}
                     for t0, t1, seg in timeline],
    }


def process_spans(rows: list[dict], gap_s: float = 1.0) -> list[tuple[float, float]]:
    """(start, end) of each process that wrote `rows` (by time): a process's rows tile its wall
    time (each row's ledger covers the time since the one before), so a row that starts more
    than `gap_s` after the previous one ended, and books a start-up (a process's first row),
    was written by a later start of the run (`myria train` run again by hand, with no
    supervisor to account for the time between). A gap without one (a row lost or unreadable)
    stays in its process's span, as time nothing accounts for."""
    spans: list[list[float]] = []
    for r in rows:
        if not spans or (r["goodput_since"] > spans[-1][1] + gap_s
                         and r["goodput"].get("startup")):
            spans.append([r["goodput_since"], r["time"]])
        else:
            spans[-1][1] = max(spans[-1][1], r["time"])
    return [(a, b) for a, b in spans]


def combine(ledgers: list[dict[str, Any]]) -> dict[str, Any]:
    """One ledger of the supervised jobs that ran on one run directory (each job's `summarize`,
    in the order the jobs started): seconds summed by category, the wall time the jobs' own
    (between two jobs the run was queued or not running, which no job accounts for), ETTR over
    it, the timelines back to back, and where each job starts in them (`job_starts`)."""
    if len(ledgers) == 1:
        return dict(ledgers[0], jobs=1, job_starts=[0.0])
    seconds: dict[str, float] = defaultdict(float)
    timeline, starts, offset = [], [], 0.0
    for led in ledgers:
        for k, v in led["seconds"].items():
            seconds[k] += v
        starts.append(round(offset, 3))
        timeline += [dict(seg, t=round(seg["t"] + offset, 3)) for seg in led.get("timeline", [])]
        offset += led["wall_s"]
    return {"wall_s": round(offset, 3),
            "seconds": {c: round(seconds.get(c, 0.0), 3) for c in CATEGORIES},
            "accounted_s": round(sum(led["accounted_s"] for led in ledgers), 3),
            "ettr": round(seconds["productive"] / offset, 4) if offset > 0 else 0.0,
            "timeline": timeline, "jobs": len(ledgers), "job_starts": starts}
