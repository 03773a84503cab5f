"""Stragglers: ranks whose own compute is persistently slower than their peers'.

Reads the event timer's per-rank, per-step compute-only time (`myria.observe.analyze.step_table`:
waits excluded, so the ranks that wait for a straggler are never blamed). Peers are the ranks
doing the same work (the data-parallel replicas of a rank, `_peers_key`); the score is paired by
step, so whatever slows every rank at once cancels:

    l[r, s]  = log(compute[r, s] / median of r's peers' compute[., s])
    sigma    = 1.4826 x MAD of the peers' own l over every step so far (at least 2%)
    m        = mean of l[r, .] over `window` measured steps after the warm-up step, each
               clipped to +-3 sigma of the window's median (outliers, not the shift itself)
    slowdown = exp(m) - 1;   z = m / (sigma / sqrt(n))

A rank is a straggler when slowdown >= `threshold` and z >= `z_min` in `windows` consecutive
windows; without peers (one rank per stage) it is compared with its own best window. Missing
steps (a restarted rank, a cut event file) shrink a window, never end the analysis. Its cost to
the job is its excess compute per step. Why these choices: docs/observability.md, "Stragglers".
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from myria.observe.analyze import Run, load_run, step_table

MIN_SIGMA = 0.02   # no host is quieter than 2% per step; keeps z finite on identical samples


@dataclass
class Straggler:
    rank: int
    host: str
    coord: dict
    first_step: int            # the first step of the windows that convicted it
    detected_step: int         # the last step of the window that completed the evidence
    slowdown: float            # median over the convicting windows
    cost_s_per_step: float     # its excess compute per step (what every step waits)
    windows: list[dict] = field(default_factory=list)

    rebalance: dict = field(default_factory=dict)

    def evidence(self) -> dict:
        return {"slowdown": round(self.slowdown, 4),
                "cost_s_per_step": round(self.cost_s_per_step, 6),
                "first_step": self.first_step, "coord": self.coord, "windows": self.windows,
                "rebalance": self.rebalance}


def rebalance(slowdown: float, microbatches: int, peers: int) -> dict:
    """Whether work could move from a slow data-parallel rank to its peers, and how much.

    With m microbatches per rank per step, moving k of them from the rank slowed by s to its P
    peers makes the step max((m - k)(1 + s), m + ceil(k / P)) instead of m (1 + s): the best k
    is searched. The mean gradient stays the same mathematically if every microbatch's loss is
    weighted by 1 / (all microbatches) instead of averaging per rank, but the sums run in another
    order: the numbers change in the last bits, so bitwise reproducibility is lost. myria keeps
    the layout and reports the option."""
    if microbatches < 2 or peers < 1:
        return {"possible": False, "why": "one microbatch per rank per step: nothing to move"}
    m, before = microbatches, microbatches * (1 + slowdown)
    cost, k = min((max((m - k) * (1 + slowdown), m + -(-k // peers)), k) for k in range(m))
    if k == 0:
        return {"possible": False, "why": f"moving one of its {m} microbatches would make a "
                "peer slower than it is"}
    return {"possible": True, "move_microbatches": k, "of": m,
            "step_saving_fraction": round(1 - cost / before, 3),
            "numbers": "same mean gradient with per-microbatch loss weighting, but not bit for "
                       "bit (another summation order); myria does not rebalance"}


def _peers_key(run: Run, r: int):
    """Peers: the data-parallel replicas of a rank (the same pipeline stage, tensor- and
    context-parallel index). Tensor- and context-parallel partners are not each other's peers:
    they wait for one another inside collectives the timer counts as compute, so a slow rank's
    partners look as slow as it, or slower."""
    c = run.ranks[r].header.get("coord", {})
    return c.get("pp", 0), c.get("tp", 0), c.get("cp", 0)


def _log_ratios(table: dict, group: list[int], steps: list[int]) -> dict[int, dict[int, float]]:
    """{rank: {step: log(its compute / its peers' median compute)}} within one peer group."""
    out: dict[int, dict[int, float]] = {r: {} for r in group}
    for s in steps:
        here = {r: table[r][s]["compute_s"] for r in group
                if s in table[r] and table[r][s]["compute_s"] > 0}
        for r, x in here.items():
            peers = [y for p, y in here.items() if p != r]
            if peers:
                out[r][s] = math.log(x / statistics.median(peers))
    return out


def _windows(steps: list[int], window: int):
    for i in range(0, len(steps) - window + 1, window):
        yield steps[i:i + window]


def detect(run: Run, window: int = 5, threshold: float = 0.10, windows: int = 2,
           table: dict | None = None, z_min: float = 2.5) -> list[Straggler]:
    """The stragglers of `run` (see the module docstring)."""
    table = table if table is not None else step_table(run)
    steps = sorted({s for rows in table.values() for s in rows})[1:]  # skip the warm-up
    groups: dict = {}
    for r in table:
        groups.setdefault(_peers_key(run, r), []).append(r)
    need = max(2, window // 2 + 1)   # samples a window needs to count
    found = []
    for group in groups.values():
        lr = _log_ratios(table, group, steps) if len(group) > 1 else {}
        for r in sorted(group):
            streak: list[dict] = []
            convicted = None
            best_self = None
            seen: list[int] = []
            for w in _windows(steps, window):
                seen += w
                if lr:
                    mine = [lr[r][s] for s in w if s in lr[r]]
                    if len(mine) < need:
                        streak = []
                        continue
                    noise = [v for p in group if p != r for s, v in lr[p].items() if s <= w[-1]]
                    med_noise = statistics.median(noise)
                    sigma = max(MIN_SIGMA,
                                1.4826 * statistics.median(abs(v - med_noise) for v in noise))
                    # outliers clipped around the window's own median, not around 0: a
                    # clip at 0 +- 3 sigma would cap the slowdown a quiet cluster can show
                    mid = statistics.median(mine)
                    m = statistics.fmean(max(mid - 3 * sigma, min(mid + 3 * sigma, v))
                                         for v in mine)
                    z = m / (sigma / math.sqrt(len(mine)))
                    slow = math.exp(m) - 1
                    own = statistics.median(table[r][s]["compute_s"] for s in w if s in table[r])
                    ref = own / (1 + slow)
                else:  # no peer does the same work: against its own best window
                    xs = [table[r][s]["compute_s"] for s in w if s in table[r]]
                    if len(xs) < need:
                        streak = []
                        continue
                    own = statistics.median(xs)
                    best_self = own if best_self is None else min(best_self, own)
                    ref, sigma = best_self, None
                    slow = own / ref - 1 if ref > 0 else 0.0
                    z = math.inf if slow > 0 else 0.0
                row = {"steps": [w[0], w[-1]], "median_s": round(own, 6),
                       "peer_median_s": round(ref, 6), "slowdown": round(slow, 4),
                       "z": round(z, 2) if math.isfinite(z) else None,
                       "sigma": round(sigma, 4) if sigma is not None else None}
                if slow >= threshold and z >= z_min:
                    streak.append(row)
                    if len(streak) >= windows:
                        convicted = streak[-windows:]
                        break
                else:
                    streak = []
            if convicted:
                hdr = run.ranks[r].header
                slow = statistics.median(c["slowdown"] for c in convicted)
                found.append(Straggler(
                    r, hdr.get("host", ""), hdr.get("coord", {}), convicted[0]["steps"][0],
                    convicted[-1]["steps"][1], slow,
                    statistics.median(c["median_s"] - c["peer_median_s"] for c in convicted),
                    convicted, rebalance(slow, int(hdr.get("microbatches") or 1),
                                         len(group) - 1)))
    return sorted(found, key=lambda s: s.rank)


def detect_dir(run_dir: str | Path, since: float | None = None, **kw) -> list[Straggler]:
    """The stragglers of a run directory, judged on the steps timed after wall time `since`
    (seconds; all of them when None): a supervisor judges only what its own workers did, not
    the steps of a run directory's earlier attempts under a supervisor that was killed."""
    run = load_run(run_dir)
    if since is not None:
        cut = since * 1e6   # event times are wall-aligned microseconds
        for re in run.ranks.values():
            re.events = [e for e in re.events if e["t0"] >= cut]
    return detect(run, **kw)


def default_window(steps: int) -> int:
    """Windows of 5 steps, shorter for short runs (at least three windows after warm-up)."""
    return max(2, min(5, (steps - 1) // 3))
