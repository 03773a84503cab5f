"""Read every rank's events and answer: where did each step's time go, who waited on whom.

    run = load_run(RUN_DIR)          # events per rank (a truncated or missing file is reported)
    table = step_table(run)          # per rank and step: compute-only, exposed comm by dim, ...
    blame = blame_report(run)        # per rank: compute, time others waited on it, time waited

Waiting is never compute, and never attributed to the rank that waited. A rank's *blame* is the
waiting it caused: how much less every other rank would block if it computed at the median
speed of its peers doing the same work (same pipeline stage), found by replaying the step over
its recorded dependencies (`StepReplay`: the collectives' last arrivals, the pipeline's sends),
so the waits its slowness sets off down a pipeline and across data-parallel groups are all its.
A rank *stands out* when its consistent excess (steps x the lower quartile of its deviations
from the median rank's blame) exceeds three standard errors of the pooled noise. Every
definition (compute-only, collective instance, pipeline receive, last arrival, noise, what-if):
docs/observability.md, "Who waited on whom".
"""

from __future__ import annotations

import json
import math
import statistics
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from myria import rundir

COMPUTE = ("forward", "backward", "backward_weight", "grad_clip", "optimizer", "loss_mean")
MODEL_COMPUTE = ("forward", "backward", "backward_weight")


@dataclass
class RankEvents:
    """One rank's events: `events` those the analyses read (each step as its newest attempt ran
    it), `redone` those of earlier attempts of steps that a later attempt ran again (lost work,
    drawn in the timeline only); `header` is the newest attempt's."""

    rank: int
    header: dict
    events: list[dict]
    truncated: bool = False
    redone: list[dict] = field(default_factory=list)


@dataclass
class Run:
    """The events of a run directory, by rank."""

    run_dir: Path
    ranks: dict[int, RankEvents]
    world: int
    missing: list[int] = field(default_factory=list)
    truncated: list[int] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    @property
    def steps(self) -> list[int]:
        s = {e["s"] for r in self.ranks.values() for e in r.events
             if e.get("n") == "step" and "t1" in e}
        return sorted(s)


def load_run(run_dir: str | Path) -> Run:
    """Every rank's events; a rank whose file is missing or cut off mid-write is noted, and
    whatever was written before the damage is kept.

    A rank's file holds one header per attempt it took part in (a restart or an in-job rejoin
    appends a new one), each followed by that attempt's events. A step a later attempt ran again
    is analysed as that attempt ran it: the earlier attempt's events of it go to `redone`, so
    that two runs of one step are never read as one (their collectives share sequence numbers,
    their spans would add up)."""
    run_dir = Path(run_dir)
    d = run_dir / rundir.EVENTS_DIR
    ranks: dict[int, RankEvents] = {}
    problems, truncated = [], []
    world = 0
    attempt_of: dict[int, list[int]] = {}       # rank -> the attempt of each of its events
    for f in sorted(d.glob("rank*.jsonl")) if d.is_dir() else []:
        try:
            r = int(f.stem[4:])
        except ValueError:
            continue
        header, evs, cut, atts, segment = {}, [], False, [], -1
        try:
            text = f.read_text(errors="replace")
        except OSError as e:
            problems.append(f"{f.name}: unreadable ({e.strerror})")
            continue
        for line in text.splitlines():
            try:
                obj = json.loads(line)
            except ValueError:
                cut = True  # a line cut by a crash: keep what came before
                continue
            if "header" in obj:
                header = obj["header"]
                world = max(world, int(header.get("world", 0)))
                # files written before headers carried the attempt: its place in the file. A
                # header is appended by a later start than the one before it, so its attempt
                # is later too: `myria train` run again by hand numbers its attempt 0 again
                segment = max(int(header.get("attempt", segment + 1)), segment + 1)
            elif "t0" in obj and "t1" in obj:
                evs.append(obj)
                atts.append(segment)
        if cut:
            truncated.append(r)
            problems.append(f"rank {r}: events file truncated (a line cut mid-write)")
        if not header:
            problems.append(f"rank {r}: events file has no header")
        ranks[r] = RankEvents(r, header, evs, cut)
        attempt_of[r] = atts
    _split_redone(ranks, attempt_of)
    world = max(world, max(ranks) + 1 if ranks else 0)
    missing = [r for r in range(world) if r not in ranks]
    for r in missing:
        problems.append(f"rank {r}: no events file (the rank was killed before writing, or "
                        "observe.enabled = false)")
    if not ranks and not problems:
        problems.append(no_events_reason(run_dir))
    return Run(run_dir, ranks, world, missing, truncated, problems)


