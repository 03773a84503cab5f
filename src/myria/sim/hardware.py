"""Cluster facts the simulator prices against: device ceilings, links, servers, the fabric.

Device peaks (FLOP/s, memory, HBM bandwidth, NVLink) come from `myria.device`, the one table the
live MFU meter also reads. This module adds what a device table does not hold: *achieved* link
figures from published nccl-tests style measurements, server facts (PCIe, host memory, NVMe) for
offload, the latency terms of the alpha-beta model, and a measured memory bandwidth for "cpu".
"""

from __future__ import annotations

import dataclasses
import json
import platform
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from myria.device import DeviceSpec, cpu_device_spec, lookup, measure_copy_bandwidth
from myria.errors import ConfigError
from myria.fsutil import atomic_write_json
from myria.sim.runspec import ClusterSpec
from myria.sim.topology import Fabric

if TYPE_CHECKING:
    from myria.sim.cpu_profile import CpuProfile

# Achieved all-reduce bus bandwidth inside one 8-GPU server (ring over NVLink/NVSwitch,
# nccl-tests convention busbw = algbw * 2(n-1)/n). DGX A100 ~230 GB/s, DGX H100 ~370 GB/s
# (hardware.md, published nccl-tests figures). Other devices: NVLINK_RING_EFFICIENCY x the
# per-direction NVLink rate, the A100 ratio 230/300.
INTRA_NODE_BUSBW_GBS = {"a100-sxm-80gb": 230.0, "a100-sxm-40gb": 230.0,
                        "h100-sxm-80gb": 370.0, "h200": 370.0}
NVLINK_RING_EFFICIENCY = 230.0 / 300.0


# Device memory as the driver reports it (NVML, nvidia-smi "Total", MiB): an "80 GB" HBM part
# holds 80 GiB less the driver's own share, not 80e9 bytes (7% more). Figures of Modal's table,
# "Why does an NVIDIA H100 80GB card offer 85.52 GB?" (thundergolfer.com/blog/
# nvidia-gpu-memory-capacity); the H800 carries the H100's memory. Devices not listed take
# their datasheet figure in 1e9 bytes (the lower reading); cluster.memory_gb overrides both.
NVML_MEMORY_MIB = {"a100-sxm-80gb": 81920, "a100-sxm-40gb": 40960, "h100-sxm-80gb": 81559,
                   "h800-sxm-80gb": 81559, "h200": 143771}

def nic_efficiency(nic_gbps: float) -> float:
    """Achieved fraction of a NIC's line rate: HDR 24/25 GB/s, NDR 47/50 GB/s (nccl-tests)."""
    return 0.96 if nic_gbps <= 200 else 0.94


# Latency terms of the alpha-beta model, of the order of NCCL's own tuning model (base latency
# per collective and per ring step over NVLink / the network). They matter only for small
# messages; nothing here is fitted.
ALPHA_BASE_S = 8e-6       # launch + synchronisation of one collective
ALPHA_INTRA_S = 1.0e-6    # one step (hop) over NVLink
ALPHA_INTER_S = 5.0e-6    # one step (hop) across the network

# Streaming multiprocessors per device (NVIDIA's datasheets) and the thread blocks a NCCL
# collective keeps resident on them while it runs: one per channel, and NCCL opens two channels
# per NIC on an 8-NIC server (16; NCCL_MIN/MAX_NCHANNELS unset). Overlapped compute runs on the
# remaining SMs (overlap.overlap_interference).
SM_COUNT = {"a100-sxm-80gb": 108, "a100-sxm-40gb": 108, "h100-sxm-80gb": 132, "h200": 132,
            "h800-sxm-80gb": 132}
NCCL_CHANNELS = 16
# HBM bytes a reduce-scatter or all-gather step moves per byte on the wire: the send buffer
# read, the received chunk written, and the reduction's read of the local chunk.
NCCL_HBM_BYTES_PER_WIRE_BYTE = 3.0

