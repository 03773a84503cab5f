"""Event-driven max-min fair sharing of links by flows (fluid model).

Progressive filling is written here because no registry library found offers a vectorised
max-min fair allocation over a sparse incidence matrix (networkx has max-flow, not fair shares);
it is ~20 lines of numpy/scipy.sparse. Abstraction: a flow is a fluid with one rate; links share
capacity max-min fairly; no packets, queues, PFC or DCQCN (not modelled yet).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import scipy.sparse as sp


def incidence(paths: list[list[int]], links: int) -> sp.csr_matrix:
    """Sparse flows x links matrix with a 1 where a flow crosses a link."""
    rows = np.repeat(np.arange(len(paths)), [len(p) for p in paths])
    cols = np.fromiter((li for p in paths for li in p), dtype=np.int64, count=len(rows))
    return sp.csr_matrix((np.ones(len(rows)), (rows, cols)), shape=(len(paths), links))


def max_min_rates(a: sp.csr_matrix, capacity: np.ndarray, active: np.ndarray) -> np.ndarray:
    """Max-min fair rates of the ``active`` flows by progressive filling: raise every unfrozen
    flow's rate together until a link saturates, freeze the flows through it, repeat."""
    at = a.T.tocsr()
    rate = np.zeros(a.shape[0])
    free = active.copy()
    residual = capacity.astype(float).copy()
    while free.any():
        n = at @ free.astype(float)  # unfrozen flows per link
        used = n > 0
        share = np.full_like(residual, np.inf)
        share[used] = residual[used] / n[used]
        inc = share.min()
        rate[free] += inc
        residual -= inc * n
        saturated = used & (residual <= 1e-9 * capacity)
        free &= ~((a @ saturated.astype(float)) > 0)
    return rate


@dataclass
class Result:
    completion_time_s: float
    finish_s: np.ndarray
    link_bytes: np.ndarray
    events: int


def simulate(paths: list[list[int]], nbytes: np.ndarray, capacity: np.ndarray) -> Result:
    """All flows start at t=0; at each event (a flow finishing) the rates are recomputed."""
    a = incidence(paths, len(capacity))
    left = np.asarray(nbytes, dtype=float).copy()
    finish = np.zeros(len(left))
    active = left > 0
    t, events = 0.0, 0
    while active.any():
        rate = max_min_rates(a, capacity, active)
        dt = np.min(left[active] / rate[active])
        left[active] -= rate[active] * dt
        t += dt
        done = active & (left <= 1e-9 * np.asarray(nbytes))
        finish[done] = t
        active &= ~done
        events += 1
    return Result(t, finish, a.T @ np.asarray(nbytes, dtype=float), events)
