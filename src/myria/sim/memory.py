"""Memory per device: weights, gradients, optimizer state under ZeRO 0-3, activations, buffers.

Activations are enumerated tensor by tensor, as Korthikanti et al. 2022 ("Reducing Activation
Recomputation in Large Transformer Models", section 4) count them: for the GPT layer with
dropout, 16-bit activations and no parallelism this gives s*b*h*(34 + 5*a*s/h) bytes per layer,
with tensor parallelism s*b*h*(10 + 24/t + 5*a*s/(h*t)), with sequence parallelism everything
/t; selective recomputation drops the 5*a*s/h term (the attention core), full recomputation keeps
only each layer's input. FlashAttention never stores the score matrix (only a log-sum-exp per
query and head). In-flight microbatches on the first pipeline stage: GPipe all m; 1F1B and
zero-bubble ZB-H1/ZB-V min(m, p); interleaved 1F1B a further factor 1 + (p-1)/(p*v)
(Korthikanti et al. section 4.2.3).

Model state per parameter (mixed precision, Rajbhandari et al. 2020 "ZeRO"): 2-byte weights,
4-byte gradients (Megatron-LM accumulates and reduces gradients in an fp32 buffer), 12 bytes of
Adam/LAMB state (fp32 master weights, two moments). ZeRO-1 shards the optimizer state over the
data-parallel ranks, ZeRO-2 also the gradients, ZeRO-3 (FSDP) also the weights, which are then
gathered one layer at a time (two layers in flight with prefetch).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from functools import lru_cache

from myria.models.flops import param_counts
from myria.models.memory import (  # the formulas the trainer's budget uses too
    head_activation_bytes,
    in_flight_microbatches,
    layer_activation_bytes,
)
from myria.models.memory import stage_params as model_stage_params
from myria.sim.operators import LayerShape

RESERVED_BYTES = 1.5e9    # CUDA context, cuBLAS workspaces, NCCL buffers (not calibrated)
FRAGMENTATION = 0.05      # allocator fragmentation, as a share of the dynamic memory


@lru_cache(maxsize=16384)
def _act(shape: LayerShape, recompute: str) -> float:
    return layer_activation_bytes(shape, recompute)


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
    """(dense, expert) parameters held by one device of a stage (myria.models.memory)."""
    return model_stage_params(_params(shape), shape.tp, layers_on_stage, first, last, ep)


def memory(shape: LayerShape, *, layers: int, pp: int, vpp: int, microbatches: int,
           schedule: str, recompute: str, zero_stage: int, dp: int, ep: int, precision: str,
           offload: str, capacity: float, gpus_per_node: int,
           reserved: float = RESERVED_BYTES, reshard_after_forward: bool = True,
           shard: int = 0, offload_params: bool = False,
           stage_layers: dict | None = None) -> MemoryResult:
    """Peak memory over the pipeline stages of one device (the first and last stage differ).

    `reserved` is what the runtime holds outside the tensors (CUDA context, library
    workspaces, NCCL buffers on a GPU; 0 on a CPU, where none of these exist).
    Offload: the optimizer state leaves the device (cpu or nvme); under cpu with ZeRO-3 also
    the sharded weights and gradients (FSDP2's CPUOffloadPolicy); under nvme with
    `offload_params` the weights, of which three layers stay (myria.offload.params).
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
        in_flight = in_flight_microbatches(schedule, pp, vpp, microbatches,
                                           1 if name == "mid" else 0)
        if pp == 1:
            in_flight = 1.0
        act = per_stage * in_flight * a_layer
        act += head_activation_bytes(shape, first, last) * (1 if last else in_flight)
        if recompute == "full":
            # the one layer being recomputed holds its full activations during its backward
            temp += _act(shape, "none")
        dynamic = w + g + o + act + temp
        total = dynamic * (1 + FRAGMENTATION) + reserved
        results.append(MemoryResult(w, g, o, act, temp + dynamic * FRAGMENTATION,
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