# Measured ceiling of a large bf16 matmul as a fraction of the datasheet peak, per device: the
# "maximum achievable matmul FLOPS" of S. Bekman's ml-engineering handbook (mamf-finder, CUDA
# 12.1): A100 SXM 267.9 of 312 TFLOP/s (85.9%), H100 SXM 792.1 of 989 (80.1%). E_GEMM is fitted
# on A100 runs only; other devices scale it by their ceiling relative to the A100's (the H100
# sustains a smaller share of its peak at its 700 W limit). H200 and H800 share the H100's die
# and power limit and take its figure (an assumption: no published MAMF for them); devices not
# listed keep E_GEMM as fitted. A device fact, not fitted to any training run.
GEMM_CEILING = {"a100-sxm-80gb": 0.859, "a100-sxm-40gb": 0.859, "h100-sxm-80gb": 0.801,
                "h200": 0.801, "h800-sxm-80gb": 0.801}
CALIBRATION_DEVICE = "a100-sxm-80gb"


def gemm_ceiling_ratio(device: str) -> float:
    """E_GEMM multiplier of `device`: its matmul ceiling over the calibration device's."""
    return GEMM_CEILING.get(device, GEMM_CEILING[CALIBRATION_DEVICE]) / \
        GEMM_CEILING[CALIBRATION_DEVICE]


# FlashAttention throughput from the kernels' own published microbenchmarks (bf16/fp16, causal,
# head dim 128; FLOPs counted as those papers count them: the causal half, backward 2.5x the
# forward), as fractions of the dense peak: (forward, backward) at long sequences and the
# sequence length at which a kernel reaches half of that, r(s) = r_inf * s / (s + s_half),
# fitted to the published curves. Not fitted to any training run (no calibration run uses
# FlashAttention):
# - Hopper: FlashAttention-3 (Shah et al. 2024, arXiv 2407.08608, Figs. 5-6, H100 SXM5; the
#   tables are in sim/data/kernel_benchmarks.toml): forward causal 292/423/521/579/602/616
#   TFLOP/s at 0.5k-16k, backward (no mask) 316/424/501/542/559/561 (-> 0.64 / 0.58 of 989
#   TFLOP/s; s_half 440 / 285);
# - Ampere: FlashAttention-2 (Dao 2023, arXiv 2307.08691, Figs. 4-6, A100 SXM4 80GB): forward
#   up to ~73% of peak (abstract; ~197 TFLOP/s causal at head dim 128), backward ~175 TFLOP/s
#   causal at 16k (read off the figure) -> 0.63 / 0.56 of 312 TFLOP/s, with Hopper's s_half.
# Other devices keep the GEMM roofline for the attention kernels. The head dimension scales the
# rate by hd/(hd + 38) relative to 128 (FA3 non-causal forward at head dim 64: 497 vs 648
# TFLOP/s at 16k), capped at the head-dim-128 figure.
# - FlashAttention-2 on Hopper (the same FA3 paper, its FA2 baseline): "only 35% utilization"
#   of the H100 forward (abstract), and FA3's backward 1.5-1.75x FA2's (section 4.1; 1.6 taken)
#   -> 0.35 / 0.36, with FA3's s_half.
# - FlashAttention (the first, `fa1`) on Ampere: the FlashAttention-2 paper's section 4.1,
#   "FlashAttention-2 is around 2x faster than FlashAttention" on the A100 (forward, backward),
#   which its introduction puts at 30-50% of peak forward, 25-35% backward -> FA2's rates / 2
#   (0.315 / 0.28, inside both ranges), with FA2's s_half. No published FA1 rates on Hopper.
FLASH_ATTENTION = {
    "ampere": (0.63, 0.56, 440.0, 285.0),
    "ampere-fa1": (0.315, 0.28, 440.0, 285.0),
    "hopper": (0.64, 0.58, 440.0, 285.0),
    "hopper-fa2": (0.35, 0.36, 440.0, 285.0),
}
FLASH_GENERATION = {"a100-sxm-80gb": "ampere", "a100-sxm-40gb": "ampere",
                    "h100-sxm-80gb": "hopper", "h200": "hopper", "h800-sxm-80gb": "hopper"}
