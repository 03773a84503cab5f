"""LAMB optimizer (You et al. 2019, "Large Batch Optimization for Deep Learning") for plain
tensors and FSDP2 / tensor-parallel DTensor parameters.

Per parameter w with gradient g, at step t:

    m = b1 m + (1 - b1) g                v = b2 v + (1 - b2) g^2
    u = (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps) + weight_decay * w
    r = ||w|| / ||u||          (r = 1 when either norm is 0; optionally r = min(r, max_trust_ratio))
    w = w - lr * r * u

The trust ratio r is layer-wise: the norms are those of the FULL parameter, not of a rank's
shard. For DTensor parameters all element-wise work runs on the local shards, and the squared
norms of every parameter sharing a (mesh, placements) layout are summed across the sharded mesh
dimensions with one all-reduce per dimension, instead of one collective per parameter.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from myria.tensors import local_grad, local_shard


def _reduce_squares(sq: torch.Tensor, param: torch.Tensor) -> None:
    """Sum the per-shard squared norms `sq` (in place) across the mesh dims `param` is sharded on.

    Any Shard-like placement (Shard, FSDP2+TP's _StridedShard) partitions the elements, so the
    sum over the shards of the local sums of squares is the full tensor's. Replicated dimensions
    hold identical copies and need nothing. Partial placements would hold partial sums of values,
    for which squares do not add up; parameters are never Partial, so that is refused.
    """
    mesh = param.device_mesh
    for dim, placement in enumerate(param.placements):
        if placement.is_replicate():
            continue
        if placement.is_partial():
            raise ValueError("LAMB: parameters with Partial placements are not supported")
        if mesh.size(dim) > 1:
            dist.all_reduce(sq, op=dist.ReduceOp.SUM, group=mesh.get_group(dim))


class Lamb(Optimizer):
    """Layer-wise Adaptive Moments (LAMB) with decoupled weight decay and bias correction.

    Args:
        params: parameters or param groups (each group may set lr, betas, eps, weight_decay,
            max_trust_ratio).
        lr: learning rate.
        betas: decay rates of the first and second moments.
        eps: added to the denominator sqrt(v_hat).
        weight_decay: decoupled weight decay, added to the update before the trust ratio.
        max_trust_ratio: clamp the trust ratio to at most this value; None for no clamp.
    """

    def __init__(self, params: Iterable, lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-6,
                 weight_decay: float = 0.0, max_trust_ratio: float | None = None):
        if lr < 0.0:
            raise ValueError(f"Lamb: invalid lr {lr}; must be >= 0")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"Lamb: invalid betas {betas}; each must be in [0, 1)")
        if eps < 0.0:
            raise ValueError(f"Lamb: invalid eps {eps}; must be >= 0")
        if weight_decay < 0.0:
            raise ValueError(f"Lamb: invalid weight_decay {weight_decay}; must be >= 0")
        if max_trust_ratio is not None and max_trust_ratio <= 0.0:
            raise ValueError(f"Lamb: invalid max_trust_ratio {max_trust_ratio}; must be > 0")
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                        max_trust_ratio=max_trust_ratio)
        super().__init__(params, defaults)

    def _init_state(self, p: torch.Tensor) -> dict[str, Any]:
        state = self.state[p]
        if not state:
            # `step` is a CPU tensor (as in torch's Adam) so distributed checkpoints can save it.
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            # zeros_like keeps DTensor-ness: the moments are sharded like their parameter.
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return state

    @torch.no_grad()
    def step(self, closure=None):
        """Perform one optimisation step; returns the closure's loss when one is given."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()

        for group in self.param_groups:
            lr, (beta1, beta2) = group["lr"], group["betas"]
            eps, wd, max_ratio = group["eps"], group["weight_decay"], group["max_trust_ratio"]
            params, updates = [], []
            # Phase 1: moments and the raw update, element-wise on local shards.
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("Lamb does not support sparse gradients")
                state = self._init_state(p)
                state["step"] += 1
                t = state["step"].item()
                w, g = local_shard(p), local_grad(p)
                m, v = local_shard(state["exp_avg"]), local_shard(state["exp_avg_sq"])
                m.lerp_(g, 1.0 - beta1)
                v.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
                bc1 = 1.0 - beta1 ** t
                bc2_sqrt = math.sqrt(1.0 - beta2 ** t)
                # u = (m / bc1) / (sqrt(v) / sqrt(bc2) + eps) + wd * w
                denom = v.sqrt().div_(bc2_sqrt).add_(eps)
                u = (m / bc1).div_(denom)
                if wd != 0.0:
                    u.add_(w, alpha=wd)
                params.append(p)
                updates.append(u)
            if not params:
                continue

            # Phase 2: full-tensor norms. Row 0 holds ||w||^2, row 1 ||u||^2, per parameter.
            # Accumulated in fp32 at least (fp64 when a parameter is fp64).
            acc = torch.float64 if any(p.dtype == torch.float64 for p in params) else torch.float32
            sq = torch.stack([
                torch.stack([local_shard(p).to(acc).square().sum(), u.to(acc).square().sum()])
                for p, u in zip(params, updates, strict=True)
            ], dim=1)
            self._reduce_norms(params, sq)
            w_norm, u_norm = sq[0].sqrt(), sq[1].sqrt()
            ratio = torch.where((w_norm > 0) & (u_norm > 0), w_norm / u_norm,
                                torch.ones_like(w_norm))
            if max_ratio is not None:
                ratio = ratio.clamp(max=max_ratio)

            # Phase 3: w -= lr * r * u (r stays a tensor: no host synchronisation).
            for i, (p, u) in enumerate(zip(params, updates, strict=True)):
                local_shard(p).sub_(u.mul_(ratio[i].to(u.dtype)), alpha=lr)
        return loss

    @staticmethod
    def _reduce_norms(params: list[torch.Tensor], sq: torch.Tensor) -> None:
        """Turn per-shard squared norms (columns of `sq`) into full-tensor squared norms."""
        layouts: dict[tuple, list[int]] = {}
        for i, p in enumerate(params):
            if isinstance(p, DTensor):
                layouts.setdefault((id(p.device_mesh), tuple(p.placements)), []).append(i)
        for idx in layouts.values():
            # One collective per sharded mesh dim for all parameters of this layout.
            cols = torch.tensor(idx, device=sq.device)
            part = sq.index_select(1, cols)
            _reduce_squares(part, params[idx[0]])
            sq.index_copy_(1, cols, part)
