"""The always-on event timer of a rank: timed spans of compute, communication and I/O.

Every rank records events (name, category, step, microbatch, start, end, arguments) into a list
that a background thread appends to RUN_DIR/events/rankNNNNN.jsonl every `flush_s` seconds, so
the training thread never touches the file. One JSON object per line:

    {"header": {rank, world, host, pid, coord: {dp, pp, cp, tp, ep}, layout, clock: {...},
                groups: {dim: [ranks...]}}}              first line, once
    {"n": name, "c": category, "s": step, "m": microbatch, "t0": µs, "t1": µs, "th": thread,
     "a": {...}}                                          one per event

Times are integer microseconds on a clock aligned across ranks: the host's monotonic clock
(`time.perf_counter_ns`, never a synchronisation of the device) mapped to the wall clock at
start, minus this rank's offset to rank 0 measured at start-up through the rendezvous store
(`measure_clock_offset`). On a GPU the compute spans would be bracketed by CUDA events resolved
lazily by the writer thread; this CPU build records host time, which is device time on a CPU.

Categories: `compute` (forward, backward, backward_weight per microbatch and pipeline stage,
optimizer, grad_clip), `comm` (every collective issued through `torch.distributed`'s module
functions, with its mesh dimension, group, bytes and per-group sequence number), `p2p` (sends and
receives, batched by `batch_isend_irecv` or one by one by `isend`/`irecv`: pipeline transfers and
ring attention, with peers and per-pair sequence numbers),
`data` (waiting for the next batch), `ckpt` (snapshot and persist of a checkpoint), `step`;
`wait` is the time a rank blocks in `Work.wait()` on an asynchronous collective or a pipeline
transfer (their exposed part; the `comm`/`p2p` event spans issue to completion).

What is NOT seen (documented in docs/observability.md): collectives that bypass the module
functions of `torch.distributed` - DTensor's functional collectives (tensor-parallel all-reduce,
all-gather and reduce-scatter inside forward/backward: their time falls inside the compute
spans), and collectives issued inside C++ (DDP's bucketed all-reduce: use FSDP to see them);
blocking `send`/`recv` are recorded as collectives of their pair.

Compute-only time of a span = its duration minus the communication spans nested in it on the
same thread; `myria.observe.analyze` computes it, and stragglers are scored on it.
"""

from __future__ import annotations

import contextlib
import functools
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

_NS = 1000  # ns per µs

# torch.distributed functions wrapped, with the positional index of `group` and `async_op`
_WRAPPED = {
    "all_reduce": (2, 3), "all_gather_into_tensor": (2, 3), "reduce_scatter_tensor": (3, 4),
    "all_gather": (2, 3), "reduce_scatter": (3, 4), "broadcast": (2, 3),
    "all_to_all_single": (4, 5), "all_to_all": (2, 3), "barrier": (0, 1), "reduce": (3, 4),
    "all_gather_single": (2, 3), "reduce_scatter_single": (3, 4),   # FSDP2 in torch 2.13
    "send": (2, None), "recv": (2, None),
}


