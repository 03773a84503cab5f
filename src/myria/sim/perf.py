"""Step model: iteration time, MFU, tokens/s, memory and a time breakdown of one training run.

One iteration = the pipeline (m microbatches through p stages, each stage running its layers'
forward, backward and recomputation with the exposed part of its tensor-, context- and
expert-parallel communication), then the exposed data-parallel gradient reduction, the optimizer
step, offload transfers and data loading. Pipeline time with per-stage time C_s over m
microbatches and v chunks is (m - 1) max C + sum_s C_s / v + (1 - 1/v) max C (Narayanan et al.
2021), less the zero-bubble savings of ZB-H1 and ZB-V (Qi et al. 2023). Every overlap
(`overlap.tp`, `overlap.pp`, `overlap.dp`, context parallelism's ring) has one explicit rule;
hidden communication costs `overlap_interference`, collectives pay a latency that grows with
their ranks (`collectives`, `bucketed`), and a synchronous step waits for its slowest rank
(`sync_wait`). MFU counts model FLOPs in the live meter's convention (models/flops.py "dense"),
so a predicted and a measured MFU compare directly; `mfu_megatron` and
`hardware_tflops_per_gpu` give the published conventions. The rules, their sources and
constants: docs/performance_model.md, "Step model (`perf.py`)", "FLOPs and MFU" and "Reasons
behind the step and FLOP modules".
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from functools import lru_cache

from myria.config import ModelConfig
from myria.device import DeviceSpec
from myria.models.flops import (
    forward_flops_per_token,
    loss_chunk_rows,
    model_flops_per_token,
)
from myria.sim import collectives as coll
from myria.sim.hardware import Hardware, build_hardware
from myria.sim.memory import FRAGMENTATION, RESERVED_BYTES, MemoryResult, memory, stage_params
from myria.sim.operators import (
    DEFAULT_EFFICIENCY,
    MEASURED_EFFICIENCY,
    Efficiency,
    LayerShape,
    Op,
    eager_supported,
    layer_shape,
    timed_head_ops,
    timed_layer_ops,
)
from myria.sim.runspec import ModelSpec, RunSpec, model_config_of

BUCKET_PARAMS = 40e6          # Megatron-Core DDP's smallest bucket (parameters)
BUCKET_PARAMS_PER_RANK = 1e6  # ... growing with the data-parallel ranks: max(40M, 1M x dp)
ADAM_BYTES_PER_PARAM = 38     # read g, p, m, v (fp32), write p, m, v, 16-bit copy, norm, zero g
LAMB_EXTRA_BYTES = 16         # second pass: trust-ratio norms and the scaled update
CPU_ADAM_BYTES_PER_PARAM = 32  # host-side Adam on fp32 p, m, v, g
REPLAY_MAX_OPS = 20000        # eager pipelines up to this many (m x pp x vpp) are replayed
# Slowdown of compute while communication hides behind it, as a share of the hidden time, on a
# device whose SMs are not known (overlap_interference prices the others). A prior, not fitted.
OVERLAP_INTERFERENCE = 0.10


# What each key of StepResult.breakdown is called in the tables of simulate and plan.
BREAKDOWN_LABELS = {
    "compute_gemm": "GEMMs", "compute_attention": "attention", "compute_memory_bound":
    "memory-bound ops", "host_overhead": "host (Python, launches)",
    "recompute": "recompute", "tp_comm_exposed": "TP comm",
    "cp_comm_exposed": "CP comm", "ep_comm_exposed": "EP all-to-all", "pp_p2p_exposed":
    "PP send/recv", "pp_bubble": "PP bubble", "dp_comm_exposed": "DP comm", "optimizer":
    "optimizer", "offload": "offload", "data_loading": "data loading",
    "sync_wait": "waiting for the slowest rank",
}


@dataclass
class StepResult:
    """Prediction for one run."""

    name: str
    iteration_time_s: float
    mfu: float                 # the live meter's convention (flops.py "dense")
    tokens_per_s: float
    tflops_per_gpu: float
    hardware_tflops_per_gpu: float
    memory_gb_per_gpu: float
    fits: bool
    breakdown: dict[str, float]
    memory: MemoryResult
    layout: dict
    details: dict = field(default_factory=dict)
    ops: list[dict] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    extra: dict = field(default_factory=dict)  # the planner's band, ETTR, ties
    mfu_megatron: float = 0.0  # Narayanan et al. 2021's convention, as published tables use it

    def to_json(self) -> dict:
        """The JSON object `myria simulate --json` prints."""
        from myria.sim.band import band_coverage, held_out_mae, uncertainty

        t, b = self.iteration_time_s, uncertainty()
        return {
            "name": self.name,
            "iteration_time_s": t,
            "mfu": self.mfu,
            "mfu_megatron": self.mfu_megatron,
            "tokens_per_s": self.tokens_per_s,
            "tflops_per_gpu": self.tflops_per_gpu,
            "hardware_tflops_per_gpu": self.hardware_tflops_per_gpu,
            "flops_note": "mfu and tflops_per_gpu count model FLOPs as myria's live meter does "
                          "(every matmul the model runs, 3x its forward; flops.py 'dense'); "
                          "mfu_megatron uses Narayanan et al. 2021's formula (72 B s l h^2 (...) "
                          "for GPT: the output layer at 2.25x), as published tables do; "
                          "hardware_tflops_per_gpu adds recomputation",
            "memory_gb_per_gpu": self.memory_gb_per_gpu,
            "fits": self.fits,
            "breakdown": {k: v for k, v in self.breakdown.items()},
            "breakdown_fraction": {k: v / t for k, v in self.breakdown.items()},
            "memory_gb": self.memory.gb(),
            "memory_peak_stage": self.memory.stage,
            "layout": self.layout,
            "details": self.details,
            "warnings": self.warnings,
            # the model's uncertainty (leave-one-out residuals of the calibration, jackknife+
            # quantile): the iteration time lies within t (1 -/+ band) with the nominal coverage
            "band": b, "band_nominal_coverage": band_coverage(),
            "band_held_out_mae": held_out_mae(),
            "iteration_time_low_s": t * (1 - b), "iteration_time_high_s": t * (1 + b),
            "mfu_low": self.mfu / (1 + b), "mfu_high": self.mfu / (1 - b),
            **self.extra,
        }


# -- helpers -------------------------------------------------------------------------------
def _chunked(t: float, n: int, t_hide: float) -> float:
    """Exposed time of a collective cut into n chunks pipelined against t_hide of compute."""
    n = max(1, n)
    return t / n + max(0.0, t * (n - 1) / n - t_hide)


@dataclass(frozen=True)
class Buckets:
    """A data-parallel collective cut into buckets, run one after another: the serial time of
    all of them (`total`), the time of the one that finishes last (`last`), and how many."""

    total: float = 0.0
    last: float = 0.0
    n: int = 1

    def __add__(self, o: Buckets) -> Buckets:
        return Buckets(self.total + o.total, max(self.last, o.last), self.n + o.n)

    def scaled(self, share: float) -> Buckets:
        """The share of the buckets that one interleaved chunk holds."""
        n = max(1, round(self.n * share))
        return Buckets(self.total * share, min(self.last, self.total * share), n)


def bucketed(fn, params: float, bytes_per: float, grp: coll.Group, bucket: float
             ) -> Buckets:
    """`params` parameters' collective `fn` over `grp` in buckets of `bucket` parameters."""
    if params <= 0 or grp.n <= 1:
        return Buckets()
    n = max(1, math.ceil(params / bucket - 1e-9))
    t = fn(params / n * bytes_per, grp)[0]
    return Buckets(n * t, t, n)


def dp_bucket_params(dp: int) -> float:
    """Parameters per gradient bucket of Megatron-Core's DistributedDataParallel when it
    overlaps: max(40M, 1M x the data-parallel ranks), so that a bucket's bandwidth term
    outweighs its latency over many ranks."""
    return max(BUCKET_PARAMS, BUCKET_PARAMS_PER_RANK * dp)


