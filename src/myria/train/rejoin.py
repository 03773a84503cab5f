"""In-job recovery, worker side: survivors stay, a replacement takes the lost rank's state from
its ring neighbour's memory, and training goes on from the newest step every rank's snapshot
holds, bit for bit as if nothing had failed (`resilience.recovery = "in-job"`, under
`myria supervise`; the supervisor's side is myria.resilience.injob).

One mechanism for every layout (FSDP, HSDP, DDP, TP, PP, experts): a lost worker is replaced
rank for rank, and every rank rebuilds its run in a new *attempt* (a generation of the job):

1. A survivor learns of the loss from its collective: gloo raises "Connection closed by peer"
   within a fraction of a second when a peer process dies, and a rank blocked on another
   survivor is released when that survivor closes its connections (`abort_groups`: torch's
   `_abort_process_group`, then shutdown(2) of its sockets, since a gloo abort alone leaves
   them open). The supervisor announces the next attempt in its store when it sees the exit.
   The survivor keeps its peer snapshots (myria.train.peer: its own last snapshots and its left
   neighbour's) and drops its Run (model, optimizer, loader, checkpoint manager).
2. It waits for the supervisor's announcement of the next attempt (a number in the store), and
   then forms the default process group of that attempt on the supervisor's TCPStore under a
   prefix of its own (`pgA/`): same world size, same rank numbers, the replacement (a hot spare
   the supervisor had started, or a fresh process) in the lost rank's place. The store is the
   supervisor's, not rank 0's, so it outlives any worker.
3. `Run.build` builds the model and groups again (a second or so) and, instead of reading the
   newest checkpoint, calls `InJob.restore`: the ranks exchange what they hold
   (`all_gather_object`), choose the newest step s for which every survivor has its own
   snapshot and each lost rank's holder (rank+1) has a copy that verifies (CRC-32), the
   replacement takes that copy (on the holder's host it maps the lost rank's shared-memory
   file, which outlives its process; else the holder sends it over the new group), and every
   rank
   loads its state of step s (model and optimizer shards, scheduler, RNG). The loader
   starts at s (each step's batch is a function of seed and step). Survivors a step ahead
   roll back to s from their own copy. Nothing is read from disk, no survivor restarts.
4. When no such step exists (a rank and its holder both lost, snapshots off, damaged copies)
   every rank knows it from the same exchanged facts and loads the newest checkpoint that
   verifies instead, still in-job (the fallback to disk).

Why on torch.distributed's own primitives and not torchft (evaluated, see myria.train.peer):
torchft heals replica groups of data parallelism from another replica; a fault inside a
replica group restarts that group, so pure FSDP (the demo's zero2 over all ranks), TP and PP
have no peer copy in it. Here the copy is the ring neighbour's, which exists in every layout,
and the recovery is the same "abort, new group of the same size, restore" in all of them.

Shrink and grow (`resilience.shrink`, pure DDP) reuse that mechanism with another size: the
supervisor names the next attempt's members (`members{A}` in its store; ranks renumbered in
slot order), each survivor restores its own copy, and the batch loader and engine share the
unchanged global batch among fewer ranks (myria.layout.Layout.share,
`Engine.divisor`); growing back, a new rank takes a replica's own copy (`choose(replicas=)`).
torchft's shrink was not taken for it: its Manager starts a quorum with its lighthouse every
step (overlapped with the forward, but a round trip per step, where this costs nothing until a
fault and one one-element all-reduce per step while shrunk), each replica group is its own
launch under the lighthouse, and it averages over
the replicas that joined the step, each training its own batch, so a step a replica short
trains a smaller batch; keeping the global batch needs the lost share
redistributed, as here.

torch's gloo has no reconfigurable group, but aborting and re-initialising the default group
under a new store prefix is supported (`destroy_process_group` resets the group counter "to
allow consistent value to be generated when we re-create process groups after some trainers
recover from failure").
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import time
from typing import Any
from urllib.parse import urlparse

import torch
import torch.distributed as dist

from myria.errors import first_line
from myria.observe import heartbeat_store
from myria.rundir import JOB_ATTEMPT_ENV
from myria.train.distributed import collective_device
from myria.train.launch import PEER_LOST
from myria.train.state import load_flat_state

log = logging.getLogger("myria")

PREFIX = "myria-injob"       # the store keys of in-job recovery: PREFIX/JOB/...
ENV_JOIN = "MYRIA_INJOB_JOIN"            # "1": this process replaces a lost rank
# tcp://HOST:PORT of the store every host's workers share for in-job recovery (a job on
# several hosts: the rendezvous store on its first node); unset: the supervisor's own store
ENV_STORE = "MYRIA_INJOB_STORE"
ENV_ASSIGNED_AT = "MYRIA_INJOB_ASSIGNED_AT"  # a spare: when it was given its rank


class Regroup(Exception):
    """Raised by every rank of a shrunk run at the same step boundary once the supervisor has
    announced a spare to grow back into (`InJob.grow_due`): the loop ends in order (saves
    finished, snapshots kept) and the ranks join the next attempt at the full size."""


def key(job: str, name: str) -> str:
    return f"{PREFIX}/{job}/{name}"


def store_address(shared: bool = False) -> tuple[str, int] | None:
    """(host, port) of the supervisor's TCPStore, or None (not supervised, or Redis);
    `shared`: the store of in-job recovery (every host's, `ENV_STORE`, where set)."""
    url = os.environ.get(ENV_STORE, "") if shared else ""
    url = url or os.environ.get(heartbeat_store.ENV_STORE, "")
    if not url.startswith("tcp://"):
        return None
    u = urlparse(url)
    return u.hostname or "127.0.0.1", int(u.port or 0)


def connect(timeout_s: float = 60.0, shared: bool = False):
    addr = store_address(shared)
    if addr is None:
        return None
    return dist.TCPStore(addr[0], addr[1], is_master=False, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=timeout_s))


