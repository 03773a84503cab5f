"""In-job recovery across hosts (`resilience.recovery = "in-job"` with --nnodes > 1): the ranks
of a lost host are taken over by a spare host's processes while every other host's workers stay.

The job's first node serves the rendezvous store (torch's c10d rendezvous); it outlives every
worker, so it carries what the hosts share, under `myria-injob/JOB/` (myria.train.rejoin.key):

- `members`: the hosts of the current rendezvous round (written by the first host);
- `hosts/HOST`: what a member host runs (its round, attempt, ranks and each worker's rank
  environment), written when its workers start;
- `alive/HOST`: a counter the host's supervisor bumps every BEAT_S (`Beat`);
- `failed`: how many workers of the job saw a collective fail (myria.train.rejoin);
- `taken/HOST`: the spare host that claimed HOST's ranks (compare-and-set: one claim only);
- `attempt`, `lost`: the announcement the survivors' workers wait on (myria.train.rejoin);
- `takeover/HOST`: the takeover's times, which the survivors' supervisors log.

A spare host (waiting in the rendezvous, no ranks) watches the members (`Watch`): a member
whose counter has not moved for `resilience.heartbeat_s x missed_heartbeats` while a worker
of the current attempt saw its collective fail is lost. Both are needed: a supervisor starved
of CPU for a few seconds is not a lost host while its workers train, and a worker's own error
is not one while its host beats. The spare claims it, announces the next attempt (the lost
ranks), and starts one worker per lost rank with that rank's environment on its own host
(a hot spare of its own pool, `resilience.spares`, else a fresh process). The survivors
rebuild their run in that attempt; each replacement takes its state from the peer holding it
on another host (the ring's step is the ranks per host, myria.train.peer.ring_stride), sent
over the new group and checked against its CRC-32 (myria.train.rejoin). The survivors'
agents ignore the spare waiting in the rendezvous from then on (no full restart of the round)
and the first host's agent passes the exit barrier for the lost host.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time

from myria import rundir
from myria.resilience.multihost import close_rendezvous, store_client
from myria.train.launch import ForkedProcess, fork_module

log = logging.getLogger("myria.supervisor")

BEAT_S = 0.5      # how often a member's supervisor bumps its counter
# the first node (the rendezvous store's, the batch script's: its loss ends the job anyway)
# waits this much longer before it claims a lost host, so another spare takes the ranks
HEAD_DELAY_S = 1.5
WATCH_S = 0.25    # how often a spare looks at the members' counters
# a worker's environment that makes it that rank of the job (the rest is the spare host's own)
RANK_ENV = ("RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME", "WORLD_SIZE",
            "LOCAL_WORLD_SIZE", "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "MASTER_ADDR",
            "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_MAX_RESTARTS",
            "TORCHELASTIC_USE_AGENT_STORE", rundir.FENCE_ENV)


def _key(job: str, name: str) -> str:
    from myria.train.rejoin import key

    return key(job, name)


def _is_head(endpoint: str) -> bool:
    import socket

    host = endpoint.rpartition(":")[0]
    try:
        return host in ("127.0.0.1", "localhost") or host in \
            {a[4][0] for a in socket.getaddrinfo(socket.gethostname(), None)}
    except OSError:
        return False


def publish(sup, wg, pc_envs: dict) -> None:
    """A member's workers started: what they are, for a spare that may have to take over."""
    # the round is the supervisor's (its workers inherit it), the rest each worker's own
    fence = {rundir.FENCE_ENV: os.environ[rundir.FENCE_ENV]} \
        if os.environ.get(rundir.FENCE_ENV) else {}
    envs = [{**fence, **{k: env[k] for k in RANK_ENV if k in env}}
            for _, env in sorted(pc_envs.items())]
    try:
        store = sup.shared_store()
        store.set(_key(sup.job, f"hosts/{sup.host}"), json.dumps(
            {"round": os.environ.get(rundir.FENCE_ENV, ""), "attempt": sup.attempt,
             "ranks": sup.ranks, "envs": envs, "at": time.time()}))
    except Exception as e:   # the spare then cannot take this host over: a full restart
        log.warning("in-job across hosts: this host's workers not published (%s)", e)


def announced(store, job: str) -> int:
    """The newest attempt announced for in-job recovery (0: none)."""
    raw = store.get(_key(job, "attempt")).decode() if store.check([_key(job, "attempt")]) \
        else ""
    return int(raw) if raw.isdigit() else 0


def next_attempt(store, job: str) -> int:
    """The attempt to announce: after the newest announced and every attempt the members'
    workers run (each host's agent numbers its own restarts)."""
    k = _key(job, "members")
    hosts = json.loads(store.get(k).decode()) if store.check([k]) else []
    published = [json.loads(store.get(_key(job, f"hosts/{h}")).decode())["attempt"]
                 for h in hosts if store.check([_key(job, f"hosts/{h}")])]
    return max([announced(store, job), *published]) + 1