def _split_redone(ranks: dict[int, RankEvents], attempt_of: dict[int, list[int]]) -> None:
    """Keep in `events` each step's events from the attempt whose timeline the run kept; move
    the rest to `redone`. An attempt that began at step s (it resumed there, or started afresh
    at 1) rewound every earlier attempt's steps from s on, whether it reached them or not (a
    fresh start in a used run directory, a rollback to an older checkpoint): of those, an
    earlier attempt's events are kept only where no later attempt began at or before them,
    and each step's from the newest attempt that finished it (or, for a step no attempt
    finished, the newest that began it)."""
    finished: dict[int, int] = {}
    began: dict[int, int] = {}
    first: dict[int, int] = {}      # attempt -> the first step it ran (its set-up is step 0)
    for r, re in ranks.items():
        for e, a in zip(re.events, attempt_of[r]):
            began[e["s"]] = max(began.get(e["s"], a), a)
            if e["s"] >= 1:
                first[a] = min(first.get(a, e["s"]), e["s"])
            if e["n"] == "step":
                finished[e["s"]] = max(finished.get(e["s"], a), a)
    if len(set(began.values()) | set(finished.values())) <= 1 and len(first) <= 1:
        return  # one attempt: nothing was redone

    def rewound(a: int, step: int) -> bool:
        return any(b > a and s0 <= step for b, s0 in first.items())

    for r, re in ranks.items():
        keep, redone = [], []
        for e, a in zip(re.events, attempt_of[r]):
            if a == finished.get(e["s"], began[e["s"]]) and not rewound(a, e["s"]):
                keep.append(e)
            else:
                redone.append(dict(e, attempt=a))
        re.events, re.redone = keep, redone


def no_events_reason(run_dir: Path) -> str:
    """One line on why a run has no events: turned off in its config, or the files are gone."""
    where = f"{run_dir / rundir.EVENTS_DIR}/"
    try:
        cfg = json.loads((run_dir / rundir.CONFIG).read_text())
        enabled = cfg.get("observe", {}).get("enabled", True)
    except (OSError, ValueError, AttributeError):
        enabled = True
    if enabled is False:
        return (f"no events: the run was trained with observe.enabled = false, so {where} was "
                "never written (no timeline, blame or measured breakdown)")
    return (f"no events: {where} is missing or empty (removed, or the run stopped before its "
            "first write); no timeline, blame or measured breakdown")


def _blocking(evs: list[dict]) -> list[dict]:
    """Spans in which a rank blocks on communication: synchronous collectives and waits."""
    return [e for e in evs if e["c"] == "wait" or
            (e["c"] == "comm" and not e.get("a", {}).get("async"))]


def _overlap(a0: int, a1: int, spans: list[tuple[int, int]]) -> int:
    return sum(max(0, min(a1, b1) - max(a0, b0)) for b0, b1 in spans)


def step_table(run: Run) -> dict[int, dict[int, dict]]:
    """{rank: {step: {step_s, compute_s, model_compute_s, comm_s: {dim: s}, wait_s, data_s,
    optimizer_s, ckpt_s, idle_s}}} from the events of each rank."""
    out: dict[int, dict[int, dict]] = {}
    for r, re in run.ranks.items():
        by_step: dict[int, list[dict]] = defaultdict(list)
        for e in re.events:
            by_step[e["s"]].append(e)
        rows = {}
        for s, evs in by_step.items():
            step = next((e for e in evs if e["n"] == "step"), None)
            if step is None:
                continue
            block = _blocking(evs)
            spans_by_th = defaultdict(list)
            for b in block:
                spans_by_th[b.get("th", 0)].append((b["t0"], b["t1"]))
            comp = model = opt = 0
            for e in evs:
                if e["c"] == "compute" and e["n"] in COMPUTE:
                    d = e["t1"] - e["t0"] - _overlap(e["t0"], e["t1"], spans_by_th[e.get("th", 0)])
                    comp += d
                    if e["n"] in MODEL_COMPUTE:
                        model += d
                    if e["n"] == "optimizer":
                        opt += d
            comm: dict[str, float] = defaultdict(float)
            for b in block:
                if b.get("th", 0) == 0:
                    dim = (b.get("a") or {}).get("dim") or ("pp" if (b.get("a") or {}).get("ops")
                                                            else "other")
                    comm[dim] += (b["t1"] - b["t0"]) / 1e6
            data = sum(e["t1"] - e["t0"] for e in evs if e["c"] == "data")
            ckpt = sum(e["t1"] - e["t0"] for e in evs if e["c"] == "ckpt" and e.get("th", 0) == 0)
            total = step["t1"] - step["t0"]
            accounted = comp + sum(comm.values()) * 1e6 + data + ckpt
            rows[s] = {"step_s": total / 1e6, "compute_s": comp / 1e6,
                       "model_compute_s": model / 1e6, "optimizer_s": opt / 1e6,
                       "comm_s": dict(comm), "data_s": data / 1e6, "ckpt_s": ckpt / 1e6,
                       "idle_s": max(0.0, (total - accounted) / 1e6)}
        out[r] = rows
    return out


