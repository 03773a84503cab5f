"""Exact bit checksums of tensors, and the check that a copy holds the bytes of its source.

`sums` is the wrapping integer sum of each tensor's bits (any single flipped bit changes it;
it reads memory once at full bandwidth). A copy of the training state (a checkpoint's snapshot,
a peer-memory snapshot, an export) is checked against the checksums the at-rest ledger
(`myria.train.sdc.StateLedger.recorded`) took when the optimizer wrote that state, found by the
source tensor's storage (`storage_key`). Imports nothing of myria: the checkpoint manager, the
peer snapshots, the export and the silent-corruption checks all use it.
"""

from __future__ import annotations

import numpy as np
import torch

from myria.tensors import local_shard


def sums(tensors: list[torch.Tensor]) -> torch.Tensor:
    """One exact bit checksum per tensor (wrapping integer sums), as one int64 tensor.

    Host tensors are summed by numpy, whose integer reductions run at memory bandwidth (torch's
    CPU integer sums are several times slower); both wrap alike, so the values are the same."""
    out = []
    host = all(t.device.type == "cpu" for t in tensors)
    for t in tensors:
        t = t.detach().reshape(-1)
        if t.element_size() == 8:
            width, acc = torch.int64, torch.int64
        else:
            width, acc = {4: torch.int32, 2: torch.int16, 1: torch.int8}[t.element_size()], \
                torch.int32
        if host:
            out.append(int(t.view(width).numpy().sum(dtype=_NUMPY[acc])))
        else:
            out.append(t.view(width).sum(dtype=acc).to(torch.int64))
    if not out:
        return torch.zeros(0, dtype=torch.int64)
    if host:
        return torch.tensor(out, dtype=torch.int64)
    # the state of one model can span devices (an optimizer's step counts stay on the host
    # beside parameters on the GPU): the sums meet on the first device tensor's device
    device = next(t.device for t in tensors if t.device.type != "cpu")
    return torch.stack([s.to(device) for s in out])


_NUMPY = {torch.int64: np.int64, torch.int32: np.int32}


def storage_key(t: torch.Tensor) -> tuple:
    """What identifies a tensor's bytes in memory: two views with the same key read the same
    bytes (a state dict's entries and the ledger's tensors share storage)."""
    t = local_shard(t)
    return (t.data_ptr(), t.numel(), t.dtype)


def expected_sums(recorded: dict[tuple, int], tensors: list[torch.Tensor]) -> list[int]:
    """The checksum each of `tensors` must have: the ledger's (`StateLedger.recorded`: what the
    optimizer wrote, verified since), else its own, taken now (a tensor the ledger does not
    track: a buffer, the step count of an optimizer tier without parameter groups)."""
    out: list[int | None] = [recorded.get(storage_key(t)) for t in tensors]
    missing = [i for i, v in enumerate(out) if v is None]
    if missing:
        for i, v in zip(missing, sums([tensors[i] for i in missing]).tolist()):
            out[i] = v
    return out   # type: ignore[return-value]


def differing(expected: list[int], tensors: list[torch.Tensor]) -> list[int]:
    """The indices of `tensors` whose checksum is not the `expected` one (empty: equal)."""
    if not tensors:
        return []
    got = sums(tensors)
    want = torch.tensor(expected, dtype=torch.int64)
    return (got != want).nonzero().reshape(-1).tolist()
