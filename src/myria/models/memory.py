"""Memory per layer: activations a layer keeps for backward, parameters a pipeline stage holds.

The one source for the trainer (the offload tier's fast-memory budget, myria.offload.budget)
and the planner (myria.sim.memory prices a whole device with them), as models/flops.py is for
FLOPs. Activations are enumerated tensor by tensor, as Korthikanti et al. 2022 (section 4)
count them, under tensor and sequence parallelism and each recomputation mode (FlashAttention
stores a log-sum-exp per query and head, never the score matrix); in-flight microbatches on the
first pipeline stage follow the schedule (GPipe, 1F1B, zero-bubble, interleaved). The formulas
read a layer's dimensions from a `LayerDims`: the trainer's budget builds one with
`layer_dims`, the planner's `sim.operators.LayerShape` is one (a subclass that adds what its
operators' time depends on). The closed forms these reproduce: docs/architectures.md, "Reasons
behind the model modules".
"""

from __future__ import annotations

from dataclasses import dataclass

from myria.config import ModelConfig
from myria.models.flops import ParamCounts


@dataclass(frozen=True)
class LayerDims:
    """What fixes one layer's activation memory on one device (hashable)."""

    arch: str
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    seq_len: int
    experts: int
    top_k: int
    capacity_factor: float
    parallel_block: bool
    micro_batch: int
    tp: int = 1
    cp: int = 1
    sp: bool = False
    flash: bool = False
    dropout: float = 0.0
    act_bytes: int = 2
    eager: bool = False      # myria's own eager modules (what autograd keeps in models.transformer)
    ce_chunk: int = 0        # rows per chunk of the fused linear + cross-entropy (eager)

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


def layer_dims(cfg: ModelConfig, micro_batch: int, *, tp: int = 1, cp: int = 1,
               sp: bool = False, flash: bool = False, dropout: float = 0.0,
               act_bytes: int = 2) -> LayerDims:
    """The LayerDims of a ModelConfig under a parallel layout (sequence parallel needs tp > 1)."""
    return LayerDims(arch=cfg.arch, hidden=cfg.hidden, heads=cfg.heads, kv_heads=cfg.n_kv_heads,
                     ffn=cfg.ffn_dim, vocab=cfg.vocab_size, seq_len=cfg.seq_len,
                     experts=cfg.experts, top_k=cfg.top_k, capacity_factor=cfg.capacity_factor,
                     parallel_block=cfg.parallel_block, micro_batch=micro_batch, tp=tp, cp=cp,
                     sp=sp and tp > 1, flash=flash, dropout=dropout, act_bytes=act_bytes)


def eager_layer(shape) -> bool:
    """Whether a layer is priced as myria's own eager block (`eager_layer_activation_bytes`):
    dense, without tp/cp, dropout or fp8 (what the eager op lists cover)."""
    return bool(getattr(shape, "eager", False) and shape.tp == 1 and shape.cp == 1
                and not shape.experts and not shape.parallel_block and not shape.dropout
                and not getattr(shape, "fp8", False))


def layer_activation_bytes(shape: LayerDims, recompute: str) -> float:
    """Bytes one layer keeps for its backward pass, per microbatch, on one device."""
    if eager_layer(shape):
        return eager_layer_activation_bytes(shape, recompute)
    e, tp, h = shape.act_bytes, shape.tp, shape.hidden
    T = shape.micro_batch * shape.seq_len / shape.cp
    Tsp = T / tp if shape.sp else T
    if recompute == "full":
        return e * Tsp * h  # the layer's input only
    hd = shape.head_dim
    q, kv = shape.heads * hd, shape.kv_heads * hd
    ffn = shape.ffn
    gpt = shape.arch == "gpt"
    n_in = 1 if gpt else 2
    if recompute == "elementwise":
        # GEMM and attention outputs only: layer input and post-attention residual (norms are
        # recomputed from them), Q/K/V before RoPE, the attention output (or, unfused, the
        # score GEMM's output), fc1's output(s); the activation and dropout are recomputed
        total = e * Tsp * h * (1 if shape.parallel_block else 2)
        total += e * T * (q + 2 * kv) / tp + e * T * q / tp
        if shape.flash:
            total += 4 * T * shape.heads / tp
        else:
            total += e * shape.micro_batch * shape.heads / tp * T * shape.seq_len
        if shape.experts:
            cf = shape.capacity_factor or 1.0
            routed = T * shape.top_k * cf / tp
            total += 4 * Tsp * shape.experts + e * routed * h + e * routed * ffn / tp * n_in
        else:
            total += e * T * ffn / tp * n_in
        return total
    p = shape.dropout
    mask = Tsp * h if p else 0.0               # 1-byte dropout masks
    total = 0.0
    # attention block: norm input, QKV input, Q, K, V, output-projection input, dropout mask
    total += e * Tsp * h + e * Tsp * h
    total += e * T * (q + 2 * kv) / tp + e * T * q / tp + mask
    if shape.flash:
        total += 4 * T * shape.heads / tp      # log-sum-exp per query and head
    elif recompute != "selective":
        n_scores = shape.micro_batch * shape.heads / tp * (shape.seq_len / shape.cp) * \
            shape.seq_len
        total += e * n_scores                  # softmax output
        if p:
            total += n_scores * (1 + e)        # dropout mask and dropout output
    # MLP block
    if not shape.parallel_block:
        total += e * Tsp * h                   # MLP norm input
    if shape.experts:
        cf = shape.capacity_factor or 1.0
        routed = T * shape.top_k * cf / tp
        total += e * Tsp * h + 4 * Tsp * shape.experts           # router input and probs
        total += e * routed * h                                  # permuted expert input
        total += e * routed * ffn / tp * (n_in + 1)              # activation in/out
    else:
        if not shape.parallel_block:
            total += e * Tsp * h               # FC1 input
        total += e * T * ffn / tp * (n_in + 1)  # activation input(s) and FC2 input
    total += mask
    return total


