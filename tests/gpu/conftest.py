"""Shared pieces of the GPU tests (`pytest -m gpu`; bench/gpu/run.sh runs them on a lent GPU).

Every test module here that needs CUDA carries `pytestmark = GPU`: marked `gpu` and skipped
cleanly where torch sees no CUDA device. Figures a test measures (overheads, timings) are
recorded with `record_property`, so they land in the JUnit XML that bench/gpu/run.sh keeps.
"""

from __future__ import annotations

import pytest
import torch

GPU = [pytest.mark.gpu,
       pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

# A model that takes a GPU milliseconds per step but is not trivially small: head_dim 64 (flash
# attention's sweet spot), grouped-query attention, seq 512.
GPU_MODEL = ["--model.vocab_size=1024", "--model.layers=4", "--model.hidden=256",
             "--model.heads=4", "--model.kv_heads=2", "--model.seq_len=512",
             "--training.global_batch=8", "--training.micro_batch=4",
             "--optimizer.warmup_steps=4", "--logging.tensorboard=false",
             "--logging.progress=false", "--training.device=cuda"]


def gpu_config(*overrides: str):
    """A Config of GPU_MODEL with `overrides` (for in-process Engine tests)."""
    from myria import config

    return config.load(None, [*GPU_MODEL, *overrides])


def gpu_only(fn):
    """Mark one test `gpu` and skip it without CUDA (GPU, for a test rather than a module)."""
    for mark in GPU:
        fn = mark(fn)
    return fn


def cuda_seconds(fn, reps: int = 5) -> float:
    """Mean seconds of `fn()` on the current CUDA stream: one warm-up call, then `reps` calls
    between two CUDA events."""
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / reps
