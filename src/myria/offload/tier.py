"""Where a rank's optimizer state lives: one protocol the engine calls for every tier.

- `MemoryTier` (parallel.offload = none or cpu): torch's optimizers over the model parts; their
  state is in memory (under `cpu`, FSDP2's CPUOffloadPolicy keeps it in host memory: nothing for
  the tier to do beyond what `parallelize.apply_fsdp` sets up).
- `NvmeTier` (parallel.offload = nvme, myria.offload.nvme): AdamW's state in files on a local
  disk, streamed through a few buffers; with `offload_params` the parameters too.

The engine builds the tier before the model (`optimizer_tier`), lets it materialise each
parallelised part, builds the optimizers through it, and then calls the same methods whatever
the tier: what happens to the gradients before `step()` (the nvme tier starts its update during
the last backward, and must hear of a clip or a changed gradient), and what a checkpoint saves
beside the DCP shards (files linked, parameters mapped from files).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import torch
from torch import nn

from myria.errors import CheckpointError
from myria.layout import Layout
from myria.offload.nvme import NvmeTier, fill_in_memory, has_offload_files
from myria.optim import build_optimizer


class OptimizerTier(Protocol):
    """What the engine asks of the home of the optimizer state (and of parameters kept off
    the device)."""

    optimizers: list[torch.optim.Optimizer]
    # whether it may read gradients before the backward ends (an update started as each
    # chunk's gradients are final): then nothing may check them only after the backward
    reads_grads_in_backward: bool

    def materialise(self, part: nn.Module, device: torch.device, seed: int) -> None:
        """Give a parallelised part on the meta device its storage and initial values."""

    def build(self, parts: list[nn.Module], layout: Layout,
              device_type: str) -> list[torch.optim.Optimizer]:
        """The optimizers of the parts (one each), kept as `optimizers`."""

    def fill_parameters(self, parts: list[nn.Module],
                        read: Callable[[dict[str, torch.Tensor]], object]) -> None:
        """Before the first step, replace the initial values of the parts' parameters:
        `read({name: parameter})` (names as the parts' `named_parameters` give them) fills
        them in place, called once with all of them, or once per unit when the tier keeps
        them in files."""

    def before_last_backward(self) -> None:
        """The step's last backward is about to run."""

    def on_clip(self, scaled: bool) -> None:
        """The gradients are about to be scaled by clipping (or not: `scaled` False)."""

    def on_grads_changed(self) -> None:
        """Something changed gradients after backward (a fault injected into one)."""

    def file_backed_state(self) -> dict[str, torch.Tensor]:
        """Model entries a checkpoint takes from files, not from the parts."""

    def checkpoint_files(self) -> dict[str, Path]:
        """{name in the checkpoint: file} to link into a checkpoint (committed state)."""

    def checkpoint_checks(self) -> dict[str, Callable[[Path], str]]:
        """{name in the checkpoint: a check of the linked file} for `checkpoint_files`, taken
        with them: why the file read back is not what was written ("" when it is)."""

    def check_checkpoint(self, path: Path, meta: dict) -> None:
        """CheckpointError (one line) when a checkpoint's state is not where this tier keeps
        it."""

    def load_files(self, path: Path) -> None:
        """Take the checkpoint's files back (after `check_checkpoint`)."""

    def close(self) -> None:
        """Finish and release what the tier holds (never raises)."""


class MemoryTier:
    """torch's optimizers, their state in memory (parallel.offload = none or cpu)."""

    reads_grads_in_backward = False

    def __init__(self, cfg):
        self.cfg = cfg
        self.optimizers: list[torch.optim.Optimizer] = []

    def materialise(self, part: nn.Module, device: torch.device, seed: int) -> None:
        if self.cfg.parallel.offload != "cpu" or device.type == "cpu":
            part.to_empty(device=device)
            part.init_weights(seed)
            return
        # FSDP2's CPUOffloadPolicy takes the sharded parameters from host memory (it refuses
        # device ones at its first use) and moves them to the device itself; the buffers (the
        # RoPE tables) are not FSDP's and must be on the device the forward runs on.
        part.to_empty(device=torch.device("cpu"))
        part.init_weights(seed)
        for module in part.modules():
            for name, b in module._buffers.items():
                if b is not None:
                    module._buffers[name] = b.to(device)

    def build(self, parts: list[nn.Module], layout: Layout,
              device_type: str) -> list[torch.optim.Optimizer]:
        self.optimizers = [build_optimizer(part, self.cfg.optimizer) for part in parts]
        return self.optimizers

    def fill_parameters(self, parts: list[nn.Module],
                        read: Callable[[dict[str, torch.Tensor]], object]) -> None:
        fill_in_memory(parts, read)

    def before_last_backward(self) -> None:
        pass

    def on_clip(self, scaled: bool) -> None:
        pass

    def on_grads_changed(self) -> None:
        pass

    def file_backed_state(self) -> dict[str, torch.Tensor]:
        return {}

    def checkpoint_files(self) -> dict[str, Path]:
        return {}

    def checkpoint_checks(self) -> dict[str, Callable[[Path], str]]:
        return {}

    def check_checkpoint(self, path: Path, meta: dict) -> None:
        if has_offload_files(meta):
            raise CheckpointError(f"checkpoint {path} keeps its optimizer state in offload "
                                  "files (saved with parallel.offload = 'nvme'); resume it with "
                                  "parallel.offload = 'nvme'")

    def load_files(self, path: Path) -> None:
        pass

    def close(self) -> None:
        pass


def optimizer_tier(cfg, run_dir: str | Path | None, rank: int) -> OptimizerTier:
    """The tier `parallel.offload` names, before the model is built."""
    if cfg.parallel.offload == "nvme":
        return NvmeTier(cfg, run_dir, rank)
    return MemoryTier(cfg)
