"""Per-operator roofline: FLOPs, bytes moved, GEMM shapes and the time of every operator of a layer.

FLOPs come from `myria.models.flops` (the one source of truth); this module adds the bytes each
kernel moves and its time on a device: the larger of its FLOPs at the shape-discounted GEMM rate
and its bytes at the achievable bandwidth, plus a launch overhead, fused or eager. The formulas,
constants and their sources: docs/performance_model.md, "Operator model (roofline)"."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from myria.config import ModelConfig
from myria.models.flops import ForwardFlops, forward_flops_per_token
from myria.models.memory import LayerDims, eager_layer, layer_dims
from myria.sim.hardware import (
    KERNEL_LAUNCH_S,
    MEMORY_EFFICIENCY,
    cached_hash,
    state_without_hash,
)


@dataclass(frozen=True)
class Efficiency:
    """The constants of the roofline (docs/performance_model.md documents each one): only
    `gemm` is fitted (bench/sim_calibration.py --fit, on calibration_runs.toml alone)."""

    gemm: float = 0.7175          # E_GEMM (fitted): large-GEMM fraction of the dense peak
    half_dim: float = 32.0        # GEMM_HALF_DIM (prior): a dimension at half efficiency
    # E_MEM (kernel benchmarks): achievable fraction of HBM bandwidth of a fused kernel
    mem: float = MEMORY_EFFICIENCY["fused"]
    # E_MEM_EAGER (kernel benchmarks): the same for PyTorch eager kernels, one per step of an
    # unfused operator, per class of operator (`Op.eager`): ((class, fraction), ...); a class
    # not listed (or () on measured devices) takes `mem`
    mem_eager: tuple = tuple(sorted(MEMORY_EFFICIENCY["eager"].items()))
    kernel_overhead_s: float = KERNEL_LAUNCH_S   # KERNEL_OVERHEAD: launch gap per kernel
    # FlashAttention kernels (device facts from their published microbenchmarks, see
    # hardware.FLASH_ATTENTION): (forward, backward) fraction of the dense peak at long
    # sequences and head dim 128, (forward, backward) sequence length at half that rate;
    # () keeps the GEMM roofline for attention
    flash: tuple = ()
    flash_half_seq: tuple = ()
    # Measured devices only (the CPU, `myria.sim.measure.cpu`): achieved FLOP/s of GEMMs and
    # attention kernels by shape, ((key, FLOP/s), ...) with the keys of `rate_key`. Empty:
    # roofline above.
    rates: tuple = ()

    __hash__ = cached_hash
    __getstate__ = state_without_hash


DEFAULT_EFFICIENCY = Efficiency()
MEASURED_EFFICIENCY = Efficiency(gemm=1.0, half_dim=0.0, mem=1.0, mem_eager=(),
                                 kernel_overhead_s=10e-6)


@dataclass
class Op:
    """One kernel (or collective) of one layer for one microbatch on one device."""

    name: str
    kind: str                  # gemm | attn (fused flash kernel) | mem | comm | host
    phase: str                 # fwd | bwd
    flops: float = 0.0
    bytes: float = 0.0
    dims: tuple = ()           # (M, N, K) of one product; K is the reduction dimension
    batch: int = 1             # independent products in one kernel (batched GEMM)
    wgrad: bool = False        # a weight-gradient product (deferrable in zero-bubble schedules)
    attn_core: bool = False    # part of the attention core (recomputed by selective recompute)
    coll: str = ""             # collective for comm ops: allreduce, all_gather, ...
    group: str = ""            # tp | cp | ep
    pair: str = ""             # GEMM this collective can hide behind when overlap is on
    always_overlap: bool = False
    # how overlap.tp pipelines it against `pair` (TransformerEngine's `initialize_ub` defaults,
    # transformer_engine/pytorch/module/base.py): 0 = ring exchange, tp pieces of the GEMM;
    # 1 = bulk, beside an independent GEMM, nothing cut; n > 1 = pipeline, n pieces
    chunks: int = 0
    category: str = ""         # gemm | attention | memory | tp | cp | ep (for breakdowns)
    time: float = 0.0
    bound: str = ""
    layout: str = ""           # measured rates: nt | nn | tn | tna (GEMM), attn-fwd | attn-bwd,
                               # eltwise | head (eager memory-bound kernels of blocks / the
                               # embedding, final norm and loss)
    kernels: int = 1           # kernels (launches / eager dispatches) this op stands for
    eager: str = ""            # memory-bound steps run as PyTorch eager kernels: their class
                               # (norm | rope | softmax | pointwise) for E_MEM_EAGER
    gqa: int = 1               # query heads per key/value head (attention ops)

    @property
    def intensity(self) -> float:
        return self.flops / self.bytes if self.bytes else float("inf")


@dataclass(frozen=True)
class LayerShape(LayerDims):
    """Everything that fixes a layer's operators on one device (hashable, so it caches): the
    layer's dimensions and layout as its activation memory sees them (`LayerDims`, declared
    once in models/memory.py), plus what its operators' time also depends on."""

    window: int = 0            # sliding attention window (0: full causal)
    layers: int = 1            # the model's layers (per-layer FLOPs are the model's / layers)
    ep: int = 1
    fused: bool = True
    fp8: bool = False
    model: tuple = ()          # the ModelConfig's (field, value) pairs: `model_config()`

    __hash__ = cached_hash
    __getstate__ = state_without_hash

    def model_config(self) -> ModelConfig:
        """The ModelConfig this shape was made from (every field, as `layer_shape` got it)."""
        return ModelConfig(**dict(self.model))


