"""Apply parallelism to a plain model part in the order that works: TP/SP, CP, AC, compile, FSDP.

The model knows nothing of this. Each function takes a model (or pipeline stage) and a mesh:

- tensor + sequence parallel with DTensor `parallelize_module` (Megatron-LM's column/row split of
  attention and MLP; norms sequence-sharded; vocabulary-sharded embedding and head);
- context parallel: every `CoreAttention` becomes our ring attention, and the model is told the
  absolute positions of the tokens this rank holds;
- activation checkpointing, full or selective (matmul outputs kept);
- per-block `torch.compile`;
- FSDP2 over the data-parallel (and context-parallel) ranks, HSDP on a 2-D mesh, CPU offload.
  Its overlap is on by default: the next block's all-gather is issued while the current one
  computes (`fsdp_prefetch` deepens it) and reduce-scatters run asynchronously in backward.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import (
    DTensor,
    Replicate,
    Shard,
    distribute_module,
    distribute_tensor,
)
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.distributed.tensor.parallel.style import ParallelStyle

from myria.config import Config
from myria.errors import ConfigError
from myria.parallel.dims import ParallelDims
from myria.tensors import local_shard


def parallelize(part: nn.Module, dims: ParallelDims, cfg: Config, device: torch.device,
                fsdp: bool = True) -> None:
    """Apply this rank's parallelism to one model part (the model, or a pipeline stage), in
    the order that works: float8 -> tensor/sequence -> context -> expert -> activation
    checkpointing -> compile -> FSDP (`fsdp=False`: no sharding, e.g. when the engine
    all-reduces gradients itself or wraps the model in DDP)."""
    p = cfg.parallel
    apply_float8(part, cfg, device, dims.tp)  # training.float8 (torchao), else nothing
    if dims.tp > 1:
        apply_tp(part, dims.sub("tp"), p.sequence_parallel, p.loss_parallel)
    if dims.cp > 1:
        apply_cp(part, dims.sub("cp").get_group(), dims.cp_rank, dims.cp, cfg.model.seq_len,
                 device, ring=p.cp_impl != "torch")
    if dims.ep > 1:
        from myria.parallel.expert import apply_expert_parallel
        apply_expert_parallel(part, dims.ep_mesh)
    apply_ac(part, p.activation_checkpoint)
    if p.compile:
        apply_compile(part)
    if fsdp and dims.fsdp_mesh is not None:
        apply_fsdp(part, dims.fsdp_mesh, cfg, device.type, reshard_root=dims.pp > 1,
                   expert_mesh=dims.replica_mesh)


def mixed_precision(cfg: Config, device_type: str) -> MixedPrecisionPolicy | None:
    """FSDP2's policy for the dtype training.dtype asks for (`layout.wants_bf16`): bf16
    parameters and compute with fp32 gradient reduction; None for fp32. Applied only where
    FSDP2 shards (`Layout.computes_in_bf16`)."""
    from myria.layout import wants_bf16

    if not wants_bf16(cfg, device_type):
        return None
    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


# -- tensor + sequence parallel ------------------------------------------------------------------
def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool = True,
             loss_parallel: bool = True) -> None:
    """Shard attention heads, MLP columns, vocabulary; norms along the sequence when SP is on.

    Without SP the residual stream is replicated over the tp ranks; with SP it is sharded along
    the sequence (dim 1) between blocks, and gathered right before each attention/MLP. The
    head's output stays a vocabulary-sharded DTensor when `loss_parallel` is on (the trainer
    computes the cross-entropy under torch's `loss_parallel`). A tied head keeps the
    embedding's tensor.
    """
    seq = Shard(1) if sequence_parallel else Replicate()
    emb, out = getattr(model, "tok_embeddings", None), getattr(model, "output", None)
    tied = emb is not None and out is not None and out.weight is emb.weight
    root_plan = {}
    if getattr(model, "tok_embeddings", None) is not None:
        root_plan["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(),
                                                      output_layouts=seq)
        if getattr(model, "pos_embeddings", None) is not None:
            # (S, H) output: sequence-sharded on dim 0 to add to the sharded token embeddings
            root_plan["pos_embeddings"] = RowwiseParallel(
                input_layouts=Replicate(),
                output_layouts=Shard(0) if sequence_parallel else Replicate())
    if getattr(model, "norm", None) is not None:
        root_plan["norm"] = SequenceParallel() if sequence_parallel else ReplicateParallel()
        root_plan["output"] = ColwiseParallel(
            input_layouts=seq, output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel)
    if root_plan:
        parallelize_module(model, tp_mesh, root_plan)
    if tied:
        # Tied embeddings stay one tensor: the embedding (row-wise) and the head (column-wise)
        # both shard the (vocab, hidden) weight on the vocabulary, so the head takes the
        # embedding's DTensor as it is and both gradients accumulate into it.
        assert emb.weight.placements == out.weight.placements == (Shard(0),)
        out.weight = emb.weight
    for block in model.layers.values():
        plan = {
            "attention_norm": SequenceParallel() if sequence_parallel else ReplicateParallel(),
            "attention": PrepareModuleInput(input_layouts=(seq, None),
                                            desired_input_layouts=(Replicate(), None)),
            **_mixer_plan(block.attention, tp_mesh),
            "attention.wo": RowwiseParallel(output_layouts=seq),
            "feed_forward": PrepareModuleInput(input_layouts=(seq,),
                                               desired_input_layouts=(Replicate(),)),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=seq),
        }
        if getattr(block.feed_forward, "w3", None) is not None:
            plan["feed_forward.w3"] = ColwiseParallel()
        if block.ffn_norm is not None:
            plan["ffn_norm"] = SequenceParallel() if sequence_parallel else ReplicateParallel()
        parallelize_module(block, tp_mesh, plan)


def _mixer_plan(mixer: nn.Module, tp_mesh: DeviceMesh) -> dict:
    """Column-parallel input projections of a block's temporal mixer, heads split over tp.

    Attention: q, k, v. Retention: q, k, v and the swish gate; each rank keeps the decays of
    its own heads (`head_offset`). Griffin's recurrent block: both branches column-parallel,
    and its per-channel parameters (convolution, block-diagonal gates by head, decay) sharded
    along their first dimension, so the recurrence runs on local channels with no
    communication; the row-parallel output projection reduces. Gated DeltaNet and Mamba-2
    likewise: every input projection column-parallel (Mamba-2's B and C by group, its groups
    being the key/value heads), the per-channel and per-head parameters (short convolutions,
    A_log, dt_bias, D, the norm's weight) sharded along dim 0.
    """
    from myria.models.deltanet import GatedDeltaNet
    from myria.models.griffin import RecurrentBlock
    from myria.models.mamba2 import Mamba2
    from myria.models.retention import Retention

    if isinstance(mixer, (GatedDeltaNet, Mamba2)):
        _shard_dim0(mixer, tp_mesh, [n for n, _ in mixer.named_parameters(recurse=False)])
        return {f"attention.{n}": ColwiseParallel() for n, m in mixer.named_children()
                if isinstance(m, nn.Linear) and n != "wo"}

    if isinstance(mixer, RecurrentBlock):
        _shard_dim0(mixer, tp_mesh, ("conv_weight", "conv_bias"))
        _shard_dim0(mixer.rglru, tp_mesh, [n for n, _ in mixer.rglru.named_parameters()])
        return {"attention.wx": ColwiseParallel(), "attention.wy": ColwiseParallel()}
    plan = {"attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel()}
    if isinstance(mixer, Retention):
        mixer.head_offset = tp_mesh.get_local_rank() * (mixer.n_heads // tp_mesh.size())
        plan["attention.wg"] = ColwiseParallel()
    return plan


def _shard_dim0(module: nn.Module, mesh: DeviceMesh, names) -> None:
    """Make `module`'s own parameters `names` DTensors sharded along dim 0 over `mesh`."""
    for name in names:
        p = getattr(module, name)
        module.register_parameter(name, nn.Parameter(distribute_tensor(p, mesh, [Shard(0)]),
                                                     requires_grad=p.requires_grad))


class ReplicateParallel(ParallelStyle):
    """Parameters replicated as DTensors over the tp mesh; activations stay plain tensors.

    For norms when sequence parallelism is off: their parameters must still be DTensors, or
    the foreach optimizer sees a mix of tensors and DTensors (torch 2.13).
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def inputs(mod, args, mesh):
            return tuple(DTensor.from_local(a, mesh, [Replicate()], run_check=False)
                         if isinstance(a, torch.Tensor) and not isinstance(a, DTensor) else a
                         for a in args)

        def outputs(mod, out, mesh):
            return local_shard(out)

        return distribute_module(module, device_mesh, None, input_fn=inputs, output_fn=outputs)


# -- context parallel ----------------------------------------------------------------------------
def apply_cp(model: nn.Module, cp_group, cp_rank: int, cp_size: int, seq_len: int,
             device: torch.device, ring: bool = True) -> None:
    """Ring attention in every block (unless torch's own CP replaces SDPA at run time), and
    this rank's absolute token positions (head + tail chunk, the layout both use)."""
    from myria.parallel.context import positions_for_rank, swap_core_attention

    if ring:
        swap_core_attention(model, cp_group, load_balance=True)
    model.positions = positions_for_rank(seq_len, cp_rank, cp_size, device=device)


# -- float8 linear layers -------------------------------------------------------------------------
def check_float8(cfg: Config, device: torch.device, tp: int = 1) -> None:
    """`training.float8` where it can run (CUDA, compute capability >= 8.9, torchao, no tensor
    parallelism), else one ConfigError saying what is missing."""
    if not cfg.training.float8:
        return
    if device.type != "cuda":
        raise ConfigError(f"training.float8 = true needs a CUDA GPU with float8 matrix units "
                          f"(H100, H200, L40S...); this run is on {device.type}: set "
                          "training.float8 = false")
    cap = torch.cuda.get_device_capability(device)
    if cap < (8, 9):
        raise ConfigError(f"training.float8 = true needs compute capability >= 8.9 (float8 "
                          f"matrix units); {torch.cuda.get_device_name(device)} has "
                          f"{cap[0]}.{cap[1]}: set training.float8 = false")
    if tp > 1:
        raise ConfigError("training.float8 = true is not supported with tensor parallelism "
                          "(parallel.tp > 1) in this version")
    try:
        import torchao.float8  # noqa: F401
    except Exception as e:  # ImportError, or a torchao built for another torch
        raise ConfigError(f"training.float8 = true needs torchao's float8 training "
                          f"(pip install torchao), which cannot be imported here: "
                          f"{type(e).__name__}: {e}") from None


def apply_float8(model: nn.Module, cfg: Config, device: torch.device, tp: int = 1) -> None:
    """Swap the blocks' nn.Linear layers for torchao's Float8Linear (dynamic tensorwise
    scaling) when `training.float8` is on; before compile and FSDP, as torchtitan does. The
    embedding and the output layer (whose weight the fused loss reads) keep their dtype."""
    if not cfg.training.float8:
        return
    check_float8(cfg, device, tp)
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    def blocks_only(mod: nn.Module, fqn: str) -> bool:
        return fqn.startswith("layers.") and mod.in_features % 16 == 0 \
            and mod.out_features % 16 == 0

    convert_to_float8_training(model, config=Float8LinearConfig(),
                               module_filter_fn=blocks_only)


# -- activation checkpointing and compile ----------------------------------------------------------
def apply_ac(model: nn.Module, mode: str) -> None:
    """Recompute each block's activations in backward (full), or all but matmul outputs."""
    if mode == "none":
        return
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    kwargs = {"preserve_rng_state": False}
    if mode == "selective":
        from functools import partial

        from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

        keep = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default,
                torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
                torch.ops.aten._scaled_dot_product_efficient_attention.default,
                torch.ops.aten._scaled_dot_product_flash_attention.default}

        def policy(ctx, op, *args, **kw):  # noqa: ARG001
            return CheckpointPolicy.MUST_SAVE if op in keep else CheckpointPolicy.PREFER_RECOMPUTE

        kwargs["context_fn"] = partial(create_selective_checkpoint_contexts, policy)
    for name, block in list(model.layers.items()):
        model.layers[name] = checkpoint_wrapper(block, **kwargs)


def apply_compile(model: nn.Module) -> None:
    """torch.compile each block (graph breaks stay inside a block)."""
    for name, block in list(model.layers.items()):
        model.layers[name] = torch.compile(block, fullgraph=False)


# -- data parallel -------------------------------------------------------------------------------
def apply_fsdp(model: nn.Module, mesh: DeviceMesh, cfg: Config, device_type: str,
               reshard_root: bool = False, expert_mesh: DeviceMesh | None = None) -> nn.Module:
    """Shard every block and the root with FSDP2 over `mesh` (1-D, or 2-D for HSDP).

    Under expert parallelism each block's experts are sharded first, over `expert_mesh`: the
    data-parallel ranks that hold the same experts.
    """
    kwargs = {"mesh": mesh}
    mp = mixed_precision(cfg, device_type)
    if mp is not None:
        kwargs["mp_policy"] = mp
    if cfg.parallel.offload == "cpu":
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=device_type == "cuda")
    reshard = cfg.training.data_parallel != "zero2"
    blocks = list(model.layers.values())
    for block in blocks:
        if expert_mesh is not None:
            from myria.parallel.expert import ParallelExperts

            ekw = dict(kwargs, mesh=expert_mesh)
            for sub in block.modules():
                if isinstance(sub, ParallelExperts):
                    fully_shard(sub, reshard_after_forward=reshard, **ekw)
        fully_shard(block, reshard_after_forward=reshard, **kwargs)
    # The root's parameters (embeddings, head) are needed right after the last block's
    # forward, so keeping them unsharded after forward avoids one all-gather (except under
    # pipelining, where a stage's forward and backward are far apart).
    fully_shard(model, reshard_after_forward=reshard_root, **kwargs)
    depth = cfg.parallel.fsdp_prefetch
    if depth > 1 and len(blocks) > 1:
        for i, block in enumerate(blocks):
            block.set_modules_to_forward_prefetch(blocks[i + 1:i + 1 + depth])
            block.set_modules_to_backward_prefetch(blocks[max(0, i - depth):i][::-1])
    return model


def apply_ddp(model: nn.Module, mesh: DeviceMesh, device: torch.device) -> nn.Module:
    """Wrap an initialised model in DistributedDataParallel over the flattened dp group."""
    group = mesh.get_group() if mesh.ndim == 1 else mesh._flatten().get_group()
    ids = [device.index] if device.type == "cuda" else None
    return nn.parallel.DistributedDataParallel(model, device_ids=ids, process_group=group)
