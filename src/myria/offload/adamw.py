"""OffloadedAdamW: torch's AdamW with its moments (and, with offload_params, its fp32 parameters)
in generation files (myria.offload.generations), streamed through the I/O pipeline's ring of
buffers (myria.offload.pipeline).

Same bits as in memory: each chunk is updated by torch's own functional Adam
(`torch.optim.adam.adam`, what AdamW.step calls) with each param group's exact settings; every
operation in it is elementwise with per-tensor scalars, and the step count is incremented once
per tensor. With the parameters on disk the update runs behind training (`read_params` serves
the next forward) and, when the last step's clipping did not bind, starts during the last
backward (`before_last_backward`): a bet `step()` keeps if no gradient was scaled or changed and
drops otherwise, the update then rerunning from `step()` into the same uncommitted file.
docs/offload.md, "How the nvme tier works".
"""

from __future__ import annotations

import bisect
import json
import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch
from torch.optim.adam import adam
from torch.optim.optimizer import _get_scalar_dtype

from myria.errors import CheckpointError, OffloadError
from myria.fsutil import atomic_write_json
from myria.offload.diskio import full_io
from myria.offload.files import Chunk, FileMap
from myria.offload.generations import Generations
from myria.offload.lending import GradientLoan, HeldChunks
from myria.offload.pipeline import Pipeline, Read, Write
from myria.offload.procmem import current_rss, peak_rss
from myria.offload.update import Update, adam_kwargs
from myria.tensors import local_grad, local_shard, placed_as_param

log = logging.getLogger("myria")


class ReadBackMismatch(OffloadError):
    """A chunk read back from the offload directory is not what the optimizer wrote (a fault of
    the storage or memory on the way): exit 1, so the supervisor restarts the run."""

    exit_code = 1


def _bytes_sum(a: np.ndarray) -> int:
    """The wrapping sum of the 64-bit words of the bytes `a` (its tail bytes added alone)."""
    n = len(a)
    return int(a[:n - n % 8].view(np.int64).sum(dtype=np.int64)) + \
        int(a[n - n % 8:].sum(dtype=np.int64))


_MASK = (1 << 64) - 1
_INT = {1: np.int8, 2: np.int16, 4: np.int32, 8: np.int64}


def param_sum(a: np.ndarray, itemsize: int) -> int:
    """The checksum of parameter bytes `a` (whole elements of `itemsize` bytes): the sum of
    their bit patterns as integers, modulo 2**64, so that a tensor's is the sum of its pieces'
    (any one flipped bit changes it)."""
    return int(a.view(_INT[itemsize]).sum(dtype=np.int64)) & _MASK


def _flat(t: torch.Tensor) -> torch.Tensor:
    """A flat view of `t` (in-place updates through it reach `t`)."""
    if not t.is_contiguous():
        raise RuntimeError("the nvme tier needs contiguous parameters and gradients")
    return t.view(-1)