def layer_shape(cfg: ModelConfig, micro_batch: int, *, tp: int = 1, cp: int = 1, ep: int = 1,
                sp: bool = False, flash: bool = False, fused: bool = True, dropout: float = 0.0,
                act_bytes: int = 2, fp8: bool = False, eager: bool = False,
                ce_chunk: int = 0) -> LayerShape:
    """The LayerShape of a ModelConfig under a parallel layout and kernel choices."""
    dims = layer_dims(cfg, micro_batch, tp=tp, cp=cp, sp=sp, flash=flash, dropout=dropout,
                      act_bytes=act_bytes)
    return LayerShape(**{**vars(dims), "eager": eager, "ce_chunk": ce_chunk},
                      window=cfg.attention_window, layers=cfg.layers, ep=ep, fused=fused,
                      fp8=fp8, model=config_items(cfg))


def config_items(cfg: ModelConfig) -> tuple:
    """A ModelConfig as hashable (field, value) pairs (lists become tuples)."""
    return tuple((f.name, tuple(v) if isinstance(v := getattr(cfg, f.name), list) else v)
                 for f in dataclasses.fields(cfg))


def _per_layer_flops(shape: LayerShape) -> tuple[ForwardFlops, ForwardFlops]:
    """Forward FLOPs per token of one layer: (GEMMs as counted, attention as executed)."""
    cfg = shape.model_config()
    L = shape.layers
    gem = forward_flops_per_token(cfg, "dense")
    if shape.flash:
        # block-sparse kernels skip fully masked blocks: the causal (and windowed) count
        att = forward_flops_per_token(cfg, "causal")
    elif cfg.attention == "block_sparse" or cfg.arch == "griffin":
        # blockwise by construction (models.attention): only the window's blocks are
        # multiplied, with or without a fused kernel
        att = gem
    else:
        # a materialised score matrix is computed in full, whatever the mask (documents too)
        att = forward_flops_per_token(dataclasses.replace(cfg, attention_window=0,
                                                          document_mask=False), "dense")
    scale = lambda f: ForwardFlops(**{k: v / L for k, v in f.as_dict().items()})
    return scale(gem), scale(att)


# -- building blocks --------------------------------------------------------------------------
GRAD_ACC_BYTES = 4   # weight gradients accumulate into fp32 main-grad buffers (Megatron-LM)


def _gemm(name: str, m: float, n: float, k: float, flops: float, e: int, cat: str = "gemm",
          bias: bool = False) -> tuple[Op, list[Op]]:
    """A linear layer y = x W (M x K times K x N): its forward op and its two backward ops."""
    fwd = Op(name, "gemm", "fwd", flops, e * (m * k + k * n + m * n) + (e * n if bias else 0),
             (m, n, k), category=cat)
    dgrad = Op(name + ".dgrad", "gemm", "bwd", flops, e * (m * n + k * n + m * k), (m, k, n),
               category=cat)
    wgrad = Op(name + ".wgrad", "gemm", "bwd", flops,
               e * (m * k + m * n) + 2 * GRAD_ACC_BYTES * k * n, (k, n, m), wgrad=True,
               category=cat)
    return fwd, [dgrad, wgrad]


def _mem(name: str, fwd_bytes: float, bwd_bytes: float, flops: float = 0.0,
         attn_core: bool = False, cat: str = "memory",
         eager: tuple[str, int, int] | None = None) -> tuple[Op, list[Op]]:
    """A memory-bound operator: one fused kernel each way, or with `eager` = (class, forward
    kernels, backward kernels) a chain of PyTorch eager kernels (E_MEM_EAGER of its class, one
    launch each)."""
    cls, kf, kb = eager or ("", 1, 1)
    return (Op(name, "mem", "fwd", flops, fwd_bytes, attn_core=attn_core, category=cat,
               kernels=kf, eager=cls),
            [Op(name + ".bwd", "mem", "bwd", flops, bwd_bytes, attn_core=attn_core,
                category=cat, kernels=kb, eager=cls)] if bwd_bytes else [])


def _norm_op(name: str, shape: LayerShape, tokens: float) -> tuple[Op, list[Op]]:
    """LayerNorm / RMSNorm over `tokens` rows: one fused kernel each way (Apex / Megatron /
    Liger: read x, write y; read x, dy, write dx), or unfused as PyTorch runs them
    (`NORM_EAGER`: RMSNorm as pow, mean, rsqrt and two multiplies with autograd's backward;
    LayerNorm as torch's native kernel), at the eager norm kernels' bandwidth (E_MEM_EAGER
    "norm", fitted to Liger's and QuACK's norm benchmarks) with one launch per kernel."""
    e, n = shape.act_bytes, tokens * shape.hidden
    if shape.fused:
        return _mem(name, 2 * e * n, 3 * e * n, 5 * n)
    (fb, fk), (bb, bk) = NORM_EAGER[shape.arch if shape.arch in NORM_EAGER else "llama"]
    return _mem(name, fb * e * n, bb * e * n, 5 * n, eager=("norm", fk, bk))


