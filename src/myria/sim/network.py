"""Flow-level network model: how fast the fabric lets a collective's concurrent flows run.

A collective step is a set of flows that run at once (every data-parallel ring of the cluster
sends to its next node at the same time, say). Flows share links max-min fairly (progressive
filling, the classic flow-level model of TCP/RoCE/IB congestion control); the step ends when its
slowest flow ends. The result is a *fabric factor* in (0, 1]: the time the step would take if
only the NICs limited it, divided by the time it takes on this fabric. 1 means the fabric is
invisible (full bisection, well-spread routes); ECMP collisions and oversubscription lower it.

Groups follow Megatron's rank order (tp fastest, then cp, dp, pp): a group is `size` ranks
`stride` apart. Large clusters are sampled: the pattern is laid out on at most `MAX_SIM_NODES`
servers (groups longer than that are shortened), since leaf-level contention is local.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from myria.sim.topology import Fabric

MAX_SIM_NODES = 64


def max_min_rates(flow: np.ndarray, link: np.ndarray, cap: np.ndarray, n_flows: int
                  ) -> np.ndarray:
    """Max-min fair rate of every flow (progressive filling) given (flow, link) incidence."""
    rate = np.zeros(n_flows)
    frozen = np.zeros(n_flows, dtype=bool)
    rem = cap.astype(float).copy()
    n_links = len(cap)
    for _ in range(10 * n_links + 10):
        active = ~frozen[flow]
        if not active.any():
            break
        cnt = np.bincount(link[active], minlength=n_links)
        used = cnt > 0
        share = np.full(n_links, np.inf)
        share[used] = rem[used] / cnt[used]
        inc = share.min()
        rate[~frozen] += inc
        rem -= inc * cnt
        saturated = used & (rem <= 1e-9 * cap + 1e-12)
        hit = saturated[link] & active
        frozen[flow[hit]] = True
    return rate


@dataclass(frozen=True)
class PatternResult:
    """Outcome of one traffic pattern on a fabric."""

    factor: float       # NIC-limited time / fabric time, in (0, 1]
    flows: int          # flows simulated
    nodes: int          # servers the pattern was laid out on


def _groups(world: int, size: int, stride: int) -> np.ndarray:
    """Ranks of every group of `size` ranks `stride` apart, shape (groups, size)."""
    block = size * stride
    bases = np.array([b * block + o for b in range(world // block) for o in range(stride)],
                     dtype=np.int64)
    return bases[:, None] + stride * np.arange(size, dtype=np.int64)[None, :]


@lru_cache(maxsize=4096)
def pattern_factor(fabric: Fabric, kind: str, size: int, stride: int) -> PatternResult:
    """Fabric factor of every group of `size` ranks `stride` apart running `kind` at once.

    kind: ``ring`` (each member sends to the same local position on the next server, one ring per
    NIC as NCCL builds them), ``p2p`` (each member sends to the next member, no wrap: pipeline
    stages) or ``a2a`` (every member sends to every member on another server).
    """
    gpn = fabric.gpus_per_node
    nodes = min(fabric.nodes, MAX_SIM_NODES)
    world = nodes * gpn
    while size > 1 and size * stride > world:
        size -= 1
    if size <= 1 or fabric.nodes <= 1:
        return PatternResult(1.0, 0, nodes)
    groups = _groups(world, size, stride)
    node = groups // gpn
    if kind == "ring" or kind == "p2p":
        nxt = np.roll(groups, -1, axis=1)
        if kind == "p2p":
            src, dst = groups[:, :-1].ravel(), groups[:, 1:].ravel()
        else:
            # members on the next server in the ring, same local position
            src, dst = groups.ravel(), nxt.ravel()
            per_node = max(1, int((node[0] == node[0, 0]).sum()))
            if per_node > 1:
                dst = np.roll(groups, -per_node, axis=1).ravel()
    elif kind == "a2a":
        s = np.repeat(groups, size, axis=1).reshape(-1)
        d = np.tile(groups, (1, size)).reshape(-1)
        src, dst = s, d
    else:
        raise ValueError(f"unknown traffic pattern {kind!r}")
    keep = (src // gpn) != (dst // gpn)
    src, dst = src[keep], dst[keep]
    if not len(src):
        return PatternResult(1.0, 0, nodes)
    q = fabric.flows_per_pair if fabric.routing == "ecmp" else 1
    src, dst = np.repeat(src, q), np.repeat(dst, q)
    nics = fabric.nics_per_node
    s_nic = (src % gpn) * nics // gpn
    d_nic = (dst % gpn) * nics // gpn
    sim = Fabric(kind=fabric.kind, nodes=nodes, gpus_per_node=gpn, nics_per_node=nics,
                 oversubscription=fabric.oversubscription, routing=fabric.routing,
                 flows_per_pair=fabric.flows_per_pair, radix=fabric.radix)
    f, lk = sim.paths(src // gpn, s_nic, dst // gpn, d_nic, seed=size * 7919 + stride)
    cap = sim.links()
    rate = max_min_rates(f, lk, cap, len(src))
    units = 1.0 / q
    t_fabric = float((units / rate).max())
    # NIC-limited time: the busiest NIC (either direction) at its full rate
    n_nic = nodes * nics
    load = np.bincount(lk[lk < 2 * n_nic], minlength=2 * n_nic) * units
    t_nic = float(load.max())
    return PatternResult(min(1.0, t_nic / t_fabric), len(src), nodes)
