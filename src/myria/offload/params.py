"""Parameters on disk too (parallel.offload_params): each layer read in for forward and backward.

With `offload = nvme` and `offload_params = true`, a parameter's home is the `param` section of
the optimizer's generation files (myria.offload.adamw), updated there in place of an fp32 master
copy. The fast tier holds at most a few *units* (the embeddings, one transformer block, the final
norm with the output layer) in aligned slabs: a unit is loaded before its forward (a forward
pre-hook, the next unit prefetched) and dropped after it, loaded again when backward reaches the
gradient of its output (a tensor hook) and dropped once every parameter of it has accumulated
its gradient. Dropping swaps `p.data` for an empty tensor, which keeps each Parameter object
(the optimizer's, autograd's) and its shape while autograd looks at it. Gradients stay in the
fast tier. All units are dropped before each optimizer step, and the next forward takes new
parameters from the update running behind it (`OffloadedAdamW.read_params`). The model is
materialised one unit at a time into generation 0. Use one microbatch per step (each microbatch
reads every unit twice). docs/offload.md, "Parameters on disk".
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from myria.offload.adamw import OffloadedAdamW, ReadBackMismatch, param_sum
from myria.offload.budget import PARAM_SLABS as SLABS
from myria.offload.diskio import aligned_buffer, full_io, round_up


@dataclass
class Unit:
    """Parameters loaded and dropped together, and where each lives in a slab."""

    name: str
    params: list[tuple[nn.Parameter, int, int]]   # (parameter, tensor index, slab offset)
    first: nn.Module                                # forward pre-hook
    last: nn.Module                                 # forward hook: the unit's output
    outputs: list[nn.Module] = field(default_factory=list)   # outputs whose grad starts it
    slab: int = -1
    ready: threading.Event | None = None            # set when its read is done
    accumulated: int = 0                            # parameters whose gradient arrived


def units_of(model: nn.Module) -> list[tuple[str, list[nn.Module]]]:
    """The model's units in forward order: embeddings, blocks, final norm + output layer."""
    out = []
    emb = [m for m in (model.tok_embeddings, getattr(model, "pos_embeddings", None)) if m]
    out.append(("embeddings", emb))
    for name, block in model.layers.items():
        out.append((f"layers.{name}", [block]))
    out.append(("head", [model.norm, model.output]))
    return out


def placeholders(model: nn.Module, device: torch.device) -> dict[int, tuple[int, ...]]:
    """Replace the meta model's parameters with empty CPU ones of the same rank (so `ndim`
    still tells weight decay which they are) and materialise its buffers; returns each new
    parameter's true shape by id."""
    shapes = {}
    for mod in model.modules():
        for name, p in list(mod._parameters.items()):
            if p is None:
                continue
            q = nn.Parameter(torch.empty((0,) * p.ndim, dtype=p.dtype, device=device),
                             requires_grad=p.requires_grad)
            mod._parameters[name] = q
            shapes[id(q)] = tuple(p.shape)
        for name, b in list(mod._buffers.items()):
            if b is not None and b.is_meta:
                mod._buffers[name] = torch.empty_like(b, device=device)
    return shapes


