"""The always-on event timer of a rank: timed spans of compute, communication and I/O.

Every rank records events (name, category, step, microbatch, start, end, arguments) into a list
that a background thread appends to RUN_DIR/events/rankNNNNN.jsonl at the end of each step and
at least every `flush_s` seconds, so the training thread never touches the file, and a rank
killed mid-step (the whole group is, when a supervisor restarts it after a fault) leaves every
step it finished in the file. One JSON object per line:

    {"header": {rank, world, host, pid, attempt, coord: {dp, pp, cp, tp, ep}, layout,
                clock: {...}, groups: {dim: [ranks...]}}}   first, and again at each attempt
    {"n": name, "c": category, "s": step, "m": microbatch, "t0": µs, "t1": µs, "th": thread,
     "a": {...}}                                          one per event

Times are integer microseconds on a clock aligned across ranks: the host's monotonic clock
(never a device synchronisation) mapped to the wall clock at start, minus this rank's offset to
rank 0 (`measure_clock_offset`). Categories: `step`, `compute`, `comm` and `p2p` (subscribed to
`myria.observe.comm`, the one interception), `wait` (blocked in `Work.wait()`), `data`, `ckpt`.
Collectives that bypass `torch.distributed`'s module functions are not seen. What each category
holds, and what is not seen: docs/observability.md, "What is recorded".
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import threading
import time
from pathlib import Path
from typing import Any

from myria import rundir
from myria.fsutil import atomic_write
from myria.observe import comm

_NS = 1000  # ns per µs

class Recorder(comm.Subscriber):
    """One rank's event timer. Thread-safe; cheap enough to stay on (bench/timeline_overhead)."""

    def __init__(self, run_dir: str | Path | None, rank: int, world: int, enabled: bool = True,
                 flush_s: float = 1.0):
        self.enabled = enabled and run_dir is not None
        self.rank, self.world = rank, world
        self.flush_s = flush_s
        self.step = 0
        self._paused = 0   # > 0: inside paused()
        self._events: list[dict] = []
        self._lock = threading.Lock()
        self._open: dict[int, list[dict]] = {}       # thread id -> stack of open spans
        self._last: dict | None = None
        self._seq: dict[tuple, int] = {}
        self._pair_seq: dict[tuple, int] = {}
        self._dims: dict[tuple, str] = {}
        self._threads: dict[int, int] = {}
        self.slow: tuple[float, int] | None = None   # (factor, from step): MYRIA_FAULT slow
        self._mono0 = time.perf_counter_ns()
        self._wall0 = time.time_ns()
        self.offset_us = 0
        self.path = rundir.events_file(run_dir, rank) if self.enabled else None
        self._stop = threading.Event()
        self._wake = threading.Event()   # a step ended: the writer flushes now
        self._writer: threading.Thread | None = None
        self._header: dict | None = None
        self._cuda_ref = None  # (CUDA event, host µs) when compute is timed on the device

    def time_device(self) -> None:
        """Time compute spans with CUDA events (on a GPU): recorded in the stream, resolved by
        the writer thread against a reference event, so the training thread never waits."""
        import torch

        if self.enabled and torch.cuda.is_available():
            ref = torch.cuda.Event(enable_timing=True)
            ref.record()
            ref.synchronize()  # once, at start
            self._cuda_ref = (ref, self.now_us())

    # -- clock -----------------------------------------------------------------------------
    def now_us(self) -> int:
        """Microseconds on the clock shared by all ranks (wall-aligned monotonic - offset)."""
        return self._us(time.perf_counter_ns())

    def _us(self, ns: int) -> int:
        """A `time.perf_counter_ns()` reading on the shared clock, in µs."""
        return (self._wall0 + ns - self._mono0) // _NS - self.offset_us

    # -- lifecycle -------------------------------------------------------------------------
    def start(self, header: dict[str, Any]) -> None:
        """Write the header and start the writer thread (call once the mesh is known)."""
        if not self.enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._header = dict(header, rank=self.rank, world=self.world,
                            host=socket.gethostname(), pid=os.getpid(),
                            clock={"offset_us": self.offset_us, "unit": "us"})
        with open(self.path, "a") as fh:
            fh.write(json.dumps({"header": self._header}) + "\n")
        self._writer = threading.Thread(target=self._write_loop, name="myria-events",
                                        daemon=True)
        self._writer.start()

    def close(self) -> None:
        if self._writer is not None:
            self._stop.set()
            self._wake.set()
            self._writer.join(timeout=10)
            self._writer = None
        self.flush()

    def flush(self) -> None:
        if not self.enabled or self.path is None:
            return
        with self._lock:
            batch, self._events = self._events, []
        for e in batch:  # device-timed spans: resolve their CUDA events here, off the hot path
            cuda = e.pop("_cuda", None)
            if cuda is not None and self._cuda_ref is not None:
                ref, ref_us = self._cuda_ref
                cuda[1].synchronize()
                e["t0"] = ref_us + int(ref.elapsed_time(cuda[0]) * 1000)
                e["t1"] = ref_us + int(ref.elapsed_time(cuda[1]) * 1000)
        if batch:
            with open(self.path, "a") as fh:
                fh.write("".join(json.dumps(e, separators=(",", ":")) + "\n" for e in batch))

    def _write_loop(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self.flush_s)
            self._wake.clear()
            if self._stop.is_set():
                break   # close() flushes what is left
            try:
                self.flush()
            except OSError:
                pass

    # -- recording -------------------------------------------------------------------------
    def _thread(self) -> int:
        ident = threading.get_ident()
        th = self._threads.get(ident)
        if th is None:
            th = self._threads[ident] = len(self._threads)
        return th

    def begin(self, name: str, cat: str, mb: int | None = None, **args) -> dict | None:
        if not self.enabled or self._paused:
            return None
        ev = {"n": name, "c": cat, "s": self.step, "t0": self.now_us(), "th": self._thread()}
        if mb is not None:
            ev["m"] = mb
        if args:
            ev["a"] = args
        self._open.setdefault(threading.get_ident(), []).append(ev)
        return ev

    def end(self, ev: dict | None, t1: int | None = None) -> None:
        if ev is None or "t1" in ev:
            return
        ev["t1"] = self.now_us() if t1 is None else t1
        stack = self._open.get(threading.get_ident())
        if stack and ev in stack:
            stack.remove(ev)
        self._last = ev
        with self._lock:
            self._events.append(ev)
        if ev["c"] == "step":
            self._wake.set()

    @contextlib.contextmanager
    def span(self, name: str, cat: str, mb: int | None = None, **args):
        ev = self.begin(name, cat, mb, **args)
        try:
            yield ev
        finally:
            self.end(ev)

    @contextlib.contextmanager
    def paused(self):
        """Record nothing inside: work between steps that a step's breakdown must not count
        (the pipeline's forwards of an evaluation, booked as eval by the ledger)."""
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    @contextlib.contextmanager
    def compute(self, name: str, mb: int | None = None, **args):
        """A compute span; under the `slow` fault hook it takes `factor` times as long."""
        ev = self.begin(name, "compute", mb, **args)
        t0 = time.perf_counter()
        if ev is not None and self._cuda_ref is not None:
            import torch

            ev["_cuda"] = (torch.cuda.Event(enable_timing=True),
                           torch.cuda.Event(enable_timing=True))
            ev["_cuda"][0].record()
        try:
            yield ev
        finally:
            if self.slow is not None and self.step >= self.slow[1]:
                _spin((self.slow[0] - 1.0) * (time.perf_counter() - t0))
            if ev is not None and "_cuda" in ev:
                ev["_cuda"][1].record()
            self.end(ev)

    # -- hang dumps ------------------------------------------------------------------------
    def snapshot(self) -> dict:
        """What this rank is doing now: its open events (innermost last) and the last one done."""
        now = self.now_us()
        opened = [dict(e, open_for_s=(now - e["t0"]) / 1e6)
                  for stack in list(self._open.values()) for e in list(stack)]
        return {"rank": self.rank, "host": socket.gethostname(), "pid": os.getpid(),
                "time_us": now, "step": self.step, "open": opened, "last": self._last}

    # -- torch.distributed's operations (myria.observe.comm) --------------------------------
    def set_mesh_groups(self, groups: dict[str, list[int]]) -> None:
        """Name communication groups by mesh dimension (ranks tuple -> dim)."""
        for dim, ranks in groups.items():
            self._dims.setdefault(tuple(ranks), dim)

    def subscribe(self) -> None:
        """Record every operation that `myria.observe.comm` publishes (its one interception of
        torch.distributed)."""
        if self.enabled:
            comm.subscribe(self)

    # comm.Subscriber: an op's event spans issue to completion
    def started(self, op: comm.Op) -> None:
        if op.kind == "p2p":
            ops = [dict(o, seq=self._pair(o["kind"], o["peer"])) for o in op.p2p]
            ev = self.begin("p2p", "p2p", ops=ops)
        else:
            key = op.group
            seq = self._seq.get(key, 0)
            self._seq[key] = seq + 1
            ev = self.begin(op.name, "comm", dim=self._dims.get(key, "world" if len(key) ==
                                                                self.world else "other"),
                            group=list(key), seq=seq, bytes=op.bytes)
            if op.async_op and ev is not None:   # None: not recorded (paused)
                ev["a"]["async"] = True
        if ev is not None:
            ev["t0"] = self._us(op.t0)
            op.notes[self] = ev

    def ended(self, op: comm.Op) -> None:
        self.end(op.notes.get(self), self._us(op.t1))

    def waited(self, op: comm.Op, t0: int, t1: int) -> None:
        issued = op.notes.get(self)
        if issued is None:
            return
        args = issued.get("a", {})
        w = {"n": "wait", "c": "wait", "s": self.step, "t0": self._us(t0), "t1": self._us(t1),
             "th": self._thread(), "a": {"of": issued["n"], "dim": args.get("dim"),
                                        "seq": args.get("seq"), "group": args.get("group")}}
        if issued["c"] == "p2p":
            w["a"]["ops"] = args.get("ops")
        with self._lock:
            self._events.append(w)

    def _pair(self, kind: str, peer: int) -> int:
        """Sends and receives are numbered per (kind, source, destination): the k-th send of A
        to B pairs with B's k-th receive from A."""
        src, dst = (self.rank, peer) if kind == "send" else (peer, self.rank)
        k = (kind, src, dst)
        seq = self._pair_seq.get(k, 0)
        self._pair_seq[k] = seq + 1
        return seq


