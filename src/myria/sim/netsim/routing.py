"""Routes of flows through a fabric: ECMP 5-tuple hashing (with or without polarisation),
queue pairs per connection, adaptive (least-loaded) routing and static rail-aware routes.

A flow goes from one GPU to another. Inside a host it crosses the source GPU's NVLink port and
the destination's. Across hosts it leaves through the NIC of its source GPU (or, with ``rail``
routing on a rail-optimised fabric, first hops over NVLink to the GPU on the destination's rail,
as NCCL's PXN does), climbs to the lowest tier common to both ends and comes down again: the
aggregation switch ``a`` and the core switch ``v`` chosen going up fix the way down. Routing
policies (``ROUTINGS``): ``ecmp`` (5-tuple hash per switch; ``polarized``: the same function at
every tier), ``adaptive`` (every flow spread evenly over its equal-cost paths, vectorised),
``flowlet`` (one path per flow, the least loaded end to end; a Python loop over the flows that
leave their ToR) and ``rail`` (static D-mod-k routes plus PXN: traffic stays on its rail). How
each hashes or chooses: docs/network.md, "Reasons behind the network simulator modules".
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from myria.errors import ConfigError
from myria.sim.netsim.fabric import Fabric

ROUTINGS = ("ecmp", "adaptive", "flowlet", "rail")
ROCE_DPORT, UDP = 4791, 17

_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def mix64(*cols: np.ndarray) -> np.ndarray:
    """A vectorised 64-bit hash of integer columns (splitmix64 finaliser over a running sum):
    uniform over ports and deterministic per flow, standing in for a switch's CRC hash."""
    h = np.zeros(len(cols[0]), dtype=np.uint64)
    with np.errstate(over="ignore"):
        for c in cols:
            h = h + np.asarray(c).astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15)
            h ^= h >> np.uint64(30)
            h *= _M1
            h ^= h >> np.uint64(27)
            h *= _M2
            h ^= h >> np.uint64(31)
    return h


@dataclass
class Routed:
    """Flows with their links: ``flow[i]`` crosses ``link[i]`` (the sparse incidence)."""

    flow: np.ndarray
    link: np.ndarray
    n_flows: int


def source_ports(n: int, seed: int) -> np.ndarray:
    """Ephemeral UDP source ports of ``n`` queue pairs (the ECMP entropy)."""
    return np.random.default_rng(seed).integers(49152, 65536, n)


