"""Leaf-spine fabric: directed links with capacities, and routes of flows through it."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import networkx as nx
import numpy as np

from myria.errors import ConfigError


@dataclass
class LeafSpine:
    """Two-tier CLOS: ``leaves`` leaf switches with ``hosts_per_leaf`` one-NIC hosts each, every
    leaf wired once to each of ``spines`` spines. Uplink speed / NIC speed sets oversubscription
    (non-blocking when spines * uplink_gbps >= hosts_per_leaf * nic_gbps)."""

    leaves: int
    hosts_per_leaf: int
    spines: int
    nic_gbps: float = 400.0
    uplink_gbps: float = 400.0
    graph: nx.DiGraph = field(init=False, repr=False)
    capacity: np.ndarray = field(init=False, repr=False)  # bytes/s per directed link

    def __post_init__(self) -> None:
        for name in ("leaves", "hosts_per_leaf", "spines"):
            if getattr(self, name) < 1:
                raise ConfigError(f"fabric.{name} = {getattr(self, name)}: must be >= 1")
        g = nx.DiGraph()
        for h in range(self.hosts):
            leaf = ("leaf", h // self.hosts_per_leaf)
            g.add_edge(("host", h), leaf, gbps=self.nic_gbps)
            g.add_edge(leaf, ("host", h), gbps=self.nic_gbps)
        for lf in range(self.leaves):
            for s in range(self.spines):
                g.add_edge(("leaf", lf), ("spine", s), gbps=self.uplink_gbps)
                g.add_edge(("spine", s), ("leaf", lf), gbps=self.uplink_gbps)
        if not nx.is_strongly_connected(g):  # pragma: no cover - wiring above is complete
            raise ConfigError("fabric: not every host reaches every other")
        self.graph = g
        self._edges = list(g.edges)
        self._index = {e: i for i, e in enumerate(self._edges)}
        self.capacity = np.array([g.edges[e]["gbps"] * 1e9 / 8 for e in self._edges])

    @property
    def hosts(self) -> int:
        return self.leaves * self.hosts_per_leaf

    @property
    def links(self) -> int:
        return len(self._edges)

    def link(self, a, b) -> int:
        return self._index[(a, b)]

    def uplink(self, leaf: int, spine: int) -> int:
        return self.link(("leaf", leaf), ("spine", spine))

    def path(self, src: int, dst: int, spine: int | None) -> list[int]:
        """Link indices from host ``src`` to ``dst``, via ``spine`` if on different leaves."""
        ls, ld = src // self.hosts_per_leaf, dst // self.hosts_per_leaf
        hops = [("host", src), ("leaf", ls)]
        if ls != ld:
            hops += [("spine", spine), ("leaf", ld)]
        hops.append(("host", dst))
        return [self._index[(a, b)] for a, b in zip(hops, hops[1:])]


@dataclass(frozen=True)
class Flow:
    src: int
    dst: int
    nbytes: float
    sport: int  # the source port: one per queue pair, the ECMP entropy


def ecmp_hash(flow: Flow, n: int, salt: int = 0) -> int:
    """ECMP port choice from the 5-tuple (src, dst, sport, dport=4791 RoCEv2, proto=UDP).
    blake2b stands in for a switch's CRC hash: uniform over ports, deterministic per flow."""
    key = f"{flow.src}|{flow.dst}|{flow.sport}|4791|17|{salt}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") % n


def connections(pairs: list[tuple[int, int]], nbytes: float, qps: int, seed: int = 0) -> list[Flow]:
    """One flow per queue pair (NCCL_IB_QPS_PER_CONNECTION): each pair's bytes split over
    ``qps`` flows with distinct source ports."""
    if qps < 1:
        raise ConfigError(f"qps_per_connection = {qps}: must be >= 1")
    rng = np.random.default_rng(seed)
    return [Flow(s, d, nbytes / qps, int(rng.integers(49152, 65536)))
            for s, d in pairs for _ in range(qps)]


def route(fabric: LeafSpine, flows: list[Flow], routing: str, salt: int = 0) -> list[list[int]]:
    """Paths of ``flows``: ``ecmp`` hashes the 5-tuple onto a spine; ``adaptive`` sends each flow
    (in order) to the spine whose up- and down-links carry the fewest bytes so far, as InfiniBand
    adaptive routing steers toward the least-loaded port (flowlet granularity, not per packet)."""
    if routing not in ("ecmp", "adaptive"):
        raise ConfigError(f"routing = {routing!r}: valid are 'ecmp', 'adaptive'")
    load = np.zeros(fabric.links)
    paths = []
    for f in flows:
        ls, ld = f.src // fabric.hosts_per_leaf, f.dst // fabric.hosts_per_leaf
        spine = None
        if ls != ld:
            if routing == "ecmp":
                spine = ecmp_hash(f, fabric.spines, salt)
            else:
                down = [fabric.link(("spine", s), ("leaf", ld)) for s in range(fabric.spines)]
                cost = [max(load[fabric.uplink(ls, s)], load[d]) for s, d in enumerate(down)]
                spine = int(np.argmin(cost))
        p = fabric.path(f.src, f.dst, spine)
        load[p] += f.nbytes
        paths.append(p)
    return paths
