"""Pipeline bubble benchmark: each rank's measured idle time per step vs the (p-1)/(v m) theory.

Runs torch.distributed.pipelining with p gloo processes on this host (127.0.0.1 only) for
p in {2, 4}, vpp in {1, 2} and m in {4, 8} microbatches: 1F1B for vpp = 1, interleaved 1F1B for
vpp = 2 (the schedules myria's `pipeline.build_schedule` builds), and with `--extra` also GPipe,
interleaved zero-bubble and ZBV rows.

Controlled cost (default). Two cores are shared by p = 4 processes and by other users, so real
compute would measure CPU contention, not the schedule. Each stage's work is therefore a tiny
real op plus a sleep inside custom autograd Functions: forward sleeps t_f / vpp per microbatch
per chunk and backward 2 t_f / vpp (split into an input-gradient and a weight-gradient half, so
the zero-bubble schedules can separate them), i.e. the 1:2 forward/backward ratio of a
transformer and the same total work per rank for every vpp. Busy time is recorded inside the
Functions; the step window runs from the (untimed) barrier before `schedule.step` to the last
rank's return, on the host-wide monotonic clock. After warm-up steps, per rank:

    idle fraction  = 1 - busy / step                      theory (p-1) / (v m + p-1)
    bubble ratio   = (step - busy) / busy                 theory (p-1) / (v m)

The second is Narayanan et al.'s bubble ratio (bubble time over ideal compute time), the
quantity of the issue's "(p-1)/(vpp m)"; the first is the same bubble as a share of the step
(`myria.parallel.pipeline.bubble_fraction` gives both; zero-bubble schedules a third of it).
Each is the median over the measured steps, then the mean over ranks. A third reference replays
torch's own per-rank action order for the schedule with the same costs and zero latency
("torch order"): it is the theory with the schedule's real warm-up/cool-down shape.
"excess" = measured step - that replay's step (at the measured busy time), split into
"durations" (the same replay with each action's measured duration, minus the uniform replay:
uneven or overshooting sleeps) and "latency" (measured step minus the measured-duration
replay: send/receive, Python and wake-up latency on the critical path). The median forward and
backward hop (a stage's output to the next stage starting on it, while that rank waited) is
printed beside it.

`--real` afterwards runs tiny transformer stages from `myria.parallel.pipeline.build_stages`
(8 layers split over 2 x vpp stages) for p = 2 with real compute (busy = time inside each
stage's forward and backward); reported separately, since stage costs then are unequal (the
last stage holds the head) and the two ranks compete for the CPU with each other and others.

Usage:  .venv/bin/python bench/pipeline_bubble.py [--extra] [--real] [--json PATH]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
HIDDEN = 16          # width of the activations passed between stages (tiny: latency, not bandwidth)
MICRO = 2            # rows per microbatch

# -- the controlled-cost stage ---------------------------------------------------------------
_BUSY: list[tuple] = []   # (start, end, kind, stage, n-th of its kind on that stage) per step
_SEQ: dict[tuple[int, str], int] = {}


def _work(seconds: float, kind: str, stage: int) -> None:
    t0 = time.perf_counter()
    time.sleep(seconds)
    seq = _SEQ.get((stage, kind), 0)
    _SEQ[(stage, kind)] = seq + 1
    _BUSY.append((t0, time.perf_counter(), kind, stage, seq))


class _InputPath(torch.autograd.Function):
    """Forward costs t_f; its backward (the input-gradient half, B) costs t_b / 2."""

    @staticmethod
    def forward(ctx, x, t_f, t_bi, stage):
        ctx.t_bi, ctx.stage = t_bi, stage
        _work(t_f, "F", stage)
        return x * 1.0

    @staticmethod
    def backward(ctx, g):
        _work(ctx.t_bi, "B", ctx.stage)
        return g * 1.0, None, None, None


class _WeightPath(torch.autograd.Function):
    """Free forward; its backward (the weight-gradient half, W) costs t_b / 2."""

    @staticmethod
    def forward(ctx, w, t_bw, stage):
        ctx.t_bw, ctx.stage = t_bw, stage
        return w * 1.0

    @staticmethod
    def backward(ctx, g):
        _work(ctx.t_bw, "W", ctx.stage)
        return g * 1.0, None, None


class SleepStage(nn.Module):
    """y = InputPath(x * a) * WeightPath(w): forward t_f, backward 2 t_f whatever the stage.

    `a` makes the input path need a gradient even on the first stage (whose input does not),
    so every stage does the same backward work.
    """

    def __init__(self, t_f: float, stage: int):
        super().__init__()
        self.t_f, self.stage = t_f, stage
        self.a = nn.Parameter(torch.ones(HIDDEN))
        self.w = nn.Parameter(torch.ones(HIDDEN))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (_InputPath.apply(x * self.a, self.t_f, self.t_f, self.stage)
                * _WeightPath.apply(self.w, self.t_f, self.stage))


def _mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (out.float() - target.float()).pow(2).mean()


def _timed(fn, kind: str, stage: int):
    """Wrap a stage method so its duration counts as busy time (real-compute mode)."""
    def run(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            seq = _SEQ.get((stage, kind), 0)
            _SEQ[(stage, kind)] = seq + 1
            _BUSY.append((t0, time.perf_counter(), kind, stage, seq))
    return run


# -- theory ----------------------------------------------------------------------------------
def theory(p: int, v: int, m: int, schedule: str) -> tuple[float, float]:
    """(bubble ratio, idle fraction of the step), closed form, from pipeline.bubble_fraction.

    GPipe / 1F1B / interleaved 1F1B: ratio (p-1)/(v m), fraction (p-1)/(v m + p-1);
    zero-bubble and ZBV (W = B/2 fills the bubble): a third of that.
    """
    from myria.parallel.pipeline import bubble_fraction

    return (bubble_fraction(p, v, m, schedule, relative_to="compute"),
            bubble_fraction(p, v, m, schedule))


def schedule_orders(p: int, v: int, m: int, schedule: str) -> list[list[tuple[int, str, int]]]:
    """Each rank's compute actions (stage, F/B/I/W, microbatch) in the order torch runs them."""
    if schedule == "gpipe":
        return [[(r, "F", i) for i in range(m)] + [(r, "B", i) for i in range(m)]
                for r in range(p)]
    if schedule == "1f1b":   # Schedule1F1B: p-1-r warm-up forwards, then 1F1B, then cool-down
        out = []
        for r in range(p):
            warm = min(m, p - 1 - r)
            ops = [(r, "F", i) for i in range(warm)]
            for i in range(m - warm):
                ops += [(r, "F", warm + i), (r, "B", i)]
            out.append(ops + [(r, "B", i) for i in range(m - warm, m)])
        return out
    from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops

    from myria.parallel.pipeline import SCHEDULES

    acts = get_schedule_ops(SCHEDULES[schedule], p, m, v)
    return [[(a.stage_index, a.computation_type.value, a.microbatch_index) for a in rank
             if a is not None and a.computation_type.value in ("F", "B", "I", "W")]
            for rank in acts]