def _spin(seconds: float) -> None:
    """Keep the CPU busy for `seconds`, as a slow device computing longer would. (Sleeping would
    hand the core to the other ranks of a small host and speed them up unevenly, which no slow
    GPU does to its neighbours.)"""
    end = time.perf_counter() + max(0.0, seconds)
    while time.perf_counter() < end:
        pass


# -- the recorder of this process ---------------------------------------------------------------
_CURRENT = Recorder(None, 0, 1, enabled=False)


def current() -> Recorder:
    """This process's recorder (a disabled one until `install`)."""
    return _CURRENT


def install(run_dir: str | Path, rank: int, world: int, enabled: bool = True,
            slow: tuple[float, int] | None = None, flush_s: float = 1.0) -> Recorder:
    """Create this rank's recorder, subscribed to torch.distributed's operations."""
    global _CURRENT
    _CURRENT = Recorder(run_dir, rank, world, enabled, flush_s)
    _CURRENT.slow = slow
    _CURRENT.subscribe()
    return _CURRENT


def uninstall() -> None:
    """Close this process's recorder and stop its subscription."""
    global _CURRENT
    _CURRENT.close()
    comm.unsubscribe(_CURRENT)
    _CURRENT = Recorder(None, 0, 1, enabled=False)


def write_dump(run_dir: str | Path, rec: Recorder, why: str) -> Path:
    """RUN_DIR/hang/rankNNNNN.json: this rank's open events and last completed one."""
    path = rundir.hang_file(run_dir, rec.rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, json.dumps(dict(rec.snapshot(), why=why), indent=1))
    return path