FLASH_HEAD_DIM_HALF = 38.0


def flash_generation(device: str) -> str:
    """The FlashAttention generation of `device` (a name or an alias such as "h100"), or ""."""
    from myria.device import lookup

    spec = lookup(device)
    return FLASH_GENERATION.get(spec.name if spec else device, "")


def flash_kernel(device: str, version: str) -> str:
    """The FlashAttention kernel a run uses on `device` ("fa3", "fa2", "fa1"): `version` auto
    is the newest the device runs. fa3 on a device without Hopper's tensor-memory accelerator
    is refused, and fa1 on Hopper (no published rates there)."""
    gen = flash_generation(device)
    if version == "fa3" and gen != "hopper":
        raise ConfigError(f"kernels.flash_version = 'fa3': FlashAttention-3 runs on Hopper "
                          f"(h100-sxm-80gb, h200, h800-sxm-80gb), not {device}; use fa2")
    if version == "fa1" and gen == "hopper":
        raise ConfigError(f"kernels.flash_version = 'fa1': FlashAttention-1 is priced on Ampere "
                          f"only (a100-sxm-80gb, a100-sxm-40gb), not {device}; use fa2 or fa3")
    if version == "auto":
        return "fa3" if gen == "hopper" else "fa2"
    return version


def flash_rates(device: str, version: str) -> tuple:
    """(forward, backward, s_half forward, s_half backward) of the run's FlashAttention."""
    gen = flash_generation(device)
    kernel = flash_kernel(device, version)
    if (gen, kernel) in (("hopper", "fa2"), ("ampere", "fa1")):
        gen = f"{gen}-{kernel}"
    return FLASH_ATTENTION.get(gen, ())

# Memory-bound kernels (norms, activations, RoPE, softmax, losses, residual chains) from their
# own published microbenchmarks (sim/data/kernel_benchmarks.toml, kind = "memory"), not from any
# training run: the achieved fraction of the datasheet HBM bandwidth of a fused kernel (one
# kernel per operator: Liger-Kernel's Triton kernels, QuACK's CuTe-DSL kernels, torch.compile)
# and of PyTorch eager code (one ATen kernel per step, as Hugging Face's modules run), each the
# median over the tables' implementations of the fit t = bytes / (bandwidth * E) + c
# (calibration.fit_memory_tables; bench/sim_kernels.py prints every table):
# - fused 0.87, one figure: Liger on A100 (RMSNorm 0.81, LayerNorm 0.89, RoPE 0.86 each way,
#   cross-entropy 0.88), Liger SwiGLU on B200 (0.85-0.86), QuACK on H100 (0.90; "~90% of
#   peak" stated), Liger and torch.compile softmax on H100 (0.90, 0.85); left out: Liger's
#   RMSNorm backward (its time does not follow its bytes) and Liger's softmax at 65k columns
#   (register spilling, as the source says);
# - eager, per class of operator (the spread between classes, 0.44-0.86, is what the data
#   show): norm 0.54 (Hugging Face RMSNorm forward 0.65 and backward 0.44, with fp32 casts and a
#   row reduction; PyTorch's LayerNorm kernel 0.54), rope 0.48 (broadcast and strided
#   multiplies, 0.44 / 0.53), softmax 0.86 (F.cross_entropy's log-softmax), pointwise 0.78
#   (SiLU and multiplies on B200, 0.74 / 0.82).
# Fused figures differ less between the A100, H100 and B200 than between kernels, so one
# serves every device. The launch gap per eager kernel is the median intercept per kernel of
# the eager rows (4 us; a Triton kernel's, 7.6 us, includes its Python launcher and is not
# used: the model's fused kernels are C++ launches).
MEMORY_EFFICIENCY = {"fused": 0.87,
                     "eager": {"norm": 0.54, "rope": 0.48, "softmax": 0.86, "pointwise": 0.78}}