def replay(p: int, v: int, m: int, schedule: str, cost) -> float:
    """Makespan of torch's own action order for the schedule with zero latency.

    Replays `schedule_orders` with `cost(stage, kind, microbatch)` per action: an action starts
    when its rank is free and its inputs exist (F after the previous stage's F, B/I after this
    stage's F and the next stage's B/I, W after I).
    """
    n_stages = p * v
    orders = schedule_orders(p, v, m, schedule)
    done: dict[tuple[int, str, int], float] = {}
    ptr, free = [0] * p, [0.0] * p
    while any(ptr[r] < len(orders[r]) for r in range(p)):
        moved = False
        for r in range(p):
            while ptr[r] < len(orders[r]):
                s, k, i = orders[r][ptr[r]]
                if k == "F":
                    deps = [(s - 1, "F", i)] if s else []
                elif k == "W":
                    deps = [(s, "I", i)]
                else:
                    deps = [(s, "F", i)]
                    if s < n_stages - 1:
                        nxt = [d for d in ((s + 1, "B", i), (s + 1, "I", i)) if d in done]
                        if not nxt:
                            break
                        deps += nxt
                if not all(d in done for d in deps):
                    break
                start = max([free[r]] + [done[d] for d in deps])
                free[r] = done[(s, k, i)] = start + cost(s, k, i)
                ptr[r] += 1
                moved = True
        if not moved:
            raise RuntimeError(f"{schedule} p={p} v={v} m={m}: replay deadlocked")
    return max(free)


