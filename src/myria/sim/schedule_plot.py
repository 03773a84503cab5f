"""Pipeline schedules as timelines: simulate GPipe, 1F1B, interleaved 1F1B, ZB-H1; draw a PNG.

Each stage runs its operations in the order its schedule prescribes (Megatron-LM's orders for
1F1B and interleaved 1F1B; Narayanan et al. 2021, section 2.2); an operation starts when its
stage is free and its input is ready (the previous virtual stage's forward, the next one's
backward). For zero-bubble ZB-H1 (Qi et al. 2023) the backward is split into B (input gradient)
and W (weight gradient); W has no consumer, so a stage runs a pending W whenever its next F or B
would otherwise wait. The simulated bubble is compared with the closed form the step model uses.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from myria.errors import ConfigError

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zero-bubble")


@dataclass
class Slot:
    """One operation on the timeline."""

    stage: int
    kind: str      # F | B | W
    micro: int
    chunk: int
    start: float
    end: float


def _orders(schedule: str, p: int, v: int, m: int) -> list[list[tuple[str, int, int]]]:
    """Per stage, the ordered (kind, microbatch, chunk) operations (W excluded)."""
    def fwd_unit(k):  # Megatron's interleaved order: groups of p microbatches per chunk
        grp, r = divmod(k, p * v)
        return grp * p + r % p, r // p

    def bwd_unit(k):
        mb, c = fwd_unit(k)
        return mb, v - 1 - c

    orders = []
    for r in range(p):
        seq: list[tuple[str, int, int]] = []
        if schedule == "gpipe":
            seq = [("F", i, 0) for i in range(m)] + [("B", i, 0) for i in range(m)]
        else:
            total = m * v
            if v > 1:
                warm = min((p - r - 1) * 2 + (v - 1) * p, total)
            else:
                warm = min(p - r - 1, total)
            f = b = 0
            for _ in range(warm):
                seq.append(("F", *fwd_unit(f)))
                f += 1
            while f < total:
                seq.append(("F", *fwd_unit(f)))
                f += 1
                seq.append(("B", *bwd_unit(b)))
                b += 1
            while b < total:
                seq.append(("B", *bwd_unit(b)))
                b += 1
        orders.append(seq)
    return orders


def simulate_schedule(schedule: str, p: int, v: int = 1, m: int = 8,
                      t_f: float | Sequence[float] = 1.0, t_b: float | Sequence[float] = 2.0,
                      t_w: float = 0.0) -> list[Slot]:
    """Timeline of one iteration. t_f, t_b are per stage (all chunks), one figure for every
    stage or one per stage (unequal stages); for zero-bubble t_b is the input-gradient part and
    t_w the weight-gradient part (default: t_b split in halves)."""
    if schedule not in SCHEDULES:
        raise ConfigError(f"schedule {schedule!r} cannot be drawn; choose one of "
                          f"{', '.join(SCHEDULES)}")
    if p < 1 or v < 1 or m < 1:
        raise ConfigError("pipeline stages, chunks and microbatches must be >= 1")
    if v > 1 and schedule not in ("interleaved-1f1b", "zero-bubble"):
        raise ConfigError(f"vpp = {v} needs schedule interleaved-1f1b or zero-bubble (its "
                          f"interleaved form), not {schedule!r}")
    if v > 1 and m % p:
        raise ConfigError(f"the interleaved schedule needs microbatches ({m}) to be a multiple "
                          f"of pipeline stages ({p}) (as Megatron-LM requires)")
    zb = schedule == "zero-bubble"
    f_s = [float(t_f)] * p if isinstance(t_f, (int, float)) else [float(x) for x in t_f]
    b_s = [float(t_b)] * p if isinstance(t_b, (int, float)) else [float(x) for x in t_b]
    if len(f_s) != p or len(b_s) != p:
        raise ConfigError(f"per-stage times need {p} figures, got {len(f_s)} and {len(b_s)}")
    if zb and not t_w:
        if len(set(b_s)) > 1:
            raise ConfigError("zero-bubble with unequal stages needs t_w")
        b_s, t_w = [b / 2 for b in b_s], b_s[0] / 2
    df, db, dw = [x / v for x in f_s], [x / v for x in b_s], t_w / v
    orders = _orders(schedule, p, v, m)
    done: dict[tuple[str, int, int], float] = {}   # (kind, micro, virtual stage) -> end
    free = [0.0] * p
    pos = [0] * p
    pending_w: list[list[tuple[int, int]]] = [[] for _ in range(p)]
    slots: list[Slot] = []
    n_vs = p * v

    def ready(r, kind, mb, c):
        vs = c * p + r
        if kind == "F":
            return 0.0 if vs == 0 else done.get(("F", mb, vs - 1))
        # B needs this stage's forward and the next virtual stage's backward
        f = done.get(("F", mb, vs))
        if f is None:
            return None
        if vs == n_vs - 1:
            return f
        nb = done.get(("B", mb, vs + 1))
        return None if nb is None else max(f, nb)

    def run(r, kind, mb, c, start, dur):
        end = start + dur
        slots.append(Slot(r, kind, mb, c, start, end))
        done[(kind, mb, c * p + r)] = end
        free[r] = end

    remaining = sum(len(o) for o in orders)
    while remaining or any(pending_w):
        progress = False
        for r in range(p):
            if pos[r] < len(orders[r]):
                kind, mb, c = orders[r][pos[r]]
                t = ready(r, kind, mb, c)
                if t is None:
                    continue
                start = max(free[r], t)
                if zb and pending_w[r] and start - free[r] >= dw - 1e-9:
                    wm, wc = pending_w[r].pop(0)
                    run(r, "W", wm, wc, free[r], dw)
                else:
                    run(r, kind, mb, c, start, df[r] if kind == "F" else db[r])
                    pos[r] += 1
                    remaining -= 1
                    if zb and kind == "B":
                        pending_w[r].append((mb, c))
                progress = True
            elif pending_w[r]:
                wm, wc = pending_w[r].pop(0)
                run(r, "W", wm, wc, free[r], dw)
                progress = True
        if not progress:
            raise RuntimeError("pipeline schedule deadlocked (internal error)")
    return slots


def bubble_fraction(slots: list[Slot], p: int) -> float:
    """Idle share of the stages over the iteration: 1 - busy / (p * makespan)."""
    span = max(s.end for s in slots) - min(s.start for s in slots)
    busy = sum(s.end - s.start for s in slots)
    return 1.0 - busy / (p * span)


def formula_bubble(schedule: str, p: int, v: int, m: int, t_f: float = 1.0,
                   t_b: float = 2.0) -> float:
    """Closed-form idle share, as the step model uses it: b / (m + b) with b the bubble in
    units of one microbatch's stage time ((p-1)/v for 1F1B-family, (p-1)(F+B-2W)/((F+B) v)
    ZB-H1, interleaved over v chunks)."""
    if schedule == "zero-bubble":
        w = t_b / 2
        b = (p - 1) * max(0.0, t_f + t_b - 2 * w) / (t_f + t_b) / v
    else:
        b = (p - 1) / v
    return b / (m + b)


def draw(slots: list[Slot], p: int, v: int, m: int, schedule: str, path: str,
         title: str = "") -> float:
    """Draw the timeline to a PNG at `path`; returns the simulated bubble fraction."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    frac = bubble_fraction(slots, p)
    span = max(s.end for s in slots)
    width = min(22.0, max(8.0, 0.18 * len(slots) / max(1, p) + 4))
    fig, ax = plt.subplots(figsize=(width, 1.0 + 0.55 * p), dpi=110)
    colors = {"F": ("#4C72B0", "#8FB0DB"), "B": ("#DD8452", "#F2BE9C"),
              "W": ("#55A868", "#9FD3AE")}
    for s in slots:
        face = colors[s.kind][s.chunk % 2]
        ax.barh(s.stage, s.end - s.start, left=s.start, height=0.8, color=face,
                edgecolor="black", linewidth=0.4)
        if (s.end - s.start) / span * width * 110 > 14:
            ax.text((s.start + s.end) / 2, s.stage, str(s.micro + 1), ha="center",
                    va="center", fontsize=7, color="white" if s.chunk % 2 == 0 else "black")
    ax.set_yticks(range(p))
    ax.set_yticklabels([f"stage {i}" for i in range(p)])
    ax.invert_yaxis()
    ax.set_xlim(0, span)
    ax.set_xlabel("time (units of one microbatch's forward on a stage)")
    expected = formula_bubble(schedule, p, v, m)
    ax.set_title(title or f"{schedule}: p={p}, vpp={v}, m={m} - bubble {frac:.1%} of stage "
                 f"time (closed form {expected:.1%})", fontsize=10)
    handles = [Patch(color=colors["F"][0], label="forward"),
               Patch(color=colors["B"][0], label="backward" if schedule != "zero-bubble"
                     else "backward (input grad)")]
    if schedule == "zero-bubble":
        handles.append(Patch(color=colors["W"][0], label="weight grad"))
    if v > 1:
        handles.append(Patch(color=colors["F"][1], label="chunk 2+ (lighter)"))
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.25 - 0.05 / p),
              ncol=len(handles), fontsize=8, frameon=False)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return frac