class OffloadedAdamW(torch.optim.AdamW):
    """torch.optim.AdamW whose moments (and optionally master parameters) live in generation
    files (module docstring). `state[p]` holds only `step`, so `state_dict()` and DCP
    checkpoints carry the steps and the hyperparameters; the files go into checkpoints by
    `checkpoint_files()` and come back by `load_files()`."""

    def __init__(self, groups: list[dict], directory: Path, *, lr: float, betas, eps: float,
                 foreach: bool, buffers: int, chunk_bytes: int, direct: bool,
                 offload_params: bool = False, faults=None, stats_file: Path | None = None,
                 budget: float = 0.0, shapes: list[tuple[int, ...]] | None = None,
                 order: list[int] | None = None):
        super().__init__(groups, lr=lr, betas=betas, eps=eps, foreach=foreach)
        self.tensors = [p for g in self.param_groups for p in g["params"]]
        self.group_of = [i for i, g in enumerate(self.param_groups) for _ in g["params"]]
        scalar = _get_scalar_dtype()
        for p in self.tensors:   # filled now, so DCP's state-dict helpers see a live state
            self.state[p]["step"] = torch.tensor(0.0, dtype=scalar)
        sections = ("param", "exp_avg", "exp_avg_sq") if offload_params else \
            ("exp_avg", "exp_avg_sq")
        shapes = shapes or [tuple(local_shard(p).shape) for p in self.tensors]
        self.filemap = FileMap([(s, p.dtype) for s, p in zip(shapes, self.tensors)], sections,
                               order)
        self.chunk_bytes = chunk_bytes
        self.chunks = self.filemap.chunks(chunk_bytes)
        self._chunks_of: dict[int, list[int]] = {}
        for c, chunk in enumerate(self.chunks):
            for pc in chunk.pieces:
                self._chunks_of.setdefault(pc.index, []).append(c)
        self._written: list[threading.Event] | None = None  # the last step's chunk writes
        self._tensors_in = [sorted({pc.index for pc in chunk.pieces}) for chunk in self.chunks]
        self._starts = [c.start for c in self.chunks]
        # parameters on disk: chunks updated and not yet written, readable from memory
        self._computed: list[threading.Event] | None = None
        self.held = HeldChunks()
        self.before_step: list = []     # called first in each step (parameter offload)
        self.after_step: list = []      # then, the new generation current; an Event it
        # returns gates the next update's reads (same)
        self.streamer = None            # myria.offload.params.ParamStreamer
        self.direct = direct
        self.faults = faults
        self.stats_file = stats_file
        self.budget = budget
        self.offload_params = offload_params
        self.pipe = Pipeline(buffers, chunk_bytes * len(sections))
        self.loan = GradientLoan([n * isz if p.requires_grad else 0 for n, isz, p in
                                  zip(self.filemap.numels, self.filemap.itemsizes, self.tensors)],
                                 self.held, self.pipe)
        self._committed: threading.Event | None = None
        self._queued: str | None = None    # reads of the next update queued: forward | reverse
        self._reads_cancel = threading.Event()
        self._closed = False
        # Parameters on disk: the update runs during the last backward when the gradients are
        # not expected to be clipped (the last step's were not), and is kept if they were not.
        self.speculate = True
        self._speculate_next = True
        self._spec: Update | None = None
        # parameters on disk: the update runs behind training (step); its end and its error
        self.asynchronous = offload_params
        self._behind: threading.Event | None = None
        self._behind_error: BaseException | None = None
        if offload_params:
            for t, p in enumerate(self.tensors):
                if p.requires_grad:
                    p.register_post_accumulate_grad_hook(lambda p, t=t: self._final(t))
        self.gens = Generations(directory, self.filemap, direct)
        # chunk -> checksum of the current generation's bytes as the optimizer wrote them; empty
        # for a generation this process did not write (the first, or one a checkpoint restored,
        # whose manifest's CRC-32s were verified when it was loaded)
        self._sums: dict[int, tuple] = {}
        # with the parameters on disk: tensor -> `param_sum` of its parameter in the current
        # generation, complete once its chunks are updated (computed_events); the parameter
        # streamer checks each read against it (empty: a restored generation)
        self.param_sums: dict[int, int] = {}
        self.gen = 0
        self.fd = self.gens.create(0)
        self.gens.write_index(0)
        self._committed = threading.Event()
        self._committed.set()

    @property
    def dir(self) -> Path:
        return self.gens.dir

    # -- the step ------------------------------------------------------------------------
    def _segments(self, chunk: Chunk) -> list[tuple[int, int, int]]:
        n = chunk.stop - chunk.start
        return [(s * self.filemap.region + chunk.start, s * self.chunk_bytes, n)
                for s in range(len(self.filemap.sections))]

    def _queue_reads(self, gen: int, fd: int, after: list[threading.Event] | None,
                     order: str = "forward", gate: threading.Event | None = None) -> None:
        """Queue the reads of generation `gen`'s chunks for the next update, in its order;
        none starts before `gate` is set."""
        self._reads_cancel = cancel = threading.Event()
        cs = range(len(self.chunks))
        for c in (cs if order == "forward" else reversed(cs)):
            self.pipe.read(Read((gen, c), fd, self._segments(self.chunks[c]),
                                after[c] if after else None, cancel, gate))
            gate = None   # one reader takes them in order: the first waits for all
        self._queued = order

    def _drop_reads(self) -> None:
        """Drop the reads queued and not taken (those not done yet skip their I/O)."""
        self._reads_cancel.set()
        self.pipe.drain()
        self._queued = None

    def raise_if_failed(self) -> None:
        """The I/O threads' or the update's error, as one OffloadError."""
        if self.pipe.error is not None:
            raise self.gens.error(self.pipe.error, self.pipe.error_doing)
        if self._behind_error is not None:
            e = self._behind_error
            raise e if isinstance(e, OffloadError) else self.gens.error(e, "updating") from None

    def _new_update(self, settings: list[dict], speculative: bool) -> Update:
        g, new = self.gen, self.gen + 1
        fd = self.gens.file_for(new)
        n = len(self.chunks)
        u = Update(g=g, new=new, fd=fd, old_fd=self.fd,
                   before={t: self.state[p]["step"] for t, p in enumerate(self.tensors)},
                   settings=settings, grads={},
                   order=list(reversed(range(n))) if speculative else list(range(n)),
                   written=[threading.Event() for _ in range(n)],
                   computed=[threading.Event() for _ in range(n)]
                   if self.offload_params else None,
                   left=[len(self._chunks_of.get(t, ())) for t in range(len(self.tensors))],
                   expect=self._sums,
                   kill=self.faults.due("offload-kill", new) if self.faults else None,
                   full=self.faults.due("offload-diskfull", new) if self.faults else None)
        if speculative:
            u.confirmed = False
            u.ready = [threading.Event() for _ in range(n)]
            u.waiting = [sum(1 for t in ts if self.loan.grad_bytes[t]) for ts in self._tensors_in]
            for c, w in enumerate(u.waiting):
                if not w:
                    u.ready[c].set()
        return u

    @torch.no_grad()
    def step(self, closure=None):  # noqa: ARG002 (the Optimizer signature)
        """Update every chunk: now (moments on disk, parameters in memory), or, when the
        parameters are on disk too (`asynchronous`), on a thread behind training.

        Behind training: everything the update reads is fixed here (the gradients, the step
        counts, each group's settings with this step's learning rate) and the step counts
        advance now; the chunks are read, updated and written by a thread while the caller goes
        on. The next forward loads each unit's new parameters once their chunks are updated
        (`computed_events`, `read_params`), so it follows the update chunk by chunk, and the
        optimizer's reads, updates and writes overlap with it instead of preceding it: the same
        arithmetic on the same values, so the same bits.

        If an update already ran during backward (`before_last_backward`) on these very gradients
        (none scaled by clipping or changed since, same settings), it is kept and goes on
        behind training; otherwise it is dropped and the update starts here."""
        if closure is not None:
            raise ValueError("OffloadedAdamW.step takes no closure")
        t0 = time.perf_counter()
        self.wait_behind()
        self.raise_if_failed()
        for fn in self.before_step:
            fn()
        settings = [adam_kwargs(group) for group in self.param_groups]
        grads = {t: _flat(local_grad(p)) for t, p in enumerate(self.tensors)
                 if p.grad is not None}
        taken = self.loan.take_charged()
        unused = [t for t in taken if t not in grads]   # charged, and no gradient came
        if unused:
            self.loan.give_back(unused)
        u = self._spec
        if u is not None and not (u.settings == settings and set(u.ptr) <= set(grads) and
                                  all(grads[t].data_ptr() == a for t, a in u.ptr.items())):
            self._cancel()
            u = None
        if u is not None:   # the speculation holds: it goes on behind training
            self._spec = None
            for t in grads:
                if t not in u.ptr:   # no hook told of it: its chunks are still waiting
                    u.grads[t] = grads[t]
            with self.loan.cv:
                u.taken, u.confirmed = taken, True
                self.loan.room += sum(self.loan.grad_bytes[t] for t in u.used if t in taken)
                self.loan.cv.notify_all()
            for ev in u.ready:
                ev.set()
            u.decided.set()
            self.pipe.stats.spec_confirmed += 1
            self.pipe.stats.spec_chunks_ahead += u.updated
        else:
            u = self._new_update(settings, speculative=False)
            u.grads, u.taken = grads, taken
            if self._queued != "forward":
                if self._queued is not None:
                    self._drop_reads()
                self._queue_reads(u.g, self.fd, self._written, "forward")
        for t in grads:   # what adam's own `step += 1` gives each tensor's count
            self.state[self.tensors[t]]["step"] = u.before[t] + 1
        self.gen, self.fd, self._written, self._computed = u.new, u.fd, u.written, u.computed
        self._sums, self.param_sums = u.sums, u.psums
        if self.asynchronous:
            self._behind = u.done
            if u.ready is None:
                threading.Thread(target=self._run_behind, args=(u,),
                                 name="myria-offload-step", daemon=True).start()
        else:
            self._update_all(u)
        # the next forward's first parameters (offload_params): their reads start now
        gates = [ev for fn in self.after_step if (ev := fn()) is not None]
        # prefetch the next update's first chunks, in the order it will take them, once those
        # parameters are in: the next update needs its chunks a forward later at the earliest
        nxt = "reverse" if self.asynchronous and self.speculate and self._speculate_next \
            else "forward"
        self._queue_reads(u.new, u.fd, u.written, nxt, gates[0] if gates else None)
        self.pipe.stats.step_s += time.perf_counter() - t0
        self.pipe.stats.steps += 1
        self._write_stats()

    # -- speculation: the update during the last backward -----------------------------------
    def before_last_backward(self) -> None:
        """The engine is about to run the step's last backward: with the parameters on disk,
        start updating each chunk as soon as its gradients are final (`_final`), on the bet
        that clipping will leave them as they are (it did last step). `step()` keeps the
        result; clipping (`on_clip`), a changed gradient (`on_grads_changed`) or a skipped
        step drop it, and the update then runs as without speculation."""
        if not (self.asynchronous and self.speculate and self._speculate_next) \
                or self._spec is not None or self._closed:
            return
        if self._queued == "forward":   # the last step did not expect this
            return
        self.raise_if_failed()
        if self._queued is None:
            self._queue_reads(self.gen, self.fd, self._written, "reverse")
        u = self._new_update([adam_kwargs(group) for group in self.param_groups],
                             speculative=True)
        u.after, self._spec = self._behind, u
        threading.Thread(target=self._run_behind, args=(u,), name="myria-offload-speculate",
                         daemon=True).start()

    def _final(self, t: int) -> None:
        """Backward (post-accumulate hook): tensor `t`'s gradient has accumulated."""
        self.loan.charge((t,))
        u = self._spec
        p = self.tensors[t]
        # parameters on disk (the one mode that speculates) run without tensor parallelism,
        # so gradients here are placed as their parameters; one that were not would need a
        # collective to become this rank's part (`local_grad`), which backward's hooks must not
        # run: `step` would take it
        if u is None or u.cancelled or t in u.ptr or p.grad is None or not placed_as_param(p):
            return
        flat = _flat(local_shard(p.grad))
        u.grads[t], u.ptr[t] = flat, flat.data_ptr()
        for c in self._chunks_of.get(t, ()):
            u.waiting[c] -= 1
            if u.waiting[c] == 0:
                u.ready[c].set()

    def on_clip(self, scaled: bool) -> None:
        """The engine's clip: the gradients are about to be scaled (or not). Scaled: a
        speculation stops before they change and is dropped; the next step speculates only if
        this one was not clipped."""
        if scaled:
            self._cancel()
        self._speculate_next = not scaled

    def on_grads_changed(self) -> None:
        """Something changed gradients after backward (a fault injected into one): a
        speculation computed from them is dropped."""
        self._cancel()

    def _cancel(self) -> None:
        """Stop and drop the speculation: its thread ends, its writes finish (into a file that
        is never committed, reused by the next update), its chunks are no longer readable."""
        u = self._spec
        if u is None:
            return
        t0 = time.perf_counter()
        self._spec = None
        u.cancelled = True
        self._reads_cancel.set()
        for ev in u.ready:
            ev.set()
        u.decided.set()
        u.done.wait()
        self.pipe.call(lambda: None, "finishing dropped writes").wait()
        for c in range(len(self.chunks)):
            self.held.unhold((u.new, c))
        self._drop_reads()
        self.gens.discard(u.new, u.fd)
        self.pipe.stats.spec_cancelled += 1
        self.pipe.stats.spec_cancel_s += time.perf_counter() - t0

    def _used_up(self, u: Update, t: int) -> None:
        """Every chunk of tensor `t` is updated: its gradient's memory goes back (once the
        update is confirmed: a dropped speculation's gradients are used again)."""
        if u.grads.pop(t, None) is None:
            return
        with self.loan.cv:
            if not u.confirmed:
                u.used.append(t)
            elif t in u.taken:
                self.loan.room += self.loan.grad_bytes[t]
                self.loan.cv.notify_all()

    def _update_all(self, u: Update) -> None:
        """Read, update and write every chunk of generation `u.g` into `u.new`, then commit.

        With the parameters on disk each updated chunk stays readable from memory until it is
        written (`computed`, `read_params`), and, while gradient memory given back allows, waits
        for its write in a buffer of its own so that its ring slot reads on."""
        exposed = not self.asynchronous
        half = len(u.order) // 2
        for i, c in enumerate(u.order):
            chunk = self.chunks[c]
            idx = self.pipe.take((u.g, c), exposed)
            if u.ready is not None:
                u.ready[c].wait()
            if u.cancelled:
                self.pipe.release(idx)
                return
            try:
                self.raise_if_failed()
                self._check_read(u, c, self.pipe.buffers[idx])
                self._update(chunk, self.pipe.buffers[idx], u.before, u.grads, u.settings)
                u.sums[c] = self._chunk_sum(c, self.pipe.buffers[idx])
                if self.offload_params:
                    self._add_param_sums(u.psums, chunk, self.pipe.buffers[idx])
            except BaseException:
                self.pipe.release(idx)
                raise
            u.updated += 1
            fail = u.full is not None and i == half
            if fail:
                self.faults.mark(u.full)
            key, nbytes = (u.new, c), self.pipe.buffers[idx].numel()
            entry = None
            if u.computed is not None:
                entry = self.held.hold(key, self.pipe.buffers[idx])
                u.computed[c].set()
            segs = self._segments(chunk)
            spare = self.loan.lend(nbytes) if self.asynchronous and u.confirmed else None
            if spare is not None:
                old, view = self.pipe.swap(idx, spare)
                self.pipe.release(idx)
                job = Write(u.new, u.fd, -1, segs, u.written[c], fail, view=view,
                            finished=lambda key=key, b=old, e=entry: self.loan.pooled(key, b, e))
                del view, old, spare
            else:
                job = Write(u.new, u.fd, idx, segs, u.written[c], fail,
                            finished=(lambda key=key, e=entry: self.held.unhold(key, e))
                            if entry is not None else None)
            self.pipe.write(job)
            del job, entry
            for t in self._tensors_in[c]:
                u.left[t] -= 1
                if u.left[t] == 0:
                    self._used_up(u, t)
            if u.kill is not None and i == half:
                u.written[c].wait()   # a half-written generation on disk, then die
                self.faults.mark(u.kill)
                os.kill(os.getpid(), signal.SIGKILL)
        if u.ready is not None:   # a speculation commits only once step() has kept it
            u.decided.wait()
            if u.cancelled:
                return
        self._committed = self.pipe.call(lambda: self.gens.commit(u.new, u.fd, u.old_fd, u.g),
                                         f"committing generation {u.new}")

    def _chunk_sum(self, c: int, buf: torch.Tensor) -> tuple:
        """The exact checksum (wrapping 64-bit sums) of chunk `c`'s sections in `buf`."""
        return tuple(_bytes_sum(buf[boff:boff + n].numpy())
                     for _, boff, n in self._segments(self.chunks[c]))

    def _add_param_sums(self, psums: dict[int, int], chunk: Chunk, buf: torch.Tensor) -> None:
        """Add the `param_sum` of each parameter piece of `chunk` (updated, in `buf`)."""
        base = self.filemap.section("param") * self.chunk_bytes
        for pc in chunk.pieces:
            isz = self.filemap.itemsizes[pc.index]
            at = base + pc.offset
            s = param_sum(buf[at:at + (pc.stop - pc.start) * isz].numpy(), isz)
            psums[pc.index] = (psums.get(pc.index, 0) + s) & _MASK

    def _file_differs(self, path: Path, sums: dict[int, tuple]) -> str:
        """Why the generation file at `path` does not hold the chunks whose checksums the
        update that wrote it took (`sums`), "" when it does (or when there are none)."""
        if not sums:
            return ""
        fd = os.open(path, os.O_RDONLY)
        try:
            for c, want in sorted(sums.items()):
                got = tuple(_bytes_sum(np.frombuffer(os.pread(fd, n, off), dtype=np.uint8))
                            for off, _, n in self._segments(self.chunks[c]))
                if got != want:
                    return (f"chunk {c} differs from what the optimizer wrote (a storage "
                            "fault between its write and the checkpoint)")
        finally:
            os.close(fd)
        return ""

    def _check_read(self, u: Update, c: int, buf: torch.Tensor) -> None:
        """Raise ReadBackMismatch unless chunk `c` of generation `u.g`, read into `buf`, holds
        what the update that wrote it computed (nothing to check in a generation this process
        did not write)."""
        want = u.expect.get(c)
        if want is None or self._chunk_sum(c, buf) == want:
            return
        raise ReadBackMismatch(
            f"offload directory {self.dir}: chunk {c} of generation {u.g} read back differs "
            "from what the optimizer wrote (a storage or memory fault); training stopped before "
            "using it: run the same command to resume from the newest checkpoint")

    def _run_behind(self, u: Update) -> None:
        """The update on its thread: an error is kept for the training thread, and every
        chunk is marked written so that nothing waits for it forever."""
        t0 = time.perf_counter()
        try:
            if u.after is not None:
                u.after.wait()
            with torch.no_grad():   # grad mode is per thread
                self._update_all(u)
        except BaseException as e:
            if not u.cancelled:
                self._behind_error = e
            for ev in u.written + (u.computed or []):
                ev.set()
        finally:
            self.pipe.stats.behind_s += time.perf_counter() - t0
            u.done.set()

    # -- gradients dropped, parameters read ------------------------------------------------
    def zero_grad(self, set_to_none: bool = True) -> None:
        self._cancel()   # no step took the gradients (a skipped step): nor does a speculation
        if set_to_none and self.loan.charged:   # dropped without a step (a skipped step)
            self.loan.give_back(self.loan.take_charged())
        super().zero_grad(set_to_none)

    def computed_events(self, tensors: set[int]) -> list[threading.Event]:
        """The last step's updates of the chunks holding `tensors` (to read them after)."""
        if self._computed is None:
            return []
        return [self._computed[c] for c in sorted({c for t in tensors
                                                    for c in self._chunks_of.get(t, ())})]

    def read_params(self, slab: torch.Tensor, view: memoryview, soff: int, off: int, n: int,
                    gen: int, fd: int) -> int:
        """Fill slab bytes [soff, soff + n) with the parameter bytes at file offset `off` of
        generation `gen` (after `computed_events`): copied from the update's buffer where the
        chunk is not written yet, else read from the file. Returns the bytes copied."""
        s = self.filemap.section("param")
        base = s * self.filemap.region
        x, end, copied = off - base, off - base + n, 0
        while x < end:
            c = bisect.bisect_right(self._starts, x) - 1
            chunk = self.chunks[c]
            m = min(end, chunk.stop) - x
            at = soff + x - (off - base)
            entry = self.held.get((gen, c))
            done = False
            if entry is not None:
                with entry.lock:
                    if entry.valid:
                        b = s * self.chunk_bytes + x - chunk.start
                        slab[at:at + m].copy_(entry.buf[b:b + m])
                        done = True
            if done:
                copied += m
            else:
                full_io(os.preadv, fd, view[at:at + m], base + x)
            x += m
        return copied

    def wait_behind(self) -> None:
        """Wait for an update running behind training (exposed time: the caller waits)."""
        if self._behind is not None and not self._behind.is_set():
            t0 = time.perf_counter()
            self._behind.wait()
            self.pipe.stats.wait_s += time.perf_counter() - t0

    def _update(self, chunk: Chunk, buf: torch.Tensor, before: dict, grads: dict,
                settings: list[dict]) -> None:
        """AdamW on the pieces of `chunk` whose moments are in `buf`, group by group."""
        lists: dict[int, tuple[list, list, list, list, list]] = {}
        s_param = self.filemap.section("param") if self.offload_params else -1
        s_m, s_v = self.filemap.section("exp_avg"), self.filemap.section("exp_avg_sq")
        for pc in chunk.pieces:
            if pc.index not in grads:
                continue
            p = self.tensors[pc.index]
            dtype, isz = self.filemap.dtypes[pc.index], self.filemap.itemsizes[pc.index]
            n = (pc.stop - pc.start) * isz

            def view(s: int, at: int = pc.offset, n: int = n, dtype=dtype) -> torch.Tensor:
                at += s * self.chunk_bytes
                return buf[at:at + n].view(dtype)

            param = view(s_param) if s_param >= 0 else \
                _flat(local_shard(p).detach())[pc.start:pc.stop]
            grad = grads[pc.index][pc.start:pc.stop]
            step = before[pc.index].clone()
            ls = lists.setdefault(self.group_of[pc.index], ([], [], [], [], []))
            for lst, x in zip(ls, (param, grad, view(s_m), view(s_v), step)):
                lst.append(x)
        for gi, (params, grads_, m, v, steps) in lists.items():
            adam(params, grads_, m, v, [], steps, **settings[gi])

    def flush(self) -> None:
        """Wait for the trailing writes of the last step (its generation is then committed)."""
        t0 = time.perf_counter()
        if self._behind is not None:
            self._behind.wait()
        if self._committed is not None:
            self._committed.wait()
        self.pipe.stats.flush_s += time.perf_counter() - t0
        self.raise_if_failed()

    # -- checkpoints ---------------------------------------------------------------------
    def checkpoint_files(self, prefix: str) -> dict[str, Path]:
        """{name in the checkpoint: file} of the committed state (after flushing)."""
        self.flush()
        return {f"{prefix}.bin": self.gens.path(self.gen),
                f"{prefix}.json": self.gens.path(self.gen, ".json")}

    def checkpoint_checks(self, prefix: str) -> dict[str, Callable[[Path], str]]:
        """{name in the checkpoint: a check of that file} for the files `checkpoint_files`
        names: each says why the file, read back, is not what the optimizer wrote ("" when it
        is), against the checksums of the current generation taken now."""
        sums = dict(self._sums)
        return {f"{prefix}.bin": lambda path: self._file_differs(path, sums)}

    def load_files(self, ckpt: Path, prefix: str) -> None:
        """Make the checkpoint's state files this optimizer's current generation."""
        src, idx = ckpt / f"{prefix}.bin", ckpt / f"{prefix}.json"
        if not src.exists() or not idx.exists():
            raise CheckpointError(f"checkpoint {ckpt} has no offloaded optimizer state "
                                  f"{prefix}.bin: it was saved with another parallel.offload "
                                  "setting or layout; resume with the settings it was saved with")
        info = json.loads(idx.read_text())
        want = self.filemap.to_json()
        if {k: info.get(k) for k in want} != want:
            raise CheckpointError(
                f"checkpoint {ckpt}: the offloaded optimizer state {prefix}.bin was saved for "
                "other local tensors (another layout, model or parallel.offload_params); "
                f"resume with the layout it was saved with{_saved_layout(ckpt)}")
        self._cancel()
        self.flush()
        for fn in self.before_step:   # parameters loaded or loading are of the replaced state
            fn()
        self._drop_reads()
        self.gens.drop_spare()
        self._written = self._computed = None
        self.loan.drop_pool()   # chunks kept in memory are of the state being replaced
        self.held.clear()
        gen = int(info["gen"])
        self.fd, how = self.gens.restore(src, gen, self.gen, self.fd)
        self.gen, self._sums, self.param_sums = gen, {}, {}
        log.debug("offload: restored generation %d from %s (%s)", gen, src, how)

    def close(self) -> None:
        """Finish the trailing writes and stop the threads (idempotent, never raises)."""
        if self._closed:
            return
        self._closed = self.gens.closed = True
        try:
            self._cancel()
            self.gens.drop_spare()
            if self._behind is not None:
                self._behind.wait()
            if self._committed is not None:
                self._committed.wait()
        finally:
            self.pipe.close()
            if self.streamer is not None:
                self.streamer.close()
            if self.fd >= 0:
                os.close(self.fd)
                self.fd = -1
            self._write_stats()

    def _write_stats(self) -> None:
        if self.stats_file is None:
            return
        s = asdict(self.pipe.stats)
        s.update(gen=self.gen, direct=self.direct, buffers=len(self.pipe.buffers),
                 buffer_bytes=self.pipe.buffers[0].numel(), chunks=len(self.chunks),
                 file_bytes=self.filemap.file_bytes, budget_bytes=self.budget,
                 peak_rss_bytes=peak_rss(), rss_bytes=current_rss(), time=time.time())
        try:
            self.stats_file.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_json(self.stats_file, s, durable=False)
        except OSError:
            pass


def _saved_layout(ckpt: Path) -> str:
    """", " + the degrees a checkpoint's meta.json records (its processes and their
    non-trivial degrees, as --parallel.* settings); "" when it records none."""
    try:
        meta = json.loads((Path(ckpt) / "meta.json").read_text())
        lay = meta["layout"]
        degrees = " ".join(f"--parallel.{k}={v}" for k, v in lay.items()
                           if k in ("dp_replicate", "dp_shard", "tp", "pp", "cp", "ep", "vpp")
                           and isinstance(v, int) and v > 1)
        return f": {meta['world_size']} process(es){', ' + degrees if degrees else ''}"
    except (OSError, ValueError, KeyError, TypeError):
        return ""
