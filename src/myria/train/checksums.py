"""Exact bit checksums of tensors, and the check that a copy holds the bytes of its source.

`sums` is the wrapping integer sum of each tensor's bits (any single flipped bit changes it;
it reads memory once at full bandwidth). A copy of the training state (a checkpoint's snapshot,
a peer-memory snapshot, an export) is checked against the checksums the at-rest ledger
(`myria.train.sdc.StateLedger.recorded`) took when the optimizer wrote that state, found by the
source tensor's storage (`storage_key`). Imports only `myria.tensors`: the checkpoint manager,
the peer snapshots, the export and the silent-corruption checks all use it.
"""

from __future__ import annotations

import warnings
from collections import OrderedDict

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
    host's work of issuing a reduction per tensor, not the bytes: see `_Plan` and `_Replays`."""
    host = [i for i, t in enumerate(tensors) if t.device.type == "cpu"]
    with torch.no_grad():   # bits are read, never differentiated: no view is tracked
        if len(host) == len(tensors):
            return torch.tensor([_host_sum(t) for t in tensors], dtype=torch.int64)
        device = next(t.device for t in tensors if t.device.type != "cpu")
        return _gathered(tensors, host, device)


def one_sum(t: torch.Tensor) -> torch.Tensor:
    """`sums([t])`'s one value as a 0-dim int64 tensor on `t`'s device, issued as one reduction
    with no index tensors (a `_Plan` makes some on the device): for a tensor summed alone as it
    is written, where building a plan per call would copy to the device each time."""
    with torch.no_grad():
        if t.device.type == "cpu":
            return torch.tensor(_host_sum(t), dtype=torch.int64)
        return _device_sum(t)


def _device_sum(t: torch.Tensor) -> torch.Tensor:
    """The wrapping sum of `t`'s bits in one reduction (the value of `_Plan.run`'s, whose
    segment sums of small tensors wrap to the same int32)."""
    width, acc = _width(t)
    return t.detach().view(width).sum(dtype=acc).to(torch.int64)


def _gathered(tensors: list[torch.Tensor], host: list[int], device: torch.device,
              replays: _Replays | None = None) -> torch.Tensor:
    """`sums` on `device`: the tensors at indices `host` summed by numpy, the others by the
    device work of a `_Plan`, replayed from a CUDA graph where `replays` (default: the
    process's) has one. The seam lets the device path run on host tensors in tests."""
    replays = _REPLAYS if replays is None else replays
    if len(tensors) - len(host) >= replays.least:
        key = (device, tuple(host), tuple(
            (t.data_ptr(), t.dtype, tuple(t.shape), t.stride()) for t in tensors))
        entry = replays.entry(key, lambda: _Plan(tensors, host, device))
        plan, got = entry.plan, replays.run(entry, tensors, device)
    else:   # a few tensors: no pattern worth a graph
        plan = _Plan(tensors, host, device)
        got = plan.run(tensors)
    if not host:
        return got
    out = torch.empty(len(tensors), dtype=torch.int64, device=device)
    out.index_copy_(0, plan.host_at, torch.tensor(
        [_host_sum(tensors[i]) for i in host], dtype=torch.int64).to(device))
    if plan.device_at.numel():
        out.index_copy_(0, plan.device_at, got)
    return out