@dataclass
class Instance:
    """One collective (or one pipeline transfer) across the ranks that took part."""

    name: str
    dim: str
    step: int
    arrival: dict[int, int]       # rank -> issue time (µs)
    blocked: dict[int, int]       # rank -> blocking time in it (µs)
    last: int = -1
    waited: dict[int, int] = field(default_factory=dict)


def instances(run: Run) -> list[Instance]:
    """Collective instances and pipeline transfers, matched across ranks."""
    coll: dict[tuple, dict] = defaultdict(lambda: {"arr": {}, "blk": {}, "name": "", "dim": "",
                                                   "step": 0})
    waits: dict[tuple, int] = {}
    sends: dict[tuple, int] = {}                      # (src, dst, seq) -> send issue time
    recv_at: dict[tuple, tuple] = {}            # (src, dst, seq) -> (receive issue time, step)
    recv_blocked: dict[tuple, int] = defaultdict(int)  # (src, dst, seq) -> blocked waiting
    recv_wait_at: dict[tuple, int] = {}               # (src, dst, seq) -> when waiting began
    for r, re in run.ranks.items():
        for e in re.events:
            a = e.get("a") or {}
            if e["c"] == "comm" and a.get("group"):
                key = (tuple(a["group"]), a["seq"])
                c = coll[key]
                c["arr"][r] = e["t0"]
                c["name"], c["dim"], c["step"] = e["n"], a.get("dim", ""), e["s"]
                if not a.get("async"):
                    c["blk"][r] = e["t1"] - e["t0"]
            elif e["c"] == "wait" and a.get("ops"):
                for op in a["ops"]:
                    if op["kind"] == "recv":
                        k = (op["peer"], r, op["seq"])
                        recv_blocked[k] += e["t1"] - e["t0"]
                        # the receiver starts waiting here (its receive may have been issued
                        # long before): the sender is late if it sends after this
                        recv_wait_at[k] = min(recv_wait_at.get(k, e["t0"]), e["t0"])
            elif e["c"] == "wait" and a.get("seq") is not None:
                waits[(r, tuple(a.get("group") or ()), a["seq"])] = e["t1"] - e["t0"]
            elif e["c"] == "p2p":
                for op in a.get("ops", []):
                    if op["kind"] == "send":
                        sends[(r, op["peer"], op["seq"])] = e["t0"]
                    else:
                        recv_at[(op["peer"], r, op["seq"])] = (e["t0"], e["s"])
    out = []
    for (group, seq), c in coll.items():
        for r in c["arr"]:
            if r not in c["blk"]:
                c["blk"][r] = waits.get((r, group, seq), 0)
        if set(c["arr"]) != set(group) or len(group) < 2:
            continue  # a rank's events are missing: the instance cannot be judged
        inst = Instance(c["name"], c["dim"], c["step"], c["arr"], c["blk"])
        inst.last = max(c["arr"], key=lambda r: (c["arr"][r], r))
        t_last = c["arr"][inst.last]
        for r, t in c["arr"].items():
            if r != inst.last:
                inst.waited[r] = max(0, min(c["blk"][r], t_last - t))
        out.append(inst)
    for (src, dst, seq), (t_recv, step) in recv_at.items():
        t_send = sends.get((src, dst, seq))
        if t_send is None:
            continue
        blocked = recv_blocked.get((src, dst, seq), 0)
        t_recv = recv_wait_at.get((src, dst, seq), t_recv)
        inst = Instance("p2p", _pair_dim(run, src, dst), step, {src: t_send, dst: t_recv},
                        {dst: blocked}, last=src)
        inst.waited[dst] = max(0, min(blocked, t_send - t_recv))
        out.append(inst)
    return out


