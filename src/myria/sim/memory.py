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
  further factor 1 + (p-1)/(p*v) on rank 0 (Korthikanti et al. section 4.2.3; Megatron's warm-up
  of 2(p-r-1) + (v-1)p chunk-microbatches on rank r, plus one), never more than all m (with m = p
  Megatron runs every forward before the first backward); the output layer's buffers are held
  for one microbatch (its chunk runs forward and backward back to back), all m under GPipe;
  uneven stages price each rank by the layers it really holds (`myria.layout.rank_layers`).

Model state per parameter (mixed precision, Rajbhandari et al. 2020 "ZeRO"): 2-byte weights,
4-byte gradients (Megatron-LM accumulates and reduces gradients in an fp32 buffer), 12 bytes of
Adam/LAMB state (fp32 master weights, two moments). ZeRO-1 (Megatron's distributed optimizer)
shards the optimizer state over the data-parallel ranks, ZeRO-2 also the gradients, ZeRO-3
(FSDP) also the weights, which are then gathered one layer at a time (two layers in flight
with prefetch: FSDP2's default forward prefetch). Under mixed precision FSDP2's sharded
parameters are the fp32 master weights themselves (its `MixedPrecisionPolicy` casts to bf16
when it gathers), so no 2-byte copy persists: 16 bytes per parameter, over the shard ranks.
FSDP2 with `reshard_after_forward=False` (PyTorch FSDP2 docs, `fully_shard`: "parameters stay
unsharded after forward", used by Llama 3, Dubey et al. 2024 section 3.3.2) keeps every
parameter of the stage gathered from its forward to its backward: the weights' memory is whole.
HSDP shards over `shard` ranks and replicates across the rest (PyTorch FSDP2 docs, 2-D device
mesh).

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
from myria.models.memory import (  # the formulas the trainer's budget uses too
    backward_transient_bytes,
    head_activation_bytes,
    in_flight_microbatches,
    layer_activation_bytes,
)
from myria.models.memory import stage_params as model_stage_params
from myria.sim.operators import LayerShape

RESERVED_BYTES = 1.5e9    # CUDA context, cuBLAS workspaces, NCCL buffers (not calibrated)
FRAGMENTATION = 0.046     # caching allocator: reserved - allocated over allocated (MindSpeed)


@lru_cache(maxsize=16384)
def layer_act(shape: LayerShape, recompute: str) -> float:
    return layer_activation_bytes(shape, recompute)


@lru_cache(maxsize=16384)
def _shape_bytes(shape: LayerShape, recompute: str) -> tuple:
    """What `memory` reads of a layer shape under a recomputation policy: (a layer's kept
    activations, what its backward regrows by recomputing, its backward's transient gradients,
    the embedding's and the output layer's activations)."""
    a_layer = layer_act(shape, recompute)
    regrown = layer_act(shape, "none") - a_layer if recompute != "none" else 0.0
    return (a_layer, regrown, backward_transient_bytes(shape),
            (head_activation_bytes(shape, False, False), head_activation_bytes(shape, True, False)),
            head_activation_bytes(shape, False, True))


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
def layer_params(shape: LayerShape):
    return param_counts(shape.model_config())


def clear_caches() -> None:
    """Empty this module's caches (a cold start, for timing)."""
    for fn in (layer_params, layer_act, stage_params, _shape_bytes):
        fn.cache_clear()


@lru_cache(maxsize=65536)
def stage_params(shape: LayerShape, layers_on_stage: float, first: bool, last: bool,
                 ep: int) -> tuple[float, float]:
    """(dense, expert) parameters held by one device of a stage (myria.models.memory)."""
    return model_stage_params(layer_params(shape), shape.tp, layers_on_stage, first, last, ep)


def memory(shape: LayerShape, *, layers: int, pp: int, vpp: int, microbatches: int,
           schedule: str, recompute: str, zero_stage: int, dp: int, ep: int, precision: str,
           offload: str, capacity: float, gpus_per_node: int,
           reserved: float = RESERVED_BYTES, reshard_after_forward: bool = True,
           shard: int = 0, offload_params: bool = False,
           stage_layers: dict | None = None,
           fragmentation: float = FRAGMENTATION, accumulate: bool = False) -> MemoryResult:
    """Peak memory over the pipeline stages of one device (the first and last stage differ).

    `reserved` is what the runtime holds outside the tensors (CUDA context, library
    workspaces, NCCL buffers on a GPU; 0 on a CPU, where none of these exist), and
    `fragmentation` the caching allocator's share of the dynamic memory (0 on a CPU).
    Offload: the optimizer state leaves the device (cpu or nvme); under cpu with ZeRO-3 also
    the sharded weights and gradients (FSDP2's CPUOffloadPolicy); under nvme with
    `offload_params` the weights, of which three layers stay (myria.offload.params).
    `stage_layers` gives uneven stages' layers per rank ({"first", "mid", "last"}: the
    busiest middle rank is priced as the second, which holds the most in-flight microbatches
    of the middle ranks); default layers / pp everywhere. `accumulate`: sharded gradients
    (ZeRO-2, FSDP) accumulate whole over the microbatches and are reduce-scattered after each
    stage's last backward (a pipeline run by torch.distributed.pipelining, as Llama 3 did): a
    chunk's gradients live from its first backward to its last, so at the activations' peak
    one chunk's when every forward runs first (interleaved, m <= p), else the whole stage's."""
    mixed = precision != "fp32"
    w_b = 2 if mixed else 4
    g_b = 4
    o_b = 12 if mixed else 8
    # ZeRO shards over the gradient-reduction ranks (dp x cp), or over an HSDP shard group
    shard = max(1, shard or dp)
    expert_shard = max(1, dp // ep)
    a_layer, regrown_layer, transient, head_first, head_last = _shape_bytes(shape, recompute)
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
        temp = acc = 0.0   # acc: the whole gradients accumulating beyond the shard
        if zero_stage >= 1:
            o = dense * o_b / shard + expert * o_b / expert_shard
        if zero_stage >= 2:
            g = dense * g_b / shard + expert * g_b / expert_shard
            if accumulate:
                # the whole gradients accumulate; each unit's shard is written as it is
                # reduced, in the place of its whole gradient: the peak is the larger of the two
                whole = (dense + expert) * g_b * (1 / vpp if vpp > 1 and microbatches <= pp
                                                  else 1.0)
                acc = max(0.0, whole - g)
            else:
                # one layer's full gradient is produced before it is reduced and scattered
                temp += (dense + expert) / per_stage * g_b
        if zero_stage >= 3 and reshard_after_forward:
            # FSDP2 (offload none or cpu) keeps the sharded parameters in fp32 (the master
            # copy, counted in the optimizer's 12 bytes) and casts to bf16 as it gathers a
            # layer: under mixed precision no 2-byte copy persists, only the gathered layers
            # in flight (the nvme tier is myria's own, not FSDP2: its rule is unchanged)
            fsdp2_mixed = mixed and offload != "nvme"
            w = 0.0 if fsdp2_mixed else dense * w_b / shard + expert * w_b / expert_shard
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
        # the output layer sits in the last chunk, which holds one microbatch between its
        # forward and backward (all m under GPipe), whatever the rank's other chunks hold
        head = head_first[first] * in_flight
        if last:
            head += head_last * (in_flight if pp == 1 or schedule == "gpipe" else 1.0)
        regrown = regrown_layer if per_stage else 0.0
        temp += max(head, regrown + transient)
        g += acc   # on the device whatever is offloaded: counted with the gradients
        dynamic = w + g + o + act + temp
        total = dynamic * (1 + fragmentation) + reserved
        results.append((total, w, g, o, act, temp + dynamic * fragmentation, name,
                        dense + expert, host))
    # the first of the largest, built once
    total, w, g, o, act, temp, name, params, host = max(results, key=lambda r: r[0])
    return MemoryResult(w, g, o, act, temp, reserved, total, capacity, total <= capacity, name,
                        params, host)


def ssm_state_elements(cfg, kind: str) -> int:
    """Elements of one sequence's generation state in a Gated DeltaNet ("deltanet") or
    Mamba-2 ("mamba2") layer: the recurrent state and the last 3 inputs of each short
    convolution (`models.deltanet`, `models.mamba2`)."""
    if kind == "deltanet":
        width = cfg.heads * cfg.head_dim
        return cfg.heads * cfg.head_dim ** 2 + 3 * 3 * width
    inner = cfg.ssm_expand * cfg.hidden
    return cfg.ssm_state * inner + 3 * (inner + 2 * cfg.n_kv_heads * cfg.ssm_state)


def decode_state_bytes(cfg, batch: int, context: int, elem_bytes: int = 2, tp: int = 1) -> float:
    """Bytes of what generation keeps per device after `context` tokens (`cfg`: ModelConfig).

    Softmax attention: keys and values of every position its window (and global tokens) can
    still reach (grows with the context up to the window); linear attention and retention: a
    head_dim x head_dim state per head (plus linear attention's normaliser); Griffin's
    recurrent block: its RG-LRU state and the last 3 convolution inputs (constant); Gated
    DeltaNet and Mamba-2: `ssm_state_elements` (constant).
    Matches `myria.models.decode.KVCache.nbytes` (tested); heads and channels split over tp.
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
        elif kind in ("deltanet", "mamba2"):
            per_seq = ssm_state_elements(cfg, kind)
        elif cfg.attention == "linear":
            per_seq = h * hd * hd + h * hd
        else:
            kept = context
            if cfg.attention_window:
                kept = min(context, cfg.attention_window - 1 + cfg.global_tokens)
            per_seq = 2 * cfg.n_kv_heads * hd * kept
        total += batch * per_seq * elem_bytes
    return total / tp
