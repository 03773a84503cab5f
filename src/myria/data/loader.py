"""Per-rank batch iterator over a TokenDataset: background prefetch thread, resumable state.

`BatchLoader` yields, for optimizer steps start_step, start_step+1, ..., this data-parallel
rank's share of the global batch (see `myria.data.dataset` for the order rule) shaped as
[microbatches, micro_batch, seq_len] inputs and targets. Which microbatches of the step are
this rank's is the layout's rule (`myria.layout.Layout.share`, passed in; by default the
dp_rank-th of equal shares): the loader only reads them.
Batches depend only on (seed, step, global_batch, dataset), so `state_dict()` (the next step)
is all a checkpoint needs, and prefetching never changes what is produced.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from myria.data.dataset import TokenDataset, global_batch_indices, rank_batch_indices
from myria.errors import ConfigError

__all__ = ["Batch", "BatchLoader", "global_batch_indices", "rank_batch_indices"]


@dataclass
class Batch:
    """One optimizer step's data for this rank."""

    step: int
    inputs: torch.Tensor   # int64 [microbatches, micro_batch, seq_len]
    targets: torch.Tensor  # int64 [microbatches, micro_batch, seq_len], inputs shifted by one
    indices: np.ndarray    # sample indices, [microbatches * micro_batch]

    @property
    def tokens(self) -> int:
        return int(self.inputs.numel())


class _Failure:
    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


