"""Apply parallelism to a plain model: data parallelism with FSDP2 (full or ZeRO-2-like) or DDP.

The model knows nothing of this. FSDP2 wraps each transformer block, then the root (embeddings,
final norm, head). Its overlap is on by default: the next block's all-gather is prefetched while
the current one computes, and reduce-scatters run asynchronously during backward.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from myria.config import Config


def mixed_precision(cfg: Config, device_type: str) -> MixedPrecisionPolicy | None:
    """bf16 parameters/compute with fp32 gradient reduction on GPU; fp32 on CPU by default."""
    dtype = cfg.training.dtype
    if dtype == "auto":
        dtype = "bfloat16" if device_type == "cuda" else "float32"
    if dtype == "float32":
        return None
    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def apply_fsdp(model: nn.Module, mesh: DeviceMesh, cfg: Config, device_type: str) -> nn.Module:
    """Shard every block and the root with FSDP2 over `mesh` (1-D, or 2-D for HSDP)."""
    kwargs = {"mesh": mesh}
    mp = mixed_precision(cfg, device_type)
    if mp is not None:
        kwargs["mp_policy"] = mp
    reshard = cfg.training.data_parallel != "zero2"
    for block in model.layers.values():
        fully_shard(block, reshard_after_forward=reshard, **kwargs)
    # The root's parameters (embeddings, head) are needed right after the last block's
    # forward, so keeping them unsharded after forward avoids one all-gather.
    fully_shard(model, reshard_after_forward=False, **kwargs)
    return model


def apply_ddp(model: nn.Module, mesh: DeviceMesh, device: torch.device) -> nn.Module:
    """Wrap an initialised model in DistributedDataParallel over the flattened dp group."""
    group = mesh.get_group() if mesh.ndim == 1 else mesh._flatten().get_group()
    ids = [device.index] if device.type == "cuda" else None
    return nn.parallel.DistributedDataParallel(model, device_ids=ids, process_group=group)


def unwrap(model: nn.Module) -> nn.Module:
    """The plain model inside a DDP wrapper (FSDP2 does not wrap)."""
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
