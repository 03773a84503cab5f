"""Layout-independent parameter initialisation.

Each parameter's full value is generated from its own seeded generator and only the local
shard is kept, so a model initialised on 1 process, under FSDP, TP or PP holds identical values.
Generating the full tensor costs one parameter's worth of temporary memory at a time.
"""

from __future__ import annotations

import math

import torch

# Wrappers that insert a level into parameter names (activation checkpointing, torch.compile).
_WRAPPER_TOKENS = ("_checkpoint_wrapped_module.", "_orig_mod.")


def canonical_name(name: str) -> str:
    """The parameter's name in the plain model, without wrapper levels."""
    for tok in _WRAPPER_TOKENS:
        name = name.replace(tok, "")
    return name


def _full_value(shape, dtype, kind: str, std: float, key: int) -> torch.Tensor:
    if kind == "ones":
        return torch.ones(shape, dtype=dtype)
    if kind == "zeros":
        return torch.zeros(shape, dtype=dtype)
    g = torch.Generator().manual_seed(key)
    if kind == "lru":  # Griffin's decay: softplus(value) = -log a0, a0^2 uniform in [0.81, 0.998]
        u = torch.empty(shape, dtype=torch.float64).uniform_(0.9 ** 2, 0.999 ** 2, generator=g)
        return torch.log(torch.expm1(-0.5 * torch.log(u))).to(dtype)
    if kind == "a_log":  # Mamba-2 / Gated DeltaNet decay rate: A uniform in [1, 16]
        return torch.log(torch.empty(shape, dtype=torch.float64).uniform_(1, 16, generator=g)
                         ).to(dtype)
    if kind == "dt_bias":  # softplus(value) = dt, log-uniform in [0.001, 0.1]
        dt = torch.exp(torch.empty(shape, dtype=torch.float64).uniform_(
            math.log(1e-3), math.log(0.1), generator=g))
        return (dt + torch.log(-torch.expm1(-dt))).to(dtype)
    return torch.randn(shape, generator=g, dtype=torch.float32).mul_(std).to(dtype)


@torch.no_grad()
def fill_parameter(p: torch.Tensor, kind: str, std: float, key: int) -> None:
    """Set `p` (a plain tensor or a DTensor shard) to its slice of the full initial value."""
    from torch.distributed.tensor import DTensor, Replicate

    if isinstance(p, DTensor):
        full = _full_value(p.shape, p.dtype, kind, std, key).to(p.device)
        # Replicate -> Shard is a local slice: no communication.
        # Every rank holds the same full value, so wrapping it as Replicate needs no check.
        placed = DTensor.from_local(full, p.device_mesh, [Replicate()] * p.device_mesh.ndim,
                                    run_check=False)
        placed = placed.redistribute(p.device_mesh, p.placements)
        p.to_local().copy_(placed.to_local())
    else:
        p.copy_(_full_value(p.shape, p.dtype, kind, std, key).to(p.device))
