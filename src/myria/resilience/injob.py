"""In-job recovery, supervisor side (`resilience.recovery = "in-job"`): replace one lost worker.

`InJobRecovery.poll` runs before torch elastic's agent looks at its workers. When exactly one
worker has exited with a failure (or a frozen one was killed, `kill_frozen`), it starts the
replacement (a hot spare, `resilience.spares`, else a fresh process with the lost one's command
and environment), puts it in the dead worker's place in the agent's process context and worker
group, announces the next attempt in the store and reports the group healthy; the other workers
stay, and all rebuild their run from peer memory (`myria.train.rejoin`). Everything else goes
the agent's way, the full restart from the newest checkpoint: two workers lost at once, a loss
while an in-job recovery is under way, an input error (exit 2), a failed save (exit 4), a hang,
no restarts left. With `resilience.shrink` (pure DDP) and no spare, the survivors go on as a
smaller data-parallel group (the lost slot is `_Dropped`) and grow back once a spare is ready.
Each recovery, shrink or grow uses one of `resilience.max_restarts`. `check` refuses in one line
a config it cannot serve (it needs the supervisor's TCPStore; shrinking, one host). Across
hosts the announcements go to the store every host shares (`Supervisor.announce_store`) and a
lost host is taken over by a spare host (myria.resilience.takeover). The protocol and its
reasons: docs/robustness.md, "In-job recovery" and "How in-job recovery sits on torch elastic".
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import time

from myria import rundir
from myria.errors import ConfigError, MyriaError
from myria.resilience.policy import SAVE_FAILED
from myria.train.launch import ForkedProcess, fork_module

log = logging.getLogger("myria.supervisor")

USER_ERROR = MyriaError.exit_code   # exits a replacement cannot fix: bad input, full disk
# Idle spares that die are started again at most this many times in a job: one that keeps dying
# (a broken environment) is said once and left, and recovery falls back to a fresh process.
SPARE_RESTARTS = 3


def check(cfg, min_nodes: int, max_nodes: int, nproc: int) -> None:
    """One line for a config in-job recovery cannot serve."""
    r = cfg.resilience
    if r.recovery != "in-job":
        return
    if r.store != "tcp":
        raise ConfigError(f"resilience.recovery = 'in-job' needs resilience.store = 'tcp' (the "
                          f"workers' process groups live on the supervisor's TCPStore), not "
                          f"{r.store!r}")
    if nproc < 2 and max_nodes < 2:
        raise ConfigError("resilience.recovery = 'in-job' needs --nproc >= 2 (survivors to "
                          "stay); use recovery = 'restart'")
    if r.shrink and max_nodes > 1:
        raise ConfigError(f"resilience.shrink = true runs on one host (--nnodes 1), not "
                          f"--nnodes {min_nodes}:{max_nodes}: a lost host is taken over by a "
                          "spare host; set resilience.shrink = false")
    if r.shrink:
        from myria.layout import Layout

        why = Layout.resolve(cfg.parallel, nproc).shrink_refusal(cfg, nproc)
        if why is not None:
            raise ConfigError(f"resilience.shrink = true cannot shrink this run: {why}; set "
                              "resilience.shrink = false (a fresh process replaces a lost "
                              "worker)")


class InJobRecovery:
    """The supervisor's in-job recovery: replaces a lost worker, keeps spares."""

    def __init__(self, sup) -> None:
        self.sup = sup
        self.spares: dict[int, ForkedProcess] = {}
        self.next_spare = 0
        self.recovered = 0
        self.owed = 0   # spares used, to be started again once the recovery is over
        self.frozen: tuple[int, object] | None = None  # (local rank, its Fault): killed by us
        self.shrunk: dict | None = None   # the slot dropped by a shrink, until the grow
        self.growing: dict | None = None  # a grow announced, until its first step
        self.resizes: list[dict] = []     # each shrink and grow, for the summary
        self.spare_deaths = 0             # idle spares found dead (check_idle_spares)

    # -- spares ------------------------------------------------------------------------------
    def start_spares(self) -> None:
        """The pool's spares, started at the first look at the workers (`poll`): a spare is
        forked ready (myria.train.launch.fork_module), so none is held while the hosts
        gather, and the supervisor's start does not wait for its forkserver's imports."""
        self.owed += self.sup.r.spares

    def _start_spare(self) -> None:
        i = self.next_spare
        self.next_spare += 1
        logs = self.sup.run_dir / rundir.LOGS_DIR
        logs.mkdir(parents=True, exist_ok=True)
        out = str(logs / f"spare{i}.log")
        self.spares[i] = fork_module(("-u", "-m", "myria.train.spare", str(i),
                                      *self.sup.worker_argv), dict(os.environ), out, out)
        log.info("started hot spare %d (pid %d)", i, self.spares[i].pid)

    def _take_spare(self) -> tuple[int, ForkedProcess] | None:
        for i, p in sorted(self.spares.items()):
            if p.poll() is None:
                del self.spares[i]
                return i, p
            del self.spares[i]
            log.warning("hot spare %d (pid %d) is gone (exit %s): not used", i, p.pid,
                        p.returncode)
        return None

    def check_idle_spares(self) -> None:
        """An idle spare that died is said when it happens (with its exit status and log) and
        started again, not found gone only when a rank needs it."""
        from myria import detections

        for i, p in sorted(self.spares.items()):
            code = p.poll()
            if code is None:
                continue
            del self.spares[i]
            self.spare_deaths += 1
            again = self.spare_deaths <= SPARE_RESTARTS
            where = self.sup.run_dir / rundir.LOGS_DIR / f"spare{i}.log"
            log.warning("DETECTED hot spare %d (pid %d) died while idle (exit %s; its log: %s)%s",
                        i, p.pid, code, where, "; starting another" if again else
                        f"; not started again after {self.spare_deaths} deaths: a lost rank "
                        "is replaced by a fresh process")
            detections.record(self.sup.run_dir, "spare-lost", None, self.sup.host,
                              self.sup.max_step, {"spare": i, "pid": p.pid, "exit": code,
                                                  "log": str(where)},
                              "started another" if again else "none (too many deaths)")
            if again:
                self._start_spare()

    def close(self) -> None:
        for p in self.spares.values():
            if p.poll() is None:
                p.kill()
        for p in self.spares.values():
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        self.spares.clear()

    # -- the agent's monitor -----------------------------------------------------------------
    def poll(self, agent, wg):
        """Before the agent's monitor: a RunResult (healthy) when a lost worker was replaced
        in-job, else None (the agent's path: nothing failed, or the full restart)."""
        from torch.distributed.elastic.agent.server.api import RunResult, WorkerState

        pc = getattr(agent, "_pcontext", None)
        handlers = getattr(pc, "subprocess_handlers", None)
        if not handlers or self.sup.watch is None:
            return None
        f = self.sup.current
        if self.owed and (f is None or f.first_step_at):
            # the first spares, or those used, once any recovery is over (not to compete
            # with it)
            for _ in range(self.owed):
                self._start_spare()
            self.owed = 0
        self.check_idle_spares()
        if self.shrunk is not None and self.shrunk["pc"] is not pc:
            self.shrunk = self.growing = None   # a full restart started every slot again
        if self.growing is not None:
            self._track_grow()
        dead = {lr: h.proc.poll() for lr, h in handlers.items()
                if not isinstance(h, _Dropped)}
        dead = {lr: c for lr, c in dead.items() if c not in (None, 0)}
        if not dead:
            if self.shrunk is not None and self.growing is None:
                self._grow_if_ready(agent, wg, pc)
            return None
        busy = f is not None and f.recovery.startswith("in-job") and not f.first_step_at
        busy = busy or self.growing is not None
        code = next(iter(dead.values()))
        # a silent-corruption verdict stops every rank together: the rollback is the job's
        sdc = self.sup.sdc_pending()
        if len(dead) > 1 or busy or code in (USER_ERROR, SAVE_FAILED) or sdc or \
                agent._remaining_restarts <= 0 or self.shrunk is not None:
            why = ("a fault during an in-job recovery" if busy else
                   "a silent-corruption verdict: every rank rolls back" if sdc else
                   "a worker lost while the run is shrunk" if self.shrunk is not None else
                   f"{len(dead)} workers lost at once" if len(dead) > 1 else
                   "no restarts left" if agent._remaining_restarts <= 0 else
                   f"exit code {code}")
            log.warning("ACTION in-job recovery not possible (%s): the worker group restarts "
                        "from the newest checkpoint", why)
            if f is not None and busy:
                f.action.append("fault during in-job recovery: full restart")
            return None
        local = next(iter(dead))
        fault = None
        if self.frozen is not None and self.frozen[0] == local:
            fault = self.frozen[1]   # the frozen rank we killed: its fault is recorded
        self.frozen = None
        self._replace(agent, wg, pc, local, code, fault)
        return RunResult(state=WorkerState.HEALTHY)

    def kill_frozen(self, agent, wg, f) -> bool:
        """A single rank without heartbeats (frozen: SIGSTOP, a stuck kernel call) is killed,
        and replaced in-job at the next poll; True if so. A hang (heartbeats, no progress) is
        not: the watchdog cannot tell the stuck rank from the ranks waiting for it."""
        if f.kind != "missed-heartbeats" or len(f.ranks) != 1 or agent._remaining_restarts <= 0:
            return False
        prev = self.sup.faults[-2] if len(self.sup.faults) > 1 else None
        if prev is not None and prev.recovery.startswith("in-job") and not prev.first_step_at:
            return False  # during an in-job recovery: the full restart
        local = next((w.local_rank for w in wg.workers if w.global_rank == f.ranks[0]), None)
        if local is None or not wg.workers[local].id:
            return False
        import signal

        try:
            os.kill(wg.workers[local].id, signal.SIGKILL)
        except OSError:
            return False
        self.frozen = (local, f)
        f.action.append(f"in-job: kill the frozen rank {f.ranks[0]}")
        log.info("ACTION kill the frozen rank %d (pid %s) to replace it in-job", f.ranks[0],
                 wg.workers[local].id)
        return True

    def _replace(self, agent, wg, pc, local: int, code: int, fault=None) -> None:
        import signal

        from myria.resilience.watch import Detection, ended
        from myria.train.rejoin import ENV_JOIN, key

        sup = self.sup
        now = time.time()
        worker = wg.workers[local]
        rank = worker.global_rank
        if fault is None:
            records = sup._read_heartbeats()
            sup.watch.heartbeats(records, now)
            how = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
            last = sup.watch.last(rank) or {}
            cause = sup.watch.cause_line(rank)
            evidence = (ended(rank, worker.id, how, last) +
                        (f"; stderr: {cause}" if cause else "") +
                        f"; ranks {[r for r in sup.ranks if r != rank]} still running")
            seen = sup.watch.state[rank].seen_at or now
            d = Detection("exit", [rank], now, seen, evidence, {"exitcodes": {rank: code}})
            log.warning("DETECTED exit on rank(s) %s: %s", d.ranks, d.evidence)
            f = sup._record(d, sup.alarms)
            f.cause = cause or how
        else:
            f = fault
        f.recovery = "in-job"
        # the attempt the survivors join: one of the restarts, so attempts keep one numbering
        # (across hosts: after the newest any host announced)
        agent._remaining_restarts -= 1
        attempt = wg.spec.max_restarts - agent._remaining_restarts
        store = sup.announce_store()
        if store is not sup._server:
            from myria.resilience.takeover import next_attempt

            attempt = max(attempt, next_attempt(store, sup.job))
            agent._remaining_restarts = wg.spec.max_restarts - attempt
        spare = self._take_spare()
        shrink = spare is None and sup.r.shrink
        if shrink:  # the members of the next attempt, before it is announced
            store.set(key(sup.job, f"members{attempt}"),
                      json.dumps([r for r in sup.ranks if r != rank]))
        store.set(key(sup.job, "lost"), json.dumps([rank]))
        store.set(key(sup.job, "attempt"), str(attempt))
        f.stopped_at = f.decided_at = f.backoff_done_at = time.time()  # no stop, no decision
        if shrink:
            self._shrink(agent, wg, pc, local, rank, attempt, f)
            return
        env = dict(pc.envs[local], TORCHELASTIC_RESTART_COUNT=str(attempt),
                   **{rundir.JOB_ATTEMPT_ENV: str(attempt)})
        env[ENV_JOIN] = "1"
        if spare is not None:
            i, proc = spare
            sup._server.set(key(sup.job, f"spare{i}"), json.dumps(
                {"env": env, "stdout": pc.stdouts.get(local), "stderr": pc.stderrs.get(local)}))
            how_new = f"hot spare {i} (pid {proc.pid})"
            f.recovery = "in-job: spare"
        else:
            proc = self._fresh(pc, local, env)
            how_new = f"a fresh process (pid {proc.pid})"
            f.recovery = "in-job: fresh process"
        pc.subprocess_handlers[local].proc = proc
        worker.id = proc.pid
        f.restarted_at = time.time()
        sup.reached(f)
        f.action.append(f"in-job: survivors stay; rank {rank} taken over by {how_new}")
        log.info("ACTION in-job recovery (attempt %d; %d more allowed by resilience.max_restarts): "
                 "ranks %s stay, rank %d is taken over by %s and takes its state from rank %d's "
                 "memory (or the newest checkpoint)",
                 attempt,
                 agent._remaining_restarts, [r for r in sup.ranks if r != rank], rank, how_new,
                 (rank + 1) % len(sup.ranks))
        sup.attempt = attempt
        sup.new_watch()
        self.recovered += 1
        if spare is not None:
            self.owed += 1  # the pool back to its size once the recovery is over

    # -- shrink and grow (resilience.shrink: pure DDP, no spare ready) ------------------------
    def _shrink(self, agent, wg, pc, local: int, rank: int, attempt: int, f) -> None:
        """No spare: the survivors go on as a smaller data-parallel group on the same global
        batch (announced with its members); the lost slot is marked dropped in the agent's
        process table, and a spare is started to grow back into once it is ready (on one host
        the lost process's share of it is free again; on a cluster it stands for the
        replacement host the scheduler provides)."""
        sup = self.sup
        survivors = [r for r in sup.ranks if r != rank]
        handler = pc.subprocess_handlers[local]
        pc.subprocess_handlers[local] = _Dropped(pc, local, handler.proc.pid)
        self.shrunk = {"pc": pc, "local": local, "rank": rank, "handler": handler,
                       "at": time.time()}
        f.recovery = "in-job: shrink"
        f.restarted_at = time.time()
        sup.reached(f)
        f.action.append(f"in-job: no spare ready: ranks {survivors} go on without rank {rank} "
                        f"on the same global batch")
        self.resizes.append({"kind": "shrink", "attempt": attempt, "at": time.time(),
                             "ranks": survivors, "dropped": rank})
        log.info("ACTION in-job shrink (attempt %d; %d more allowed by resilience.max_restarts): "
                 "no spare ready; ranks %s go on as %d data-parallel replicas on the same global "
                 "batch, rank %d's slot waits for a spare",
                 attempt, agent._remaining_restarts, survivors,
                 len(survivors), rank)
        sup.ranks = survivors
        sup.attempt = attempt
        sup.new_watch()
        self.recovered += 1
        if not self.spares:
            self._start_spare()

    def _ready_spare(self) -> tuple[int, ForkedProcess] | None:
        """A spare that is running and has said it is ready (torch imported, waiting)."""
        from myria.train.rejoin import key

        store = self.sup._server
        for i, p in sorted(self.spares.items()):
            if p.poll() is None and store.check([key(self.sup.job, f"spare{i}/ready")]):
                return i, p
        return None

    def _grow_if_ready(self, agent, wg, pc) -> None:
        """A shrunk run that has made progress grows back once a spare is ready: the next
        attempt is announced with every slot a member, the spare takes the dropped slot and
        its state from a survivor's (a replica's) memory; the survivors leave their loop after
        the same step (myria.train.rejoin.InJob.grow_due)."""
        from myria.train.rejoin import ENV_JOIN, key

        sup, s = self.sup, self.shrunk
        f = sup.current
        if f is not None and not f.first_step_at or agent._remaining_restarts <= 0:
            return
        last = self.resizes[-1]
        if f is not None and last["kind"] == "shrink" and "to_first_step_s" not in last:
            last["resumed_from"] = f.resumed_from
            last["to_first_step_s"] = round(f.first_step_at - f.fault_at, 3)
        ready = self._ready_spare()
        if ready is None:
            if not any(p.poll() is None for p in self.spares.values()):
                self._start_spare()   # the spare died before it was ready: another
            return
        i, proc = ready
        del self.spares[i]
        agent._remaining_restarts -= 1   # one numbering of attempts (the store's prefixes)
        attempt = wg.spec.max_restarts - agent._remaining_restarts
        local, rank = s["local"], s["rank"]
        full = sorted([*sup.ranks, rank])
        store = sup._server
        env = dict(pc.envs[local], TORCHELASTIC_RESTART_COUNT=str(attempt),
                   **{rundir.JOB_ATTEMPT_ENV: str(attempt)})
        env[ENV_JOIN] = "1"
        store.set(key(sup.job, f"spare{i}"), json.dumps(
            {"env": env, "stdout": pc.stdouts.get(local), "stderr": pc.stderrs.get(local)}))
        store.set(key(sup.job, f"members{attempt}"), json.dumps(full))
        store.set(key(sup.job, "lost"), json.dumps([rank]))
        store.set(key(sup.job, "attempt"), str(attempt))
        handler = s["handler"]
        handler.proc = proc
        pc.subprocess_handlers[local] = handler
        wg.workers[local].id = proc.pid
        now = time.time()
        self.growing = {"attempt": attempt, "at": now, "spare": i, "rank": rank,
                        "shrunk_s": round(now - s["at"], 3)}
        self.shrunk = None
        if f is not None:
            # announced: done once every rank has stepped (`_track_grow`, the summary's
            # resizes), which a run ending first never does
            f.action.append(f"in-job: grow back to {len(full)} ranks announced (hot spare {i} "
                            f"takes rank {rank}) after {now - s['at']:.1f} s shrunk")
        log.info("ACTION in-job grow (attempt %d; %d more allowed by resilience.max_restarts): hot "
                 "spare %d (pid %d) is ready and takes rank %d; ranks %s join it after their "
                 "current step", attempt, agent._remaining_restarts, i, proc.pid, rank, sup.ranks)
        sup.ranks = full
        sup.attempt = attempt
        sup.new_watch()
        if sup.r.spares:
            self.owed += 1

    def _track_grow(self) -> None:
        """The grow is over once every rank of its attempt has done a step."""
        g = self.growing
        recs = [x for x in self.sup._read_heartbeats().values()
                if x and x.get("attempt") == g["attempt"]]
        if len(recs) == len(self.sup.ranks) and all(x.get("first_step_at") for x in recs):
            first = max(x["first_step_at"] for x in recs)
            self.resizes.append({"kind": "grow", "attempt": g["attempt"], "at": g["at"],
                                 "ranks": list(self.sup.ranks), "added": g["rank"],
                                 "spare": g["spare"], "shrunk_s": g["shrunk_s"],
                                 "to_first_step_s": round(first - g["at"], 3),
                                 "resumed_from": min(x.get("resumed_from", -1) for x in recs)})
            log.info("GREW back to %d ranks: first step %.1f s after the announcement",
                     len(self.sup.ranks), first - g["at"])
            self.growing = None

    @staticmethod
    def _fresh(pc, local: int, env: dict) -> ForkedProcess:
        """The lost worker's command again, in a new process, its output appended to the same
        files (the agent's tee keeps showing it)."""
        return fork_module(pc.args[local], {**os.environ, **env}, pc.stdouts.get(local),
                           pc.stderrs.get(local))



class _Dropped:
    """Stands in torch elastic's process table (as handler and process at once) for the slot
    a shrink dropped: running while any worker still runs, done (exit 0) once all are, so the
    agent neither restarts the group for it nor waits for it at the end; nothing to signal."""

    def __init__(self, pc, local: int, pid: int) -> None:
        self.pc, self.local, self.pid = pc, local, pid
        self.returncode: int | None = None
        self.proc = self

    def poll(self) -> int | None:
        others = [h.proc.poll() for lr, h in self.pc.subprocess_handlers.items()
                  if lr != self.local]
        if self.returncode is None and all(c is not None for c in others):
            self.returncode = 0
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        return self.poll() or 0

    def close(self, death_sig=None) -> None:
        pass

    def send_signal(self, sig) -> None:
        pass

    def kill(self) -> None:
        pass
