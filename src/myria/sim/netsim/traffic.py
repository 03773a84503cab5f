"""Traffic of collectives as flows: ring all-reduce (flat) for now."""

from __future__ import annotations

import numpy as np

from myria.sim.netsim.fabric import LeafSpine, connections, route
from myria.sim.netsim.flows import simulate


def ring_all_reduce(fabric: LeafSpine, hosts: list[int], nbytes: float, routing: str = "ecmp",
                    qps: int = 1, salt: int = 0) -> dict:
    """Ring all-reduce of ``nbytes`` over ``hosts`` (ring order as given): each neighbour
    connection carries 2(N-1)/N * nbytes; busbw = that / completion time (NCCL's definition)."""
    n = len(hosts)
    per_pair = 2 * (n - 1) / n * nbytes
    pairs = [(hosts[i], hosts[(i + 1) % n]) for i in range(n)]
    flows = connections(pairs, per_pair, qps, seed=salt)
    paths = route(fabric, flows, routing, salt=salt)
    res = simulate(paths, np.array([f.nbytes for f in flows]), fabric.capacity)
    util = res.link_bytes / (fabric.capacity * res.completion_time_s)
    return {
        "completion_time_s": res.completion_time_s,
        "busbw_gbs": per_pair / res.completion_time_s / 1e9,
        "ideal_busbw_gbs": fabric.nic_gbps / 8,
        "max_link_utilization": float(util.max()),
        "flows": len(flows),
        "links": fabric.links,
        "paths": paths,
    }
