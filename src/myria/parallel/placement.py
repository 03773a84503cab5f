"""Rank placement: which global rank takes which (pp, dp, cp, tp) coordinate, and which groups
cross hosts, leaf switches and NVLink domains.

Launchers number ranks host by host (rank = host * ranks_per_host + local rank), and hosts are
numbered switch by switch. The trainer's mesh (`myria.layout.MESH_ORDER`) gives coordinates to
ranks with tensor parallelism varying fastest, then context parallelism, then data
parallelism, then the pipeline (Megatron-LM's order): TP (and CP, when it fits) groups stay
inside one host's fast domain (NVLink), data parallelism takes what is left of a host (the
larger gradient traffic), and data-parallel groups list their members in rank order, so a ring
over them crosses each host and switch boundary once (the topology-aware ring of NCCL, by
construction; MegaScale section 3.3). The performance model prices this order
(`sim.collectives.layout_groups`). `describe` reports it for a dry run, the switches
(`hosts_per_switch`) and NVLink domains only counting which groups cross them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from myria.layout import MESH_ORDER as DIMS  # outermost first, as the DeviceMesh (dims.py)


@dataclass
class Cluster:
    """What placement knows of the machines."""

    ranks_per_host: int
    hosts_per_switch: int = 0       # 0: all hosts under one switch
    fast_domain: int = 0            # ranks per NVLink domain; 0: one host
    host_names: list[str] | None = None

    def host_of(self, rank: int) -> int:
        return rank // self.ranks_per_host

    def switch_of(self, rank: int) -> int:
        return self.host_of(rank) // self.hosts_per_switch if self.hosts_per_switch else 0

    def domain_of(self, rank: int) -> int:
        size = self.fast_domain or self.ranks_per_host
        return rank // size

    def host_name(self, rank: int) -> str:
        h = self.host_of(rank)
        if self.host_names and h < len(self.host_names):
            return self.host_names[h]
        return f"host{h}"


def place(layout: dict[str, int], cluster: Cluster | None = None) -> np.ndarray:
    """Global ranks laid out as an array of shape (pp, dp_replicate, dp_shard, cp, tp), as the
    trainer's mesh has them: consecutive ranks fill tp first (`MESH_ORDER`). Launchers number
    ranks host by host and hosts switch by switch, so this needs nothing of the `cluster`,
    which only says what the groups cross."""
    sizes = [layout.get(d, 1) for d in DIMS]
    return np.arange(int(np.prod(sizes)), dtype=np.int64).reshape(sizes)


grid = place   # the same array, named for callers without a cluster


def coordinates(grid: np.ndarray) -> dict[int, dict[str, int]]:
    """rank -> {dim: index} for every rank in `grid`."""
    out = {}
    for idx in np.ndindex(grid.shape):
        out[int(grid[idx])] = dict(zip(DIMS, idx))
    return out


def groups(grid: np.ndarray, dim: str) -> list[list[int]]:
    """The process groups along `dim`: lists of global ranks in group-rank order."""
    axis = DIMS.index(dim)
    moved = np.moveaxis(grid, axis, -1).reshape(-1, grid.shape[axis])
    return [list(map(int, row)) for row in moved]


def crossing_summary(grid: np.ndarray, cluster: Cluster) -> dict[str, dict[str, int]]:
    """Per dimension: number of groups, and how many span several hosts / switches / domains."""
    out = {}
    for dim in DIMS:
        if grid.shape[DIMS.index(dim)] == 1:
            continue
        gs = groups(grid, dim)
        out[dim] = {
            "groups": len(gs), "size": len(gs[0]),
            "cross_host": sum(len({cluster.host_of(r) for r in g}) > 1 for g in gs),
            "cross_switch": sum(len({cluster.switch_of(r) for r in g}) > 1 for g in gs),
            "cross_fast_domain": sum(len({cluster.domain_of(r) for r in g}) > 1 for g in gs),
        }
    return out


def describe(layout: dict[str, int], cluster: Cluster, max_rows: int = 16) -> str:
    """The placement as text: each rank's host and coordinates, and which groups cross what."""
    grid = place(layout, cluster)
    coords = coordinates(grid)
    ep = layout.get("ep", 1)
    dp_shard = layout.get("dp_shard", 1)
    lines = [f"placement of {grid.size} ranks on {-(-grid.size // cluster.ranks_per_host)} "
             f"host(s) x {cluster.ranks_per_host} ranks"
             + (f", {cluster.hosts_per_switch} hosts per leaf switch"
                if cluster.hosts_per_switch else "")
             + f", fast domain {cluster.fast_domain or cluster.ranks_per_host} ranks",
             f"{'rank':>6} {'host':>10} {'switch':>6}   (dp, pp, cp, tp, ep)"]
    for r in sorted(coords)[:max_rows]:
        c = coords[r]
        dp = c["dp_replicate"] * dp_shard + c["dp_shard"]
        lines.append(f"{r:>6} {cluster.host_name(r):>10} {cluster.switch_of(r):>6}   "
                     f"({dp}, {c['pp']}, {c['cp']}, {c['tp']}, {dp % ep})")
    if grid.size > max_rows:
        lines.append(f"   ... {grid.size - max_rows} more ranks")
    lines.append("groups:  dim           groups x size   cross host   cross switch   "
                 "cross NVLink domain")
    for dim, s in crossing_summary(grid, cluster).items():
        lines.append(f"         {dim:<13} {s['groups']:>6} x {s['size']:<6} {s['cross_host']:>10}"
                     f" {s['cross_switch']:>14} {s['cross_fast_domain']:>21}")
    return "\n".join(lines)