def megatron_buckets(fn, dense: float, expert: float, bytes_per: float, grps: tuple,
                     bucket: float) -> Buckets:
    """Dense and expert parameters (over their own groups) in Megatron-Core's buckets."""
    return bucketed(fn, dense, bytes_per, grps[0], bucket) + \
        bucketed(fn, expert, bytes_per, grps[1], bucket)


def fsdp_buckets(fn, dense: float, expert: float, layers: float, block: tuple,
                 bytes_per: float, grps: tuple) -> Buckets:
    """FSDP's collectives, one per wrapped unit: `layers` transformer blocks (`block`: dense,
    expert parameters each) and the root (what the stage holds beyond its blocks: embedding,
    final norm, head). The root's collective runs first in forward and last in backward, next
    to the first block's, so both are exposed together (`last`)."""
    if grps[0].n <= 1 and grps[1].n <= 1:
        return Buckets()
    units = max(1, round(layers))
    one = (fn(block[0] * bytes_per, grps[0])[0] if block[0] > 0 else 0.0) + \
        (fn(block[1] * bytes_per, grps[1])[0] if block[1] > 0 else 0.0)
    root = max(0.0, dense - layers * block[0]) + max(0.0, expert - layers * block[1])
    t_root = fn(root * bytes_per, grps[0])[0] if root > 1 else 0.0
    return Buckets(units * one + t_root, one + t_root, units + (1 if t_root else 0))


def _overlap(b: Buckets, hide: float) -> float:
    """Exposed time of buckets that become final evenly over `hide` seconds of compute (the last
    when it ends) and run one after another: max(last bucket, total - hide (n - 1) / n)."""
    if b.total <= 0:
        return 0.0
    return min(b.total, max(b.last, b.total - hide * (b.n - 1) / b.n))


def _grad_reduce_exposed(b: Buckets, b_last: float, pp: int, v: int) -> float:
    """Exposed time of a once-per-step gradient reduction (buckets `b`) on the first pipeline
    rank (the last to finish), overlapped with backward (Megatron-LM's overlap_grad_reduce:
    a bucket is reduced as soon as its gradients are final).

    One chunk per rank: the buckets reduce during the last microbatch's backward (`b_last`),
    the last bucket after it (`_overlap`). Interleaved (v chunks): the gradients of chunks
    1..v-1 are final when the schedule's last group of pp chunk-0 backwards starts (Megatron's
    interleaved order runs the backwards of pp microbatches per chunk), so they reduce behind
    those pp chunk backwards (pp x b_last / v); chunk 0's share behind its own last backward,
    as above. Mirrored, the same holds for the updated parameters' all-gather before the first
    forwards (Megatron's overlap_param_gather: chunk 0's parameters first, behind its first
    forward; the other chunks' behind the first group of pp chunk-0 forwards), with `b_last`
    the first microbatch's forward."""
    if pp <= 1 or v <= 1:
        return _overlap(b, b_last)
    own = b.scaled(1 / v)
    rest = b.total - own.total
    b_chunk = b_last / v
    return max(0.0, rest - pp * b_chunk) + _overlap(own, b_chunk)


@lru_cache(maxsize=4096)
def overlap_interference(hw: Hardware, mem_share: float, grp: coll.Group) -> float:
    """Extra compute time per second of `grp`'s communication hidden behind it (module
    docstring): s / (1 - s) with s = NCCL's channels over the device's SMs, plus the
    memory-bound share of the compute (`mem_share`) slowed by the HBM bandwidth the collective
    takes (its per-rank bus rate x NCCL_HBM_BYTES_PER_WIRE_BYTE of the device's)."""
    from myria.sim.hardware import NCCL_CHANNELS, NCCL_HBM_BYTES_PER_WIRE_BYTE, SM_COUNT

    sms = SM_COUNT.get(hw.device)
    if not sms or hw.cpu is not None:
        return OVERLAP_INTERFERENCE
    s = NCCL_CHANNELS / sms
    hbm = min(0.9, NCCL_HBM_BYTES_PER_WIRE_BYTE * grp.ring_busbw / hw.mem_bw) \
        if grp.n > 1 else 0.0
    return s / (1 - s) + mem_share * hbm / (1 - hbm)


@lru_cache(maxsize=1024)
def expected_max_normal(n: int) -> float:
    """E[max] of n independent standard normal variables (Blom's approximation,
    Phi^-1((n - 0.375) / (n + 0.25)); 0 for one)."""
    if n <= 1:
        return 0.0
    from statistics import NormalDist

    return NormalDist().inv_cdf((n - 0.375) / (n + 0.25))


def sync_wait(hw: Hardware, compute_s: float) -> float:
    """What the slowest of the ranks that synchronise costs a step: every rank waits, at each
    step's data-parallel collective (and each layer's tensor-parallel one, each microbatch's
    pipeline exchange), for the slowest of all `hw.gpus`; with their compute times spread
    independently by `hw.jitter` (ClusterSpec.rank_jitter: sigma, a share of `compute_s`, and
    the straggler tail) the step takes sigma x `expected_max_jitter` x compute_s longer. 0 on a
    measured device (the CPU self-check: its few local processes are measured as they run)."""
    if hw.cpu is not None or hw.measured:
        return 0.0
    sigma, share, excess = hw.jitter
    return sigma * expected_max_jitter(hw.gpus, share, excess) * compute_s


@lru_cache(maxsize=1024)
def expected_max_jitter(n: int, tail_share: float = 0.0, tail_excess: float = 0.0) -> float:
    """E[max] of n independent draws of a rank's step-time deviation, in units of its spread:
    a standard normal core (`expected_max_normal` when there is no tail), to which a share
    `tail_share` of the draws adds an exponential delay of mean `tail_excess` (the straggler
    tail). With the tail, E[max] = integral of 1 - F(x)^n over x > 0 less that of F(x)^n over
    x < 0, F the mixture's CDF, integrated numerically; it grows like tail_excess x ln(n x
    tail_share) once n x tail_share >> 1, against sqrt(2 ln n) for the normal core."""
    if n <= 1:
        return 0.0
    if tail_share <= 0 or tail_excess <= 0:
        return expected_max_normal(n)
    import numpy as np
    from scipy.special import log_ndtr, ndtr

    top = 8.0 + tail_excess * (math.log(max(2.0, n * tail_share)) + 30.0)
    x = np.linspace(-8.0, top, 200001)
    # the normal core, and the core plus an Exp(mean tail_excess) delay (exponentially
    # modified Gaussian)
    lam = 1.0 / tail_excess
    tail = ndtr(x) - np.exp(lam * lam / 2 - lam * x + log_ndtr(x - lam))
    cdf = (1 - tail_share) * ndtr(x) + tail_share * tail
    fn = np.exp(n * np.log(np.clip(cdf, 1e-300, 1.0)))
    dx = x[1] - x[0]
    return float(np.sum(np.where(x > 0, 1 - fn, -fn)) * dx)


def _cost(t: float, exposed: float, kappa: float = OVERLAP_INTERFERENCE) -> float:
    """Time a collective adds: its exposed part plus the interference of its hidden part
    (`kappa` seconds of slowed compute per second hidden: `overlap_interference`)."""
    return exposed + kappa * max(0.0, t - exposed)


@dataclass
class _Phase:
    """Per-layer (or head) sums for one microbatch."""

    fwd: float = 0.0
    bwd: float = 0.0
    wgrad: float = 0.0
    attn_core_fwd: float = 0.0
    fwd_cat: dict = field(default_factory=dict)
    bwd_cat: dict = field(default_factory=dict)
    comm_detail: dict = field(default_factory=dict)