class StepReplay:
    """One step of every rank replayed over its recorded dependencies, to ask "what if".

    Each rank's main thread is a sequence of markers in time order: collective issues (an
    asynchronous collective's arrival), sends, and blocking spans (a synchronous collective, a
    wait on an asynchronous one, a wait on receives), each with what it waits for. Between two
    markers the rank works. Replayed, a marker is reached when the rank's previous marker ends
    plus the work in between (its compute shortened by `speed` where asked); a blocking span
    ends when its last dependency has arrived (the group's last member, the sender's send) plus
    the transfer time it had (its recorded end minus when its last dependency arrived). With
    nothing changed the replay gives back each rank's recorded waits; with one rank's compute
    set to its peers' median speed, the others' waits that disappear are the waiting that rank
    caused. No library replays a trace of torch.distributed calls against its own dependencies
    (HTA and Perfetto analyse one timeline as it was), hence this one.
    """

    def __init__(self, events: dict[int, list[dict]]):
        """`events`: each rank's events of the step."""
        self.marks: dict[int, list[tuple]] = {}
        self.bounds: dict[int, tuple[int, int]] = {}
        self.compute: dict[int, list[tuple[int, int]]] = {}
        self.arrived: dict[tuple, dict[int, int]] = defaultdict(dict)  # recorded arrivals
        for r, evs in events.items():
            st = next((e for e in evs if e["n"] == "step"), None)
            if st is None:
                continue
            marks, spans = [], []
            for e in evs:
                a, main = e.get("a") or {}, e.get("th", 0) == 0
                if e["c"] == "compute" and e["n"] in COMPUTE and main:
                    spans.append((e["t0"], e["t1"]))
                elif e["c"] == "comm" and a.get("group"):
                    key = ("c", tuple(a["group"]), a["seq"])
                    if a.get("async"):
                        marks.append((e["t0"], e["t0"], "issue", (key,)))
                    elif main:
                        marks.append((e["t0"], e["t1"], "block", (key,)))
                    self.arrived[key].setdefault(r, e["t0"])
                elif e["c"] == "p2p":
                    for op in a.get("ops", []):
                        if op["kind"] == "send":
                            key = ("p", r, op["peer"], op["seq"])
                            marks.append((e["t0"], e["t0"], "issue", (key,)))
                            self.arrived[key][r] = e["t0"]
                elif e["c"] == "wait" and main:
                    if a.get("ops"):
                        deps = tuple(("p", op["peer"], r, op["seq"]) for op in a["ops"]
                                     if op["kind"] == "recv")
                    elif a.get("seq") is not None and a.get("group"):
                        deps = (("c", tuple(a["group"]), a["seq"]),)
                    else:
                        continue
                    marks.append((e["t0"], e["t1"], "block", deps))
            marks.sort(key=lambda m: (m[0], m[1]))
            self.marks[r], self.bounds[r], self.compute[r] = marks, (st["t0"], st["t1"]), spans

    def _work(self, r: int, a: int, b: int, speed: float) -> float:
        """The time rank r works between a and b, its compute run at `speed` x its own."""
        gap = max(0, b - a)
        if speed == 1.0 or gap == 0:
            return gap
        comp = sum(max(0, min(b, y) - max(a, x)) for x, y in self.compute[r])
        return gap - comp + comp * speed

    def run(self, speed: dict[int, float] | None = None) -> tuple[dict, dict]:
        """(each rank's step duration, each rank's blocked time), in µs, with each rank's
        compute scaled by `speed` (fraction of its recorded time)."""
        speed = speed or {}
        arrived: dict[tuple, dict[int, float]] = defaultdict(dict)
        done_o = {r: b[0] for r, b in self.bounds.items()}      # recorded time reached
        done_n = {r: float(b[0]) for r, b in self.bounds.items()}  # replayed time reached
        idx = {r: 0 for r in self.marks}
        blocked: dict[int, float] = defaultdict(float)
        moved = True
        while moved:  # each pass advances every rank as far as its dependencies allow
            moved = False
            for r, marks in self.marks.items():
                f = speed.get(r, 1.0)
                while idx[r] < len(marks):
                    t0, t1, kind, deps = marks[idx[r]]
                    reach = done_n[r] + self._work(r, done_o[r], t0, f)
                    if kind == "issue":
                        arrived[deps[0]][r] = reach
                        done_o[r], done_n[r] = max(done_o[r], t0), reach
                        idx[r] += 1
                        moved = True
                        continue
                    for d in deps:  # a synchronous collective arrives where it blocks
                        if d[0] == "c" and self.arrived[d].get(r) == t0:
                            arrived[d].setdefault(r, reach)
                    ready_n, ready_o, ok = reach, t0, True
                    for d in deps:
                        want = set(d[1]) if d[0] == "c" else {d[1]}
                        want &= set(self.arrived[d]) | set(self.marks)  # members with events
                        if not want <= set(arrived[d]):
                            ok = False
                            break
                        ready_n = max([ready_n, *(arrived[d][q] for q in want)])
                        ready_o = max([ready_o, *(self.arrived[d].get(q, t0) for q in want)])
                    if not ok:
                        break
                    end = ready_n + max(0, t1 - max(t0, ready_o))
                    blocked[r] += end - reach
                    done_o[r], done_n[r] = max(done_o[r], t1), end
                    idx[r] += 1
                    moved = True
        dur = {}
        for r, (s0, s1) in self.bounds.items():
            if idx[r] < len(self.marks[r]):
                continue  # a dependency never arrived (a rank's events are missing)
            dur[r] = done_n[r] + self._work(r, done_o[r], s1, speed.get(r, 1.0)) - s0
        return dur, blocked


