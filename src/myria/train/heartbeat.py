"""Worker-side heartbeats: a daemon thread reports this rank's progress to the supervisor's store.

Every `heartbeat_s` seconds each worker writes one JSON record under `myria/<job>/hb/<rank>`:
rank, host, pid, attempt, step, phase (data, forward-backward, grad-clip, optimizer, metrics,
eval, checkpoint, ...), the collective it is in or last issued, tokens/s, bytes communicated
in the last step and in total, and memory in use. The supervisor reads these to tell a dead or
frozen process (no heartbeat), a hang (heartbeats but no progress) and a silent rank (traffic
stopped) apart, as MegaScale's driver does with its executors' heartbeats.

The store is a TCPStore served by the supervisor on 127.0.0.1 (default) or a Redis server
(MegaScale moved its heartbeats to Redis); the supervisor passes its address in the environment:

    MYRIA_HEARTBEAT       tcp://127.0.0.1:PORT or redis://HOST:PORT/DB
    MYRIA_HEARTBEAT_S     the period in seconds
    MYRIA_HEARTBEAT_JOB   the key namespace (one per supervised job)

Without MYRIA_HEARTBEAT (`myria train` alone) the progress is still tracked but nothing is sent.
When the supervisor's TCPStore goes away (the supervisor died), the sender stops sending and,
unless the parent-death signal already did (myria.train.launch.stop_with_launcher), asks its
process to stop at the end of the step with a checkpoint (SIGTERM), in one log line.
Collectives are counted by wrapping `torch.distributed`'s Python entry points in this process
(FSDP2's all-gather and reduce-scatter, all-reduce, broadcast, send/recv, ...): collectives that
bypass them (DDP's C++ reducer, functional collectives under DTensor) are not counted.
"""

from __future__ import annotations

import datetime
import functools
import json
import logging
import os
import socket
import threading
import time
from typing import Any
from urllib.parse import urlparse

log = logging.getLogger("myria")

ENV_STORE = "MYRIA_HEARTBEAT"
ENV_PERIOD = "MYRIA_HEARTBEAT_S"
ENV_JOB = "MYRIA_HEARTBEAT_JOB"


# what a TCPStore client's error says when the server's process has gone
LOST_CONNECTION = ("Broken pipe", "Connection reset", "Connection refused")


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def key(job: str, rank: int) -> str:
    """The store key of `rank`'s heartbeat in job `job`."""
    return f"myria/{job}/hb/{rank}"


# -- stores ----------------------------------------------------------------------------------
class HeartbeatStore:
    """The two operations heartbeats need from a key-value store."""

    def put(self, k: str, value: bytes) -> None:
        raise NotImplementedError

    def get_many(self, keys: list[str]) -> list[bytes | None]:
        raise NotImplementedError

    def delete(self, keys: list[str]) -> None:
        raise NotImplementedError

    def close(self) -> None:
        pass


class TCPHeartbeatStore(HeartbeatStore):
    """A torch.distributed TCPStore (client, or the server object itself)."""

    def __init__(self, store) -> None:
        self.store = store

    @classmethod
    def connect(cls, host: str, port: int, timeout_s: float) -> TCPHeartbeatStore:
        import torch.distributed as dist

        return cls(dist.TCPStore(host, port, is_master=False, wait_for_workers=False,
                                 timeout=datetime.timedelta(seconds=timeout_s)))

    def put(self, k: str, value: bytes) -> None:
        self.store.set(k, value)

    def get_many(self, keys: list[str]) -> list[bytes | None]:
        out: list[bytes | None] = []
        for k in keys:
            out.append(self.store.get(k) if self.store.check([k]) else None)
        return out

    def delete(self, keys: list[str]) -> None:
        for k in keys:
            self.store.delete_key(k)


class RedisHeartbeatStore(HeartbeatStore):
    """A Redis server (needs the `redis` package: pip install 'myria[redis]')."""

    def __init__(self, url: str, timeout_s: float, ttl_s: float | None = None) -> None:
        try:
            import redis
        except ImportError:
            from myria.errors import ConfigError
            raise ConfigError("resilience.store = 'redis' needs the redis package: "
                              "pip install 'myria[redis]'") from None
        self.client = redis.Redis.from_url(url, socket_timeout=timeout_s,
                                           socket_connect_timeout=timeout_s)
        self.ttl = max(1, int(ttl_s)) if ttl_s else None

    def put(self, k: str, value: bytes) -> None:
        self.client.set(k, value, ex=self.ttl)

    def get_many(self, keys: list[str]) -> list[bytes | None]:
        return list(self.client.mget(keys)) if keys else []

    def delete(self, keys: list[str]) -> None:
        if keys:
            self.client.delete(*keys)

    def close(self) -> None:
        self.client.close()


def open_store(url: str, timeout_s: float = 10.0, ttl_s: float | None = None) -> HeartbeatStore:
    """A client of the store at `url` (tcp://host:port or redis://host:port/db)."""
    u = urlparse(url)
    if u.scheme == "tcp":
        return TCPHeartbeatStore.connect(u.hostname or "127.0.0.1", int(u.port or 0), timeout_s)
    if u.scheme in ("redis", "rediss", "unix"):
        return RedisHeartbeatStore(url, timeout_s, ttl_s)
    from myria.errors import ConfigError
    raise ConfigError(f"heartbeat store {url!r}: expected tcp://HOST:PORT or redis://HOST:PORT")


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