class Recorder:
    """One rank's event timer. Thread-safe; cheap enough to stay on (bench/timeline_overhead)."""

    def __init__(self, run_dir: str | Path | None, rank: int, world: int, enabled: bool = True,
                 flush_s: float = 1.0):
        self.enabled = enabled and run_dir is not None
        self.rank, self.world = rank, world
        self.flush_s = flush_s
        self.step = 0
        self._events: list[dict] = []
        self._lock = threading.Lock()
        self._open: dict[int, list[dict]] = {}       # thread id -> stack of open spans
        self._last: dict | None = None
        self._seq: dict[tuple, int] = {}
        self._works: dict[int, dict] = {}             # id(Work) -> its issuing event
        self._pair_seq: dict[tuple, int] = {}
        self._dims: dict[tuple, str] = {}
        self._groups: dict[int, tuple] = {}
        self._threads: dict[int, int] = {}
        self.slow: tuple[float, int] | None = None   # (factor, from step): MYRIA_FAULT slow
        self._mono0 = time.perf_counter_ns()
        self._wall0 = time.time_ns()
        self.offset_us = 0
        self.path = rundir.events_file(run_dir, rank) if self.enabled else None
        self._stop = threading.Event()
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
        return (self._wall0 + time.perf_counter_ns() - self._mono0) // _NS - self.offset_us

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
        while not self._stop.wait(self.flush_s):
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
        if not self.enabled:
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

    @contextlib.contextmanager
    def span(self, name: str, cat: str, mb: int | None = None, **args):
        ev = self.begin(name, cat, mb, **args)
        try:
            yield ev
        finally:
            self.end(ev)

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

    # -- torch.distributed wrapper -----------------------------------------------------------
    def set_mesh_groups(self, groups: dict[str, list[int]]) -> None:
        """Name communication groups by mesh dimension (ranks tuple -> dim)."""
        for dim, ranks in groups.items():
            self._dims.setdefault(tuple(ranks), dim)

    def _group_key(self, dist, group) -> tuple:
        key = self._groups.get(id(group))
        if key is None:
            try:
                key = tuple(dist.get_process_group_ranks(group or dist.group.WORLD))
            except Exception:
                key = ()
            self._groups[id(group)] = key
        return key

    def wrap_distributed(self) -> None:
        """Record every collective issued through torch.distributed's module functions."""
        if not self.enabled:
            return
        import torch.distributed as dist

        if getattr(dist, "_myria_wrapped", False):
            return
        for name, (gi, ai) in _WRAPPED.items():
            fn = getattr(dist, name, None)
            if fn is not None:
                setattr(dist, name, self._collective(dist, name, fn, gi, ai))
        orig = dist.batch_isend_irecv
        dist.batch_isend_irecv = self._batch_p2p(dist, orig)
        # isend/irecv one by one (torch's pipelining sends a homogeneous batch this way, and
        # ring attention): replaced in the package and in distributed_c10d, whose P2POp checks
        # `op is isend` against its own globals
        c10d = dist.distributed_c10d
        singles = {name: getattr(c10d, name) for name in ("isend", "irecv")}
        for name, fn in singles.items():
            w = self._single_p2p(dist, name, fn)
            setattr(dist, name, w)
            setattr(c10d, name, w)
        work_cls = dist.distributed_c10d.Work
        orig_wait = work_cls.wait
        work_cls.wait = self._timed_wait(orig_wait)
        dist._myria_wrapped = (_WRAPPED, orig, orig_wait, singles)

    def _timed_wait(self, orig):
        """Work.wait, recorded: the exposed part of an asynchronous collective or p2p (FSDP's
        prefetched all-gathers, pipeline receives) is the time its issuer blocks here."""
        rec = self

        def wait(work, *a, **kw):
            issued = rec._works.pop(id(work), None)
            if issued is None or not rec.enabled:
                return orig(work, *a, **kw)
            t0 = rec.now_us()
            try:
                return orig(work, *a, **kw)
            finally:
                t1 = rec.now_us()
                args = issued.get("a", {})
                w = {"n": "wait", "c": "wait", "s": rec.step, "t0": t0, "t1": t1,
                     "th": rec._thread(), "a": {"of": issued["n"], "dim": args.get("dim"),
                                                "seq": args.get("seq"),
                                                "group": args.get("group")}}
                if issued["c"] == "p2p":
                    w["a"]["ops"] = args.get("ops")
                    issued["_pending"] -= 1
                    if issued["_pending"] <= 0:
                        issued.pop("_pending", None)
                        rec.end(issued, t1)
                with rec._lock:
                    rec._events.append(w)

        wait.__wrapped__ = orig
        return wait

    def _collective(self, dist, name: str, fn, gi: int, ai: int | None):
        rec = self

        def wrapped(*args, **kwargs):
            group = kwargs.get("group", args[gi] if len(args) > gi else None)
            async_op = kwargs.get("async_op", args[ai] if ai is not None and len(args) > ai
                                  else False)
            key = rec._group_key(dist, group)
            seq = rec._seq.get(key, 0)
            rec._seq[key] = seq + 1
            # the larger buffer: the gathered output, the scattered input, the reduced tensor
            nbytes = max((_bytes(x) for x in (*args[:2], *kwargs.values())), default=0)
            ev = rec.begin(name, "comm", dim=rec._dims.get(key, "world" if len(key) ==
                                                           rec.world else "other"),
                           group=list(key), seq=seq, bytes=nbytes)
            try:
                work = fn(*args, **kwargs)
            except BaseException:
                rec.end(ev)
                raise
            if not async_op or work is None:
                rec.end(ev)
                return work
            if ev is not None:
                ev["a"]["async"] = True
                rec._works[id(work)] = ev
                try:
                    work.get_future().add_done_callback(lambda _f: rec.end(ev))
                except Exception:
                    rec.end(ev)
            return work

        wrapped.__wrapped__ = fn
        return wrapped

    def _p2p_op(self, kind: str, peer: int, tensor) -> dict:
        """One send or receive, numbered per (kind, source, destination): the k-th send of A
        to B pairs with B's k-th receive from A."""
        src, dst = (self.rank, peer) if kind == "send" else (peer, self.rank)
        k = (kind, src, dst)
        seq = self._pair_seq.get(k, 0)
        self._pair_seq[k] = seq + 1
        return {"kind": kind, "peer": peer, "seq": seq, "bytes": _bytes(tensor)}

    def _p2p_issued(self, ops: list[dict], works: list) -> None:
        ev = self.begin("p2p", "p2p", ops=ops)
        if ev is None:
            return
        ev["_pending"] = len(works)
        for w in works:  # closed when the last of them is waited for (Work.wait below)
            self._works[id(w)] = ev

    def _batch_p2p(self, dist, fn):
        rec = self

        def wrapped(p2p_op_list, *a, **kw):
            if not rec.enabled:
                return fn(p2p_op_list, *a, **kw)
            ops = [rec._p2p_op("send" if getattr(op.op, "__name__", "") == "isend" else "recv",
                               op.peer, op.tensor) for op in p2p_op_list]
            _IN_BATCH.on = True   # its isend/irecv calls are this batch's, recorded here
            try:
                works = fn(p2p_op_list, *a, **kw)
            finally:
                _IN_BATCH.on = False
            rec._p2p_issued(ops, [w for w in works if w is not None])
            return works

        wrapped.__wrapped__ = fn
        return wrapped

    def _single_p2p(self, dist, name: str, fn):
        rec = self
        kind = "send" if name == "isend" else "recv"
        peer_kw = "dst" if kind == "send" else "src"

        @functools.wraps(fn)
        def wrapped(tensor, *a, **kw):
            if not rec.enabled or getattr(_IN_BATCH, "on", False):
                return fn(tensor, *a, **kw)
            work = fn(tensor, *a, **kw)
            try:
                peer = kw.get(peer_kw, a[0] if a else None)
                if peer is None:
                    group = kw.get("group", a[1] if len(a) > 1 else None)
                    peer = dist.get_global_rank(group, kw.get("group_" + peer_kw))
                if work is not None:
                    rec._p2p_issued([rec._p2p_op(kind, int(peer), tensor)], [work])
            except Exception:  # never let the timer break a transfer
                pass
            return work

        return wrapped