def attempt_now() -> int:
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))


def abort_groups() -> None:
    """Abort every process group of this process and close its connections to its peers, so
    a peer blocked on this rank fails at once instead of at its timeout.

    gloo in torch 2.13 has no abort that reaches the wire: measured, a peer blocked in a
    collective with a rank that aborted (`_abort_process_group`) or shut down its group stays
    blocked until its timeout (120 s here); only the group's destruction closes the
    connections, and the failed run's objects (FSDP state, meshes, tracebacks) keep it alive.
    So the connections are closed under it: shutdown(2) on every TCP socket of this process
    but those to the supervisor's store (its heartbeats and the next attempt's group)."""
    if dist.is_initialized():
        try:
            dist.distributed_c10d._abort_process_group()
        except Exception as e:  # already half torn down
            log.debug("abort of the process groups: %s", e)
    close_connections({a[1] for a in (store_address(), store_address(shared=True)) if a})


def close_connections(keep_ports: set[int]) -> int:
    """shutdown(2) every connected TCP socket of this process except those to `keep_ports`
    (the stores: heartbeats, the next attempt's group); returns how many."""
    import socket
    import stat

    n = 0
    try:
        fds = [int(x) for x in os.listdir("/proc/self/fd")]
    except OSError:  # not Linux: the collective timeout is the backstop
        return 0
    for fd in fds:
        try:
            if not stat.S_ISSOCK(os.fstat(fd).st_mode):
                continue
            s = socket.socket(fileno=fd)
        except (OSError, ValueError):
            continue
        try:
            if s.family not in (socket.AF_INET, socket.AF_INET6) or \
                    s.type != socket.SOCK_STREAM:
                continue
            try:
                peer = s.getpeername()
            except OSError:
                continue  # listening or not connected
            if peer[1] in keep_ports or s.getsockname()[1] in keep_ports:
                continue
            s.shutdown(socket.SHUT_RDWR)
            n += 1
        except OSError:
            pass
        finally:
            s.detach()
    return n


def release(error: BaseException) -> None:
    """Drop every reference the failed run left behind (the frames of its traceback hold the
    model, its FSDP state, the checkpoint manager...), so its gloo process groups are
    destroyed and their connections closed: a survivor blocked in a collective with this rank
    then fails at once ("Connection closed by peer"). Aborting a gloo group does not close its
    connections (torch 2.13: a peer stays blocked until its timeout); destroying it does."""
    import gc
    import traceback

    seen = set()
    e: BaseException | None = error
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if e.__traceback__ is not None:
            traceback.clear_frames(e.__traceback__)
        e = e.__cause__ or e.__context__
    gc.collect()