def schedule_exact(p: int, v: int, m: int, schedule: str) -> tuple[float, float]:
    """(bubble ratio, idle fraction) of the replay with this benchmark's uniform costs.

    Per chunk F = I = W = 1/v and a full B = 2/v: the theory with the schedule's real warm-up
    and cool-down shapes.
    """
    cost = {"F": 1 / v, "I": 1 / v, "W": 1 / v, "B": 2 / v}
    span, busy = replay(p, v, m, schedule, lambda s, k, i: cost[k]), 3.0 * m
    return (span - busy) / busy, 1 - busy / span


def replay_measured(raw: dict, step: int) -> float:
    """Replay makespan (s) of one measured step with each action's measured duration."""
    dur: dict[tuple[int, str, int], float] = {}
    for r in raw["per_rank_steps"]:
        for b, e, kind, stage, seq in r[step]["busy"]:
            dur[(stage, kind, seq)] = dur.get((stage, kind, seq), 0.0) + e - b

    def cost(s: int, k: str, i: int) -> float:
        if k == "B":    # a full backward: both halves
            return dur.get((s, "B", i), 0.0) + dur.get((s, "W", i), 0.0)
        return dur.get((s, "B" if k == "I" else k, i), 0.0)
    return replay(raw["p"], raw["vpp"], raw["m"], raw["schedule"], cost)


# -- one process -----------------------------------------------------------------------------
def _worker(rank: int, world: int, port: int, cases: list[dict], opts: dict, out: str) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"    # talk over loopback only
    torch.set_num_threads(1)
    from myria.parallel import pipeline

    store = dist.TCPStore("127.0.0.1", port, world, is_master=False,
                          timeout=datetime.timedelta(seconds=120))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))
    results = []
    for case in cases:
        p, v, m, sched = case["p"], case["vpp"], case["m"], case["schedule"]
        n_stages = p * v
        ids = pipeline.stage_ids(rank, p, v, sched)
        torch.manual_seed(0)
        if opts["real"]:
            parts, x, y = _real_parts(rank, p, v, m, sched)
        else:
            t_f = opts["t_f"] / v      # per chunk: same work per rank for every vpp
            parts = [SleepStage(t_f, s) for s in ids]
            x = torch.randn(m * MICRO, HIDDEN)
            y = torch.randn(m * MICRO, HIDDEN)
        schedule = pipeline.build_schedule(parts, ids, n_stages, sched, m, _mse if not
                                           opts["real"] else _ce, torch.device("cpu"), None)
        if opts["real"]:
            stages = getattr(schedule, "_stages", None) or [schedule._stage]
            for st in stages:
                st.forward_maybe_with_nosync = _timed(st.forward_maybe_with_nosync, "F",
                                                      st.stage_index)
                st.backward_maybe_with_nosync = _timed(st.backward_maybe_with_nosync, "B",
                                                       st.stage_index)
        has_first, has_last = 0 in ids, (n_stages - 1) in ids
        steps = []
        for i in range(opts["warmup"] + opts["steps"]):
            for part in parts:
                part.zero_grad(set_to_none=True)
            dist.barrier()
            _BUSY.clear()
            _SEQ.clear()
            t0 = time.perf_counter()
            if has_first:
                schedule.step(x, target=y if has_last else None)
            elif has_last:
                schedule.step(target=y)
            else:
                schedule.step()
            t1 = time.perf_counter()
            if i >= opts["warmup"]:
                steps.append({"t0": t0, "t1": t1, "busy": list(_BUSY)})
        gathered: list = [None] * world
        dist.all_gather_object(gathered, steps)
        if rank == 0:
            results.append({**case, "per_rank_steps": gathered})
    if rank == 0:
        Path(out).write_text(json.dumps(results))
    dist.destroy_process_group()


