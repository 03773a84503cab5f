"""Flow-level network simulator (myria.sim.netsim): fabrics, routing, collectives, against
max-min fairness, balls-into-bins and the alpha-beta model."""

import math
import re

import numpy as np
import pytest

from myria.errors import ConfigError
from myria.sim.hardware import ALPHA_BASE_S, ALPHA_INTER_S, ALPHA_INTRA_S
from myria.sim.netsim.fabric import Fabric, build, load_spec, spec_from_dict, with_uplinks
from myria.sim.netsim.flows import incidence, max_min_rates
from myria.sim.netsim.routing import route
from myria.sim.netsim.traffic import (
    SIMPLE_SLICE_BYTES,
    collective,
    simulate_collective,
    simulate_jobs,
)

# a two-tier non-blocking leaf-spine: 2 hosts (8 GPUs, 8 x 400G NICs) per ToR, 16 spines
LEAF_SPINE = {"name": "ls", "tiers": 2,
              "host": {"gpus": 8, "nics": 8, "nic_gbps": 400, "nvlink_gbs": 450},
              "tor": {"down_ports": 16, "up_ports": 16, "up_gbps": 400},
              "agg": {"down_ports": 8}}
TORS, HOSTS_PER_TOR = 8, 2


def cross_tor_ring(hosts_per_tor: int, tors: int, gpus: int = 8, tor_order=None) -> np.ndarray:
    """GPUs in a ring order where every host's successor is under the next ToR, so each ToR
    sends all its hosts' flows up and the next ToR receives exactly those (the ECMP worst
    case): host order (position under ToR, ToR)."""
    tor_order = range(tors) if tor_order is None else tor_order
    hosts = [t * hosts_per_tor + p for p in range(hosts_per_tor) for t in tor_order]
    return np.array([h * gpus + i for h in hosts for i in range(gpus)])[None, :]


def p_max_le(m: int, n: int, k: int) -> float:
    """P(max bin load <= k), m balls uniformly into n bins:
    m! [x^m] (sum_{j<=k} x^j / j!)^n / n^m."""
    base = np.array([1 / math.factorial(j) for j in range(k + 1)])
    poly = np.array([1.0])
    for _ in range(n):
        poly = np.convolve(poly, base)[: m + 1]
    return poly[m] * math.factorial(m) / n**m if len(poly) > m else 0.0


def fabric_max_distribution(m: int, n: int, experiments: int) -> np.ndarray:
    """P(K = k) for K the largest bin load over ``experiments`` independent throws."""
    cdf = np.array([p_max_le(m, n, k) ** experiments for k in range(m + 1)])
    return np.diff(np.concatenate([[0.0], cdf]))


def test_max_min_textbook_example():
    # link 0 (cap 1) shared by flows 0,1; link 1 (cap 2) by flows 1,2 -> 0.5, 0.5, 1.5
    a = incidence([[0], [0, 1], [1]], 2)
    r = max_min_rates(a, np.array([1.0, 2.0]), np.ones(3, bool))
    assert np.allclose(r, [0.5, 0.5, 1.5])


def test_presets_wiring_and_routes_follow_graph_edges():
    mega = load_spec("megascale")
    assert (mega.tor.down_ports, mega.tor.up_ports, mega.nic_gbps, mega.tor.up_gbps) == \
        (64, 32, 200, 400)                       # uplink = 2 x a (split) downlink
    fab = build(mega, 12288)
    assert (fab.n_tor, fab.n_pod) == (192, 6)   # 8 rails x 24 groups of 64 servers; 2,048/pod
    assert load_spec("llama3").agg.oversubscription(400) == pytest.approx(7.0)
    ft = load_spec("fat-tree")
    assert ft.tor.oversubscription(ft.nic_gbps) == ft.agg.oversubscription(400) == 1.0
    # every route is a walk in the networkx graph of a small rail-optimised 3-tier fabric
    small = Fabric(spec_from_dict({**LEAF_SPINE, "tiers": 3, "host": {**LEAF_SPINE["host"],
                                   "rail_optimized": True},
                                   "tor": {"down_ports": 2, "up_ports": 2, "up_gbps": 400},
                                   "agg": {"down_ports": 8, "up_ports": 2, "up_gbps": 400},
                                   "core": {"down_ports": 4}}), hosts=8)
    g = small.graph()
    import networkx as nx
    assert nx.is_strongly_connected(g)
    rng = np.random.default_rng(0)
    src, dst = rng.integers(0, small.n_gpu, 200), rng.integers(0, small.n_gpu, 200)
    r = route(small, src, dst, np.ones(200), "ecmp")
    names = small.link_names(r.link)
    for f in range(200):
        hops = [n for n, ff in zip(names, r.flow) if ff == f]
        if src[f] // 8 == dst[f] // 8:
            assert len(hops) == 2 and "nvswitch" in hops[0]
            continue
        tor_hops = [h for h in hops if "agg" in h or "core" in h]
        assert len(tor_hops) in (0, 2, 4)        # up and down the same number of tiers