KERNEL_LAUNCH_S = 4e-6


# fp8 tensor-core peak is twice the dense bf16 peak on Hopper (hardware.md: 1,979 vs 989); the
# A100 has no fp8 tensor cores, so fp8 runs at the bf16 rate there.
FP8_DEVICES = ("h100-sxm-80gb", "h200", "h800-sxm-80gb")


@dataclass(frozen=True)
class ServerSpec:
    """Host-side facts of a server, used by the offload (ZeRO-Offload/Infinity) model."""

    pcie_gbs: float            # achieved host<->device bandwidth per GPU, one direction
    host_memory_gb: float      # per server
    host_memory_bw_gbs: float  # per server, achieved
    nvme_gb: float             # per server
    nvme_gbs: float            # per server, aggregate read/write


# DGX A100: PCIe Gen4 x16 (~32 GB/s line, 80% achieved), 1 TB DDR4 on 2 x 8 channels of
# DDR4-3200 (410 GB/s peak, ~70% achieved), 15 TB of NVMe at ~25 GB/s aggregate.
# DGX H100: PCIe Gen5 (~64 GB/s line), 2 TB DDR5 on 2 x 8 channels of DDR5-4800 (614 GB/s
# peak), 30 TB of NVMe. These are datasheet-derived, not calibrated.
SERVERS = {
    "ampere": ServerSpec(pcie_gbs=25.6, host_memory_gb=1000, host_memory_bw_gbs=290,
                         nvme_gb=15000, nvme_gbs=25),
    "hopper": ServerSpec(pcie_gbs=51.2, host_memory_gb=2000, host_memory_bw_gbs=430,
                         nvme_gb=30000, nvme_gbs=50),
}

# A CPU host's offload disk (myria's nvme tier run on a CPU): priors, overridden by the run's
# cluster.nvme_gbs; bench/offload.py measures the real one (here 2.6-3.1 GB/s reading and
# 2.7-4.3 writing alone, O_DIRECT from huge-page buffers; 1.0-1.9 from 4 KiB pages).
CPU_DISK_GBS = 1.0
CPU_DISK_GB = 100.0


def cached_hash(self) -> int:
    """`__hash__` of a frozen dataclass that the step model's caches use as a key: the hash of
    its fields, computed once (assign it in the class body, where `dataclass` keeps it)."""
    h = self.__dict__.get("_hash")
    if h is None:
        h = hash(tuple(getattr(self, f.name) for f in dataclasses.fields(self)))
        object.__setattr__(self, "_hash", h)
    return h


def state_without_hash(self) -> dict:
    """`__getstate__` beside `cached_hash`: a copy or another process hashes anew."""
    return {k: v for k, v in self.__dict__.items() if k != "_hash"}


