"""This rank's view of a tensor that may be a DTensor: its local shard, or its whole value.

Every module that walks a rank's tensors (model code, optimizers, checkpoints, peer snapshots,
silent-corruption checks, the nvme tier) asks here, so that "the local shard" means one thing.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor


def local_shard(t: torch.Tensor) -> torch.Tensor:
    """The part of `t` this rank holds (a DTensor's local tensor, sharing its storage), else
    `t` itself. Differentiable under grad mode (`DTensor.to_local`); without grad mode it is
    the local tensor object itself, outside autograd."""
    return t.to_local() if isinstance(t, DTensor) else t


def local_grad(p: torch.Tensor) -> torch.Tensor | None:
    """This rank's part of `p`'s gradient, laid out as `p` is. Under tensor parallelism a
    gradient can come out placed otherwise than its parameter: a replicated norm weight's
    pending a sum over the group (Partial), the sharded embedding's whole (Replicate). DTensor
    arithmetic (torch's optimizers, the clip's norm) redistributes it on every use; code that
    reads the local bytes needs it as the parameter is, so it is redistributed here, once, and
    kept in `p.grad` (for a Partial gradient that is a sum over the group: every rank of it
    calls this for the same tensors in the same order)."""
    g = p.grad
    if isinstance(g, DTensor) and isinstance(p, DTensor) and g.placements != p.placements:
        g = p.grad = g.redistribute(p.device_mesh, p.placements)
    return None if g is None else local_shard(g)


def placed_as_param(p: torch.Tensor) -> bool:
    """Whether `p`'s gradient (if any) already has its parameter's layout (`local_grad`)."""
    g = p.grad
    return not (isinstance(g, DTensor) and isinstance(p, DTensor) and g.placements != p.placements)


def local_data(t: torch.Tensor) -> torch.Tensor:
    """The tensor object that holds this rank's bytes of `t` (a DTensor's local tensor, else
    `t`), for code that reads or writes bytes outside autograd (checksums, copies). Unlike
    `local_shard` it dispatches nothing: a checksum pass visits every tensor of the state each
    step, and on a GPU host `to_local`'s autograd call per tensor outweighs the sums."""
    return t._local_tensor if isinstance(t, DTensor) else t


def full_value(t: torch.Tensor) -> torch.Tensor:
    """The whole value of `t` on this rank (a DTensor gathered, as `full_tensor` does), else
    `t` itself: for small replicated results such as a loss or a norm."""
    return t.full_tensor() if isinstance(t, DTensor) else t