class InJob:
    """This process's part in in-job recovery (None when off: see `create`)."""

    def __init__(self, cfg, run_dir, job: str, store) -> None:
        self.cfg, self.run_dir, self.job, self.store = cfg, run_dir, job, store
        self.attempt = attempt_now()
        # this process's rank in the full job (its slot in the supervisor's worker group, and
        # the rank its heartbeats carry) and the full size; a shrunk attempt renumbers ranks
        self.slot = int(os.environ.get("RANK", 0))
        self.full_world = int(os.environ.get("WORLD_SIZE", 1))
        self.replacement = os.environ.get(ENV_JOIN) == "1"
        self.kept: dict[str, Any] | None = None   # peer snapshots that outlived the Run
        self.rejoined = False   # a survivor set up for the next attempt: restore in-job
        self.failed_at = 0.0
        self.stats: list[dict] = []
        # across hosts: the rendezvous round this process started in ("JOB:ROUND"), whose
        # first group every host's workers form under the round's name (each host's agent
        # numbers its own restarts); an announcement older than this process is not for it
        from myria.rundir import FENCE_ENV

        fence = os.environ.get(FENCE_ENV, "")
        self.round = fence.rpartition(":")[2] if fence else None
        self.first_group = not self.replacement
        v = self._get("attempt", "")
        self.base = int(v) if v.isdigit() and not self.replacement else 0

    @classmethod
    def create(cls, cfg, run_dir) -> InJob | None:
        """In-job recovery for this worker: with recovery = in-job under the supervisor's
        TCPStore (myria.resilience.injob checks the rest before it starts a worker)."""
        if cfg.resilience.recovery != "in-job" or store_address(shared=True) is None or \
                int(os.environ.get("WORLD_SIZE", 1)) < 2:
            return None
        store = connect(max(60.0, cfg.training.init_timeout_s), shared=True)
        return cls(cfg, run_dir, os.environ.get(heartbeat_store.ENV_JOB, "local"), store)

    # -- the process group of an attempt -------------------------------------------------------
    def pg_store(self):
        """The default group's store of this attempt: the supervisor's (across hosts, the
        shared one), under a prefix of the attempt's own."""
        if self.round is None:
            name = f"pg{self.attempt}"
        else:
            name = f"pg-round{self.round}" + ("" if self.first_group else f"-{self.attempt}")
        return dist.PrefixStore(key(self.job, name) + "/", self.store)

    # -- a failure -----------------------------------------------------------------------------
    settle_s = 10.0  # the most `keep` lets the background traffic in flight finish

    def keep(self, run, orderly: bool = False) -> None:
        """The training loop failed: keep the peer snapshots of `run`, abort the groups.
        `orderly` (a Regroup: every rank left after the same step): nothing is aborted, the
        run's saves finish on its groups in its close."""
        self.failed_at = self.failed_at or time.time()
        # the traffic in flight first (the peer snapshots' exchange, the checkpoint's save),
        # the abort after: aborted in the middle of a transfer, gloo leaves it waiting for
        # its group's timeout, and the run's close joins it (PeerSnapshots.settle). Bounded
        # below the hang timeout: meanwhile the peers blocked on this rank wait.
        r = getattr(self.cfg, "resilience", None)
        end = time.time() + (min(self.settle_s, r.hang_timeout_s / 4) if r else self.settle_s)
        peers = getattr(run, "peers", None)
        if peers is not None:
            peers.keep_files = True   # the replacement of this rank, if it is lost, maps them
            peers.settle(max(0.0, end - time.time()))
        ckpt = getattr(run, "ckpt", None)
        if ckpt is not None and not orderly:
            ckpt.settle(max(0.0, end - time.time()))
        if not orderly:
            abort_groups()
        if peers is None:
            return
        kept = peers.kept()
        if kept is not None:
            self.kept = kept

    def recover(self, error: BaseException, hb) -> bool:
        """After `error` ended this rank's run: True once the supervisor has announced the
        next attempt and this process is set up for it (the caller forms its group and builds
        the run again); False: the error is this rank's own, or nobody announced a recovery
        (the caller re-raises it and the process exits)."""
        if not isinstance(error, Exception):
            return False
        self.failed_at = self.failed_at or time.time()
        abort_groups()
        release(error)
        try:   # the evidence a host's loss is acted on with: its peers' collectives failed
            self.store.add(key(self.job, "failed"), 1)
        except Exception:
            pass
        # waiting is start-up, not a hang: the supervisor judges it by the start-up timeout
        hb.progress.set_phase("init")   # the supervisor's view: the ledger is replaced below
        r = self.cfg.resilience
        looks_lost = any(m in f"{type(error).__name__}: {error}" for m in PEER_LOST)
        # a peer's loss is announced within a monitor interval of its exit; a hang takes the
        # supervisor hang_timeout_s to see. Our own error: a short look, then exit with it.
        wait = r.hang_timeout_s + 10 * r.heartbeat_s if looks_lost else 2 * r.heartbeat_s
        nxt = self._announced(wait)
        if nxt is None:
            self.failed_at = 0.0
            return False
        lost = self._get("lost", "[]")
        members = json.loads(self._get(f"members{nxt}", "null"))
        what = (f"the run goes on without rank(s) {lost} ({len(members)} of "
                f"{self.full_world} ranks, no spare ready)"
                if members is not None and len(members) < self.full_world else
                f"the supervisor replaces rank(s) {lost}")
        log.warning("rank %s: %s; %s: joining attempt %d in-job", os.environ.get("RANK", "?"),
                    _first_line(error), what, nxt)
        self.attempt = nxt
        os.environ["TORCHELASTIC_RESTART_COUNT"] = os.environ[JOB_ATTEMPT_ENV] = str(nxt)
        self._take_rank(nxt)
        self._new_attempt(hb, self.failed_at)
        self.failed_at = 0.0
        self.first_group = False
        self.rejoined = True
        return True

    # -- shrink and grow (resilience.shrink: pure DDP) ---------------------------------------
    @property
    def shrunk(self) -> bool:
        """This attempt runs with fewer ranks than the job (a replica was lost, none replaced)."""
        return int(os.environ.get("WORLD_SIZE", self.full_world)) < self.full_world

    def _take_rank(self, attempt: int) -> None:
        """This process's rank and the world of `attempt`: the supervisor's member list for
        it (the survivors, in slot order, after a shrink; everyone after a grow), else the
        full job."""
        members = json.loads(self._get(f"members{attempt}", "null"))
        if members is None:
            rank, world = self.slot, self.full_world
        elif self.slot in members:
            rank, world = members.index(self.slot), len(members)
        else:  # not a member: never asked to join (the supervisor dropped this slot)
            raise RuntimeError(f"slot {self.slot} is not a member of attempt {attempt} "
                               f"({members})")
        os.environ["RANK"], os.environ["WORLD_SIZE"] = str(rank), str(world)
        if members is not None:
            log.warning("rank %d of the job joins attempt %d as rank %d of %d (%s)", self.slot,
                        attempt, rank, world, "shrunk: a replica fewer, the same global batch"
                        if world < self.full_world else "grown back to the full size")

    def grow_due(self) -> bool:
        """At a step boundary of a shrunk run: has the supervisor announced the attempt that
        grows back (a spare is ready)? Rank 0 reads the store, every rank learns it from one
        one-element all-reduce, so all leave the loop after the same step."""
        flag = torch.zeros(1, device=collective_device())
        if dist.get_rank() == 0:
            v = self._get("attempt", "")
            flag[0] = float(v.isdigit() and int(v) > self.attempt)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def _get(self, name: str, default: str) -> str:
        try:
            k = key(self.job, name)
            return self.store.get(k).decode() if self.store.check([k]) else default
        except Exception:
            return default

    def _announced(self, wait_s: float) -> int | None:
        """The next attempt once the supervisor has announced it, else None after wait_s."""
        end = time.time() + wait_s
        while True:
            v = self._get("attempt", "")
            if v.isdigit() and int(v) > max(self.attempt, self.base):
                return int(v)
            if time.time() >= end:
                return None
            time.sleep(0.05)

    def _new_attempt(self, hb, since: float) -> None:
        """The heartbeat and the goodput ledger of this process go on as the new attempt's:
        its time from the failure on is recovery, its first step is looked for again."""
        from myria.observe import goodput

        # progress first, the attempt last: the heartbeat thread reads the attempt before the
        # progress, so no record it sends carries the new attempt with the old first step (a
        # supervisor would take that attempt for one that had finished a step)
        hb.progress.first_step_at = 0.0
        hb.progress.resumed_from = -1
        hb.attempt = self.attempt
        old = hb.ledger
        if old is None:
            return
        led = goodput.Ledger(self.run_dir, attempt=self.attempt)
        led.rank = old.rank
        led.marks = {"process_start": since, "entered": since}
        led.since = led.row_since = since
        hb.ledger = led
        hb.phase("init")  # start-up again: judged against the start-up timeout, not a hang

    def adjust_ledger(self, ledger) -> None:
        """A spare's ledger starts when it was given its rank, not when it was started."""
        at = os.environ.get(ENV_ASSIGNED_AT)
        if at:
            t = float(at)
            ledger.marks["process_start"] = t
            ledger.since = ledger.row_since = t

    # -- restoring from peer memory ------------------------------------------------------------
    def restore(self, engine, env, cap: int | None = None) -> int | None:
        """In `Run.build` in place of the resume from disk: load the state of the newest step
        every rank's snapshot holds; its step, or None (a fresh start, or the fallback to the
        newest checkpoint, which every rank then takes together). `cap`: no step after it
        (state after the last clean check before a fault found later, `drop_suspect`)."""
        if not (self.rejoined or self.replacement):
            return None  # a started (or restarted) job: the usual resume from disk
        t0 = time.time()
        kept, self.kept = self.kept, None
        self.rejoined = False
        info = _describe(kept, env.rank, survivor=not self.replacement)
        if info.get("refused"):   # a held copy changed after its check: a detection
            from myria import detections

            for s in info["refused"]:
                detections.record(
                    self.run_dir, "checkpoint", env.rank, info["host"], s,
                    {"peer_snapshot_of_rank": info["holds"], "check": "CRC-32"},
                    f"rank {env.rank}'s copy of rank {info['holds']}'s in-memory snapshot of "
                    f"step {s} no longer matches its CRC-32: not offered for recovery")
        infos: list = [None] * env.world_size
        dist.all_gather_object(infos, info)
        lay = engine.dims.layout
        replicas = self.cfg.training.data_parallel == "ddp" and lay.dp == env.world_size
        plan = choose(infos, replicas=replicas, cap=cap)
        self.replacement = False
        if plan is None:
            if env.is_main:
                print(f"in-job recovery: no step whose state every rank holds in memory "
                      f"({_facts(infos)}): every rank loads the newest checkpoint instead",
                      flush=True)
            self._record(None, infos, t0, env)
            return None
        step, sources = plan["step"], plan["sources"]
        state = None
        how = {}
        for lost, holder in sources.items():
            replica = lost in plan["replica"]   # a DDP replica's own copy (a grow)
            meta = infos[holder]["own_meta" if replica else "held"][step]
            # on one host the copy is the lost rank's shared-memory file: the replacement maps
            # it (what its holder maps); else the holder sends it over the new group
            mapped = bool(meta.get("path")) and meta.get("host") == infos[lost]["host"]
            how[lost] = "mapped" if mapped else "replica sent" if replica else "sent"
            if env.rank == holder and not mapped:
                dist.send(kept["own" if replica else "held"][step]["buf"], dst=lost)
            elif env.rank == lost:
                from myria.train import peer

                if mapped:
                    buf = torch.from_file(meta["path"], shared=False, size=meta["nbytes"],
                                          dtype=torch.uint8)
                else:
                    buf = torch.empty(meta["nbytes"], dtype=torch.uint8)
                    dist.recv(buf, src=holder)

                if peer.crc32(buf) != meta["crc"]:  # not an input error (exit 2): exit 1, so
                    # the supervisor restarts the group from the newest checkpoint
                    raise RuntimeError(f"the snapshot of rank {lost} at step {step} from rank "
                                       f"{holder} fails its CRC-32 on arrival")
                state = peer.unpack(meta["meta"], buf)
        if state is None:
            from myria.train import peer

            own = kept["own"][step]
            state = peer.unpack(own["meta"], own["buf"])
        load_flat_state(engine, state)
        del kept
        self._record(step, infos, t0, env, sources, how)
        if env.is_main:
            if not sources:
                whence = f"each of {env.world_size} ranks its own copy"
            elif plan["replica"]:
                whence = f"new rank(s) {plan['replica']} from a replica's copy"
            else:
                whence = f"rank(s) {sorted(sources)} from their ring neighbours' copies"
            print(f"in-job recovery: resumed from step {step} held in memory ({whence}) in "
                  f"{time.time() - t0:.2f} s", flush=True)
        return step

    def _record(self, step, infos, t0, env, sources=None, how=None) -> None:
        self.stats.append({"attempt": self.attempt, "step": step, "sources": sources or {},
                           "copy": how or {},
                           "restore_s": round(time.time() - t0, 4), "facts": _facts(infos)})
        if not env.is_main:
            return
        try:
            from myria.fsutil import atomic_write

            out = self.run_dir / "peer" / "injob.json"
            out.parent.mkdir(parents=True, exist_ok=True)
            old = json.loads(out.read_text()) if out.exists() else []
            atomic_write(out, json.dumps(old + self.stats[-1:], indent=1))
        except (OSError, ValueError):
            pass