@dataclass(frozen=True)
class Hardware:
    """Everything the step model needs about one cluster, in SI units (FLOP/s, bytes/s)."""

    device: str
    peak_flops: float          # dense peak for the run's precision
    mem_bw: float              # HBM (or DRAM) bandwidth, bytes/s
    memory_bytes: float        # per device
    measured: bool             # peaks are measured, hence already achievable (efficiency 1)
    gpus: int
    gpus_per_node: int
    nics_per_node: int
    nic_gbps: float
    nic_bw: float              # achieved bytes/s per NIC
    intra_busbw: float         # achieved all-reduce bus bandwidth inside a server, bytes/s
    intra_p2p: float           # achieved one-direction bandwidth between two GPUs of a server
    server: ServerSpec
    fabric: Fabric
    cpu: CpuProfile | None = None   # measured CPU figures (myria.sim.cpu), "cpu" device only
    # per-rank step-time jitter (ClusterSpec.rank_jitter, jitter_tail_share, jitter_tail_excess)
    jitter: tuple = (0.01, 0.0, 0.0)

    @property
    def nodes(self) -> int:
        return max(1, self.gpus // self.gpus_per_node)

    __hash__ = cached_hash
    __getstate__ = state_without_hash

    def nic_share(self) -> float:
        """NIC bandwidth per device when every device of a server sends at once."""
        return self.nic_bw * min(1.0, self.nics_per_node / self.gpus_per_node)


# -- CPU memory bandwidth, measured once and cached --------------------------------------------
def _cache_path() -> Path:
    from myria.device import cache_dir

    root = cache_dir()
    return root / "cpu_membw.json"


def cpu_memory_bandwidth(refresh: bool = False) -> float:
    """This host's copy bandwidth in GB/s, measured once and cached under ~/.cache/myria."""
    path = _cache_path()
    key = f"{platform.node()}|{platform.processor() or platform.machine()}"
    cache: dict = {}
    if path.exists():
        try:
            cache = json.loads(path.read_text())
        except (OSError, ValueError):
            cache = {}
    if not refresh and key in cache:
        return float(cache[key])
    bw = measure_copy_bandwidth("cpu", 64 * 2**20, seconds=0.5, min_reps=1, threads=1)
    cache[key] = bw
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(path, cache, indent=None, durable=False)
    except OSError:
        pass
    return bw


def available_memory_bytes() -> float:
    """Memory the kernel can give new processes now (MemAvailable), in bytes."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable"):
                return int(line.split()[1]) * 1024.0
    except OSError:
        pass
    return _host_memory_gb() * 1e9 / 2


def _host_memory_gb() -> float:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                return int(line.split()[1]) * 1024 / 1e9
    except OSError:
        pass
    return 16.0


def device_spec(name: str, cluster: ClusterSpec | None = None) -> DeviceSpec:
    """The DeviceSpec of `name` ("cpu" measured here unless the run file gives its figures)."""
    if name.lower() == "cpu":
        peak = cluster.peak_tflops if cluster and cluster.peak_tflops else 0.0
        bw = cluster.memory_bw_gbs if cluster and cluster.memory_bw_gbs else 0.0
        source = "described"
        if not peak:
            here = cpu_device_spec()
            peak, source = here.peak_fp32_tflops, here.source
        if not bw:
            bw = cpu_memory_bandwidth()
        mem = cluster.memory_gb if cluster and cluster.memory_gb else _host_memory_gb()
        return DeviceSpec("cpu", peak, peak, mem, bw, 0.0, source=source)
    spec = lookup(name)
    if spec is None:
        import difflib

        from myria.device import DEVICES
        close = difflib.get_close_matches(name.lower(), list(DEVICES) + ["cpu"], n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigError(f"cluster.gpu = {name!r}: unknown device{hint}; known: "
                          f"{', '.join(list(DEVICES) + ['cpu'])}")
    return spec


def build_hardware(cluster: ClusterSpec, precision: str = "bf16",
                   spec: DeviceSpec | None = None, cpu: CpuProfile | None = None) -> Hardware:
    """Resolve a run's [cluster] section (with documented defaults) into a Hardware.

    For a "cpu" measured here (no peak or bandwidth given in the run) the cached profile
    (`myria.sim.cpu_profile`, measured by `myria.sim.measure.cpu`) at the trainer's threads per
    process (cores / processes per node) is used when there is one, or `cpu` when given: its
    GEMM/SDPA rates, its elementwise bandwidth as the memory bandwidth, and its gloo figures for
    the collectives between the local processes.
    """
    spec = spec or device_spec(cluster.gpu, cluster)
    is_cpu = spec.name == "cpu"
    if is_cpu and cpu is None and not cluster.peak_tflops and not cluster.memory_bw_gbs:
        from myria.sim import cpu_profile as cpu_mod

        gpn0 = min(cluster.gpus_per_node, cluster.gpus)
        cpu = cpu_mod.load_profile(cpu_mod.default_threads(gpn0), gpn0)
    if not is_cpu:
        cpu = None
    if cpu is not None:
        cluster = dataclasses.replace(cluster, memory_bw_gbs=cpu.elementwise_bw / 1e9)
    measured = spec.source.startswith("measured") or is_cpu   # a CPU peak is an achieved one
    if precision == "fp32":
        peak = spec.peak_fp32_tflops
    else:
        peak = spec.peak_bf16_tflops * (2.0 if precision == "fp8" and spec.name in FP8_DEVICES
                                        else 1.0)
    if cluster.peak_tflops:
        peak = cluster.peak_tflops
    mem_bw = cluster.memory_bw_gbs or spec.memory_bw_gbs
    memory = cluster.memory_gb or (NVML_MEMORY_MIB[spec.name] * 2**20 / 1e9
                                   if spec.name in NVML_MEMORY_MIB else spec.memory_gb)
    if is_cpu:
        mem_bw = mem_bw or cpu_memory_bandwidth()
        memory = memory or _host_memory_gb()
    if not peak or not mem_bw:
        raise ConfigError(f"cluster.gpu = {spec.name!r}: no peak FLOP/s or memory bandwidth; "
                          "give cluster.peak_tflops and cluster.memory_bw_gbs")
    gpn = min(cluster.gpus_per_node, cluster.gpus)
    nics = cluster.nics_per_node or gpn
    hopper = spec.name in FP8_DEVICES
    nic_gbps = cluster.nic_gbps or (400.0 if hopper else 200.0)
    nic_bw = nic_gbps / 8 * nic_efficiency(nic_gbps) * 1e9
    if cluster.intra_node_gbs:
        intra = cluster.intra_node_gbs
    elif is_cpu and cpu is not None and cpu.gloo_fit("all_reduce"):
        # gloo between local processes, measured (collectives.py also takes its alpha terms)
        intra = cpu.gloo_fit("all_reduce")[1] / 1e9
    elif is_cpu:
        # Not measured (no gloo figures cached): a quarter of the copy bandwidth.
        intra = mem_bw / 4
    else:
        intra = INTRA_NODE_BUSBW_GBS.get(spec.name, NVLINK_RING_EFFICIENCY * spec.nvlink_gbs)
    # A point-to-point transfer inside a server reaches the same fraction of the link.
    intra_p2p = intra if is_cpu or not spec.nvlink_gbs else \
        NVLINK_RING_EFFICIENCY * spec.nvlink_gbs
    nodes = max(1, cluster.gpus // gpn)
    fabric = Fabric(kind=cluster.topology, nodes=nodes, gpus_per_node=gpn, nics_per_node=nics,
                    oversubscription=cluster.oversubscription, routing=cluster.routing,
                    flows_per_pair=cluster.flows_per_pair, radix=cluster.switch_radix)
    server = SERVERS["hopper" if hopper else "ampere"]
    if is_cpu:  # the device is the host: no bus to cross, its own memory, a local disk
        server = ServerSpec(pcie_gbs=mem_bw, host_memory_gb=memory, host_memory_bw_gbs=mem_bw,
                            nvme_gb=CPU_DISK_GB, nvme_gbs=CPU_DISK_GBS)
    if cluster.nvme_gbs:
        server = dataclasses.replace(server, nvme_gbs=cluster.nvme_gbs)
    return Hardware(device=spec.name, peak_flops=peak * 1e12, mem_bw=mem_bw * 1e9,
                    memory_bytes=memory * 1e9, measured=measured, gpus=cluster.gpus,
                    gpus_per_node=gpn, nics_per_node=nics, nic_gbps=nic_gbps, nic_bw=nic_bw,
                    intra_busbw=intra * 1e9, intra_p2p=intra_p2p * 1e9,
                    server=server, fabric=fabric, cpu=cpu,
                    jitter=(cluster.rank_jitter, cluster.jitter_tail_share,
                            cluster.jitter_tail_excess))