def _cli_json(capsys, *argv: str) -> dict:
    import json

    from myria.cli import main

    assert main(["simulate-network", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_cli_defaults_are_nccls_and_reach_the_nics_aggregate_on_a_non_blocking_fat_tree(capsys):
    # as a user types it: NCCL's defaults (algorithm auto, 2 channels per NIC, 1 QP), on the
    # k=32 three-tier fat-tree the published figures (bench/RESULTS_network.md) were made on
    fat = ("--topology", "fat-tree-3tier-k32", "--gpus", "1024", "--collective", "all-reduce")
    ada = _cli_json(capsys, *fat, "--bytes", "1G", "--routing", "adaptive")
    assert ada["ideal_busbw_gbs"] == pytest.approx(8 * 50.0)     # 8 NICs x 400G per host
    assert (ada["algorithm"], ada["channels"], ada["qps_per_connection"]) == ("tree", 16, 1)
    assert ada["busbw_gbs"] >= 0.9 * ada["ideal_busbw_gbs"]
    # ECMP with 1 QP per connection: hash collisions on the fabric cost a plausible share
    ecmp = _cli_json(capsys, *fat, "--bytes", "1G", "--routing", "ecmp")
    assert 0.3 < ecmp["fabric_efficiency"] < 0.8 and ecmp["busbw_gbs"] < 0.8 * ada["busbw_gbs"]
    # a forced ring (16 rings, two per NIC) loses nothing to the fabric, and NCCL's protocol
    # choice (LL128 here) hides the hops' latency behind the transfer: the step costs the
    # transfer at LL128's 120/128 line efficiency, >= 90% of the NICs' aggregate
    ring = _cli_json(capsys, *fat, "--bytes", "1G", "--algorithm", "ring", "--routing",
                     "adaptive")
    assert (ring["algorithm"], ring["protocol"], ring["channels"]) == ("ring", "ll128", 16)
    assert ring["fabric_efficiency"] == pytest.approx(1.0)
    assert ring["completion_time_s"] == pytest.approx(
        ALPHA_BASE_S + ring["ideal_time_s"] * 128 / 120, rel=1e-9)
    assert ring["busbw_gbs"] >= 0.9 * ring["ideal_busbw_gbs"]
    # under Simple each 64 KiB chunk is one slice, received whole before it is forwarded: the
    # latency adds, 2(k-1) steps across hosts and the other 2(n-1) - 2(k-1) over NVLink
    simple = _cli_json(capsys, *fat, "--bytes", "1G", "--algorithm", "ring", "--routing",
                       "adaptive", "--protocol", "simple")
    inter, steps = 2 * 127, 2 * 1023
    latency = ALPHA_BASE_S + inter * ALPHA_INTER_S + (steps - inter) * ALPHA_INTRA_S
    assert simple["completion_time_s"] == pytest.approx(simple["ideal_time_s"] + latency,
                                                        rel=1e-9)
    # ECMP: the ring loses to hash collisions, well below the adaptive ring
    ring_ecmp = _cli_json(capsys, *fat, "--bytes", "1G", "--algorithm", "ring", "--routing",
                          "ecmp")
    assert ring_ecmp["busbw_gbs"] < 0.6 * ring["busbw_gbs"]
    # which bandwidth amortises: at 8 GiB the ring reaches 90% too
    big = _cli_json(capsys, *fat, "--bytes", "8GiB", "--algorithm", "ring", "--routing",
                    "adaptive")
    assert big["busbw_gbs"] >= 0.9 * big["ideal_busbw_gbs"]


def _ecmp_runs(spec, qps=1, salts=range(80)):
    fab = Fabric(spec, TORS * HOSTS_PER_TOR)
    ring = cross_tor_ring(HOSTS_PER_TOR, TORS)
    coll = collective("all-reduce", ring, 1e9, "ring", 8, channels=8)   # one flow per NIC
    return [simulate_collective(fab, coll, "ecmp", qps, salt) for salt in salts]


def test_ecmp_max_link_load_matches_balls_into_bins():
    # each ToR hashes 16 flows onto 16 uplinks, the next ToR receives the same 16 flows on
    # the same spines' downlinks: the fabric's busiest link is the largest of 8 independent
    # balls-into-bins maxima
    runs = _ecmp_runs(spec_from_dict(LEAF_SPINE), salts=range(200))
    observed = np.mean([r["max_flows_on_a_fabric_link"] for r in runs])
    dist = fabric_max_distribution(16, 16, TORS)
    expected = float((np.arange(len(dist)) * dist).sum())
    assert abs(observed - expected) < 0.15, (observed, expected)   # ~3 standard errors
    # and the ring runs at 1/K of the NICs' rate (every flow of a collided link equally slow)
    for r in runs[:5]:
        assert r["fabric_efficiency"] == pytest.approx(1 / r["max_flows_on_a_fabric_link"])


def test_qps_adaptive_and_2x_uplinks_reduce_the_loss_as_theory_predicts():
    base = spec_from_dict(LEAF_SPINE)
    # 2x uplinks, MegaScale style: 8 uplinks of twice the NIC speed per ToR, 8 spines
    wide = with_uplinks(spec_from_dict({**LEAF_SPINE, "tor": {"down_ports": 16, "up_ports": 8,
                                                              "up_gbps": 400}}), 2.0)

    def theory(m, n, per_unit):
        dist = fabric_max_distribution(m, n, TORS)
        k = np.arange(len(dist))
        return float((dist / np.maximum(1.0, k / per_unit)).sum())

    measured = {
        "ecmp": np.mean([r["fabric_efficiency"] for r in _ecmp_runs(base)]),
        "qps4": np.mean([r["fabric_efficiency"] for r in _ecmp_runs(base, qps=4)]),
        "2x uplinks": np.mean([r["fabric_efficiency"] for r in _ecmp_runs(wide)]),
    }
    fab = Fabric(base, TORS * HOSTS_PER_TOR)
    ring = cross_tor_ring(HOSTS_PER_TOR, TORS)
    measured["adaptive"] = simulate_collective(
        fab, collective("all-reduce", ring, 1e9, "ring", 8, channels=8),
        "adaptive")["fabric_efficiency"]
    predicted = {"ecmp": theory(16, 16, 1), "qps4": theory(64, 16, 4),
                 "2x uplinks": theory(16, 8, 2), "adaptive": 1.0}
    for k in predicted:
        assert measured[k] == pytest.approx(predicted[k], abs=0.04), (k, measured, predicted)
    order = sorted(predicted, key=predicted.get)
    assert order == sorted(measured, key=measured.get) == ["ecmp", "2x uplinks", "qps4",
                                                           "adaptive"]


@pytest.mark.parametrize("nvlink_gbs", [450.0, 30.0])
def test_two_stage_ring_against_flat_ring_by_the_alpha_beta_amount(nvlink_gbs):
    spec = spec_from_dict({**LEAF_SPINE, "agg": {"down_ports": 16}, "host": {**LEAF_SPINE["host"],
                                                  "nvlink_gbs": nvlink_gbs}})
    n, g, size = 256, 8, 64e6
    k = n // g
    fab = Fabric(spec, k)
    ranks = np.arange(n)[None, :]
    flat = simulate_collective(fab, collective("all-reduce", ranks, size, "ring", g),
                               "adaptive", protocol="simple")["completion_time_s"]
    two = simulate_collective(fab, collective("all-reduce", ranks, size, "two-stage-ring", g),
                              "adaptive", protocol="simple")["completion_time_s"]
    nic, nvl = spec.nic_gbps / 8 * 1e9, spec.nvlink_gbs * 1e9
    # flat ring: 2g channels, each GPU's NVLink port carries all of them, each NIC two; NCCL's
    # latency: 2(k-1) steps cross hosts, the others are NVLink hops
    inter, steps = 2 * (k - 1), 2 * (n - 1)
    ab_flat = (ALPHA_BASE_S + inter * ALPHA_INTER_S + (steps - inter) * ALPHA_INTRA_S
               + steps * size / (n * 2 * g) / min(nic / 2, nvl / (2 * g)))
    # NCCL's Simple protocol: the NVLink rings' 8 MB chunks move in 1 MiB slices, so a hop's
    # latency hides behind the chunk's transfer; the flat and rail rings' chunks are one slice
    slices = int(size / g // SIMPLE_SLICE_BYTES)
    t_in = size / g / nvl
    ab_two = (3 * ALPHA_BASE_S + 2 * (g - 1) * max(ALPHA_INTRA_S + t_in / slices, t_in)
              + 2 * (k - 1) * (ALPHA_INTER_S + size / (g * k) / nic))
    assert flat - two == pytest.approx(ab_flat - ab_two, rel=1e-6)
    if nvlink_gbs > 8 * spec.nic_gbps / 8:       # NVLink >> NIC: two-stage wins (fewer steps)
        assert two < flat


def test_hash_polarization_concentrates_core_traffic():
    fab = build("fat-tree-3tier-k32", 512)
    # ToRs alternate between the two pods (16 ToRs each): every flow crosses the core
    ring = cross_tor_ring(2, 32, tor_order=[t + 16 * p for t in range(16) for p in (0, 1)])
    coll = collective("all-reduce", ring, 1e9, "ring", 8)
    util = {}
    for pol in (False, True):
        out = simulate_collective(fab, coll, "ecmp", 1, 3, polarized=pol, top=1)
        util[pol] = out["max_flows_on_a_fabric_link"], out["fabric_efficiency"]
    # polarised: aggregation switch a sends everything to core a of its plane (16 ToRs x 16
    # flows / 16 aggregation switches = ~16 flows on one uplink); salted hashes spread them
    assert util[True][0] >= 2 * util[False][0] and util[True][1] < 0.5 * util[False][1]


def test_several_jobs_share_the_fabric_and_one_job_matches_the_step_reduction():
    fab = build("fat-tree", 64)
    a = collective("all-reduce", np.arange(32)[None, :], 64e6, "ring", 8)
    alone = simulate_collective(fab, a, "ecmp", 1, 5, protocol="simple")["completion_time_s"]
    assert simulate_jobs(fab, [(a, "ecmp", 1)], salt=5)[0]["completion_time_s"] == \
        pytest.approx(alone, rel=1e-9)
    # same hosts: the all-to-all takes NIC and NVLink bandwidth from the ring
    c = collective("all-to-all", np.arange(32)[None, :], 64e6, "pairwise", 8)
    both = simulate_jobs(fab, [(a, "ecmp", 1), (c, "ecmp", 1)], salt=5)
    assert both[0]["completion_time_s"] > 1.05 * alone


def test_all_to_all_and_tree_are_nic_limited_on_a_non_blocking_fabric():
    fab = build("fat-tree", 64)
    ranks = np.arange(64)[None, :]
    size = 1e9
    out = simulate_collective(fab, collective("all-to-all", ranks, size, "pairwise", 8),
                              "adaptive")
    # 56/64 of a rank's bytes leave through its own 50 GB/s NIC
    assert out["ideal_time_s"] == pytest.approx(56 / 64 * size / 50e9, rel=1e-6)
    tree = simulate_collective(fab, collective("all-reduce", ranks, size, "tree", 8),
                               "adaptive")
    # each NIC sends (and receives) 2 x size/8 in the double binary tree
    assert tree["ideal_time_s"] == pytest.approx(2 * size / 8 / 50e9, rel=1e-6)


def test_bad_values_are_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="routing"):
        route(build("fat-tree", 16), [0], [9], [1.0], "spray")
    with pytest.raises(ConfigError, match="exceed"):
        build("fat-tree", 10**6)
    with pytest.raises(ConfigError, match="not a preset"):
        load_spec("nonesuch")
    bad = tmp_path / "f.toml"
    bad.write_text('tiers = 4\n[tor]\ndown_ports = 4\nup_ports = 4\nup_gbps = 100\n'
                   '[agg]\ndown_ports = 4\n')
    with pytest.raises(ConfigError, match="tiers = 4"):
        load_spec(str(bad))


def test_pfc_pauses_spread_upstream_and_make_victims_dcqcn_leaves_permutations_alone():
    from myria.sim.netsim.congestion import simulate_congestion
    from myria.sim.netsim.flows import incidence_of

    fab = build("fat-tree-3tier-k32", 64)         # 8 hosts, 2 per ToR

    def run(src, dst):
        nb = np.full(len(src), 4e6)
        r = route(fab, np.array(src), np.array(dst), nb, "flowlet")
        return simulate_congestion(fab, incidence_of(r.flow, r.link, r.n_flows, fab.links), nb)

    # 6:1 incast into GPU 0 plus a bystander from an incast source's NIC to GPU 1
    res = run([16, 24, 32, 40, 48, 56, 16], [0, 0, 0, 0, 0, 0, 1])
    s = res.summary()
    assert s["victim_flows"] == 1 and res.victim[6]
    paused = np.nonzero(res.paused_fraction)[0]
    tiers = set(fab.tier_of_link[paused])
    assert {5, 4, 0} <= tiers                     # agg->ToR, then ToR->agg, then the NICs
    assert s["completion_time_s"] > s["max_min_time_s"]
    # a permutation (host 2 -> host 0, one flow per GPU): no queue, no pause, ~max-min time
    s = run(list(range(16, 24)), list(range(0, 8))).summary()
    assert s["paused_links"] == 0 and s["max_queue_kb"] == 0
    assert s["completion_time_s"] == pytest.approx(s["max_min_time_s"], rel=0.1)


def test_equal_flows_shortcut_equals_the_event_driven_max_min():
    from myria.sim.netsim.flows import incidence_of, simulate_flows

    fab = build("fat-tree", 256)
    rng = np.random.default_rng(1)
    m = 400
    src, dst = rng.integers(0, 256, m), rng.integers(0, 256, m)
    for routing in ("ecmp", "flowlet"):
        r = route(fab, src, dst, np.ones(m), routing)
        a = incidence_of(r.flow, r.link, r.n_flows, fab.links)
        fast = simulate_flows(a, np.full(m, 1e6), fab.capacity)
        slow = simulate_flows(a, np.full(m, 1e6), fab.capacity, events=True)
        assert slow.events > 1 and fast.events == 1
        assert fast.completion_time_s == pytest.approx(slow.completion_time_s, rel=1e-9)
    # the double binary tree: NIC flows of half the NVLink chains' bytes, on other links
    from myria.sim.netsim.traffic import route_collective
    rp = route_collective(fab, collective("all-reduce", np.arange(96)[None, :], 1e9, "tree",
                                          8, 8), "ecmp")[0]
    fast = simulate_flows(rp.a, rp.phase.nbytes, fab.capacity)
    slow = simulate_flows(rp.a, rp.phase.nbytes, fab.capacity, events=True)
    assert len(np.unique(rp.phase.nbytes)) == 2 and slow.events > 1 and fast.events == 1
    assert fast.completion_time_s == pytest.approx(slow.completion_time_s, rel=1e-9)


def test_simulate_network_cli_contract(capsys, tmp_path):
    import json

    from myria.cli import main

    args = ["simulate-network", "--topology", "megascale", "--gpus", "1024", "--collective",
            "all-reduce", "--bytes", "256M", "--algorithm", "two-stage-ring", "--routing",
            "ecmp", "--qps-per-connection", "4", "--json"]
    assert main(args) == 0
    out = json.loads(capsys.readouterr().out)
    for key in ("completion_time_s", "busbw_gbs", "ideal_busbw_gbs", "max_link_utilization",
                "flows", "links", "wall_s"):
        assert key in out
    assert 0 < out["busbw_gbs"] <= out["ideal_busbw_gbs"] and out["flows"] > 0
    # a layout's data-parallel groups, a TOML fabric, a plot
    toml = tmp_path / "f.toml"
    toml.write_text('tiers = 2\n[host]\nnic_gbps = 200\n[tor]\ndown_ports = 16\nup_ports = 8\n'
                    'oversubscription = 2.0\n[agg]\ndown_ports = 16\n')
    png = tmp_path / "u.png"
    assert main(["simulate-network", "--topology", str(toml), "--gpus", "128", "--collective",
                 "all-reduce", "--bytes", "1G", "--layout", "tp=8,dp=16", "--group", "dp",
                 "--plot", str(png)]) == 0
    assert "16 ranks" in capsys.readouterr().out and png.stat().st_size > 0
    # several jobs at once: the data-parallel all-reduce with the pipeline sends of the layout
    assert main(["simulate-network", "--topology", "fat-tree", "--gpus", "256", "--collective",
                 "all-reduce", "--bytes", "64M", "--layout", "tp=8,pp=4,dp=8", "--group", "dp",
                 "--with", "ring-p2p:pp:32M", "--json"]) == 0
    jobs = json.loads(capsys.readouterr().out)["jobs"]
    assert [j["collective"] for j in jobs] == ["all-reduce", "ring-p2p"]
    assert all(j["slowdown"] >= 1 - 1e-9 for j in jobs)
    for bad, msg in ((["--gpus", "x"], "--gpus"), (["--bytes", "1X"], "--bytes"),
                     (["--gpus", "7"], "--gpus 7: must be a multiple of the 8 GPUs per host"),
                     (["--bytes", "-5G"], "--bytes '-5G': must be > 0"),
                     (["--channels", "0"], "--channels"),
                     (["--routing", "spray"], "--routing"), (["--algorithm", "rings"], "ring"),
                     (["--topology", "nope"], "not a preset")):
        argv = args[:-1] + bad
        assert main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert msg in err and len(err.splitlines()) == 1


def test_flow_pricing_hook_for_the_performance_model():
    import dataclasses

    from myria.sim.netsim.api import flow_pattern_factor
    from myria.sim.network import pattern_factor
    from myria.sim.topology import Fabric

    ada = Fabric(kind="fat-tree", nodes=64, routing="adaptive", model="flow")
    assert pattern_factor(ada, "ring", 64, 8).factor == pytest.approx(1.0)
    over = dataclasses.replace(ada, oversubscription=4.0)
    assert pattern_factor(over, "p2p", 2, 256).factor == pytest.approx(0.25, rel=0.01)
    one = Fabric(kind="fat-tree", nodes=64, routing="ecmp", flows_per_pair=1, model="flow")
    many = dataclasses.replace(one, flows_per_pair=16)
    f1, f16 = pattern_factor(one, "ring", 64, 8).factor, pattern_factor(many, "ring", 64, 8).factor
    assert f1 < 0.6 < f16
    hits = flow_pattern_factor.cache_info().hits
    assert flow_pattern_factor(one, "ring", 64, 8).factor == f1   # cached per fabric, pattern
    assert flow_pattern_factor.cache_info().hits == hits + 1
    # any collective over explicit groups on a netsim fabric, cached the same way
    from myria.sim.netsim.api import price_collective
    key = (tuple(range(64)),)
    out = price_collective(load_spec("fat-tree"), 64, "all-reduce", key, 1e9, "ring", "adaptive")
    assert out["ideal_busbw_gbs"] == pytest.approx(400.0)
    assert price_collective(load_spec("fat-tree"), 64, "all-reduce", key, 1e9, "ring",
                            "adaptive") is out


# -- simulate-network walkthrough defects ------------------------------------------------------

def _cli_err(capsys, *argv: str) -> str:
    """The one-line error of a refused simulate-network command (exit 2)."""
    from myria.cli import main

    assert main(["simulate-network", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


def _cli_text(capsys, *argv: str) -> str:
    from myria.cli import main

    assert main(["simulate-network", *argv]) == 0
    return capsys.readouterr().out


SMALL = ("--topology", "fat-tree", "--gpus", "64", "--collective", "all-reduce", "--bytes", "1G")


@pytest.mark.parametrize("section, key, close", [
    ("host", "nic_gbp", "nic_gbps"), ("tor", "up_gpbs", "up_gbps"),
    ("agg", "down_port", "down_ports"), ("core", "downports", "down_ports"),
    (None, "teirs", "tiers")])
def test_fabric_toml_refuses_unknown_keys_in_every_section(tmp_path, section, key, close):
    d = {**LEAF_SPINE, "tiers": 3, "core": {"down_ports": 2},
         "agg": {"down_ports": 8, "up_ports": 2, "up_gbps": 400}}
    d = {k: (dict(v) if isinstance(v, dict) else v) for k, v in d.items()}
    (d[section] if section else d)[key] = 100
    where = f"[{section}]" if section else "'ls'"
    with pytest.raises(ConfigError, match=re.escape(
            f"{where}: unknown key(s) [{key!r}] (did you mean {close!r}?)")):
        spec_from_dict(d, "ls")
    # as a user meets it: a misspelt NIC speed is refused, not priced at the preset's 400G
    toml = tmp_path / "f.toml"
    toml.write_text('tiers = 2\n[host]\nnic_gbp = 100\n[tor]\ndown_ports = 16\nup_ports = 16\n'
                    'up_gbps = 400\n[agg]\ndown_ports = 16\n')
    with pytest.raises(ConfigError, match=r"\[host\]: unknown key"):
        load_spec(str(toml))


def test_plot_path_is_checked_before_simulating(capsys, tmp_path, monkeypatch):
    import myria.sim.netsim.cli as cli

    def boom(*a, **k):
        raise AssertionError("simulated before checking --plot")

    monkeypatch.setattr(cli, "simulate_collective", boom)
    err = _cli_err(capsys, *SMALL, "--plot", str(tmp_path / "nope" / "u.png"))
    assert "its directory" in err and "does not exist" in err
    err = _cli_err(capsys, *SMALL, "--plot", str(tmp_path / "u.txt"))
    assert "'.txt'" not in err and ".png" in err and ".pdf" in err and "u.txt" in err


def test_algorithm_must_belong_to_the_collective_and_labels_say_what_ran(capsys):
    base = ("--topology", "fat-tree", "--gpus", "64", "--bytes", "1G")
    for kind, has in (("all-to-all", "auto, pairwise"), ("ring-p2p", "auto, p2p"),
                      ("all-gather", "auto, ring, two-stage-ring"),
                      ("reduce-scatter", "auto, ring, two-stage-ring")):
        err = _cli_err(capsys, *base, "--collective", kind, "--algorithm", "tree")
        assert f"--algorithm 'tree': {kind} has {has}" in err
    a2a = _cli_json(capsys, *base, "--collective", "all-to-all")
    assert a2a["algorithm"] == "pairwise"
    line = _cli_text(capsys, *base, "--collective", "all-to-all").splitlines()[1]
    assert line.startswith("all-to-all (pairwise, ") and "ring" not in line
    assert _cli_json(capsys, *base, "--collective", "ring-p2p")["algorithm"] == "p2p"
    # --with is held to the same rule, and names itself
    err = _cli_err(capsys, *SMALL, "--layout", "tp=8,dp=8", "--with", "all-to-all:tp:1M:tree")
    assert err.endswith("--with 'all-to-all:tp:1M:tree': algorithm 'tree': all-to-all has "
                        "auto, pairwise")
    # the library holds callers to the same rule: an all-to-all is not a ring
    assert collective("all-to-all", np.arange(16)[None, :], 1e6, "pairwise", 8).algorithm == \
        "pairwise"
    with pytest.raises(ConfigError, match="all-to-all has pairwise"):
        collective("all-to-all", np.arange(16)[None, :], 1e6, "ring", 8)
    with pytest.raises(ConfigError, match="all-gather has ring, two-stage-ring"):
        collective("all-gather", np.arange(16)[None, :], 1e6, "tree", 8)


def test_expert_parallel_groups_follow_myrias_trainer():
    from myria.sim.netsim.layout import layout_groups, parse_layout

    spec = load_spec("fat-tree")
    # tp 2 x dp 32 (ep 4 inside dp): an ep group is 4 consecutive members of a dp group, as
    # expert_meshes splits dp_shard (dp_shard / ep, ep) with ep fastest and the planner's
    # collectives.layout_groups prices it (stride tp)
    lay = parse_layout("tp=2,dp=32,ep=4")
    ep = layout_groups(lay, spec, "ep")
    dp = layout_groups(lay, spec, "dp")
    assert ep.shape == (16, 4)
    assert (ep == dp.reshape(-1, 4)).all()
    assert sorted(map(tuple, ep.tolist()))[:2] == [(0, 2, 4, 6), (1, 3, 5, 7)]
    with pytest.raises(ConfigError, match="ep = 3 must divide dp = 32"):
        parse_layout("tp=2,dp=32,ep=3")


def test_moe_all_to_all_over_expert_parallel_groups_from_the_cli(capsys):
    out = _cli_json(capsys, "--topology", "clos3", "--gpus", "4096", "--collective",
                    "all-to-all", "--bytes", "1M", "--layout", "tp=1,pp=1,ep=64,dp=4096",
                    "--group", "ep")
    assert (out["groups"], out["ranks"], out["algorithm"]) == (64, 64, "pairwise")
    assert out["flows"] == 64 * 64 * 63


def test_sizes_and_times_are_printed_in_readable_units(capsys):
    base = ("--topology", "fat-tree", "--gpus", "64", "--collective", "all-reduce")
    out = _cli_text(capsys, *base, "--bytes", "4KiB")
    assert "4.096 KB per rank" in out and "e-0" not in out and " µs;" in out
    out = _cli_text(capsys, *base, "--bytes", "1")
    assert "1 B per rank" in out and "e-0" not in out
    out = _cli_text(capsys, *base, "--bytes", "1e15")
    completion = out.splitlines()[2]
    assert re.search(r"completion \d+\.\d{3} s;", completion), completion
    # adaptive routing pools a ToR's uplinks: no flow count per link to report
    adaptive = _cli_text(capsys, *base, "--bytes", "1G", "--routing", "adaptive")
    assert "most flows on one switch link" not in adaptive
    assert "spread over all its equal-cost uplinks (adaptive)" in adaptive
    ecmp = _cli_text(capsys, *base, "--bytes", "1G", "--routing", "ecmp")
    assert re.search(r"most flows on one switch link: [1-9]", ecmp)


def test_group_and_with_need_a_layout_and_with_names_itself(capsys):
    assert _cli_err(capsys, *SMALL, "--group", "dp").endswith(
        "--group needs --layout (its groups say who talks to whom)")
    assert _cli_err(capsys, *SMALL, "--with", "ring-p2p:pp:1M").endswith(
        "--with needs --layout (its groups say who talks to whom)")
    err = _cli_err(capsys, *SMALL, "--layout", "tp=8,dp=8", "--with", "all-reduce:tpp:1M")
    assert "--with 'all-reduce:tpp:1M': group 'tpp': valid are" in err
    assert "--group 'tpp'" not in err


def test_fat_tree_and_clos3_presets_are_plans_fabrics():
    from myria.sim.netsim.api import spec_of
    from myria.sim.topology import Fabric as PlanFabric

    def shape(s):
        return (s.tiers, s.gpus, s.nics, s.nic_gbps, s.rail_optimized, s.tor, s.agg, s.core)

    ft, clos3 = load_spec("fat-tree"), load_spec("clos3")
    # plan's default fat-tree as big as a radix-64 spine reaches (64 leaves x 4 servers)
    assert ft.max_gpus == 2048 and ft.hosts_per_tor_group == 4
    assert shape(ft) == shape(spec_of(PlanFabric(kind="fat-tree", nodes=256)))
    assert clos3.max_gpus == 65536
    assert shape(clos3) == shape(spec_of(PlanFabric(kind="clos3", nodes=8192)))
    with pytest.raises(ConfigError, match="4096 GPUs exceed its 2048 .*clos3"):
        build("fat-tree", 4096)
    # the old three-tier k=32 fat-tree keeps a name that says what it is
    old = load_spec("fat-tree-3tier-k32")
    assert (old.tiers, old.tor.down_ports, old.max_gpus) == (3, 16, 8192)


def test_routing_and_flows_are_in_the_header_and_the_defaults_match_the_planner(capsys):
    import argparse

    from myria.sim.netsim.cli import add_arguments
    from myria.sim.topology import Fabric as PlanFabric

    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(["--topology", "x", "--gpus", "8", "--collective", "all-reduce",
                         "--bytes", "1"])
    assert args.routing == PlanFabric().routing == "adaptive"
    # 1 QP per connection over NCCL's 2 channels per NIC: the planner's 2 flows per pair
    assert int(args.qps_per_connection) * 2 == PlanFabric().flows_per_pair
    line = _cli_text(capsys, *SMALL).splitlines()[1]
    assert "adaptive routing, 1 flow(s) (QPs) per connection" in line
    line = _cli_text(capsys, *SMALL, "--routing", "ecmp", "--qps-per-connection", "4")
    assert "ecmp routing, 4 flow(s) (QPs) per connection" in line
    # the fabric keys are in the help, not in a source file
    text = p.format_help()
    assert "fabric.py" not in text and "nic_gbps" in text and "docs/network.md" in text


def test_a_collective_with_nothing_to_send_is_refused_and_a_fallback_algorithm_said(capsys):
    """ring-p2p on one server (one rank per group) sends nothing: refused in one line, not a
    result of 0 B/s; a tree asked for inside one server runs as a ring, and the output says so."""
    err = _cli_err(capsys, "--topology", "fat-tree", "--gpus", "8", "--collective", "ring-p2p",
                   "--bytes", "64M")
    assert "one rank each" in err and "nothing is sent" in err, err
    out = _cli_text(capsys, "--topology", "fat-tree", "--gpus", "8", "--collective",
                    "all-reduce", "--bytes", "1G", "--algorithm", "tree")
    assert "all-reduce (ring, " in out and "note: --algorithm tree runs as a ring here" in out
    out = _cli_text(capsys, *SMALL, "--algorithm", "tree")
    assert "double binary tree" in out or "(tree" in out, out
    assert "runs as a" not in out, out
