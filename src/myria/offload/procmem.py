"""This process's memory: what the budget holds it to, and what it measured.

A run under a memory budget must hand freed tensors back to the OS (`keep_heap_small`); the
tier reports its peak and current resident memory beside its I/O (`peak_rss`, `current_rss`).
"""

from __future__ import annotations

import ctypes
from pathlib import Path


def keep_heap_small(threshold: int = 1 << 20) -> bool:
    """Serve blocks of `threshold` bytes and more straight from mmap, so freed tensors go back
    to the OS. glibc raises its mmap threshold to the size of each freed large block (up to 32
    MiB); layer-sized tensors then come from heap arenas that keep what is freed: 0.4 GB of peak
    memory above the plan in bench/offload.py, gone with a fixed threshold (mallopt
    M_MMAP_THRESHOLD, which also stops the adjustment). glibc only; False elsewhere."""
    try:
        return bool(ctypes.CDLL("libc.so.6").mallopt(-3, int(threshold)))  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        return False


def peak_rss() -> int:
    """This process's peak resident memory (VmHWM), bytes; 0 where /proc is missing."""
    return _status_kb("VmHWM") * 1024


def current_rss() -> int:
    return _status_kb("VmRSS") * 1024


def _status_kb(key: str) -> int:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0