class BatchLoader:
    """Iterator of `Batch`es for one data-parallel rank, prefetched by a daemon thread.

    `prefetch` = number of batches kept ready (0 = build each batch synchronously in `next`).
    `pop_wait_time()` returns the seconds the caller spent blocked in `next` since the last
    call (the data-loading stall) and resets it.
    """

    def __init__(self, dataset: TokenDataset, global_batch: int, micro_batch: int,
                 dp_rank: int = 0, dp_size: int = 1, seed: int = 0, start_step: int = 0,
                 prefetch: int = 2, device: str | torch.device = "cpu",
                 microbatches: range | None = None) -> None:
        if micro_batch < 1 or global_batch < 1:
            raise ConfigError(f"global_batch ({global_batch}) and micro_batch ({micro_batch}) "
                              "must be >= 1")
        if dp_size < 1 or not 0 <= dp_rank < dp_size:
            raise ConfigError(f"dp_rank = {dp_rank} must be in [0, dp_size = {dp_size})")
        if prefetch < 0:
            raise ConfigError(f"prefetch = {prefetch}: must be >= 0")
        if start_step < 0:
            raise ConfigError(f"start_step = {start_step}: must be >= 0")
        self.dataset = dataset
        self.global_batch, self.micro_batch = int(global_batch), int(micro_batch)
        self.dp_rank, self.dp_size = int(dp_rank), int(dp_size)
        self.seed = int(seed)
        if microbatches is None:   # the dp_rank-th of dp_size equal shares
            if global_batch % (dp_size * micro_batch):
                raise ConfigError(f"global_batch ({global_batch}) is not divisible by dp_size "
                                  f"({dp_size}) x micro_batch ({micro_batch}); pass this rank's "
                                  "microbatches (myria.layout.Layout.share)")
            per = global_batch // (dp_size * micro_batch)
            microbatches = range(dp_rank * per, (dp_rank + 1) * per)
        self.microbatches = microbatches   # of the step's global_batch / micro_batch, in order
        self.prefetch = int(prefetch)
        self.device = torch.device(device)
        self._pin = self.device.type == "cuda"
        self._step = int(start_step)  # next step returned by __next__
        self.samples_read = 0  # samples this loader read from the dataset (prefetched included)
        self.last_wait_s = 0.0
        self._wait_acc = 0.0
        self._thread: threading.Thread | None = None
        self._queue: queue.Queue | None = None
        self._stop = threading.Event()

    # -- building batches ---------------------------------------------------------------

    def indices(self, step: int) -> np.ndarray:
        """This rank's sample indices for `step` (global_batch / dp_size of them): its contiguous
        slice of the step's global batch (a TokenDataset's or a MixtureDataset's order)."""
        g = self.dataset.batch_indices(step, self.global_batch, self.seed)
        mine = self.microbatches
        return g[mine.start * self.micro_batch: mine.stop * self.micro_batch]

    def make_batch(self, step: int) -> Batch:
        """Read and shape the batch of `step` (on CPU; pinned when the device is CUDA)."""
        idx = self.indices(step)
        arr = torch.from_numpy(self.dataset.get_many(idx))
        self.samples_read += len(idx)
        shape = (-1, self.micro_batch, self.dataset.seq_len)   # Layout.microbatches of them
        inputs = arr[:, :-1].reshape(shape).contiguous()
        targets = arr[:, 1:].reshape(shape).contiguous()
        if self._pin:
            inputs, targets = inputs.pin_memory(), targets.pin_memory()
        return Batch(step, inputs, targets, idx)

    def _worker(self, first: int, q: queue.Queue, stop: threading.Event) -> None:
        step = first
        while not stop.is_set():
            try:
                item: Any = self.make_batch(step)
            except BaseException as e:  # surfaced to the consumer by __next__
                item = _Failure(e)
            while not stop.is_set():
                try:
                    q.put(item, timeout=0.1)
                    break
                except queue.Full:
                    continue
            if isinstance(item, _Failure):
                return
            step += 1

    def _start(self) -> None:
        self._stop = threading.Event()
        self._queue = queue.Queue(maxsize=self.prefetch)
        self._thread = threading.Thread(target=self._worker, name="myria-batch-prefetch",
                                        args=(self._step, self._queue, self._stop), daemon=True)
        self._thread.start()

    # -- iteration ----------------------------------------------------------------------

    def __iter__(self) -> BatchLoader:
        return self

    def __next__(self) -> Batch:
        t0 = time.perf_counter()
        if self.prefetch == 0:
            batch = self.make_batch(self._step)
        else:
            if self._thread is None:
                self._start()
            assert self._queue is not None
            item = self._queue.get()
            if isinstance(item, _Failure):
                self._thread = None
                raise item.exc
            batch = item
        if batch.step != self._step:  # cannot happen unless the thread was not restarted
            raise RuntimeError(f"loader produced step {batch.step}, expected {self._step}")
        if self.device.type != "cpu":
            batch.inputs = batch.inputs.to(self.device, non_blocking=True)
            batch.targets = batch.targets.to(self.device, non_blocking=True)
        self.last_wait_s = time.perf_counter() - t0
        self._wait_acc += self.last_wait_s
        self._step += 1
        return batch

    def pop_wait_time(self) -> float:
        """Seconds spent waiting in `next` since the previous call; resets the counter."""
        w, self._wait_acc = self._wait_acc, 0.0
        return w

    @property
    def step(self) -> int:
        """The step the next batch belongs to."""
        return self._step

    # -- state ----------------------------------------------------------------------------

    def state_dict(self) -> dict[str, int]:
        """{"step": next step, "seed", "global_batch"}: enough to resume the exact order."""
        return {"step": self._step, "seed": self.seed, "global_batch": self.global_batch}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from `state["step"]`; the seed and global batch must match this loader's."""
        for key in ("seed", "global_batch"):
            if key in state and int(state[key]) != getattr(self, key):
                raise ConfigError(f"data loader state has {key} = {state[key]} but this run uses "
                                  f"{getattr(self, key)}; the data order would not continue "
                                  f"(use the same training.{key} to resume)")
        self.close()
        self._step = int(state["step"])

    def close(self) -> None:
        """Stop the prefetch thread and drop prefetched batches."""
        t, self._thread = self._thread, None
        if t is None:
            return
        self._stop.set()
        if self._queue is not None:
            while True:
                try:
                    self._queue.get_nowait()
                except queue.Empty:
                    break
        t.join(timeout=5.0)
        self._queue = None

    def __enter__(self) -> BatchLoader:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass
