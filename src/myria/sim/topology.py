"""Cluster fabrics as link graphs: fat-tree, 3-tier CLOS with pods, rail-optimized; flow paths.

Capacities are in units of one NIC's achieved rate, so the flow solver in `network.py` returns
dimensionless factors. Every server's NICs attach to leaf (ToR) switches with `radix/2` ports
down and `radix/2` up: ``fat-tree`` (a server's NICs share one leaf; a non-blocking spine over
uplinks of the downlink capacity / `oversubscription`), ``clos3`` (fat-tree pods of `radix/2`
leaves reaching the core through `radix/2` aggregation planes, oversubscribed) and
``rail-optimized`` (NIC i of every server on rail switch i of its group; traffic between rails
moves over NVLink first, as NCCL's PXN). Routing: ``adaptive`` pools a switch's uplinks into
one link; ``ecmp`` hashes every flow (split into `flows_per_pair` sub-flows) onto one uplink,
and the spine chosen going up fixes the way down. `pattern_groups` lays a traffic pattern (every
group of `size` ranks `stride` apart) on a fabric for both pricers, `network.pattern_factor`
and `netsim.api.flow_pattern_factor` (both return a `PatternResult`); it lives here, below both.
The fabrics' sources: docs/performance_model.md, "Reasons behind the simulator modules".
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Fabric:
    """A cluster network; hashable, so results computed on it can be cached."""

    kind: str = "fat-tree"
    nodes: int = 1
    gpus_per_node: int = 8
    nics_per_node: int = 8
    oversubscription: float = 1.0
    routing: str = "adaptive"
    flows_per_pair: int = 2
    radix: int = 64
    model: str = "analytic"     # "flow": network.pattern_factor asks the flow simulator

    @property
    def down(self) -> int:
        return max(1, self.radix // 2)

    @property
    def nodes_per_leaf(self) -> int:
        if self.kind == "rail-optimized":
            return self.down
        return max(1, self.down // self.nics_per_node)

    @property
    def leaf_groups(self) -> int:
        """Groups of servers under one leaf (or one set of rail switches)."""
        return -(-self.nodes // self.nodes_per_leaf)

    @property
    def n_leaves(self) -> int:
        rails = self.nics_per_node if self.kind == "rail-optimized" else 1
        return self.leaf_groups * rails

    @property
    def leaves_per_pod(self) -> int:
        return self.down if self.kind == "clos3" else max(1, self.n_leaves)

    @property
    def n_pods(self) -> int:
        return -(-self.n_leaves // self.leaves_per_pod)

    def describe(self) -> str:
        """One line about the fabric."""
        tiers = {"fat-tree": "2-tier fat-tree", "clos3": "3-tier CLOS",
                 "rail-optimized": "rail-optimized"}[self.kind]
        return (f"{tiers}, {self.nodes} servers x {self.nics_per_node} NICs, radix {self.radix}, "
                f"{self.nodes_per_leaf} servers per leaf, {self.n_leaves} leaves, "
                f"{self.n_pods} pod(s), oversubscription {self.oversubscription:g}:1, "
                f"{self.routing} routing"
                + (f" ({self.flows_per_pair} flows per pair)" if self.routing == "ecmp" else "")
                + (", flow-level simulated" if self.model == "flow" else ""))

    @property
    def max_leaves(self) -> int:
        """Leaves one spine tier can join: a spine switch has `radix` ports, every one a
        downlink, and each leaf takes one port of every spine (`radix/2` spines). A clos3
        core joins `radix` pods the same way."""
        return self.radix

    def notes(self) -> list[str]:
        """What the fabric's formulas assume where the cluster leaves the fabric's own shape:
        a two-tier fabric past the leaves its spines can join (priced as one spine tier over
        all of them, as if the switches were large enough: no third tier's cost), and an
        oversubscription no traffic crosses (the GPUs fit under one leaf, or one clos3 pod)."""
        out = []
        servers = self.nodes_per_leaf * self.max_leaves
        if self.kind != "clos3" and self.n_leaves > self.max_leaves:
            per = self.nics_per_node if self.kind == "rail-optimized" else 1
            cap = servers // per
            out.append(f"a two-tier {self.kind} of radix-{self.radix} switches joins at most "
                       f"{self.max_leaves} leaves ({cap:,} servers, {cap * self.gpus_per_node:,} "
                       f"GPUs); {self.nodes:,} servers need {self.n_leaves:,}: priced as if one "
                       "spine tier joined them all (no third tier's hops or contention; "
                       "topology clos3 prices pods and a core: --topology in `myria plan`, "
                       "cluster.topology in a run file)")
        elif self.kind == "clos3" and self.n_pods > self.max_leaves:
            out.append(f"a clos3 of radix-{self.radix} switches joins at most {self.max_leaves} "
                       f"pods; {self.n_pods:,} pods are priced as one core tier over all of "
                       "them, without a fourth tier's cost")
        if self.oversubscription > 1:
            gpus = self.nodes * self.gpus_per_node
            if self.kind == "clos3" and self.n_pods == 1:
                out.append(f"oversubscription {self.oversubscription:g} applies between pods; "
                           f"{gpus:,} GPUs fit in one pod ({self.leaves_per_pod} leaves of "
                           f"{self.nodes_per_leaf} servers), so it changes nothing here")
            elif self.kind != "clos3" and self.leaf_groups == 1:
                out.append(f"oversubscription {self.oversubscription:g} applies between "
                           f"leaves; {gpus:,} GPUs fit under one leaf, so it changes nothing "
                           "here")
        return out

    # -- link layout --------------------------------------------------------------------------
    def _dims(self) -> tuple[int, int, float, float]:
        """Uplinks per leaf and per pod, and their capacities (NIC units), after pooling."""
        adaptive = self.routing == "adaptive"
        u, p = self.down, self.down * self.down
        if self.kind == "clos3":
            leaf_cap = 1.0                          # full bisection inside a pod
            pod_cap = 1.0 / self.oversubscription   # aggregation -> core planes
        else:
            leaf_cap = 1.0 / self.oversubscription  # the single oversubscribed tier
            pod_cap = 1.0
        if adaptive:
            return 1, 1, leaf_cap * u, pod_cap * p
        return u, p, leaf_cap, pod_cap

    def links(self) -> np.ndarray:
        """Capacity of every link, in NIC units, in the order used by `paths`."""
        n_nic = self.nodes * self.nics_per_node
        u, p, leaf_cap, pod_cap = self._dims()
        return np.concatenate([np.ones(2 * n_nic), np.full(2 * self.n_leaves * u, leaf_cap),
                               np.full(2 * self.n_pods * p, pod_cap)])

    def leaf_of(self, node: np.ndarray, nic: np.ndarray) -> np.ndarray:
        group = node // self.nodes_per_leaf
        if self.kind == "rail-optimized":
            return group * self.nics_per_node + nic
        return group

    def paths(self, src_node: np.ndarray, src_nic: np.ndarray, dst_node: np.ndarray,
              dst_nic: np.ndarray, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """Links crossed by each flow, as (flow index, link index) pairs.

        Flows inside one server never reach the fabric: callers leave them out.
        """
        nf = len(src_node)
        n_nic = self.nodes * self.nics_per_node
        u, p, _, _ = self._dims()
        if self.kind == "rail-optimized":
            src_nic = dst_nic  # PXN: hop over NVLink to the GPU on the destination's rail
        la, lb = self.leaf_of(src_node, src_nic), self.leaf_of(dst_node, dst_nic)
        pa, pb = la // self.leaves_per_pod, lb // self.leaves_per_pod
        rng = np.random.default_rng(seed)
        spine = rng.integers(0, u, nf) if u > 1 else np.zeros(nf, dtype=np.int64)
        per_plane = max(1, p // u)
        core = spine * per_plane + (rng.integers(0, per_plane, nf) if per_plane > 1 else 0)
        flow = np.arange(nf)
        off_leaf_up = 2 * n_nic
        off_leaf_dn = off_leaf_up + self.n_leaves * u
        off_pod_up = off_leaf_dn + self.n_leaves * u
        off_pod_dn = off_pod_up + self.n_pods * p
        f_parts = [flow, flow]
        l_parts = [src_node * self.nics_per_node + src_nic,
                   n_nic + dst_node * self.nics_per_node + dst_nic]
        cross = la != lb
        f_parts += [flow[cross], flow[cross]]
        l_parts += [off_leaf_up + la[cross] * u + spine[cross],
                    off_leaf_dn + lb[cross] * u + spine[cross]]
        far = pa != pb
        f_parts += [flow[far], flow[far]]
        l_parts += [off_pod_up + pa[far] * p + core[far], off_pod_dn + pb[far] * p + core[far]]
        return np.concatenate(f_parts), np.concatenate(l_parts).astype(np.int64)


@dataclass(frozen=True)
class PatternResult:
    """Outcome of one traffic pattern on a fabric."""

    factor: float       # NIC-limited time / fabric time, in (0, 1]
    flows: int          # flows simulated
    nodes: int          # servers the pattern was laid out on


def _groups(world: int, size: int, stride: int) -> np.ndarray:
    """Ranks of every group of `size` ranks `stride` apart, shape (groups, size)."""
    block = size * stride
    bases = np.array([b * block + o for b in range(world // block) for o in range(stride)],
                     dtype=np.int64)
    return bases[:, None] + stride * np.arange(size, dtype=np.int64)[None, :]


def pattern_groups(fabric: Fabric, kind: str, size: int, stride: int, max_flows: int,
                   ring_flows: int = 1) -> tuple[np.ndarray | None, int]:
    """The groups a pattern is simulated on and the servers they span: the fabric shrunk to at
    most `max_flows` flows (`ring_flows` per member of a ring), the group size clipped to it;
    None when no group leaves one rank (nothing crosses the fabric)."""
    gpn = fabric.gpus_per_node
    q = fabric.flows_per_pair if fabric.routing == "ecmp" else 1
    per_gpu = q * (max(1, size - 1) if kind == "a2a" else 1) * (ring_flows if kind == "ring"
                                                                 else 1)
    nodes = max(2, min(fabric.nodes, max_flows // (per_gpu * gpn)))
    world = nodes * gpn
    while size > 1 and size * stride > world:
        size -= 1
    if size <= 1 or fabric.nodes <= 1:
        return None, nodes
    return _groups(world, size, stride), nodes
