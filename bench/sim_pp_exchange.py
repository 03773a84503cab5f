"""What blocking pipeline sends cost: Megatron-LM's schedules replayed with rendezvous exchanges.

    PYTHONPATH=src .venv/bin/python bench/sim_pp_exchange.py

Without `overlap.pp` the step model charges every chunk boundary's transfer on the critical path
(2 v transfers per microbatch and stage, in the fill and drain too) and nothing else. Megatron-LM
without `overlap_p2p_comm` runs its sends and receives as blocking, bundled exchanges
(`p2p_communication.send_forward_recv_backward`, `send_forward_backward_recv_forward_backward`,
... then wait): a send completes only when its receiver has posted the matching receive, so
neighbouring ranks wait for each other. Could that coupling cost more than the transfers? This
replays each rank's operations in Megatron's order (`schedule_plot._orders`) with its
exchanges as Megatron composes them:

- 1F1B (`forward_backward_pipelining_without_interleaving`): warm-up recv_forward, F,
  send_forward; steady F, send_forward_recv_backward, B, send_backward_recv_forward;
  cool-down recv_backward, B, send_backward;
- interleaved (`forward_backward_pipelining_with_interleaving`, no overlap_p2p_comm): the first
  input's receive; after each warm-up F send_forward_recv_forward (the last one also receives
  the first backward's gradient); in the steady state one F and one B, then one
  send_forward_backward_recv_forward_backward; after each cool-down B
  send_backward_recv_backward.

An exchange completes `t_x` after the later of its own posting and every partner's (one transfer
time per exchange: its sends and receives run at once). Compared with the closed form the step
model uses for the same stages (m C + (p-1) C / v with C = F + B + 2 v t_x).

With equal, fixed operation times the coupling is free. The second table spreads every
operation's time independently (normal, sigma = the rank-jitter prior's 1% of the operation)
and compares, per microbatch, what the blocking exchanges lose to the spread beyond what
asynchronous sends and receives lose (`decoupled_pipeline_time`, MegaScale's PP overlap), with
the model's charge (`overlap.exchange_wait`); 12 draws each.
"""

from __future__ import annotations

import sys

from myria.sim.schedule_plot import _orders


def _segments(p: int, v: int, m: int) -> list[list[tuple[list, list, list]]]:
    """Per rank: (ops, sends, receives) segments: the ops run, then one exchange. Sends and
    receives are keyed by the consuming op (kind, microbatch, virtual stage)."""
    orders = _orders("interleaved-1f1b" if v > 1 else "1f1b", p, v, m)
    n_vs, total = p * v, m * v
    out = []
    for r in range(p):
        def sends(op, r=r):
            k, mb, c = op
            vs = c * p + r
            if k == "F" and vs < n_vs - 1:
                return [("F", mb, vs + 1)]
            return [("B", mb, vs - 1)] if k == "B" and vs > 0 else []

        def recvs(op, r=r):
            k, mb, c = op
            vs = c * p + r
            if (k == "F" and vs > 0) or (k == "B" and vs < n_vs - 1):
                return [(k, mb, vs)]
            return []

        fwd = [o for o in orders[r] if o[0] == "F"]
        bwd = [o for o in orders[r] if o[0] == "B"]
        segs: list[tuple[list, list, list]] = []
        if v == 1:
            warm = min(p - r - 1, total)
            for k in range(warm):
                segs += [([], [], recvs(fwd[k])), ([fwd[k]], sends(fwd[k]), [])]
            if warm < m:
                segs.append(([], [], recvs(fwd[warm])))
            for i in range(m - warm):
                f, b = fwd[warm + i], bwd[i]
                segs.append(([f], sends(f), recvs(b)))
                nxt = recvs(fwd[warm + i + 1]) if warm + i + 1 < m else []
                segs.append(([b], sends(b), nxt))
            for i in range(m - warm, m):
                segs += [([], [], recvs(bwd[i])), ([bwd[i]], sends(bwd[i]), [])]
        else:
            warm = min((p - r - 1) * 2 + (v - 1) * p, total)
            segs.append(([], [], recvs(fwd[0])))
            nf = nb = 0
            for k in range(warm):
                op = fwd[nf]
                nf += 1
                rv = recvs(fwd[nf]) if nf < total else []
                if k == warm - 1 and warm < total:
                    rv += recvs(bwd[0])
                segs.append(([op], sends(op), rv))
            while nf < total:
                f, b = fwd[nf], bwd[nb]
                nf, nb = nf + 1, nb + 1
                rv = (recvs(fwd[nf]) if nf < total else []) + recvs(bwd[nb])
                segs.append(([f, b], sends(f) + sends(b), rv))
            while nb < total:
                b = bwd[nb]
                nb += 1
                segs.append(([b], sends(b), recvs(bwd[nb]) if nb < total else []))
        out.append(segs)
    return out


def _duration(t_f: float, t_b: float, v: int, spread: dict | None):
    """One operation's seconds on rank r: its chunk's share of t_f or t_b, times the
    operation's factor in `spread` (keyed by rank and op) when given."""
    def dur(r: int, op: tuple) -> float:
        t = (t_f if op[0] == "F" else t_b) / v
        return t * spread[(r, op)] if spread else t
    return dur


