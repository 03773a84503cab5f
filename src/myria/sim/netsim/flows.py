"""Event-driven max-min fair sharing of links by flows (the fluid, flow-level model).

A flow is a fluid with one rate; every link shares its capacity max-min fairly among the flows
crossing it (progressive filling: raise all unfrozen rates together until a link saturates,
freeze its flows, repeat), the classic flow-level abstraction of TCP / RoCE / InfiniBand
congestion control in steady state. Events are flows finishing (and, for several jobs, flows
starting); rates are recomputed at each event. The arithmetic is one sparse flows x links
incidence matrix (scipy.sparse) and vectors: no per-flow Python loop.

Not captured here: packets, queues and their delay, slow start, PFC pauses and DCQCN dynamics
(``congestion.py`` adds a fluid model of those), switch buffers, NIC/PCIe limits other than the
NIC line rate, and per-message software latency (added per collective step by ``traffic.py``).
Progressive filling is written here because no registry library offers a vectorised max-min
allocation over a sparse incidence matrix (networkx has max-flow, not fair shares).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import scipy.sparse as sp


def incidence(paths: list[list[int]], links: int) -> sp.csr_matrix:
    """Sparse flows x links matrix with a 1 where a flow crosses a link (from path lists)."""
    rows = np.repeat(np.arange(len(paths)), [len(p) for p in paths])
    cols = np.fromiter((li for p in paths for li in p), dtype=np.int64, count=len(rows))
    return sp.csr_matrix((np.ones(len(rows)), (rows, cols)), shape=(len(paths), links))


def incidence_of(flow: np.ndarray, link: np.ndarray, n_flows: int, links: int
                 ) -> sp.csr_matrix:
    """The same matrix from (flow, link) pairs (duplicates, e.g. a GPU's port crossed twice,
    count twice)."""
    return sp.csr_matrix((np.ones(len(flow)), (flow, link)), shape=(n_flows, links))


def max_min_rates(a: sp.csr_matrix, capacity: np.ndarray, active: np.ndarray,
                  at: sp.csr_matrix | None = None) -> np.ndarray:
    """Max-min fair rates of the ``active`` flows by progressive filling (on the sub-matrix of
    the active flows and the links they use)."""
    rate = np.zeros(a.shape[0])
    idx = np.flatnonzero(active)
    if not len(idx):
        return rate
    sub = a[idx]
    links, cols = np.unique(sub.indices, return_inverse=True)
    sub = sp.csr_matrix((sub.data, cols, sub.indptr), shape=(len(idx), len(links)))
    sub_t = sub.T.tocsr()
    cap = capacity[links].astype(float)
    r = np.zeros(len(idx))
    free = np.ones(len(idx), dtype=bool)
    residual = cap.copy()
    while free.any():
        n = sub_t @ free.astype(float)  # unfrozen flows per link
        used = n > 0
        share = np.full_like(residual, np.inf)
        share[used] = residual[used] / n[used]
        inc = share.min()
        if not np.isfinite(inc):      # flows crossing only unlimited links
            r[free] = np.inf
            break
        r[free] += inc
        residual -= inc * n
        saturated = used & (residual <= 1e-9 * cap)
        free &= ~((sub @ saturated.astype(float)) > 0)
    rate[idx] = r
    return rate


@dataclass
class Result:
    completion_time_s: float
    finish_s: np.ndarray
    link_bytes: np.ndarray
    events: int


def simulate_flows(a: sp.csr_matrix, nbytes: np.ndarray, capacity: np.ndarray,
                   events: bool = False) -> Result:
    """All flows start at t=0; at each event (flows finishing) the rates are recomputed.

    When every flow carries the same bytes ``s`` (every step of a ring, of a two-stage phase,
    of an all-to-all) the completion time is exactly ``s`` over the first level of progressive
    filling, r1 = min over links of capacity / flows: the flows of that link run at r1 until
    they all end together, and no flow ever runs slower, since a max-min rate is at least its
    links' smallest capacity / (active flows), which only grows as flows end. That is one
    sparse product instead of an event loop (``events=True`` forces the loop; ``finish_s``
    is then filled, otherwise NaN). The same holds for flows of a few sizes when flows of
    different sizes never share a link (the double binary tree: its NIC flows carry half what
    its NVLink chains do): those are independent problems, each of equal sizes, and the step
    ends when the slowest ends."""
    at = a.T.tocsr()
    size = np.asarray(nbytes, dtype=float)
    values = np.unique(size) if len(size) else size
    if not events and 0 < len(values) <= 8 and values[0] > 0:
        counts = [at @ (size == v).astype(float) for v in values]
        if (np.sum([c > 0 for c in counts], axis=0) <= 1).all():    # disjoint link sets
            t = 0.0
            for v, n in zip(values, counts):
                used = n > 0
                r1 = float((capacity[used] / n[used]).min())
                if not np.isfinite(r1):
                    raise ValueError("a flow crosses no capacity-limited link")
                t = max(t, v / r1)
            return Result(t, np.full(len(size), np.nan), at @ size, 1)
    left = size.copy()
    finish = np.zeros(len(left))
    active = left > 0
    t, events = 0.0, 0
    while active.any():
        rate = max_min_rates(a, capacity, active, at)
        r = rate[active]
        if np.isinf(r).any():
            raise ValueError("a flow crosses no capacity-limited link")
        dt = np.min(left[active] / r)
        left[active] -= r * dt
        t += dt
        done = active & (left <= 1e-9 * size)
        finish[done] = t
        active &= ~done
        events += 1
    return Result(t, finish, at @ size, events)


def simulate(paths: list[list[int]], nbytes: np.ndarray, capacity: np.ndarray) -> Result:
    """``simulate_flows`` from path lists."""
    return simulate_flows(incidence(paths, len(capacity)), nbytes, capacity)