def _real_parts(rank: int, p: int, v: int, m: int, sched: str):
    """Tiny transformer stages (myria's FLOP-balanced split) and a batch, for --real."""
    from myria.config import ModelConfig
    from myria.models.transformer import build_model
    from myria.parallel import pipeline

    cfg = ModelConfig(vocab_size=1024, layers=8, hidden=128, heads=4, seq_len=64)
    model = build_model(cfg, "meta")
    parts, _ = pipeline.build_stages(model, cfg, rank, p, v, sched)
    for part in parts:
        part.to_empty(device="cpu")
        part.init_weights(0)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, cfg.vocab_size, (m * MICRO, cfg.seq_len), generator=g)
    y = torch.randint(0, cfg.vocab_size, (m * MICRO, cfg.seq_len), generator=g)
    return parts, x, y


def _ce(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


# -- analysis --------------------------------------------------------------------------------
def summarise(raw: dict) -> dict:
    """Per-rank idle fraction and bubble ratio (medians over steps) and the theory."""
    per_rank = raw["per_rank_steps"]
    n_steps = len(per_rank[0])
    idle = [[0.0] * n_steps for _ in per_rank]
    ratio = [[0.0] * n_steps for _ in per_rank]
    walls, skews = [], []
    for s in range(n_steps):
        t0 = min(r[s]["t0"] for r in per_rank)
        wall = max(r[s]["t1"] for r in per_rank) - t0
        walls.append(wall)
        skews.append(max(r[s]["t0"] for r in per_rank) - t0)
        for k, r in enumerate(per_rank):
            busy = sum(e[1] - e[0] for e in r[s]["busy"])
            idle[k][s] = 1 - busy / wall
            ratio[k][s] = (wall - busy) / busy
    idle_r = [statistics.median(x) for x in idle]
    ratio_r = [statistics.median(x) for x in ratio]
    th_ratio, th_frac = theory(raw["p"], raw["vpp"], raw["m"], raw["schedule"])
    ex_ratio, ex_frac = schedule_exact(raw["p"], raw["vpp"], raw["m"], raw["schedule"])
    busy0 = [sum(e[1] - e[0] for e in r[0]["busy"]) for r in per_rank]
    busy = statistics.median(statistics.fmean(sum(e[1] - e[0] for e in r[s]["busy"])
                                              for r in per_rank) for s in range(n_steps))
    hop_f, hop_b, gaps = hop_latencies(raw)
    replayed = statistics.median(replay_measured(raw, s) for s in range(n_steps))
    return {
        "p": raw["p"], "vpp": raw["vpp"], "m": raw["m"], "schedule": raw["schedule"],
        "step_s": statistics.median(walls), "barrier_skew_ms": 1e3 * max(skews),
        "busy_s_per_rank": busy0,
        "idle_frac_per_rank": idle_r, "idle_frac_mean": statistics.fmean(idle_r),
        "idle_frac_max": max(idle_r), "theory_idle_frac": th_frac,
        "bubble_ratio_per_rank": ratio_r, "bubble_ratio_mean": statistics.fmean(ratio_r),
        "theory_bubble_ratio": th_ratio,
        "diff_frac_pts": 100 * (statistics.fmean(idle_r) - th_frac),
        "diff_ratio_pts": 100 * (statistics.fmean(ratio_r) - th_ratio),
        "exact_bubble_ratio": ex_ratio, "exact_idle_frac": ex_frac,
        "diff_exact_ratio_pts": 100 * (statistics.fmean(ratio_r) - ex_ratio),
        "excess_ms": 1e3 * (statistics.median(walls) - busy * (1 + ex_ratio)),
        "excess_durations_ms": 1e3 * (replayed - busy * (1 + ex_ratio)),
        "excess_latency_ms": 1e3 * (statistics.median(walls) - replayed),
        "hop_ms_fwd": 1e3 * statistics.median(hop_f) if hop_f else None,
        "hop_ms_bwd": 1e3 * statistics.median(hop_b) if hop_b else None,
        "hops_seen": [len(hop_f), len(hop_b)],
        "local_gap_ms": 1e3 * statistics.median(gaps) if gaps else None,
    }


def hop_latencies(raw: dict) -> tuple[list[float], list[float], list[float]]:
    """Forward hops, backward hops and local gaps between a rank's consecutive work (seconds).

    Forward hop: end of F(s-1, i) -> start of F(s, i). Backward hop: end of the input-gradient
    half B(s+1, i) -> start of stage s's first backward work on microbatch i. A hop is counted
    when the receiving rank had finished its previous work before the sender finished (it was
    waiting): send + receive + Python + wake-up latency. Otherwise (its input was already
    there) the gap after its previous work is a local gap: the schedule's per-action overhead.
    """
    n_stages = raw["p"] * raw["vpp"]
    fwd: list[float] = []
    bwd: list[float] = []
    local: list[float] = []
    per_rank = raw["per_rank_steps"]
    for s in range(len(per_rank[0])):
        ev: dict[tuple, tuple[float, float]] = {}
        prev_end: dict[tuple, float] = {}
        for r in per_rank:
            last = r[s]["t0"]
            for b, e, kind, stage, seq in sorted(r[s]["busy"]):
                ev[(stage, kind, seq)] = (b, e)
                prev_end[(stage, kind, seq)] = last
                last = e
        for (stage, kind, seq), (b, _) in ev.items():
            if kind == "F" and stage > 0:
                dep = ev.get((stage - 1, "F", seq))
                out = fwd
            elif kind in ("B", "W") and stage < n_stages - 1:
                first = min((ev[k][0], k[1]) for k in ((stage, "B", seq), (stage, "W", seq))
                            if k in ev)
                if first[1] != kind:
                    continue
                dep = ev.get((stage + 1, "B", seq))
                out = bwd
            else:
                dep, out = None, local
            if dep is not None and dep[1] >= prev_end[(stage, kind, seq)]:
                out.append(b - dep[1])
            else:
                local.append(b - prev_end[(stage, kind, seq)])
    return fwd, bwd, local


def table(rows: list[dict]) -> str:
    """Markdown table: measured idle share and bubble ratio beside both theories."""
    head = ["p", "vpp", "m", "schedule", "step (s)", "idle % of step: mean [per rank]",
            "theory (p-1)/(vm+p-1) %", "diff (pts)", "bubble ratio idle/busy %",
            "theory (p-1)/(vm) %", "diff (pts)", "torch order, 0 latency %",
            "diff (pts)", "excess (ms) = durations + latency", "median hop F / B (ms)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        ranks = " ".join(f"{100 * x:.1f}" for x in r["idle_frac_per_rank"])
        cells = [r["p"], r["vpp"], r["m"], r["schedule"], f"{r['step_s']:.3f}",
                 f"{100 * r['idle_frac_mean']:.1f} [{ranks}]", f"{100 * r['theory_idle_frac']:.1f}",
                 f"{r['diff_frac_pts']:+.1f}", f"{100 * r['bubble_ratio_mean']:.1f}",
                 f"{100 * r['theory_bubble_ratio']:.1f}", f"{r['diff_ratio_pts']:+.1f}",
                 f"{100 * r['exact_bubble_ratio']:.1f}", f"{r['diff_exact_ratio_pts']:+.1f}",
                 f"{r['excess_ms']:.0f} = {r['excess_durations_ms']:.0f} + "
                 f"{r['excess_latency_ms']:.0f}", _hops(r)]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines)


def _hops(r: dict) -> str:
    if r["hop_ms_fwd"] is None:
        return "-"
    return f"{r['hop_ms_fwd']:.1f} / {r['hop_ms_bwd']:.1f}"


def run_world(p: int, cases: list[dict], opts: dict) -> list[dict]:
    """Spawn p ranks around a parent-held TCPStore (as torchrun's agent store) and run cases."""
    import tempfile

    store = dist.TCPStore("127.0.0.1", 0, p, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=120))
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "raw.json")
        mp.start_processes(_worker, args=(p, store.port, cases, opts, out), nprocs=p,
                           join=True, start_method="spawn")
        raws = json.loads(Path(out).read_text())
    del store
    return raws


