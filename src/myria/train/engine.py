"""The model as the training loop sees it, whatever the parallel layout.

`Engine` builds the model on the meta device, applies the parallelism of the layout, materialises
and initialises it, and owns the optimizer and schedule. The loop calls `forward_backward` on a
batch, `step`, and for checkpoints `state_dict` / `load_state_dict`, whose keys are the plain
model's parameter names whatever the layout, so a checkpoint loads under any other layout.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from myria.config import Config
from myria.models.transformer import build_model
from myria.optim import build_optimizer
from myria.optim.schedules import build_scheduler
from myria.parallel.mesh import dp_mesh, dp_rank_and_size
from myria.parallel.parallelize import apply_ddp, apply_fsdp


def _grad_sync(model: nn.Module, enabled: bool):
    """Gradient synchronisation on or off, for gradient accumulation (FSDP2 or DDP)."""
    if hasattr(model, "set_requires_gradient_sync"):  # FSDP2
        model.set_requires_gradient_sync(enabled)
        return contextlib.nullcontext()
    if not enabled and isinstance(model, nn.parallel.DistributedDataParallel):
        return model.no_sync()
    return contextlib.nullcontext()


class Engine:
    """Model parts, optimizer and schedule of this rank, built for the run's layout."""

    def __init__(self, cfg: Config, mesh, device: torch.device):
        self.cfg, self.mesh, self.device = cfg, mesh, device
        t = cfg.training
        self.dp_rank, self.dp_size = dp_rank_and_size(mesh)
        self.dp_group = None
        if self.dp_size > 1:
            sub = dp_mesh(mesh)
            self.dp_group = sub.get_group() if sub.ndim == 1 else sub._flatten().get_group()

        model = build_model(cfg.model, "meta")
        if self.dp_size > 1 and t.data_parallel != "ddp":
            apply_fsdp(model, dp_mesh(mesh), cfg, device.type)
        model.to_empty(device=device)
        model.init_weights(t.seed)
        if self.dp_size > 1 and t.data_parallel == "ddp":
            model = apply_ddp(model, dp_mesh(mesh), device)
        self.model = model
        self.parts: list[nn.Module] = [model]
        self.optimizer = build_optimizer(model, cfg.optimizer)
        self.scheduler = build_scheduler(self.optimizer, cfg.optimizer, t.steps)

    # -- one step ----------------------------------------------------------------------------
    def forward_backward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Run all microbatches (inputs: [accum, micro, seq]); return this rank's mean loss."""
        accum = inputs.shape[0]
        loss_sum = torch.zeros((), device=self.device)
        for i in range(accum):
            with _grad_sync(self.model, i == accum - 1):
                loss = self.model(inputs[i], targets[i]) / accum
                loss.backward()
            loss_sum += loss.detach()
        return loss_sum

    def clip_grads(self, max_norm: float) -> float:
        """Clip the global gradient norm (DTensor-aware); returns the norm before clipping."""
        params = [p for m in self.parts for p in m.parameters() if p.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm > 0 else float("inf"),
                                              foreach=True)
        if hasattr(norm, "full_tensor"):
            norm = norm.full_tensor()
        return float(norm)

    def step(self) -> None:
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()

    @property
    def lr(self) -> float:
        return self.scheduler.get_last_lr()[0]

    def mean_over_dp(self, value: torch.Tensor) -> float:
        """Average a per-rank scalar over the data-parallel ranks."""
        if self.dp_group is not None:
            value = value.clone()
            dist.all_reduce(value, op=dist.ReduceOp.SUM, group=self.dp_group)
            value /= self.dp_size
        return float(value)

    @torch.no_grad()
    def eval_loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        self.model.eval()
        try:
            return self.model(inputs, targets)
        finally:
            self.model.train()

    # -- checkpoint state --------------------------------------------------------------------
    _OPTS = StateDictOptions(flatten_optimizer_state_dict=True)

    def state_dict(self) -> dict:
        """{"model": {name: tensor}, "optim": {flat name: tensor}} keyed by plain names."""
        model_sd, optim_sd = {}, {}
        for part in self.parts:
            model_sd.update(get_model_state_dict(part, options=self._OPTS))
            optim_sd.update(get_optimizer_state_dict(part, self.optimizer, options=self._OPTS))
        return {"model": model_sd, "optim": optim_sd}

    def load_state_dict(self, state: dict) -> None:
        for part in self.parts:
            set_model_state_dict(part, state["model"], options=StateDictOptions(strict=False))
            set_optimizer_state_dict(part, self.optimizer, state["optim"], options=self._OPTS)

    def scheduler_state(self) -> dict:
        return self.scheduler.state_dict()

    def load_scheduler_state(self, state: dict) -> None:
        self.scheduler.load_state_dict(state)
