"""Cluster fabrics: two-tier leaf-spine and three-tier CLOS / fat-tree, hosts with an NVLink
domain and several NICs (rails), from a TOML description or a preset; directed links with
capacities, numbered so that routes are computed with numpy.

Presets (``PRESETS``, files ``myria/sim/data/fabric-*.toml``): ``megascale``, ``llama3``,
``fat-tree`` and ``clos3`` (``myria plan``'s fabrics of those names at their defaults: radix 64,
8 x 400G NICs per server, non-blocking) and ``fat-tree-3tier-k32`` (the k=32 three-tier fat-tree
of Al-Fares et al., ToRs of 16 ports down: 2 servers each). Unknown keys are refused in every
section. A fabric description is TOML: ``name``, ``tiers``
(2: leaf-spine, 3: ToR / aggregation / core), ``[host]`` (``gpus``, ``nics``, ``nic_gbps``,
``nvlink_gbs``, ``rail_optimized``), and per tier ``[tor]``, ``[agg]`` (the spine when
tiers = 2), ``[core]`` its ``down_ports``, ``up_ports`` and ``up_gbps`` or ``oversubscription``.
Wiring is the standard folded CLOS: ToR port u goes to aggregation switch u of its pod;
aggregation switch a of every pod joins core plane a, its port v to core switch v of the plane.
Routes go up to the lowest common tier and down again; the choice going up fixes the way down,
which is why two flows collide if their hashes agree. Every field, annotated:
docs/network.md, "Reasons behind the network simulator modules".
"""

from __future__ import annotations

import difflib
import math
import tomllib
from dataclasses import dataclass, field, replace
from importlib import resources
from pathlib import Path

import numpy as np

from myria.errors import ConfigError

PRESETS = ("megascale", "llama3", "fat-tree", "clos3", "fat-tree-3tier-k32")
HOST_KEYS = ("gpus", "nics", "nic_gbps", "nvlink_gbs", "rail_optimized")
TIER_KEYS = ("down_ports", "up_ports", "up_gbps", "oversubscription")
TOP_KEYS = ("name", "tiers", "host", "tor", "agg", "core", "source")


def _refuse_unknown(d: dict, valid: tuple, where: str) -> None:
    """ConfigError naming the keys of ``d`` not in ``valid`` (with a close match, if any)."""
    unknown = sorted(set(d) - set(valid))
    if not unknown:
        return
    hints = [f"{m[0]!r}" + (f" for {k!r}" if len(unknown) > 1 else "") for k in unknown
             if (m := difflib.get_close_matches(k, valid, n=1))]
    hint = f" (did you mean {', '.join(hints)}?)" if hints else ""
    raise ConfigError(f"{where}: unknown key(s) {unknown}{hint}; valid: {', '.join(valid)}")


@dataclass(frozen=True)
class Tier:
    """One switch tier: ports toward the tier below and above, and the up-link speed."""

    down_ports: int
    up_ports: int = 0
    up_gbps: float = 0.0

    def oversubscription(self, down_gbps: float) -> float:
        return (self.down_ports * down_gbps) / (self.up_ports * self.up_gbps) \
            if self.up_ports else 1.0