def run_cases(ps: list[int], vpps: list[int], ms: list[int], extra: bool,
              opts: dict) -> tuple[list[dict], list[dict]]:
    """All cases, one spawned world per pipeline size; prints a line per case."""
    rows, raws = [], []
    for p in ps:
        cases = []
        for v in vpps:
            names = ["1f1b" if v == 1 else "interleaved-1f1b"]
            if extra:
                names += ["gpipe"] if v == 1 else ["zero-bubble", "zbv"] if v == 2 else []
            for m in ms:
                cases += [{"p": p, "vpp": v, "m": m, "schedule": s} for s in names]
        for raw in run_world(p, cases, opts):
            raws.append(raw)
            rows.append(summarise(raw))
            r = rows[-1]
            print(f"{'real ' if opts['real'] else ''}p={r['p']} vpp={r['vpp']} m={r['m']} "
                  f"{r['schedule']:<16} step {r['step_s']:.3f}s idle "
                  f"{100 * r['idle_frac_mean']:5.1f}% (theory {100 * r['theory_idle_frac']:5.1f}%)"
                  f"  bubble ratio {100 * r['bubble_ratio_mean']:5.1f}% (theory "
                  f"{100 * r['theory_bubble_ratio']:5.1f}%)", flush=True)
    return rows, raws