def counterfactual_blame(run: Run, table: dict, steps: list[int], candidates: int = 8
                         ) -> tuple[dict[int, dict[int, float]], dict[int, float]]:
    """Per step, the waiting each rank caused: how much less the other ranks would block if it
    computed at the median speed of its peers doing the same work (same pipeline stage), by
    StepReplay; and per step, how much shorter the step would be. Only ranks slower than those
    peers cause waiting; the `candidates` ranks with the most compute beyond their peers over
    the run are replayed (each replay costs one pass over every rank's markers)."""
    stage = {r: run.ranks[r].header.get("coord", {}).get("pp") for r in run.ranks}
    same: dict = defaultdict(list)
    for q in table:
        same[stage.get(q)].append(q)

    def peer_median(r: int, s: int) -> float | None:
        peers = [table[q][s]["compute_s"] for q in same[stage.get(r)] if q != r and s in table[q]]
        return statistics.median(peers) if peers else None

    by_step: dict[int, dict[int, list[dict]]] = defaultdict(lambda: defaultdict(list))
    for r, re in run.ranks.items():  # each rank's events by step, once
        for e in re.events:
            by_step[e["s"]][r].append(e)

    excess: dict[int, float] = defaultdict(float)
    for r in table:
        for s in steps:
            med = peer_median(r, s) if s in table[r] else None
            if med is not None:
                excess[r] += max(0.0, table[r][s]["compute_s"] - med)
    picked = [r for r in sorted(excess, key=excess.get, reverse=True)[:candidates]
              if excess[r] > 0]
    caused: dict[int, dict[int, float]] = {s: {} for s in steps}
    shorter: dict[int, dict[int, float]] = {s: {} for s in steps}
    for s in steps:
        rp = StepReplay(by_step[s])
        base_dur, base_blk = rp.run()
        for r in picked:
            med = peer_median(r, s) if s in table[r] else None
            own = table[r][s]["compute_s"] if s in table[r] else 0.0
            if med is None or own <= med or r not in base_dur:
                continue
            dur, blk = rp.run({r: med / own})
            caused[s][r] = max(0.0, sum(base_blk[q] - blk.get(q, base_blk[q])
                                        for q in base_blk if q != r) / 1e6)
            if dur:
                shorter[s][r] = max(0.0, (max(base_dur.values()) - max(dur.values())) / 1e6)
    return caused, shorter


def _pair_dim(run: Run, src: int, dst: int) -> str:
    """The mesh dimension of a transfer: the smallest of the receiver's groups holding both
    ranks (pipeline neighbours: pp; ring attention's: cp)."""
    groups = (run.ranks[dst].header.get("groups") or {}).items()
    fits = [(len(g), d) for d, g in groups if src in g and dst in g]
    return min(fits)[1] if fits else "pp"


