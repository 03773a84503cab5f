"""Optimizers and learning-rate schedules: AdamW or LAMB with weight-decay param groups.

Weight decay is not applied to normalisation weights (any parameter with "norm" in its name),
to biases, nor to any 1-D parameter. Tied parameters (e.g. shared embedding and output weights)
appear once, under the first name `named_parameters` gives them.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from myria.config import OptimizerConfig
from myria.optim.lamb import Lamb
from myria.optim.schedules import build_scheduler, lr_lambda

__all__ = ["Lamb", "build_optimizer", "build_scheduler", "lr_lambda", "no_decay",
           "param_groups"]


def no_decay(name: str, p: torch.Tensor) -> bool:
    """Whether parameter `name` is exempt from weight decay (norms, biases, 1-D tensors)."""
    return "norm" in name or name.endswith("bias") or p.ndim < 2


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Two param groups, "decay" and "no_decay" (empty ones are left out), tied params once."""
    seen: set[int] = set()
    decay: list[torch.Tensor] = []
    skip: list[torch.Tensor] = []
    for name, p in model.named_parameters(remove_duplicate=False):
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        (skip if no_decay(name, p) else decay).append(p)
    groups = [{"name": "decay", "params": decay, "weight_decay": weight_decay},
              {"name": "no_decay", "params": skip, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def build_optimizer(model: nn.Module, cfg: OptimizerConfig) -> torch.optim.Optimizer:
    """AdamW (PyTorch's) or LAMB over `model`'s trainable parameters, per `cfg`."""
    groups = param_groups(model, cfg.weight_decay)
    betas = (cfg.beta1, cfg.beta2)
    if cfg.name == "lamb":
        return Lamb(groups, lr=cfg.lr, betas=betas, eps=cfg.eps)
    if cfg.name != "adamw":
        raise ValueError(f"unknown optimizer {cfg.name!r}; valid: adamw, lamb")
    params = [p for g in groups for p in g["params"]]
    kinds = {isinstance(p, DTensor) for p in params}
    # The foreach kernels group tensors by type; a mix of DTensor and Tensor is not supported.
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=betas, eps=cfg.eps, foreach=len(kinds) < 2)
