"""The nvme tier's I/O pipeline: a reader and a writer thread around a ring of aligned buffers.

A reader thread runs ahead of the optimizer, reading chunk i+1, i+2, ... into free buffers while
the main thread updates chunk i, and a writer thread writes chunk i-1 back. When a step ends the
reader goes on prefetching the next step's first chunks (they depend only on this step's
writes), and the writer's last chunks trail into the next forward pass: the I/O hides behind
the optimizer's arithmetic and, as far as the buffers reach, behind forward and backward.
"""

from __future__ import annotations

import errno
import os
import queue
import threading
import time
from dataclasses import dataclass

import torch

from myria.observe import events
from myria.offload.diskio import aligned_buffer, full_io


@dataclass
class IOStats:
    """What the pipeline did: bytes, the threads' busy time, the optimizer's waits."""

    bytes_read: int = 0
    bytes_written: int = 0
    read_s: float = 0.0            # reader thread inside preadv
    write_s: float = 0.0           # writer thread inside pwritev and fdatasync
    wait_s: float = 0.0            # main thread blocked on a chunk not yet read (exposed I/O)
    step_s: float = 0.0            # main thread inside optimizer steps (incl. waits)
    behind_s: float = 0.0          # the update running behind training (asynchronous step)
    behind_wait_s: float = 0.0     # ... of it waiting for chunks (hidden from training)
    flush_s: float = 0.0           # main thread waiting for trailing writes (checkpoints, end)
    room_wait_s: float = 0.0       # backward waiting for write-behind buffers to drain
    behind_buffers: int = 0        # chunks written from a buffer of their own (write-behind)
    behind_peak_bytes: int = 0     # the most memory write-behind buffers held at once
    spec_confirmed: int = 0        # updates run during backward and kept (gradients not scaled)
    spec_cancelled: int = 0        # ... and dropped (clipped, skipped, gradients changed)
    spec_cancel_s: float = 0.0     # main thread stopping dropped speculations (exposed)
    spec_chunks_ahead: int = 0     # chunks a kept speculation had updated when step() came
    steps: int = 0


@dataclass
class Read:
    key: tuple
    fd: int
    segments: list[tuple[int, int, int]]   # (file offset, buffer offset, bytes)
    after: threading.Event | None = None   # the write this read depends on
    cancel: threading.Event | None = None  # set: skip the I/O (the read is not wanted any more)
    gate: threading.Event | None = None    # set: the disk is free for it (see step())


@dataclass
class Write:
    gen: int
    fd: int
    buffer: int                    # a ring slot, or -1: `view` is a buffer of its own
    segments: list[tuple[int, int, int]]
    done: threading.Event | None = None
    fail: bool = False             # the offload-diskfull fault hook
    view: memoryview | None = None
    finished: object = None        # called after the write (before the slot is freed)


