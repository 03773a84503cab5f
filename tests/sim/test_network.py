"""Collective costs (nccl-tests conventions) and the flow-level fabric model."""

from __future__ import annotations

import numpy as np
import pytest

from myria.sim import collectives as coll
from myria.sim.hardware import build_hardware
from myria.sim.network import max_min_rates, pattern_factor
from myria.sim.runspec import ClusterSpec
from myria.sim.topology import Fabric


def hw(gpus=32, **kw):
    return build_hardware(ClusterSpec(gpu="a100-sxm-80gb", gpus=gpus, **kw))


def test_intra_and_inter_node_bus_bandwidth():
    size = 4e9
    g8 = coll.make_group(hw(), 8, 1)
    t, algo = coll.allreduce(size, g8)
    assert coll.bus_bandwidth("allreduce", 8, size, t) / 1e9 == pytest.approx(230, rel=0.01)
    g32 = coll.make_group(hw(), 32, 1)   # 4 DGX A100 x 8 HDR NICs: ~192 GB/s published
    t, _ = coll.allreduce(size, g32)
    assert coll.bus_bandwidth("allreduce", 32, size, t) / 1e9 == pytest.approx(192, rel=0.03)
    rail = coll.make_group(hw(), 4, 8)   # one GPU per server: one NIC, 24 GB/s
    t, _ = coll.allreduce(size, rail)
    assert coll.bus_bandwidth("allreduce", 4, size, t) / 1e9 == pytest.approx(24, rel=0.02)
    t_rs, _ = coll.reduce_scatter(size, g8)
    assert coll.bus_bandwidth("reduce_scatter", 8, size, t_rs) / 1e9 == pytest.approx(
        230, rel=0.01)


def test_small_messages_prefer_tree_and_cost_latency():
    g = coll.make_group(hw(gpus=1024), 128, 8)
    t, algo = coll.allreduce(1e3, g)
    assert algo == "tree" and t > 1e-5
    assert coll.allreduce(1e9, coll.make_group(hw(), 1, 1)) == (0.0, "none")


def test_all_to_all_uses_one_nic_per_gpu():
    g = coll.make_group(hw(gpus=64), 64, 1)
    t, _ = coll.all_to_all(1e9, g)
    # 56/64 of the data leaves the server through one 24 GB/s NIC
    assert t == pytest.approx(56 / 64 * 1e9 / 24e9, rel=0.05)


def test_max_min_fairness():
    # two flows share link 0 (cap 1); flow 1 also crosses link 1 (cap 0.2)
    flow = np.array([0, 1, 1])
    link = np.array([0, 0, 1])
    rates = max_min_rates(flow, link, np.array([1.0, 0.2]), 2)
    assert rates == pytest.approx([0.8, 0.2])


def test_fabric_factors():
    full = Fabric(kind="fat-tree", nodes=64, routing="adaptive")
    assert pattern_factor(full, "p2p", 2, 256).factor == pytest.approx(1.0)
    over = Fabric(kind="fat-tree", nodes=64, routing="adaptive", oversubscription=4.0)
    assert pattern_factor(over, "p2p", 2, 256).factor == pytest.approx(0.25, rel=0.01)
    ecmp = Fabric(kind="fat-tree", nodes=64, routing="ecmp", flows_per_pair=1)
    assert pattern_factor(ecmp, "p2p", 2, 256).factor < 0.6     # hash collisions
    more = Fabric(kind="fat-tree", nodes=64, routing="ecmp", flows_per_pair=16)
    assert pattern_factor(more, "p2p", 2, 256).factor > pattern_factor(ecmp, "p2p", 2,
                                                                       256).factor
    # rail-optimized: same-rank rings stay on a rail switch, oversubscription is invisible
    rail = Fabric(kind="rail-optimized", nodes=32, routing="ecmp", oversubscription=4.0)
    assert pattern_factor(rail, "ring", 32, 8).factor == pytest.approx(1.0)
    # a 3-tier CLOS only pays its oversubscribed core between pods
    clos = Fabric(kind="clos3", nodes=256, routing="adaptive", oversubscription=7.0)
    assert pattern_factor(clos, "p2p", 2, 8 * 128).factor < 0.2
    assert "3-tier CLOS" in clos.describe()