def _report(rows: list[dict], title: str) -> None:
    print(f"\n{title}\n")
    print(table(rows))
    over = [r for r in rows if abs(r["diff_frac_pts"]) > 5 or abs(r["diff_ratio_pts"]) > 5]
    print(f"\n{len(over)} of {len(rows)} cases differ from the closed-form theory by more than 5 "
          "points" + (": " + ", ".join(f"p={r['p']} vpp={r['vpp']} m={r['m']} {r['schedule']}"
                                       for r in over) if over else ""))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0] + " Spawns p gloo processes per pipeline size, "
        "runs each (vpp, m, schedule) case for --warmup + --steps steps and prints measured "
        "idle time beside the theory.",
        formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("--p", type=int, nargs="+", default=[2, 4], help="pipeline sizes (ranks)")
    ap.add_argument("--vpp", type=int, nargs="+", default=[1, 2], help="stages per rank")
    ap.add_argument("--m", type=int, nargs="+", default=[4, 8], help="microbatches per step")
    ap.add_argument("--tf-ms", type=float, default=50.0,
                    help="forward time per microbatch per rank in ms (split over the vpp "
                    "chunks; backward is twice as long) [50]")
    ap.add_argument("--warmup", type=int, default=2, help="unmeasured steps per case [2]")
    ap.add_argument("--steps", type=int, default=5, help="measured steps per case [5]")
    ap.add_argument("--extra", action="store_true",
                    help="also GPipe (vpp 1), interleaved zero-bubble and ZBV (vpp 2) rows")
    ap.add_argument("--real", action="store_true",
                    help="afterwards, also real compute: tiny transformer stages from "
                    "build_stages, p = 2, 1F1B / interleaved 1F1B, reported separately")
    ap.add_argument("--json", default=str(ROOT / "bench/results/pipeline_bubble.json"),
                    help="write summaries and raw per-rank timings here "
                    "[bench/results/pipeline_bubble.json]")
    a = ap.parse_args(argv)
    t_start = time.perf_counter()
    load_start = os.getloadavg()   # the 2 cores are shared: record how busy they were
    opts = {"t_f": a.tf_ms / 1e3, "warmup": a.warmup, "steps": a.steps, "real": False}
    rows, raws = run_cases(a.p, a.vpp, a.m, a.extra, opts)
    real_rows, real_raws = [], []
    if a.real:
        real_rows, real_raws = run_cases([2], a.vpp, a.m, False, {**opts, "real": True})
    elapsed = time.perf_counter() - t_start
    _report(rows, f"controlled cost: forward {a.tf_ms:g} ms, backward {2 * a.tf_ms:g} ms per "
            "microbatch per rank")
    if real_rows:
        _report(real_rows, "real compute (tiny transformer, unequal stages, shared CPU)")
    print(f"\n{elapsed:.0f} s")
    path = Path(a.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({
        "command": " ".join([".venv/bin/python", f"bench/{Path(__file__).name}"]
                           + (argv or sys.argv[1:])),
        "t_f_ms": a.tf_ms, "warmup": a.warmup, "steps": a.steps, "torch": torch.__version__,
        "elapsed_s": elapsed,
        "load_avg_start": load_start, "load_avg_end": os.getloadavg(),
        "date": datetime.date.today().isoformat(), "rows": rows,
        "real_rows": real_rows, "raw": raws, "real_raw": real_raws}, indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
