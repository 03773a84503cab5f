"""The fast-memory budget of the offload tiers (`parallel.fast_memory_gb`).

`plan_memory` splits a rank's budget into what stays in memory (parameters, or a few units of
them with `offload_params`; gradients; activations) and the nvme tier's I/O buffers, or says in
one line that it cannot hold even one layer. `plan_for_config` estimates the same before any
tensor exists (the CLI's check before launch, the dry run), from the per-layer formulas the
planner uses too (myria.models.memory).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from myria.errors import ConfigError
from myria.layout import Layout
from myria.models.flops import param_counts
from myria.models.memory import (
    head_activation_bytes,
    in_flight_microbatches,
    layer_activation_bytes,
    layer_dims,
    stage_params,
)
from myria.offload.diskio import ALIGN, round_up

CHUNK_BYTES = 64 << 20       # bytes per section per buffer when the budget allows (I/O saturates)
MIN_BUFFERS = 3              # one being read, one being updated, one being written
MIN_CHUNK = 8 << 20          # bytes per section per buffer at least (or one layer if smaller)
PARAM_SLABS = 3              # offload_params: units in memory at once (myria.offload.params)
MAX_BUFFERS = 64
DEFAULT_BUFFERS = 4          # without a budget (fast_memory_gb = 0)


@dataclass
class MemoryPlan:
    """What one rank keeps in the fast tier under `parallel.offload`, in bytes."""

    tier: str
    budget: float                  # fast_memory_gb in bytes (0: none)
    params: float                  # parameters kept resident (a layer at a time if offloaded)
    grads: float
    optimizer: float               # optimizer state kept resident (0 under nvme)
    activations: float             # activation_bytes (myria.models.memory)
    buffers: int = 0               # nvme: I/O buffers ...
    buffer_bytes: float = 0.0      # ... of this size each (all sections of one chunk)
    offloaded: float = 0.0         # bytes in the offload files per rank
    layer_state: float = 0.0       # one layer's offloaded state (all sections)
    sections: int = 2              # nvme: state tensors per parameter in the files
    gathered: float = 0.0          # FSDP2's unsharded copies at the peak (`gathered_bytes`)

    @property
    def resident(self) -> float:
        return self.params + self.gathered + self.grads + self.optimizer + \
            self.activations + self.buffers * self.buffer_bytes

    @property
    def chunk_bytes(self) -> int:
        """Bytes per section of one buffer."""
        return int(self.buffer_bytes // max(1, self.sections)) if self.buffers else 0

    def describe(self) -> str:
        gb = lambda x: f"{x / 1e9:.3g}"  # noqa: E731
        s = (f"offload {self.tier}: fast tier per rank: parameters {gb(self.params)} + "
             + (f"gathered parameters {gb(self.gathered)} + " if self.gathered else "")
             + f"gradients {gb(self.grads)} + optimizer {gb(self.optimizer)} + activations "
             f"{gb(self.activations)}")
        if self.tier == "nvme":
            s += (f" + {self.buffers} I/O buffers of {self.buffer_bytes / 2**20:.1f} MiB"
                  f" = {gb(self.resident)} GB; on disk {gb(2 * self.offloaded)} GB per rank "
                  f"(two generations of {gb(self.offloaded)} GB, and one per kept checkpoint)")
        else:
            s += f" = {gb(self.resident)} GB"
        if self.budget:
            s += f" (budget {gb(self.budget)} GB)"
        return s


def plan_memory(cfg, params_local: int, layer_params_local: int, itemsize: int,
                activations: float, unit_params_local: int = 0,
                gathered: float = 0.0) -> MemoryPlan:
    """The fast-tier plan of one rank, or a ConfigError (one line) when the budget
    `parallel.fast_memory_gb` cannot hold even one layer's worth of it.

    `params_local`: parameters this rank holds (its shards); `layer_params_local`: of them,
    the largest transformer block's; `unit_params_local`: the largest unit offload_params
    loads at once (a block, the embeddings or the head); `gathered`: bytes of FSDP2's
    unsharded parameter copies at the peak (`gathered_bytes`). Under nvme the buffers take what the
    budget leaves, at least MIN_BUFFERS chunks of MIN_CHUNK (or a layer, if smaller) per
    section, at most enough for the whole state (with room for the next step's prefetch) and
    CHUNK_BYTES per section each."""
    par = cfg.parallel
    tier = par.offload
    budget = par.fast_memory_gb * 1e9
    p_bytes = params_local * itemsize
    if tier != "nvme":
        plan = MemoryPlan(tier, budget, p_bytes, p_bytes, 2 * p_bytes if tier == "none" else 0,
                          activations, gathered=gathered)
        if tier == "none" and budget and plan.resident > budget:
            raise ConfigError(
                f"parallel.fast_memory_gb = {par.fast_memory_gb:g} is too small for this run in "
                f"memory: it needs {plan.resident / 1e9:.3g} GB per rank (parameters, gradients"
                f", optimizer state, activations); set parallel.offload = 'nvme' to keep the "
                "optimizer state on disk")
        return plan
    sections = 3 if par.offload_params else 2
    layer_state = layer_params_local * itemsize * sections
    # with offloaded parameters the fast tier holds a few units (offload_params.py)
    unit = round_up(max(unit_params_local, layer_params_local) * itemsize)
    resident_params = PARAM_SLABS * unit if par.offload_params else p_bytes
    plan = MemoryPlan(tier, budget, resident_params, p_bytes, 0.0, activations,
                      offloaded=p_bytes * sections, layer_state=layer_state, sections=sections,
                      gathered=gathered)
    chunk_min = round_up(max(1, min(layer_params_local * itemsize, MIN_CHUNK)))
    if budget:
        room = budget - plan.resident
        need = MIN_BUFFERS * chunk_min * sections
        if room < need:
            least = (plan.resident + need) / 1e9
            raise ConfigError(
                f"parallel.fast_memory_gb = {par.fast_memory_gb:g} is too small for even one "
                f"layer: this rank needs at least {least:.3g} GB (parameters "
                f"{plan.params / 1e9:.3g}, "
                + (f"gathered parameters {gathered / 1e9:.3g}, " if gathered else "")
                + f"gradients {plan.grads / 1e9:.3g}, activations "
                f"{activations / 1e9:.3g}, and {MIN_BUFFERS} I/O buffers of "
                f"{chunk_min * sections / 1e9:.3g})"
                + ("" if par.offload_params else "; parallel.offload_params = true also moves "
                   "the parameters to disk"))
        # several chunks even when the whole state would fit: the pipeline needs them
        chunk = min(CHUNK_BYTES, int(room // (MIN_BUFFERS * sections)),
                    round_up(max(1, p_bytes // 4)))
        chunk = max(chunk_min, chunk // ALIGN * ALIGN)
        n = int(room // (chunk * sections))
    else:
        chunk = max(chunk_min, min(CHUNK_BYTES, round_up(max(1, p_bytes // 8))))
        n = DEFAULT_BUFFERS
    whole = -(-p_bytes // chunk) + 2  # every chunk prefetched, plus one being written
    plan.buffers = max(MIN_BUFFERS, min(n, whole, MAX_BUFFERS))
    plan.buffer_bytes = chunk * sections
    return plan


def plan_for_config(cfg, layout: Layout, device_type: str | None = None) -> MemoryPlan:
    """`plan_memory` estimated from the config before any tensor exists (the CLI's check
    before launching, the dry-run): the parameters of the busier pipeline stage
    (myria.models.memory.stage_params), sharded over the data-parallel ranks under FSDP.
    `device_type`: the device the run trains on (None: training.device, "auto" read as cpu)."""
    m, t = cfg.model, cfg.training
    tp, pp, ep = layout["tp"], layout["pp"], layout["ep"]
    if device_type is None:
        device_type = t.device if t.device != "auto" else "cpu"
    fsdp = layout.shards_with_fsdp(cfg, device_type)
    shard = layout["dp"] * layout["cp"] if fsdp else 1
    pc = param_counts(m)
    stages = [(True, True)] if pp == 1 else [(True, False), (False, True)]
    dense, expert = max((stage_params(pc, tp, m.layers / pp, f, la, ep) for f, la in stages),
                        key=sum)
    ldense, lexpert = stage_params(pc, tp, 1, False, False, ep)
    eshard = max(1, shard // ep)
    total = math.ceil(dense / shard + expert / eshard)
    layer = math.ceil(ldense / shard + lexpert / eshard)
    unit = max(layer, math.ceil(max(pc.embedding + pc.positional, pc.final_norm + pc.head)
                                / tp / shard))
    # the root module's (embeddings, head) stays gathered after its forward unless pipelined
    root = (pc.embedding + pc.positional + pc.final_norm + pc.head) / tp if pp == 1 else 0
    gathered = gathered_bytes(cfg, layout, device_type, dense + expert, ldense + lexpert,
                              root) if fsdp else 0.0
    return plan_memory(cfg, total, layer, 4, activation_bytes(cfg, layout, device_type), unit,
                       gathered)


def gathered_bytes(cfg, layout: Layout, device_type: str, stage: float, layer: float,
                   root: float) -> float:
    """Bytes of the unsharded parameters FSDP2 holds at a rank's peak beside its fp32 shards;
    `stage`, `layer`, `root`: a pipeline stage's, a block's and the root module's parameters
    on this rank before the data-parallel sharding (`root` 0 where it is resharded after its
    forward, as under pipelining). Under ZeRO-2 (`reshard_after_forward=False`) every block
    stays gathered from its forward to its backward: the whole stage at the end of the
    forward. Under FSDP the root, the block computing and the `fsdp_prefetch` blocks gathered
    ahead of it (at least one, FSDP2's own prefetch). In bf16 under the mixed-precision
    policy; in fp32 without it, on more than one rank."""
    mixed = layout.computes_in_bf16(cfg, device_type)
    if not mixed and layout["dp"] * layout["cp"] == 1:
        return 0.0
    per = 2 if mixed else 4
    if cfg.training.data_parallel == "zero2":
        return stage * per
    return (root + layer * (1 + max(1, cfg.parallel.fsdp_prefetch))) * per


def activation_bytes(cfg, layout: Layout, device_type: str) -> float:
    """Activation memory per rank as the planner models it (myria.models.memory), for
    myria's eager modules in the precision the run computes in on `device_type`."""
    m, t, p = cfg.model, cfg.training, cfg.parallel
    tp, cp, pp = layout.tp, layout.cp, layout.pp
    # 16-bit only where the engine applies FSDP2 with a mixed-precision policy (the policy
    # resolves training.dtype = auto: bf16 on CUDA); elsewhere the model runs in fp32
    bf16 = layout.computes_in_bf16(cfg, device_type)
    shape = layer_dims(m, t.micro_batch, tp=tp, cp=cp, sp=p.sequence_parallel, flash=True,
                       act_bytes=2 if bf16 else 4)
    micro = layout.microbatches(t.global_batch, t.micro_batch)
    flight = in_flight_microbatches(p.schedule, pp, p.vpp, micro) if pp > 1 else 1.0
    act = m.layers / pp * flight * layer_activation_bytes(shape, p.activation_checkpoint)
    if p.activation_checkpoint == "full":  # the layer being recomputed, whole
        act += layer_activation_bytes(shape, "none")
    return act + head_activation_bytes(shape, True, True) * flight


def check_budget(cfg, layout, device_type: str = "cpu") -> None:
    """A fast-memory budget too small for the run, as a one-line ConfigError before training
    starts (what each tier supports is part of the layout's rules: `Layout.check`)."""
    par = cfg.parallel
    if par.offload == "none" and not par.fast_memory_gb:
        return
    plan_for_config(cfg, layout, device_type)
