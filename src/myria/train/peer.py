"""State in peer memory: each rank's snapshot also held by its ring neighbour's process.

Every `resilience.memory_snapshot_interval` steps (0: off; the default -1 is every step with
in-job recovery, off otherwise), after the optimizer step, a rank copies its training state
(`Engine.state_dict()` flattened to local tensors, the RNG state and the step) into one
preallocated host buffer: the only work on the training thread. A background thread takes the
buffer's CRC-32 and hands the snapshot (header, JSON layout) to rank+S over a gloo group of its
own, and takes rank-S's (S = 1 on one host, the ranks per host across hosts: `ring_stride`):
across hosts the buffer goes over the group into one of two alternating receive buffers; on
one host it is a /dev/shm file the holder maps (`verify` checks its CRC-32 when used;
`remove_shared` removes a killed process's files). Each packed tensor is checked against the
at-rest ledger (`recorded`, myria.train.sdc), so a CRC-32 is only ever taken over verified
bytes. The next step waits for the previous exchange only if it still runs;
RUN_DIR/peer/rankNNNNN.json has the counts, seconds and checksum failures. A rank keeps its own
last SLOTS snapshots and its left neighbour's last two verified ones (`kept`), which in-job
recovery (myria.train.rejoin) reads. The reasons: docs/robustness.md, "Reasons behind the peer
snapshot, fault and SDC modules".
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import socket
import tempfile
import threading
import time
import uuid
import zlib
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger("myria")
DIR = "peer"
SLOTS = 3  # shared-memory snapshots per sender: the holder's newest is never the one written


def shm_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def remove_shared(job: str) -> int:
    """Remove the shared-memory snapshot files of job `job` (its processes have ended)."""
    n = 0
    for name in os.listdir(shm_dir()):
        if name.startswith(f"myria-{job}-"):
            try:
                os.unlink(os.path.join(shm_dir(), name))
                n += 1
            except OSError:
                pass
    return n


def _shared(path: str, nbytes: int) -> torch.Tensor:
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
    try:
        if os.fstat(fd).st_size < nbytes:
            os.ftruncate(fd, nbytes)
    finally:
        os.close(fd)
    return torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)


def _unwrapped(fn):
    # the event timer and the heartbeat's meter wrap torch.distributed's functions for the
    # training thread; the snapshot traffic is not training traffic
    while hasattr(fn, "__wrapped__"):
        fn = fn.__wrapped__
    return fn


def crc32(buf: torch.Tensor) -> int:
    return zlib.crc32(memoryview(buf.numpy())) & 0xFFFFFFFF


def layout_of(state: dict[str, Any]) -> tuple[list[dict], int]:
    out, off = [], 0
    for k, v in state.items():
        if isinstance(v, torch.Tensor):
            n = v.numel() * v.element_size()
            out.append({"k": k, "dtype": str(v.dtype).removeprefix("torch."),
                        "shape": list(v.shape), "off": off, "n": n})
            off += n
        else:
            out.append({"k": k, "value": v if isinstance(v, (int, float, str, bool))
                        or v is None else repr(v)})
    return out, off


def pack(state: dict[str, Any], buf: torch.Tensor, layout: list[dict]) -> None:
    for item in layout:
        if "off" in item and item["n"]:
            t = state[item["k"]].reshape(-1)
            t = t if t.is_contiguous() else t.contiguous()
            buf[item["off"]:item["off"] + item["n"]].copy_(t.view(torch.uint8))


def _tensor_at(buf: torch.Tensor, item: dict) -> torch.Tensor:
    """The packed tensor `item` of `buf`, read in place when aligned for its type."""
    raw = buf[item["off"]:item["off"] + item["n"]]
    dtype = getattr(torch, item["dtype"])
    try:
        return raw.view(dtype)
    except RuntimeError:   # an offset not a multiple of the element size
        return raw.clone().view(dtype)


def packed_differs(buf: torch.Tensor, layout: list[dict], expected: list[int]) -> str | None:
    """The first key whose packed bytes do not have the `expected` checksum, else None."""
    from myria.train import checksums

    items = [i for i in layout if "off" in i and i["n"]]
    bad = checksums.differing(expected, [_tensor_at(buf, i) for i in items])
    return items[bad[0]]["k"] if bad else None


def unpack(meta: dict, buf: torch.Tensor) -> dict[str, Any]:
    """The state a snapshot holds: {key: tensor (a copy) or value}, plus "_step", "_rng"."""
    out: dict[str, Any] = {"_step": meta["step"], "_rng": meta.get("rng"),
                           "_scheduler": meta.get("scheduler")}
    for item in meta["layout"]:
        if "off" not in item:
            out[item["k"]] = item.get("value")
            continue
        raw = buf[item["off"]:item["off"] + item["n"]].clone()
        out[item["k"]] = raw.view(getattr(torch, item["dtype"])).reshape(item["shape"])
    return out


class PeerSnapshots:
    """This rank's side of the ring: sends its snapshot right, holds the left one's."""

    def __init__(self, interval: int, engine, rank: int, world: int, run_dir: Path | None,
                 timeout_s: float = 600.0, shared: bool | None = None) -> None:
        import torch.distributed as dist

        self.interval, self.engine = interval, engine
        self.rank, self.world, self.run_dir = rank, world, run_dir
        self.keep_files = False   # set by in-job recovery when this rank's run fails
        # the ring's step: across hosts a host's ranks are held on the next host, so a lost
        # host's states all survive on others (torch elastic numbers ranks host by host)
        self.stride = ring_stride(world)
        self.right, self.left = (rank + self.stride) % world, (rank - self.stride) % world
        # a group of its own: its traffic never queues behind (or between) training collectives
        self.group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
        self._isend = _unwrapped(dist.isend)
        self._irecv = _unwrapped(dist.irecv)
        # which neighbours share this host, and a name for this ring's shared files
        hosts: list = [None] * world
        _unwrapped(dist.all_gather_object)(hosts, socket.gethostname(), group=self.group)
        token = [f"{os.environ.get('MYRIA_HEARTBEAT_JOB', 'local')}-{uuid.uuid4().hex[:8]}"]
        _unwrapped(dist.broadcast_object_list)(token, src=0, group=self.group)
        self.prefix = os.path.join(shm_dir(), f"myria-{token[0]}-")
        # shared: None = by host, False = always over the group (tests of that path)
        self.shared_right = hosts[self.right] == hosts[rank] and shared is not False
        self.shared_left = hosts[self.left] == hosts[rank] and shared is not False
        self.slot = -1
        self.slots: dict[int, torch.Tensor] = {}      # this rank's snapshot buffers, by slot
        self.own: dict[int, dict] = {}   # step -> {"meta", "buf", "crc"}: this rank's, kept
        self.held_by_step: dict[int, dict] = {}  # step -> held: the left's, the newest two
        self.mapped: dict[int, torch.Tensor] = {}     # the left neighbour's, by slot
        self.layout: list[dict] | None = None
        self.buf: torch.Tensor | None = None
        self.recv = [None, None, None]  # receive buffers: never one of the two held copies
        self.held: dict | None = None  # {"from", "step", "meta", "buf", "crc"} once verified
        self.stats = {"snapshots": 0, "bytes": 0, "copy_s": 0.0, "stall_s": 0.0,
                      "exchange_s": 0.0, "exchange_cpu_s": 0.0, "crc_failures": 0,
                      "held_step": None}
        self._cpu0 = time.process_time()
        self._job: threading.Thread | None = None
        self._error: BaseException | None = None
        self.abandoned = False  # `settle` gave up on the exchange in flight: never joined
        # {storage key: checksum} of the state the optimizer wrote (StepGuard.recorded)
        self.recorded = None
        self._expected: list[int] = []

    # -- the training thread -----------------------------------------------------------------
    def after_step(self, step: int) -> None:
        if not self.interval or step % self.interval:
            return
        t0 = time.perf_counter()
        self.wait()
        t1 = time.perf_counter()
        # here, not at the top: the supervisor uses this module's file helpers (remove_shared)
        # without the DTensor stack the state's walk needs
        from myria.train.state import flat_state, rng_state

        state = flat_state(self.engine)
        layout, nbytes = layout_of(state)
        # SLOTS buffers in turn, either way: the last SLOTS snapshots of this rank stay intact
        # (in-job recovery rolls back to the newest step every rank's copy exists for)
        self.slot = (self.slot + 1) % SLOTS
        buf = self.slots.get(self.slot)
        if buf is None or buf.numel() != nbytes:
            buf = self.slots[self.slot] = (
                _shared(f"{self.prefix}{self.rank}-{self.slot}", nbytes) if self.shared_right
                else torch.empty(nbytes, dtype=torch.uint8))
        self.buf = buf
        for old in [k for k, v in self.own.items() if v["buf"] is buf]:
            del self.own[old]
        from myria.train import checksums

        self._expected = checksums.expected_sums(
            self.recorded() if self.recorded is not None else {},
            [state[i["k"]] for i in layout if "off" in i and i["n"]])
        pack(state, self.buf, layout)
        sched = getattr(self.engine, "scheduler_state", None)
        meta = {"step": step, "rank": self.rank, "layout": layout, "rng": rng_state(),
                "scheduler": sched() if sched else None}
        if (bad := packed_differs(buf, layout, self._expected)) is None:
            self.own[step] = {"meta": meta, "buf": buf, "crc": None}
        else:   # never kept, never held: its holder receives it flagged
            self._integrity_failure(step, bad, "once packed")
        t2 = time.perf_counter()
        self.stats["stall_s"] += t1 - t0
        self.stats["copy_s"] += t2 - t1
        self.stats["snapshots"] += 1
        self.stats["bytes"] += nbytes
        self._job = threading.Thread(target=self._exchange, args=(meta,), daemon=True,
                                     name="myria-peer-snapshot")
        self._job.start()

    def _integrity_failure(self, step: int, key: str, when: str) -> None:
        self.stats["integrity_failures"] = self.stats.get("integrity_failures", 0) + 1
        self.own.pop(step, None)
        log.warning("rank %d: the peer snapshot of step %d differs from the state the "
                    "optimizer wrote %s (%s): not kept", self.rank, step, when, key)

    def wait(self, timeout: float | None = None) -> bool:
        """Until the exchange in flight (if any) is over; raises what it failed with. With
        `timeout`: False if it is still running after that many seconds (it goes on)."""
        if self._job is not None:
            self._job.join(timeout)
            if self._job.is_alive():
                return False
            self._job = None
        if self._error is not None:
            e, self._error = self._error, None
            raise e
        return True

    def settle(self, timeout_s: float) -> bool:
        """The failure path (in-job recovery's `InJob.keep`), BEFORE the process groups are
        aborted: let the exchange in flight finish, for at most `timeout_s`. True once it is
        over (done or failed); False: it is abandoned, `close` will not join it.

        Why first: gloo (torch 2.13, tcp transport) fails the pending operations of a pair
        whose connection closes, but not an unbound-buffer send already being written nor a
        receive whose payload is being read (`Pair::signalException` skips `tx_` entries of
        unbound buffers and the receive in progress), so aborting in the middle of a
        transfer (`abort_groups`: shutdown(2) of every socket) left this thread waiting for
        the group's timeout (600 s; tests/train/test_peer_race.py). Let through, the
        exchange completes in milliseconds: every rank posts its side in `after_step`, and
        a peer that died closed its sockets, which fails the operations still pending.
        What stays is a transfer cut by a peer that died in the middle of it, or a frozen
        peer: those are abandoned after `timeout_s` and keep waiting in this daemon thread,
        which holds the group (and its buffers) until its timeout; the group is never
        destroyed under an operation in flight, and nothing else waits for it. `kept` is
        then the copies that verified before: a transfer never lands in either held copy
        (`recv` buffers, `_hold`)."""
        try:
            done = self.wait(timeout_s)
        except BaseException as e:  # the exchange in flight met the same failure
            log.debug("peer snapshot exchange ended with: %s", e)
            return True
        if not done:
            self.abandoned = True
            self.stats["abandoned"] = True
            log.warning("rank %d: the peer snapshot exchange in flight is not over after "
                        "%.1f s: left behind; the held copy of rank %d stays at step %s",
                        self.rank, timeout_s, self.left, self.stats["held_step"])
        return done

    # -- the background thread ---------------------------------------------------------------
    def _exchange(self, meta: dict) -> None:
        try:
            t0, c0 = time.perf_counter(), time.thread_time()
            self._swap(meta)
            self.stats["exchange_s"] += time.perf_counter() - t0
            self.stats["exchange_cpu_s"] += time.thread_time() - c0
        except BaseException as e:  # the training thread sees it at the next snapshot
            self._error = e

    def _swap(self, meta: dict) -> None:
        mbytes = json.dumps(meta).encode()
        mt = torch.frombuffer(bytearray(mbytes), dtype=torch.uint8)
        own_crc = crc32(self.buf)
        # the CRC-32 covers verified bytes only: checked again after it was taken
        ok = meta["step"] in self.own
        if ok and (bad := packed_differs(self.buf, meta["layout"], self._expected)):
            self._integrity_failure(meta["step"], bad, "before it was sent")
            ok = False
        if ok:
            self.own[meta["step"]]["crc"] = own_crc
        head = torch.tensor([meta["step"], len(mbytes), self.buf.numel(), own_crc,
                             zlib.crc32(mbytes), self.slot, int(ok)], dtype=torch.int64)
        rhead = torch.empty(7, dtype=torch.int64)
        self._run([self._isend(head, self.right, group=self.group),
                   self._irecv(rhead, self.left, group=self.group)])
        step, mlen, nbytes, crc, mcrc, slot, rok = (int(x) for x in rhead)
        rmeta = torch.empty(mlen, dtype=torch.uint8)
        sends = [self._isend(mt, self.right, group=self.group)]
        if not self.shared_right:
            sends.append(self._isend(self.buf, self.right, group=self.group))
        if self.shared_left:  # the left neighbour's file holds it: map it, take the layout
            self._run([*sends, self._irecv(rmeta, self.left, group=self.group)])
            mraw = bytes(rmeta.numpy())
            rbuf = self.mapped.get(slot)
            if rbuf is None or rbuf.numel() != nbytes:
                rbuf = self.mapped[slot] = _shared(f"{self.prefix}{self.left}-{slot}", nbytes)
            if zlib.crc32(mraw) != mcrc:
                self.stats["crc_failures"] += 1
                return
            if not rok:   # its sender found it differs from the state it wrote
                return
            self._hold({"from": self.left, "step": step, "meta": json.loads(mraw),
                        "buf": rbuf, "crc": crc, "path": f"{self.prefix}{self.left}-{slot}",
                        "host": socket.gethostname()})
            return
        busy = [h["buf"] for h in self.held_by_step.values()]
        slot = next(i for i, b in enumerate(self.recv) if b is None or
                    not any(b is x for x in busy))
        rbuf = self.recv[slot]
        if rbuf is None or rbuf.numel() != nbytes:
            rbuf = self.recv[slot] = torch.empty(nbytes, dtype=torch.uint8)
        self._run([*sends, self._irecv(rmeta, self.left, group=self.group),
                   self._irecv(rbuf, self.left, group=self.group)])
        mraw = bytes(rmeta.numpy())
        if not rok:   # its sender found it differs from the state it wrote
            return
        if crc32(rbuf) != crc or zlib.crc32(mraw) != mcrc:
            self.stats["crc_failures"] += 1
            log.warning("peer snapshot of rank %d at step %d fails its checksum: the previous "
                        "copy (step %s) is kept", self.left, step, self.stats["held_step"])
            return
        self._hold({"from": self.left, "step": step, "meta": json.loads(mraw), "buf": rbuf,
                    "crc": crc})

    def _hold(self, held: dict) -> None:
        """`held` is the newest verified copy; the one before it stays (the two newest)."""
        for k in [k for k, v in self.held_by_step.items() if v["buf"] is held["buf"]]:
            del self.held_by_step[k]   # its buffer (a shared file's slot) is overwritten
        self.held_by_step[held["step"]] = held
        for k in sorted(self.held_by_step)[:-2]:
            del self.held_by_step[k]
        self.held = held
        self.stats["held_step"] = held["step"]

    @staticmethod
    def _run(works) -> None:
        for w in works:
            w.wait()

    # -- what is held ------------------------------------------------------------------------
    def verify(self) -> str | None:
        """None if the held snapshot still matches its checksum, else why not."""
        if self.held is None:
            return "no snapshot held"
        if crc32(self.held["buf"]) != self.held["crc"]:
            return (f"the snapshot of rank {self.held['from']} at step {self.held['step']} "
                    "no longer matches its CRC-32")
        return None

    def kept(self) -> dict[str, Any]:
        """What outlives this ring for in-job recovery (call after `wait`, or once the
        exchange has failed): this rank's own snapshots and its left neighbour's held ones,
        by step. The buffers stay valid after `close` (a mapping outlives its file)."""
        return {"rank": self.rank, "left": self.left, "world": self.world,
                "stride": self.stride, "own": dict(self.own),
                "held": dict(self.held_by_step)}

    def held_state(self) -> dict[str, Any]:
        if (why := self.verify()) is not None:
            from myria.errors import CheckpointError

            raise CheckpointError(f"peer snapshot unusable: {why}")
        return unpack(self.held["meta"], self.held["buf"])

    def close(self) -> None:
        try:
            if not self.abandoned:  # else its thread may wait out the group's timeout
                self.wait()
        except BaseException as e:
            log.warning("peer snapshot exchange failed: %s", e)
        # the holder's mapping keeps its copy until it ends; a failed rank under in-job
        # recovery leaves its files (`keep_files`): its replacement maps them by name (a rank
        # that raised ends through here, a killed one never does); the supervisor removes
        # what is left when the job ends (`remove_shared`)
        for slot in self.slots if not self.keep_files else ():
            try:
                os.unlink(f"{self.prefix}{self.rank}-{slot}")
            except OSError:
                pass
        if self.run_dir is None:
            return
        from myria.fsutil import atomic_write

        try:
            out = Path(self.run_dir) / DIR / f"rank{self.rank:05d}.json"
            out.parent.mkdir(parents=True, exist_ok=True)
            # the whole process's CPU time since the ring started: the snapshots' share of it
            # is their cost on a host whose cores are all busy (this CPU box)
            s = dict(self.stats, interval=self.interval, rank=self.rank, peer=self.right,
                     holds_rank=self.left, process_cpu_s=time.process_time() - self._cpu0)
            atomic_write(out, json.dumps({k: round(v, 6) if isinstance(v, float) else v
                                          for k, v in s.items()}, indent=1))
        except OSError:
            pass


class _Off:
    held = None

    def kept(self) -> None:
        return None

    def after_step(self, step: int) -> None:
        pass

    def settle(self, timeout_s: float) -> bool:
        return True

    def close(self) -> None:
        pass


def ring_stride(world: int) -> int:
    """How far right a rank's snapshot goes: the ranks per host (LOCAL_WORLD_SIZE) when the
    world spans several hosts of that many ranks each, else 1 (the next rank)."""
    per_host = int(os.environ.get("LOCAL_WORLD_SIZE", world) or world)
    return per_host if 0 < per_host < world and world % per_host == 0 else 1


def interval_of(resilience) -> int:
    """`resilience.memory_snapshot_interval` resolved: -1 is every step with in-job recovery
    (which reads the snapshots), else off."""
    n = resilience.memory_snapshot_interval
    if n >= 0:
        return n
    return 1 if resilience.recovery == "in-job" else 0


def start(interval: int, engine, rank: int, world: int, run_dir: Path | None):
    """The ring's member for this rank, or a no-op when off (interval 0) or alone."""
    if not interval or world < 2:
        return _Off()
    return PeerSnapshots(interval, engine, rank, world, run_dir)
