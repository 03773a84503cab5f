"""A fluid model of lossless-Ethernet congestion control: PFC pauses and DCQCN rate control.

The max-min model of ``flows.py`` is the steady state congestion control is meant to reach;
this module simulates how RoCE gets (or fails to get) there, in time steps ``dt``, all flows at
once (sparse matrix-vector products, no per-flow loop). Every hop of every flow holds a queue; a
link serves its queued bytes up to its capacity, each flow in proportion to what it has queued,
and passes them to the next hop one step later (bytes are conserved end to end). Queues mark
ECN RED-style (0 below ``kmin``, linear to ``pmax`` at ``kmax``, 1 above); DCQCN (Zhu et al.,
SIGCOMM 2015) updates each flow's alpha (``g``), target rate (``rai``) and current rate every
``timer_s`` in the mean-field; PFC pauses every link feeding a port whose queue exceeds
``xoff`` until it drops below ``xon``. Times are indicative: the model shows when and where
pauses spread and which flows become victims. The mechanisms in full and what is not captured:
docs/network.md, "Reasons behind the network simulator modules".
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import scipy.sparse as sp

from myria.sim.netsim.fabric import Fabric
from myria.sim.netsim.flows import simulate_flows

# hop order of the link blocks along any route (see Fabric): GPU->NVSwitch, NVSwitch->GPU,
# NIC->ToR, ToR->agg, agg->core, core->agg, agg->ToR, ToR->NIC (pooled links as theirs)
_HOP_RANK = np.array([2, 7, 0, 1, 3, 6, 4, 5, 3, 6, 4, 5])


@dataclass(frozen=True)
class Params:
    """Typical RoCE settings (DCQCN paper and vendor defaults, rounded)."""

    dt_s: float = 1e-6
    timer_s: float = 55e-6       # DCQCN rate-update / alpha timer
    g: float = 1 / 256
    rai_bps: float = 5e6         # additive increase, 40 Mb/s in bytes/s
    kmin: float = 5e3            # ECN marking thresholds, bytes
    kmax: float = 200e3
    pmax: float = 0.01
    xoff: float = 300e3          # PFC pause / resume thresholds, bytes per port
    xon: float = 280e3
    mtu: float = 4096
    max_steps: int = 2_000_000


@dataclass
class CongestionResult:
    completion_time_s: float
    max_min_time_s: float
    paused_fraction: np.ndarray       # per link, fraction of the time paused
    max_queue_bytes: np.ndarray
    victim: np.ndarray                # flows stopped by a pause they did not cause
    steps: int

    def summary(self) -> dict:
        return {"completion_time_s": self.completion_time_s,
                "max_min_time_s": self.max_min_time_s,
                "slowdown": self.completion_time_s / self.max_min_time_s
                if self.max_min_time_s else 1.0,
                "paused_links": int((self.paused_fraction > 0).sum()),
                "max_paused_fraction": float(self.paused_fraction.max(initial=0.0)),
                "max_queue_kb": float(self.max_queue_bytes.max(initial=0.0) / 1e3),
                "victim_flows": int(self.victim.sum()), "steps": self.steps}


def _order(a: sp.csr_matrix, fab: Fabric):
    """Every flow's hops in path order (flow, link, index of the flow's first entry), the first
    hop of every flow, and the links x links matrix of (hop, next hop) pairs."""
    coo = a.tocoo()
    rank = _HOP_RANK[fab.tier_of_link[coo.col]]
    idx = np.lexsort((rank, coo.row))
    f, lk = coo.row[idx], coo.col[idx]
    first = np.ones(len(f), dtype=bool)
    first[1:] = f[1:] != f[:-1]
    first_link = np.zeros(a.shape[0], dtype=np.int64)
    first_link[f[first]] = lk[first]
    nxt = ~first[1:]
    up, down = lk[:-1][nxt], lk[1:][nxt]
    feeds = sp.csr_matrix((np.ones(len(up)), (up, down)), shape=(fab.links, fab.links))
    feeds.data[:] = 1.0
    start = np.maximum.accumulate(np.where(first, np.arange(len(f)), 0))
    return f, lk, start, first_link, feeds


def simulate_congestion(fab: Fabric, a: sp.csr_matrix, nbytes: np.ndarray,
                        params: Params = Params()) -> CongestionResult:
    """Flows of incidence ``a`` (all starting at once, ``nbytes`` each) under PFC + DCQCN."""
    p = params
    cap = fab.capacity
    at = a.T.tocsr()
    size = np.asarray(nbytes, dtype=float)
    n = len(size)
    hop_f, hop_l, hop_start, first_link, feeds = _order(a, fab)
    first = hop_start == np.arange(len(hop_f))
    last = np.ones(len(hop_f), dtype=bool)
    last[:-1] = first[1:]
    prev = np.arange(len(hop_f)) - 1          # the entry feeding each entry (if not first)
    line = cap[first_link]
    rc, rt = line.copy(), line.copy()
    alpha = np.ones(n)
    left = size.copy()                         # bytes the source has not sent yet
    undelivered = size.copy()                  # bytes not yet out of the last hop
    qe = np.zeros(len(hop_f))                  # bytes of each flow queued at each hop
    out_e = np.zeros(len(hop_f))               # rate each hop passed on in the last step
    qmax = np.zeros(fab.links)
    paused = np.zeros(fab.links, dtype=bool)
    paused_time = np.zeros(fab.links)
    victim = np.zeros(n, dtype=bool)
    per_timer = max(1, int(round(p.timer_s / p.dt_s)))
    marked = np.zeros(n)          # expected packets marked since the last timer
    dt = p.dt_s
    t, step = 0.0, 0
    while (undelivered > 1e-6 * size).any():
        if step >= p.max_steps:
            raise RuntimeError(f"congestion model: not done after {step} steps of {dt} s")
        # sources: DCQCN rate, stopped if their first hop is paused, shared at the NIC
        x = np.where((left > 0) & ~paused[first_link], rc, 0.0)
        load = np.bincount(first_link, weights=x, minlength=fab.links)
        x *= np.minimum(1.0, cap / np.maximum(load, 1e-30))[first_link]
        x = np.minimum(x, left / dt)
        left -= x * dt
        # every hop receives what the hop before it passed on in the last step (the first hop
        # what the source sends) and serves its link's content in proportion, up to capacity
        arr = np.where(first, x[hop_f], out_e[prev])
        content = qe + arr * dt
        q = np.bincount(hop_l, weights=content, minlength=fab.links)
        serve = np.where(paused, 0.0, np.minimum(cap * dt, q))
        share = np.divide(serve, q, out=np.zeros_like(q), where=q > 0)
        sent = content * share[hop_l]
        qe = content - sent
        out_e = sent / dt
        undelivered -= np.bincount(hop_f[last], weights=sent[last], minlength=n)
        qlink = np.bincount(hop_l, weights=qe, minlength=fab.links)
        qmax = np.maximum(qmax, qlink)
        # ECN marks on every flow's path (Poisson count of marked packets)
        mark = np.clip((qlink - p.kmin) / (p.kmax - p.kmin), 0.0, 1.0) * p.pmax
        mark[qlink >= p.kmax] = 1.0
        log_keep = at.T @ np.log1p(-np.minimum(mark, 1 - 1e-12))
        marked += x * dt / p.mtu * (1.0 - np.exp(log_keep))
        # PFC: pause the links feeding a port above xoff until it drops below xon
        trigger = (feeds @ (qlink > p.xoff).astype(float)) > 0
        still = (feeds @ (qlink >= p.xon).astype(float)) > 0
        paused = trigger | (paused & still)
        paused_time += paused * dt
        if paused.any():   # held at a paused hop without crossing a congested port
            held = np.bincount(hop_f, weights=(paused[hop_l] & (qe > 0)), minlength=n) > 0
            held |= paused[first_link] & (left > 0)
            congested = (a @ (qlink >= p.xon).astype(float)) > 0
            victim |= held & ~congested
        step += 1
        t += dt
        if step % per_timer == 0:
            cnp = 1.0 - np.exp(-marked)            # P(at least one notification)
            alpha = (1 - p.g) * alpha + p.g * cnp
            new_rt = cnp * rc + (1 - cnp) * np.minimum(line, rt + p.rai_bps)
            rc = cnp * rc * (1 - alpha / 2) + (1 - cnp) * (rc + rt) / 2
            rt = new_rt
            rc = np.clip(rc, line * 1e-3, line)
            marked[:] = 0.0
    base = simulate_flows(a, size, cap).completion_time_s
    return CongestionResult(t, base, paused_time / t, qmax, victim, step)
