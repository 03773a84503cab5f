"""Worker-side heartbeats: a daemon thread reports this rank's progress to the supervisor's store.

Every `heartbeat_s` seconds each worker writes one record (`myria.observe.heartbeat_store`: the
store, its keys and the record, shared with the supervisor): rank, attempt, step, phase, the
collective it is in or last issued, tokens/s, bytes communicated, memory in use. From them the
supervisor tells a dead or frozen process, a hang and a silent rank apart.
`Heartbeat.phase(name)` is the loop's one call to mark a phase: it tells the goodput ledger (when
given one) and the supervisor now and, for the phases the event timer also times (`TIMED`),
returns the timer's span to enter.
Collectives are counted on the main thread from `myria.observe.comm`; what bypasses it (DDP's
C++ reducer, DTensor's functional collectives) is not counted.

Without MYRIA_HEARTBEAT (`myria train` alone) progress is tracked but nothing is sent. When the
supervisor's store goes away, the sender stops and, unless the parent-death signal already did
(`myria.train.launch.stop_with_launcher`), asks its process to stop at the end of the step with
a checkpoint (SIGTERM), in one log line.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
from typing import Any

from myria import rundir
from myria.observe import comm, events
from myria.observe import heartbeat_store as store_protocol
from myria.observe.goodput import Ledger

log = logging.getLogger("myria")

# spans of the event timer that a heartbeat phase of the same moment opens (heartbeat phase ->
# event name and category): one `phase()` call marks both
TIMED = {"data": ("data_wait", "data"), "grad-clip": ("grad_clip", "compute"),
         "snapshot-wait": ("snapshot_wait", "ckpt"), "optimizer": ("optimizer", "compute"),
         "checkpoint": ("checkpoint_save", "ckpt")}


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


# -- progress --------------------------------------------------------------------------------
def memory_in_use() -> int:
    """Bytes in use by this process: CUDA allocations on GPU, else the resident set."""
    try:
        import torch
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            return int(torch.cuda.memory_allocated())
    except Exception:
        pass
    try:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        import resource
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class Progress(comm.Subscriber):
    """This rank's progress, updated by the training loop and by `myria.observe.comm` (the
    collectives of the main thread), read by the heartbeat thread.

    Plain attribute writes (atomic under the GIL); `progress` counts every phase change, so
    the supervisor sees movement even within a long step.
    """

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.step = 0
        self.phase = "init"
        self.phase_since = time.time()
        self.progress = 0
        self.collective = ""
        self.in_collective = False
        self.collectives = 0
        self.comm_bytes = 0
        self.step_bytes = 0
        self.tokens_per_s = 0.0
        self.resumed_from = -1        # the step this process started from, once known
        self.first_step_at = 0.0      # wall time of this process's first finished step
        self._step_start_bytes = 0
        self._main = threading.main_thread().ident

    # comm.Subscriber: the collective this rank is in or last issued, and its bytes
    def started(self, op: comm.Op) -> None:
        if op.thread == self._main:
            self.collective = op.name
            self.collectives += 1
            self.comm_bytes += op.bytes
            self.in_collective = True

    def returned(self, op: comm.Op) -> None:
        if op.thread == self._main:
            self.in_collective = False

    def set_phase(self, name: str) -> None:
        self.phase = name
        self.phase_since = time.time()
        self.progress += 1

    def step_done(self, step: int, tokens_per_s: float) -> None:
        """Record a finished optimizer step and the bytes it communicated."""
        self.step = step
        if not self.first_step_at:
            self.first_step_at = time.time()
        self.tokens_per_s = tokens_per_s
        self.step_bytes = self.comm_bytes - self._step_start_bytes
        self._step_start_bytes = self.comm_bytes
        self.progress += 1

    def record(self, **more: Any) -> dict[str, Any]:
        return dict(
            rank=self.rank, host=socket.gethostname(), pid=os.getpid(), time=time.time(),
            step=self.step, phase=self.phase, phase_s=round(time.time() - self.phase_since, 3),
            progress=self.progress, collective=self.collective,
            in_collective=self.in_collective, collectives=self.collectives,
            tokens_per_s=self.tokens_per_s, step_bytes=self.step_bytes,
            comm_bytes=self.comm_bytes, mem_bytes=memory_in_use(),
            resumed_from=self.resumed_from, first_step_at=self.first_step_at, **more)


# -- the sender ------------------------------------------------------------------------------
class Heartbeat:
    """Progress of this rank plus the daemon thread that sends it every `period_s`; `ledger`
    (replaceable: a new attempt in-job starts a new one) is told each phase, the resume and each
    finished step before the supervisor."""

    def __init__(self, rank: int, store: store_protocol.HeartbeatStore | None = None,
                 period_s: float = 1.0, job: str = "local", ledger: Ledger | None = None) -> None:
        self.progress = Progress(rank)
        self.ledger = ledger
        self.store = store
        self.period_s = period_s
        self.job = job
        self.attempt = rundir.job_attempt()   # what the supervisor matches records by
        self.sent = 0
        self.failures = 0
        self.lost = False  # the supervisor's store went away: nothing more is sent
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if store is not None:
            comm.subscribe(self.progress)
            self._thread = threading.Thread(target=self._run, name="myria-heartbeat",
                                            daemon=True)
            self._thread.start()

    # the loop's hooks
    def phase(self, name: str):
        """Mark phase `name` for the supervisor now, and return the event timer's span of the
        same moment (`TIMED`) to enter: `with hb.phase("optimizer"): ...`. A phase the timer
        does not time returns a context that does nothing, so a plain call marks it too."""
        if self.ledger is not None:
            self.ledger.phase(name)
        self.progress.set_phase(name)
        timed = TIMED.get(name)
        return events.current().span(*timed) if timed else contextlib.nullcontext()

    def step_done(self, step: int, tokens_per_s: float) -> None:
        if self.ledger is not None:
            self.ledger.step_done(step)
        self.progress.step_done(step, tokens_per_s)

    def resumed(self, step: int) -> None:
        """Record the step training starts from (0 for a fresh run)."""
        if self.ledger is not None:
            self.ledger.resumed(step)
        self.progress.step = step
        self.progress.resumed_from = step
        self.progress.progress += 1

    def send(self) -> None:
        if self.store is None:
            return
        rec = self.progress.record(attempt=self.attempt, seq=self.sent)
        self.store.put(store_protocol.key(self.job, self.progress.rank), store_protocol.encode(rec))
        self.sent += 1

    def _run(self) -> None:
        from myria.train.launch import launcher_gone

        while True:
            if launcher_gone():  # its store went with it: a send would print a C++ stack
                self.lost = True
                return
            try:
                self.send()
            except Exception as e:  # the store may be gone; keep training, retry next period
                self.failures += 1
                if self._supervisor_gone(e):
                    return
                if self.failures in (1, 10, 100):
                    log.warning("heartbeat of rank %d not sent (%d failures): %s",
                                self.progress.rank, self.failures, _first_line(e))
            if self._stop.wait(self.period_s):
                return

    def _supervisor_gone(self, e: Exception) -> bool:
        """A lost connection to the supervisor's own TCPStore means the supervisor ended: stop
        sending (each try would print a C++ stack) and stop training cleanly at the end of
        this step (SIGTERM: a checkpoint, then exit), unless the launcher's death already did
        that (myria.train.launch.stop_with_launcher)."""
        if not isinstance(self.store, store_protocol.TCPHeartbeatStore) or not any(
                m in str(e) for m in store_protocol.LOST_CONNECTION):
            return False
        self.lost = True
        from myria.train.launch import launcher_gone, stop_once

        time.sleep(min(2.0, 2 * self.period_s))  # the parent-death signal comes with the exit
        sent = not launcher_gone() and stop_once()
        log.warning("rank %d: the supervisor's heartbeat store is gone (%s)%s",
                    self.progress.rank, _first_line(e),
                    ": stopping (after the current step, with a checkpoint; at once if no step "
                    "has begun)" if sent else "")
        return True

    def close(self, phase: str = "exit") -> None:
        """Send a last heartbeat with `phase` and stop the thread."""
        self.progress.set_phase(phase)
        comm.unsubscribe(self.progress)
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=max(1.0, 2 * self.period_s))
            try:
                if not self.lost:
                    self.send()
            except Exception:
                pass
        if self.store is not None:
            self.store.close()


def start(rank: int, ledger: Ledger | None = None) -> Heartbeat:
    """The heartbeat of this worker (telling `ledger` too), sending if the supervisor gave a
    store in the environment."""
    url = os.environ.get(store_protocol.ENV_STORE)
    period = float(os.environ.get(store_protocol.ENV_PERIOD, 1.0))
    if not url:
        return Heartbeat(rank, ledger=ledger)
    store = store_protocol.open_store(url, timeout_s=max(10.0, 5 * period),
                                      ttl_s=max(60.0, 30 * period))
    return Heartbeat(rank, store, period, os.environ.get(store_protocol.ENV_JOB, "local"), ledger)
