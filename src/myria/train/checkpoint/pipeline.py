"""Two-stage distributed checkpoints: snapshot to host memory, write in the background, commit.

The directory layout, manifests, quarantine and retention are `myria.train.checkpoint.store`'s
(torch-free); `CheckpointManager` is a store that also saves and loads. A save has two stages,
as in MegaScale (§4.5.3) and torchtitan's asynchronous checkpointing:

1. *Snapshot*: each rank copies its shard of the model and optimizer state into host buffers
   allocated once and reused (pinned memory on GPU). With `overlap`, the copy runs on a helper
   thread during the next step's data loading, forward and backward, which do not change the
   weights (on a GPU on its own stream, so the copy runs beside their kernels); the loop waits
   for it only in `before_update()`, just before the optimizer step.
2. *Persist*: a background thread writes the snapshot with DCP through its own gloo process
   group (so it never interleaves with the training collectives), fsyncs every file, checksums
   them, and the ranks vote. If every rank succeeded, rank 0 commits (`CheckpointStore.commit`).

**End to end.** A checkpoint is committed only if the bytes it copied are the bytes the
optimizer wrote: each tensor's expected checksum is taken from the at-rest ledger (`recorded`,
myria.train.sdc) or, for a tensor the ledger does not track, from the tensor itself when the
save starts; the host buffers are checked against it once copied and again after the files are
written. A mismatch fails the save on every rank (the vote); the files already written go to
`quarantine/`, never to a checkpoint. A fault found after a commit is handled by
`store.mark_suspect`.

At most one save is in flight. A failed save is logged in one line (a full disk reads "No space
left on device", with what a checkpoint needs and what is free), its temporary directory
removed, older checkpoints untouched, and training goes on unless `max_failures` saves in a row
have failed (`checkpoint.max_failed_saves`): then the save raises `SaveError`, as
`require_saved` does when the final save (or the save of a requested stop) was not committed. A
save that would be the `max_failures`-th failure in a row is waited for before training goes on.

Resuming picks the newest checkpoint that every rank verifies (each checksums its share of the
files); when checkpoints exist but none verifies, resuming raises a CheckpointError naming them
unless `allow_fresh` (`checkpoint.start_fresh`). Loading is one read per group of ranks holding
the same shard: the group's first rank reads it and broadcasts it to the others (MegaScale
§4.5.3); `bytes_read` counts what this rank read. Loading executes nothing from the checkpoint
(DCP reads tensors with `weights_only=True`; the rest is JSON).
"""

from __future__ import annotations

import contextlib
import copy
import errno
import json
import logging
import os
import shutil
import threading
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor

from myria.errors import CheckpointError, first_line
from myria.fsutil import atomic_write, file_crc32, link_or_copy
from myria.observe import events
from myria.tensors import local_shard
from myria.train import checksums
from myria.train.checkpoint.load import load_state
from myria.train.checkpoint.store import (
    MANIFEST_VERSION,
    CheckpointStore,
    checkpoint_bytes,
    describe_error,
    free_bytes,
    size_text,
)
from myria.train.state import (
    flatten,
    rank_and_world,
    rng_state,
    unflatten,
    unique_bytes,
)


class SnapshotMismatch(Exception):
    """A save's copy differs from the state the optimizer wrote (the save is not committed)."""



class SaveError(CheckpointError):
    """Checkpoints could not be saved (a full disk, ...): the run stops, so that no work is
    reported done that was not saved. Exit status 4; the supervisor does not restart it."""

    exit_code = 4


# One process saves and loads with no_dist=True on purpose; DCP warns that it "assumes" so.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or "
                        "uninitialized", category=UserWarning)

log = logging.getLogger("myria")


def _errors_of(e: BaseException):
    """`e`, DCP's per-rank failures in it, and their causes and contexts."""
    seen, todo = set(), [e]
    while todo:
        x = todo.pop()
        if x is None or id(x) in seen:
            continue
        seen.add(id(x))
        yield x
        failures = getattr(x, "failures", None)
        if isinstance(failures, dict):
            for v in failures.values():
                todo.append(v[0] if isinstance(v, tuple) else v)
        todo += [x.__cause__, x.__context__]


# torch's zip writer reports a write that the disk refused as a position mismatch
_ZIP_SHORT_WRITE = "unexpected pos"


def _disk_error(e: BaseException, path: Path, needed: int) -> str | None:
    """The OS's words for a full disk ("No space left on device", "Disk quota exceeded") when
    that is why `e` happened.

    An OSError with ENOSPC/EDQUOT says so itself; torch's "[enforce fail at inline_container.cc]
    unexpected pos" (a short write inside torch.save) counts when `path` has less free space
    than the `needed` bytes."""
    for x in _errors_of(e):
        if isinstance(x, BaseException) and getattr(x, "errno", None) == errno.ENOSPC:
            return os.strerror(errno.ENOSPC)
        if isinstance(x, BaseException) and getattr(x, "errno", None) == errno.EDQUOT:
            return os.strerror(errno.EDQUOT)
        if isinstance(x, BaseException) and _ZIP_SHORT_WRITE in str(x):
            free = free_bytes(path)
            if free is not None and free < needed:
                return os.strerror(errno.ENOSPC)
    return None



def _host_leaf(v: torch.Tensor) -> tuple[Any, torch.Tensor]:
    """A host-memory twin of tensor `v` (DTensor or plain) and its local buffer."""
    local = local_shard(v).detach()
    pin = local.is_cuda
    buf = torch.empty(local.shape, dtype=local.dtype, device="cpu", pin_memory=pin)
    if not isinstance(v, DTensor):
        return buf, buf
    if v.device_mesh.device_type == "cpu":
        twin = DTensor.from_local(buf, v.device_mesh, v.placements, run_check=False,
                                  shape=v.shape, stride=v.stride())
    else:  # a CPU DTensor on a GPU mesh, as DCP's own staging makes (from_local would move it)
        twin = v.detach().to("cpu")
        twin._local_tensor = buf
    return twin, buf   # the local tensor of `twin` (the same storage)


@dataclass
class SaveRecord:
    """What one save cost: the loop's stall, the background time, the outcome."""

    step: int
    bytes: int = 0
    wait_prev_s: float = 0.0       # blocked waiting for the previous save (never two in flight)
    snapshot_s: float = 0.0        # the copy into host buffers
    stall_s: float = 0.0           # total time the training loop was blocked by this save
    persist_s: float = 0.0         # stage 2: write, fsync, checksum, vote, commit
    ok: bool | None = None
    error: str = ""


@dataclass
class _Pending:
    step: int
    flat: dict[tuple, Any]         # host twins and copied non-tensor leaves
    copies: list[tuple[torch.Tensor, torch.Tensor]]  # (live local, host buffer)
    extra: dict[str, Any]
    rng: dict[str, str]
    record: SaveRecord
    linked: list[str] = field(default_factory=list)  # files linked in (offloaded state)
    link_checks: dict = field(default_factory=dict)  # name -> why its file is not as written
    names: list[str] = field(default_factory=list)   # the state key of each copy
    expected: list[int] = field(default_factory=list)  # each copy's checksum (what was written)
    abandoned: bool = False        # `settle` gave up on it: never commit, never remove others'
    deferred: bool = False         # copied by the training thread, as late as possible
    mismatch: str = ""             # the copy differs from what was written (SnapshotMismatch)
    unique: int = 0                # bytes of the checkpoint that only this rank writes (at least)
    snapshot_done: threading.Event = field(default_factory=threading.Event)
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None
    ready: Any = None              # CUDA event: the saved step's writes done (overlapped copy)