BULK, RING = 1, 0          # Op.chunks: beside another GEMM / tp pieces of the paired GEMM
TP_PIPELINE_SPLITS = 4     # TransformerEngine's default num_splits of a "pipeline" overlap


def _comm(name: str, phase: str, coll: str, size: float, group: str, pair: str = "",
          always: bool = False, chunks: int = RING) -> Op:
    return Op(name, "comm", phase, 0.0, size, coll=coll, group=group, pair=pair,
              always_overlap=always, chunks=chunks, category=group)


def layer_ops(shape: LayerShape) -> list[Op]:
    """Forward and backward operators of one transformer layer, for one microbatch, per device.

    Tokens on a device: T = micro_batch * seq_len / cp. With tensor parallelism the GEMMs and the
    attention are split over tp ranks; norms, dropout and residual adds are replicated over the
    tp ranks unless sequence parallelism shards them (Korthikanti et al. 2022, section 4.2.2).
    """
    if eager_supported(shape):
        return eager_layer_ops(shape)
    e, tp, h = shape.act_bytes, shape.tp, shape.hidden
    T = shape.micro_batch * shape.seq_len / shape.cp
    Tsp = T / tp if shape.sp else T
    hd = shape.head_dim
    q_dim, kv_dim = shape.heads * hd, shape.kv_heads * hd
    ffn = shape.ffn
    gpt = shape.arch == "gpt"
    p = shape.dropout
    gem, att = _per_layer_flops(shape)
    fwd: list[Op] = []
    bwd: list[list[Op]] = []

    def add(pair):
        fwd.append(pair[0])
        bwd.append(pair[1])

    def norm(name):
        # fused: read x, write y (fwd); read x, dy, write dx (bwd). Unfused: PyTorch's kernels
        add(_norm_op(name, shape, Tsp))

    def residual(name, with_bias):
        # [bias +] dropout + residual add: fused = one pass; else one pass per step
        mask = Tsp * h if p else 0.0
        if shape.fused:
            add(_mem(name, 3 * e * Tsp * h + mask, 3 * e * Tsp * h + mask, 2 * Tsp * h))
            return
        steps = (2 if with_bias else 0) + (2 if p else 0) + 3
        f = steps * e * Tsp * h + mask
        b = ((3 if p else 0) + 3) * e * Tsp * h + mask
        add(_mem(name, f, b, 2 * Tsp * h,
                 eager=("pointwise", (1 if with_bias else 0) + (1 if p else 0) + 1,
                        (1 if p else 0) + 1)))

    def activation():
        n = T * ffn / tp
        if gpt and shape.fused:
            add(_mem("bias_gelu", 2 * e * n, 3 * e * n, 8 * n))
        elif gpt:   # bias add, then GELU; backward: GELU's gradient and the bias sum
            add(_mem("bias_gelu", 4 * e * n, 4 * e * n, 8 * n, eager=("pointwise", 2, 2)))
        elif shape.fused:
            add(_mem("swiglu", 3 * e * n, 5 * e * n, 6 * n))
        else:       # silu, multiply; backward: two multiplies and silu_backward
            (fb, fk), (bb, bk) = SWIGLU_EAGER
            add(_mem("swiglu", fb * e * n, bb * e * n, 6 * n, eager=("pointwise", fk, bk)))

    def tp_in(name, pair, conj_pair, wgrad_pair):
        """Collective entering a column-parallel GEMM (SP all-gather / bwd all-reduce). With
        overlap.tp (TransformerEngine's defaults): the forward all-gather by ring exchange
        against the GEMM, the all-reduce beside the weight-gradient GEMM; the SP reduce-scatter
        of the input gradient runs beside it always (Megatron-LM's asynchronous one)."""
        if tp == 1:
            return
        size = T * h * e
        if shape.sp:
            fwd.append(_comm(name + ".ag", "fwd", "all_gather", size, "tp", pair))
            bwd.append([_comm(name + ".rs.bwd", "bwd", "reduce_scatter", size, "tp", wgrad_pair,
                              always=True, chunks=BULK),
                        _comm(name + ".ag.bwd", "bwd", "all_gather", size, "tp", conj_pair,
                              always=True)])
        else:
            bwd.append([_comm(name + ".ar.bwd", "bwd", "allreduce", size, "tp", wgrad_pair,
                              chunks=BULK)])

    def tp_out(name, pair, conj_pair):
        """Collective leaving a row-parallel GEMM (all-reduce, or SP reduce-scatter). With
        overlap.tp (TransformerEngine's defaults): the forward reduce-scatter pipelined against
        the GEMM in TP_PIPELINE_SPLITS pieces, the backward all-gather of the output gradient by
        ring exchange against the data-gradient GEMM."""
        if tp == 1:
            return
        size = T * h * e
        if shape.sp:
            fwd.append(_comm(name + ".rs", "fwd", "reduce_scatter", size, "tp", pair,
                             chunks=TP_PIPELINE_SPLITS))
            bwd.append([_comm(name + ".ag.bwd", "bwd", "all_gather", size, "tp", conj_pair)])
        else:
            fwd.append(_comm(name + ".ar", "fwd", "allreduce", size, "tp", ""))

    n_in = 2 if not gpt else 1                 # SwiGLU has gate and up projections
    n_mats = n_in + 1
    dense_mlp = not shape.experts
    mlp_in_flops = gem.mlp * n_in / n_mats * T / tp
    mlp_out_flops = gem.mlp / n_mats * T / tp

    # -- attention block ---------------------------------------------------------------------
    norm("attn_norm")
    if shape.parallel_block and dense_mlp:
        # one gather for both branches, cut against FC1; QKV reads it whole (MegaScale Fig. 3b)
        tp_in("block_in", "fc1", "fc1.dgrad", "fc1.wgrad")
    else:
        tp_in("qkv", "qkv", "qkv.dgrad", "qkv.wgrad")
    add(_gemm("qkv", T, (q_dim + 2 * kv_dim) / tp, h, gem.qkv * T / tp, e, bias=gpt))
    if not gpt:
        n_rot = T * (q_dim + kv_dim) / tp
        if shape.fused:
            add(_mem("rope", 2 * e * n_rot, 2 * e * n_rot, 6 * n_rot))
        else:   # neg, cat, two multiplies and an add per tensor, as in eager PyTorch
            (fb, fk), (bb, bk) = ROPE_EAGER
            add(_mem("rope", fb * e * n_rot, bb * e * n_rot, 6 * n_rot, eager=("rope", fk, bk)))
    _attention_core(shape, att, T, e, q_dim, kv_dim, fwd, bwd, add)
    add(_gemm("attn_out", T, h, q_dim / tp, gem.attn_out * T / tp, e))
    for pair in recurrent_mixer_ops(shape, gem, T / tp, e):
        add(pair)
    if shape.parallel_block and dense_mlp:
        # both branches end in a row-parallel GEMM; their sum needs one reduction (PaLM)
        add(_gemm("fc1", T, n_in * ffn / tp, h, mlp_in_flops, e))
        activation()
        add(_gemm("fc2", T, h, ffn / tp, mlp_out_flops, e))
        add(_mem("branch_sum", 3 * e * T * h, 0.0, T * h))
        tp_out("block_out", "fc2", "fc2.dgrad")
        residual("residual", gpt)
    else:
        tp_out("attn_out", "attn_out", "attn_out.dgrad")
        residual("attn_residual", gpt)
        norm("mlp_norm")
        if dense_mlp:
            tp_in("fc1", "fc1", "fc1.dgrad", "fc1.wgrad")
            add(_gemm("fc1", T, n_in * ffn / tp, h, mlp_in_flops, e))
            activation()
            add(_gemm("fc2", T, h, ffn / tp, mlp_out_flops, e))
        else:
            _moe(shape, T, Tsp, gem, add, fwd, bwd, tp_in)
        tp_out("mlp_out", "fc2" if dense_mlp else "", "fc2.dgrad" if dense_mlp else "")
        residual("mlp_residual", gpt)
    if shape.cp > 1:
        # ring attention: cp-1 steps pass this rank's K and V around the ring (forward), and
        # K, V plus their gradients (backward); hidden behind the attention blocks
        kv = 2 * shape.micro_batch * (shape.seq_len / shape.cp) * kv_dim / tp * e
        fwd.append(_comm("cp_ring", "fwd", "p2p", (shape.cp - 1) * kv, "cp", "attention"))
        bwd.append([_comm("cp_ring.bwd", "bwd", "p2p", 2 * (shape.cp - 1) * kv, "cp",
                          "attention")])
    if shape.fp8:
        _fp8_casts(fwd, bwd, e)
    ops = list(fwd)
    for group in reversed(bwd):
        ops.extend(group)
    return ops


