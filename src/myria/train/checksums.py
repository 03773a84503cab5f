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

from myria.tensors import local_data

SMALL = 1 << 16   # elements: on a device, tensors this small are summed together per width


def sums(tensors: list[torch.Tensor]) -> torch.Tensor:
    """One exact bit checksum per tensor (the wrapping integer sum of its bits), as one int64
    tensor: on the host when every tensor is, else on the first device tensor's device (the
    state of one model can span both: an optimizer's step counts stay on the host beside GPU
    parameters). Any single flipped bit changes a tensor's sum; the memory is read once.

    Host tensors are summed by numpy, whose integer reductions run at memory bandwidth (torch's
    CPU integer sums are several times slower). On a device the cost of a model's state is the
    launches, not the bytes (a layer's norms are tiny): larger tensors take one reduction each,
    small ones are concatenated per width and summed per segment in int64, then wrapped to the
    int32 a wrapping accumulator would hold, which is the same value."""
    host = [i for i, t in enumerate(tensors) if t.device.type == "cpu"]
    with torch.no_grad():   # bits are read, never differentiated: no view is tracked
        if len(host) == len(tensors):
            return torch.tensor([_host_sum(t) for t in tensors], dtype=torch.int64)
        device = next(t.device for t in tensors if t.device.type != "cpu")
        return _gathered(tensors, host, device)


def _gathered(tensors: list[torch.Tensor], host: list[int], device: torch.device) -> torch.Tensor:
    """`sums` on `device`, the tensors at indices `host` summed by numpy and the others by
    torch (the seam lets the device path run on host tensors in tests)."""
    out = torch.empty(len(tensors), dtype=torch.int64, device=device)
    if host:
        out[torch.tensor(host, device=device)] = torch.tensor(
            [_host_sum(tensors[i]) for i in host], dtype=torch.int64).to(device)
    on_host = set(host)
    small: dict[torch.dtype, list[int]] = {}
    large: dict[torch.dtype, tuple[list[int], list[torch.Tensor]]] = {}
    for i, t in enumerate(tensors):
        if i in on_host:
            continue
        width, acc = _width(t)
        if 0 < t.numel() <= SMALL and acc == torch.int32:
            small.setdefault(width, []).append(i)
        else:
            idx, vals = large.setdefault(acc, ([], []))
            idx.append(i)
            vals.append(t.view(width).sum(dtype=acc))   # same width: a view of any layout
    for idx, vals in large.values():
        out[torch.tensor(idx, device=device)] = torch.stack(vals).to(torch.int64)
    for width, idx in small.items():
        flat = torch.cat([_flat(tensors[i], width) for i in idx]).to(torch.int64)
        lengths = torch.tensor([tensors[i].numel() for i in idx], device=device)
        segment = torch.repeat_interleave(torch.arange(len(idx), device=device), lengths,
                                          output_size=flat.numel())
        total = torch.zeros(len(idx), dtype=torch.int64, device=device)
        out[torch.tensor(idx, device=device)] = _wrap32(total.index_add_(0, segment, flat))
    return out


def _host_sum(t: torch.Tensor) -> int:
    width, acc = _width(t)
    return int(_flat(t, width).numpy().sum(dtype=_NUMPY[acc]))


def _flat(t: torch.Tensor, width: torch.dtype) -> torch.Tensor:
    return t.detach().reshape(-1).view(width)


def _wrap32(x: torch.Tensor) -> torch.Tensor:
    """int64 sums as the int32 a wrapping int32 accumulator would hold."""
    return (x + 2**31) % 2**32 - 2**31


def _width(t: torch.Tensor) -> tuple[torch.dtype, torch.dtype]:
    """The integer type of `t`'s bytes, and the one its wrapping sum accumulates in."""
    if t.element_size() == 8:
        return torch.int64, torch.int64
    return {4: torch.int32, 2: torch.int16, 1: torch.int8}[t.element_size()], torch.int32


_NUMPY = {torch.int64: np.int64, torch.int32: np.int32}


def storage_key(t: torch.Tensor) -> tuple:
    """What identifies a tensor's bytes in memory: two views with the same key read the same
    bytes (a state dict's entries and the ledger's tensors share storage)."""
    t = local_data(t)
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