class Pipeline:
    """A reader and a writer thread around a ring of aligned buffers.

    Reads run ahead as far as free buffers allow; the consumer takes them in order; writes
    trail and free their buffer when done. Any I/O error is kept, the threads keep draining
    their queues without I/O (nobody waits forever), and the consumer raises it."""

    def __init__(self, n_buffers: int, nbytes: int):
        self.buffers = [aligned_buffer(nbytes) for _ in range(n_buffers)]
        self._views = [memoryview(b.numpy()) for b in self.buffers]
        self._free: queue.SimpleQueue = queue.SimpleQueue()
        for i in range(n_buffers):
            self._free.put(i)
        self._reads: queue.SimpleQueue = queue.SimpleQueue()
        self._ready: queue.SimpleQueue = queue.SimpleQueue()
        self._writes: queue.SimpleQueue = queue.SimpleQueue()
        self.error: BaseException | None = None
        self.error_doing = ""              # what the thread was doing when it failed
        self.stats = IOStats()
        self.outstanding: list[tuple] = []   # keys of reads queued and not yet taken
        self._threads = [threading.Thread(target=self._read_loop, name="myria-offload-read",
                                          daemon=True),
                         threading.Thread(target=self._write_loop, name="myria-offload-write",
                                          daemon=True)]
        for th in self._threads:
            th.start()

    # main thread
    def read(self, job: Read) -> None:
        self.outstanding.append(job.key)
        self._reads.put(job)

    def take(self, key: tuple, exposed: bool = True) -> int:
        """The buffer holding read `key` (reads are taken in the order they were queued).
        `exposed`: the training thread waits (recorded on its timeline), not a thread behind it."""
        t0 = time.perf_counter()
        ev = None
        try:
            got, idx = self._ready.get_nowait()
        except queue.Empty:
            if exposed:
                ev = events.current().begin("offload_wait", "offload")
            got, idx = self._ready.get()
        events.current().end(ev)
        if exposed:
            self.stats.wait_s += time.perf_counter() - t0
        else:
            self.stats.behind_wait_s += time.perf_counter() - t0
        self.outstanding.pop(0)
        if got != key:
            raise RuntimeError(f"offload pipeline out of order: {got} != {key}")
        return idx

    def write(self, job: Write) -> None:
        self._writes.put(job)

    def swap(self, idx: int, new: torch.Tensor) -> tuple[torch.Tensor, memoryview]:
        """Give ring slot `idx` (taken, not free) buffer `new` and return its old one, which
        is then the caller's: a chunk can wait for its write there while the slot reads on."""
        old, view = self.buffers[idx], self._views[idx]
        self.buffers[idx] = new
        self._views[idx] = memoryview(new.numpy())
        return old, view

    def call(self, fn, doing: str) -> threading.Event:
        """Run `fn` on the writer thread after the writes queued before it; set when done."""
        done = threading.Event()
        self._writes.put((fn, done, doing))
        return done

    def release(self, idx: int) -> None:
        self._free.put(idx)

    def drain(self) -> None:
        """Drop the reads queued and not yet taken (their buffers go back to the ring)."""
        while self.outstanding:
            self.release(self.take(self.outstanding[0], exposed=False))

    def close(self) -> None:
        self._reads.put(None)
        self._writes.put(None)
        self._free.put(-1)
        for th in self._threads:
            th.join(timeout=60)

    # threads
    def _fail(self, e: BaseException, doing: str) -> None:
        if self.error is None:
            self.error, self.error_doing = e, doing

    def _read_loop(self) -> None:
        while (job := self._reads.get()) is not None:
            idx = self._free.get()
            if idx < 0:
                return
            if job.after is not None:
                job.after.wait()
            while job.gate is not None and not job.gate.wait(0.05):
                if job.cancel is not None and job.cancel.is_set():
                    break
            if self.error is None and not (job.cancel is not None and job.cancel.is_set()):
                t0 = time.perf_counter()
                try:
                    for off, boff, n in job.segments:
                        full_io(os.preadv, job.fd, self._views[idx][boff:boff + n], off)
                        self.stats.bytes_read += n
                except BaseException as e:
                    self._fail(e, f"reading generation {job.key[0]}")
                self.stats.read_s += time.perf_counter() - t0
            self._ready.put((job.key, idx))

    def _write_loop(self) -> None:
        while (job := self._writes.get()) is not None:
            if isinstance(job, tuple):  # a call
                fn, done, doing = job
                if self.error is None:
                    t0 = time.perf_counter()
                    try:
                        fn()
                    except BaseException as e:
                        self._fail(e, doing)
                    self.stats.write_s += time.perf_counter() - t0
                done.set()
                continue
            if self.error is None:
                t0 = time.perf_counter()
                try:
                    if job.fail:
                        raise OSError(errno.ENOSPC, "No space left on device (injected fault)")
                    view = job.view if job.view is not None else self._views[job.buffer]
                    for off, boff, n in job.segments:
                        full_io(os.pwritev, job.fd, view[boff:boff + n], off)
                        self.stats.bytes_written += n
                except BaseException as e:
                    self._fail(e, f"writing generation {job.gen}")
                self.stats.write_s += time.perf_counter() - t0
            job.view = None   # a buffer of its own is freed once written
            if job.finished is not None:
                job.finished()
            if job.buffer >= 0:
                self._free.put(job.buffer)
            if job.done is not None:
                job.done.set()