def blame_report(run: Run, table: dict | None = None) -> dict:
    """The blame.json object: per rank compute, blamed and waited seconds; the most blamed
    rank; the noise; per-step critical path and what-if."""
    table = table if table is not None else step_table(run)
    steps = sorted({s for rows in table.values() for s in rows})
    warmup = steps[0] if len(steps) > 1 else None  # the first step (allocation, warm-up)
    steps = [s for s in steps if s != warmup]
    blamed: dict[int, float] = defaultdict(float)
    direct: dict[int, float] = defaultdict(float)
    waited: dict[int, float] = defaultdict(float)
    insts = [i for i in instances(run) if i.step in steps]
    # each rank's blocked intervals and whom it waited for, to chase lateness to its root
    blocked: dict[int, list[tuple[int, int, int]]] = defaultdict(list)
    for inst in insts:
        for r, w in inst.waited.items():
            if w > 0:
                t = inst.arrival[inst.last]
                blocked[r].append((t - w, t, inst.last))
    for r in blocked:
        blocked[r].sort()
    step_t0 = {(r, e["s"]): e["t0"] for r, re in run.ranks.items() for e in re.events
               if e["n"] == "step"}
    for inst in insts:
        t_last = inst.arrival[inst.last]
        for r, w in inst.waited.items():
            waited[r] += w / 1e6
            if inst.name == "p2p":
                shares = _root(blocked, inst.last, t_last - w, t_last, w, {r})
            else:
                shares = _delay_root(blocked, step_t0, inst, r, w)
            for culprit, amount in shares.items():
                direct[culprit] += amount / 1e6
    per_step_blame, shorter = counterfactual_blame(run, table, steps)
    for s in steps:
        for r, v in per_step_blame[s].items():
            blamed[r] += v
    ranks = sorted(run.ranks)
    rows = []
    for r in ranks:
        hdr = run.ranks[r].header
        comp = sum(row["compute_s"] for s, row in table.get(r, {}).items() if s != warmup)
        rows.append({"rank": r, "coord": hdr.get("coord", {}), "host": hdr.get("host", ""),
                     "compute_s": comp, "blamed_s": blamed.get(r, 0.0),
                     "last_arrival_s": direct.get(r, 0.0), "waited_s": waited.get(r, 0.0)})
    # noise: each rank's per-step blame minus the median rank's, pooled (module docstring)
    dev: dict[int, list[float]] = {r: [] for r in ranks}
    for s in steps:
        vals = [per_step_blame[s].get(r, 0.0) for r in ranks]
        med = statistics.median(vals) if vals else 0.0
        for r, v in zip(ranks, vals):
            dev[r].append(v - med)
    n = len(steps)
    pooled = [x for r in ranks for x in dev[r]]
    if len(ranks) == 2:
        # the median of two ranks is their mean: each deviation is half their difference, so
        # pooled deviations measure the difference itself, never the noise; each rank's
        # spread around its own median deviation is the noise of its per-step blame
        pooled = [x - statistics.median(dev[r]) for r in ranks if dev[r] for x in dev[r]]
    noise = 0.0
    if len(ranks) > 1 and pooled:
        mid = statistics.median(pooled)
        sigma = 1.4826 * statistics.median(abs(x - mid) for x in pooled)
        noise = 3 * 1.36 * math.sqrt(n) * sigma
    excess = {r: n * _lower_quartile(dev[r]) if dev[r] else 0.0 for r in ranks}
    most = max(rows, key=lambda x: (x["blamed_s"], -x["rank"]))["rank"] if rows else None
    standout = [r for r in ranks if excess[r] > noise and excess[r] > 0]
    # per step: its time (the longest rank's), the rank it waited on most (the largest blame;
    # None when no rank held it up: in lockstep every rank's step ends together, so the
    # longest step is the rank that started first, not the one that set the pace) and the
    # what-if of the most blamed rank
    per_step = []
    for s in steps:
        have = {r: table[r][s] for r in ranks if s in table.get(r, {})}
        if not have:
            continue
        t = max(x["step_s"] for x in have.values())
        held = {r: v for r, v in per_step_blame[s].items() if v > 0}
        crit = max(held, key=lambda r: (held[r], -r)) if held else None
        whatif = max(0.0, t - shorter[s].get(most, 0.0))
        per_step.append({"step": s, "step_s": t, "critical_rank": crit,
                         "blame": {str(r): v for r, v in per_step_blame[s].items()},
                         "whatif_s": whatif})
    return {"ranks": rows, "most_blamed_rank": most, "steps": len(steps),
            "warmup_step_excluded": warmup,
            "noise_s": noise, "excess_blame_s": {str(r): excess[r] for r in ranks},
            "standout_ranks": standout, "per_step": per_step,
            "whatif_saving_s": sum(p["step_s"] - p["whatif_s"] for p in per_step),
            "missing_ranks": run.missing, "truncated_ranks": run.truncated,
            "problems": run.problems}