def _first_line(e: BaseException) -> str:
    return f"{type(e).__name__}: " + first_line(e)


def _describe(kept: dict | None, rank: int, survivor: bool = True) -> dict:
    """What this rank can contribute: its own snapshots' steps and the held copies (their
    metadata and checksums: the bytes go to the replacement only)."""
    import socket

    from myria.train import peer

    if kept is None:  # a replacement, or a survivor without snapshots (interval 0)
        return {"rank": rank, "fresh": True, "own": [], "holds": None, "held": {},
                "survivor": survivor, "host": socket.gethostname()}
    own = [s for s, o in kept["own"].items()
           if o["crc"] is None or peer.crc32(o["buf"]) == o["crc"]]
    # what a new rank of a data-parallel replica group takes when the run grows back
    own_meta = {s: {"meta": kept["own"][s]["meta"], "nbytes": kept["own"][s]["buf"].numel(),
                    "crc": kept["own"][s]["crc"] if kept["own"][s]["crc"] is not None
                    else peer.crc32(kept["own"][s]["buf"])} for s in own}
    held, refused = {}, []
    for s, h in kept["held"].items():
        if peer.crc32(h["buf"]) == h["crc"]:  # the same check as a checkpoint's on load
            held[s] = {"meta": h["meta"], "crc": h["crc"], "nbytes": h["buf"].numel(),
                       "path": h.get("path"), "host": h.get("host")}
        else:   # changed since it was verified: never offered
            refused.append(s)
            log.warning("rank %d: its copy of rank %d's snapshot of step %d no longer matches "
                        "its CRC-32: not offered for recovery", rank, kept["left"], s)
    return {"rank": rank, "fresh": False, "own": sorted(own), "holds": kept["left"],
            "held": held, "refused": sorted(refused), "own_meta": own_meta,
            "ring": kept.get("world"), "stride": kept.get("stride", 1),
            "host": socket.gethostname()}