def _spin(seconds: float) -> None:
    """Keep the CPU busy for `seconds`, as a slow device computing longer would. (Sleeping would
    hand the core to the other ranks of a small host and speed them up unevenly, which no slow
    GPU does to its neighbours.)"""
    end = time.perf_counter() + max(0.0, seconds)
    while time.perf_counter() < end:
        pass


def _bytes(t) -> int:
    if isinstance(t, (list, tuple)):
        return sum(_bytes(x) for x in t)
    numel = getattr(t, "numel", None)
    if numel is None:
        return 0
    try:
        return int(numel() * t.element_size())
    except Exception:
        return 0


# -- the recorder of this process ---------------------------------------------------------------
_IN_BATCH = threading.local()   # inside batch_isend_irecv: its single ops are recorded by it

_CURRENT = Recorder(None, 0, 1, enabled=False)


def current() -> Recorder:
    """This process's recorder (a disabled one until `install`)."""
    return _CURRENT


def install(run_dir: str | Path, rank: int, world: int, enabled: bool = True,
            slow: tuple[float, int] | None = None, flush_s: float = 1.0) -> Recorder:
    """Create this rank's recorder and wrap torch.distributed's collectives."""
    global _CURRENT
    _CURRENT = Recorder(run_dir, rank, world, enabled, flush_s)
    _CURRENT.slow = slow
    _CURRENT.wrap_distributed()
    return _CURRENT


def uninstall() -> None:
    """Close this process's recorder and restore torch.distributed's functions."""
    global _CURRENT
    _CURRENT.close()
    import torch.distributed as dist

    wrapped = getattr(dist, "_myria_wrapped", None)
    if wrapped:
        for name in wrapped[0]:
            fn = getattr(dist, name, None)
            if fn is not None and hasattr(fn, "__wrapped__"):
                setattr(dist, name, fn.__wrapped__)
        dist.batch_isend_irecv = wrapped[1]
        dist.distributed_c10d.Work.wait = wrapped[2]
        for name, fn in wrapped[3].items():
            setattr(dist, name, fn)
            setattr(dist.distributed_c10d, name, fn)
        dist._myria_wrapped = False
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