@dataclass(frozen=True)
class FabricSpec:
    """A fabric description (hashable: results computed on it are cached)."""

    name: str
    tiers: int
    gpus: int
    nics: int
    nic_gbps: float
    nvlink_gbs: float
    rail_optimized: bool
    tor: Tier
    agg: Tier
    core: Tier = Tier(down_ports=1)
    source: str = ""

    def __post_init__(self) -> None:
        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise ConfigError(f"fabric {self.name!r}: {msg}")
        need(self.tiers in (2, 3), f"tiers = {self.tiers}: must be 2 or 3")
        need(self.gpus >= 1 and self.nics >= 1, "host.gpus and host.nics must be >= 1")
        need(self.gpus % self.nics == 0 or self.nics % self.gpus == 0,
             f"host.gpus = {self.gpus} and host.nics = {self.nics}: one must divide the other")
        need(self.nic_gbps > 0 and self.nvlink_gbs > 0, "nic_gbps and nvlink_gbs must be > 0")
        need(self.tor.up_ports >= 1 and self.tor.up_gbps > 0,
             "tor.up_ports and tor.up_gbps (or oversubscription) must be > 0")
        if self.rail_optimized:
            need(self.agg.down_ports % self.nics == 0,
                 f"rail-optimized: agg.down_ports = {self.agg.down_ports} (ToRs per pod) must "
                 f"be a multiple of host.nics = {self.nics}")
        else:
            need(self.tor.down_ports >= self.nics,
                 f"tor.down_ports = {self.tor.down_ports} < host.nics = {self.nics}")
        if self.tiers == 3:
            need(self.agg.up_ports >= 1 and self.agg.up_gbps > 0,
                 "tiers = 3 needs agg.up_ports and agg.up_gbps (or oversubscription)")

    @property
    def hosts_per_tor_group(self) -> int:
        """Hosts under one ToR (rail-optimised: under one group of ``nics`` rail ToRs)."""
        return self.tor.down_ports if self.rail_optimized else self.tor.down_ports // self.nics

    @property
    def tor_group(self) -> int:
        return self.nics if self.rail_optimized else 1

    @property
    def max_hosts(self) -> int:
        groups_per_pod = self.agg.down_ports // self.tor_group
        pods = self.core.down_ports if self.tiers == 3 else 1
        return pods * groups_per_pod * self.hosts_per_tor_group

    @property
    def max_gpus(self) -> int:
        return self.max_hosts * self.gpus

    def describe(self) -> str:
        os_tor = self.tor.oversubscription(self.nic_gbps)
        line = (f"{self.name}: {self.tiers}-tier, hosts of {self.gpus} GPUs (NVLink "
                f"{self.nvlink_gbs:g} GB/s) x {self.nics} NICs of {self.nic_gbps:g}G"
                f"{', rail-optimized' if self.rail_optimized else ''}; ToR {self.tor.down_ports}"
                f" down / {self.tor.up_ports} x {self.tor.up_gbps:g}G up ({os_tor:g}:1)")
        if self.tiers == 3:
            line += (f"; agg {self.agg.down_ports} down / {self.agg.up_ports} x "
                     f"{self.agg.up_gbps:g}G up "
                     f"({self.agg.oversubscription(self.tor.up_gbps):g}:1); "
                     f"up to {self.max_gpus} GPUs")
        else:
            line += f"; {self.tor.up_ports} spines of {self.agg.down_ports} ports; " \
                    f"up to {self.max_gpus} GPUs"
        return line


def _tier(d: dict, name: str, down_gbps: float) -> Tier:
    if not isinstance(d, dict):
        raise ConfigError(f"fabric [{name}]: missing table")
    _refuse_unknown(d, TIER_KEYS, f"fabric [{name}]")
    try:
        down, up = int(d["down_ports"]), int(d.get("up_ports", 0))
    except (KeyError, TypeError, ValueError):
        raise ConfigError(f"fabric [{name}]: down_ports (an integer) is required") from None
    gbps = float(d.get("up_gbps", 0.0))
    if "oversubscription" in d:
        os_ = float(d["oversubscription"])
        if os_ <= 0 or up < 1:
            raise ConfigError(f"fabric [{name}]: oversubscription = {os_} needs up_ports >= 1 "
                              "and a value > 0")
        gbps = down * down_gbps / (os_ * up)
    if down < 1 or up < 0:
        raise ConfigError(f"fabric [{name}]: down_ports = {down}, up_ports = {up}: invalid")
    return Tier(down, up, gbps)


def spec_from_dict(d: dict, name: str = "custom") -> FabricSpec:
    """A FabricSpec from a parsed TOML description (see the module docstring)."""
    _refuse_unknown(d, TOP_KEYS, f"fabric {name!r}")
    host = d.get("host", {})
    if not isinstance(host, dict):
        raise ConfigError(f"fabric {name!r}: host must be a table ([host])")
    _refuse_unknown(host, HOST_KEYS, "fabric [host]")
    try:
        gpus, nics = int(host.get("gpus", 8)), int(host.get("nics", 8))
        nic_gbps = float(host.get("nic_gbps", 400.0))
        nvlink = float(host.get("nvlink_gbs", 450.0))
    except (TypeError, ValueError) as e:
        raise ConfigError(f"fabric {name!r} [host]: {e}") from None
    rail = bool(host.get("rail_optimized", False))
    tor = _tier(d.get("tor"), "tor", nic_gbps)
    agg = _tier(d.get("agg"), "agg", tor.up_gbps)
    tiers = int(d.get("tiers", 3 if "core" in d else 2))
    core = _tier(d.get("core", {"down_ports": 1}), "core", agg.up_gbps)
    return FabricSpec(name=str(d.get("name", name)), tiers=tiers, gpus=gpus, nics=nics,
                      nic_gbps=nic_gbps, nvlink_gbs=nvlink, rail_optimized=rail, tor=tor,
                      agg=agg, core=core, source=str(d.get("source", "")))


