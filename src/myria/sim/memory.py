"""Memory per device: weights, gradients, optimizer state under ZeRO 0-3, activations, buffers.

Every rule says which framework keeps memory that way and where the rule comes from.

Activations (per layer and microbatch, one device; e bytes per 16-bit element):

- **Megatron-style layers** are enumerated tensor by tensor, as Korthikanti et al. 2022
  ("Reducing Activation Recomputation in Large Transformer Models", section 4) count them: for
  the GPT layer with dropout and no parallelism s*b*h*(34 + 5*a*s/h) bytes, with tensor
  parallelism s*b*h*(10 + 24/t + 5*a*s/(h*t)), with sequence parallelism everything /t (their
  eqs. 1-4). SwiGLU keeps its two input halves and its output (Megatron-core's fused
  `bias_swiglu` saves the fc1 output, fc2 saves its input). FlashAttention (Dao 2022) never
  stores the b*a*s*s score matrix, only a log-sum-exp per query and head; its output is the
  output projection's input.
- **Recomputation**: `selective` is Korthikanti's (the attention core is recomputed: the 5as/h
  term goes; with FlashAttention nothing changes), `elementwise` keeps only GEMM and attention
  outputs and recomputes norms, RoPE, activation functions and dropout from them (torchtitan's
  op-level selective checkpointing and myria's own `selective` policy; Megatron-core's
  `--recompute-modules layernorm moe_act`), `full` keeps each layer's input (Megatron
  `--recompute-granularity full --recompute-method uniform`), and the one layer being
  recomputed holds its full activations during its backward.
- **myria's own eager modules** (`LayerShape.eager`: what a myria run on torch keeps) are
  counted from what autograd saves in `models.transformer.Block`, tensor by tensor (checked
  against torch's memory profiler in tests/sim/test_memory.py): an RMSNorm keeps its input, its
  fp32 reciprocal RMS and the normalised input, and the Linear after it its output; LayerNorm
  its input and fp32 mean and rstd; SDPA keeps q, k, v, its output and the fp32 log-sum-exp;
  SwiGLU both GEMM outputs, the SiLU output and the product; GELU its input and output. myria's
  `selective` keeps only mm/addmm and SDPA outputs (`parallel.parallelize.apply_ac`).
- **In-flight microbatches** on the busiest pipeline rank: GPipe all m; 1F1B and ZB-H1 min(m,
  p - r) on rank r (Narayanan et al. 2021, section 2.2); interleaved 1F1B with v chunks a
  further factor 1 + (p-1)/(p*v) (Korthikanti et al. section 4.2.3; Megatron's warm-up of
  2(p-1) + (v-1)p chunk-microbatches on rank 0); uneven stages price each rank by the layers it
  really holds (`myria.layout.rank_layers`).

Model state per parameter (mixed precision, Rajbhandari et al. 2020 "ZeRO"): 2-byte weights,
4-byte gradients (Megatron-LM accumulates and reduces gradients in an fp32 buffer), 12 bytes of
Adam/LAMB state (fp32 master weights, two moments). ZeRO-1 (Megatron's distributed optimizer)
shards the optimizer state over the data-parallel ranks, ZeRO-2 also the gradients, ZeRO-3
(FSDP) also the weights, which are then gathered one layer at a time (two layers in flight
with prefetch: FSDP2's default forward prefetch). FSDP2 with `reshard_after_forward=False`
(PyTorch FSDP2 docs, `fully_shard`: "parameters stay unsharded after forward", used by Llama 3,
Dubey et al. 2024 section 3.3.2) keeps every parameter of the stage gathered from its forward
to its backward: the weights' memory is whole. HSDP shards over `shard` ranks and replicates
across the rest (PyTorch FSDP2 docs, 2-D device mesh).

The caching allocator's fragmentation is a measured fraction of the dynamic memory: 4.6%,
the reserved-minus-allocated gap (2.7 GB) over the allocated memory (58.3 GB) that Huawei's
MindSpeed guide measures on a 61 GB device ("memory fragmentation optimisation"); the GPU
issue replaces it with the accelerator's own measured peaks. On a CPU torch has no caching
allocator (freed tensors return to the C allocator), and it is 0.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from functools import lru_cache

from myria.models.flops import param_counts
from myria.sim.operators import LayerShape

RESERVED_BYTES = 1.5e9    # CUDA context, cuBLAS workspaces, NCCL buffers (not calibrated)
FRAGMENTATION = 0.046     # caching allocator: reserved - allocated over allocated (MindSpeed)


def layer_activation_bytes(shape: LayerShape, recompute: str) -> float:
    """Bytes one layer keeps for its backward pass, per microbatch, on one device."""
    from myria.sim.operators import eager_supported

    if shape.eager and eager_supported(shape):
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


def eager_layer_activation_bytes(shape: LayerShape, recompute: str) -> float:
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


def backward_transient_bytes(shape: LayerShape) -> float:
    """Gradients in flight inside one layer's backward, at its largest (the MLP activation's
    backward): the residual stream's gradient and the gradients of the activation function's
    inputs (two for SwiGLU, gate and up; one for GELU). Checked against torch's memory
    profiler on myria's blocks (tests/sim/test_memory.py)."""
    e, tp = shape.act_bytes, shape.tp
    T = shape.micro_batch * shape.seq_len / shape.cp
    Tsp = T / tp if shape.sp else T
    n_in = 1 if shape.arch == "gpt" else 2
    return e * (Tsp * shape.hidden + n_in * T * shape.ffn / tp)