class Progress:
    """This rank's progress, updated by the training loop, read by the heartbeat thread.

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


# -- counting collectives --------------------------------------------------------------------
def _nbytes(t: Any) -> int:
    try:
        return int(t.numel() * t.element_size())
    except Exception:
        return 0


def _first(args: tuple, kwargs: dict, name: str, index: int = 0) -> Any:
    return kwargs[name] if name in kwargs else (args[index] if len(args) > index else None)


# name -> bytes this rank moves (the payload: the message size nccl-tests reports)
_SIZES = {
    "all_reduce": lambda a, k: _nbytes(_first(a, k, "tensor")),
    "broadcast": lambda a, k: _nbytes(_first(a, k, "tensor")),
    "reduce": lambda a, k: _nbytes(_first(a, k, "tensor")),
    "all_gather_single": lambda a, k: _nbytes(_first(a, k, "output_tensor")),
    "all_gather_into_tensor": lambda a, k: _nbytes(_first(a, k, "output_tensor")),
    "reduce_scatter_single": lambda a, k: _nbytes(_first(a, k, "input", 1)),
    "reduce_scatter_tensor": lambda a, k: _nbytes(_first(a, k, "input", 1)),
    "all_to_all_single": lambda a, k: _nbytes(_first(a, k, "input", 1)),
    "all_gather": lambda a, k: sum(_nbytes(t) for t in (_first(a, k, "tensor_list") or [])),
    "reduce_scatter": lambda a, k: sum(_nbytes(t) for t in (_first(a, k, "input_list", 1)
                                                            or [])),
    "send": lambda a, k: _nbytes(_first(a, k, "tensor")),
    "recv": lambda a, k: _nbytes(_first(a, k, "tensor")),
    "isend": lambda a, k: _nbytes(_first(a, k, "tensor")),
    "irecv": lambda a, k: _nbytes(_first(a, k, "tensor")),
    "batch_isend_irecv": lambda a, k: sum(_nbytes(op.tensor) for op in (_first(a, k, "p2p_op_list")
                                                                        or [])),
    "barrier": lambda a, k: 0,
}
_installed: Progress | None = None


def install_comm_meter(progress: Progress) -> None:
    """Count this process's collectives (main thread only) into `progress`."""
    global _installed
    import torch.distributed as dist

    _installed = progress
    main = threading.main_thread().ident
    for name, size in _SIZES.items():
        fn = getattr(dist, name, None)
        if fn is None or getattr(fn, "__myria_meter__", False):
            continue

        def make(fn=fn, name=name, size=size):
            @functools.wraps(fn)
            def metered(*args, **kwargs):
                p = _installed
                if p is None or threading.get_ident() != main:
                    return fn(*args, **kwargs)
                p.collective = name
                p.collectives += 1
                p.comm_bytes += size(args, kwargs)
                p.in_collective = True
                try:
                    return fn(*args, **kwargs)
                finally:
                    p.in_collective = False
            metered.__myria_meter__ = True
            metered.__wrapped_collective__ = fn
            return metered

        setattr(dist, name, make())


def uninstall_comm_meter() -> None:
    """Put torch.distributed's own functions back (tests)."""
    global _installed
    import torch.distributed as dist

    _installed = None
    for name in _SIZES:
        fn = getattr(dist, name, None)
        if fn is not None and getattr(fn, "__myria_meter__", False):
            setattr(dist, name, fn.__wrapped_collective__)


# -- the sender ------------------------------------------------------------------------------
class Heartbeat:
    """Progress of this rank plus the daemon thread that sends it every `period_s`."""

    def __init__(self, rank: int, store: HeartbeatStore | None = None, period_s: float = 1.0,
                 job: str = "local") -> None:
        self.progress = Progress(rank)
        self.store = store
        self.period_s = period_s
        self.job = job
        self.attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
        self.sent = 0
        self.failures = 0
        self.lost = False  # the supervisor's store went away: nothing more is sent
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if store is not None:
            install_comm_meter(self.progress)
            self._thread = threading.Thread(target=self._run, name="myria-heartbeat",
                                            daemon=True)
            self._thread.start()

    # the loop's hooks
    def phase(self, name: str) -> None:
        self.progress.set_phase(name)

    def step_done(self, step: int, tokens_per_s: float) -> None:
        self.progress.step_done(step, tokens_per_s)

    def resumed(self, step: int) -> None:
        """Record the step training starts from (0 for a fresh run)."""
        self.progress.step = step
        self.progress.resumed_from = step
        self.progress.progress += 1

    def send(self) -> None:
        if self.store is None:
            return
        rec = self.progress.record(attempt=self.attempt, seq=self.sent)
        self.store.put(key(self.job, self.progress.rank), json.dumps(rec).encode())
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
        if not isinstance(self.store, TCPHeartbeatStore) or not any(
                m in str(e) for m in LOST_CONNECTION):
            return False
        self.lost = True
        from myria.train.launch import launcher_gone

        time.sleep(min(2.0, 2 * self.period_s))  # the parent-death signal comes with the exit
        gone = launcher_gone()
        log.warning("rank %d: the supervisor's heartbeat store is gone (%s)%s",
                    self.progress.rank, _first_line(e),
                    "" if gone else ": stopping at the end of this step with a checkpoint")
        if not gone:
            import signal
            os.kill(os.getpid(), signal.SIGTERM)
        return True

    def close(self, phase: str = "exit") -> None:
        """Send a last heartbeat with `phase` and stop the thread."""
        self.progress.set_phase(phase)
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


def start(rank: int) -> Heartbeat:
    """The heartbeat of this worker, sending if the supervisor gave a store in the environment."""
    url = os.environ.get(ENV_STORE)
    period = float(os.environ.get(ENV_PERIOD, 1.0))
    if not url:
        return Heartbeat(rank)
    store = open_store(url, timeout_s=max(10.0, 5 * period), ttl_s=max(60.0, 30 * period))
    return Heartbeat(rank, store, period, os.environ.get(ENV_JOB, "local"))
