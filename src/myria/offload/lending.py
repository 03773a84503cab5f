"""Memory the update lends out while parameters are on disk (parallel.offload_params).

Two ledgers of OffloadedAdamW, each with its own lock:

- `HeldChunks`: updated chunks still in memory (being written, or written and their buffer not
  yet reused). The next forward may copy parameters from them instead of reading the file
  (`OffloadedAdamW.read_params`).
- `GradientLoan`: gradient memory lent to write-behind buffers. `room` is the gradient bytes the
  plan reserves minus the gradients alive minus the write-behind buffers: the update gives a
  gradient's bytes back once its last chunk is done, a chunk may then wait for its write in a
  buffer of its own (the ring slot reads on; written, the buffer is pooled), and backward,
  charging each unit's gradients before they exist, drops pooled buffers and waits for those
  being written before it takes more.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from myria.observe import events
from myria.offload.diskio import aligned_buffer
from myria.offload.pipeline import Pipeline


@dataclass
class Held:
    """An updated chunk still in memory: the next forward may copy parameters from it."""

    buf: torch.Tensor
    lock: threading.Lock = field(default_factory=threading.Lock)
    valid: bool = True


class HeldChunks:
    """{(generation, chunk): Held} of the chunks readable from memory."""

    def __init__(self) -> None:
        self._held: dict[tuple[int, int], Held] = {}
        self._lock = threading.Lock()

    def hold(self, key: tuple[int, int], buf: torch.Tensor) -> Held:
        entry = Held(buf)
        with self._lock:
            self._held[key] = entry
        return entry

    def get(self, key: tuple[int, int]) -> Held | None:
        return self._held.get(key)

    def unhold(self, key: tuple[int, int], entry: Held | None = None) -> None:
        """A chunk's buffer is about to hold something else: no longer read from memory.
        With `entry`: only that one (a newer entry of the same chunk stays readable)."""
        with self._lock:
            if entry is None:
                entry = self._held.pop(key, None)
            elif self._held.get(key) is entry:
                del self._held[key]
        if entry is not None:
            with entry.lock:
                entry.valid = False
                entry.buf = None

    def clear(self) -> None:
        for key in list(self._held):
            self.unhold(key)


class GradientLoan:
    """Gradient memory lent to write-behind buffers (module docstring). `cv` guards `room`,
    `extra` (bytes of write-behind buffers being written or pooled), `inflight` (being
    written) and `pool`; `charged` (tensors whose gradient is counted) belongs to the training
    thread."""

    def __init__(self, grad_bytes: list[int], held: HeldChunks, pipe: Pipeline):
        self.grad_bytes = grad_bytes     # tensor -> its gradient's bytes (0: no gradient)
        self.held = held
        self.pipe = pipe
        self.cv = threading.Condition()
        self.room = sum(grad_bytes)
        self.extra = 0
        self.inflight = 0
        self.pool: list[tuple[torch.Tensor, tuple[int, int], Held | None]] = []  # for reuse
        self.charged: set[int] = set()

    def charge(self, tensors: Iterable[int]) -> None:
        """Backward is about to produce (or has accumulated) the gradients of `tensors`: count
        each once, so their memory is free before they exist; drop pooled write-behind
        buffers, and wait for those being written, while they hold the memory it needs
        (exposed time, on the training thread's timeline)."""
        for t in tensors:
            if t not in self.charged and self.grad_bytes[t]:
                self._charge(t)

    def _charge(self, t: int) -> None:
        self.charged.add(t)
        dropped: list[tuple[tuple[int, int], Held | None]] = []
        t0, ev = 0.0, None
        with self.cv:
            self.room -= self.grad_bytes[t]
            while self.room < 0 and (self.pool or self.inflight):
                if self.pool:
                    dropped.append(self._drop_pooled())
                elif self.pipe.error is not None:
                    break
                else:
                    if ev is None:
                        t0 = time.perf_counter()
                        ev = events.current().begin("offload_wait", "offload")
                    self.cv.wait(0.5)
        for key, entry in dropped:
            self.held.unhold(key, entry)
        if ev is not None:
            events.current().end(ev)
            self.pipe.stats.room_wait_s += time.perf_counter() - t0

    def take_charged(self) -> set[int]:
        """The tensors charged since the last call (a step takes their gradients)."""
        taken, self.charged = self.charged, set()
        return taken

    def give_back(self, tensors: Iterable[int]) -> None:
        """The gradients of `tensors` are gone: their memory is room again."""
        n = sum(self.grad_bytes[t] for t in tensors)
        with self.cv:
            self.room += n
            self.cv.notify_all()

    def lend(self, n: int) -> torch.Tensor | None:
        """A buffer for a ring slot whose chunk then waits for its write off the ring: a pooled
        one, or a new one while the gradient memory given back allows; None otherwise."""
        with self.cv:
            if self.pool:
                buf, key, entry = self.pool.pop()
            elif self.room >= n:
                buf, key, entry = None, None, None
                self.room -= n
                self.extra += n
            else:
                return None
            self.inflight += 1
            st = self.pipe.stats
            st.behind_buffers += 1
            st.behind_peak_bytes = max(st.behind_peak_bytes, self.extra)
        if key is not None:
            self.held.unhold(key, entry)
        return buf if buf is not None else aligned_buffer(n)

    def pooled(self, key: tuple[int, int], buf: torch.Tensor, entry: Held | None) -> None:
        """Writer thread, a write-behind chunk written: its buffer is kept for reuse, and the
        chunk stays readable from it until then."""
        with self.cv:
            self.pool.append((buf, key, entry))
            self.inflight -= 1
            self.cv.notify_all()

    def _drop_pooled(self) -> tuple[tuple[int, int], Held | None]:
        """With `cv` held: free a pooled buffer's memory; returns its chunk's key and entry
        (the caller unholds it outside the lock, which frees the buffer)."""
        _, key, entry = self.pool.pop()
        n = self.pipe.buffers[0].numel()
        self.room += n
        self.extra -= n
        return key, entry

    def drop_pool(self) -> None:
        """Free every pooled buffer (the state they hold is being replaced)."""
        with self.cv:
            while self.pool:
                self._drop_pooled()
