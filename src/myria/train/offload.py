"""The nvme tier (parallel.offload = nvme): AdamW's state in files, streamed through a few buffers.

ZeRO-Infinity (Rajbhandari et al. 2021) keeps what does not fit in accelerator memory in host
memory and on NVMe and streams it in with overlap; PyTorch offers the host tier (FSDP2's
`CPUOffloadPolicy`, myria's `offload = cpu`) but nothing for NVMe. This module is that tier for
AdamW: each rank's two moments (and, with `offload_params`, its fp32 parameters: see
myria.train.offload_params) live in a file on a local disk; the fast tier holds only a ring of
a few aligned buffers, sized from `parallel.fast_memory_gb`.

**Files.** `OFFLOAD_DIR/rankNNNNN/partK/gen_00000012.bin` is the state after 12 updates:
one region per section (`param`, `exp_avg`, `exp_avg_sq`), each holding the rank's local
tensors one after another at 4 KiB-aligned offsets (`Layout`); `gen_N.json` beside it says what
is where. A generation is never written twice: update N+1 reads generation N and writes another
file; when its last chunk is written it is synced, and generation N is dropped. Its file is kept
as `spare.bin` and becomes generation N+2's (its blocks are allocated already: deleting and
allocating 4 GB files each step slowed the disk for the reads that followed), unless a
checkpoint links it, in which case only its name goes. A new file is created at full size first
(`posix_fallocate`, so a full disk fails before any parameter changes). A fresh run starts from
a preallocated file of zeros, which is AdamW's initial state.

**The I/O pipeline** (`_Pipeline`). A reader thread runs ahead of the optimizer, reading chunk
i+1, i+2, ... into free buffers while the main thread updates chunk i, and a writer thread
writes chunk i-1 back. When a step ends the reader goes on prefetching the next step's first
chunks (they depend only on this step's writes), and the writer's last chunks trail into the
next forward pass: the I/O hides behind the optimizer's arithmetic and, as far as the buffers
reach, behind forward and backward. With the parameters on disk the update runs behind
training, the next forward copies updated parameters from its buffers, and the gradient memory
the update has used up is lent to write-behind buffers, which backward takes back
(`OffloadedAdamW.charge`, docs/offload.md). And when clipping is not expected to bind (the last
step's did not), the update starts during the last backward, each chunk once its gradients are
final: a bet `step()` keeps if no gradient was scaled or changed, and drops otherwise, the
update then running from `step()` into the same uncommitted file (`last_backward`).
Files are opened with O_DIRECT where the file system allows it (no page-cache copy, no cache
pollution, bandwidth that is the disk's); elsewhere (tmpfs, some network file systems) plain
buffered I/O is used. Python's
`os.preadv`/`os.pwritev` release the GIL, so the threads overlap with torch's kernels; no extra
library is needed.

**Same bits as in memory.** Each chunk is updated by torch's own functional Adam
(`torch.optim.adam.adam`, the function AdamW.step calls) with each param group's exact
settings (foreach, fused, decoupled weight decay, ...). Every operation in it is elementwise
with per-tensor scalars, so applying it to pieces of a tensor gives the bits of applying it to
the whole; the only per-tensor state, the step count, is incremented once per tensor
(`tests/train/test_offload.py` checks the parameters bit for bit against torch.optim.AdamW,
one process and two FSDP ranks).

**Checkpoints** link the committed generation file into the checkpoint (a hard link, else a
reflink, else a kernel-side copy: `link_or_copy`), so saving costs no copy through memory and
no write-back; the checkpoint manager checksums and validates it like any shard. Since no
generation is modified in place, a linked file is immutable. Resuming links it back. A process
killed mid-step leaves a half-written generation that the next start deletes; training resumes
from the last checkpoint, bit for bit. A full or unwritable offload directory raises an
`OffloadError` (one line; training stops, committed checkpoints are untouched).
"""

from __future__ import annotations

import bisect
import errno
import json
import logging
import math
import mmap
import os
import queue
import shutil
import signal
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn

from myria import rundir
from myria.errors import CheckpointError, ConfigError, OffloadError
from myria.observe import events

log = logging.getLogger("myria")

HUGE_PAGE = 2 << 20          # a transparent huge page (x86-64, arm64 with 4 KiB pages)
ALIGN = 4096                 # O_DIRECT alignment of offsets, lengths and buffer addresses
CHUNK_BYTES = 64 << 20       # bytes per section per buffer when the budget allows (I/O saturates)
MIN_BUFFERS = 3              # one being read, one being updated, one being written
MIN_CHUNK = 8 << 20          # bytes per section per buffer at least (or one layer if smaller)
PARAM_SLABS = 3              # offload_params: units in memory at once (offload_params.py)
SPARE = "spare.bin"          # a replaced generation's file, rewritten as a later one
MAX_BUFFERS = 64
DEFAULT_BUFFERS = 4          # without a budget (fast_memory_gb = 0)
CKPT_PREFIX = "offload"      # checkpoint subdirectory of the linked state files


