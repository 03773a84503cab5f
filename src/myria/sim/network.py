"""Flow-level network model: how fast the fabric lets a collective's concurrent flows run.

A collective step is a set of flows that run at once (every data-parallel ring of the cluster
sends to its next node at the same time, say). Flows share links max-min fairly (progressive
filling, the classic flow-level model of TCP/RoCE/IB congestion control); the step ends when its
slowest flow ends. The result is a *fabric factor* in (0, 1]: the time the step would take if
only the NICs limited it, divided by the time it takes on this fabric. 1 means the fabric is
invisible (full bisection, well-spread routes); ECMP collisions and oversubscription lower it.

All flows of a pattern carry the same bytes, so the slowest flow's max-min rate is the first
level of progressive filling: min over links of capacity / flows crossing it. One pass over the
flows gives it; `max_min_rates` (the full allocation) is kept for other uses and for tests.

Groups follow Megatron's rank order (tp fastest, then cp, dp, pp): a group is `size` ranks
`stride` apart. Patterns with more than `MAX_SIM_FLOWS` flows (large all-to-alls) are laid out on
fewer servers (groups shortened to fit), which keeps leaf-level contention but can hide the core.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from myria.sim.topology import Fabric, PatternResult, pattern_groups

MAX_SIM_FLOWS = 300_000


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


@lru_cache(maxsize=4096)
def pattern_factor(fabric: Fabric, kind: str, size: int, stride: int) -> PatternResult:
    """Fabric factor of every group of `size` ranks `stride` apart running `kind` at once.

    kind: ``ring`` (each member sends to the same local position on the next server, one ring per
    NIC as NCCL builds them), ``p2p`` (each member sends to the next member, no wrap: pipeline
    stages) or ``a2a`` (every member sends to every member on another server).
    """
    if kind not in ("ring", "p2p", "a2a"):
        raise ValueError(f"unknown traffic pattern {kind!r}")
    if fabric.model == "flow":                 # myria simulate --network flow
        # imported here, not at the top: netsim loads scipy.sparse (~0.6 s), which the
        # analytic path (every `plan` and `simulate`) does not need; netsim imports nothing
        # from this module, so the dependency runs one way
        from myria.sim.netsim.api import flow_pattern_factor
        return flow_pattern_factor(fabric, kind, size, stride)
    gpn = fabric.gpus_per_node
    q = fabric.flows_per_pair if fabric.routing == "ecmp" else 1
    groups, nodes = pattern_groups(fabric, kind, size, stride, MAX_SIM_FLOWS)
    if groups is None:
        return PatternResult(1.0, 0, nodes)
    size = groups.shape[1]
    node = groups // gpn
    if kind == "p2p":
        src, dst = groups[:, :-1].ravel(), groups[:, 1:].ravel()
    elif kind == "ring":
        # the member at the same local position on the next server of the ring
        per_node = max(1, int((node[0] == node[0, 0]).sum()))
        src, dst = groups.ravel(), np.roll(groups, -per_node, axis=1).ravel()
    else:
        src = np.repeat(groups, size, axis=1).reshape(-1)
        dst = np.tile(groups, (1, size)).reshape(-1)
    keep = (src // gpn) != (dst // gpn)
    src, dst = src[keep], dst[keep]
    if not len(src):
        return PatternResult(1.0, 0, nodes)
    src, dst = np.repeat(src, q), np.repeat(dst, q)
    nics = fabric.nics_per_node
    sim = Fabric(kind=fabric.kind, nodes=nodes, gpus_per_node=gpn, nics_per_node=nics,
                 oversubscription=fabric.oversubscription, routing=fabric.routing,
                 flows_per_pair=fabric.flows_per_pair, radix=fabric.radix)
    f, lk = sim.paths(src // gpn, (src % gpn) * nics // gpn, dst // gpn,
                      (dst % gpn) * nics // gpn, seed=size * 7919 + stride)
    cap = sim.links()
    count = np.bincount(lk, minlength=len(cap))
    used = count > 0
    slowest = float((cap[used] / count[used]).min())   # first max-min fair level
    # NIC-limited rate: the busiest NIC (either direction) shared by its flows
    n_nic = nodes * nics
    nic_rate = float(1.0 / count[:2 * n_nic].max())
    return PatternResult(min(1.0, slowest / nic_rate), len(src), nodes)
