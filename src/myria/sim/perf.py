"""Step model: iteration time, MFU, tokens/s, memory and a time breakdown of one training run.

One iteration = the pipeline (m microbatches through p stages, each stage running its layers'
forward, backward and recomputation with the exposed part of its tensor-, context- and
expert-parallel communication), then the exposed data-parallel gradient reduction, the optimizer
step, offload transfers and data loading. Pipeline time with per-stage time C_s over m
microbatches and v chunks is (m - 1) max C + sum_s C_s / v + (1 - 1/v) max C (Narayanan et al.
2021), less the zero-bubble savings of ZB-H1 and ZB-V (Qi et al. 2023). Every overlap
(`overlap.tp`, `overlap.pp`, `overlap.dp`, context parallelism's ring) has one explicit rule;
hidden communication costs `overlap.overlap_interference`, collectives pay a latency that grows
with their ranks (`collectives`, `overlap.bucketed`), and a synchronous step waits for its
slowest rank (`overlap.sync_wait`). The data-parallel traffic is `dataparallel`'s, the
optimizer and offload `optimizer`'s. MFU counts model FLOPs in the live meter's convention
(models/flops.py "dense"), so a predicted and a measured MFU compare directly; `mfu_megatron` and
`hardware_tflops_per_gpu` give the published conventions. The rules, their sources and
constants: docs/performance_model.md, "Step model (`perf.py`)", "FLOPs and MFU" and "Reasons
behind the step and FLOP modules".
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import lru_cache

from myria.config import ModelConfig
from myria.device import SERVER_GPUS, DeviceSpec, measured_threads
from myria.models.flops import (
    forward_flops_per_token,
    loss_chunk_rows,
    model_flops_per_token,
)
from myria.sim import collectives as coll
from myria.sim.collectives import layout_groups
from myria.sim.dataparallel import (
    GRAD_BYTES,
    DataParallel,
    accumulates_whole,
    dp_collectives,
    dp_time,
    stage_kinds,
    stage_zero,
)
from myria.sim.hardware import Hardware, build_hardware
from myria.sim.layer_cost import Phase, head_summary, layer_summary
from myria.sim.memory import FRAGMENTATION, RESERVED_BYTES, MemoryResult, memory, stage_params
from myria.sim.op_timing import timed_head_ops, timed_layer_ops
from myria.sim.operators import (
    DEFAULT_EFFICIENCY,
    MEASURED_EFFICIENCY,
    Efficiency,
    LayerShape,
    Op,
    eager_supported,
    layer_shape,
)
from myria.sim.optimizer import optimizer_time
from myria.sim.overlap import (
    comm_cost,
    exchange_wait,
    overlap_interference,
    sync_wait,
)
from myria.sim.runspec import RECOMPUTE_OF_TRAINER, ModelSpec, RunSpec, model_config_of
from myria.sim.step_result import StepResult

REPLAY_MAX_OPS = 20000        # eager pipelines up to this many (m x pp x vpp) are replayed


@lru_cache(maxsize=256)
def _describe(hw: Hardware) -> str:
    """`hw.fabric.describe()`, looked up by the hardware (whose hash is computed once)."""
    return hw.fabric.describe()


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


class _ModelKey(tuple):
    """(field, value) pairs of a [model] section that hash once: every cache lookup of the step
    and memory models hashes the key again."""

    def __hash__(self) -> int:
        h = self.__dict__.get("hash")
        if h is None:
            h = self.__dict__["hash"] = tuple.__hash__(self)
        return h


_MODEL_KEYS: dict = {}   # id(model section) -> (the section, a copy of its fields, its key)


def _model_key(run: RunSpec) -> tuple:
    """The run's [model] section as hashable (field, value) pairs (every field is a scalar),
    made once per section object while its fields stay as they were (the planner's candidates
    share their base run's section)."""
    m = run.model
    hit = _MODEL_KEYS.get(id(m))
    if hit is not None and hit[0] is m and hit[1] == m.__dict__:
        return hit[2]
    if len(_MODEL_KEYS) >= 256:
        _MODEL_KEYS.clear()
    key = _ModelKey(vars(m).items())
    _MODEL_KEYS[id(m)] = (m, dict(m.__dict__), key)
    return key


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


@dataclass
class Step:
    """What the phases of `simulate` share about one run."""

    run: RunSpec
    hw: Hardware
    eff: Efficiency
    shape: LayerShape
    cfg: ModelConfig
    groups: dict
    lay: Phase
    recompute: float
    eager: bool
    n_layers: dict
    kinds: tuple
    dpc: DataParallel
    k_dp: float
    k_pp: float
    t_p2p: float
    w_b: int
    hsdp: int
    gkey: tuple
    m: int           # microbatches per step
    stage_base: tuple  # `_stage_base`


def _step_context(run: RunSpec, hw: Hardware, eff: Efficiency) -> Step:
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
    return Step(run, hw, eff, *ctx[:4], recompute, *ctx[4:])


_CONTEXTS: dict = {}   # `_layout_context`'s cache


def _layout_context(run: RunSpec, hw: Hardware, eff: Efficiency, key: tuple) -> tuple:
    """The `Step` fields that do not depend on recomputation (all but run, hw, eff and
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
    groups = layout_groups(hw, *gkey, hsdp)
    lay = layer_summary(shape, hw, eff, run.overlap.tp, gkey)
    eager = eager_supported(shape)
    n_layers = _stage_layers(run, eager)
    w_b = 4 if run.training.precision == "fp32" else 2
    dpc = dp_collectives(shape, hw, gkey, hsdp, tuple(n_layers.items()), run.overlap.dp, w_b)
    kinds, m = stage_kinds(par.pp), run.microbatches
    mem_layer = round((lay.fwd_cat.get("memory", 0.0) + lay.bwd_cat.get("memory", 0.0)) /
                      max(1e-30, lay.fwd + lay.bwd), 2)
    ctx = _CONTEXTS[key] = (
        shape, cfg, groups, lay, eager, n_layers, kinds, dpc,
        overlap_interference(hw, mem_layer, groups["dp"]),
        overlap_interference(hw, mem_layer, groups["pp"]), _p2p_time(run, cfg, groups), w_b,
        hsdp, gkey, m, _stage_base(run, hw, eff, shape, lay, kinds, n_layers, gkey, eager, m))
    return ctx


def clear_caches() -> None:
    """Empty every cache of the step and memory models (a cold start, for timing)."""
    from myria.sim import memory, network, op_timing, overlap

    _CONTEXTS.clear()
    _MODEL_KEYS.clear()
    memory.clear_caches()
    for fn in (network.pattern_factor, layout_groups, layer_summary, head_summary, _model_flops,
               overlap.overlap_interference, overlap.expected_max_normal,
               overlap.expected_max_jitter, overlap.lockstep_rate, _shape, _model_config,
               _rank_layers, dp_collectives,
               op_timing.timed_layer_ops, op_timing.timed_head_ops):
        fn.cache_clear()


def _p2p_time(run: RunSpec, cfg: ModelConfig, groups: dict) -> float:
    """Pipeline point-to-point time per chunk boundary (`collectives.pipeline_p2p`)."""
    par = run.parallel
    act = run.training.micro_batch * cfg.seq_len / par.cp * cfg.hidden * run.act_bytes
    return coll.pipeline_p2p(act, par.pp, par.tp, par.sequence_parallel, groups)


def _stage_base(run: RunSpec, hw: Hardware, eff: Efficiency, shape: LayerShape, lay: Phase,
                kinds: tuple, n_layers: dict, gkey: tuple, eager: bool, m: int) -> tuple:
    """Per kind of pipeline rank, what `_stages` needs that recomputation and the ZeRO stage do
    not change: (kind, first, last, layers, head sums, forward F, weight-gradient W, time by
    category of the layers and the head, gradient accumulation per microbatch or None)."""
    out = []
    for kind, first, last in kinds:
        nl = n_layers[kind]
        hp = head_summary(shape, first, last, hw, eff, run.overlap.tp, gkey)
        cats = {}
        for src, mult in ((lay.fwd_cat, nl), (lay.bwd_cat, nl),
                          (hp.fwd_cat, 1), (hp.bwd_cat, 1)):
            for c, val in src.items():
                cats[c] = cats.get(c, 0.0) + mult * val
        acc = None
        if eager and m > 1:
            # autograd adds each later microbatch's gradients into .grad: read two, write one
            acc = sum(stage_params(shape, nl, first, last, run.parallel.ep)) * 3 * \
                GRAD_BYTES / (hw.mem_bw * eff.mem)
            acc = acc * (m - 1) / m
        out.append((kind, first, last, nl, hp, nl * lay.fwd + hp.fwd,
                    nl * lay.wgrad + hp.wgrad, cats, acc))
    return tuple(out)


def _stages(s: Step) -> dict:
    """Per kind of pipeline rank: one microbatch's forward F, backward B, weight-gradient W,
    compute C, steady-state time and fill time, and its time by category."""
    lay, v = s.lay, s.run.parallel.vpp
    ov = s.run.overlap
    stages = {}
    t_pp = 2 * v * s.t_p2p
    for kind, first, last, nl, hp, F, W, base, acc in s.stage_base:
        B = nl * (lay.bwd + s.recompute) + hp.bwd
        cats = dict(base)
        cats["recompute"] = nl * s.recompute
        cats["dp_zero3"], cats["dp_hidden"] = stage_zero(s, F, B, nl, first, last)
        C = F + B + cats["dp_zero3"]
        if acc is not None:
            cats["grad_accumulate"] = acc
            C += acc
        # bundled blocking exchanges wait for the slower neighbour (`exchange_wait`)
        wait = 0.0 if ov.pp else exchange_wait(s.hw, F, B, s.run.parallel.pp, v)
        steady = C + wait + (comm_cost(t_pp, max(0.0, t_pp - C), s.k_pp) if ov.pp else t_pp)
        stages[kind] = dict(F=F, B=B, W=W, C=C, steady=steady, fill=C + wait + t_pp, cats=cats)
    return stages


def _pipeline_time(s: Step, stages: dict, crit: str) -> float:
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
                 shard=layout_groups(hw, par.tp, par.cp, par.ep, dp, par.pp, hsdp)["dps"].n,
                 stage_layers=n_layers if par.pp > 1 else None,
                 # myria's eager runtime accumulates them too (reduce_once)
                 accumulate=accumulates_whole(run) and (not eager or tr.reduce_once))
    if tr.offload != "none":
        mem.host_fits = mem.host_bytes_per_node <= host_capacity(hw, tr.offload)
    return mem


def host_capacity(hw: Hardware, offload: str) -> float:
    """Bytes per server that offloaded state may take: host memory (offload "cpu") or the
    NVMe disks ("nvme")."""
    return (hw.server.host_memory_gb if offload == "cpu" else hw.server.nvme_gb) * 1e9


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
    t_dp = dp_time(s, first["F"], first["B"], hidden)
    t_opt, t_offload = optimizer_time(s, m * stages[crit]["C"])
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


def _result(s: Step, total: float, bd: dict, mem: MemoryResult, stages: dict, crit: str,
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
    # causal FlashAttention skips the key blocks above the diagonal: what runs is the causal
    # count (model FLOPs charge every key, as Megatron's and PaLM's MFU do); unfused attention
    # computes the whole score matrix and masks it
    causal = dense - 3.0 * (fw.attn_scores + fw.attn_values - fc.attn_scores
                            - fc.attn_values) * tokens
    ran = (causal if run.kernels.flash_attention else dense) + extra
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
        "hardware_flops_per_iteration": ran,
        "causal_model_flops_per_iteration": causal,
        "peak_tflops": mfu_peak / 1e12,
        "memory_bw_gbs": hw.mem_bw / 1e9,
        "params_per_device": mem.params_per_device,
        "efficiency": {"gemm": eff.gemm, "half_dim": eff.half_dim, "mem": eff.mem,
                       "mem_eager": dict(eff.mem_eager),
                       "kernel_overhead_s": eff.kernel_overhead_s},
        "fabric": _describe(hw),
    }
    return StepResult(
        name=run.name, iteration_time_s=total,
        mfu=dense / (total * gpus * mfu_peak),
        mfu_megatron=model_flops / (total * gpus * mfu_peak),
        mfu_causal=causal / (total * gpus * mfu_peak),
        tokens_per_s=tokens / total,
        tflops_per_gpu=dense / (total * gpus) / 1e12,
        hardware_tflops_per_gpu=ran / (total * gpus) / 1e12,
        memory_gb_per_gpu=mem.total / 1e9, fits=mem.fits and mem.host_fits, breakdown=bd,
        memory=mem, layout=layout, details=details, warnings=warnings)


def op_table(run: RunSpec, res: StepResult, ops: tuple[Op, ...], stage: dict,
             per_stage: float, m: int, crit: str, hw: Hardware, eff: Efficiency,
             groups: dict) -> list[dict]:
    """Per-operator rows for `myria analyze`: totals per iteration on the critical stage; a
    forward operator that `training.recompute` runs again in backward counts both runs
    (`recomputed`)."""
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
        rows.append({"name": op.name, "phase": op.phase, "recomputed": repeats == 2,
                     "kind": op.kind,
                     "flops": op.flops * mult * repeats, "bytes": op.bytes * mult * repeats,
                     "intensity": op.intensity, "bound": bound,
                     "time_s": t * mult * repeats,
                     "share": t * mult * repeats / res.iteration_time_s})
    return rows


def measured_here(spec: DeviceSpec) -> bool:
    """A CPU spec measured on this machine by `myria.device.cpu_device_spec`."""
    return spec.name == "cpu" and measured_threads(spec.source) is not None


def trainer_stack(cfg, is_cpu: bool) -> dict[str, dict]:
    """What myria's trainer fixes of a run, as run-file sections ("training", "kernels",
    "overlap"), for a myria Config on a CPU (`is_cpu`: the eager runtime measured there, float32
    under `dtype = "auto"`) or a GPU: its recomputation, optimizer, data-parallel stage and
    precision; FSDP2 with gradient sync off until the last microbatch (`reduce_once`); its own
    modules (separate elementwise kernels, SDPA's FlashAttention-2); no decomposed overlap.
    `config_run` prices a config with it, and `myria plan` a training TOML's model."""
    dtype = cfg.training.dtype
    if dtype == "auto":
        dtype = "float32" if is_cpu else "bfloat16"
    return {
        "training": dict(
            global_batch=cfg.training.global_batch, micro_batch=cfg.training.micro_batch,
            recompute=RECOMPUTE_OF_TRAINER[cfg.parallel.activation_checkpoint],
            optimizer="lamb" if cfg.optimizer.name == "lamb" else "adam",
            zero_stage={"fsdp": 3, "zero2": 2, "ddp": 0}[cfg.training.data_parallel],
            precision="fp32" if dtype == "float32" else "bf16",
            offload=cfg.parallel.offload, offload_params=cfg.parallel.offload_params,
            reduce_once=True),   # the trainer's FSDP2 syncs on the last microbatch
        # SDPA's flash backend is FlashAttention-2 on every GPU (torch's default priority)
        "kernels": dict(flash_attention=True, flash_version="fa2", fused_ops=False,
                        eager=is_cpu),
        "overlap": {},           # each OverlapSpec default: nothing decomposed
    }


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
        OverlapSpec,
        ParallelSpec,
        TrainingSpec,
        model_section,
        validate,
    )

    lay = Layout.resolve(cfg.parallel, nproc)
    is_cpu = device_spec.name == "cpu"
    stack = trainer_stack(cfg, is_cpu)
    model = ModelSpec(**model_section(cfg.model))
    training = TrainingSpec(**stack["training"])
    dtype = "float32" if training.precision == "fp32" else "bfloat16"
    par = ParallelSpec(tp=lay["tp"], pp=lay["pp"], cp=lay["cp"], ep=lay["ep"],
                       vpp=cfg.parallel.vpp, schedule=cfg.parallel.schedule,
                       sequence_parallel=cfg.parallel.sequence_parallel and lay["tp"] > 1,
                       dp_shard=lay["dp_shard"] if lay["dp_replicate"] > 1 else 0)
    gpn = gpus_per_node or (nproc if is_cpu else min(SERVER_GPUS, nproc))
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
                  overlap=OverlapSpec(**stack["overlap"]), kernels=KernelSpec(**stack["kernels"]),
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
    `cpu_profile` if given (`myria.sim.measure.cpu.measured_profile` measures what a config needs),
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