class Beat(threading.Thread):
    """A member host's liveness: bumps `alive/HOST` every BEAT_S (its own store client)."""

    def __init__(self, endpoint: str, job: str, host: str) -> None:
        super().__init__(daemon=True, name="myria-host-beat")
        self.endpoint, self.key = endpoint, _key(job, f"alive/{host}")
        self.stop_event = threading.Event()

    def run(self) -> None:
        store = None
        while not self.stop_event.wait(BEAT_S):
            try:
                store = store or store_client(self.endpoint, 5.0)
                store.add(self.key, 1)
            except Exception:
                store = None


class Watch(threading.Thread):
    """A spare host's watch over the members; on a lost one, the takeover (see the module)."""

    def __init__(self, sup) -> None:
        super().__init__(daemon=True, name="myria-takeover")
        self.sup = sup
        self.lost_s = sup.r.heartbeat_s * sup.r.missed_heartbeats
        if _is_head(sup._endpoint):   # the first node claims last: another spare first
            self.lost_s += HEAD_DELAY_S
        self.seen: dict[str, tuple[int, float]] = {}   # host -> (counter, when it moved)
        self.round = None            # the members' list as last read, and the failures
        self.failed_base = 0         # counted when it was first read
        self.stop_event = threading.Event()
        self.claimed: str | None = None
        self.procs: dict[int, ForkedProcess] = {}   # rank -> its worker here
        self.codes: dict[int, int] = {}
        self.record: dict = {}
        self.done = threading.Event()

    # -- watching ----------------------------------------------------------------------------
    def run(self) -> None:
        store = None
        try:
            while not self.stop_event.wait(WATCH_S):
                try:
                    store = store or store_client(self.sup._endpoint, 5.0)
                    if self.sup.ranks:   # this host joined a round: a member, not a spare
                        return
                    lost = self._lost(store)
                except Exception:
                    store = None
                    continue
                if lost is None:
                    continue
                host, info, silent_at = lost
                mine = store.compare_set(_key(self.sup.job, f"taken/{host}"), "",
                                         self.sup.host).decode()
                if mine != self.sup.host:
                    self.seen.pop(host, None)   # another spare took it
                    continue
                self.claimed = host
                self._take_over(store, host, info, silent_at)
                self._follow()
                if self.codes and all(c == 0 for c in self.codes.values()):
                    close_rendezvous(self.sup.agent)   # training ended: this spare's wait too
                return
        finally:
            self.done.set()

    def _lost(self, store):
        """(host, its published info, when its counter last moved) of a lost member, or
        None."""
        job = self.sup.job
        hosts = {}
        raw = store.get(_key(job, "members")).decode() \
            if store.check([_key(job, "members")]) else "[]"
        if raw != self.round:   # a new round: failures before it are not evidence
            self.round, self.failed_base = raw, store.add(_key(job, "failed"), 0)
        names = json.loads(raw)
        for h in names:
            k = _key(job, f"hosts/{h}")
            if store.check([k]):
                hosts[h] = json.loads(store.get(k).decode())
        now = time.time()
        for h, info in hosts.items():
            if h == self.sup.host or store.check([_key(job, f"taken/{h}")]):
                continue
            n = store.add(_key(job, f"alive/{h}"), 0)
            last = self.seen.get(h)
            if last is None or last[0] != n:
                self.seen[h] = (n, now)
                continue
            if now - last[1] < self.lost_s:
                continue
            if store.add(_key(job, "failed"), 0) > self.failed_base:
                return h, info, last[1]
        return None

    # -- taking over -------------------------------------------------------------------------
    def _take_over(self, store, host: str, info: dict, silent_at: float) -> None:
        from myria.resilience.policy import Fault
        from myria.train.rejoin import ENV_JOIN

        sup = self.sup
        now = time.time()
        ranks = info["ranks"]
        attempt = next_attempt(store, sup.job)
        since = time.strftime("%H:%M:%S", time.localtime(silent_at))
        evidence = (f"host {host} (ranks {ranks}) silent since {since} "
                    f"({now - silent_at:.1f} s; resilience.heartbeat_s x missed_heartbeats = "
                    f"{self.lost_s:g} s) and "
                    f"{store.add(_key(sup.job, 'failed'), 0) - self.failed_base} worker(s) of "
                    "the job saw their collectives fail")
        log.warning("DETECTED host-lost on rank(s) %s: %s", ranks, evidence)
        # the record before the announcement: a survivor's supervisor that sees the new attempt
        # reads which host it replaces from the record, once (`follow`)
        self.record = {"host": host, "by": sup.host, "attempt": attempt, "ranks": ranks,
                       "silent_at": silent_at, "detected_at": now}
        store.set(_key(sup.job, f"takeover/{host}"), json.dumps(self.record))
        store.set(_key(sup.job, "lost"), json.dumps(ranks))
        store.set(_key(sup.job, "attempt"), str(attempt))
        announced_at = time.time()
        f = Fault("host-lost", list(ranks), attempt - 1, silent_at, now, evidence,
                  cause=f"host {host} lost")
        f.recovery = "in-job: host takeover"
        f.hosts_lost = [host]
        f.stopped_at = f.decided_at = f.backoff_done_at = announced_at
        sup.reached(f)   # a spare watched no worker: the step comes from the run directory
        sup.faults.append(f)
        sup.current = f
        logs = sup.run_dir / rundir.LOGS_DIR / f"{sup.job}-{sup.host}-takeover"
        how = []
        for env_of in info["envs"]:
            env = {**{k: v for k, v in os.environ.items()}, **env_of,
                   "TORCHELASTIC_RESTART_COUNT": str(attempt),
                   rundir.JOB_ATTEMPT_ENV: str(attempt), ENV_JOIN: "1"}
            env.pop("TORCHELASTIC_ERROR_FILE", None)
            rank = int(env_of["RANK"])
            d = logs / f"rank_{rank}"
            d.mkdir(parents=True, exist_ok=True)
            spare = sup.injob._take_spare() if sup.injob is not None else None
            if spare is not None:
                i, proc = spare
                sup._server.set(_key(sup.job, f"spare{i}"), json.dumps(
                    {"env": env, "stdout": str(d / "stdout.log"),
                     "stderr": str(d / "stderr.log")}))
                how.append(f"rank {rank}: hot spare {i} (pid {proc.pid})")
            else:
                proc = fork_module(("-u", "-m", "myria", *sup.worker_argv), env,
                                   str(d / "stdout.log"), str(d / "stderr.log"))
                how.append(f"rank {rank}: a fresh process (pid {proc.pid})")
            self.procs[rank] = proc
        f.restarted_at = time.time()
        sup.ranks = list(ranks)
        sup.attempt = attempt
        sup.new_watch()
        f.action.append(f"in-job: host {host}'s ranks {ranks} taken over on {sup.host} "
                        f"({'; '.join(how)}); the other hosts' workers stay")
        self.record.update(announced_at=announced_at, started_at=f.restarted_at)
        store.set(_key(sup.job, f"takeover/{host}"), json.dumps(self.record))
        log.info("ACTION in-job takeover (attempt %d): %s takes over host %s's ranks %s (%s); "
                 "the other hosts' workers stay and send the lost ranks' state from their "
                 "memory", attempt, sup.host, host, ranks, "; ".join(how))

    def _follow(self) -> None:
        """The takeover's workers to their end: their recovery tracked from their heartbeats
        (the fault's first step), their exit codes kept."""
        sup = self.sup
        while self.procs and len(self.codes) < len(self.procs):
            for rank, p in self.procs.items():
                if rank not in self.codes and p.poll() is not None:
                    self.codes[rank] = p.returncode
                    (log.info if p.returncode == 0 else log.warning)(
                        "takeover: rank %d (pid %d) ended with exit %s", rank, p.pid,
                        p.returncode)
            try:
                sup._track_recovery(sup._read_heartbeats(), time.time())
            except Exception:
                pass
            time.sleep(0.25)

    def outcome(self) -> tuple[str, int]:
        """After the job: this spare's status and exit code from its takeover workers."""
        self.done.wait()
        ok = self.codes and all(c == 0 for c in self.codes.values())
        return ("succeeded", 0) if ok else ("failed", 1)

    def stop(self) -> None:
        """The job ends without a takeover here (or its workers are done)."""
        if self.claimed is None:
            self.stop_event.set()


def follow(sup, agent) -> None:
    """A member host: a newer attempt announced by another host (a takeover, or another
    host's in-job replacement) is the one its workers join; its supervisor follows it, so it
    judges their heartbeats as that attempt's."""
    try:
        store = sup.shared_store()
        a = announced(store, sup.job)
    except Exception:
        return
    if a <= max(sup.attempt, sup.announced_base):   # none new since this round's start
        return
    taken = []
    for h in sup.members:
        k = _key(sup.job, f"takeover/{h}")
        if store.check([k]):
            t = json.loads(store.get(k).decode())
            if t.get("attempt") == a:
                taken.append(t)
    agent._remaining_restarts -= a - sup.attempt
    why = "; ".join(f"host {t['host']}'s ranks {t['ranks']} taken over by {t['by']}"
                    for t in taken) or "ranks of another host replaced in-job"
    log.info("FOLLOW attempt %d (%s): this host's workers %s stay and join it", a, why,
             sup.ranks)
    sup.attempt = a
    sup.lost_hosts.update(t["host"] for t in taken)
    sup.new_watch()