def _attention_core(shape: LayerShape, att: ForwardFlops, T: float, e: int, q_dim: float,
                    kv_dim: float, fwd: list, bwd: list, add) -> None:
    """The attention core's operators (FlashAttention, or the materialised scores, softmax,
    dropout and values), appended to `fwd` and `bwd` (`add`: a forward op and its backward)."""
    tp, hd, p = shape.tp, shape.head_dim, shape.dropout
    heads = shape.heads / tp
    b = shape.micro_batch
    s_q, s_kv = shape.seq_len / shape.cp, shape.seq_len
    attn_flops = (att.attn_scores + att.attn_values) * T / tp
    if shape.flash:
        qkvo = e * T * (2 * q_dim + 2 * kv_dim) / tp * (1 if shape.cp == 1 else 1.0)
        lse = 4 * T * heads
        fwd.append(Op("flash_attn", "attn", "fwd", attn_flops, qkvo + lse, (s_q, s_kv, hd),
                      batch=int(b * heads), attn_core=True, category="attention"))
        # FlashAttention-2 backward: five matrix products against the forward's two (2.5x
        # FLOPs); reads Q, K, V, O, dO and writes dQ, dK, dV
        bwd.append([Op("flash_attn.bwd", "attn", "bwd", 2.5 * attn_flops,
                       2 * qkvo + qkvo / 2 + lse, (s_q, s_kv, hd), batch=int(b * heads),
                       attn_core=True, category="attention")])
    else:
        n_scores = b * heads * s_q * s_kv
        # QK^T: [s_q x hd] x [hd x s_kv] per head; K, V are expanded to every query head
        sc_flops = att.attn_scores * T / tp
        f = Op("attn_scores", "gemm", "fwd", sc_flops,
               e * (b * heads * (s_q + s_kv) * hd + n_scores), (s_q, s_kv, hd),
               batch=int(b * heads), attn_core=True, category="attention")
        fwd.append(f)
        bwd.append([dataclasses.replace(f, name="attn_scores.dq", phase="bwd",
                                        dims=(s_q, hd, s_kv)),
                    dataclasses.replace(f, name="attn_scores.dk", phase="bwd",
                                        dims=(s_kv, hd, s_q))])
        # scale + causal mask + softmax (fp16 in, fp16 out; fp32 inside the fused kernel)
        passes_f, passes_b = (2, 3) if shape.fused else (6, 7)
        add(_mem("softmax", passes_f * e * n_scores, passes_b * e * n_scores, 5 * n_scores,
                 attn_core=True, cat="attention",
                 eager=None if shape.fused else ("softmax", 3, 3)))
        if p:
            add(_mem("attn_dropout", (2 * e + 1) * n_scores, (2 * e + 1) * n_scores,
                     n_scores, attn_core=True, cat="attention"))
        pv_flops = att.attn_values * T / tp
        f = Op("attn_values", "gemm", "fwd", pv_flops,
               e * (n_scores + b * heads * (s_kv + s_q) * hd), (s_q, hd, s_kv),
               batch=int(b * heads), attn_core=True, category="attention")
        fwd.append(f)
        bwd.append([dataclasses.replace(f, name="attn_values.dp", phase="bwd",
                                        dims=(s_q, s_kv, hd)),
                    dataclasses.replace(f, name="attn_values.dv", phase="bwd",
                                        dims=(s_kv, hd, s_q))])