def _sum_ops(ops: tuple[Op, ...], overlap_tp: bool, tp: int, cp: int,
             groups: dict[str, coll.Group], hw: Hardware) -> _Phase:
    ph = _Phase()
    by_name = {op.name: op.time for op in ops if op.kind != "comm"}
    busy = sum(o.time for o in ops if o.kind != "comm") or 1.0
    mem_share = sum(o.time for o in ops if o.kind != "comm" and o.category == "memory") / busy
    attn_time = {"fwd": sum(o.time for o in ops if o.attn_core and o.phase == "fwd"),
                 "bwd": sum(o.time for o in ops if o.attn_core and o.phase == "bwd")}
    for op in ops:
        cat = op.category
        if op.kind == "comm":
            fn = coll.COLLECTIVES[op.coll]
            t, algo = fn(op.bytes, groups[op.group])
            if op.group == "tp":
                hide = by_name.get(op.pair, 0.0)
                if op.always_overlap:
                    exposed = max(0.0, t - hide)
                elif overlap_tp and op.pair:
                    exposed = _chunked(t, tp, hide)
                else:
                    exposed = t
            elif op.group == "cp":
                exposed = max(0.0, t - (cp - 1) / cp * attn_time[op.phase])
            else:
                exposed = t
            ph.comm_detail[op.group] = algo
            val = _cost(t, exposed, overlap_interference(hw, round(mem_share, 2),
                                                         groups[op.group]))
        else:
            val = op.time
            if op.wgrad:
                ph.wgrad += val
            if op.attn_core and op.phase == "fwd":
                ph.attn_core_fwd += val
        if op.phase == "fwd":
            ph.fwd += val
            ph.fwd_cat[cat] = ph.fwd_cat.get(cat, 0.0) + val
        else:
            ph.bwd += val
            ph.bwd_cat[cat] = ph.bwd_cat.get(cat, 0.0) + val
    return ph


