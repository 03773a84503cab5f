"""Stragglers: ranks whose own compute is persistently slower than their peers'.

Reads the event timer's per-rank, per-step compute-only time (waits excluded, so the ranks that
wait for a straggler are never blamed: `myria.observe.analyze.step_table`). Steps after the
warm-up are cut into windows of `window` steps. In each window a rank's median compute time is
compared with the median of its peers doing the same work (the same pipeline stage):

    slowdown = rank median / peer median - 1
    z        = (rank median - peer median) / (1.4826 x MAD of the peers' medians, at least 3% of
               the peer median: with one or two peers the MAD says nothing)

A rank is a straggler when slowdown >= `threshold` and z >= 3 in `windows` consecutive windows:
detection within window x windows steps of the slowdown starting (10 with the defaults), and one
window of noise (a descheduled process on a busy host) is not enough. Without peers (one rank per
stage) it is compared with its own best window instead. The cost to the job is the rank's excess
compute per step: in synchronous training every step waits for the slowest rank.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from pathlib import Path

from myria.observe.analyze import Run, load_run, step_table


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

    def evidence(self) -> dict:
        return {"slowdown": round(self.slowdown, 4),
                "cost_s_per_step": round(self.cost_s_per_step, 6),
                "first_step": self.first_step, "coord": self.coord, "windows": self.windows}


def _peers_key(run: Run, r: int):
    return run.ranks[r].header.get("coord", {}).get("pp", 0)


def detect(run: Run, window: int = 5, threshold: float = 0.10, windows: int = 2,
           table: dict | None = None) -> list[Straggler]:
    """The stragglers of `run` (see the module docstring)."""
    table = table if table is not None else step_table(run)
    steps = sorted({s for rows in table.values() for s in rows})[1:]  # skip the warm-up
    groups: dict = {}
    for r in table:
        groups.setdefault(_peers_key(run, r), []).append(r)
    found = []
    for r in sorted(table):
        peers = [p for p in groups[_peers_key(run, r)] if p != r]
        streak: list[dict] = []
        best_self = None
        convicted = None
        for i in range(0, len(steps) - window + 1, window):
            w = steps[i:i + window]
            mine = [table[r][s]["compute_s"] for s in w if s in table[r]]
            if len(mine) < window:
                break
            med = statistics.median(mine)
            if peers:
                pm = [statistics.median(table[p][s]["compute_s"] for s in w if s in table[p])
                      for p in peers if all(s in table[p] for s in w)]
                if not pm:
                    break
                ref = statistics.median(pm)
                mad = statistics.median(abs(x - ref) for x in pm) * 1.4826
                z = (med - ref) / max(mad, 0.03 * ref, 1e-9)
            else:  # no peer does the same work: against its own best window
                best_self = med if best_self is None else min(best_self, med)
                ref, z = best_self, float("inf") if med > best_self else 0.0
            slow = med / ref - 1 if ref > 0 else 0.0
            row = {"steps": [w[0], w[-1]], "median_s": round(med, 6),
                   "peer_median_s": round(ref, 6), "slowdown": round(slow, 4),
                   "z": round(z, 2) if z != float("inf") else None}
            if slow >= threshold and z >= 3:
                streak.append(row)
                if len(streak) >= windows:
                    convicted = streak[-windows:]
                    break
            else:
                streak = []
        if convicted:
            slows = [c["slowdown"] for c in convicted]
            cost = statistics.median(c["median_s"] - c["peer_median_s"] for c in convicted)
            hdr = run.ranks[r].header
            found.append(Straggler(r, hdr.get("host", ""), hdr.get("coord", {}),
                                   convicted[0]["steps"][0], convicted[-1]["steps"][1],
                                   statistics.median(slows), cost, convicted))
    return found


def detect_dir(run_dir: str | Path, **kw) -> list[Straggler]:
    return detect(load_run(run_dir), **kw)


def default_window(steps: int) -> int:
    """Windows of 5 steps, shorter for short runs (at least three windows after warm-up)."""
    return max(2, min(5, (steps - 1) // 3))
