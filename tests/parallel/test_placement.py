"""Placement: the trainer's mesh order, TP inside hosts, every rank once, what groups cross."""

import numpy as np

from myria.parallel.placement import Cluster, crossing_summary, groups, place


def test_every_rank_placed_once_and_tp_inside_hosts():
    """The trainer's mesh order: TP inside a host, data parallelism next (a ring crosses each
    host boundary once), the pipeline outermost; switches only counted."""
    lay = {"pp": 4, "dp_shard": 4, "tp": 8}
    c = Cluster(ranks_per_host=8, hosts_per_switch=4)
    grid = place(lay, c)
    assert sorted(grid.flatten().tolist()) == list(range(128))
    s = crossing_summary(grid, c)
    assert s["tp"]["cross_host"] == 0
    assert s["dp_shard"]["cross_switch"] == 0   # 4 hosts of one data-parallel group, 1 switch
    assert s["pp"]["cross_switch"] == 32        # stages 32 ranks apart: every pipeline crosses
    # data-parallel groups list ranks in slot order: a ring crosses each host boundary once
    for g in groups(grid, "dp_shard"):
        assert g == sorted(g)


def test_cp_and_tp_share_a_host_when_they_fit():
    lay = {"dp_shard": 2, "cp": 2, "tp": 2}
    c = Cluster(ranks_per_host=4)
    s = crossing_summary(place(lay, c), c)
    assert s["cp"]["cross_host"] == 0 and s["tp"]["cross_host"] == 0
    assert s["dp_shard"] == {"groups": 4, "size": 2, "cross_host": 4, "cross_switch": 0,
                              "cross_fast_domain": 4}


def test_single_host_is_identity():
    lay = {"pp": 2, "dp_shard": 2, "cp": 1, "tp": 2}
    grid = place(lay, Cluster(ranks_per_host=8))
    assert np.array_equal(grid.reshape(-1), np.arange(8))


def test_dry_run_prints_placement():
    from tests.conftest import run_cli

    p = run_cli("train", "--config", "configs/gpt3-175b.toml", "--dry-run", "--nproc", "8",
                "--nnodes", "128", "--parallel.hosts_per_switch=32")
    assert "placement of 1024 ranks on 128 host(s)" in p.stdout
    assert "(dp, pp, cp, tp, ep)" in p.stdout and "cross switch" in p.stdout


def test_data_parallelism_follows_tp_at_the_strides_the_model_prices():
    """Data parallelism comes after TP and CP (Megatron-LM's order) and takes what is left of
    a host: each group's members lie at the strides the performance model prices
    (`layout.strides`)."""
    from myria.layout import strides

    lay = {"pp": 2, "dp_shard": 8, "tp": 2}
    c = Cluster(ranks_per_host=8)
    grid = place(lay, c)
    st = strides(lay)
    for dim in ("tp", "dp_shard", "pp"):
        for g in groups(grid, dim):
            assert [b - a for a, b in zip(g, g[1:])] == [st[dim]] * (len(g) - 1), (dim, g)
    s = crossing_summary(grid, c)
    assert s["dp_shard"]["cross_host"] == 4 and s["pp"]["cross_host"] == 16   # 4 of 8 in a host
