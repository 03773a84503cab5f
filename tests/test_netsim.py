"""Flow-level network simulator: max-min sharing, ECMP collisions against balls-into-bins."""

import math

import numpy as np
import pytest

from myria.errors import ConfigError
from myria.sim.netsim.fabric import LeafSpine, connections, route
from myria.sim.netsim.flows import incidence, max_min_rates
from myria.sim.netsim.traffic import ring_all_reduce


def cross_leaf_ring(f: LeafSpine) -> list[int]:
    """Ring order in which every neighbour is on another leaf: each leaf sends hosts_per_leaf
    flows up, the worst case for ECMP."""
    return [(r % f.leaves) * f.hosts_per_leaf + r // f.leaves for r in range(f.hosts)]


def expected_max_load(m: int, n: int) -> float:
    """E[max bin load] for m balls thrown uniformly into n bins, exactly:
    P(max <= k) = m! [x^m] (sum_{j<=k} x^j/j!)^n / n^m."""
    def p_le(k):
        base = np.array([1 / math.factorial(j) for j in range(k + 1)])
        poly = np.array([1.0])
        for _ in range(n):
            poly = np.convolve(poly, base)[: m + 1]
        return poly[m] * math.factorial(m) / n**m if len(poly) > m else 0.0
    return sum(1 - p_le(k) for k in range(m))


def test_max_min_textbook_example():
    # link 0 (cap 1) shared by flows 0,1; link 1 (cap 2) by flows 1,2 -> 0.5, 0.5, 1.5
    a = incidence([[0], [0, 1], [1]], 2)
    r = max_min_rates(a, np.array([1.0, 2.0]), np.ones(3, bool))
    assert np.allclose(r, [0.5, 0.5, 1.5])


def test_adaptive_ring_reaches_ideal_busbw():
    f = LeafSpine(leaves=4, hosts_per_leaf=8, spines=8)
    out = ring_all_reduce(f, cross_leaf_ring(f), 1 << 28, routing="adaptive")
    assert out["busbw_gbs"] >= 0.95 * out["ideal_busbw_gbs"]


def test_ecmp_max_uplink_load_matches_balls_into_bins():
    f = LeafSpine(leaves=4, hosts_per_leaf=8, spines=8)
    ring = cross_leaf_ring(f)
    pairs = [(ring[i], ring[(i + 1) % len(ring)]) for i in range(len(ring))]
    maxima = []
    for salt in range(150):
        flows = connections(pairs, 1.0, 1, seed=salt)
        paths = route(f, flows, "ecmp", salt=salt)
        counts = np.zeros(f.links)
        for p in paths:
            counts[p] += 1
        for leaf in range(f.leaves):
            maxima.append(max(counts[f.uplink(leaf, s)] for s in range(f.spines)))
    expect = expected_max_load(8, 8)  # 8 flows up from each leaf onto 8 spines: ~2.56
    assert abs(np.mean(maxima) - expect) < 0.12, (np.mean(maxima), expect)


def test_qps_adaptive_and_uplinks_reduce_ecmp_loss_in_order():
    def loss(routing, qps=1, uplink=400.0):
        f = LeafSpine(leaves=4, hosts_per_leaf=8, spines=8, uplink_gbps=uplink)
        vals = [ring_all_reduce(f, cross_leaf_ring(f), 1 << 26, routing, qps, salt)
                for salt in range(6)]
        return 1 - np.mean([v["busbw_gbs"] / v["ideal_busbw_gbs"] for v in vals])

    ecmp, qps8, wide, ar = loss("ecmp"), loss("ecmp", 8), loss("ecmp", 1, 800.0), loss("adaptive")
    # balls into bins: slowest connection shares its uplink with ~E[max]-1 others -> ~60% loss;
    # 8 QPs average the collisions (the connection waits for its most loaded QP, smaller);
    # 2x uplinks halve the collided share; adaptive routing removes collisions.
    assert ecmp > 0.4
    assert ecmp > wide > ar and ecmp > qps8 > ar
    assert ar < 0.05


def test_bad_routing_is_a_config_error():
    f = LeafSpine(leaves=2, hosts_per_leaf=2, spines=2)
    with pytest.raises(ConfigError, match="routing"):
        route(f, connections([(0, 2)], 1.0, 1), "spray")