class _FaultyWriter(dcp.FileSystemWriter):
    """A DCP writer that runs out of space half-way through its file (the `diskfull` hook)."""

    def write_data(self, plan, planner):
        fut = super().write_data(plan, planner)
        fut.wait()
        for p in Path(self.path).glob("*.distcp"):
            with open(p, "r+b") as fh:
                fh.truncate(p.stat().st_size // 2)
        raise OSError(errno.ENOSPC, "No space left on device (injected fault)")


class CheckpointManager(CheckpointStore):
    """Saves (in two stages), verifies, prunes and loads the checkpoints of one run directory."""

    def __init__(self, directory: str | Path, keep: int = 3, faults=None, *,
                 async_save: bool = False, overlap: bool = False, timeout_s: float = 600.0,
                 max_failures: int = 2, interval: int = 0):
        super().__init__(directory, keep, faults, timeout_s)
        self.interval = interval       # save every `interval` steps (0: only last and stop)
        self.max_failures = max_failures  # failed saves in a row that stop the run; 0: never
        self.failed_in_row = 0
        self.last_failure = ""         # the one-line reason of the newest failed save
        self.disk_full = False         # ... and whether it was a full disk (or quota)
        self.async_save = async_save
        self.overlap = overlap and async_save
        self.history: list[SaveRecord] = []
        self.bytes_read = 0            # from storage by this rank during the last load
        self._leaves: dict[tuple, tuple[Any, torch.Tensor]] = {}
        self._pending: _Pending | None = None
        self._thread: threading.Thread | None = None
        self._stream = None   # the overlapped snapshot's CUDA stream (`_copy_stream`)
        self._pg = None
        # {storage key: checksum} of the state the optimizer wrote (StepGuard.recorded), or
        # None: each copy is then checked against its source as it was when the save started
        self.recorded = None
        rank, world = rank_and_world()
        if world > 1 and async_save:
            # Background saves talk over their own gloo group, never the training group.
            import datetime
            self._pg = dist.new_group(backend="gloo",
                                      timeout=datetime.timedelta(seconds=timeout_s))
        # the name of this manager's temporary directories: rank 0's process, unique
        token = [self.token]
        if world > 1:
            dist.broadcast_object_list(token, src=0, group=self._pg)
        self.token = token[0]
        if rank == 0 and self.dir.is_dir():
            self.remove_stale_tmp()

    def choose_resume(self, allow_fresh: bool = False) -> Path | None:
        """The newest checkpoint that verifies, decided together by all ranks (collective).

        Each rank checks the sizes and the checksums of its share of the files; a checkpoint
        is used only if every rank found its share intact. Damaged ones are quarantined by
        rank 0 and `latest` is pointed at the chosen one. When there were checkpoints but none
        verifies, raises CheckpointError unless `allow_fresh` (then returns None).
        """
        rank, world = rank_and_world()
        chosen = None
        self.drop_suspect()   # before any rank lists the checkpoints
        if world == 1:
            chosen = self.latest_valid()
        else:
            for p in reversed(self.committed()):
                reason = self.verify(p, part=(rank, world))
                reasons: list[str | None] = [None] * world
                dist.all_gather_object(reasons, reason, group=self._pg)
                bad = [r for r in reasons if r is not None]
                if not bad:
                    chosen = p
                    self._verified.add(p.name)
                    break
                if rank == 0:
                    self.quarantine(p, bad[0])
        if rank == 0:
            self.set_latest()
        if world > 1:
            dist.barrier(group=self._pg)  # every rank sees the files rank 0 moved
        if chosen is None:
            damaged = self.unaccepted_quarantine()
            if damaged and not allow_fresh:
                raise CheckpointError(self.all_damaged_message(damaged))
            if damaged and rank == 0:
                self.accept_fresh_start(damaged)
            if world > 1:
                dist.barrier(group=self._pg)
        return chosen

    def drop_suspect(self) -> int | None:
        """Quarantine the checkpoints `mark_suspect` named (rank 0) and forget the mark
        (collective): the step every rank must not roll back past (None: no mark)."""
        rank, world = rank_and_world()
        if rank == 0:
            self.quarantine_incomplete()
        after = self.quarantine_suspect() if rank == 0 else None
        if world > 1:
            box = [after]
            dist.broadcast_object_list(box, src=0, group=self._pg)
            after = box[0]
        return after

    # -- saving ----------------------------------------------------------------------------
    def should_save(self, step: int, last: bool = False, stopping: bool = False) -> bool:
        """Whether to checkpoint after step `step`: the last step, a stop (preemption or
        `stop_after`), or every `interval` steps."""
        return last or stopping or bool(self.interval and step % self.interval == 0)

    def save(self, step: int, target, extra: dict[str, Any]) -> bool:
        """Checkpoint `target.state_dict()` as step `step` (collective).

        `target` has `state_dict()` returning {"model": {...}, "optim": {...}} (the Engine);
        `extra` is JSON state stored in the manifest. Synchronous mode returns whether the
        checkpoint was committed. Asynchronous mode returns True once the save is under way;
        `wait()` gives its outcome.
        """
        t0 = time.perf_counter()
        prev_wait = self._wait_thread()
        self._check_failures(step)
        rec = SaveRecord(step, wait_prev_s=prev_wait)
        self.history.append(rec)
        pending = self._snapshot_refs(step, target, extra, rec)
        self._expect(pending)
        self._link_files(pending, target)
        if not self.async_save:
            self._copy(pending)
            self._persist(pending)
            rec.stall_s = time.perf_counter() - t0
            self._check_failures(step)
            return bool(rec.ok)
        self._pending = pending
        if not self.overlap:
            self._copy(pending)
        else:
            pending.deferred = self._flip_due(step)
            if not pending.deferred and any(src.is_cuda for src, _ in pending.copies):
                pending.ready = torch.cuda.Event()
                pending.ready.record()   # after the optimizer's writes on this thread's stream
        # whether its failure would stop the run, judged before its thread can fail and count
        last_allowed = bool(self.max_failures) and self.failed_in_row + 1 >= self.max_failures
        self._thread = threading.Thread(target=self._background, args=(pending,),
                                        name=f"myria-ckpt-{step}", daemon=True)
        self._thread.start()
        if last_allowed:   # know its outcome before training on
            self._wait_thread()
            rec.stall_s = time.perf_counter() - t0
            self._check_failures(step)
            return bool(rec.ok)
        rec.stall_s = time.perf_counter() - t0
        return True

    def before_update(self) -> float:
        """Block until an overlapped snapshot is copied (call before the optimizer step)."""
        p = self._pending
        if p is None or p.snapshot_done.is_set():
            return 0.0
        t0 = time.perf_counter()
        if p.deferred:
            self._copy(p)
        p.snapshot_done.wait()
        dt = time.perf_counter() - t0
        p.record.stall_s += dt
        return dt

    def wait(self) -> bool | None:
        """Wait for the save in flight; its outcome (None if there was none)."""
        p = self._pending
        self._wait_thread()
        return None if p is None else p.record.ok

    def close(self) -> None:
        """Finish the save in flight (call before the process exits)."""
        self.wait()

    def settle(self, timeout_s: float) -> bool:
        """In-job recovery's failure path (`InJob.keep`), before the process groups are
        aborted: let the save in flight finish, for at most `timeout_s`. Its collectives on
        its gloo group meet the gloo limit of myria.train.peer's `PeerSnapshots.settle`
        (aborted mid-transfer, an operation waits out the group's timeout, 600 s). False:
        it is left behind in its daemon thread and `close` no longer waits for it."""
        t = self._thread
        if t is None:
            return True
        self._copy_deferred()
        t.join(timeout_s)
        if not t.is_alive():
            return True
        if self._pending is not None:   # it must not commit over what comes next
            self._pending.abandoned = True
        self._thread = None
        log.warning("the checkpoint save in flight is not over after %.1f s: left behind",
                    timeout_s)
        return False

    def require_saved(self, step: int) -> None:
        """Wait for the save in flight; raise SaveError if the save of `step` failed (the end of
        a run, or a requested stop: work that was not saved never ends as a success)."""
        self.wait()
        last = self.history[-1] if self.history else None
        if last is None or last.step != step or last.ok:
            return
        raise SaveError(f"training stopped at step {step} but its checkpoint could not be "
                        f"saved: {self.last_failure or last.error}; {self._resume_hint()}")

    def _check_failures(self, step: int) -> None:
        """Raise SaveError once `max_failures` saves in a row have failed (same on every rank:
        each save's outcome is agreed by all)."""
        if not self.max_failures or self.failed_in_row < self.max_failures:
            return
        raise SaveError(f"training stopped at step {step}: {self.failed_in_row} checkpoint "
                        f"saves in a row failed (checkpoint.max_failed_saves = "
                        f"{self.max_failures}; 0 trains on), the newest: {self.last_failure}; "
                        f"{self._resume_hint()}")

    def _resume_hint(self) -> str:
        ckpts = self.committed()
        fix = f"free space in {self.dir}" if self.disk_full else "fix the cause"
        if not ckpts:
            return f"no checkpoint of this run was saved: {fix} and run again (from step 0)"
        return (f"the newest saved checkpoint is {ckpts[-1].name}: {fix} and run the same "
                "command to resume from it")

    def _kept(self, step: int) -> str:
        prev = [p for p in self.committed() if p.name != self.path_for(step).name]
        return (f"the previous checkpoint {prev[-1].name} is kept" if prev else
                "no checkpoint of this run is saved yet")

    def _flip_due(self, step: int) -> bool:
        """Whether a `bitflip` fault hook (target param or optimizer) is due at the start of the
        step that follows the save of `step`: the window an overlapped copy leaves open. The
        copy is then deferred to the last moment (`before_update`, or the end of the run when
        the fault stops it first), so that it always copies the flipped state: the case the
        end-to-end check must catch, made certain rather than left to thread timing."""
        f = self.faults.due("bitflip", step) if self.faults is not None else None
        return f is not None and f.params.get("target") in ("param", "optimizer")

    def _copy_deferred(self) -> None:
        p = self._pending
        if p is not None and p.deferred and not p.snapshot_done.is_set():
            self._copy(p)

    def _wait_thread(self) -> float:
        t0 = time.perf_counter()
        self._copy_deferred()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._pending = None
        return time.perf_counter() - t0

    def _snapshot_refs(self, step: int, target, extra: dict[str, Any],
                       rec: SaveRecord) -> _Pending:
        """Stage 1 bookkeeping: pair each live tensor with its preallocated host buffer."""
        flat = flatten(target.state_dict())
        out: dict[tuple, Any] = {}
        copies = []
        names: list[str] = []
        unique = 0
        for key, v in flat.items():
            if isinstance(v, torch.Tensor):
                unique += unique_bytes(v)
            if getattr(v, "_myria_immutable", False):  # a file never written again: as it is
                out[key] = v
                rec.bytes += v.numel() * v.element_size()
            elif isinstance(v, torch.Tensor):
                local = local_shard(v).detach()
                cached = self._leaves.get(key)
                if cached is None or cached[1].shape != local.shape or \
                        cached[1].dtype != local.dtype:
                    cached = self._leaves[key] = _host_leaf(v)
                out[key] = cached[0]
                copies.append((local, cached[1]))
                names.append("/".join(map(str, key)))
                rec.bytes += local.numel() * local.element_size()
            else:
                out[key] = copy.deepcopy(v)
        return _Pending(step, out, copies, json.loads(json.dumps(extra)), rng_state(), rec,
                        unique=unique, names=names)

    def _expect(self, p: _Pending) -> None:
        """The checksum each copy must have: what the ledger recorded when the optimizer wrote
        it (verified just before the save), else the source's own, now."""
        recorded = self.recorded() if self.recorded is not None else {}
        try:
            with events.current().span("snapshot_expect", "check"):   # bench/integrity.py
                p.expected = checksums.expected_sums(recorded, [src for src, _ in p.copies])
        except BaseException as e:  # the save fails (the vote sees it)
            p.error = e

    def _check_copies(self, p: _Pending, when: str) -> str:
        """Why the host buffers' bytes are not the expected ones ("" when they are)."""
        if len(p.expected) != len(p.copies):
            return ""
        with events.current().span("snapshot_verify", "check"):   # bench/integrity.py
            bad = checksums.differing(p.expected, [dst for _, dst in p.copies])
        if not bad:
            return ""
        return (f"the snapshot differs from the state the optimizer wrote {when} "
                f"({len(bad)} tensor(s), the first {p.names[bad[0]]}): not committed")

    def _check_linked(self, p: _Pending, tmp: Path) -> str:
        """Why a file linked into the checkpoint is not what its writer wrote ("" when each
        is): a fault of the storage between the write and the save is not committed."""
        with events.current().span("linked_verify", "check"):
            for name, check in p.link_checks.items():
                if why := check(tmp / name):
                    return f"{name}: {why}: not committed"
        return ""

    def _link_files(self, p: _Pending, target) -> None:
        """Stage 1 for state kept in files (`target.checkpoint_files()`: the nvme tier's
        optimizer state): link them into the checkpoint now, before the next step replaces
        them (myria.fsutil.link_or_copy: no copy through memory); stage 2 reads each back
        against the checksums its writer took (`target.checkpoint_checks()`, taken now)."""
        files = target.checkpoint_files() if hasattr(target, "checkpoint_files") else {}
        if not files:
            return
        if hasattr(target, "checkpoint_checks"):
            p.link_checks = target.checkpoint_checks()
        tmp = self.tmp_for(p.step)
        try:
            for name, src in files.items():
                (tmp / name).parent.mkdir(parents=True, exist_ok=True)
                link_or_copy(src, tmp / name)
                p.linked.append(name)
                p.record.bytes += (tmp / name).stat().st_size
        except OSError as e:  # the save fails (the vote sees it); training goes on
            p.error = e

    def _copy(self, p: _Pending) -> None:
        t0 = time.perf_counter()
        ev = events.current().begin("snapshot", "ckpt", bytes=p.record.bytes)
        try:
            stream = self._copy_stream(p)
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                for src, dst in p.copies:
                    dst.copy_(src, non_blocking=src.is_cuda)
                    if stream is not None and src.is_cuda:
                        src.record_stream(stream)   # its memory is not reused before the copy
            if stream is not None:
                stream.synchronize()
            elif any(src.is_cuda for src, _ in p.copies):
                torch.cuda.synchronize()
            if p.error is None:   # written all the same: every rank's DCP collectives run
                p.mismatch = self._check_copies(p, "once copied")
        except BaseException as e:  # the writer sees it and fails the save
            p.error = e
        finally:
            p.record.snapshot_s = time.perf_counter() - t0
            events.current().end(ev)
            p.snapshot_done.set()

    def _copy_stream(self, p: _Pending):
        """The CUDA stream an overlapped snapshot copies on (None: the current one). Its own
        stream, waiting only for the saved step's writes (`p.ready`), lets the copy to the host
        run beside the next step's forward and backward instead of between their kernels; the
        optimizer's next writes wait for it (`before_update`)."""
        if p.ready is None:
            return None
        if self._stream is None:
            dev = next(src.device for src, _ in p.copies if src.is_cuda)
            self._stream = torch.cuda.Stream(device=dev)
        self._stream.wait_event(p.ready)
        return self._stream

    def _background(self, p: _Pending) -> None:
        try:
            if p.deferred:   # the training thread copies it (`_flip_due`)
                p.snapshot_done.wait()
            elif not p.snapshot_done.is_set():
                self._copy(p)
            with events.current().span("persist", "ckpt", step_saved=p.step):
                self._persist(p)
        except BaseException as e:  # never let the thread die silently
            p.record.ok, p.record.error = False, describe_error(e)
            self.failed_in_row += 1
            self.last_failure = f"checkpoint of step {p.step} failed: {p.record.error}"
            self.disk_full = False
            log.error("%s; %s", self.last_failure, self._kept(p.step))
        finally:
            p.snapshot_done.set()
            p.done.set()

    def _persist(self, p: _Pending) -> None:
        """Stage 2: write, fsync, checksum, vote, and (rank 0) commit."""
        t0 = time.perf_counter()
        rank, world = rank_and_world()
        final = self.path_for(p.step)
        tmp = self.tmp_for(p.step)
        mine: dict[str, list] = {}
        err: str = ""
        try:
            if p.error is not None:
                raise p.error
            writer_cls = dcp.FileSystemWriter
            if self.faults is not None and (f := self.faults.due("diskfull", p.step)):
                self.faults.mark(f)
                writer_cls = _FaultyWriter
            writer = writer_cls(str(tmp), single_file_per_rank=True, sync_files=True)
            dcp.save(unflatten(p.flat), storage_writer=writer, process_group=self._pg,
                     no_dist=not dist.is_initialized())
            atomic_write(tmp / f"rng_rank{rank:05d}.json", json.dumps(p.rng))
            names = [f"rng_rank{rank:05d}.json", *p.linked]
            names += [q.name for q in tmp.glob(f"__{rank}_*.distcp")]
            if rank == 0 and (tmp / ".metadata").exists():
                names.append(".metadata")
            for name in names:
                crc, _ = file_crc32(tmp / name)
                mine[name] = [(tmp / name).stat().st_size, crc]
            if why := p.mismatch or self._check_copies(p, "after it was written") or \
                    self._check_linked(p, tmp):
                raise SnapshotMismatch(why)
        except BaseException as e:  # a failed save must not end training (DCP raises
            err = describe_error(e)   # CheckpointException, a BaseException)
            disk = _disk_error(e, tmp, p.record.bytes)
            if disk:
                log.debug("checkpoint of step %d: %s", p.step, err)
                err = disk + (" (injected fault)" if "injected fault" in err else "")
        votes: list[Any] = [(err, mine, p.unique)]
        if world > 1:
            votes = [None] * world
            try:
                dist.all_gather_object(votes, (err, mine, p.unique), group=self._pg)
            except Exception as e:
                votes = [(f"vote failed: {first_line(e)}", {}, 0)]
        errors = [(r, v[0]) for r, v in enumerate(votes) if v is None or v[0]]
        if p.abandoned and not errors:   # a newer attempt owns the run directory now
            errors = [(rank, "abandoned by in-job recovery before it committed")]
        committed = not errors
        if committed and rank == 0:
            try:
                self._commit(p, tmp, final, votes, world)
            except Exception as e:
                committed = False
                disk = _disk_error(e, tmp, p.record.bytes)
                errors = [(0, f"commit failed: {disk or describe_error(e)}")]
        if not committed and rank == 0:  # free the space before the other ranks go on
            mismatch = next((why for _, why in errors if SnapshotMismatch.__name__ in str(why)),
                            None)
            if mismatch and tmp.is_dir():   # the evidence, where nothing loads it
                try:
                    self.quarantine(tmp, mismatch, accepted=True)
                except OSError:
                    shutil.rmtree(tmp, ignore_errors=True)
            else:
                shutil.rmtree(tmp, ignore_errors=True)
        if world > 1:
            flag = [committed if rank == 0 else None]
            try:
                dist.broadcast_object_list(flag, src=0, group=self._pg)
                committed = bool(flag[0])
            except Exception:
                committed = False
        if not committed:
            who = errors[0] if errors else (0, "commit failed on rank 0")
            self.failed_in_row += 1
            self.last_failure = self._failure_line(p.step, who, votes)
            stop = self.max_failures and self.failed_in_row >= self.max_failures
            if rank == 0:   # what is known now: whether this failure stops the run
                self.detected(p.step, {"error": self.last_failure},
                              f"save failed; {self._kept(p.step)}"
                              + ("; training stops (checkpoint.max_failed_saves)" if stop
                                 else ""))
            if rank == 0 or (err and len(votes) < world):  # rank 0 speaks for the vote
                log.error("%s; %s%s", self.last_failure, self._kept(p.step),
                          "; training stops" if stop else
                          f" ({self.failed_in_row} failed in a row; the run stops at "
                          f"{self.max_failures}: checkpoint.max_failed_saves)"
                          if self.max_failures else "")
        else:
            self.failed_in_row = 0
        p.record.ok = committed
        p.record.error = "" if committed else str(errors[0][1] if errors else "commit failed")
        p.record.persist_s = time.perf_counter() - t0
        p.done.set()

    def _failure_line(self, step: int, who: tuple[int, str], votes: list) -> str:
        """One line for a failed save: which rank, why, and for a full disk what a checkpoint
        needs and what is free; whether an older checkpoint is kept."""
        rank, why = who
        line = f"checkpoint of step {step} failed on rank {rank}: {why}"
        self.disk_full = why.removeprefix("commit failed: ").startswith(
            (os.strerror(errno.ENOSPC), os.strerror(errno.EDQUOT)))
        if self.disk_full:
            ckpts = [c for c in self.committed() if c.name != self.path_for(step).name]
            need = checkpoint_bytes(ckpts[-1]) if ckpts else None
            if need:
                need_s = f"about {size_text(need)} (the size of {ckpts[-1].name})"
            else:  # each rank's shards, replicated state once
                need_s = "at least " + size_text(sum(v[2] for v in votes if v))
            line += (f" in {self.dir}: a checkpoint needs {need_s}, "
                     f"{size_text(free_bytes(self.dir))} free")
        return line

    def _commit(self, p: _Pending, tmp: Path, final: Path, votes: list, world: int) -> None:
        files: dict[str, int] = {}
        sums: dict[str, str] = {}
        for _, entries, _ in votes:
            for name, (size, crc) in entries.items():
                files[name], sums[name] = size, crc
        meta = dict(p.extra, step=p.step, world_size=world, files=files, checksums=sums,
                    manifest_version=MANIFEST_VERSION)
        self.commit(tmp, final, meta, p.step)

    # -- loading ---------------------------------------------------------------------------
    def load(self, path: Path, target) -> dict[str, Any]:
        """Load `target` (state_dict/load_state_dict) and RNG from `path`; return its meta
        (collective; `myria.train.checkpoint.load.load_state`)."""
        meta, self.bytes_read = load_state(path, target)
        return meta

    def stats(self) -> dict[str, Any]:
        """Save records and bytes read, for logs and benchmarks."""
        return {"saves": [asdict(r) for r in self.history], "bytes_read": self.bytes_read,
                "verify_bytes": self.verify_bytes}

