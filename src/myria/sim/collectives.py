"""Alpha-beta costs of NCCL collectives: ring, double binary tree, hierarchical, all-to-all, p2p.

Sizes follow the nccl-tests convention: `size` is the full buffer of one rank (the all-reduce
input, the all-gather output, the reduce-scatter input, the all-to-all send buffer). Bandwidths
are *bus* bandwidths where nccl-tests reports them: algbw = size / time, and
busbw = algbw * 2(n-1)/n for all-reduce, * (n-1)/n for reduce-scatter, all-gather, all-to-all.

A group of n ranks spans k servers with g ranks on each. Inside a server ranks talk over NVLink
at the achieved intra-node bus bandwidth; across servers NCCL builds one ring per NIC, so a
ring's bus bandwidth is min(intra-node busbw, g x per-rank NIC rate x fabric factor) (DGX A100:
8 x 24 GB/s = 192 GB/s, the published cross-node figure). The all-reduce cost is the cheapest of
ring, tree and two-stage hierarchical, as NCCL's tuner picks the cheapest algorithm.
All-to-all does not combine NICs: each rank's off-server traffic leaves through its own NIC.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING

from myria.sim.hardware import ALPHA_BASE_S, ALPHA_INTER_S, ALPHA_INTRA_S, Hardware
from myria.sim.network import pattern_factor

if TYPE_CHECKING:
    from myria.sim.cpu_profile import CpuProfile


@dataclass(frozen=True)
class Group:
    """A communicator: who is in it and what bandwidth each rank sees (bytes/s)."""

    n: int
    g: int                 # ranks per server
    k: int                 # servers
    intra_busbw: float     # achieved all-reduce bus bandwidth inside a server
    intra_p2p: float       # one-direction GPU-to-GPU bandwidth inside a server
    inter: float           # per-rank network rate for ring traffic, after the fabric factor
    inter_a2a: float       # per-rank network rate under all-to-all traffic
    inter_p2p: float       # per-rank network rate under pipeline (p2p) traffic
    cpu: CpuProfile | None = None   # CPU: gloo among the local processes, measured

    def fit(self, op: str) -> tuple[float, float] | None:
        """Measured (alpha, bandwidth) of `op` inside one host, if any."""
        return self.cpu.gloo_fit(op) if self.cpu is not None and self.k <= 1 else None

    @property
    def ring_busbw(self) -> float:
        """Bus bandwidth of a flat ring over the whole group."""
        if self.k <= 1:
            return self.intra_busbw
        net = self.g * self.inter
        return min(self.intra_busbw, net) if self.g > 1 else net


def make_group(hw: Hardware, size: int, stride: int) -> Group:
    """The group of `size` ranks `stride` apart (Megatron rank order), on hardware `hw`."""
    gpn = hw.gpus_per_node
    size = max(1, size)
    if size == 1:
        g, k = 1, 1
    elif stride >= gpn:
        g, k = 1, size
    else:
        g = max(1, min(size, gpn // stride))
        k = -(-size // g)
    nic = hw.nic_share()
    f_ring = f_a2a = f_p2p = 1.0
    if k > 1:
        f_ring = pattern_factor(hw.fabric, "ring", size, stride).factor
        f_a2a = pattern_factor(hw.fabric, "a2a", size, stride).factor
        f_p2p = pattern_factor(hw.fabric, "p2p", size, stride).factor
    return Group(n=size, g=g, k=k, intra_busbw=hw.intra_busbw, intra_p2p=hw.intra_p2p,
                 inter=nic * f_ring, inter_a2a=nic * f_a2a, inter_p2p=nic * f_p2p, cpu=hw.cpu)


def _alpha(grp: Group) -> float:
    return ALPHA_INTRA_S if grp.k <= 1 else ALPHA_INTER_S


def allreduce(size: float, grp: Group) -> tuple[float, str]:
    """Time of an all-reduce of `size` bytes per rank, and the algorithm chosen."""
    n = grp.n
    if n <= 1 or size <= 0:
        return 0.0, "none"
    fit = grp.fit("all_reduce")
    if fit:
        return fit[0] + 2 * (n - 1) / n * size / fit[1], "gloo"
    bw = grp.ring_busbw
    options = {"ring": 2 * (n - 1) / n * size / bw + ALPHA_BASE_S + 2 * (n - 1) * _alpha(grp)}
    if grp.k > 1:
        # double binary tree across servers (chain inside): log-depth latency, each rank
        # moves the whole buffer up and down once
        options["tree"] = (2 * size / bw + ALPHA_BASE_S
                           + 2 * (math.ceil(math.log2(grp.k)) * ALPHA_INTER_S
                                  + (grp.g - 1) * ALPHA_INTRA_S))
        if grp.g > 1:
            # two-stage: reduce-scatter in the server, all-reduce of 1/g across servers on
            # each rank's NIC, all-gather in the server
            g, k = grp.g, grp.k
            options["hierarchical"] = (2 * (g - 1) / g * size / grp.intra_busbw
                                       + 2 * (k - 1) / k * size / g / grp.inter
                                       + 3 * ALPHA_BASE_S + 2 * (g - 1) * ALPHA_INTRA_S
                                       + 2 * (k - 1) * ALPHA_INTER_S)
    algo = min(options, key=options.get)
    return options[algo], algo


def reduce_scatter(size: float, grp: Group) -> tuple[float, str]:
    """Time of a reduce-scatter whose input is `size` bytes per rank (ring or hierarchical)."""
    return _half(size, grp, "reduce_scatter")


def all_gather(size: float, grp: Group) -> tuple[float, str]:
    """Time of an all-gather whose output is `size` bytes per rank (ring or hierarchical)."""
    return _half(size, grp, "all_gather")


def _half(size: float, grp: Group, op: str = "") -> tuple[float, str]:
    n = grp.n
    if n <= 1 or size <= 0:
        return 0.0, "none"
    fit = grp.fit(op)
    if fit:
        return fit[0] + (n - 1) / n * size / fit[1], "gloo"
    options = {"ring": (n - 1) / n * size / grp.ring_busbw + ALPHA_BASE_S
               + (n - 1) * _alpha(grp)}
    if grp.k > 1 and grp.g > 1:
        g, k = grp.g, grp.k
        options["hierarchical"] = ((g - 1) / g * size / grp.intra_busbw
                                   + (k - 1) / k * size / g / grp.inter
                                   + 2 * ALPHA_BASE_S + (g - 1) * ALPHA_INTRA_S
                                   + (k - 1) * ALPHA_INTER_S)
    algo = min(options, key=options.get)
    return options[algo], algo


def all_to_all(size: float, grp: Group) -> tuple[float, str]:
    """Time of an all-to-all where each rank sends `size` bytes in total (size/n to each)."""
    n = grp.n
    if n <= 1 or size <= 0:
        return 0.0, "none"
    intra = (grp.g - 1) / n * size / grp.intra_p2p
    inter = (n - grp.g) / n * size / grp.inter_a2a if grp.k > 1 else 0.0
    return max(intra, inter) + ALPHA_BASE_S + (n - 1) * _alpha(grp), "pairwise"


def p2p(size: float, grp: Group) -> tuple[float, str]:
    """Time of one send/receive of `size` bytes between neighbours of the group."""
    if size <= 0:
        return 0.0, "none"
    fit = grp.fit("p2p")
    if fit:
        return fit[0] + size / fit[1], "gloo"
    if grp.k <= 1:
        return size / grp.intra_p2p + ALPHA_BASE_S, "nvlink"
    return size / grp.inter_p2p + ALPHA_BASE_S, "network"


def pipeline_p2p(act: float, pp: int, tp: int, sp: bool, groups: dict) -> float:
    """Seconds of one pipeline send/receive of an activation of `act` bytes between stages
    (Megatron's scatter/gather optimisation: each TP rank sends 1/tp across the network, then
    an NVLink all-gather rebuilds the tensor, which sequence parallelism does not need)."""
    if pp <= 1:
        return 0.0
    grp = groups["pp"]
    if tp > 1 and (sp or grp.k > 1):
        return p2p(act / tp, grp)[0] + (0.0 if sp else all_gather(act, groups["tp"])[0])
    return p2p(act, grp)[0]


def bus_bandwidth(op: str, n: int, size: float, seconds: float) -> float:
    """nccl-tests bus bandwidth (bytes/s) of a collective that moved `size` in `seconds`."""
    algbw = size / seconds
    if op == "allreduce":
        return algbw * 2 * (n - 1) / n
    if op in ("reduce_scatter", "all_gather", "all_to_all"):
        return algbw * (n - 1) / n
    return algbw


COLLECTIVES = {"allreduce": allreduce, "reduce_scatter": reduce_scatter,
               "all_gather": all_gather, "all_to_all": all_to_all, "p2p": p2p}


@lru_cache(maxsize=4096)
def layout_groups(hw: Hardware, tp: int, cp: int, ep: int, dp: int, pp: int,
                  dp_shard: int = 0) -> dict:
    """Communicators of a layout, placed as the trainer's mesh places them
    (`myria.layout.MESH_ORDER`, `myria.parallel.placement.place`: tp fastest, then cp,
    dp_shard, dp_replicate, pp; ep inside the data-parallel ranks). Data-parallel reductions
    run over dp x cp (cp ranks hold the same parameters); under HSDP (`dp_shard`) over shard
    groups of dp_shard x cp neighbours ("dps") and replica groups across them ("dpr")."""
    from myria.layout import strides

    shard = (dp_shard or dp) * cp
    st = strides({"tp": tp, "cp": cp, "dp_shard": dp_shard or dp,
                  "dp_replicate": dp // (dp_shard or dp), "pp": pp})
    return {
        "tp": make_group(hw, tp, st["tp"]),
        "cp": make_group(hw, cp, st["cp"]),
        "ep": make_group(hw, ep, st["cp"] * cp),
        "dp": make_group(hw, dp * cp, st["cp"]),
        "dps": make_group(hw, shard, st["cp"]),
        "dpr": make_group(hw, dp * cp // shard, st["dp_replicate"]),
        "edp": make_group(hw, max(1, dp * cp // ep), st["cp"] * cp * ep),
        "pp": make_group(hw, pp, st["pp"]),
    }
