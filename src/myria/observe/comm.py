"""The one interception of `torch.distributed`: every operation is published once to subscribers.

The module functions of `torch.distributed` (collectives, send/recv, `batch_isend_irecv`,
`isend`/`irecv`) are wrapped while at least one subscriber listens, and restored when the last
one leaves. Each call becomes one `Op`: name, group (global ranks), bytes by ONE rule (`nbytes`:
the larger of the buffers given, a list counting as the sum of its tensors, the message size
nccl-tests reports; a point-to-point op counts each tensor sent or received), and its start and
end on the monotonic clock. A subscriber (`myria.train.heartbeat`, `myria.observe.events`) sees:

    started(op)            before the call, on the issuing thread
    returned(op)           the call returned (or raised): a blocking op is complete here
    ended(op)              the op completed, op.t1 set (an asynchronous collective: when its
                           future is done; a point-to-point batch: its last work waited for)
    waited(op, t0, t1)     the issuer blocked in `Work.wait()` on the op from t0 to t1 (ns)

Not seen: collectives that bypass these Python functions (DTensor's functional collectives,
DDP's C++ reducer). A `batch_isend_irecv` is published once, as the batch.
"""

from __future__ import annotations

import functools
import threading
import time
from typing import Any

# wrapped collectives, with the positional index of `group` and `async_op`
COLLECTIVES = {
    "all_reduce": (2, 3), "all_gather_into_tensor": (2, 3), "reduce_scatter_tensor": (3, 4),
    "all_gather": (2, 3), "reduce_scatter": (3, 4), "broadcast": (2, 3),
    "all_to_all_single": (4, 5), "all_to_all": (2, 3), "barrier": (0, 1), "reduce": (3, 4),
    "all_gather_single": (2, 3), "reduce_scatter_single": (3, 4),   # FSDP2 in torch 2.13
    "send": (2, None), "recv": (2, None),
}


class Op:
    """One operation issued through torch.distributed, as every subscriber sees it."""

    __slots__ = ("name", "kind", "group", "bytes", "async_op", "p2p", "t0", "t1", "thread",
                 "notes", "_pending")

    def __init__(self, name: str, kind: str, group: tuple[int, ...], nbytes: int,
                 async_op: bool = False, p2p: list[dict] | None = None) -> None:
        self.name = name              # the torch.distributed function
        self.kind = kind              # "collective" or "p2p"
        self.group = group            # global ranks of its group (() if unknown)
        self.bytes = nbytes
        self.async_op = async_op
        self.p2p = p2p                # p2p: [{"kind": send|recv, "peer", "bytes"}, ...]
        self.t0 = time.perf_counter_ns()
        self.t1: int | None = None
        self.thread = threading.get_ident()
        self.notes: dict = {}         # per subscriber (e.g. the timer's open event)
        self._pending = 0


class Subscriber:
    """What a subscriber may implement (each a no-op here)."""

    def started(self, op: Op) -> None:
        pass

    def returned(self, op: Op) -> None:
        pass

    def ended(self, op: Op) -> None:
        pass

    def waited(self, op: Op, t0: int, t1: int) -> None:
        pass


def nbytes(x: Any) -> int:
    """Bytes of a tensor, or of a list/tuple of tensors (their sum); 0 for anything else."""
    if isinstance(x, (list, tuple)):
        return sum(nbytes(t) for t in x)
    numel = getattr(x, "numel", None)
    if numel is None:
        return 0
    try:
        return int(numel() * x.element_size())
    except Exception:
        return 0


def call_bytes(args: tuple, kwargs: dict) -> int:
    """The one byte rule for a collective: the larger of the buffers it is given."""
    return max((nbytes(x) for x in (*args[:2], *kwargs.values())), default=0)


# -- the publisher -----------------------------------------------------------------------------
_subscribers: list[Subscriber] = []
_saved: dict | None = None             # torch's own functions while wrapped
_works: dict[int, Op] = {}             # id(Work) -> the asynchronous op it belongs to
_groups: dict[int, tuple] = {}         # id(group) -> its global ranks
_in_batch = threading.local()          # inside batch_isend_irecv: its single ops are the batch's


def subscribe(sub: Subscriber) -> None:
    """Publish every later operation to `sub` (wraps torch.distributed on the first one)."""
    if sub not in _subscribers:
        _subscribers.append(sub)
    if _saved is None:
        _install()


def unsubscribe(sub: Subscriber) -> None:
    """Stop publishing to `sub`; the last one to leave puts torch's functions back."""
    if sub in _subscribers:
        _subscribers.remove(sub)
    if not _subscribers and _saved is not None:
        _uninstall()


def installed() -> bool:
    return _saved is not None


def group_ranks(group) -> tuple[int, ...]:
    """The global ranks of `group` (None: the world), cached per group."""
    key = _groups.get(id(group))
    if key is None:
        import torch.distributed as dist

        try:
            key = tuple(dist.get_process_group_ranks(group or dist.group.WORLD))
        except Exception:
            key = ()
        _groups[id(group)] = key
    return key


def _publish(event: str, op: Op, *more) -> None:
    for s in tuple(_subscribers):
        getattr(s, event)(op, *more)


def _end(op: Op, t1: int | None = None) -> None:
    if op.t1 is None:
        op.t1 = time.perf_counter_ns() if t1 is None else t1
        _publish("ended", op)


def _install() -> None:
    global _saved
    import torch.distributed as dist

    c10d = dist.distributed_c10d
    saved = {"module": {}, "c10d": {}, "wait": c10d.Work.wait}
    for name, (gi, ai) in COLLECTIVES.items():
        fn = getattr(dist, name, None)
        if fn is not None:
            saved["module"][name] = fn
            setattr(dist, name, _collective(name, fn, gi, ai))
    saved["module"]["batch_isend_irecv"] = dist.batch_isend_irecv
    dist.batch_isend_irecv = _batch_p2p(dist.batch_isend_irecv)
    # isend/irecv one by one (torch's pipelining sends a homogeneous batch this way, and ring
    # attention): replaced in the package and in distributed_c10d, whose P2POp checks
    # `op is isend` against its own globals
    for name in ("isend", "irecv"):
        fn = getattr(c10d, name)
        saved["module"][name] = getattr(dist, name)
        saved["c10d"][name] = fn
        w = _single_p2p(dist, name, fn)
        setattr(dist, name, w)
        setattr(c10d, name, w)
    c10d.Work.wait = _timed_wait(saved["wait"])
    _saved = saved


def _uninstall() -> None:
    global _saved
    import torch.distributed as dist

    c10d = dist.distributed_c10d
    for name, fn in _saved["module"].items():
        setattr(dist, name, fn)
    for name, fn in _saved["c10d"].items():
        setattr(c10d, name, fn)
    c10d.Work.wait = _saved["wait"]
    _saved = None
    _works.clear()
    _groups.clear()


def _collective(name: str, fn, gi: int, ai: int | None):
    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        group = kwargs.get("group", args[gi] if len(args) > gi else None)
        async_op = bool(kwargs.get("async_op", args[ai] if ai is not None and len(args) > ai
                                   else False))
        op = Op(name, "collective", group_ranks(group), call_bytes(args, kwargs), async_op)
        _publish("started", op)
        try:
            work = fn(*args, **kwargs)
        except BaseException:
            _publish("returned", op)
            _end(op)
            raise
        _publish("returned", op)
        if not async_op or work is None:
            _end(op)
            return work
        _works[id(work)] = op
        try:
            work.get_future().add_done_callback(lambda _f: _end(op))
        except Exception:
            _end(op)
        return work

    return wrapped


def _issued_p2p(op: Op, works: list) -> None:
    """An issued point-to-point op ends when the last of its works is waited for."""
    _publish("returned", op)
    op._pending = len(works)
    if not works:
        _end(op)
    for w in works:
        _works[id(w)] = op


def _batch_p2p(fn):
    @functools.wraps(fn)
    def wrapped(p2p_op_list, *a, **kw):
        ops = [{"kind": "send" if getattr(p.op, "__name__", "") == "isend" else "recv",
                "peer": p.peer, "bytes": nbytes(p.tensor)} for p in p2p_op_list]
        op = Op("batch_isend_irecv", "p2p", (), sum(o["bytes"] for o in ops), True, ops)
        _publish("started", op)
        _in_batch.on = True
        try:
            works = fn(p2p_op_list, *a, **kw)
        except BaseException:
            _publish("returned", op)
            _end(op)
            raise
        finally:
            _in_batch.on = False
        _issued_p2p(op, [w for w in works if w is not None])
        return works

    return wrapped


def _single_p2p(dist, name: str, fn):
    kind = "send" if name == "isend" else "recv"
    peer_kw = "dst" if kind == "send" else "src"

    @functools.wraps(fn)
    def wrapped(tensor, *a, **kw):
        if getattr(_in_batch, "on", False):
            return fn(tensor, *a, **kw)
        try:
            peer = kw.get(peer_kw, a[0] if a else None)
            if peer is None:
                group = kw.get("group", a[1] if len(a) > 1 else None)
                peer = dist.get_global_rank(group, kw.get("group_" + peer_kw))
            entry = {"kind": kind, "peer": int(peer), "bytes": nbytes(tensor)}
        except Exception:  # never let the interception break a transfer
            return fn(tensor, *a, **kw)
        op = Op(name, "p2p", (), entry["bytes"], True, [entry])
        _publish("started", op)
        try:
            work = fn(tensor, *a, **kw)
        except BaseException:
            _publish("returned", op)
            _end(op)
            raise
        _issued_p2p(op, [work] if work is not None else [])
        return work

    return wrapped


def _timed_wait(orig):
    """Work.wait, published: the exposed part of an asynchronous op (FSDP's prefetched
    all-gathers, pipeline receives) is the time its issuer blocks here."""

    def wait(work, *a, **kw):
        op = _works.pop(id(work), None)
        if op is None:
            return orig(work, *a, **kw)
        t0 = time.perf_counter_ns()
        try:
            return orig(work, *a, **kw)
        finally:
            t1 = time.perf_counter_ns()
            _publish("waited", op, t0, t1)
            if op.kind == "p2p":
                op._pending -= 1
                if op._pending <= 0:
                    _end(op, t1)

    wait.__wrapped__ = orig
    return wait