def route(fab: Fabric, src: np.ndarray, dst: np.ndarray, nbytes: np.ndarray, routing: str,
          sport: np.ndarray | None = None, salt: int = 0, polarized: bool = False) -> Routed:
    """Links crossed by flows from GPU ``src[i]`` to GPU ``dst[i]``."""
    if routing not in ROUTINGS:
        raise ConfigError(f"routing = {routing!r}: valid are {', '.join(ROUTINGS)}")
    s = fab.spec
    src, dst = np.asarray(src, dtype=np.int64), np.asarray(dst, dtype=np.int64)
    nf = len(src)
    fid = np.arange(nf, dtype=np.int64)
    if sport is None:
        sport = source_ports(nf, salt)
    b = fab.base
    sh, dh = src // s.gpus, dst // s.gpus
    local = sh == dh
    flows, links = [], []
    # inside a host: NVLink out of the source GPU, into the destination GPU
    flows += [fid[local], fid[local]]
    links += [b[2] + src[local], b[3] + dst[local]]
    far = ~local
    f, sg, dg = fid[far], src[far], dst[far]
    sn, dn = fab.nic_of_gpu(sg), fab.nic_of_gpu(dg)
    if routing == "rail" and s.rail_optimized:
        # PXN: hop over NVLink to the GPU of the source host on the destination's rail
        relay = (sg // s.gpus) * s.gpus + dg % s.gpus
        hop = relay != sg
        flows += [f[hop], f[hop]]
        links += [b[2] + sg[hop], b[3] + relay[hop]]
        sn = fab.nic_of_gpu(relay)
    flows += [f, f]
    links += [b[0] + sn, b[1] + dn]
    ts, td = fab.tor_of_nic(sn), fab.tor_of_nic(dn)
    up = ts != td
    f, sn, dn, ts, td = f[up], sn[up], dn[up], ts[up], td[up]
    ps, pd = ts // fab.tors_per_pod, td // fab.tors_per_pod
    cross_pod = ps != pd
    U, V = fab.U, max(fab.V, 1)
    if routing == "ecmp":
        sp = np.asarray(sport)[f]
        h1 = mix64(sn, dn, sp, np.full(len(f), ROCE_DPORT), np.full(len(f), UDP),
                   np.full(len(f), salt))
        h2 = h1 if polarized else mix64(sn, dn, sp, np.full(len(f), ROCE_DPORT),
                                        np.full(len(f), UDP), np.full(len(f), salt + 7919))
        a = (h1 % np.uint64(U)).astype(np.int64)
        v = (h2 % np.uint64(V)).astype(np.int64)
    elif routing == "rail":
        # D-mod-k on the destination's port number below its ToR, offset by the ToR's index in
        # its pod so that the rails' ToRs of one group climb to different aggregation switches
        dhost, rail = np.divmod(dn, s.nics)
        port = dhost % s.hosts_per_tor_group
        if not s.rail_optimized:
            port = port * s.nics + rail
        key = port + td % fab.tors_per_pod
        a, v = key % U, (key // U) % V
    elif routing == "adaptive":            # sprayed: the pooled links
        c = cross_pod
        flows += [f, f, f[c], f[c]]
        links += [b[8] + ts, b[9] + td, b[10] + ps[c], b[11] + pd[c]]
        return Routed(np.concatenate(flows), np.concatenate(links).astype(np.int64), nf)
    else:
        a, v = _adaptive(fab, ts, td, ps, pd, cross_pod, np.asarray(nbytes, float)[f])
    flows += [f, f]
    links += [b[4] + ts * U + a, b[5] + td * U + a]
    c = cross_pod
    flows += [f[c], f[c]]
    links += [b[6] + (ps[c] * U + a[c]) * V + v[c], b[7] + (pd[c] * U + a[c]) * V + v[c]]
    return Routed(np.concatenate(flows), np.concatenate(links).astype(np.int64), nf)


def _adaptive(fab: Fabric, ts, td, ps, pd, cross_pod, nbytes):
    """Greedy least-loaded path choice, flow after flow (loads in seconds of link time).
    A Python loop over the flows that leave their ToR only: it runs once per pattern, before
    the simulation, and ring traffic has few such flows."""
    U, V = fab.U, max(fab.V, 1)
    cap = fab.capacity
    b = fab.base
    up = np.zeros((fab.n_tor, U))
    dn = np.zeros((fab.n_tor, U))
    cu = np.zeros((fab.n_pod, U, V))
    cd = np.zeros((fab.n_pod, U, V))
    t_tor = 1.0 / cap[b[4]] if fab.n_tor else 0.0
    t_core = 1.0 / cap[b[6]] if fab.V else 0.0
    a_out = np.zeros(len(ts), dtype=np.int64)
    v_out = np.zeros(len(ts), dtype=np.int64)
    order = np.argsort(-nbytes, kind="stable")   # largest first, as a greedy bin packer
    for i in order:
        x, y = ts[i], td[i]
        w = nbytes[i]
        if cross_pod[i]:
            p, q = ps[i], pd[i]
            cost = np.maximum(np.maximum(up[x], dn[y])[:, None], np.maximum(cu[p], cd[q]))
            k = int(np.argmin(cost))
            a, v = divmod(k, V)
            cu[p, a, v] += w * t_core
            cd[q, a, v] += w * t_core
            v_out[i] = v
        else:
            a = int(np.argmin(np.maximum(up[x], dn[y])))
        up[x, a] += w * t_tor
        dn[y, a] += w * t_tor
        a_out[i] = a
    return a_out, v_out