def choose(infos: list[dict], replicas: bool = False, cap: int | None = None) -> dict | None:
    """The newest step every survivor has its own snapshot of and each lost (fresh) rank's
    holder (its right neighbour in the ring, rank + stride, a survivor) has a verified copy
    of; with the holders:
    {"step": s, "sources": {lost: holder}}, or None. `replicas` (pure DDP: every rank holds
    the same state): a new rank without a holder (a run growing back after a shrink, whose
    ring did not include it) takes the lowest survivor's own copy instead."""
    world = len(infos)
    lost = [i["rank"] for i in infos if i["fresh"]]
    survivors = [i for i in infos if not i["fresh"]]
    if not survivors:
        return None
    steps = set.intersection(*(set(i["own"]) for i in survivors))
    if cap is not None:   # copied after the last clean check before a fault: suspect
        steps = {s for s in steps if s <= cap}
    sources, replica = {}, []
    stride = survivors[0].get("stride", 1)
    for r in lost:
        h = infos[(r + stride) % world]
        # a holder of the same ring: a shrunk attempt's ring numbered its ranks otherwise
        if h["fresh"] or h["holds"] != r or h.get("ring", world) != world:
            if replicas:
                sources[r] = survivors[0]["rank"]
                replica.append(r)
                continue
            return None   # both copies of this rank's state are gone
        steps &= {int(s) for s in h["held"]}
        sources[r] = h["rank"]
    if not steps:
        return None
    return {"step": max(steps), "sources": sources, "replica": replica}


def _facts(infos: list[dict]) -> str:
    return "; ".join(f"rank {i['rank']}: " + (
        ("no snapshot" if i.get("survivor") else "replacement") if i["fresh"] else
                     f"own {i['own']}, holds rank {i['holds']} at {sorted(i['held'])}"
                     + (f" (refused, CRC-32: {i['refused']})" if i.get("refused") else ""))
                     for i in infos)