_LISTENING = False


def listen_for_dumps(run_dir: str | Path) -> None:
    """On SIGUSR1, write a hang dump of the current recorder from a thread of its own.

    Call first thing in a worker, before any thread starts. A Python signal handler runs only
    when the main thread executes bytecode, which a rank blocked inside a collective does not;
    so SIGUSR1 is blocked here (threads started later inherit the mask) and a dedicated thread
    takes it with sigwait. A no-op handler keeps SIGUSR1 from ending the process should a
    thread started earlier receive it.
    """
    global _LISTENING
    if _LISTENING or not hasattr(signal, "pthread_sigmask") or \
            threading.current_thread() is not threading.main_thread():
        return
    _LISTENING = True
    signal.signal(signal.SIGUSR1, lambda *_: None)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})

    def loop():
        while True:
            signal.sigwait({signal.SIGUSR1})
            rec = current()
            if not rec.enabled:
                continue
            try:
                rec.flush()
                write_dump(run_dir, rec, "SIGUSR1")
            except Exception:
                pass

    threading.Thread(target=loop, name="myria-hang-dump", daemon=True).start()


def default_store():
    """The default process group's store (the rendezvous store), or None."""
    try:
        from torch.distributed import distributed_c10d

        return distributed_c10d._get_default_store()
    except Exception:
        return None


def measure_clock_offset(store, rank: int, world: int, rounds: int = 5, clock=None) -> int:
    """This rank's clock offset to rank 0 in µs, through the rendezvous store.

    Rank 0 answers each rank's pings with its own clock reading; the rank takes the reading of
    the round with the shortest round trip and assumes it was taken halfway (Cristian's
    method). Same host: the offset is ~0; across hosts it corrects their wall clocks.
    """
    if world <= 1 or store is None:
        return 0
    clock = clock or (lambda: time.time_ns() // _NS)
    if rank == 0:
        for r in range(1, world):
            for i in range(rounds):
                store.wait([f"myria/clock/ping/{r}/{i}"])
                store.set(f"myria/clock/pong/{r}/{i}", str(clock()))
        return 0
    best = None
    for i in range(rounds):
        t0 = clock()
        store.set(f"myria/clock/ping/{rank}/{i}", "1")
        store.wait([f"myria/clock/pong/{rank}/{i}"])
        remote = int(store.get(f"myria/clock/pong/{rank}/{i}"))
        t1 = clock()
        rtt = t1 - t0
        if best is None or rtt < best[0]:
            best = (rtt, (t0 + t1) // 2 - remote)
    return best[1]