def _lower_quartile(xs: list[float]) -> float:
    """The 25th percentile (linear interpolation): exceeded in three steps of four."""
    return statistics.quantiles(xs, n=4, method="inclusive")[0] if len(xs) > 1 else xs[0]


def _root(blocked: dict, rank: int, t0: int, t1: int, amount: int, seen: set,
          depth: int = 4) -> dict[int, int]:
    """Who `amount` µs of waiting for `rank` during [t0, t1] is due to: the part of that window
    in which `rank` was itself blocked waiting for another rank goes to that rank (recursively:
    in a pipeline the next stage waits for the slow stage, and its data-parallel peers wait for
    the next stage), the rest to `rank`."""
    out: dict[int, int] = defaultdict(int)
    if depth == 0 or rank in seen or t1 <= t0 or amount <= 0:
        out[rank] += amount
        return out
    left = amount
    for b0, b1, culprit in blocked.get(rank, ()):
        if b1 <= t0:
            continue
        if b0 >= t1:
            break
        ov = min(t1, b1) - max(t0, b0)
        if ov <= 0 or culprit == rank:
            continue
        part = min(left, ov)
        for c, a in _root(blocked, culprit, max(t0, b0), min(t1, b1), part, seen | {rank},
                          depth - 1).items():
            out[c] += a
        left -= part
        if left <= 0:
            break
    if left > 0:
        out[rank] += left
    return out


def _blocked_in(blocked: dict, rank: int, t0: int, t1: int) -> list[tuple[int, int, int]]:
    """`rank`'s blocked intervals clipped to [t0, t1], with whom it waited for."""
    out = []
    for b0, b1, culprit in blocked.get(rank, ()):
        lo, hi = max(t0, b0), min(t1, b1)
        if hi > lo and culprit != rank:
            out.append((lo, hi, culprit))
    return out


def _delay_root(blocked: dict, step_t0: dict, inst: Instance, waiter: int,
                w: int) -> dict[int, int]:
    """Who `waiter`'s `w` µs of waiting for the last arrival `last` of a collective is due to.

    Both began the step and arrived at the collective (members of a group do the same work),
    `last` w later: its delay is its extra compute plus its extra blocked time since the step
    began. The blocked time `last` spent beyond the waiter's (in a pipeline: waiting for a slow
    stage's sends that the waiter did not wait for) goes to whom `last` was blocked on, in
    proportion and onward (`_root`); only the rest is `last`'s own."""
    last = inst.last
    s_last, s_w = step_t0.get((last, inst.step)), step_t0.get((waiter, inst.step))
    t_last, t_w = inst.arrival[last], inst.arrival[waiter]
    if s_last is None or s_w is None:
        return _root(blocked, last, t_last - w, t_last, w, {waiter})
    mine = _blocked_in(blocked, last, s_last, t_last)
    b_last = sum(b1 - b0 for b0, b1, _ in mine)
    b_w = sum(b1 - b0 for b0, b1, _ in _blocked_in(blocked, waiter, s_w, t_w))
    excess = min(w, max(0, b_last - b_w))
    out: dict[int, int] = defaultdict(int)
    if excess > 0:
        for b0, b1, culprit in mine:
            part = excess * (b1 - b0) // b_last
            for c, a in _root(blocked, culprit, b0, b1, part, {last, waiter}, 3).items():
                out[c] += a
    out[last] += w - sum(out.values())
    return out


def compute_matrix(run: Run, table: dict | None = None) -> tuple[list[int], list[int], list]:
    """(ranks, steps, rows of compute-only seconds): the heat map's data. Stragglers read this
    (myria.resilience detectors score each rank against peers of the same stage)."""
    table = table if table is not None else step_table(run)
    ranks = sorted(table)
    steps = sorted({s for rows in table.values() for s in rows})
    return ranks, steps, [[table[r].get(s, {}).get("compute_s", float("nan")) for s in steps]
                          for r in ranks]
