"""Memory bandwidth: the best GB/s of copying a large buffer."""

from __future__ import annotations

import time
from typing import Any

from myria.resilience.checks.compute import sync

MEMBW_BYTES = {"cpu": 128 * 2**20, "cuda": 1 << 30}


def measure_memory_bandwidth(device: Any, nbytes: int, seconds: float = 0.3) -> float:
    """Best GB/s of copying an `nbytes` buffer (read + write counted, as STREAM copy does)."""
    import torch

    src = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)  # first touch
    sync(device)
    best, reps = 0.0, 0
    deadline = time.perf_counter() + seconds
    while reps < 3 or time.perf_counter() < deadline:
        t0 = time.perf_counter()
        dst.copy_(src)
        sync(device)
        best = max(best, 2.0 * src.numel() * 4 / (time.perf_counter() - t0) / 1e9)
        reps += 1
    return best


