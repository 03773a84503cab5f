"""Traffic of collectives as flows, and their simulation on a fabric.

A collective is a list of *phases*; a phase is ``steps`` identical steps, each a set of flows
that run at once and a latency ``alpha`` (the alpha-beta model's per-hop latency, the constants
of ``myria.sim.hardware``). Communicators are rows of GPU ids in ring order (e.g. every
data-parallel group of a layout, from ``myria.parallel.placement``), all running at once; within
a row the members of one host are adjacent. Every step of a phase moves the same bytes between
the same pairs, so one step per phase is simulated and multiplied (phase time = steps x (alpha
+ step time)): exact for a collective running alone; ``simulate_jobs`` simulates several
collectives step by step, with flows arriving and finishing. Algorithms, NCCL's (defaults of
NCCL 2.30, ``nccl_channels``): ``ring``, ``two-stage-ring``, ``tree`` (all-reduce only), the
all-to-all's ``pairwise`` exchange, ``ring-p2p``'s ``p2p`` sends (``COLLECTIVE_ALGORITHMS``)
and ``auto`` (``best_algorithm``, NCCL's tuner without the fabric's congestion); a ring step is
priced by ``step_cost`` under LL128 or Simple (``--protocol auto`` takes the faster). How each
algorithm maps to flows: docs/network.md, "Reasons behind the network simulator modules".
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import scipy.sparse as sp

from myria.errors import ConfigError
from myria.sim.hardware import ALPHA_BASE_S, ALPHA_INTER_S, ALPHA_INTRA_S
from myria.sim.netsim.fabric import Fabric
from myria.sim.netsim.flows import incidence_of, max_min_rates, simulate_flows
from myria.sim.netsim.routing import route, source_ports

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "ring-p2p")
# the algorithms each collective has (``auto`` picks among them): all-to-all is every rank
# sending to every other one at once ("pairwise", NCCL's send/recv loop), not a ring; ring-p2p
# is one send per rank to the next ("p2p")
COLLECTIVE_ALGORITHMS = {"all-reduce": ("ring", "two-stage-ring", "tree"),
                         "all-gather": ("ring", "two-stage-ring"),
                         "reduce-scatter": ("ring", "two-stage-ring"),
                         "all-to-all": ("pairwise",), "ring-p2p": ("p2p",)}
PROTOCOLS = ("auto", "simple", "ll128")     # NCCL_PROTO (LL, for small messages, not modelled)
# LL128: 128-byte lines of 120 data bytes and an 8-byte flag (NCCL's NCCL_LL128_DATAELEMS = 15
# of NCCL_LL128_LINEELEMS = 16 eight-byte words), forwarded as they arrive
LL128_EFFICIENCY = 120 / 128
# Simple: a ring step's chunk moves in slices of SLICESTEPS x (buffer / NCCL_STEPS) = 2 x 4 MiB
# / 8 (NCCL's defaults), each forwarded once whole
SIMPLE_SLICE_BYTES = 2 * 4 * 2**20 / 8
MAXCHANNELS = 64               # NCCL's src/include/device.h
CHANNELS_PER_NIC = 2           # one search channel per NIC, duplicated (src/graph/connect.cc)
# nccl-tests bus bandwidth factor: busbw = algbw x factor(n)
BUS_FACTOR = {"all-reduce": lambda n: 2 * (n - 1) / n, "all-gather": lambda n: (n - 1) / n,
              "reduce-scatter": lambda n: (n - 1) / n, "all-to-all": lambda n: (n - 1) / n,
              "ring-p2p": lambda n: 1.0}


@dataclass
class Phase:
    src: np.ndarray
    dst: np.ndarray
    nbytes: np.ndarray
    steps: int
    alpha: float
    label: str
    # ring phases: the share of a ring's hops that cross hosts (the network proxy forwards whole
    # chunks there, whatever the protocol); -1 for phases that are not rings
    hop_store: float = -1.0
    chunk: float = 0.0      # a connection's bytes per step, when split into queue pairs


@dataclass
class Collective:
    kind: str
    algorithm: str
    size: float           # bytes per rank (nccl-tests convention)
    n: int                # ranks per communicator
    phases: list[Phase] = field(default_factory=list)
    base_alpha: float = ALPHA_BASE_S
    hosts: int = 1        # hosts a communicator spans
    nics: int = 0         # NICs its members own on one host (the 'ideal' is their aggregate)
    channels: int = 1


def step_cost(ph: Phase, ts: float, protocol: str) -> float:
    """Time of one step of phase ``ph`` whose transfers take ``ts`` alone, under NCCL's
    ``protocol`` (simple or ll128).

    A ring step is a pipeline, not a latency followed by a transfer: rank r's step s needs its
    neighbour's step s-1, so one hop's latency sits on the chain, while each link keeps sending
    the rest of the chunk. Per step the chain costs the hop latency plus what a hop must receive
    before it forwards (Simple: one slice of the chunk; LL128: nothing over NVLink, where lines
    are forwarded as they arrive, the whole chunk across hosts, where the network proxy sends
    full buffers), the links the chunk's transfer (at LL128's 120/128 line efficiency). A
    step costs the larger; when it is the transfer, the latency is hidden. Phases that are
    not rings, and phases whose chunk is one slice under Simple, cost latency + transfer."""
    if ph.hop_store < 0:
        return ph.alpha + ts
    if protocol == "ll128":
        return max(ph.alpha + ph.hop_store * ts, ts / LL128_EFFICIENCY)
    chunk = ph.chunk or float(ph.nbytes.max(initial=0.0))
    slices = max(1, int(chunk // SIMPLE_SLICE_BYTES))
    return max(ph.alpha + ts / slices, ts)


def nccl_channels(nics: int) -> int:
    """NCCL's default channel count for a communicator whose members own ``nics`` NICs on each
    host: one ring per NIC from the topology search, each duplicated, at most MAXCHANNELS
    (NCCL_MIN_NCHANNELS / NCCL_MAX_NCHANNELS override it; ``--channels`` here)."""
    return min(MAXCHANNELS, CHANNELS_PER_NIC * max(1, nics))


def nics_of(groups: np.ndarray, gpus_per_host: int, nics_per_host: int | None) -> int:
    """Distinct NICs the members of the first group own on its first host (NIC i serves GPU
    i * nics / gpus)."""
    nics = nics_per_host or gpus_per_host
    first = groups[0][groups[0] // gpus_per_host == groups[0, 0] // gpus_per_host]
    return len(np.unique((first % gpus_per_host) * nics // gpus_per_host))


def _blocks(groups: np.ndarray, gpus: int) -> np.ndarray | None:
    """Groups as (G, k hosts, g members) when every host holds g adjacent members."""
    G, n = groups.shape
    host = groups // gpus
    g = int((host[0] == host[0, 0]).sum())
    if n % g:
        return None
    b = host.reshape(G, n // g, g)
    heads = np.sort(b[:, :, 0], axis=1)
    if not (b == b[:, :, :1]).all() or (heads[:, 1:] == heads[:, :-1]).any():
        return None
    return groups.reshape(G, n // g, g)


def _cycle(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Flows of rings over the last axis: member i -> member i+1 (wrapping)."""
    return rows.reshape(-1), np.roll(rows, -1, axis=-1).reshape(-1)