class ParamStreamer:
    """Loads and drops the units of one model part around forward and backward."""

    def __init__(self, model: nn.Module, opt: OffloadedAdamW, seed: int):
        self.opt = opt
        lay = opt.filemap
        self.section = lay.section("param") * lay.region
        index = {id(p): t for t, p in enumerate(opt.tensors)}
        self.units: list[Unit] = []
        for name, mods in units_of(model):
            params, off = [], 0
            for m in mods:
                for p in m.parameters():
                    t = index[id(p)]
                    params.append((p, t, off))
                    off += round_up(lay.numels[t] * lay.itemsizes[t])
            self.units.append(Unit(name, params, mods[0], mods[-1], mods))
        self.slab_bytes = max(self._bytes(u) for u in self.units)
        self.slabs = [aligned_buffer(self.slab_bytes) for _ in range(SLABS)]
        self._views = [memoryview(s.numpy()) for s in self.slabs]
        self.free = list(range(SLABS))
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.read_s = self.wait_s = 0.0
        self.waits: dict[str, float] = {}   # exposed wait per "forward|backward unit"
        self.bytes_read = 0
        self.bytes_copied = 0       # updated parameters taken from memory before their write
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="myria-offload-params",
                                        daemon=True)
        self._thread.start()
        self._materialise(model, seed)
        self._hooks(model)
        opt.before_step.append(self.drop_all)
        opt.after_step.append(self.prefetch_first)

    def _bytes(self, u: Unit) -> int:
        lay = self.opt.filemap
        return sum(round_up(lay.numels[t] * lay.itemsizes[t]) for _, t, _ in u.params)

    def _segments(self, u: Unit) -> list[tuple[int, int, int]]:
        """(file offset, slab offset, bytes) of each of the unit's parameters."""
        lay = self.opt.filemap
        return [(self.section + lay.offsets[t], off, round_up(lay.numels[t] * lay.itemsizes[t]))
                for _, t, off in u.params]

    # -- loading and dropping --------------------------------------------------------------
    def _attach(self, u: Unit) -> None:
        """Point the unit's parameters at their slab."""
        lay, slab = self.opt.filemap, self.slabs[u.slab]
        for p, t, off in u.params:
            n = lay.numels[t] * lay.itemsizes[t]
            p.data = slab[off:off + n].view(lay.dtypes[t]).view(lay.shapes[t])

    def prefetch(self, u: Unit) -> None:
        """Start reading `u` if it is not loaded or loading and a slab is free."""
        if u.slab >= 0 or not self.free:
            return
        u.slab = self.free.pop()
        u.ready = threading.Event()
        after = self.opt.computed_events({t for _, t, _ in u.params})
        self._jobs.put((u, after, self.opt.gen, self.opt.fd, self.opt.param_sums))

    def ensure(self, u: Unit, phase: str = "forward") -> None:
        """Make `u`'s parameters usable now."""
        if u.slab < 0:
            if not self.free:   # never in forward/backward order; drop what else is loaded
                for other in self.units:
                    if other is not u and other.slab >= 0:
                        self.drop(other)
            self.prefetch(u)
        t0 = time.perf_counter()
        u.ready.wait()
        dt = time.perf_counter() - t0
        self.wait_s += dt
        key = f"{phase} {u.name}"
        self.waits[key] = self.waits.get(key, 0.0) + dt
        if isinstance(self.error, ReadBackMismatch):
            # a write of the update that failed (a full disk) leaves other bytes on disk too:
            # that error is the cause, and its thread records it just after its call returns
            deadline = time.monotonic() + 1.0
            while time.monotonic() < deadline:
                self.opt.raise_if_failed()
                time.sleep(0.05)
            raise self.error
        if self.error is not None:
            raise self.opt.gens.error(self.error, f"reading the parameters of {u.name}")
        self.opt.raise_if_failed()   # the update behind training, if it failed
        self._attach(u)

    def drop(self, u: Unit) -> None:
        if u.slab < 0:
            return
        u.ready.wait()
        for p, _, _ in u.params:
            p.data = torch.empty((0,) * p.ndim, dtype=p.dtype, device=p.device)
        self.free.append(u.slab)
        u.slab, u.ready, u.accumulated = -1, None, 0

    def drop_all(self) -> None:
        """Before an optimizer step: every loaded unit is about to be out of date."""
        for u in self.units:
            self.drop(u)

    def prefetch_first(self) -> threading.Event | None:
        """After an optimizer step: start reading the units the next forward takes first, into
        every slab. Each read waits for its chunks' update and takes the new values from the
        update's buffers while they are not yet written (`read_params`): with the update run
        during backward those chunks (the first layers') are the last it computes, and waiting
        for the forward's own hook to ask for them left the forward's first layers waiting for
        the disk, behind the update's trailing writes. Returns an event set once they are in
        (the reads run in order), which the optimizer waits for before it reads ahead for the
        next update, so that its reads do not share the disk with these."""
        for u in self.units[:SLABS]:
            self.prefetch(u)
        return self.units[min(SLABS, len(self.units)) - 1].ready

    def _loop(self) -> None:
        while (job := self._jobs.get()) is not None:
            u, after, gen, fd, sums = job
            for ev in after:
                ev.wait()
            if self.error is None:
                t0 = time.perf_counter()
                try:
                    for off, soff, n in self._segments(u):
                        copied = self.opt.read_params(self.slabs[u.slab], self._views[u.slab],
                                                      soff, off, n, gen, fd)
                        self.bytes_copied += copied
                        self.bytes_read += n - copied
                    self._check(u, gen, sums)
                except BaseException as e:
                    self.error = e
                self.read_s += time.perf_counter() - t0
            u.ready.set()

    def _check(self, u: Unit, gen: int, sums: dict[int, int]) -> None:
        """Raise ReadBackMismatch unless each parameter of `u` read into its slab holds what
        the update that wrote generation `gen` computed (`OffloadedAdamW.param_sums`)."""
        lay, slab = self.opt.filemap, self.slabs[u.slab]
        for _, t, off in u.params:
            want = sums.get(t)
            isz = lay.itemsizes[t]
            if want is None or param_sum(slab[off:off + lay.numels[t] * isz].numpy(),
                                         isz) == want:
                continue
            raise ReadBackMismatch(
                f"offload directory {self.opt.dir}: parameter {t} of {u.name} in generation "
                f"{gen} read back differs from what the optimizer wrote (a storage or memory "
                "fault); training stopped before using it: run the same command to resume "
                "from the newest checkpoint")

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join(timeout=60)

    # -- setup -----------------------------------------------------------------------------
    @torch.no_grad()
    def _materialise(self, model: nn.Module, seed: int) -> None:
        """Initialise one unit at a time and write it to generation 0 (then drop it)."""
        model.init_weights(seed, buffers_only=True)   # RoPE tables
        names = {id(p): n for n, p in model.named_parameters()}
        self._write_units(lambda named: [model.init_parameter(n, p, seed)
                                         for n, p in named.items()], names)

    @torch.no_grad()
    def fill(self, model: nn.Module, read: Callable[[dict[str, torch.Tensor]], object]) -> None:
        """Replace the initial values in generation 0 with `read`'s, one unit at a time:
        `read({name: tensor})` fills the unit's parameters (named as `model.named_parameters`
        names them) in place. Only before the first step (the generation the update reads)."""
        if self.opt.gen != 0:
            raise RuntimeError("parameters on disk are filled before the first step only")
        self._write_units(read, {id(p): n for n, p in model.named_parameters()})

    def _write_units(self, fill, names: dict[int, str]) -> None:
        """For each unit: load a slab, `fill({name: parameter})`, write it to the current
        generation's file, drop it."""
        for u in self.units:
            u.slab = self.free.pop()
            u.ready = threading.Event()
            u.ready.set()
            self._attach(u)
            fill({names[id(p)]: p for p, _, _ in u.params})
            for off, soff, n in self._segments(u):
                full_io(os.pwritev, self.opt.fd, self._views[u.slab][soff:soff + n], off)
            lay, slab = self.opt.filemap, self.slabs[u.slab]
            for _, t, off in u.params:
                isz = lay.itemsizes[t]
                self.opt.param_sums[t] = param_sum(slab[off:off + lay.numels[t] * isz].numpy(),
                                                   isz)
            self.drop(u)
        os.fdatasync(self.opt.fd)

    def _hooks(self, model: nn.Module) -> None:
        last = len(self.units) - 1
        for i, u in enumerate(self.units):
            ahead = self.units[i + 1:i + SLABS]   # as many as the other slabs hold

            def pre(mod, args, u=u, ahead=ahead):
                self.ensure(u)
                for nxt in ahead:
                    self.prefetch(nxt)

            u.first.register_forward_pre_hook(pre)
            for m in u.outputs:
                def post(mod, args, out, u=u, i=i, m=m):
                    if isinstance(out, torch.Tensor) and out.requires_grad:
                        out.register_hook(lambda g, u=u, i=i: self._before_backward(u, i))
                    # backward needs the last block and the head right after forward
                    keep = torch.is_grad_enabled() and i >= last - 1
                    if m is u.last and not keep:
                        self.drop(u)

                m.register_forward_hook(post)
            for p, _, _ in u.params:
                p.register_post_accumulate_grad_hook(lambda p, u=u: self._accumulated(u))

    def _before_backward(self, u: Unit, i: int) -> None:
        self.opt.loan.charge(t for _, t, _ in u.params)   # room for its gradients first
        self.ensure(u, "backward")
        for below in reversed(self.units[max(0, i - SLABS + 1):i]):
            self.prefetch(below)   # in order, as far as free slabs allow

    def _accumulated(self, u: Unit) -> None:
        u.accumulated += 1
        if u.accumulated == len(u.params):
            self.drop(u)


def file_tensor(opt: OffloadedAdamW, t: int) -> torch.Tensor:
    """Parameter `t` as stored in the committed generation, memory-mapped read-only (for
    checkpoints: no copy in anonymous memory). Marked immutable: a generation file is never
    written again, so the checkpoint's snapshot stage can use it as it is."""
    lay = opt.filemap
    n = lay.numels[t]
    start = lay.section("param") * lay.region + lay.offsets[t]
    isz = lay.itemsizes[t]
    whole = torch.from_file(str(opt.gens.path(opt.gen)), shared=False,
                            size=(start + n * isz) // isz, dtype=lay.dtypes[t])
    v = whole[start // isz:start // isz + n].view(lay.shapes[t])
    v._myria_immutable = True
    return v

