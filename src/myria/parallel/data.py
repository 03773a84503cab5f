"""One data reader per tensor/context-parallel group: it reads each batch and broadcasts it.

All ranks of a tp x cp group train on the same sequences, so reading them once per group is
enough (MegaScale §3.5: removing redundant data loaders). The group's first rank runs the real
`BatchLoader` (with its prefetch thread); the others receive the batch by broadcast and never
touch the token files. `samples_read` counts, per rank, the samples read from storage.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
import torch.distributed as dist

from myria import rundir
from myria.data.dataset import TokenDataset
from myria.data.loader import Batch, BatchLoader
from myria.fsutil import atomic_write_json


class BroadcastLoader:
    """A `BatchLoader` on the group's reader rank, broadcast receivers on the others."""

    def __init__(self, inner: BatchLoader | None, group, src: int, shape: tuple[int, int, int],
                 start_step: int, device: torch.device, seed: int, global_batch: int):
        self.inner, self.group, self.src = inner, group, src
        self.shape, self.device = shape, device
        self._step, self._wait = start_step, 0.0
        self._seed, self._global_batch = seed, global_batch

    def __iter__(self):
        return self

    def __next__(self) -> Batch:
        t0 = time.perf_counter()
        if self.inner is not None:
            b = next(self.inner)
            both = torch.stack([b.inputs, b.targets]).to(self.device)
        else:
            both = torch.empty((2, *self.shape), dtype=torch.int64, device=self.device)
        dist.broadcast(both, src=self.src, group=self.group)
        if self.inner is None:
            self._wait += time.perf_counter() - t0
            b = Batch(self._step, both[0], both[1], None)
        else:
            b = Batch(b.step, both[0], both[1], b.indices)
        self._step += 1
        return b

    @property
    def samples_read(self) -> int:
        return self.inner.samples_read if self.inner is not None else 0

    def pop_wait_time(self) -> float:
        if self.inner is not None:
            return self.inner.pop_wait_time()
        w, self._wait = self._wait, 0.0
        return w

    def state_dict(self) -> dict:
        if self.inner is not None:
            return self.inner.state_dict()
        return {"step": self._step, "seed": self._seed, "global_batch": self._global_batch}

    def close(self) -> None:
        if self.inner is not None:
            self.inner.close()


def make_loader(engine, dataset: TokenDataset, cfg, start_step: int):
    """The loader of this rank: a plain BatchLoader, or one reader per tp x cp group."""
    t = cfg.training

    def real() -> BatchLoader:
        return BatchLoader(dataset, t.global_batch, t.micro_batch, engine.dims.dp_rank,
                           engine.dims.dp, t.seed, start_step=start_step,
                           prefetch=cfg.data.prefetch, device=engine.device,
                           microbatches=engine.share.microbatches)

    group = engine.dims.data_group if cfg.parallel.data_broadcast else None
    if group is None:
        return real()
    src = dist.get_global_rank(group, 0)
    is_reader = dist.get_rank() == src
    shape = (engine.microbatches, t.micro_batch, cfg.model.seq_len)
    return BroadcastLoader(real() if is_reader else None, group, src, shape, start_step,
                           engine.device, t.seed, t.global_batch)


def write_read_counts(run_dir: Path, rank: int, loader) -> None:
    """RUN_DIR/stats/data_rank{r}.json: samples this rank read from the token files."""
    path = rundir.data_stats_file(run_dir, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(path,
                      {"rank": rank, "samples_read": int(loader.samples_read)},
                      indent=None, durable=False)