def _ring_flows(blocks: np.ndarray, channels: int) -> tuple[np.ndarray, np.ndarray]:
    """Flows of one step of the flat ring with ``channels`` channels (see module doc)."""
    G, k, g = blocks.shape
    src, dst = [], []
    for c in range(channels):
        rolled = np.roll(blocks, -c, axis=2)
        if g > 1:
            s, d = _cycle(rolled)
            src.append(s)
            dst.append(d)
        if k > 1:
            s, d = _cycle(rolled[:, :, 0])
            src.append(s)
            dst.append(d)
    return np.concatenate(src), np.concatenate(dst)


def btree_parent(k: int) -> np.ndarray:
    """Parent of every position in NCCL's binary tree over k ranks (``ncclGetBtree``): rank r's
    parent is (r xor b) | 2b for b its lowest set bit, or r xor b when that is >= k; 0 is the
    root and odd ranks are leaves."""
    r = np.arange(k, dtype=np.int64)
    bit = r & -r
    up = (r ^ bit) | (bit << 1)
    up = np.where(up >= k, r ^ bit, up)
    up[0] = -1
    return up


def _tree_flows(blocks: np.ndarray, channels: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Flows of the double binary tree (both trees, both directions) and intra-host chains,
    with their shares of the buffer."""
    G, k, g = blocks.shape
    src, dst, share = [], [], []
    child = np.arange(1, k)
    parent = btree_parent(k)
    # the second tree: mirrored (k even) or shifted (k odd), as NCCL does, so that a host
    # interior in one tree is a leaf in the other
    second = k - 1 - np.arange(k) if k % 2 == 0 else (np.arange(k) + 1) % k
    for c in range(channels):
        rolled = np.roll(blocks, -c, axis=2)
        heads = rolled[:, :, 0]
        for lab in (np.arange(k), second):             # tree position -> host slot
            a, p = heads[:, lab[child]], heads[:, lab[parent[child]]]
            for s, d in ((a, p), (p, a)):
                src.append(s.reshape(-1))
                dst.append(d.reshape(-1))
                share.append(np.full(s.size, 0.5 / channels))
        if g > 1:
            s, d = rolled[:, :, :-1].reshape(-1), rolled[:, :, 1:].reshape(-1)
            for x, y in ((s, d), (d, s)):
                src.append(x)
                dst.append(y)
                share.append(np.full(x.size, 1.0 / channels))
    return np.concatenate(src), np.concatenate(dst), np.concatenate(share)


def collective(kind: str, groups: np.ndarray, size: float, algorithm: str, gpus_per_host: int,
               nics_per_host: int | None = None, channels: int | None = None) -> Collective:
    """The phases of ``kind`` over every row of ``groups`` (GPU ids, ring order) at once, on
    ``channels`` channels (None: NCCL's default, ``nccl_channels``)."""
    if kind not in COLLECTIVES:
        raise ConfigError(f"collective = {kind!r}: valid are {', '.join(COLLECTIVES)}")
    has = COLLECTIVE_ALGORITHMS[kind]
    if algorithm not in has:
        raise ConfigError(f"algorithm = {algorithm!r}: {kind} has {', '.join(has)}")
    if size <= 0:
        raise ConfigError(f"bytes = {size:g}: must be > 0")
    groups = np.atleast_2d(np.asarray(groups, dtype=np.int64))
    G, n = groups.shape
    out = Collective(kind, algorithm, float(size), n)
    if n < 2:
        return out
    blocks = _blocks(groups, gpus_per_host)
    if blocks is None:                         # irregular: one member per "host block"
        blocks = groups.reshape(G, n, 1)
    _, k, g = blocks.shape
    a_step = ALPHA_INTER_S if k > 1 else ALPHA_INTRA_S
    out.hosts, out.nics = k, nics_of(groups, gpus_per_host, nics_per_host)
    if channels is not None and channels < 1:
        raise ConfigError(f"channels = {channels}: must be >= 1")
    if k == 1:
        channels = 1          # inside one host: NVLink ports limit, whatever the channels
    elif channels is None:
        channels = nccl_channels(out.nics)
    out.channels = channels

    def const(x, v):
        return np.full(len(x), float(v))

    if kind == "all-to-all":
        i, j = np.nonzero(~np.eye(n, dtype=bool))
        src, dst = groups[:, i].reshape(-1), groups[:, j].reshape(-1)
        out.phases.append(Phase(src, dst, const(src, size / n), 1, (n - 1) * a_step,
                                "all-to-all"))
        return out
    if kind == "ring-p2p":
        src, dst = _cycle(groups)
        out.phases.append(Phase(src, dst, const(src, size), 1, 0.0, "p2p"))
        return out
    two = algorithm == "two-stage-ring" and k > 1 and g > 1
    tree = algorithm == "tree" and kind == "all-reduce" and k > 1
    if not (two or tree):
        out.algorithm = "ring"                 # what runs (one host, one GPU per host, ...)
    if tree:
        src, dst, share = _tree_flows(blocks, channels)
        lat = 2 * (math.ceil(math.log2(k)) * ALPHA_INTER_S + (g - 1) * ALPHA_INTRA_S)
        out.phases.append(Phase(src, dst, share * size, 1, lat, "double binary tree"))
        return out
    if not two:
        src, dst = _ring_flows(blocks, channels)
        steps = (2 if kind == "all-reduce" else 1) * (n - 1)
        inter = (2 if kind == "all-reduce" else 1) * (k - 1)     # NCCL's nInterSteps
        alpha = (inter * ALPHA_INTER_S + (steps - inter) * ALPHA_INTRA_S) / steps
        out.phases.append(Phase(src, dst, const(src, size / (n * channels)), steps, alpha,
                                f"ring {kind}", inter / steps))
        return out
    out.channels = g                                      # one ring per rail across hosts
    s_in, d_in = _cycle(blocks)                           # NVLink rings inside hosts
    s_x, d_x = _cycle(np.swapaxes(blocks, 1, 2))         # one ring per rail across hosts
    intra = Phase(s_in, d_in, const(s_in, size / g), g - 1, ALPHA_INTRA_S, "NVLink ring", 0.0)
    x_steps = (2 if kind == "all-reduce" else 1) * (k - 1)
    inter = Phase(s_x, d_x, const(s_x, size / (g * k)), x_steps, ALPHA_INTER_S, "rail rings",
                  1.0)
    if kind == "all-reduce":
        out.phases += [intra, inter, Phase(s_in, d_in, intra.nbytes, g - 1, ALPHA_INTRA_S,
                                           "NVLink all-gather", 0.0)]
    elif kind == "reduce-scatter":
        out.phases += [intra, inter]
    else:
        out.phases += [inter, intra]
    out.base_alpha = ALPHA_BASE_S * len(out.phases)
    return out


@dataclass
class RoutedPhase:
    phase: Phase
    a: sp.csr_matrix


def route_collective(fab: Fabric, coll: Collective, routing: str, qps: int = 1, salt: int = 0,
                     polarized: bool = False) -> list[RoutedPhase]:
    """Route every phase; each connection is split into ``qps`` flows (queue pairs) with their
    own source ports (NCCL_IB_QPS_PER_CONNECTION)."""
    if qps < 1:
        raise ConfigError(f"qps_per_connection = {qps}: must be >= 1")
    out = []
    for i, ph in enumerate(coll.phases):
        src, dst = np.repeat(ph.src, qps), np.repeat(ph.dst, qps)
        nb = np.repeat(ph.nbytes / qps, qps)
        if src.max(initial=0) >= fab.n_gpu or dst.max(initial=0) >= fab.n_gpu:
            raise ConfigError(f"traffic reaches GPU {max(src.max(), dst.max())} but the fabric "
                              f"has {fab.n_gpu}")
        r = route(fab, src, dst, nb, routing, source_ports(len(src), salt * 1009 + i), salt,
                  polarized)
        out.append(RoutedPhase(Phase(src, dst, nb, ph.steps, ph.alpha, ph.label, ph.hop_store,
                                     float(ph.nbytes.max(initial=0.0))),
                               incidence_of(r.flow, r.link, r.n_flows, fab.links)))
    return out


def _step_time(rp: RoutedPhase, capacity: np.ndarray) -> tuple[float, int]:
    if not len(rp.phase.nbytes):
        return 0.0, 0
    res = simulate_flows(rp.a, rp.phase.nbytes, capacity)
    return res.completion_time_s, res.events


def _protocols(protocol: str) -> tuple[str, ...]:
    if protocol not in PROTOCOLS:
        raise ConfigError(f"protocol = {protocol!r}: valid are {', '.join(PROTOCOLS)}")
    return ("simple", "ll128") if protocol == "auto" else (protocol,)


def _timed(coll: Collective, steps: list[tuple[Phase, float]], protocol: str
           ) -> tuple[float, str]:
    """(completion time, protocol) of phases with step transfer times ``steps``: the
    protocol asked, or with ``auto`` (NCCL_PROTO unset) the faster of Simple and LL128."""
    return min(((coll.base_alpha + sum(ph.steps * step_cost(ph, ts, p) for ph, ts in steps), p)
                for p in _protocols(protocol)), key=lambda tp: tp[0])


def ideal_time(fab: Fabric, coll: Collective, protocol: str = "auto") -> float:
    """Completion time of ``coll`` when only NICs and NVLink limit, latencies included: what
    NCCL's tuner can see (the route does not matter on those links)."""
    cap = np.where(fab.edge_links, fab.capacity, np.inf)
    return _timed(coll, [(rp.phase, _step_time(rp, cap)[0])
                         for rp in route_collective(fab, coll, "adaptive")], protocol)[0]


def best_algorithm(fab: Fabric, kind: str, groups: np.ndarray, size: float, gpus_per_host: int,
                   nics_per_host: int | None = None, channels: int | None = None,
                   protocol: str = "auto") -> Collective:
    """``algorithm = "auto"``, as NCCL_ALGO unset: the ring, or for all-reduce the double binary
    tree if its NIC/NVLink-limited time is smaller (see the module doc)."""
    cands = ("ring", "tree") if kind == "all-reduce" else COLLECTIVE_ALGORITHMS[kind][:1]
    colls = [collective(kind, groups, size, a, gpus_per_host, nics_per_host, channels)
             for a in cands]
    if len(colls) == 1 or colls[1].algorithm == "ring":
        return colls[0]
    return min(colls, key=lambda c: ideal_time(fab, c, protocol))


def simulate_collective(fab: Fabric, coll: Collective, routing: str = "ecmp", qps: int = 1,
                        salt: int = 0, polarized: bool = False, top: int = 5,
                        protocol: str = "auto") -> dict:
    """Completion time, bus bandwidth against the ideal (only NICs and NVLink limit, no
    latency), link utilisation, for ``coll`` alone on ``fab`` (one step per phase, see the
    module doc), under NCCL's ``protocol`` (auto: the faster of Simple and LL128)."""
    _protocols(protocol)
    routed = route_collective(fab, coll, routing, qps, salt, polarized)
    ideal_cap = np.where(fab.edge_links, fab.capacity, np.inf)
    t_ideal, t_xfer, events = 0.0, 0.0, 0
    steps = []
    link_bytes = np.zeros(fab.links)
    max_flows = 0
    for rp in routed:
        ts, ev = _step_time(rp, fab.capacity)
        ti, _ = _step_time(rp, ideal_cap)
        steps.append((rp.phase, ts))
        t_xfer += rp.phase.steps * ts
        t_ideal += rp.phase.steps * ti
        events += ev
        link_bytes += rp.phase.steps * (rp.a.T @ rp.phase.nbytes)
        fab_links = fab.switch_links
        if fab_links.any():
            counts = np.asarray(rp.a.sum(axis=0)).ravel()
            max_flows = max(max_flows, int(counts[fab_links].max(initial=0)))
    t, proto = _timed(coll, steps, protocol)
    out = _report(fab, coll, t, t_ideal, link_bytes, sum(len(r.phase.src) for r in routed),
                  events, max_flows, top)
    out["protocol"] = proto
    out["transfer_time_s"] = t_xfer
    out["fabric_efficiency"] = t_ideal / t_xfer if t_xfer > 0 else 1.0
    if routing == "adaptive":   # every flow spread over all its uplinks: no count per link
        out["max_flows_on_a_fabric_link"] = None
    return out


def _report(fab, coll, t, t_ideal, link_bytes, flows, events, max_flows, top) -> dict:
    factor = BUS_FACTOR[coll.kind](coll.n) if coll.n > 1 else 0.0
    # the ideal bus bandwidth: across hosts, the aggregate of the NICs the members own on a host
    # (no algorithm that moves the data through the NICs beats it; NVLS/SHARP in-network
    # reduction is not modelled); otherwise the same flows with only NICs and NVLink limiting
    if coll.hosts > 1 and coll.kind in ("all-reduce", "all-gather", "reduce-scatter"):
        ideal_bus = coll.nics * fab.spec.nic_gbps / 8
    else:
        ideal_bus = factor * coll.size / t_ideal / 1e9 if t_ideal > 0 else 0.0
    util = np.divide(link_bytes, fab.capacity * t, out=np.zeros(fab.links),
                     where=fab.capacity * t > 0)
    used = link_bytes > 0
    fabric = used & ~fab.edge_links
    order = np.argsort(-util)[:top]
    pct = (np.percentile(util[fabric], [50, 90, 99, 100]).tolist() if fabric.any()
           else [0.0] * 4)
    return {
        "completion_time_s": t,
        "algbw_gbs": coll.size / t / 1e9 if t > 0 else 0.0,
        "busbw_gbs": factor * coll.size / t / 1e9 if t > 0 else 0.0,
        "ideal_busbw_gbs": ideal_bus,
        "ideal_time_s": t_ideal,
        "max_link_utilization": float(util.max(initial=0.0)),
        "fabric_link_utilization_p50_p90_p99_max": pct,
        "max_flows_on_a_fabric_link": max_flows,
        "most_congested_links": [{"link": name, "utilization": float(util[i])}
                                 for name, i in zip(fab.link_names(order), order)
                                 if util[i] > 0],
        "flows": int(flows),
        "links": int(used.sum()),
        "events": int(events),
        "collective": coll.kind, "algorithm": coll.algorithm, "ranks": coll.n,
        "channels": coll.channels,
        "bytes": coll.size,
        "_fabric_util": util[fabric],       # for plots; not JSON
    }


def simulate_jobs(fab: Fabric, jobs: list[tuple[Collective, str, int]], salt: int = 0
                  ) -> list[dict]:
    """Several collectives at once (``(collective, routing, qps)`` each), step by step: a step's
    flows start ``alpha`` after the job's previous step ends and share the fabric max-min
    fairly with whatever else runs. Returns each job's completion time and bus bandwidth."""
    phases, owner = [], []        # (job, phase index) -> routed phase
    for j, (coll, routing, qps) in enumerate(jobs):
        for rp in route_collective(fab, coll, routing, qps, salt + 31 * j):
            phases.append(rp)
            owner.append(j)
    a = sp.vstack([rp.a for rp in phases]).tocsr() if phases else None
    at = a.T.tocsr() if a is not None else None
    sizes = [len(rp.phase.nbytes) for rp in phases]
    start = np.concatenate([[0], np.cumsum(sizes)])
    nbytes = np.concatenate([rp.phase.nbytes for rp in phases]) if phases else np.zeros(0)
    left = np.zeros(len(nbytes))
    active = np.zeros(len(nbytes), dtype=bool)
    # per job: list of its phase ids, current position, step, time the next step starts
    plan = {j: [i for i, o in enumerate(owner) if o == j] for j in range(len(jobs))}
    pos = {j: 0 for j in plan}
    step = {j: 0 for j in plan}
    wake = {j: jobs[j][0].base_alpha + (phases[plan[j][0]].phase.alpha if plan[j] else 0)
            for j in plan}
    done_at = {j: (0.0 if not plan[j] else None) for j in plan}
    running = {j: False for j in plan}
    t = 0.0
    while any(v is None for v in done_at.values()):
        for j in plan:     # start steps whose latency has elapsed
            if done_at[j] is None and not running[j] and wake[j] <= t + 1e-15:
                p = plan[j][pos[j]]
                sl = slice(start[p], start[p + 1])
                left[sl], active[sl] = nbytes[sl], nbytes[sl] > 0
                running[j] = True
        rate = max_min_rates(a, fab.capacity, active, at) if active.any() else left * 0
        dt_flow = np.min(left[active] / rate[active]) if active.any() else np.inf
        pending = [wake[j] - t for j in plan if done_at[j] is None and not running[j]]
        dt = min([dt_flow] + pending)
        left[active] -= rate[active] * dt
        t += dt
        active &= left > 1e-9 * np.maximum(nbytes, 1e-30)
        for j in plan:     # steps that ended
            if not running[j]:
                continue
            p = plan[j][pos[j]]
            if active[start[p]:start[p + 1]].any():
                continue
            running[j] = False
            step[j] += 1
            if step[j] >= phases[p].phase.steps:
                step[j], pos[j] = 0, pos[j] + 1
            if pos[j] >= len(plan[j]):
                done_at[j] = t
            else:
                wake[j] = t + phases[plan[j][pos[j]]].phase.alpha
    out = []
    for j, (coll, _, _) in enumerate(jobs):
        tj = done_at[j]
        f = BUS_FACTOR[coll.kind](coll.n) if coll.n > 1 else 0.0
        out.append({"completion_time_s": tj, "busbw_gbs": f * coll.size / tj / 1e9
                    if tj else 0.0, "collective": coll.kind, "algorithm": coll.algorithm})
    return out