def load_spec(preset_or_path: str) -> FabricSpec:
    """A preset name (``PRESETS``) or the path of a TOML description."""
    if preset_or_path in PRESETS:
        text = resources.files("myria.sim").joinpath(
            f"data/fabric-{preset_or_path}.toml").read_text()
        return spec_from_dict(tomllib.loads(text), preset_or_path)
    p = Path(preset_or_path)
    if not p.is_file():
        raise ConfigError(f"--topology {preset_or_path!r}: not a preset ({', '.join(PRESETS)}) "
                          "nor a TOML file")
    try:
        d = tomllib.loads(p.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{p}: not valid TOML ({e})") from None
    return spec_from_dict(d, p.stem)


@dataclass
class Fabric:
    """A fabric built for ``hosts`` hosts: every directed link has an index and a capacity in
    bytes/s. Link blocks, in order: NIC->ToR, ToR->NIC, GPU->NVSwitch, NVSwitch->GPU,
    ToR->agg, agg->ToR, agg->core, core->agg, then the pooled links of adaptive routing
    (per-packet spraying): all uplinks of a ToR as one link, all its downlinks, all uplinks of a
    pod, all its downlinks. Spraying puts 1/U of every flow on each of a ToR's U uplinks, so
    every uplink carries the same load and the pooled link (capacity U x uplink) is an exact
    stand-in; likewise at the pod's U x V core links."""

    spec: FabricSpec
    hosts: int
    capacity: np.ndarray = field(init=False, repr=False)

    def __post_init__(self) -> None:
        s = self.spec
        if self.hosts < 1:
            raise ConfigError(f"fabric: hosts = {self.hosts}: must be >= 1")
        if self.hosts > s.max_hosts:
            how = ("2 tiers: its spines reach agg.down_ports = "
                   f"{s.agg.down_ports} leaves; more needs a third tier, e.g. the clos3 preset, "
                   "or a TOML with a larger agg.down_ports" if s.tiers == 2
                   else "raise core.down_ports or agg.down_ports")
            raise ConfigError(f"fabric {s.name!r}: {self.hosts * s.gpus} GPUs exceed its "
                              f"{s.max_gpus} ({how})")
        self.n_nic = self.hosts * s.nics
        self.n_gpu = self.hosts * s.gpus
        groups = -(-self.hosts // s.hosts_per_tor_group)
        self.n_tor = groups * s.tor_group
        self.tors_per_pod = s.agg.down_ports
        self.n_pod = -(-self.n_tor // self.tors_per_pod)
        self.U = s.tor.up_ports          # aggregation switches per pod
        self.V = s.agg.up_ports if s.tiers == 3 else 0   # core switches per plane
        sizes = [self.n_nic, self.n_nic, self.n_gpu, self.n_gpu, self.n_tor * self.U,
                 self.n_tor * self.U, self.n_pod * self.U * self.V,
                 self.n_pod * self.U * self.V, self.n_tor, self.n_tor, self.n_pod, self.n_pod]
        self.base = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        gb = 1e9 / 8
        caps = [s.nic_gbps * gb, s.nic_gbps * gb, s.nvlink_gbs * 1e9, s.nvlink_gbs * 1e9,
                s.tor.up_gbps * gb, s.tor.up_gbps * gb, s.agg.up_gbps * gb, s.agg.up_gbps * gb]
        caps += [caps[4] * self.U, caps[5] * self.U, caps[6] * self.U * self.V,
                 caps[7] * self.U * self.V]
        self.capacity = np.repeat(np.array(caps, dtype=float), sizes)
        self.tier_of_link = np.repeat(np.arange(12), sizes)

    # -- geometry ------------------------------------------------------------------------
    @property
    def links(self) -> int:
        return len(self.capacity)

    @property
    def edge_links(self) -> np.ndarray:
        """Links that only NICs and NVLink limit (the 'ideal' fabric keeps just these)."""
        return self.tier_of_link < 4

    @property
    def switch_links(self) -> np.ndarray:
        """Physical links between switches (not the pooled ones)."""
        return (self.tier_of_link >= 4) & (self.tier_of_link < 8)

    def nic_of_gpu(self, gpu: np.ndarray) -> np.ndarray:
        s = self.spec
        host, local = np.divmod(np.asarray(gpu, dtype=np.int64), s.gpus)
        return host * s.nics + local * s.nics // s.gpus

    def tor_of_nic(self, nic: np.ndarray) -> np.ndarray:
        s = self.spec
        host, rail = np.divmod(np.asarray(nic, dtype=np.int64), s.nics)
        group = host // s.hosts_per_tor_group
        return group * s.tor_group + (rail if s.rail_optimized else 0)

    def link_names(self, idx: np.ndarray) -> list[str]:
        """Readable names of links (for the most congested links report)."""
        kinds = ["nic{}->tor", "tor->nic{}", "gpu{}->nvswitch", "nvswitch->gpu{}",
                 "tor{}->agg{}", "agg{}->tor{}", "pod{}.agg{}->core{}", "core{}->pod{}.agg{}",
                 "tor{}->aggs (sprayed)", "aggs->tor{} (sprayed)", "pod{}->cores (sprayed)",
                 "cores->pod{} (sprayed)"]
        out = []
        for i in np.asarray(idx):
            t = int(np.searchsorted(self.base, i, side="right") - 1)
            k = int(i - self.base[t])
            if t < 4 or t >= 8:
                out.append(kinds[t].format(k))
            elif t < 6:
                tor, a = divmod(k, self.U)
                out.append(kinds[t].format(*((tor, a) if t == 4 else (a, tor))))
            else:
                pa, v = divmod(k, self.V)
                p, a = divmod(pa, self.U)
                out.append(kinds[t].format(*((p, a, v) if t == 6 else (v, p, a))))
        return out

    def graph(self):
        """The fabric as a networkx DiGraph (for checks on small fabrics)."""
        import networkx as nx

        s, g = self.spec, nx.DiGraph()
        for nic in range(self.n_nic):
            tor = int(self.tor_of_nic(np.array([nic]))[0])
            g.add_edge(("nic", nic), ("tor", tor))
            g.add_edge(("tor", tor), ("nic", nic))
            g.add_edge(("nic", nic), ("host", nic // s.nics))
            g.add_edge(("host", nic // s.nics), ("nic", nic))
        for tor in range(self.n_tor):
            pod = tor // self.tors_per_pod
            for a in range(self.U):
                g.add_edge(("tor", tor), ("agg", pod, a))
                g.add_edge(("agg", pod, a), ("tor", tor))
                for v in range(self.V):
                    g.add_edge(("agg", pod, a), ("core", a, v))
                    g.add_edge(("core", a, v), ("agg", pod, a))
        return g


def build(spec: FabricSpec | str, gpus: int) -> Fabric:
    """The fabric of ``spec`` (or a preset / TOML path) sized for ``gpus`` GPUs."""
    if isinstance(spec, str):
        spec = load_spec(spec)
    if gpus < 1:
        raise ConfigError(f"--gpus {gpus}: must be >= 1")
    if gpus % spec.gpus:
        raise ConfigError(f"--gpus {gpus}: must be a multiple of the {spec.gpus} GPUs per host")
    return Fabric(spec, max(1, math.ceil(gpus / spec.gpus)))


def with_uplinks(spec: FabricSpec, factor: float) -> FabricSpec:
    """The same fabric with every ToR uplink ``factor`` times faster (2: MegaScale's 400G
    uplinks over 200G downlinks)."""
    return replace(spec, name=f"{spec.name}-x{factor:g}-uplinks",
                   tor=replace(spec.tor, up_gbps=spec.tor.up_gbps * factor))