def _round_up(n: int, to: int = ALIGN) -> int:
    return -(-n // to) * to


def _local(t: torch.Tensor) -> torch.Tensor:
    """The local tensor of a DTensor (its shard on this rank), else the tensor itself."""
    return t._local_tensor if hasattr(t, "_local_tensor") else t


def _flat(t: torch.Tensor) -> torch.Tensor:
    """A flat view of `t` (in-place updates through it reach `t`)."""
    if not t.is_contiguous():
        raise RuntimeError("the nvme tier needs contiguous parameters and gradients")
    return t.view(-1)


def aligned_buffer(nbytes: int) -> torch.Tensor:
    """A uint8 CPU tensor of `nbytes` whose address is a multiple of ALIGN (for O_DIRECT).

    Buffers of a huge page and more are their own anonymous mapping, aligned to HUGE_PAGE and
    marked MADV_HUGEPAGE, so that the kernel backs them with transparent huge pages where it
    offers them (`enabled` = always or madvise; elsewhere they stay 4 KiB pages and work the
    same). Why: a direct I/O request takes at most `max_segments` physical segments (254 on a
    virtio disk), so a buffer of scattered 4 KiB pages splits the I/O into ~1 MB requests, each
    costing the block layer's workers CPU time that no process is charged for. Measured on the
    2-core VM (`bench/offload_hugepages.py`: 18 MB O_DIRECT calls over 2 GB): reads 1.3-1.5 ->
    3.0-3.1 GB/s, writes 2.2-3.2 -> 6.8-6.9 GB/s, block-layer worker CPU 0.1 s -> 0 per 2 GB;
    the offload moves ~12 GB a step.
    The mapping is unmapped when the tensor's storage is freed (it holds the mapping).

    Smaller buffers come from torch's allocator, which aligns to 64 bytes only, so a larger
    block is sliced at the first aligned address. (On a GPU run these are the host staging
    buffers; pinning them, e.g. `cudaHostRegister` over the same mapping, is future work.)"""
    if nbytes >= HUGE_PAGE and hasattr(mmap, "MADV_HUGEPAGE"):
        m = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        raw = torch.frombuffer(m, dtype=torch.uint8)   # holds `m`: unmapped with the storage
        skip = (-raw.data_ptr()) % HUGE_PAGE
        try:
            m.madvise(mmap.MADV_HUGEPAGE, skip, _round_up(nbytes))
        except OSError:   # no transparent huge pages in this kernel: 4 KiB pages
            pass
        return raw[skip:skip + nbytes]
    raw = torch.empty(nbytes + ALIGN, dtype=torch.uint8)
    skip = (-raw.data_ptr()) % ALIGN
    return raw[skip:skip + nbytes]


# -- files --------------------------------------------------------------------------------
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


def _full_io(op, fd: int, mv: memoryview, offset: int) -> None:
    """Read (os.preadv) or write (os.pwritev) all of `mv` at `offset`, looping on short I/O."""
    done = 0
    while done < len(mv):
        n = op(fd, [mv[done:]], offset + done)
        if n <= 0:
            raise OSError(errno.EIO, f"short {'read' if op is os.preadv else 'write'} at "
                          f"offset {offset + done}")
        done += n


def link_or_copy(src: Path, dst: Path) -> str:
    """Make `dst` hold `src`'s bytes without reading them through this process: a hard link
    (same file system), else a reflink (copy-on-write clone: btrfs, XFS), else a kernel-side
    copy (`shutil.copyfile`, which uses sendfile/copy_file_range). Returns which was used."""
    dst.unlink(missing_ok=True)
    try:
        os.link(src, dst)
        return "link"
    except OSError:
        pass
    try:
        import fcntl
        with open(src, "rb") as fs, open(dst, "wb") as fd:
            fcntl.ioctl(fd.fileno(), 0x40049409, fs.fileno())  # FICLONE
        return "reflink"
    except OSError:
        dst.unlink(missing_ok=True)
    shutil.copyfile(src, dst)
    return "copy"


# -- where each tensor lives -------------------------------------------------------------------
@dataclass(frozen=True)
class Piece:
    """Elements [start, stop) of tensor `index`, at byte `offset` of a chunk's section."""

    index: int
    start: int
    stop: int
    offset: int


@dataclass(frozen=True)
class Chunk:
    """Bytes [start, stop) of every section region, and the tensor pieces they hold."""

    start: int
    stop: int
    pieces: tuple[Piece, ...]


class Layout:
    """Sections (e.g. exp_avg, exp_avg_sq) one region after another; in each region the tensors
    in optimizer order (or in `order`: tensor indices in the order they are placed), each at a
    4 KiB-aligned byte offset."""

    def __init__(self, tensors: list[tuple[tuple[int, ...], torch.dtype]],
                 sections: tuple[str, ...], order: list[int] | None = None):
        self.sections = sections
        self.shapes = [tuple(s) for s, _ in tensors]
        self.dtypes = [d for _, d in tensors]
        self.numels = [math.prod(s) for s in self.shapes]
        self.itemsizes = [torch.empty((), dtype=d).element_size() for d in self.dtypes]
        self.order = list(order) if order is not None else list(range(len(tensors)))
        if sorted(self.order) != list(range(len(tensors))):
            raise ValueError("Layout: order must place every tensor once")
        self.offsets = [0] * len(tensors)
        off = 0
        for t in self.order:
            self.offsets[t] = off
            off += _round_up(self.numels[t] * self.itemsizes[t])
        self.region = off
        self.file_bytes = off * len(sections)

    def section(self, name: str) -> int:
        return self.sections.index(name)

    def chunks(self, cap: int) -> list[Chunk]:
        """The region cut into chunks of at most `cap` bytes (a multiple of ALIGN)."""
        out = []
        a = 0
        while a < self.region:
            b = min(a + cap, self.region)
            pieces = []
            for t, (o, n, isz) in enumerate(zip(self.offsets, self.numels, self.itemsizes)):
                x, y = max(a, o), min(b, o + n * isz)
                if x < y:
                    pieces.append(Piece(t, (x - o) // isz, (y - o) // isz, x - a))
            out.append(Chunk(a, b, tuple(pieces)))
            a = b
        return out

    def to_json(self) -> dict:
        out = {"sections": list(self.sections),
               "tensors": [[list(s), str(d).replace("torch.", "")]
                           for s, d in zip(self.shapes, self.dtypes)],
               "region_bytes": self.region}
        if self.order != list(range(len(self.shapes))):
            out["order"] = self.order
        return out


# -- budget ------------------------------------------------------------------------------------
@dataclass
class MemoryPlan:
    """What one rank keeps in the fast tier under `parallel.offload`, in bytes."""

    tier: str
    budget: float                  # fast_memory_gb in bytes (0: none)
    params: float                  # parameters kept resident (a layer at a time if offloaded)
    grads: float
    optimizer: float               # optimizer state kept resident (0 under nvme)
    activations: float             # the planner's estimate (myria.sim.memory)
    buffers: int = 0               # nvme: I/O buffers ...
    buffer_bytes: float = 0.0      # ... of this size each (all sections of one chunk)
    offloaded: float = 0.0         # bytes in the offload files per rank
    layer_state: float = 0.0       # one layer's offloaded state (all sections)
    sections: int = 2              # nvme: state tensors per parameter in the files

    @property
    def resident(self) -> float:
        return self.params + self.grads + self.optimizer + self.activations + \
            self.buffers * self.buffer_bytes

    @property
    def chunk_bytes(self) -> int:
        """Bytes per section of one buffer."""
        return int(self.buffer_bytes // max(1, self.sections)) if self.buffers else 0

    def describe(self) -> str:
        gb = lambda x: f"{x / 1e9:.3g}"  # noqa: E731
        s = (f"offload {self.tier}: fast tier per rank: parameters {gb(self.params)} + "
             f"gradients {gb(self.grads)} + optimizer {gb(self.optimizer)} + activations "
             f"{gb(self.activations)}")
        if self.tier == "nvme":
            s += (f" + {self.buffers} I/O buffers of {self.buffer_bytes / 2**20:.1f} MiB"
                  f" = {gb(self.resident)} GB; on disk {gb(self.offloaded)} GB per rank")
        else:
            s += f" = {gb(self.resident)} GB"
        if self.budget:
            s += f" (budget {gb(self.budget)} GB)"
        return s


def plan_memory(cfg, params_local: int, layer_params_local: int, itemsize: int,
                activations: float, unit_params_local: int = 0) -> MemoryPlan:
    """The fast-tier plan of one rank, or a ConfigError (one line) when the budget
    `parallel.fast_memory_gb` cannot hold even one layer's worth of it.

    `params_local`: parameters this rank holds (its shards); `layer_params_local`: of them,
    the largest transformer block's; `unit_params_local`: the largest unit offload_params
    loads at once (a block, the embeddings or the head). Under nvme the buffers take what the
    budget leaves, at least MIN_BUFFERS chunks of MIN_CHUNK (or a layer, if smaller) per
    section, at most enough for the whole state (with room for the next step's prefetch) and
    CHUNK_BYTES per section each."""
    par = cfg.parallel
    tier = par.offload_tier
    budget = par.fast_memory_gb * 1e9
    p_bytes = params_local * itemsize
    if tier != "nvme":
        plan = MemoryPlan(tier, budget, p_bytes, p_bytes, 2 * p_bytes if tier == "none" else 0,
                          activations)
        if tier == "none" and budget and plan.resident > budget:
            raise ConfigError(
                f"parallel.fast_memory_gb = {par.fast_memory_gb:g} is too small for this run in "
                f"memory: it needs {plan.resident / 1e9:.3g} GB per rank (parameters, gradients"
                f", optimizer state, activations); set parallel.offload = 'nvme' to keep the "
                "optimizer state on disk")
        return plan
    sections = 3 if par.offload_params else 2
    layer_state = layer_params_local * itemsize * sections
    # with offloaded parameters the fast tier holds a few units (offload_params.py)
    unit = _round_up(max(unit_params_local, layer_params_local) * itemsize)
    resident_params = PARAM_SLABS * unit if par.offload_params else p_bytes
    plan = MemoryPlan(tier, budget, resident_params, p_bytes, 0.0, activations,
                      offloaded=p_bytes * sections, layer_state=layer_state, sections=sections)
    chunk_min = _round_up(max(1, min(layer_params_local * itemsize, MIN_CHUNK)))
    if budget:
        room = budget - plan.resident
        need = MIN_BUFFERS * chunk_min * sections
        if room < need:
            least = (plan.resident + need) / 1e9
            raise ConfigError(
                f"parallel.fast_memory_gb = {par.fast_memory_gb:g} is too small for even one "
                f"layer: this rank needs at least {least:.3g} GB (parameters "
                f"{plan.params / 1e9:.3g}, gradients {plan.grads / 1e9:.3g}, activations "
                f"{activations / 1e9:.3g}, and {MIN_BUFFERS} I/O buffers of "
                f"{chunk_min * sections / 1e9:.3g})"
                + ("" if par.offload_params else "; parallel.offload_params = true also moves "
                   "the parameters to disk"))
        # several chunks even when the whole state would fit: the pipeline needs them
        chunk = min(CHUNK_BYTES, int(room // (MIN_BUFFERS * sections)),
                    _round_up(max(1, p_bytes // 4)))
        chunk = max(chunk_min, chunk // ALIGN * ALIGN)
        n = int(room // (chunk * sections))
    else:
        chunk = max(chunk_min, min(CHUNK_BYTES, _round_up(max(1, p_bytes // 8))))
        n = DEFAULT_BUFFERS
    whole = -(-p_bytes // chunk) + 2  # every chunk prefetched, plus one being written
    plan.buffers = max(MIN_BUFFERS, min(n, whole, MAX_BUFFERS))
    plan.buffer_bytes = chunk * sections
    return plan


def plan_for_config(cfg, layout: dict[str, int]) -> MemoryPlan:
    """`plan_memory` estimated from the config before any tensor exists (the CLI's check
    before launching, the dry-run): the parameters of the busier pipeline stage
    (myria.sim.memory.stage_params), sharded over the data-parallel ranks under FSDP."""
    from myria.models.flops import param_counts
    from myria.sim.memory import stage_params
    from myria.sim.operators import layer_shape

    m, t = cfg.model, cfg.training
    tp, pp, ep = layout["tp"], layout["pp"], layout["ep"]
    shard = layout["dp"] * layout["cp"] if t.data_parallel != "ddp" else 1
    shape = layer_shape(m, t.micro_batch, tp=tp, ep=ep)
    stages = [(True, True)] if pp == 1 else [(True, False), (False, True)]
    dense, expert = max((stage_params(shape, m.layers / pp, f, la, ep) for f, la in stages),
                        key=sum)
    ldense, lexpert = stage_params(shape, 1, False, False, ep)
    eshard = max(1, shard // ep)
    total = math.ceil(dense / shard + expert / eshard)
    layer = math.ceil(ldense / shard + lexpert / eshard)
    pc = param_counts(m)
    unit = max(layer, math.ceil(max(pc.embedding + pc.positional, pc.final_norm + pc.head)
                                / tp / shard))
    return plan_memory(cfg, total, layer, 4, activation_bytes(cfg, layout), unit)


def activation_bytes(cfg, layout: dict[str, int]) -> float:
    """Activation memory per rank as the planner models it (myria.sim.memory), for myria's
    eager modules in the run's precision."""
    from myria.models.flops import loss_chunk_rows
    from myria.sim.memory import (
        head_activation_bytes,
        in_flight_microbatches,
        layer_activation_bytes,
    )
    from myria.sim.operators import layer_shape

    m, t, p = cfg.model, cfg.training, cfg.parallel
    tp, cp, pp = layout.get("tp", 1), layout.get("cp", 1), layout.get("pp", 1)
    bf16 = t.dtype == "bfloat16" or (t.dtype == "auto" and t.device == "cuda")
    shape = layer_shape(m, t.micro_batch, tp=tp, cp=cp, ep=layout.get("ep", 1),
                        sp=p.sequence_parallel, flash=True, fused=False,
                        act_bytes=2 if bf16 else 4, eager=True,
                        ce_chunk=loss_chunk_rows(m.vocab_size) if tp == 1 and pp == 1 else 0)
    micro = t.global_batch // max(1, layout.get("dp", 1) * t.micro_batch)
    flight = in_flight_microbatches(p.schedule, pp, p.vpp, micro) if pp > 1 else 1.0
    act = m.layers / pp * flight * layer_activation_bytes(shape, p.activation_checkpoint)
    if p.activation_checkpoint == "full":  # the layer being recomputed, whole
        act += layer_activation_bytes(shape, "none")
    return act + head_activation_bytes(shape, True, True) * flight


# -- the I/O pipeline --------------------------------------------------------------------------
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
class _Read:
    key: tuple
    fd: int
    segments: list[tuple[int, int, int]]   # (file offset, buffer offset, bytes)
    after: threading.Event | None = None   # the write this read depends on
    cancel: threading.Event | None = None  # set: skip the I/O (the read is not wanted any more)
    gate: threading.Event | None = None    # set: the disk is free for it (see step())


@dataclass
class _Write:
    gen: int
    fd: int
    buffer: int                    # a ring slot, or -1: `view` is a buffer of its own
    segments: list[tuple[int, int, int]]
    done: threading.Event | None = None
    fail: bool = False             # the offload-diskfull fault hook
    view: memoryview | None = None
    finished: object = None        # called after the write (before the slot is freed)


class _Pipeline:
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
    def read(self, job: _Read) -> None:
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

    def write(self, job: _Write) -> None:
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
                        _full_io(os.preadv, job.fd, self._views[idx][boff:boff + n], off)
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
                        _full_io(os.pwritev, job.fd, view[boff:boff + n], off)
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


# -- the optimizer -----------------------------------------------------------------------------
@dataclass
class _Held:
    """An updated chunk still in memory (being written, or written and its buffer not yet
    reused): the next forward may copy parameters from it."""

    buf: torch.Tensor
    lock: threading.Lock = field(default_factory=threading.Lock)
    valid: bool = True


@dataclass
class _Update:
    """One update of every chunk, generation `g` into `new` (file `fd`), in `order`.

    Speculative (`ready` set): started during the last backward, before the gradients are
    clipped. Chunk c is updated once the gradients of all its tensors are final (`ready[c]`),
    assuming they will not be scaled; `step()` keeps it (`confirmed`) when nothing changed them,
    else it is dropped (`cancelled`) and its file is reused by the update that replaces it."""

    g: int
    new: int
    fd: int
    old_fd: int
    before: dict          # tensor -> its step count before this update
    settings: list[dict]  # each group's adam() settings (this step's learning rate)
    grads: dict           # tensor -> its flat gradient (speculative: filled as they are final)
    order: list[int]
    written: list[threading.Event]
    computed: list[threading.Event] | None
    left: list[int]       # tensor -> chunks of it not updated yet
    taken: set = field(default_factory=set)   # tensors whose gradient memory was charged
    kill: object = None
    full: object = None
    ready: list[threading.Event] | None = None
    waiting: list[int] | None = None          # chunk -> tensors whose gradient is not final
    ptr: dict = field(default_factory=dict)   # tensor -> data_ptr of the gradient used
    after: threading.Event | None = None      # the previous update's end
    confirmed: bool = True
    cancelled: bool = False
    decided: threading.Event = field(default_factory=threading.Event)
    used: list[int] = field(default_factory=list)   # used up before it was confirmed
    updated: int = 0      # chunks updated so far
    done: threading.Event = field(default_factory=threading.Event)


def _adam_kwargs(group: dict) -> dict:
    """The settings AdamW.step passes to torch.optim.adam.adam for `group`."""
    beta1, beta2 = group["betas"]
    return dict(amsgrad=group["amsgrad"], has_complex=False, beta1=beta1, beta2=beta2,
                lr=group["lr"], weight_decay=group["weight_decay"], eps=group["eps"],
                maximize=group["maximize"], foreach=group["foreach"],
                capturable=group["capturable"], differentiable=group["differentiable"],
                fused=group["fused"], grad_scale=None, found_inf=None,
                decoupled_weight_decay=group["decoupled_weight_decay"])


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
        self.dir = Path(directory)
        self.tensors = [p for g in self.param_groups for p in g["params"]]
        self.group_of = [i for i, g in enumerate(self.param_groups) for _ in g["params"]]
        from torch.optim.optimizer import _get_scalar_dtype

        scalar = _get_scalar_dtype()
        for p in self.tensors:   # filled now, so DCP's state-dict helpers see a live state
            self.state[p]["step"] = torch.tensor(0.0, dtype=scalar)
        sections = ("param", "exp_avg", "exp_avg_sq") if offload_params else \
            ("exp_avg", "exp_avg_sq")
        shapes = shapes or [tuple(_local(p).shape) for p in self.tensors]
        self.layout = Layout([(s, p.dtype) for s, p in zip(shapes, self.tensors)], sections,
                             order)
        self.chunk_bytes = chunk_bytes
        self.chunks = self.layout.chunks(chunk_bytes)
        self._chunks_of: dict[int, list[int]] = {}
        for c, chunk in enumerate(self.chunks):
            for pc in chunk.pieces:
                self._chunks_of.setdefault(pc.index, []).append(c)
        self._written: list[threading.Event] | None = None  # the last step's chunk writes
        self._tensors_in = [sorted({pc.index for pc in chunk.pieces}) for chunk in self.chunks]
        self._starts = [c.start for c in self.chunks]
        # parameters on disk: chunks updated and not yet written, readable from memory
        self._computed: list[threading.Event] | None = None
        self._held: dict[tuple[int, int], _Held] = {}
        self._held_lock = threading.Lock()
        # Gradient memory lent to write-behind buffers. `_room` is the gradient bytes the plan
        # reserves minus the gradients alive minus the write-behind buffers: the update gives
        # a gradient's bytes back once its last chunk is done, a chunk may then wait for its
        # write in a buffer of its own (the ring slot reads on; written, the buffer is pooled),
        # and backward, charging each unit's gradients before they exist, drops pooled buffers
        # and waits for those being written before it takes more.
        self._room_cv = threading.Condition()
        self._grad_bytes = [n * isz if p.requires_grad else 0 for n, isz, p in
                            zip(self.layout.numels, self.layout.itemsizes, self.tensors)]
        self._room = sum(self._grad_bytes)
        self._extra = 0          # bytes of write-behind buffers: being written or pooled
        self._inflight = 0       # write-behind buffers being written
        self._pool: list[tuple[torch.Tensor, tuple[int, int], _Held | None]] = []  # for reuse
        self._charged: set[int] = set()
        self.before_step: list = []     # called first in each step (parameter offload)
        self.after_step: list = []      # then, the new generation current; an Event it
        # returns gates the next update's reads (same)
        self.streamer = None            # myria.train.offload_params.ParamStreamer
        self.direct = direct
        self.faults = faults
        self.stats_file = stats_file
        self.budget = budget
        self.offload_params = offload_params
        self.pipe = _Pipeline(buffers, chunk_bytes * len(sections))
        self.gen = 0
        self.fd = -1
        self._committed: threading.Event | None = None
        self._queued: str | None = None    # reads of the next update queued: forward | reverse
        self._reads_cancel = threading.Event()
        self._closed = False
        # Parameters on disk: the update runs during the last backward when the gradients are
        # not expected to be clipped (the last step's were not), and is kept if they were not.
        self.speculate = True
        self._speculate_next = True
        self._spec: _Update | None = None
        # a file the next generation can be written into (`_file_for`): a dropped
        # speculation's (its gen, fd), or a replaced generation's, renamed SPARE (-1, fd)
        self._spare: tuple[int, int] | None = None
        self._spare_lock = threading.Lock()
        # parameters on disk: the update runs behind training (step); its end and its error
        self.asynchronous = offload_params
        self._behind: threading.Event | None = None
        self._behind_error: BaseException | None = None
        if offload_params:
            for t, p in enumerate(self.tensors):
                if p.requires_grad:
                    p.register_post_accumulate_grad_hook(lambda p, t=t: self._final(t))
        self._prepare_dir()
        self.fd = self._create(0)
        self._write_index(0)
        self._committed = threading.Event()
        self._committed.set()

    # -- files ---------------------------------------------------------------------------
    def path(self, gen: int, suffix: str = ".bin") -> Path:
        return self.dir / f"gen_{gen:08d}{suffix}"

    def _prepare_dir(self) -> None:
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            for f in [*self.dir.glob("gen_*"), self.dir / SPARE]:   # a crashed run's
                f.unlink(missing_ok=True)
        except OSError as e:
            raise OffloadError(f"offload directory {self.dir} is not usable: "
                               f"{e.strerror or e}") from None

    def _create(self, gen: int) -> int:
        """A new generation file at full size (zeros); OffloadError when there is no room."""
        path = self.path(gen)
        try:
            path.unlink(missing_ok=True)   # never truncate a file a checkpoint may link
            fd = open_file(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, self.direct)
            try:
                if self.layout.file_bytes:
                    os.posix_fallocate(fd, 0, self.layout.file_bytes)
            except OSError:
                os.close(fd)
                path.unlink(missing_ok=True)
                raise
            return fd
        except OSError as e:
            raise self._error(e, f"creating {path.name}") from None

    def _error(self, e: BaseException, doing: str) -> OffloadError:
        full = isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT)
        why = "is full" if full else "failed"
        detail = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        return OffloadError(
            f"offload directory {self.dir} {why} ({detail}) while {doing} "
            f"({self.layout.file_bytes / 1e9:.3g} GB per generation); training stopped, "
            "the committed checkpoints are intact: free space or set parallel.offload_dir, then "
            "run the same command to resume")

    def _write_index(self, gen: int) -> None:
        text = json.dumps({"gen": gen, "direct": self.direct, **self.layout.to_json()})
        tmp = self.path(gen, ".json.tmp")
        tmp.write_text(text)
        os.replace(tmp, self.path(gen, ".json"))

    # -- the step ------------------------------------------------------------------------
    def _segments(self, chunk: Chunk) -> list[tuple[int, int, int]]:
        n = chunk.stop - chunk.start
        return [(s * self.layout.region + chunk.start, s * self.chunk_bytes, n)
                for s in range(len(self.layout.sections))]

    def _queue_reads(self, gen: int, fd: int, after: list[threading.Event] | None,
                     order: str = "forward", gate: threading.Event | None = None) -> None:
        """Queue the reads of generation `gen`'s chunks for the next update, in its order;
        none starts before `gate` is set."""
        self._reads_cancel = cancel = threading.Event()
        cs = range(len(self.chunks))
        for c in (cs if order == "forward" else reversed(cs)):
            self.pipe.read(_Read((gen, c), fd, self._segments(self.chunks[c]),
                                 after[c] if after else None, cancel, gate))
            gate = None   # one reader takes them in order: the first waits for all
        self._queued = order

    def _drop_reads(self) -> None:
        """Drop the reads queued and not taken (those not done yet skip their I/O)."""
        self._reads_cancel.set()
        self.pipe.drain()
        self._queued = None

    def _raise_if_failed(self) -> None:
        if self.pipe.error is not None:
            raise self._error(self.pipe.error, self.pipe.error_doing)
        if self._behind_error is not None:
            e = self._behind_error
            raise e if isinstance(e, OffloadError) else self._error(e, "updating") from None

    def _new_update(self, settings: list[dict], speculative: bool) -> _Update:
        g, new = self.gen, self.gen + 1
        fd = self._file_for(new)
        n = len(self.chunks)
        u = _Update(g=g, new=new, fd=fd, old_fd=self.fd,
                    before={t: self.state[p]["step"] for t, p in enumerate(self.tensors)},
                    settings=settings, grads={},
                    order=list(reversed(range(n))) if speculative else list(range(n)),
                    written=[threading.Event() for _ in range(n)],
                    computed=[threading.Event() for _ in range(n)]
                    if self.offload_params else None,
                    left=[len(self._chunks_of.get(t, ())) for t in range(len(self.tensors))],
                    kill=self.faults.due("offload-kill", new) if self.faults else None,
                    full=self.faults.due("offload-diskfull", new) if self.faults else None)
        if speculative:
            u.confirmed = False
            u.ready = [threading.Event() for _ in range(n)]
            u.waiting = [sum(1 for t in ts if self._grad_bytes[t]) for ts in self._tensors_in]
            for c, w in enumerate(u.waiting):
                if not w:
                    u.ready[c].set()
        return u

    def _spare_path(self, gen: int) -> Path:
        return self.dir / SPARE if gen < 0 else self.path(gen)

    def _drop_spare(self) -> None:
        with self._spare_lock:
            spare, self._spare = self._spare, None
        if spare is not None:
            os.close(spare[1])
            self._spare_path(spare[0]).unlink(missing_ok=True)

    def _keep_spare(self, gen: int, fd: int) -> bool:
        """Keep the file of generation `gen` (or -1: already named SPARE) to write a later
        generation into, if nothing else is kept and no checkpoint links it; False: not kept."""
        with self._spare_lock:
            if self._spare is not None or self._closed or os.fstat(fd).st_nlink != 1:
                return False
            if gen >= 0:
                os.replace(self.path(gen), self.dir / SPARE)
            self._spare = (-1, fd)
            return True

    def _file_for(self, gen: int) -> int:
        """The file generation `gen` is written into: a dropped speculation's or a replaced
        generation's (its blocks already allocated: rewriting them costs the file system
        nothing, while deleting a generation file frees every block of it, discarding them
        on a disk mounted with `discard`, and a new one is allocated and its extents converted
        as they are written: measured here, the next forward's first layer reads ran 3-5x
        slower for the half second after each deletion), else a new one."""
        with self._spare_lock:
            spare, self._spare = self._spare, None
        if spare is not None:
            sgen, fd = spare
            if sgen == gen:
                return fd
            try:
                os.replace(self._spare_path(sgen), self.path(gen))
                return fd
            except OSError:
                os.close(fd)
                self._spare_path(sgen).unlink(missing_ok=True)
        return self._create(gen)

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

        If an update already ran during backward (`last_backward`) on these very gradients
        (none scaled by clipping or changed since, same settings), it is kept and goes on
        behind training; otherwise it is dropped and the update starts here."""
        if closure is not None:
            raise ValueError("OffloadedAdamW.step takes no closure")
        t0 = time.perf_counter()
        self.wait_behind()
        self._raise_if_failed()
        for fn in self.before_step:
            fn()
        settings = [_adam_kwargs(group) for group in self.param_groups]
        grads = {t: _flat(_local(p.grad)) for t, p in enumerate(self.tensors)
                 if p.grad is not None}
        taken, self._charged = self._charged, set()
        unused = [t for t in taken if t not in grads]   # charged, and no gradient came
        if unused:
            self._give_back(sum(self._grad_bytes[t] for t in unused))
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
            with self._room_cv:
                u.taken, u.confirmed = taken, True
                self._room += sum(self._grad_bytes[t] for t in u.used if t in taken)
                self._room_cv.notify_all()
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
    def last_backward(self) -> None:
        """The engine is about to run the step's last backward: with the parameters on disk,
        start updating each chunk as soon as its gradients are final (`_final`), on the bet
        that clipping will leave them as they are (it did last step). `step()` keeps the
        result; clipping (`clipping`), a changed gradient (`gradients_changed`) or a skipped
        step drop it, and the update then runs as without speculation."""
        if not (self.asynchronous and self.speculate and self._speculate_next) \
                or self._spec is not None or self._closed:
            return
        if self._queued == "forward":   # the last step did not expect this
            return
        self._raise_if_failed()
        if self._queued is None:
            self._queue_reads(self.gen, self.fd, self._written, "reverse")
        u = self._new_update([_adam_kwargs(group) for group in self.param_groups],
                             speculative=True)
        u.after, self._spec = self._behind, u
        threading.Thread(target=self._run_behind, args=(u,), name="myria-offload-speculate",
                         daemon=True).start()

    def _final(self, t: int) -> None:
        """Backward (post-accumulate hook): tensor `t`'s gradient has accumulated."""
        self._charge(t)
        u = self._spec
        if u is None or u.cancelled or t in u.ptr or self.tensors[t].grad is None:
            return
        flat = _flat(_local(self.tensors[t].grad))
        u.grads[t], u.ptr[t] = flat, flat.data_ptr()
        for c in self._chunks_of.get(t, ()):
            u.waiting[c] -= 1
            if u.waiting[c] == 0:
                u.ready[c].set()

    def clipping(self, scaled: bool) -> None:
        """The engine's clip: the gradients are about to be scaled (or not). Scaled: a
        speculation stops before they change and is dropped; the next step speculates only if
        this one was not clipped."""
        if scaled:
            self._cancel()
        self._speculate_next = not scaled

    def gradients_changed(self) -> None:
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
            self._unhold((u.new, c))
        self._drop_reads()
        if not self._keep_spare(u.new, u.fd):
            os.close(u.fd)
            self.path(u.new).unlink(missing_ok=True)
        self.pipe.stats.spec_cancelled += 1
        self.pipe.stats.spec_cancel_s += time.perf_counter() - t0

    def _used_up(self, u: _Update, t: int) -> None:
        """Every chunk of tensor `t` is updated: its gradient's memory goes back (once the
        update is confirmed: a dropped speculation's gradients are used again)."""
        if u.grads.pop(t, None) is None:
            return
        with self._room_cv:
            if not u.confirmed:
                u.used.append(t)
            elif t in u.taken:
                self._room += self._grad_bytes[t]
                self._room_cv.notify_all()

    def _update_all(self, u: _Update) -> None:
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
                self._raise_if_failed()
                self._update(chunk, self.pipe.buffers[idx], u.before, u.grads, u.settings)
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
                entry = _Held(self.pipe.buffers[idx])
                with self._held_lock:
                    self._held[key] = entry
                u.computed[c].set()
            segs = self._segments(chunk)
            spare = self._lend(nbytes) if self.asynchronous and u.confirmed else None
            if spare is not None:
                old, view = self.pipe.swap(idx, spare)
                self.pipe.release(idx)
                job = _Write(u.new, u.fd, -1, segs, u.written[c], fail, view=view,
                             finished=lambda key=key, b=old, e=entry: self._pooled(key, b, e))
                del view, old, spare
            else:
                job = _Write(u.new, u.fd, idx, segs, u.written[c], fail,
                             finished=(lambda key=key, e=entry: self._unhold(key, e))
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
        self._committed = self.pipe.call(lambda: self._commit(u.new, u.fd, u.old_fd, u.g),
                                         f"committing generation {u.new}")

    def _run_behind(self, u: _Update) -> None:
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

    # -- gradient memory lent to write-behind buffers -------------------------------------
    def charge(self, tensors) -> None:
        """Backward is about to produce the gradients of `tensors` (offload_params.py, before
        a unit's backward): count them now, so their memory is free before they exist."""
        for t in tensors:
            self._charge(t)

    def _charge(self, t: int) -> None:
        """Backward (a gradient about to be produced, or accumulated): count it once; drop
        pooled write-behind buffers, and wait for those being written, while they hold the
        memory it needs (exposed time, on the training thread's timeline)."""
        if t in self._charged or not self._grad_bytes[t]:
            return
        self._charged.add(t)
        dropped: list[tuple[tuple[int, int], _Held | None]] = []
        t0, ev = 0.0, None
        with self._room_cv:
            self._room -= self._grad_bytes[t]
            while self._room < 0 and (self._pool or self._inflight):
                if self._pool:
                    dropped.append(self._drop_pooled())
                elif self.pipe.error is not None:
                    break
                else:
                    if ev is None:
                        t0 = time.perf_counter()
                        ev = events.current().begin("offload_wait", "offload")
                    self._room_cv.wait(0.5)
        for key, entry in dropped:
            self._unhold(key, entry)
        if ev is not None:
            events.current().end(ev)
            self.pipe.stats.room_wait_s += time.perf_counter() - t0

    def _lend(self, n: int) -> torch.Tensor | None:
        """A buffer for a ring slot whose chunk then waits for its write off the ring: a pooled
        one, or a new one while the gradient memory given back allows; None otherwise."""
        with self._room_cv:
            if self._pool:
                buf, key, entry = self._pool.pop()
            elif self._room >= n:
                buf, key, entry = None, None, None
                self._room -= n
                self._extra += n
            else:
                return None
            self._inflight += 1
            st = self.pipe.stats
            st.behind_buffers += 1
            st.behind_peak_bytes = max(st.behind_peak_bytes, self._extra)
        if key is not None:
            self._unhold(key, entry)
        return buf if buf is not None else aligned_buffer(n)

    def _drop_pooled(self) -> tuple[tuple[int, int], _Held | None]:
        """With `_room_cv` held: free a pooled buffer's memory; returns its chunk's key and
        entry (the caller unholds it outside the lock, which frees the buffer)."""
        _, key, entry = self._pool.pop()
        n = self.pipe.buffers[0].numel()
        self._room += n
        self._extra -= n
        return key, entry

    def _give_back(self, n: int) -> None:
        with self._room_cv:
            self._room += n
            self._room_cv.notify_all()

    def _pooled(self, key: tuple[int, int], buf: torch.Tensor, entry: _Held | None) -> None:
        """Writer thread, a write-behind chunk written: its buffer is kept for reuse, and the
        chunk stays readable from it until then."""
        with self._room_cv:
            self._pool.append((buf, key, entry))
            self._inflight -= 1
            self._room_cv.notify_all()

    def _unhold(self, key: tuple[int, int], entry: _Held | None = None) -> None:
        """A chunk's buffer is about to hold something else: no longer read from memory.
        With `entry`: only that one (a newer entry of the same chunk stays readable)."""
        with self._held_lock:
            if entry is None:
                entry = self._held.pop(key, None)
            elif self._held.get(key) is entry:
                del self._held[key]
        if entry is not None:
            with entry.lock:
                entry.valid = False
                entry.buf = None

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._cancel()   # no step took the gradients (a skipped step): nor does a speculation
        if set_to_none and self._charged:   # dropped without a step (a skipped step)
            n = sum(self._grad_bytes[t] for t in self._charged)
            self._charged = set()
            self._give_back(n)
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
        s = self.layout.section("param")
        base = s * self.layout.region
        x, end, copied = off - base, off - base + n, 0
        while x < end:
            c = bisect.bisect_right(self._starts, x) - 1
            chunk = self.chunks[c]
            m = min(end, chunk.stop) - x
            at = soff + x - (off - base)
            entry = self._held.get((gen, c))
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
                _full_io(os.preadv, fd, view[at:at + m], base + x)
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
        from torch.optim.adam import adam

        lists: dict[int, tuple[list, list, list, list, list]] = {}
        s_param = self.layout.section("param") if self.offload_params else -1
        s_m, s_v = self.layout.section("exp_avg"), self.layout.section("exp_avg_sq")
        for pc in chunk.pieces:
            if pc.index not in grads:
                continue
            p = self.tensors[pc.index]
            dtype, isz = self.layout.dtypes[pc.index], self.layout.itemsizes[pc.index]
            n = (pc.stop - pc.start) * isz

            def view(s: int, at: int = pc.offset, n: int = n, dtype=dtype) -> torch.Tensor:
                at += s * self.chunk_bytes
                return buf[at:at + n].view(dtype)

            param = view(s_param) if s_param >= 0 else \
                _flat(_local(p).detach())[pc.start:pc.stop]
            grad = grads[pc.index][pc.start:pc.stop]
            step = before[pc.index].clone()
            ls = lists.setdefault(self.group_of[pc.index], ([], [], [], [], []))
            for lst, x in zip(ls, (param, grad, view(s_m), view(s_v), step)):
                lst.append(x)
        for gi, (params, grads_, m, v, steps) in lists.items():
            adam(params, grads_, m, v, [], steps, **settings[gi])

    def _commit(self, gen: int, fd: int, old_fd: int, old: int) -> None:
        """Writer thread, after the last chunk of `gen`: sync it, then drop generation `old`."""
        os.fdatasync(fd)
        self._write_index(gen)
        self.path(old, ".json").unlink(missing_ok=True)
        if not self._keep_spare(old, old_fd):   # linked into a checkpoint: the link keeps it
            os.close(old_fd)
            self.path(old).unlink(missing_ok=True)

    def flush(self) -> None:
        """Wait for the trailing writes of the last step (its generation is then committed)."""
        t0 = time.perf_counter()
        if self._behind is not None:
            self._behind.wait()
        if self._committed is not None:
            self._committed.wait()
        self.pipe.stats.flush_s += time.perf_counter() - t0
        self._raise_if_failed()

    # -- checkpoints ---------------------------------------------------------------------
    def checkpoint_files(self, prefix: str) -> dict[str, Path]:
        """{name in the checkpoint: file} of the committed state (after flushing)."""
        self.flush()
        return {f"{prefix}.bin": self.path(self.gen), f"{prefix}.json": self.path(self.gen,
                                                                                   ".json")}

    def load_files(self, ckpt: Path, prefix: str) -> None:
        """Make the checkpoint's state files this optimizer's current generation."""
        src, idx = ckpt / f"{prefix}.bin", ckpt / f"{prefix}.json"
        if not src.exists() or not idx.exists():
            raise CheckpointError(f"checkpoint {ckpt} has no offloaded optimizer state "
                                  f"{prefix}.bin: it was saved with another parallel.offload "
                                  "setting or layout; resume with the settings it was saved with")
        info = json.loads(idx.read_text())
        want = self.layout.to_json()
        if {k: info.get(k) for k in want} != want:
            raise CheckpointError(
                f"checkpoint {ckpt}: the offloaded optimizer state {prefix}.bin was saved for "
                "other local tensors (another layout, model or parallel.offload_params); "
                "resume with the layout it was saved with")
        self._cancel()
        self.flush()
        for fn in self.before_step:   # parameters loaded or loading are of the replaced state
            fn()
        self._drop_reads()
        self._drop_spare()
        self._written = self._computed = None
        with self._room_cv:   # chunks kept in memory are of the state being replaced
            while self._pool:
                self._drop_pooled()
        for key in list(self._held):
            self._unhold(key)
        gen = int(info["gen"])
        try:
            if gen != self.gen:
                self.path(gen).unlink(missing_ok=True)
            how = link_or_copy(src, self.path(gen, ".bin.tmp"))
            os.replace(self.path(gen, ".bin.tmp"), self.path(gen))
            fd = open_file(self.path(gen), os.O_RDWR, self.direct)
        except OSError as e:
            raise self._error(e, f"restoring {src}") from None
        os.close(self.fd)
        if gen != self.gen:
            self.path(self.gen).unlink(missing_ok=True)
            self.path(self.gen, ".json").unlink(missing_ok=True)
        self.gen, self.fd = gen, fd
        self._write_index(gen)
        log.debug("offload: restored generation %d from %s (%s)", gen, src, how)

    def close(self) -> None:
        """Finish the trailing writes and stop the threads (idempotent, never raises)."""
        if self._closed:
            return
        self._closed = True
        try:
            self._cancel()
            self._drop_spare()
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
                 file_bytes=self.layout.file_bytes, budget_bytes=self.budget,
                 peak_rss_bytes=peak_rss(), rss_bytes=current_rss(), time=time.time())
        try:
            self.stats_file.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.stats_file.with_name(self.stats_file.name + ".tmp")
            tmp.write_text(json.dumps(s, indent=1))
            os.replace(tmp, self.stats_file)
        except OSError:
            pass


# -- the rank's tier ---------------------------------------------------------------------------
def keep_heap_small(threshold: int = 1 << 20) -> bool:
    """Serve blocks of `threshold` bytes and more straight from mmap, so freed tensors go back
    to the OS. glibc raises its mmap threshold to the size of each freed large block (up to 32
    MiB); layer-sized tensors then come from heap arenas that keep what is freed: 0.4 GB of peak
    memory above the plan in bench/offload.py, gone with a fixed threshold (mallopt
    M_MMAP_THRESHOLD, which also stops the adjustment). glibc only; False elsewhere."""
    import ctypes

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


def local_sizes(parts: list[nn.Module]) -> tuple[int, int, int]:
    """(parameters this rank holds, the largest transformer block's, the largest of the
    embeddings, the final norm with the output layer, and a block), local shards."""
    seen: set[int] = set()
    total = 0
    for part in parts:
        for p in part.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                total += _local(p).numel()
    layer = ends = 0
    count = lambda mods: sum(_local(p).numel() for m in mods if m is not None  # noqa: E731
                             for p in m.parameters())
    for part in parts:
        for block in getattr(part, "layers", {}).values():
            layer = max(layer, count([block]))
        ends = max(ends, count([getattr(part, "tok_embeddings", None),
                                getattr(part, "pos_embeddings", None)]),
                   count([getattr(part, "norm", None), getattr(part, "output", None)]))
    return total, layer, max(layer, ends)


@dataclass
class Offload:
    """The nvme tier of one rank: one OffloadedAdamW per model part, sharing the budget."""

    optimizers: list[OffloadedAdamW]
    plan: MemoryPlan
    rank: int
    directory: Path
    parts: list[nn.Module] = field(default_factory=list)

    @classmethod
    def build(cls, cfg, parts: list[nn.Module], layout: dict[str, int],
              run_dir: str | Path | None, rank: int) -> Offload:
        from myria.faults import FaultInjector
        from myria.optim import param_groups

        par, o = cfg.parallel, cfg.optimizer
        if o.name != "adamw":
            raise ConfigError(f"parallel.offload = 'nvme' supports optimizer.name = 'adamw', not "
                              f"{o.name!r}")
        root = offload_root(cfg, run_dir)
        directory = root / f"rank{rank:05d}"
        total, layer, unit = local_sizes(parts)
        itemsize = next(iter(parts[0].parameters())).element_size()
        plan = plan_memory(cfg, total, layer, itemsize, activation_bytes(cfg, layout), unit)
        try:
            directory.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise OffloadError(f"parallel.offload_dir {str(root)!r} is not writable: "
                               f"{e.strerror or e}") from None
        if not os.access(directory, os.W_OK):
            raise OffloadError(f"parallel.offload_dir {str(root)!r} is not writable")
        direct = probe_direct(directory)
        faults = FaultInjector(run_dir, rank) if run_dir is not None else None
        stats = rundir.offload_stats_file(run_dir, rank) if run_dir is not None else None
        n = len(parts)
        chunk = max(ALIGN, plan.chunk_bytes // n // ALIGN * ALIGN)
        opts = []
        for i, part in enumerate(parts):
            sf = stats if stats is None or n == 1 else stats.with_name(f"{stats.stem}.part{i}.json")
            shapes = order = None
            if par.offload_params:  # the part is still on the meta device (Engine)
                from myria.train.offload_params import placeholders, units_of
                true_shape = placeholders(part, torch.device("cpu"))
            groups = param_groups(part, o.weight_decay)
            if par.offload_params:
                flat = [p for g in groups for p in g["params"]]
                shapes = [true_shape[id(p)] for p in flat]
                # the files in forward order of the units, each unit's tensors together (its
                # norms too, which AdamW's groups put last): the next forward then follows
                # the update chunk by chunk instead of waiting for its last chunk
                where = {id(p): t for t, p in enumerate(flat)}
                order = [where[id(p)] for _, mods in units_of(part) for m in mods
                         for p in m.parameters()]
            kinds = {hasattr(p, "_local_tensor") for g in groups for p in g["params"]}
            opt = OffloadedAdamW(
                groups, directory / f"part{i}", lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps,
                foreach=len(kinds) < 2, buffers=plan.buffers, chunk_bytes=chunk,
                direct=direct, offload_params=par.offload_params, faults=faults,
                stats_file=sf, budget=plan.budget, shapes=shapes, order=order)
            if par.offload_params:
                from myria.train.offload_params import ParamStreamer
                opt.streamer = ParamStreamer(part, opt, cfg.training.seed)
            opts.append(opt)
        return cls(opts, plan, rank, directory, parts)

    def names(self, i: int) -> str:
        return f"{CKPT_PREFIX}/rank{self.rank:05d}.part{i}"

    def checkpoint_files(self) -> dict[str, Path]:
        files: dict[str, Path] = {}
        for i, opt in enumerate(self.optimizers):
            files.update(opt.checkpoint_files(self.names(i)))
        return files

    def load_files(self, ckpt: Path) -> None:
        for i, opt in enumerate(self.optimizers):
            opt.load_files(ckpt, self.names(i))

    def file_backed_state(self) -> dict[str, torch.Tensor]:
        """Under offload_params: {parameter name: its committed value, memory-mapped}."""
        from myria.models.init import canonical_name
        from myria.train.offload_params import file_tensor

        out = {}
        for part, opt in zip(self.parts, self.optimizers):
            if opt.streamer is None:
                continue
            opt.flush()
            index = {id(p): t for t, p in enumerate(opt.tensors)}
            for name, p in part.named_parameters():
                out[canonical_name(name)] = file_tensor(opt, index[id(p)])
        return out

    def close(self) -> None:
        for opt in self.optimizers:
            try:
                opt.close()
            except Exception as e:  # never hide the error that stopped training
                log.error("offload: closing %s: %s", opt.dir, e)


def offload_root(cfg, run_dir: str | Path | None) -> Path:
    """The offload directory: parallel.offload_dir, or RUN_DIR/offload."""
    if cfg.parallel.offload_dir:
        return Path(cfg.parallel.offload_dir)
    if run_dir is None:
        raise ConfigError("parallel.offload = 'nvme' needs parallel.offload_dir (or a run "
                          "directory to put RUN_DIR/offload in)")
    return Path(run_dir) / rundir.OFFLOAD_DIR


def check_layout(cfg, layout: dict[str, int], device_type: str = "cpu") -> None:
    """What each offload tier supports, as one-line ConfigErrors (before training starts)."""
    par, t = cfg.parallel, cfg.training
    shard = layout["dp"] * layout["cp"]
    if par.offload_tier == "cpu" and (t.data_parallel == "ddp"
                                      or (shard <= 1 and device_type != "cuda")):
        raise ConfigError("parallel.offload = 'cpu' is FSDP2's CPUOffloadPolicy: it needs "
                          "training.data_parallel = 'fsdp' or 'zero2' on more than one rank "
                          "(or on one GPU); on one CPU process use parallel.offload = 'nvme'")
    if par.offload_tier == "nvme" and device_type != "cpu":
        # the moments sit in host buffers: the update would need a per-chunk copy to the device
        # (or a host-side update, as ZeRO-Offload does), not written yet (docs/offload.md)
        raise ConfigError(f"parallel.offload = 'nvme' runs on CPU in this version, not on "
                          f"{device_type}; use parallel.offload = 'cpu' (FSDP2's host offload)")
    if par.offload_tier == "nvme" and cfg.optimizer.name != "adamw":
        raise ConfigError(f"parallel.offload = 'nvme' supports optimizer.name = 'adamw', not "
                          f"{cfg.optimizer.name!r}")
    if par.offload_params:
        many = {k: layout[k] for k in ("dp", "tp", "pp", "cp", "ep") if layout[k] > 1}
        if many:
            raise ConfigError("parallel.offload_params = true runs on one process (no "
                              "data, tensor, pipeline, context or expert parallelism), not "
                              + ", ".join(f"{k}={v}" for k, v in many.items()))
        if cfg.model.tie_embeddings or par.compile or device_type != "cpu":
            raise ConfigError("parallel.offload_params = true runs on CPU without "
                              "model.tie_embeddings or parallel.compile in this version")
        if par.activation_checkpoint == "none":
            # a dropped block is read back into another slab: what autograd saved in forward
            # (views of the weights) would point at other data; recomputation re-reads them
            raise ConfigError("parallel.offload_params = true needs "
                              "parallel.activation_checkpoint = 'full' or 'selective' (each "
                              "block's forward is recomputed from the parameters read back)")
    plan_for_config(cfg, layout)  # a budget too small: one line before anything starts


def check_checkpoint(path: Path, meta: dict, offloaded: bool) -> None:
    """CheckpointError (one line) when a checkpoint's optimizer state is not where this run
    keeps it: in offload files (parallel.offload = nvme) or in the DCP shards."""
    has = any(name.startswith(CKPT_PREFIX + "/") for name in meta.get("files", {}))
    if has and not offloaded:
        raise CheckpointError(f"checkpoint {path} keeps its optimizer state in offload files "
                              "(saved with parallel.offload = 'nvme'); resume it with "
                              "parallel.offload = 'nvme'")
    if offloaded and not has:
        raise CheckpointError(f"checkpoint {path} keeps its optimizer state in memory shards "
                              "(saved without parallel.offload = 'nvme'); resume it with the "
                              "parallel.offload setting it was saved with")
