"""The performance model's entry to the flow-level simulator, cached per topology and pattern.

``myria.sim.network.pattern_factor`` prices a traffic pattern (every group of ``size`` ranks
``stride`` apart running a ring, pipeline sends or an all-to-all at once) by a *fabric factor*:
the time the pattern takes when only the NICs (and NVLink) limit it, divided by its time on the
fabric. With ``cluster.network = "flow"`` semantics (``myria simulate --network flow``) that
factor comes from here: the analytic ``topology.Fabric`` is turned into a netsim fabric, the
pattern's flows are generated, routed (ECMP with the fabric's queue pairs per connection, or
adaptive) and simulated, and ``fabric_efficiency`` is returned; under ECMP it is the expected
value over ``ECMP_SEEDS`` hash seeds (the analytic formula prices one random draw). Results are
cached (``functools.lru_cache``) on the hashable fabric and pattern, so a planner search pays
once per distinct (fabric, pattern).

``price_collective`` is the general API: a collective of ``nbytes`` per rank over explicit
groups on a netsim fabric spec, cached on (spec, gpus, pattern, routing, QPs).
"""

from __future__ import annotations

import dataclasses
from functools import lru_cache

import numpy as np

from myria.errors import ConfigError
from myria.sim.netsim.fabric import Fabric, FabricSpec, Tier, build
from myria.sim.netsim.traffic import (
    Collective,
    Phase,
    best_algorithm,
    collective,
    nics_of,
    simulate_collective,
)
from myria.sim.topology import PatternResult, pattern_groups

MAX_FLOWS = 1_000_000
ECMP_SEEDS = 8
NETWORK_MODELS = ("analytic", "flow")


def spec_of(fabric) -> FabricSpec:
    """A netsim fabric equivalent to an analytic ``myria.sim.topology.Fabric`` (line rates in
    NIC units of 400G; only ratios matter for the factor)."""
    nic = 400.0
    half = max(1, fabric.radix // 2)
    rail = fabric.kind == "rail-optimized"
    nics = fabric.nics_per_node
    hosts_per_tor = half if rail else max(1, half // nics)
    tor_down = half if rail else hosts_per_tor * nics
    group = nics if rail else 1
    tors = -(-fabric.nodes // hosts_per_tor) * group
    if fabric.kind == "clos3":
        tors_per_pod = half if not rail else max(group, half // group * group)
        pods = -(-tors // tors_per_pod)
        tor = Tier(tor_down, half, tor_down * nic / half)
        agg = Tier(tors_per_pod, half, tors_per_pod * tor.up_gbps / (fabric.oversubscription
                                                                     * half))
        return FabricSpec("analytic-clos3", 3, fabric.gpus_per_node, nics, nic, 1e6, rail, tor,
                          agg, Tier(max(1, pods)))
    tor = Tier(tor_down, half, tor_down * nic / (fabric.oversubscription * half))
    tors = max(tors, group)
    return FabricSpec(f"analytic-{fabric.kind}", 2, fabric.gpus_per_node, nics, nic, 1e6, rail,
                      tor, Tier(tors))


def _pattern(kind: str, groups: np.ndarray, gpus: int, nics: int) -> Collective:
    if kind == "ring":
        # one channel per NIC: the performance model's ``flows_per_pair`` (default 2) already
        # stands for NCCL's connections per NIC pair (its duplicated channels), so NCCL's
        # default channel count here would count them twice
        return collective("all-reduce", groups, 1e9, "ring", gpus, nics,
                          channels=nics_of(groups, gpus, nics))
    if kind == "a2a":
        return collective("all-to-all", groups, 1e9, "pairwise", gpus, nics)
    src, dst = groups[:, :-1].reshape(-1), groups[:, 1:].reshape(-1)   # pipeline: no wrap
    out = Collective("ring-p2p", "p2p", 1e9, groups.shape[1])
    out.phases.append(Phase(src, dst, np.full(len(src), 1e9), 1, 0.0, "p2p"))
    return out


@lru_cache(maxsize=4096)
def flow_pattern_factor(fabric, kind: str, size: int, stride: int):
    """``pattern_factor`` by the flow-level simulator (same meaning, same result type)."""
    gpn = fabric.gpus_per_node
    q = fabric.flows_per_pair if fabric.routing == "ecmp" else 1
    groups, nodes = pattern_groups(fabric, kind, size, stride, MAX_FLOWS, ring_flows=2)
    if groups is None:
        return PatternResult(1.0, 0, nodes)
    if not ((groups // gpn) != (groups[:, :1] // gpn)).any():
        return PatternResult(1.0, 0, nodes)      # every group inside one server
    small = dataclasses.replace(fabric, nodes=nodes)
    spec = spec_of(small)
    fab = Fabric(spec, nodes)
    coll = _pattern(kind, groups, gpn, spec.nics)
    routing = "adaptive" if fabric.routing == "adaptive" else "ecmp"
    # ECMP: the expected time over ECMP_SEEDS hash seeds (a factor is a ratio of times, so
    # the times are averaged: harmonic mean of the factors); adaptive is deterministic
    seeds = range(ECMP_SEEDS) if routing == "ecmp" else range(1)
    outs = [simulate_collective(fab, coll, routing, q, salt=seed) for seed in seeds]
    factor = 1.0 / np.mean([1.0 / o["fabric_efficiency"] for o in outs])
    return PatternResult(min(1.0, float(factor)), int(outs[0]["flows"]), nodes)


@lru_cache(maxsize=1024)
def price_collective(spec: FabricSpec, gpus: int, kind: str, group_key: tuple, nbytes: float,
                     algorithm: str = "auto", routing: str = "ecmp", qps: int = 1,
                     channels: int | None = None) -> dict:
    """Completion time and bus bandwidth of ``kind`` over the groups ``group_key`` (a tuple of
    tuples of GPU ids, hashable for the cache) on ``spec`` sized for ``gpus`` GPUs; the
    defaults are NCCL's (see ``netsim.traffic``)."""
    fab = build(spec, gpus)
    groups = np.array(group_key, dtype=np.int64)
    if algorithm == "auto":
        coll = best_algorithm(fab, kind, groups, nbytes, spec.gpus, spec.nics, channels)
    else:
        coll = collective(kind, groups, nbytes, algorithm, spec.gpus, spec.nics, channels)
    out = simulate_collective(fab, coll, routing, qps)
    out.pop("_fabric_util", None)
    return out


def with_network_model(hw, model: str):
    """``hw`` (a ``myria.sim.hardware.Hardware``) whose fabric is priced by ``model``."""
    if model not in NETWORK_MODELS:
        raise ConfigError(f"--network {model!r}: valid are {', '.join(NETWORK_MODELS)}")
    return dataclasses.replace(hw, fabric=dataclasses.replace(hw.fabric, model=model))