def blocking_pipeline_time(p: int, v: int, m: int, t_f: float, t_b: float, t_x: float,
                           spread: dict | None = None) -> float:
    """End of the last exchange of Megatron's schedule with rendezvous exchanges (docstring);
    t_f, t_b per stage (all chunks), t_x one transfer; `spread`: each operation's time factor
    (`random_spread`)."""
    dur = _duration(t_f, t_b, v, spread)
    segs = _segments(p, v, m)
    send_at, recv_at = {}, {}
    for r in range(p):
        for e, (_, snd, rcv) in enumerate(segs[r]):
            for key in snd:
                send_at[key] = (r, e)
            for key in rcv:
                recv_at[key] = (r, e)
    post = [[None] * len(s) for s in segs]
    cur, free = [0] * p, [0.0] * p
    remaining = sum(len(s) for s in segs)
    while remaining:
        progress = False
        for r in range(p):
            e = cur[r]
            if e >= len(segs[r]):
                continue
            ops, snd, rcv = segs[r][e]
            if post[r][e] is None:
                post[r][e] = free[r] + sum(dur(r, op) for op in ops)
            partners = [recv_at[k] for k in snd] + [send_at[k] for k in rcv]
            times = [post[q][f] for q, f in partners]
            if any(t is None for t in times):
                continue
            free[r] = max([post[r][e]] + times) + (t_x if partners else 0.0)
            cur[r] += 1
            remaining -= 1
            progress = True
        if not progress:
            raise RuntimeError("the exchanges deadlock (internal error)")
    return max(free)


def decoupled_pipeline_time(p: int, v: int, m: int, t_f: float, t_b: float, t_x: float,
                            spread: dict | None = None) -> float:
    """The same order with asynchronous sends and receives (MegaScale's PP overlap, section
    3.2): an operation waits only for its own input, `t_x` after the operation that produced
    it ended; no rank waits for a partner to post."""
    dur = _duration(t_f, t_b, v, spread)
    orders = _orders("interleaved-1f1b" if v > 1 else "1f1b", p, v, m)
    n_vs = p * v
    end: dict = {}
    cur, free = [0] * p, [0.0] * p
    remaining = sum(len(o) for o in orders)
    while remaining:
        progress = False
        for r in range(p):
            while cur[r] < len(orders[r]):
                op = orders[r][cur[r]]
                k, mb, c = op
                vs = c * p + r
                src = (("F", mb, vs - 1) if vs > 0 else None) if k == "F" else \
                    (("B", mb, vs + 1) if vs < n_vs - 1 else ("F", mb, vs))
                if src is not None and src not in end:
                    break
                ready = 0.0 if src is None else end[src] + (t_x if src[2] != vs else 0.0)
                free[r] = end[(k, mb, vs)] = max(free[r], ready) + dur(r, op)
                cur[r] += 1
                remaining -= 1
                progress = True
        if not progress:
            raise RuntimeError("the schedule deadlocks (internal error)")
    return max(free)


def random_spread(p: int, v: int, m: int, sigma: float, seed: int) -> dict:
    """Independent normal time factors 1 + sigma Z for every operation of every rank."""
    import numpy as np

    rng = np.random.default_rng(seed)
    orders = _orders("interleaved-1f1b" if v > 1 else "1f1b", p, v, m)
    return {(r, op): 1.0 + sigma * float(rng.standard_normal())
            for r in range(p) for op in orders[r]}


def closed_form(p: int, v: int, m: int, t_f: float, t_b: float, t_x: float) -> float:
    """The step model's pipeline time for equal stages without overlap.pp."""
    s = t_f + t_b + 2 * v * t_x
    return (m - 1) * s + p * s / v + (1 - 1 / v) * s


CASES = [(8, 2, 64), (8, 1, 64), (4, 2, 16), (16, 2, 144), (64, 2, 512)]
SPREAD_CASES = [(4, 2, 16), (8, 2, 64), (8, 6, 64), (16, 2, 144), (8, 1, 64)]


def spread_cost(p: int, v: int, m: int, sigma: float = 0.01, draws: int = 12,
                t_x: float = 0.004) -> tuple[float, float]:
    """Mean seconds per microbatch (F = 1, B = 2 per stage) that the spread adds to the
    blocking schedule beyond what it adds to the decoupled one, and what it adds to the
    decoupled one."""
    fixed_b = blocking_pipeline_time(p, v, m, 1.0, 2.0, t_x)
    fixed_d = decoupled_pipeline_time(p, v, m, 1.0, 2.0, t_x)
    cpl = dec = 0.0
    for seed in range(draws):
        sp = random_spread(p, v, m, sigma, seed)
        d = decoupled_pipeline_time(p, v, m, 1.0, 2.0, t_x, sp) - fixed_d
        cpl += blocking_pipeline_time(p, v, m, 1.0, 2.0, t_x, sp) - fixed_b - d
        dec += d
    return cpl / draws / m, dec / draws / m


def main() -> int:
    import math

    from myria.sim.overlap import lockstep_rate

    print("p  v    m   t_x/F   replayed  closed form  difference")
    for p, v, m in CASES:
        for tx in (0.0, 0.004, 0.02):
            a = blocking_pipeline_time(p, v, m, 1.0, 2.0, tx)
            b = closed_form(p, v, m, 1.0, 2.0, tx)
            print(f"{p:<3}{v:<3}{m:>4}  {tx:6.3f}  {a:9.3f}  {b:11.3f}  {a / b - 1:+.2%}")
    print("\nspread 1% per operation, per microbatch (F + B = 3):")
    print("p  v    m   blocking beyond async  async alone  model (exchange_wait)")
    for p, v, m in SPREAD_CASES:
        cpl, dec = spread_cost(p, v, m)
        model = 0.01 * lockstep_rate(p) * math.hypot(1.0, 2.0) if v > 1 else 0.0
        print(f"{p:<3}{v:<3}{m:>4}  {cpl:20.4f}  {dec:11.4f}  {model:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