def recurrent_mixer_ops(shape: LayerShape, gem: ForwardFlops, T: float, e: int
                        ) -> list[tuple[Op, list[Op]]]:
    """The work of the recurrent mixers (Gated DeltaNet, Mamba-2, RG-LRU, retention, linear
    attention) beyond what the attention operators price, averaged over the layers as the
    layer's FLOPs are (`_per_layer_flops`): their gate projections as one GEMM, the short
    convolutions as a memory-bound pass, and the chunked forms' state products and triangular
    solves at the rate of a (tokens x head_dim) by (head_dim x head_dim) product, backward
    twice the forward. T: tokens on this device (a tensor-parallel rank's share); none for
    attention-only models."""
    ops = []
    h, hd = shape.hidden, shape.head_dim
    if gem.gate:
        n = gem.gate / (2 * h)       # output width of the gate projections
        ops.append(_gemm("mixer_gates", T, n, h, gem.gate * T, e))
    if gem.conv:
        width = gem.conv / 8         # channels of the width-4 short convolutions
        ops.append(_mem("mixer_conv", 2 * e * T * width, 4 * e * T * width, gem.conv * T))
    chunked = gem.state + gem.solve
    if chunked:
        f = Op("mixer_state", "gemm", "fwd", chunked * T, 4 * e * T * hd, (T, hd, hd),
               category="attention")
        ops.append((f, [dataclasses.replace(f, name="mixer_state.bwd", phase="bwd",
                                            flops=2 * f.flops, bytes=2 * f.bytes)]))
    return ops


def _fp8_casts(fwd: list[Op], bwd: list[list[Op]], e: int) -> None:
    """fp8 GEMMs (Transformer Engine recipe): operands are cast from 16 bits to 8 bits.

    Each GEMM then reads 1-byte operands, and one memory-bound pass per layer and direction
    casts every activation operand (read 2 bytes, write 1) and the weights (amortised: weights
    are cast once per microbatch too). Delayed scaling keeps amax bookkeeping negligible.
    """
    cast_f = cast_b = 0.0
    for op in fwd:
        if op.kind == "gemm" and not op.attn_core:
            m, n, k = op.dims
            cast_f += (e + 1) * (m * k + k * n) * op.batch
            op.bytes -= (e - 1) * (m * k + k * n) * op.batch
    for group in bwd:
        for op in group:
            if op.kind == "gemm" and not op.attn_core and not op.wgrad:
                m, n, k = op.dims
                cast_b += (e + 1) * m * k * op.batch   # the incoming gradient
                op.bytes -= (e - 1) * (m * k + k * n) * op.batch
    fwd.append(Op("fp8_cast", "mem", "fwd", 0.0, cast_f, category="memory"))
    bwd.append([Op("fp8_cast.bwd", "mem", "bwd", 0.0, cast_b, category="memory")])