@lru_cache(maxsize=16384)
def _act(shape: LayerShape, recompute: str) -> float:
    return layer_activation_bytes(shape, recompute)


def head_activation_bytes(shape: LayerShape, first: bool, last: bool) -> float:
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
    peak, in units of its layers: rank r of 1F1B holds min(m, p - r)."""
    if p <= 1:
        return 1.0
    if schedule == "gpipe":
        return float(m)
    base = float(min(m, p - rank))
    if schedule in ("interleaved-1f1b", "zero-bubble") and v > 1:
        return base * (1 + (p - 1) / (p * v))
    return base


@dataclass
class MemoryResult:
    """Peak memory of the busiest device, in bytes, by kind."""

    weights: float
    gradients: float
    optimizer: float
    activations: float
    temporary: float
    reserved: float
    total: float
    capacity: float
    fits: bool
    stage: str                 # which pipeline stage is the peak: first | last | only
    params_per_device: float
    host_bytes_per_node: float = 0.0   # offloaded state per server (host memory or disk)
    host_fits: bool = True

    def gb(self) -> dict:
        """The sizes in GB (1e9 bytes): weights ... total, capacity, host_per_node."""
        d = asdict(self)
        out = {k: d[k] / 1e9 for k in ("weights", "gradients", "optimizer", "activations",
                                       "temporary", "reserved", "total", "capacity")}
        out["host_per_node"] = self.host_bytes_per_node / 1e9
        return out


@lru_cache(maxsize=4096)
def _params(shape: LayerShape):
    return param_counts(shape.model_config())


def stage_params(shape: LayerShape, layers_on_stage: float, first: bool, last: bool,
                 ep: int) -> tuple[float, float]:
    """(dense, expert) parameters held by one device of a stage."""
    pc = _params(shape)
    tp = shape.tp
    dense = layers_on_stage * pc.per_layer_dense / tp
    experts = layers_on_stage * pc.per_layer_experts / (tp * ep)
    if first:
        dense += pc.embedding / tp + pc.positional
    if last:
        dense += pc.final_norm + (pc.head / tp if pc.head else 0.0)
        if not pc.head and not first:
            dense += pc.embedding / tp  # tied output layer: the last stage keeps a copy
    return dense, experts


def memory(shape: LayerShape, *, layers: int, pp: int, vpp: int, microbatches: int,
           schedule: str, recompute: str, zero_stage: int, dp: int, ep: int, precision: str,
           offload: str, capacity: float, gpus_per_node: int,
           reserved: float = RESERVED_BYTES, reshard_after_forward: bool = True,
           shard: int = 0, offload_params: bool = False,
           stage_layers: dict | None = None,
           fragmentation: float = FRAGMENTATION) -> MemoryResult:
    """Peak memory over the pipeline stages of one device (the first and last stage differ).

    `reserved` is what the runtime holds outside the tensors (CUDA context, library
    workspaces, NCCL buffers on a GPU; 0 on a CPU, where none of these exist), and
    `fragmentation` the caching allocator's share of the dynamic memory (0 on a CPU).
    Offload: the optimizer state leaves the device (cpu or nvme); under cpu with ZeRO-3 also
    the sharded weights and gradients (FSDP2's CPUOffloadPolicy); under nvme with
    `offload_params` the weights, of which three layers stay (myria.train.offload_params).
    `stage_layers` gives uneven stages' layers per rank ({"first", "mid", "last"}: the
    busiest middle rank is priced as the second, which holds the most in-flight microbatches
    of the middle ranks); default layers / pp everywhere."""
    mixed = precision != "fp32"
    w_b = 2 if mixed else 4
    g_b = 4
    o_b = 12 if mixed else 8
    # ZeRO shards over the gradient-reduction ranks (dp x cp), or over an HSDP shard group
    shard = max(1, shard or dp)
    expert_shard = max(1, dp // ep)
    a_layer = _act(shape, recompute)
    results = []
    stages = [("only", True, True)] if pp == 1 else [("first", True, False),
                                                     ("last", False, True)]
    if stage_layers and pp > 2:
        stages.insert(1, ("mid", False, False))
    for name, first, last in stages:
        per_stage = (stage_layers or {}).get(name, layers / pp)
        dense, expert = stage_params(shape, per_stage, first, last, ep)
        w = dense * w_b + expert * w_b
        g = dense * g_b + expert * g_b
        o = dense * o_b + expert * o_b
        temp = 0.0
        if zero_stage >= 1:
            o = dense * o_b / shard + expert * o_b / expert_shard
        if zero_stage >= 2:
            g = dense * g_b / shard + expert * g_b / expert_shard
            # one layer's full gradient is produced before it is reduced and scattered
            temp += (dense + expert) / per_stage * g_b
        if zero_stage >= 3 and reshard_after_forward:
            w = dense * w_b / shard + expert * w_b / expert_shard
            temp += 2 * (dense + expert) / per_stage * w_b   # gathered layers (prefetch)
        elif zero_stage >= 3:
            # parameters stay gathered from the first forward to the end of the step: the
            # weights' memory is whole, only gradients and optimizer state are sharded
            temp += 0.0
        host = 0.0
        if offload != "none":
            host = o * gpus_per_node
            o = 0.0
            if offload == "cpu" and zero_stage >= 3:
                host += (w + g) * gpus_per_node
                w = g = 0.0
            if offload_params:
                host += w * gpus_per_node
                w = 3 * (dense + expert) / per_stage * w_b
        # rank r of 1F1B holds min(m, p - r): the first rank p, the last one microbatch
        in_flight = in_flight_microbatches(schedule, pp, vpp, microbatches,
                                           {"mid": 1, "last": pp - 1}.get(name, 0))
        if pp == 1:
            in_flight = 1.0
        act = per_stage * in_flight * a_layer
        # the peak is the larger of the loss's forward (every layer's activations and the
        # output layer's buffers) and a layer's backward (its recomputed activations, when it
        # recomputes, and the gradients of its outputs in flight)
        # (the last rank keeps the loss's buffers for each microbatch in flight: one under
        # 1F1B, all m under GPipe)
        head = head_activation_bytes(shape, first, last) * in_flight
        regrown = _act(shape, "none") - a_layer if recompute != "none" and per_stage else 0.0
        temp += max(head, regrown + backward_transient_bytes(shape))
        dynamic = w + g + o + act + temp
        total = dynamic * (1 + fragmentation) + reserved
        results.append(MemoryResult(w, g, o, act, temp + dynamic * fragmentation,
                                    reserved, total, capacity, total <= capacity, name,
                                    dense + expert, host))
    return max(results, key=lambda r: r.total)


def decode_state_bytes(cfg, batch: int, context: int, elem_bytes: int = 2, tp: int = 1) -> float:
    """Bytes of what generation keeps per device after `context` tokens (`cfg`: ModelConfig).

    Softmax attention: keys and values of every position its window (and global tokens) can
    still reach (grows with the context up to the window); linear attention and retention: a
    head_dim x head_dim state per head (plus linear attention's normaliser); Griffin's
    recurrent block: its RG-LRU state and the last 3 convolution inputs (constant).
    Matches `myria.generate.KVCache.nbytes` (tested); heads and channels split over tp.
    """
    from myria.models.flops import layer_kind

    hd, h = cfg.head_dim, cfg.heads
    total = 0.0
    for i in range(cfg.layers):
        kind = layer_kind(cfg, i)
        if kind == "recurrent":
            per_seq = 4 * cfg.hidden                       # h (W) + 3 conv inputs (W each)
        elif kind == "retention":
            per_seq = h * hd * hd
        elif cfg.attention == "linear":
            per_seq = h * hd * hd + h * hd
        else:
            kept = context
            if cfg.attention_window:
                kept = min(context, cfg.attention_window - 1 + cfg.global_tokens)
            per_seq = 2 * cfg.n_kv_heads * hd * kept
        total += batch * per_seq * elem_bytes
    return total / tp