class _Plan:
    """The device work of `sums` for one list of tensors (their shapes and dtypes), fixed once:
    larger tensors take one reduction each; small ones (a layer's norms) are concatenated per
    width and summed per segment in int64, then wrapped to the int32 a wrapping accumulator
    would hold, which is the same value. Its index tensors are made on the device here, so
    that `run` issues only device operations, in an order a CUDA graph can capture."""

    def __init__(self, tensors: list[torch.Tensor], host: list[int], device: torch.device):
        on_host = set(host)
        on_device = [i for i in range(len(tensors)) if i not in on_host]
        self.device_at = torch.tensor(on_device, dtype=torch.int64, device=device)
        self.host_at = torch.tensor(host, dtype=torch.int64, device=device)
        self.n = len(on_device)
        slot = {i: k for k, i in enumerate(on_device)}   # position among the device tensors
        small: dict[torch.dtype, list[int]] = {}
        self.large: dict[torch.dtype, list[int]] = {}
        for i, t in enumerate(tensors):
            if i in on_host:
                continue
            width, acc = _width(t)
            if 0 < t.numel() <= SMALL and acc == torch.int32:
                small.setdefault(width, []).append(i)
            else:
                self.large.setdefault(acc, []).append(i)
        self.large_at = {acc: torch.tensor([slot[i] for i in idx], device=device)
                         for acc, idx in self.large.items()}
        self.small = []   # (width, tensor indices, their slots, segment id of each element)
        for width, idx in small.items():
            lengths = torch.tensor([tensors[i].numel() for i in idx], device=device)
            segment = torch.repeat_interleave(torch.arange(len(idx), device=device), lengths)
            self.small.append((width, idx, torch.tensor([slot[i] for i in idx], device=device),
                               segment))

    def run(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        """The int64 sums of the device tensors, in their order in `tensors`."""
        out = torch.empty(self.n, dtype=torch.int64, device=self.device_at.device)
        for acc, idx in self.large.items():
            vals = [tensors[i].view(_width(tensors[i])[0]).sum(dtype=acc) for i in idx]
            out.index_copy_(0, self.large_at[acc], torch.stack(vals).to(torch.int64))
        for width, idx, at, segment in self.small:
            flat = torch.cat([tensors[i].reshape(-1).view(width) for i in idx]).to(torch.int64)
            total = torch.zeros(len(idx), dtype=torch.int64, device=flat.device)
            out.index_copy_(0, at, _wrap32(total.index_add_(0, segment, flat)))
        return out


class _Replays:
    """CUDA graphs of `_Plan.run`, one per list of tensors at fixed addresses (the key: each
    tensor's address, dtype, shape and strides). Every step sums the same parameters and
    optimizer state, hundreds of tensors twice a step; issuing each reduction costs the host
    more than the GPU needs to read the tensor, and a graph replays them all in one launch.

    Only lists of at least `least` device tensors are kept (a model's state and gradients; the
    few tensors of a compute check are new each time). A list is captured the second time it
    is seen (once is no pattern: gradients may move), at most `limit` lists are kept (the least
    recently used goes), and a graph is trusted only
    after its first replay equalled the operations run directly: on a mismatch, or where a
    capture fails, this process stops using graphs and says so once. `capture(fn)` returns
    (graph, output) with `graph.replay()` rewriting `output`, or None where the device has no
    graphs (a `capture` of None: never capture)."""

    def __init__(self, capture=None, limit: int = 4, least: int = 16):
        self.capture = capture
        self.limit = limit
        self.least = least
        self.entries: OrderedDict = OrderedDict()
        self.disabled = ""   # why graphs are off in this process ("" while they are on)

    def entry(self, key, make) -> _Entry:
        e = self.entries.get(key)
        if e is None:
            e = self.entries[key] = _Entry(make())
            while len(self.entries) > self.limit:
                self.entries.popitem(last=False)
        self.entries.move_to_end(key)
        return e

    def run(self, e: _Entry, tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
        e.seen += 1
        usable = self.capture is not None and not self.disabled and e.plan.n
        if usable and e.graph is None and e.seen >= 2:
            try:
                e.graph, e.out = self.capture(lambda: e.plan.run(tensors), device) or (False, None)
            except Exception as ex:   # noqa: BLE001  (a capture the device refuses)
                self._off(f"capture failed ({type(ex).__name__}: {ex})")
        if not e.graph or self.disabled:
            return e.plan.run(tensors)
        e.graph.replay()
        got = e.out.clone()   # the next replay rewrites the graph's output
        if not e.trusted:
            want = e.plan.run(tensors)
            if not torch.equal(got, want):
                self._off("a replay differed from the direct sums")
                return want
            e.trusted = True
        return got

    def _off(self, why: str) -> None:
        self.disabled = why
        self.entries.clear()
        warnings.warn(f"myria: checksums without CUDA graphs from here on: {why}", stacklevel=3)


class _Entry:
    __slots__ = ("plan", "seen", "graph", "out", "trusted")

    def __init__(self, plan: _Plan):
        self.plan, self.seen, self.graph, self.out, self.trusted = plan, 0, None, None, False


def _cuda_capture(fn, device: torch.device):
    """(graph, output) of `fn` captured in a CUDA graph on a CUDA `device`, else None. The
    capture runs on a side stream that first waits for this thread's stream, and without
    `torch.cuda.graph`'s device synchronisation and emptying of the allocator's cache (a
    training step's memory would be allocated afresh after it). Other threads (the overlapped
    checkpoint's copy) go on launching their own work meanwhile."""
    if device.type != "cuda":
        return None
    graph = torch.cuda.CUDAGraph()
    here = torch.cuda.current_stream(device)
    side = torch.cuda.Stream(device)
    side.wait_stream(here)
    with torch.cuda.stream(side):
        graph.capture_begin(capture_error_mode="thread_local")
        try:
            out = fn()
        finally:
            graph.capture_end()
    here.wait_stream(side)
    return graph, out


_REPLAYS = _Replays(_cuda_capture)


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
