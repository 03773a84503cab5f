"""Communicators of a real myria layout, placed on a fabric by ``myria.parallel.placement``.

Expert parallelism (``ep``) is carved out of the data-parallel sharding dimension, as myria's
trainer does (``myria.parallel.expert.expert_meshes``: ``dp_shard`` split as
(dp_shard / ep, ep), ep fastest) and as the planner prices it (``myria.sim.collectives
.layout_groups``: ep consecutive data-parallel ranks): ``ep`` does not multiply the ranks, it
must divide ``dp`` (``dp_shard``), and an expert-parallel group is ``ep`` consecutive members
of a data-parallel group, in its placed (slot) order.
"""

from __future__ import annotations

import numpy as np

from myria.errors import ConfigError
from myria.parallel import placement
from myria.sim.netsim.fabric import FabricSpec

DIM_ALIASES = {"dp": "dp_shard", "dp_shard": "dp_shard", "dp_replicate": "dp_replicate",
               "tp": "tp", "pp": "pp", "cp": "cp", "ep": "ep"}
GROUPS = ("tp", "cp", "dp", "dp_replicate", "pp", "ep")


def parse_layout(text: str) -> dict[str, int]:
    """``"tp=8,pp=4,dp=48"`` -> placement's layout dict (dp is dp_shard; ep, if given, is kept
    under ``ep`` and must divide dp_shard)."""
    out: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, _, val = part.partition("=")
        key = key.strip()
        if key not in DIM_ALIASES or not val.strip().isdigit() or int(val) < 1:
            raise ConfigError(f"--layout {text!r}: {part!r} is not DIM=N with DIM one of "
                              f"{', '.join(sorted(set(DIM_ALIASES)))} and N >= 1")
        out[DIM_ALIASES[key]] = int(val)
    ep, shard = out.get("ep", 1), out.get("dp_shard", 1)
    if shard % ep:
        raise ConfigError(f"--layout {text!r}: ep = {ep} must divide dp = {shard} (expert "
                          "parallelism is carved out of the data-parallel ranks, as myria's "
                          "trainer does)")
    return out


def world_of(layout: dict[str, int]) -> int:
    """Ranks of a layout (ep is inside dp, it does not multiply them)."""
    return int(np.prod([v for k, v in layout.items() if k != "ep"]))


def cluster_of(spec: FabricSpec) -> placement.Cluster:
    """What placement needs: ranks per host, hosts per leaf switch (group), NVLink domain."""
    return placement.Cluster(ranks_per_host=spec.gpus, hosts_per_switch=spec.hosts_per_tor_group,
                             fast_domain=spec.gpus)


def layout_groups(layout: dict[str, int], spec: FabricSpec, dim: str,
                  flag: str = "--group") -> np.ndarray:
    """Every group along ``dim`` of ``layout`` placed on ``spec``'s hosts: rows of global ranks
    (= GPU ids) in group order, members of one host adjacent (placement's promise). ``ep``:
    every run of ``ep`` consecutive members of a data-parallel (dp_shard) group. ``flag`` names
    the option in errors."""
    name = dim
    dim = DIM_ALIASES.get(dim, dim)
    if dim not in placement.DIMS and dim != "ep":
        raise ConfigError(f"{flag} {name!r}: valid are {', '.join(GROUPS)}")
    ep = layout.get("ep", 1)
    grid = placement.place({k: v for k, v in layout.items() if k != "ep"}, cluster_of(spec))
    if dim != "ep":
        return np.array(placement.groups(grid, dim), dtype=np.int64)
    shard = np.array(placement.groups(grid, "dp_shard"), dtype=np.int64)
    if shard.shape[1] % ep:
        raise ConfigError(f"{flag} ep: ep = {ep} must divide dp = {shard.shape[1]}")
    return shard.reshape(-1, ep)
