"""Communicators of a real myria layout, placed on a fabric by ``myria.parallel.placement``."""

from __future__ import annotations

import numpy as np

from myria.errors import ConfigError
from myria.parallel import placement
from myria.sim.netsim.fabric import FabricSpec

DIM_ALIASES = {"dp": "dp_shard", "dp_shard": "dp_shard", "dp_replicate": "dp_replicate",
               "tp": "tp", "pp": "pp", "cp": "cp"}


def parse_layout(text: str) -> dict[str, int]:
    """``"tp=8,pp=4,dp=48"`` -> placement's layout dict (dp is dp_shard)."""
    out: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, _, val = part.partition("=")
        key = key.strip()
        if key not in DIM_ALIASES or not val.strip().isdigit() or int(val) < 1:
            raise ConfigError(f"--layout {text!r}: {part!r} is not DIM=N with DIM one of "
                              f"{', '.join(sorted(set(DIM_ALIASES)))} and N >= 1")
        out[DIM_ALIASES[key]] = int(val)
    return out


def cluster_of(spec: FabricSpec) -> placement.Cluster:
    """What placement needs: ranks per host, hosts per leaf switch (group), NVLink domain."""
    return placement.Cluster(ranks_per_host=spec.gpus, hosts_per_switch=spec.hosts_per_tor_group,
                             fast_domain=spec.gpus)


def layout_groups(layout: dict[str, int], spec: FabricSpec, dim: str) -> np.ndarray:
    """Every group along ``dim`` of ``layout`` placed on ``spec``'s hosts: rows of global ranks
    (= GPU ids) in group order, members of one host adjacent (placement's promise)."""
    dim = DIM_ALIASES.get(dim, dim)
    if dim not in placement.DIMS:
        raise ConfigError(f"--group {dim!r}: valid are tp, cp, dp, dp_replicate, pp")
    grid = placement.place(layout, cluster_of(spec))
    return np.array(placement.groups(grid, dim), dtype=np.int64)