def _moe(shape: LayerShape, T: float, Tsp: float, gem: ForwardFlops, add, fwd, bwd, tp_in):
    """Mixture-of-experts MLP: router, permutation, all-to-all, grouped expert GEMMs."""
    e, tp, h, ffn = shape.act_bytes, shape.tp, shape.hidden, shape.ffn
    gpt = shape.arch == "gpt"
    n_in = 1 if gpt else 2
    cf = shape.capacity_factor or 1.0
    E, k = shape.experts, shape.top_k
    add(_gemm("router", Tsp, E, h, gem.router * Tsp, e))
    add(_mem("topk", 3 * 4 * Tsp * E, 3 * 4 * Tsp * E, 5 * Tsp * E))
    routed = T * k * cf / tp                      # token copies this rank dispatches
    add(_mem("permute", 2 * e * routed * h, 2 * e * routed * h))
    size = routed * h * e
    if shape.ep > 1:
        fwd.append(_comm("dispatch", "fwd", "all_to_all", size, "ep"))
        bwd.append([_comm("dispatch.bwd", "bwd", "all_to_all", size, "ep")])
    local = max(1, E // shape.ep)
    m_exp = routed * shape.ep / E                 # tokens per local expert (balanced routing)
    per_tok = gem.mlp / k                         # one expert's forward FLOPs per token
    f_in = per_tok * n_in / (n_in + 1) * routed
    f_out = per_tok / (n_in + 1) * routed
    fi, bi = _gemm("expert_fc1", m_exp, n_in * ffn / tp, h, f_in, e)
    fo, bo = _gemm("expert_fc2", m_exp, h, ffn / tp, f_out, e)
    for op in [fi, fo, *bi, *bo]:
        op.batch = local
        op.bytes = op.bytes * local
    act = (2 if gpt else 3) * e * routed * ffn / tp
    fwd.append(fi)
    bwd.append(bi)
    add(_mem("expert_act", act, 1.6 * act, 6 * routed * ffn / tp))
    fwd.append(fo)
    bwd.append(bo)
    if shape.ep > 1:
        fwd.append(_comm("combine", "fwd", "all_to_all", size, "ep"))
        bwd.append([_comm("combine.bwd", "bwd", "all_to_all", size, "ep")])
    add(_mem("unpermute", 3 * e * routed * h, 3 * e * routed * h, 2 * routed * h))


def head_ops(shape: LayerShape, first: bool, last: bool) -> list[Op]:
    """Embedding (first stage) and final norm, logits and cross-entropy (last stage) ops."""
    if eager_supported(shape):
        return eager_head_ops(shape, first, last)
    e, tp, h, V = shape.act_bytes, shape.tp, shape.hidden, shape.vocab
    T = shape.micro_batch * shape.seq_len / shape.cp
    Tsp = T / tp if shape.sp else T
    gem, _ = _per_layer_flops(shape)
    ops: list[Op] = []
    bwd: list[Op] = []
    if first:
        pos = 2 if shape.arch == "gpt" else 0
        drop = 3 if shape.dropout else 0
        ops.append(Op("embedding", "mem", "fwd", 0.0, (2 + pos + drop) * e * T * h,
                      category="memory"))
        # scatter-add of the token gradients into the (fp32) embedding gradient
        bwd.append(Op("embedding.bwd", "mem", "bwd", 0.0, (e + 2 * GRAD_ACC_BYTES) * T * h,
                      category="memory"))
        if tp > 1:  # vocabulary-parallel embedding: partial lookups are summed over tp
            coll = "reduce_scatter" if shape.sp else "allreduce"
            ops.append(_comm("embedding.tp", "fwd", coll, T * h * e, "tp"))
    if last:
        nf, nb = _norm_op("final_norm", shape, Tsp)
        ops.append(nf)
        bwd.extend(nb)
        if tp > 1 and shape.sp:
            ops.append(_comm("logits.ag", "fwd", "all_gather", T * h * e, "tp", "logits"))
            bwd.append(_comm("logits.rs.bwd", "bwd", "reduce_scatter", T * h * e, "tp",
                             "logits.wgrad", chunks=BULK))
        elif tp > 1:
            bwd.append(_comm("logits.ar.bwd", "bwd", "allreduce", T * h * e, "tp",
                             "logits.wgrad", chunks=BULK))
        # flops.py counts the output layer once per token for the whole model
        f, b = _gemm("logits", T, V / tp, h, gem.logits * shape.layers * T / tp, e)
        ops.append(f)
        bwd.extend(b)
        n = T * V / tp
        # vocabulary-parallel cross-entropy on fp32 logits (Megatron-LM upcasts the fp16/bf16
        # logits): upcast, max, exp, sum, log-softmax gather ~ 5 fp32 passes forward, softmax
        # gradient and downcast backward
        ops.append(Op("cross_entropy", "mem", "fwd", 5 * n, (e + 4 * 5) * n, category="memory"))
        bwd.append(Op("cross_entropy.bwd", "mem", "bwd", 3 * n, (4 * 3 + e) * n,
                      category="memory"))
    return ops + list(reversed(bwd))


# -- myria's eager PyTorch modules (the CPU path) -----------------------------------------------
# What `myria.models.transformer` runs, kernel by kernel, when nothing is fused: separate Q, K, V
# and gate/up projections (each one GEMM forward and two backward), RMSNorm as pow, mean, rsqrt
# and two multiplies (LayerNorm: one native kernel), RoPE as neg, cat, two multiplies and an add
# per tensor, SDPA's flash kernel (causal work only), SiLU/GELU and the gating multiply, residual
# adds, and in the backward the sums autograd makes where a tensor feeds several operators. Byte
# counts are in units of e*T (e = bytes per element, T tokens), per kernel input + output, as a
# torch dispatch-mode trace of one block counts them (tests/sim/test_cpu.py checks the total).
NORM_EAGER = {"llama": ((7, 6), (24, 14)), "gpt": ((2, 1), (3, 1))}   # ((fwd, kernels), (bwd, k))
ROPE_EAGER = ((10, 10), (14, 14))  # per element of q and k: (bytes/e, kernels) fwd, bwd
SWIGLU_EAGER = ((5, 2), (9, 3))    # silu + mul per ffn element; backward: 2 mul + silu_backward
GELU_EAGER = ((2, 1), (3, 1))
CE_FUSED_PASSES = 8                # amax, sub_, exp_, sum, div_ (read + write where in place)
CE_PLAIN_PASSES = (3, 4)           # log_softmax (2 reads, 1 write); nll + log_softmax backward


def eager_supported(shape: LayerShape) -> bool:
    """The eager op lists cover myria's dense blocks without tp/cp/sp, dropout or fp8 (the
    same rule prices their memory: myria.models.memory.eager_layer)."""
    return eager_layer(shape)


def _eager_linear(name: str, T: float, n: float, k: float, flops: float, e: int,
                  cat: str = "gemm") -> tuple[Op, list[Op]]:
    """nn.Linear: x @ W^T (nt), dx = dy @ W (nn), dW^T = x^T @ dy (tn), as autograd runs them."""
    fwd, (dgrad, wgrad) = _gemm(name, T, n, k, flops, e, cat)
    fwd.layout, dgrad.layout, wgrad.layout = "nt", "nn", "tn"
    wgrad.bytes = e * (T * k + T * n + k * n)   # autograd writes a fresh gradient
    return fwd, [dgrad, wgrad]


def _eager_mem(name: str, fwd: tuple, bwd: tuple, unit: float,
               cls: str = "pointwise") -> tuple[Op, list[Op]]:
    (fb, fk), (bb, bk) = fwd, bwd
    return (Op(name, "mem", "fwd", 0.0, fb * unit, kernels=fk, category="memory",
               layout="eltwise", eager=cls),
            [Op(name + ".bwd", "mem", "bwd", 0.0, bb * unit, kernels=bk, category="memory",
                layout="eltwise", eager=cls)])


def eager_layer_ops(shape: LayerShape) -> list[Op]:
    """One block of `myria.models.transformer` in eager PyTorch, one microbatch, one device."""
    e, h = shape.act_bytes, shape.hidden
    T = shape.micro_batch * shape.seq_len
    hd = shape.head_dim
    q, kv, f = shape.heads * hd, shape.kv_heads * hd, shape.ffn
    gpt = shape.arch == "gpt"
    gem, att = _per_layer_flops(dataclasses.replace(shape, flash=True))
    unit = e * T
    fwd: list[Op] = []
    bwd: list[list[Op]] = []

    def add(pair):
        fwd.append(pair[0])
        bwd.append(pair[1])

    def bwd_only(name: str, nbytes: float, kernels: int) -> None:
        bwd.append([Op(name, "mem", "bwd", 0.0, nbytes, kernels=kernels, category="memory",
                       layout="eltwise")])

    def linear(name: str, n: float, k: float, flops: float) -> None:
        add(_eager_linear(name, T, n, k, flops, e))
        if gpt:  # bias gradient: a sum over the tokens of the output gradient
            bwd_only(name + ".bias_grad", e * T * n, 1)

    norm = NORM_EAGER.get(shape.arch, NORM_EAGER["llama"])
    add(_eager_mem("attn_norm", norm[0], norm[1], unit * h, "norm"))
    per_out = gem.qkv * T / (q + 2 * kv)
    linear("wq", q, h, per_out * q)
    linear("wk", kv, h, per_out * kv)
    linear("wv", kv, h, per_out * kv)
    bwd_only("qkv.dgrad_sum", 2 * 3 * unit * h, 2)   # x feeds three projections
    if not gpt:
        add(_eager_mem("rope", ROPE_EAGER[0], ROPE_EAGER[1], unit * (q + kv), "rope"))
    b = shape.micro_batch
    s = shape.seq_len
    flops = (att.attn_scores + att.attn_values) * T
    io = e * T * (2 * q + 2 * kv)
    lse = 4 * T * shape.heads
    gqa = max(1, shape.heads // shape.kv_heads)
    fwd.append(Op("sdpa", "attn", "fwd", flops, io + lse, (s, s, hd), batch=b * shape.heads,
                  attn_core=True, category="attention", layout="attn-fwd", gqa=gqa))
    # backward: 2.5x the forward's matrix products (recomputes P, then dV, dP, dQ, dK)
    bwd.append([Op("sdpa.bwd", "attn", "bwd", 2.5 * flops, 2 * io + io / 2 + lse, (s, s, hd),
                   batch=b * shape.heads, attn_core=True, category="attention",
                   layout="attn-bwd", gqa=gqa)])
    linear("wo", h, q, gem.attn_out * T)
    for pair in recurrent_mixer_ops(shape, gem, T, e):
        add(pair)
    add(_eager_mem("attn_residual", (3, 1), (3, 1), unit * h))   # add; backward: the fork's sum
    add(_eager_mem("mlp_norm", norm[0], norm[1], unit * h, "norm"))
    if gpt:
        linear("w1", f, h, gem.mlp / 2 * T)
        add(_eager_mem("gelu", GELU_EAGER[0], GELU_EAGER[1], unit * f))
        linear("w2", h, f, gem.mlp / 2 * T)
    else:
        linear("w1", f, h, gem.mlp / 3 * T)
        linear("w3", f, h, gem.mlp / 3 * T)
        bwd_only("w13.dgrad_sum", 3 * unit * h, 1)
        add(_eager_mem("swiglu", SWIGLU_EAGER[0], SWIGLU_EAGER[1], unit * f))
        linear("w2", h, f, gem.mlp / 3 * T)
    add(_eager_mem("mlp_residual", (3, 1), (3, 1), unit * h))
    # time between kernels (Python, autograd, module calls), forward and backward together
    fwd.append(Op("host.block", "host", "fwd", layout="block", kernels=0, category="host"))
    ops = list(fwd)
    for group in reversed(bwd):
        ops.extend(group)
    return ops


def eager_head_ops(shape: LayerShape, first: bool, last: bool) -> list[Op]:
    """Embeddings (first stage), final norm, output layer and loss (last stage), eager.

    With `ce_chunk` the loss is `myria.models.loss.fused_linear_cross_entropy`: per chunk of rows
    the logits GEMM, five fp32 passes over the chunk's logits, then the input- and weight-gradient
    GEMMs (the latter accumulating into one fp32 gradient), all inside the forward; its backward
    only scales the two stored gradients. Without it (pipeline last stage) the logits exist
    whole: F.cross_entropy's log-softmax forward, and the NLL and log-softmax backward.
    """
    e, h, V = shape.act_bytes, shape.hidden, shape.vocab
    T = shape.micro_batch * shape.seq_len
    gem, _ = _per_layer_flops(shape)
    fwd: list[Op] = []
    bwd: list[Op] = []
    if first:
        extra = (2 + 3, 2) if shape.arch == "gpt" else (0, 0)   # learned positions + add
        fwd.append(Op("embedding", "mem", "fwd", 0.0, (2 + extra[0]) * e * T * h,
                      kernels=1 + extra[1], category="memory", layout="head"))
        # embedding_dense_backward: a zeroed (V x h) gradient, then a scatter-add of T rows
        bwd.append(Op("embedding.bwd", "mem", "bwd", 0.0, e * (V * h + 3 * T * h),
                      kernels=2 + extra[1], category="memory", layout="head"))
    if last:
        norm = NORM_EAGER.get(shape.arch, NORM_EAGER["llama"])
        nf, nb = _eager_mem("final_norm", norm[0], norm[1], e * T * h, "norm")
        nf.layout = nb[0].layout = "head"
        fwd.append(nf)
        bwd.extend(nb)
        flops = gem.logits * shape.layers * T
        n = T * V
        if shape.ce_chunk:
            c = min(float(shape.ce_chunk), T)
            k = max(1, math.ceil(T / c))
            fwd.append(Op("logits", "gemm", "fwd", flops, e * (T * h + k * V * h + n), (c, V, h),
                          layout="nt", kernels=k, category="gemm"))
            fwd.append(Op("cross_entropy", "mem", "fwd", 5 * n,
                          4 * CE_FUSED_PASSES * n + 4 * V * h, kernels=8 * k + 2,
                          category="memory", layout="head"))
            fwd.append(Op("logits.dgrad", "gemm", "fwd", flops, e * (n + k * V * h + T * h),
                          (c, h, V), layout="nn", kernels=k, category="gemm"))
            fwd.append(Op("logits.wgrad", "gemm", "fwd", flops, e * (n + T * h) + 8 * k * V * h,
                          (V, h, c), layout="tna", kernels=k, wgrad=True, category="gemm"))
            bwd.append(Op("cross_entropy.bwd", "mem", "bwd", 0.0, 2 * e * T * h + 8 * V * h,
                          kernels=2, category="memory", layout="head"))
        else:
            fwd.append(Op("logits", "gemm", "fwd", flops, e * (T * h + V * h + n), (T, V, h),
                          layout="nt", category="gemm"))
            fwd.append(Op("cross_entropy", "mem", "fwd", 5 * n, 4 * CE_PLAIN_PASSES[0] * n,
                          kernels=2, category="memory", layout="head"))
            bwd.append(Op("cross_entropy.bwd", "mem", "bwd", 3 * n, 4 * CE_PLAIN_PASSES[1] * n,
                          kernels=2, category="memory", layout="head"))
            bwd.append(Op("logits.dgrad", "gemm", "bwd", flops, e * (n + V * h + T * h),
                          (T, h, V), layout="nn", category="gemm"))
            bwd.append(Op("logits.wgrad", "gemm", "bwd", flops, e * (n + T * h + V * h),
                          (V, h, T), layout="tn", wgrad=True, category="gemm"))
        fwd.append(Op("host.head", "host", "fwd", layout="head", kernels=0, category="host"))
    return fwd + list(reversed(bwd))