@lru_cache(maxsize=4096)
def _groups(hw: Hardware, tp: int, cp: int, ep: int, dp: int, pp: int,
            dp_shard: int = 0) -> dict:
    """Communicators of a layout, placed as the trainer's mesh places them
    (`myria.layout.MESH_ORDER`: tp fastest, then cp, dp_shard, dp_replicate, pp; ep inside the
    data-parallel ranks). Data-parallel reductions run over dp x cp (cp ranks hold the same
    parameters); under HSDP (`dp_shard`) over shard groups of dp_shard x cp neighbours ("dps")
    and replica groups across them ("dpr")."""
    from myria.layout import strides

    shard = (dp_shard or dp) * cp
    st = strides({"tp": tp, "cp": cp, "dp_shard": dp_shard or dp,
                  "dp_replicate": dp // (dp_shard or dp), "pp": pp})
    return {
        "tp": coll.make_group(hw, tp, st["tp"]),
        "cp": coll.make_group(hw, cp, st["cp"]),
        "ep": coll.make_group(hw, ep, st["cp"] * cp),
        "dp": coll.make_group(hw, dp * cp, st["cp"]),
        "dps": coll.make_group(hw, shard, st["cp"]),
        "dpr": coll.make_group(hw, dp * cp // shard, st["dp_replicate"]),
        "edp": coll.make_group(hw, max(1, dp * cp // ep), st["cp"] * cp * ep),
        "pp": coll.make_group(hw, pp, st["pp"]),
    }


@lru_cache(maxsize=16384)
def _layer_summary(shape: LayerShape, hw: Hardware, eff: Efficiency, overlap_tp: bool,
                   groups_key: tuple) -> _Phase:
    groups = _groups(hw, *groups_key)
    ops = timed_layer_ops(shape, hw.peak_flops, hw.mem_bw, eff)
    return _sum_ops(ops, overlap_tp, shape.tp, shape.cp, groups, hw)


@lru_cache(maxsize=16384)
def _head_summary(shape: LayerShape, first: bool, last: bool, hw: Hardware, eff: Efficiency,
                  overlap_tp: bool, groups_key: tuple) -> _Phase:
    groups = _groups(hw, *groups_key)
    ops = timed_head_ops(shape, first, last, hw.peak_flops, hw.mem_bw, eff)
    return _sum_ops(ops, overlap_tp, shape.tp, shape.cp, groups, hw)


@lru_cache(maxsize=256)
def _describe(fabric) -> str:
    return fabric.describe()


@lru_cache(maxsize=4096)
def _model_flops(shape: LayerShape) -> tuple:
    """(megatron model FLOPs, dense FLOPs, forward by op, causal forward) per token."""
    cfg = shape.model_config()
    return (model_flops_per_token(cfg, "megatron"), model_flops_per_token(cfg, "dense"),
            forward_flops_per_token(cfg, "dense"), forward_flops_per_token(cfg, "causal"))


def efficiency_for(hw: Hardware, flash_version: str = "auto") -> Efficiency:
    """Calibrated efficiencies for datasheet devices; 1 for devices whose peaks are measured;
    a measured CPU profile's rates, bandwidth and kernel overhead when there is one."""
    if hw.cpu is not None:   # measured rates, bandwidth already achieved (E_MEM = 1)
        return Efficiency(gemm=1.0, half_dim=0.0, mem=1.0, mem_eager=(),
                          kernel_overhead_s=hw.cpu.kernel_overhead_s, rates=hw.cpu.rates)
    return MEASURED_EFFICIENCY if hw.measured else _device_efficiency(hw.device, flash_version)


@lru_cache(maxsize=16)
def _device_efficiency(device: str, flash_version: str = "auto") -> Efficiency:
    """The calibrated efficiencies, E_GEMM scaled by the device's matmul ceiling, and the
    FlashAttention rates of the run's kernel on the device from the kernels' microbenchmarks
    (hardware.flash_rates)."""
    from myria.sim.hardware import flash_rates, gemm_ceiling_ratio

    fa = flash_rates(device, flash_version)
    return dataclasses.replace(DEFAULT_EFFICIENCY,
                               gemm=DEFAULT_EFFICIENCY.gemm * gemm_ceiling_ratio(device),
                               flash=fa[:2] if fa else (), flash_half_seq=fa[2:] if fa else ())


def run_shape(run: RunSpec) -> LayerShape:
    """The LayerShape of a run (model, micro-batch, layout, kernels)."""
    p, k = run.parallel, run.kernels
    return _shape(_model_key(run), run.training.micro_batch, p.tp, p.cp, p.ep, p.pp,
                  p.sequence_parallel, k.flash_attention, k.fused_ops, run.dropout,
                  run.act_bytes, run.training.precision == "fp8", k.eager)


def _model_key(run: RunSpec) -> tuple:
    """The run's [model] section as hashable (field, value) pairs (every field is a scalar)."""
    return tuple(vars(run.model).items())


@lru_cache(maxsize=256)
def _model_config(model_key: tuple) -> ModelConfig:
    """The ModelConfig of a [model] section given by `_model_key` (shared: read it only)."""
    return model_config_of(ModelSpec(**dict(model_key)))


@lru_cache(maxsize=8192)
def _shape(model_key: tuple, micro_batch: int, tp: int, cp: int, ep: int, pp: int, sp: bool,
           flash: bool, fused: bool, dropout: float, act_bytes: int, fp8: bool,
           eager: bool) -> LayerShape:
    cfg = _model_config(model_key)
    ce_chunk = 0
    if eager and tp == 1 and pp == 1:
        # the Engine's loss when pp = tp = 1: myria.models.loss.fused_linear_cross_entropy
        ce_chunk = loss_chunk_rows(cfg.vocab_size)
    return layer_shape(cfg, micro_batch, tp=tp, cp=cp, ep=ep, sp=sp, flash=flash, fused=fused,
                       dropout=dropout, act_bytes=act_bytes, fp8=fp8, eager=eager,
                       ce_chunk=ce_chunk)


def _stage_layers(run: RunSpec, eager: bool) -> dict[str, float]:
    """Layers per pipeline rank by kind (first, busiest middle, last rank).

    Equal stages (L/pp each) when pp x vpp divides the layers and the run is not myria's own
    eager runtime (Megatron-LM's split); otherwise the trainer's split (`myria.layout`: stages
    balanced by forward FLOPs, so the output layer's stage holds fewer layers)."""
    L, pp, v = run.model.layers, run.parallel.pp, run.parallel.vpp
    if pp == 1:
        return {"only": float(L)}
    if not eager and L % (pp * v) == 0:
        return {"first": L / pp, "mid": L / pp, "last": L / pp}
    return dict(_rank_layers(_model_key(run), pp, v, run.parallel.schedule))


@lru_cache(maxsize=4096)
def _rank_layers(model_key: tuple, pp: int, v: int, schedule: str) -> tuple:
    from myria.layout import rank_layers

    per_rank = rank_layers(_model_config(model_key), pp, v, schedule)
    mid = per_rank[1:-1]
    return (("first", float(per_rank[0])), ("mid", float(max(mid)) if mid else 0.0),
            ("last", float(per_rank[-1])))


@dataclass(frozen=True)
class _DataParallel:
    """A layout's data-parallel collectives for its busiest stage (`_dp_collectives`): whole
    (t_*: one collective each) and in the buckets the frameworks cut them into (b_*:
    Megatron-Core's for ZeRO 0-1, f_*: FSDP's units for ZeRO 2-3)."""

    dense0: float
    expert0: float
    shard_n: int
    t_grad: float
    t_rs: float
    t_ag: float
    t_rep: float
    b_ar: Buckets
    b_rs: Buckets
    b_ag: Buckets
    f_rs: Buckets
    f_ag: Buckets


def _kinds(pp: int) -> tuple:
    """(kind, first, last) of the pipeline ranks the model prices: one, or first/mid/last."""
    return (("only", True, True),) if pp == 1 else \
        (("first", True, False), ("mid", False, False), ("last", False, True))


@lru_cache(maxsize=16384)
def _dp_collectives(shape: LayerShape, hw: Hardware, gkey: tuple, hsdp: int,
                    n_layers: tuple, overlap_dp: bool, w_b: int) -> _DataParallel:
    """The data-parallel state per device of the busiest (first) stage and its collectives
    (the rank holding the most parameters, under uneven stages)."""
    _, cp, ep, dp, pp = gkey
    groups = _groups(hw, *gkey, hsdp)
    layers = dict(n_layers)
    kinds = _kinds(pp)
    dense0, expert0 = max((stage_params(shape, layers[k], f, la, ep) for k, f, la in kinds),
                          key=sum)
    g_b = GRAD_BYTES
    t_grad = coll.allreduce(dense0 * g_b, groups["dp"])[0] + \
        coll.allreduce(expert0 * g_b, groups["edp"])[0]
    # sharded data parallel (ZeRO 1-3, FSDP): collectives over the shard group; under HSDP the
    # replicas then all-reduce their gradient shards once per step
    shard_n = groups["dps"].n
    t_rs = coll.reduce_scatter(dense0 * g_b, groups["dps"])[0] + \
        coll.reduce_scatter(expert0 * g_b, groups["edp"])[0]
    t_ag = coll.all_gather(dense0 * w_b, groups["dps"])[0] + \
        coll.all_gather(expert0 * w_b, groups["edp"])[0]
    t_rep = coll.allreduce(dense0 * g_b / shard_n, groups["dpr"])[0] if hsdp else 0.0
    # the same collectives in the buckets the frameworks cut them into (module docstring):
    # Megatron-Core's for ZeRO 0-1 (one bucket without overlap), FSDP's units for ZeRO 2-3
    k0 = max((k for k, _, _ in kinds), key=lambda k: sum(
        stage_params(shape, layers[k], k in ("first", "only"), k in ("last", "only"), ep)))
    block = stage_params(shape, 1, False, False, ep)
    mega = dp_bucket_params(dp * cp) if overlap_dp else math.inf
    grps = (groups["dps"], groups["edp"])
    return _DataParallel(
        dense0, expert0, shard_n, t_grad, t_rs, t_ag, t_rep,
        megatron_buckets(coll.allreduce, dense0, expert0, g_b, (groups["dp"], groups["edp"]),
                         mega),
        megatron_buckets(coll.reduce_scatter, dense0, expert0, g_b, grps, mega),
        megatron_buckets(coll.all_gather, dense0, expert0, w_b, grps, mega),
        fsdp_buckets(coll.reduce_scatter, dense0, expert0, layers[k0], block, g_b, grps),
        fsdp_buckets(coll.all_gather, dense0, expert0, layers[k0], block, w_b, grps))


@dataclass
class _Step:
    """What the phases of `simulate` share about one run."""

    run: RunSpec
    hw: Hardware
    eff: Efficiency
    shape: LayerShape
    cfg: ModelConfig
    groups: dict
    lay: _Phase
    recompute: float
    eager: bool
    n_layers: dict
    kinds: tuple
    dpc: _DataParallel
    k_dp: float
    k_pp: float
    t_p2p: float
    w_b: int
    hsdp: int
    gkey: tuple
    m: int           # microbatches per step


GRAD_BYTES = 4   # gradients reduce in fp32


def _step_context(run: RunSpec, hw: Hardware, eff: Efficiency) -> _Step:
    """The per-layer costs, stage layers, communicators and data-parallel collectives of
    `run` (`_layout_context`, shared by the runs that differ only in recomputation, ZeRO
    stage or offload)."""
    par, tr, ov, k = run.parallel, run.training, run.overlap, run.kernels
    dp = run.dp
    hsdp = par.dp_shard if 0 < par.dp_shard < dp and tr.zero_stage >= 1 else 0
    ctx = _layout_context(run, hw, eff, (
        _model_key(run), tr.micro_batch, tr.global_batch, tr.precision, par.tp, par.cp,
        par.ep, par.pp, par.vpp, par.schedule, par.sequence_parallel, k.flash_attention,
        k.fused_ops, k.eager, ov.tp, ov.dp, ov.pp, dp, hsdp, hw, eff))
    lay = ctx[3]
    recompute = {"full": lay.fwd,
                 "selective": lay.attn_core_fwd,  # FlashAttention recomputes in its backward
                 # norms, RoPE, activations, dropout
                 "elementwise": lay.fwd_cat.get("memory", 0.0)}.get(tr.recompute, 0.0)
    return _Step(run, hw, eff, *ctx[:4], recompute, *ctx[4:])


_CONTEXTS: dict = {}   # `_layout_context`'s cache


def _layout_context(run: RunSpec, hw: Hardware, eff: Efficiency, key: tuple) -> tuple:
    """The `_Step` fields that do not depend on recomputation (all but run, hw, eff and
    recompute), cached under `key`: what fixes them (the model, batch, precision, degrees,
    schedule, kernels, overlap, hardware)."""
    ctx = _CONTEXTS.get(key)
    if ctx is not None:
        return ctx
    if len(_CONTEXTS) >= 65536:
        _CONTEXTS.clear()
    par = run.parallel
    shape = run_shape(run)
    cfg = _model_config(_model_key(run))
    dp, hsdp = key[-4], key[-3]
    gkey = (par.tp, par.cp, par.ep, dp, par.pp)
    groups = _groups(hw, *gkey, hsdp)
    lay = _layer_summary(shape, hw, eff, run.overlap.tp, gkey)
    eager = eager_supported(shape)
    n_layers = _stage_layers(run, eager)
    w_b = 4 if run.training.precision == "fp32" else 2
    dpc = _dp_collectives(shape, hw, gkey, hsdp, tuple(n_layers.items()), run.overlap.dp, w_b)
    mem_layer = round((lay.fwd_cat.get("memory", 0.0) + lay.bwd_cat.get("memory", 0.0)) /
                      max(1e-30, lay.fwd + lay.bwd), 2)
    ctx = _CONTEXTS[key] = (
        shape, cfg, groups, lay, eager, n_layers, _kinds(par.pp), dpc,
        overlap_interference(hw, mem_layer, groups["dp"]),
        overlap_interference(hw, mem_layer, groups["pp"]), _p2p_time(run, cfg, groups), w_b,
        hsdp, gkey, run.microbatches)
    return ctx


def clear_caches() -> None:
    """Empty every cache of the step and memory models (a cold start, for timing)."""
    from myria.sim import memory as mem
    from myria.sim import network, operators

    _CONTEXTS.clear()
    for fn in (network.pattern_factor, _groups, _layer_summary, _head_summary, _model_flops,
               overlap_interference, _shape, _model_config, _rank_layers, _dp_collectives,
               expected_max_normal, mem.stage_params, mem._params, mem._act,
               operators.timed_layer_ops, operators.timed_head_ops):
        fn.cache_clear()


def _p2p_time(run: RunSpec, cfg: ModelConfig, groups: dict) -> float:
    """Pipeline point-to-point time per chunk boundary (Megatron's scatter/gather
    optimisation: each TP rank sends 1/tp across the network, then an NVLink all-gather
    rebuilds the tensor)."""
    par = run.parallel
    if par.pp <= 1:
        return 0.0
    act = run.training.micro_batch * cfg.seq_len / par.cp * cfg.hidden * run.act_bytes
    grp = groups["pp"]
    if par.tp > 1 and (par.sequence_parallel or grp.k > 1):
        t = coll.p2p(act / par.tp, grp)[0]
        if not par.sequence_parallel:
            t += coll.all_gather(act, groups["tp"])[0]
        return t
    return coll.p2p(act, grp)[0]


def _stage_zero(s: _Step, F: float, B: float, nl: float, first: bool, last: bool
                ) -> tuple[float, float]:
    """(cost, hidden seconds) of one microbatch's sharded data-parallel traffic on a stage."""
    run, tr = s.run, s.run.training
    dp, cp, pp = run.dp, run.parallel.cp, run.parallel.pp
    if tr.zero_stage >= 3 and dp * cp > 1 and s.eager:
        return _fsdp2_microbatch(s.shape, nl, first, last, pp, run.parallel.ep, s.w_b,
                                 s.groups, s.hw.mem_bw * s.eff.mem, s.hw.cpu), 0.0
    if not (tr.zero_stage >= 2 and dp * cp > 1 and not s.eager):
        return 0.0, 0.0
    # FSDP units every microbatch: without a pipeline its gradients are reduce-scattered
    # (under one, once per step: `deferred`) behind its backward; resharding after forward
    # also gathers each unit before its forward (behind the forward) and again before its
    # backward (behind the backward); without resharding the parameters are gathered once
    # per step (`_dp_time`)
    rs = Buckets() if _deferred(s) else s.dpc.f_rs
    ag = s.dpc.f_ag if tr.zero_stage >= 3 and tr.reshard_after_forward else Buckets()
    bwd = rs + ag
    if not run.overlap.dp:
        return ag.total + bwd.total, 0.0
    e_f, e_b = _overlap(ag, F), _overlap(bwd, B)
    return (_cost(ag.total, e_f, s.k_dp) + _cost(bwd.total, e_b, s.k_dp),
            ag.total - e_f + bwd.total - e_b)


def _deferred(s: _Step) -> bool:
    """Sharded gradients under a pipeline accumulate whole and reduce once per step."""
    return s.run.parallel.pp > 1 and s.run.training.zero_stage >= 2 and not s.eager


def _stages(s: _Step) -> dict:
    """Per kind of pipeline rank: one microbatch's forward F, backward B, weight-gradient W,
    compute C, steady-state time and fill time, and its time by category."""
    lay, v, m = s.lay, s.run.parallel.vpp, s.m
    ov = s.run.overlap
    stages = {}
    for kind, first, last in s.kinds:
        nl = s.n_layers[kind]
        hp = _head_summary(s.shape, first, last, s.hw, s.eff, ov.tp, s.gkey)
        F = nl * lay.fwd + hp.fwd
        B = nl * (lay.bwd + s.recompute) + hp.bwd
        W = nl * lay.wgrad + hp.wgrad
        cats = {}
        for src, mult in ((lay.fwd_cat, nl), (lay.bwd_cat, nl),
                          (hp.fwd_cat, 1), (hp.bwd_cat, 1)):
            for c, val in src.items():
                cats[c] = cats.get(c, 0.0) + mult * val
        cats["recompute"] = nl * s.recompute
        cats["dp_zero3"], cats["dp_hidden"] = _stage_zero(s, F, B, nl, first, last)
        C = F + B + cats["dp_zero3"]
        if s.eager and m > 1:
            # autograd adds each later microbatch's gradients into .grad: read two, write one
            acc = sum(stage_params(s.shape, nl, first, last, s.run.parallel.ep)) * 3 * \
                GRAD_BYTES / (s.hw.mem_bw * s.eff.mem)
            cats["grad_accumulate"] = acc * (m - 1) / m
            C += cats["grad_accumulate"]
        t_pp = 2 * v * s.t_p2p
        steady = C + (_cost(t_pp, max(0.0, t_pp - C), s.k_pp) if ov.pp else t_pp)
        stages[kind] = dict(F=F, B=B, W=W, C=C, steady=steady, fill=C + 2 * v * s.t_p2p,
                            cats=cats)
    return stages


def _pipeline_time(s: _Step, stages: dict, crit: str) -> float:
    """The pipeline's time for m microbatches (module docstring)."""
    par, m = s.run.parallel, s.m
    pp, v = par.pp, par.vpp
    s_max = stages[crit]["steady"]
    if pp == 1:
        return m * s_max
    if par.schedule in ("zero-bubble", "zbv"):
        worst = max(stages.values(), key=lambda x: x["fill"])
        spare = (3 if par.schedule == "zbv" else 2) * worst["W"]
        return m * s_max + (pp - 1) * max(0.0, worst["fill"] - spare) / v
    if s.eager and m * pp * v <= REPLAY_MAX_OPS:
        # myria's own runtime splits layers by FLOPs, so its stages are unequal (the demo's go
        # 3 + 1 layers, the head on the last) and the closed form below, exact for equal
        # stages, overstates the bubble: replay the schedule's own order with each rank's
        # forward and backward times instead (torch's 1F1B/GPipe/interleaved orders are
        # Megatron's, as bench/pipeline_bubble.py checks)
        from myria.sim.schedule_plot import simulate_schedule

        ranks = [stages["first"]] + [stages["mid"]] * (pp - 2) + [stages["last"]]
        t_f = [x["F"] + v * s.t_p2p for x in ranks]
        t_b = [x["steady"] - f for x, f in zip(ranks, t_f)]
        return max(sl.end for sl in simulate_schedule(par.schedule, pp, v, m, t_f, t_b))
    counts = {"only": 1, "first": 1, "last": 1, "mid": max(0, pp - 2)}
    fill_sum = sum(counts[k] * x["fill"] for k, x in stages.items())
    return (m - 1) * s_max + fill_sum / v + (1 - 1 / v) * s_max


def _dp_time(s: _Step, F0: float, B0: float, hidden: list) -> float:
    """Data-parallel communication after (or overlapped with) the pipeline; the seconds it
    hides are appended to `hidden`."""
    run, dpc, k_dp = s.run, s.dpc, s.k_dp
    tr, par, ov = run.training, run.parallel, run.overlap
    dp, cp, ep, pp, v = run.dp, par.cp, par.ep, par.pp, par.vpp

    def step_cost(t: float, exposed: float) -> float:
        hidden.append(max(0.0, t - exposed))
        return _cost(t, exposed, k_dp)

    def behind(b: Buckets, t_hide: float) -> float:
        return step_cost(b.total, _grad_reduce_exposed(b, t_hide, pp, v)) if ov.dp \
            else b.total

    if dp * cp <= 1 and ep <= 1:
        t_dp = 0.0
    elif tr.zero_stage == 0:
        t_dp = behind(dpc.b_ar, B0) if ov.dp else dpc.t_grad
    elif tr.zero_stage == 1 or (tr.zero_stage == 2 and s.eager):
        # whole gradients accumulate over the microbatches: one reduce-scatter per step, then
        # the updated shards are all-gathered (myria's eager "zero2" is FSDP2 without
        # resharding after forward under no_sync: gradients accumulate whole, as here)
        t_dp = behind(dpc.b_rs, B0) + behind(dpc.b_ag, F0) if ov.dp else dpc.t_rs + dpc.t_ag
    elif tr.zero_stage == 2 or (tr.zero_stage >= 3 and not tr.reshard_after_forward
                                and not s.eager):
        # gradients were reduce-scattered per microbatch (`_stage_zero`); the updated
        # parameter shards are all-gathered once per step, unit by unit, behind the first
        # forward (ZeRO-2, FSDP without resharding)
        t_dp = behind(dpc.f_ag, F0)
    elif s.eager:
        t_dp = _eager_fsdp_reduce(s)
    else:
        t_dp = 0.0  # ZeRO-3 traffic is charged per microbatch (`_stage_zero`)
    if _deferred(s) and dp * cp > 1:
        # each stage's accumulated gradients, reduce-scattered after its last backward (the
        # interleaved chunks' during the remaining chunks' backward)
        t_dp += behind(dpc.f_rs, B0)
    if dpc.t_rep:  # HSDP: the replicas all-reduce their gradient shards after the last backward
        t_dp += step_cost(dpc.t_rep, max(dpc.t_rep / dpc.f_rs.n, dpc.t_rep - B0)) if ov.dp \
            else dpc.t_rep
    if pp > 1 and s.cfg.tie_embeddings and not ov.dp:
        # the tied embedding's gradient is summed between the first and last stage
        emb = s.cfg.vocab_size * s.cfg.hidden / par.tp * GRAD_BYTES
        t_dp += coll.allreduce(emb, coll.make_group(s.hw, 2, par.tp * cp * dp * (pp - 1)))[0]
    return t_dp


def _eager_fsdp_reduce(s: _Step) -> float:
    """myria's eager FSDP2 (ZeRO-3) gradient reduction once per step, under no_sync."""
    hw, dpc, par = s.hw, s.dpc, s.run.parallel
    if _fsdp_context(hw.cpu, s.groups["dp"], par.pp):
        _, block_rs, _, ends_rs = _fsdp_context(hw.cpu, s.groups["dp"], par.pp)
        return s.n_layers[s.kinds[0][0]] * block_rs + ends_rs
    if hw.cpu is not None and hw.cpu.fsdp and s.groups["dp"].k <= 1:
        # each unit reduce-scatters its accumulated gradients once per step (the last
        # microbatch), as timed on this machine per unit
        nl0 = s.n_layers[s.kinds[0][0]]
        block = sum(stage_params(s.shape, 1, False, False, par.ep))
        root = dpc.dense0 + dpc.expert0 - nl0 * block
        return nl0 * hw.cpu.fsdp_time(block * GRAD_BYTES, "reduce") + \
            (hw.cpu.fsdp_time(root * GRAD_BYTES, "reduce") if root > 0 else 0.0)
    # one reduce-scatter of the accumulated gradients, after chunk_cat copies them into the
    # reduce-scatter input (read + write, fp32)
    return dpc.t_rs + 2 * (dpc.dense0 + dpc.expert0) * GRAD_BYTES / (hw.mem_bw * s.eff.mem)


def _optimizer_time(s: _Step, t_compute: float) -> tuple[float, float]:
    """(optimizer step, exposed offload transfers) per iteration."""
    run, hw, dpc = s.run, s.hw, s.dpc
    tr, par = run.training, run.parallel
    dp, cp, ep, m = run.dp, par.cp, par.ep, s.m
    shard = dpc.shard_n if tr.zero_stage >= 1 else 1
    n_opt = dpc.dense0 / shard + dpc.expert0 / (max(1, dp * cp // ep) if tr.zero_stage >= 1
                                                else 1)
    per_param = ADAM_BYTES_PER_PARAM + (LAMB_EXTRA_BYTES if tr.optimizer == "lamb" else 0)
    t_offload = 0.0
    on_device = tr.offload in ("none", "nvme")   # where the update's arithmetic runs
    if on_device and s.eager and hw.cpu is not None and hw.cpu.optimizer_s_per_param:
        # measured: myria's foreach gradient clip + AdamW per parameter on this CPU, plus the
        # two scalar all-reduces of the step (gradient norm, logged loss) per reduction group
        t_opt = n_opt * hw.cpu.optimizer_s_per_param
        for name in ("dp", "pp"):
            t_opt += 2 * coll.allreduce(8.0, s.groups[name])[0]
    elif on_device:
        t_opt = n_opt * per_param / (hw.mem_bw * s.eff.mem)
    else:
        srv = hw.server
        t_opt = n_opt * CPU_ADAM_BYTES_PER_PARAM * hw.gpus_per_node / \
            (srv.host_memory_bw_gbs * 1e9)
        t_offload = n_opt * (GRAD_BYTES + s.w_b) / (srv.pcie_gbs * 1e9)
        if tr.zero_stage >= 3:
            # FSDP2's CPU offload copies the sharded weights in for forward and backward of
            # every microbatch
            t_offload += m * 2 * n_opt * s.w_b / (srv.pcie_gbs * 1e9)
    if tr.offload == "nvme":
        t_offload = _nvme_time(tr, hw, n_opt, t_opt, m, s.w_b, t_compute)
    return t_opt, t_offload


def step_memory(run: RunSpec, hw: Hardware | None = None) -> MemoryResult:
    """Peak memory per device of `run` (`memory.memory` with the run's layout and stages), and
    whether the offloaded state fits its host (`host_fits`); `simulate` reports the same."""
    hw = hw or build_hardware(run.cluster, run.training.precision)
    shape = run_shape(run)
    eager = eager_supported(shape)
    return _memory(run, hw, shape, _stage_layers(run, eager), eager, run.microbatches)


def _memory(run: RunSpec, hw: Hardware, shape: LayerShape, n_layers: dict, eager: bool,
            m: int) -> MemoryResult:
    par, tr = run.parallel, run.training
    dp = run.dp
    hsdp = par.dp_shard if 0 < par.dp_shard < dp and tr.zero_stage >= 1 else 0
    cpu_dev = hw.device == "cpu"
    mem = memory(shape, layers=run.model.layers, pp=par.pp, vpp=par.vpp,
                 microbatches=m, schedule=par.schedule,
                 recompute=tr.recompute, zero_stage=tr.zero_stage, dp=dp * par.cp, ep=par.ep,
                 precision=tr.precision, offload=tr.offload,
                 offload_params=tr.offload_params, capacity=hw.memory_bytes,
                 gpus_per_node=hw.gpus_per_node,
                 reserved=0.0 if cpu_dev else RESERVED_BYTES,
                 fragmentation=0.0 if cpu_dev else FRAGMENTATION,
                 reshard_after_forward=tr.reshard_after_forward,
                 shard=_groups(hw, par.tp, par.cp, par.ep, dp, par.pp, hsdp)["dps"].n,
                 stage_layers=n_layers if par.pp > 1 else None,
                 accumulate=par.pp > 1 and not eager)
    if tr.offload != "none":
        cap = (hw.server.host_memory_gb if tr.offload == "cpu" else hw.server.nvme_gb) * 1e9
        mem.host_fits = mem.host_bytes_per_node <= cap
    return mem


def simulate(run: RunSpec, hw: Hardware | None = None, eff: Efficiency | None = None,
             detail: bool = False, mem: MemoryResult | None = None) -> StepResult:
    """Predict one iteration of `run` (`mem`: its `step_memory`, when already priced)."""
    hw = hw or build_hardware(run.cluster, run.training.precision)
    eff = eff or efficiency_for(hw, run.kernels.flash_version)
    s = _step_context(run, hw, eff)
    m = s.m
    stages = _stages(s)
    crit = max(stages, key=lambda k: stages[k]["steady"])
    t_pipe = _pipeline_time(s, stages, crit)
    bubble = max(0.0, t_pipe - m * stages[crit]["steady"])
    first = stages[s.kinds[0][0]]
    hidden = [m * stages[crit]["cats"]["dp_hidden"]]   # seconds of hidden DP communication
    t_dp = _dp_time(s, first["F"], first["B"], hidden)
    t_opt, t_offload = _optimizer_time(s, m * stages[crit]["C"])
    t_data = run.training.data_loading_s
    t_sync = sync_wait(hw, m * (stages[crit]["F"] + stages[crit]["B"]))
    total = t_pipe + t_dp + t_opt + t_offload + t_data + t_sync
    # breakdown: the critical stage's m microbatches, then the rest
    cats = stages[crit]["cats"]
    bd = {
        "compute_gemm": m * cats.get("gemm", 0.0),
        "compute_attention": m * cats.get("attention", 0.0),
        "compute_memory_bound": m * (cats.get("memory", 0.0) + cats.get("grad_accumulate", 0.0)),
        "host_overhead": m * cats.get("host", 0.0),
        "recompute": m * cats.get("recompute", 0.0),
        "tp_comm_exposed": m * cats.get("tp", 0.0),
        "cp_comm_exposed": m * cats.get("cp", 0.0),
        "ep_comm_exposed": m * cats.get("ep", 0.0),
        "pp_p2p_exposed": m * (stages[crit]["steady"] - stages[crit]["C"]),
        "pp_bubble": bubble,
        "dp_comm_exposed": t_dp + m * cats.get("dp_zero3", 0.0),
        "optimizer": t_opt,
        "offload": t_offload,
        "data_loading": t_data,
        "sync_wait": t_sync,
    }
    if mem is None:
        mem = _memory(run, hw, s.shape, s.n_layers, s.eager, m)
    res = _result(s, total, bd, mem, stages, crit, t_pipe, sum(hidden))
    if detail:
        ops = timed_layer_ops(s.shape, hw.peak_flops, hw.mem_bw, eff)
        res.ops = op_table(run, res, ops, stages[crit], s.n_layers[crit], m, crit, hw, eff,
                           s.groups)
    return res


def _result(s: _Step, total: float, bd: dict, mem: MemoryResult, stages: dict, crit: str,
            t_pipe: float, hidden: float) -> StepResult:
    """The StepResult of a priced step: MFU in both conventions, layout, details, warnings."""
    run, hw, eff = s.run, s.hw, s.eff
    tr, par = run.training, run.parallel
    tokens = tr.global_batch * s.cfg.seq_len
    mf, df, fw, fc = _model_flops(s.shape)
    model_flops = mf * tokens
    dense = df * tokens
    if tr.recompute == "full":
        extra = (fw.total - fw.logits) * tokens
    elif tr.recompute == "selective":
        # the attention core runs forward twice (FlashAttention: its block-sparse causal work)
        fa = fc if run.kernels.flash_attention else fw
        extra = (fa.attn_scores + fa.attn_values) * tokens
    else:
        extra = 0.0
    gpus = hw.gpus
    mfu_peak = hw.peak_flops
    if tr.precision == "fp8":
        mfu_peak = hw.peak_flops / 2 if hw.device in ("h100-sxm-80gb", "h200",
                                                      "h800-sxm-80gb") else hw.peak_flops
    warnings: list[str] = []
    if tr.offload != "none" and not mem.host_fits:
        cap = (hw.server.host_memory_gb if tr.offload == "cpu" else hw.server.nvme_gb) * 1e9
        warnings.append(f"offloaded state needs {mem.host_bytes_per_node / 1e9:.0f} GB per "
                        f"server; {tr.offload} holds {cap / 1e9:.0f} GB")
    if not mem.fits:
        warnings.append(f"needs {mem.total / 1e9:.1f} GB per device, has "
                        f"{hw.memory_bytes / 1e9:.0f} GB")
    layout = {"gpus": gpus, "tp": par.tp, "pp": par.pp, "dp": run.dp, "cp": par.cp,
              "ep": par.ep, "vpp": par.vpp, "micro_batch": tr.micro_batch,
              "microbatches": s.m, "schedule": par.schedule,
              "sequence_parallel": par.sequence_parallel, "recompute": tr.recompute,
              "zero_stage": tr.zero_stage, "device": hw.device,
              "reshard_after_forward": tr.reshard_after_forward, "dp_shard": s.hsdp or run.dp,
              "offload": tr.offload, "offload_params": tr.offload_params}
    details = {
        "bubble_fraction": bd["pp_bubble"] / t_pipe if t_pipe else 0.0,
        "comm_hidden_s": hidden,
        "compute_s": bd["compute_gemm"] + bd["compute_attention"] + bd["compute_memory_bound"]
        + bd["recompute"],
        "critical_stage": crit,
        "stage_time_s": {k: x["steady"] for k, x in stages.items()},
        "p2p_time_s": s.t_p2p,
        "collective_algorithms": s.lay.comm_detail,
        "model_flops_per_iteration": dense,
        "megatron_flops_per_iteration": model_flops,
        "hardware_flops_per_iteration": dense + extra,
        "peak_tflops": mfu_peak / 1e12,
        "memory_bw_gbs": hw.mem_bw / 1e9,
        "params_per_device": mem.params_per_device,
        "efficiency": {"gemm": eff.gemm, "half_dim": eff.half_dim, "mem": eff.mem,
                       "mem_eager": dict(eff.mem_eager),
                       "kernel_overhead_s": eff.kernel_overhead_s},
        "fabric": _describe(hw.fabric),
    }
    return StepResult(
        name=run.name, iteration_time_s=total,
        mfu=dense / (total * gpus * mfu_peak),
        mfu_megatron=model_flops / (total * gpus * mfu_peak),
        tokens_per_s=tokens / total,
        tflops_per_gpu=dense / (total * gpus) / 1e12,
        hardware_tflops_per_gpu=(dense + extra) / (total * gpus) / 1e12,
        memory_gb_per_gpu=mem.total / 1e9, fits=mem.fits and mem.host_fits, breakdown=bd,
        memory=mem, layout=layout, details=details, warnings=warnings)


def _nvme_time(tr, hw: Hardware, n_opt: float, t_opt: float, m: int, w_b: int,
               t_compute: float) -> float:
    """Exposed time of myria's nvme tier (myria.offload) per iteration.

    The update runs on the device chunk by chunk while a reader and a writer thread stream the
    optimizer state from disk and back (across the host bus on a GPU): the optimizer phase
    takes the slowest of its arithmetic, the disk and the bus, so what the offload adds is the
    excess over the arithmetic. Every server's devices share its disks. The prefetch of the
    next step's chunks and the trailing writes, which hide more behind forward and backward as
    far as the buffers reach, are not counted (conservative).

    With offload_params each microbatch also reads the parameters for forward and backward, a
    layer ahead of the compute, and the update runs behind training (during the last backward
    while clipping does not bind, else from the step on, followed chunk by chunk by the next
    forward): the state's stream and the layers' reads share the disk with compute and the
    update's arithmetic, and only what exceeds both is exposed. bench/offload.py measures
    1.03-1.20x the in-memory step where the disk needs 0.5-0.7x of it."""
    srv, gpn = hw.server, hw.gpus_per_node
    state_b = (12 if tr.precision != "fp32" else 8) + \
        (w_b if tr.offload_params and tr.precision == "fp32" else 0)
    stream = 2 * n_opt * state_b                       # read and write, per device
    if tr.offload_params:
        stream += m * 2 * n_opt * w_b
    t_disk = stream * gpn / (srv.nvme_gbs * 1e9)
    t_bus = 0.0 if hw.device == "cpu" else stream / (srv.pcie_gbs * 1e9)
    if tr.offload_params:
        return max(0.0, max(t_disk, t_bus) - t_opt - t_compute)
    return max(0.0, max(t_disk, t_bus) - t_opt)


def op_table(run: RunSpec, res: StepResult, ops: tuple[Op, ...], stage: dict,
             per_stage: float, m: int, crit: str, hw: Hardware, eff: Efficiency,
             groups: dict) -> list[dict]:
    """Per-operator rows for `myria analyze`: totals per iteration on the critical stage."""
    shape = run_shape(run)
    first, last = crit in ("only", "first"), crit in ("only", "last")
    head = timed_head_ops(shape, first, last, hw.peak_flops, hw.mem_bw, eff)
    rec = run.training.recompute
    rows = []
    for op, mult, in_layer in [(o, per_stage * m, True) for o in ops] + \
            [(o, m, False) for o in head]:
        repeats = 1
        if in_layer and op.phase == "fwd" and (
                rec == "full" or (rec == "selective" and op.attn_core) or
                (rec == "elementwise" and op.category == "memory")):
            repeats = 2
        if op.kind == "comm":
            t = coll.COLLECTIVES[op.coll](op.bytes, groups[op.group])[0]
            bound = "network" if groups[op.group].k > 1 else "nvlink"
        else:
            t, bound = op.time, op.bound
        rows.append({"name": op.name, "phase": op.phase, "kind": op.kind,
                     "flops": op.flops * mult * repeats, "bytes": op.bytes * mult * repeats,
                     "intensity": op.intensity, "bound": bound,
                     "time_s": t * mult * repeats,
                     "share": t * mult * repeats / res.iteration_time_s})
    return rows


def _fsdp_context(cpu, grp, pp: int) -> tuple:
    """FSDP2 measured around this model's own block and ends (`cpu._fsdp_in_context`), when it
    applies: one host, no pipeline. Empty otherwise."""
    return cpu.fsdp_context if cpu is not None and grp.k <= 1 and pp == 1 else ()


def _fsdp2_microbatch(shape: LayerShape, n_layers: float, first: bool, last: bool, pp: int,
                      ep: int, w_b: int, groups: dict, mem_rate: float, cpu=None) -> float:
    """FSDP2 traffic of one microbatch on one rank (myria's `apply_fsdp`, no overlap on CPU).

    Every block is all-gathered for its forward and again for its backward (resharded after
    forward); the root module (embeddings, final norm, head) once per microbatch when pp = 1
    (kept unsharded until its backward), twice under pipelining. Each all-gather copies the
    local shard in and the gathered parameters out (torch's foreach_all_gather and
    split_with_sizes_copy: read + write each); on a measured CPU FSDP2 itself is timed per unit
    (`cpu._fsdp_unit_points`: gathers, copies and hooks of a block or the root).
    """
    from myria.sim.memory import stage_params

    grp = groups["dp"]
    n = max(1, grp.n)
    if _fsdp_context(cpu, grp, pp):
        block_mb, _, ends_mb, _ = _fsdp_context(cpu, grp, pp)
        return n_layers * block_mb + (ends_mb if first or last else 0.0)
    blocks = sum(stage_params(shape, n_layers, False, False, ep))
    root = sum(stage_params(shape, n_layers, first, last, ep)) - blocks
    per_block = blocks / max(1.0, n_layers)
    root_kind = "root" if pp == 1 else "block"   # myria reshards the root only under pp
    t = 0.0
    for params, units, kind in ((per_block, n_layers, "block"), (root, 1 if root else 0,
                                                                 root_kind)):
        if not units:
            continue
        measured = cpu.fsdp_time(params * w_b, kind) if cpu is not None and grp.k <= 1 \
            else None
        if measured is not None:
            # FSDP2 timed on this machine per unit and microbatch (gathers, copies, hooks)
            t += units * measured
        else:
            gathers = 2 if kind == "block" else 1
            ag = coll.all_gather(params * w_b, grp)[0]
            t += units * gathers * (ag + 2 * params * w_b * (1 + 1 / n) / mem_rate)
    return t


def measured_here(spec: DeviceSpec) -> bool:
    """A CPU spec measured on this machine by `myria.device.cpu_device_spec`."""
    return spec.name == "cpu" and spec.source.startswith("measured (") and \
        "threads" in spec.source


def config_run(cfg, nproc: int, device_spec: DeviceSpec, gpus_per_node: int = 0
               ) -> tuple[RunSpec, DeviceSpec, int]:
    """The RunSpec `simulate_config` prices for a myria Config on `nproc` processes.

    Returns (run, device spec, threads per process). On a CPU the run is myria's eager runtime
    (`kernels.eager`; SDPA's flash kernel, which skips masked blocks) with the trainer's threads
    per process (`training.threads`, or cores / processes); a CPU spec measured on this machine
    (`myria.device.cpu_device_spec`, source "measured (N threads ...)") is re-read at those
    threads. Off CPU, threads is 0.
    """
    from myria.layout import Layout
    from myria.sim.runspec import (
        ClusterSpec,
        KernelSpec,
        ModelSpec,
        OverlapSpec,
        ParallelSpec,
        TrainingSpec,
        model_section,
        validate,
    )

    lay = Layout.resolve(cfg.parallel, nproc)
    dtype = cfg.training.dtype
    if dtype == "auto":
        dtype = "float32" if device_spec.name == "cpu" else "bfloat16"
    zero = {"fsdp": 3, "zero2": 2, "ddp": 0}[cfg.training.data_parallel]
    model = ModelSpec(**model_section(cfg.model))
    training = TrainingSpec(global_batch=cfg.training.global_batch,
                            micro_batch=cfg.training.micro_batch,
                            recompute=cfg.parallel.activation_checkpoint,
                            optimizer="lamb" if cfg.optimizer.name == "lamb" else "adam",
                            zero_stage=zero, precision="fp32" if dtype == "float32" else "bf16",
                            offload=cfg.parallel.offload,
                            offload_params=cfg.parallel.offload_params)
    par = ParallelSpec(tp=lay["tp"], pp=lay["pp"], cp=lay["cp"], ep=lay["ep"],
                       vpp=cfg.parallel.vpp, schedule=cfg.parallel.schedule,
                       sequence_parallel=cfg.parallel.sequence_parallel and lay["tp"] > 1,
                       dp_shard=lay["dp_shard"] if lay["dp_replicate"] > 1 else 0)
    is_cpu = device_spec.name == "cpu"
    gpn = gpus_per_node or (nproc if is_cpu else min(8, nproc))
    threads = 0
    if is_cpu:
        from myria.sim.cpu_profile import default_threads
        threads = cfg.training.threads or default_threads(gpn)
        if measured_here(device_spec):
            from myria.device import cpu_device_spec
            device_spec = cpu_device_spec(threads=threads)
    cluster = ClusterSpec(gpu=device_spec.name, gpus=nproc, gpus_per_node=gpn,
                          peak_tflops=device_spec.peak_tflops(dtype),
                          memory_bw_gbs=device_spec.memory_bw_gbs,
                          # a datasheet device: its memory as the driver reports it (hardware.py)
                          memory_gb=cfg.parallel.fast_memory_gb or (
                              0.0 if device_spec.source == "datasheet" else device_spec.memory_gb))
    run = RunSpec(name="myria-config", model=model, training=training, parallel=par,
                  overlap=OverlapSpec(),
                  kernels=KernelSpec(flash_attention=True, fused_ops=False, eager=is_cpu),
                  cluster=cluster)
    validate(run)
    return run, device_spec, threads


def simulate_config(cfg, nproc: int, device_spec: DeviceSpec, gpus_per_node: int = 0,
                    cpu_profile=None, **kw) -> StepResult:
    """Predict a myria training Config (`myria.config.Config`) run on `nproc` processes.

    The layout comes from cfg.parallel (dp fills the rest); the device is `device_spec` (e.g.
    `myria.device.cpu_device_spec()`, all processes on this host, for the CPU self-check; or a
    GPU DeviceSpec, 8 per server unless `gpus_per_node` says otherwise). The model is myria's
    own: no dropout, no fused elementwise kernels (`config_run`).

    On a CPU measured here the figures are a CPU profile at the trainer's threads per process:
    `cpu_profile` if given (`myria.measure.cpu.measured_profile` measures what a config needs),
    else the cached one (`myria.sim.cpu_profile`); this function never measures. A CPU described
    by hand (a DeviceSpec with another source) is priced by its peak and bandwidth.
    """
    run, device_spec, threads = config_run(cfg, nproc, device_spec, gpus_per_node)
    gpn = run.cluster.gpus_per_node
    prof = cpu_profile
    if threads and prof is None and measured_here(device_spec):
        from myria.sim.cpu_profile import load_profile

        prof = load_profile(threads, gpn, run_shape(run))
    hw = build_hardware(run.cluster, run.training.precision, spec=device_spec, cpu=prof)
    return simulate(run, hw=hw, **kw)
