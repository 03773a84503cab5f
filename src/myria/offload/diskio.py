"""Disk I/O of the nvme tier: aligned (and huge-page) buffers, O_DIRECT files, whole reads
and writes.

O_DIRECT needs offsets, lengths and buffer addresses aligned to ALIGN; `aligned_buffer` gives
such buffers, `probe_direct` says whether a directory's file system takes O_DIRECT at all
(tmpfs does not: buffered I/O is used there), and `full_io` loops over short reads and writes.
`os.preadv`/`os.pwritev` release the GIL, so the tier's threads overlap with torch's kernels.
"""

from __future__ import annotations

import errno
import mmap
import os
from pathlib import Path

import torch

HUGE_PAGE = 2 << 20          # a transparent huge page (x86-64, arm64 with 4 KiB pages)
ALIGN = 4096                 # O_DIRECT alignment of offsets, lengths and buffer addresses


def round_up(n: int, to: int = ALIGN) -> int:
    """`n` rounded up to a multiple of `to`."""
    return -(-n // to) * to


def aligned_buffer(nbytes: int) -> torch.Tensor:
    """A uint8 CPU tensor of `nbytes` whose address is a multiple of ALIGN (for O_DIRECT).

    Buffers of a huge page and more are their own anonymous mapping, aligned to HUGE_PAGE and
    marked MADV_HUGEPAGE, so that the kernel backs them with transparent huge pages where it
    offers them (`enabled` = always or madvise; elsewhere they stay 4 KiB pages and work the
    same). Why: a direct I/O request takes at most `max_segments` physical segments (254 on a
    virtio disk), so a buffer of scattered 4 KiB pages splits the I/O into ~1 MB requests, each
    costing the block layer's workers CPU time that no process is charged for; huge pages
    about double the direct-I/O rates (`bench/offload_hugepages.py`, its figures in
    bench/RESULTS.md, "huge pages").
    The mapping is unmapped when the tensor's storage is freed (it holds the mapping).

    Smaller buffers come from torch's allocator, which aligns to 64 bytes only, so a larger
    block is sliced at the first aligned address. (On a GPU run these are the host staging
    buffers; pinning them, e.g. `cudaHostRegister` over the same mapping, is future work.)"""
    if nbytes >= HUGE_PAGE and hasattr(mmap, "MADV_HUGEPAGE"):
        m = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        raw = torch.frombuffer(m, dtype=torch.uint8)   # holds `m`: unmapped with the storage
        skip = (-raw.data_ptr()) % HUGE_PAGE
        try:
            m.madvise(mmap.MADV_HUGEPAGE, skip, round_up(nbytes))
        except OSError:   # no transparent huge pages in this kernel: 4 KiB pages
            pass
        return raw[skip:skip + nbytes]
    raw = torch.empty(nbytes + ALIGN, dtype=torch.uint8)
    skip = (-raw.data_ptr()) % ALIGN
    return raw[skip:skip + nbytes]


def open_file(path: Path, flags: int, direct: bool) -> int:
    """os.open with O_DIRECT when `direct` (raises OSError as os.open does)."""
    extra = getattr(os, "O_DIRECT", 0) if direct else 0
    return os.open(path, flags | extra, 0o644)


def probe_direct(directory: Path) -> bool:
    """Whether O_DIRECT reads and writes work in `directory` (not on tmpfs, for instance)."""
    if not hasattr(os, "O_DIRECT"):
        return False
    probe = directory / ".direct_probe"
    buf = aligned_buffer(ALIGN)
    try:
        fd = open_file(probe, os.O_RDWR | os.O_CREAT | os.O_TRUNC, True)
    except OSError:
        return False
    try:
        mv = memoryview(buf.numpy())
        return os.pwritev(fd, [mv], 0) == ALIGN and os.preadv(fd, [mv], 0) == ALIGN
    except OSError:
        return False
    finally:
        os.close(fd)
        probe.unlink(missing_ok=True)


def full_io(op, fd: int, mv: memoryview, offset: int) -> None:
    """Read (os.preadv) or write (os.pwritev) all of `mv` at `offset`, looping on short I/O."""
    done = 0
    while done < len(mv):
        n = op(fd, [mv[done:]], offset + done)
        if n <= 0:
            raise OSError(errno.EIO, f"short {'read' if op is os.preadv else 'write'} at "
                          f"offset {offset + done}")
        done += n