def eager_layer_activation_bytes(shape: LayerDims, recompute: str) -> float:
    """What autograd keeps for one block of myria's own model (`models.transformer.Block`,
    dense, no tp/cp) per microbatch: tensor by tensor as listed in the module docstring."""
    e, h = shape.act_bytes, shape.hidden
    T = shape.micro_batch * shape.seq_len
    q, kv, f = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim, shape.ffn
    gpt = shape.arch == "gpt"
    lse = 4 * T * shape.heads                   # SDPA's fp32 log-sum-exp
    if recompute == "full":
        return e * T * h                        # checkpoint_wrapper keeps the block's input
    if recompute in ("selective", "elementwise"):  # mm/addmm and SDPA outputs, and the input
        return e * T * (3 * h + 2 * q + 2 * kv + (1 if gpt else 2) * f) + lse
    # norm: input, fp32 statistics (LayerNorm mean and rstd; RMSNorm rstd and x * rstd),
    # and its output as the next Linear's input
    norm = e * T * 2 * h + 8 * T if gpt else e * T * 3 * h + 4 * T
    attn = e * T * (q + 2 * kv) + e * T * q + lse    # SDPA inputs and output
    mlp = e * T * 2 * f if gpt else e * T * 4 * f    # GELU in/out; SwiGLU w1, silu, w3, product
    return 2 * norm + attn + mlp


def backward_transient_bytes(shape: LayerDims) -> float:
    """Gradients in flight inside one layer's backward, at its largest (the MLP activation's
    backward): the residual stream's gradient and the gradients of the activation function's
    inputs (two for SwiGLU, gate and up; one for GELU). Checked against torch's memory
    profiler on myria's blocks (tests/sim/test_memory.py)."""
    e, tp = shape.act_bytes, shape.tp
    T = shape.micro_batch * shape.seq_len / shape.cp
    Tsp = T / tp if shape.sp else T
    n_in = 1 if shape.arch == "gpt" else 2
    return e * (Tsp * shape.hidden + n_in * T * shape.ffn / tp)


def head_activation_bytes(shape: LayerDims, first: bool, last: bool) -> float:
    """Activations of the embedding (first stage) and output layer (last stage), one microbatch:
    at the loss's peak (its forward), the final norm's saved tensors and output and the loss's
    own buffers."""
    e, tp = shape.act_bytes, shape.tp
    T = shape.micro_batch * shape.seq_len / shape.cp
    Tsp = T / tp if shape.sp else T
    total = 0.0
    if first and shape.dropout:
        total += Tsp * shape.hidden            # embedding dropout mask
    if shape.eager and shape.ce_chunk and tp == 1:
        # myria's fused linear + cross-entropy (models/loss.py): tokens and targets (int64),
        # the final norm's saved tensors and output, the input and weight gradients it
        # computes in forward, and one chunk's fp32 logits
        h = shape.hidden
        if first:
            total += 16 * T
        if last:
            norm = e * T * h + 8 * T if shape.arch == "gpt" else e * T * 2 * h + 4 * T
            total += norm + 2 * e * T * h + e * shape.vocab * h + \
                4 * min(T, shape.ce_chunk) * shape.vocab
        return total
    if last:
        # final norm input, logits (16-bit) and their fp32 copy for the cross-entropy
        total += e * Tsp * shape.hidden + (e + 4) * T * shape.vocab / tp
    return total


def in_flight_microbatches(schedule: str, p: int, v: int, m: int, rank: int = 0) -> float:
    """Microbatches whose activations pipeline rank `rank` (default the first) holds at its
    peak, in units of its layers: rank r of 1F1B holds min(m, p - r); of an interleaved
    schedule with v chunks, Megatron-LM's warm-up of 2(p - r - 1) + (v - 1)p chunk-microbatches
    and one more in the steady state, never more than all m x v (with m = p every forward runs
    before the first backward: all m)."""
    if p <= 1:
        return 1.0
    if schedule == "gpipe":
        return float(m)
    if schedule in ("interleaved-1f1b", "zero-bubble") and v > 1:
        chunks = 2 * (p - rank - 1) + (v - 1) * p + 1
        return min(m * v, chunks) / v
    return float(min(m, p - rank))


def stage_params(pc: ParamCounts, tp: int, layers_on_stage: float, first: bool, last: bool,
                 ep: int) -> tuple[float, float]:
    """(dense, expert) parameters held by one device of a stage (`pc`: the model's counts)."""
    dense = layers_on_stage * pc.per_layer_dense / tp
    experts = layers_on_stage * pc.per_layer_experts / (tp * ep)
    if first:
        dense += pc.embedding / tp + pc.positional
    if last:
        dense += pc.final_norm + (pc.head / tp if pc.head else 0.0)
        if not pc.head and not first:
            dense += pc.embedding / tp  # tied output layer: the last stage keeps a copy
    return dense, experts
