"""`myria supervise`: training under torch elastic with heartbeats, fault detection and recovery.

    myria supervise --config configs/demo.toml --run-dir runs/demo --nproc 2 [--section.key=value]
    # several hosts: the same command on each, plus --nnodes 4 --rdzv-endpoint HOST0:29400

MegaScale's robust-training driver on torch elastic's agent API: a `LocalElasticAgent` subclass
(myria.resilience.agent) starts this host's workers, and its monitor loop reads their heartbeats
and stderr (myria.resilience.watch), detects faults, decides (myria.resilience.policy: restart,
in-job recovery, diagnostics, blocklist, give up) and writes RUN_DIR/supervisor_summary.json
(myria.resilience.summary). What it logs, the summary's fields, the recovery modes and the exit
statuses are documented in docs/robustness.md.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import time
import uuid
from pathlib import Path

from myria import config as config_mod
from myria import rundir
from myria.errors import LaunchError, MyriaError
from myria.observe import heartbeat_store as heartbeat
from myria.resilience import multihost, policy, summary
from myria.resilience.agent import SignalLatch, make_agent, serve_tcp_store
from myria.resilience.policy import Fault
from myria.resilience.watch import Detection, Watchdog, cpu_seconds

STRAGGLER_CHECK_S = 5.0  # how often the supervisor scores the ranks' compute times
ACTIONABLE = ("exit", "missed-heartbeats", "no-heartbeat", "hang", "traffic-stopped", "alarm")

log = logging.getLogger("myria.supervisor")


class Supervisor:
    """Runs one host's workers through torch elastic and recovers them from faults."""

    def __init__(self, cfg: config_mod.Config, run_dir: Path, nproc: int, worker_argv: list[str],
                 *, min_nodes: int = 1, max_nodes: int = 1, rdzv_endpoint: str = "",
                 rdzv_id: str = "") -> None:
        self.cfg, self.r = cfg, cfg.resilience
        self.run_dir = Path(run_dir)
        self.nproc = nproc
        self.worker_argv = worker_argv
        self.min_nodes, self.max_nodes = min_nodes, max_nodes
        self.rdzv_endpoint = rdzv_endpoint
        self.job = rdzv_id or f"myria-{uuid.uuid4().hex[:10]}"
        self.host = socket.gethostname()
        self.expect = policy.parse_expect(self.r.doctor_expect)
        self.faults: list[Fault] = []
        self.current: Fault | None = None
        self.attempt = 0
        self.watch: Watchdog | None = None
        self.alarms: list[Detection] = []
        self.stderr_pos: dict[int, int] = {}
        self.ranks: list[int] = []
        self.max_step = 0
        self.initial_step: int | None = None
        self.started_at = time.time()
        # when this host's first workers started (0: none yet, a spare): the fault hooks it
        # could have seen fired after that
        self.workers_since = 0.0
        # the longest time from an attempt's start to its first step on every rank, and when
        # the attempt being measured started (0: measured, or none running)
        self.startup_s, self._attempt_at = 0.0, 0.0
        self.blocklist: list[str] = []
        self.stragglers: dict = {}
        self._straggler_at = 0.0
        self.store = None
        self._server = None
        self.members: list[str] = []   # the hosts of the current rendezvous round
        self._endpoint = rdzv_endpoint
        self._waiting = None           # a multihost.RendezvousWait while waiting for hosts
        self._link = None              # a multihost.LinkProbe of this host's link
        self.injob = None
        if self.r.recovery == "in-job":
            from myria.resilience.injob import InJobRecovery

            self.injob = InJobRecovery(self)
        # in-job recovery across hosts (myria.resilience.takeover)
        self.across_hosts = self.injob is not None and max_nodes > 1
        self._shared = None            # a client of the rendezvous store (the main thread's)
        self._beat = self._takeover = None
        self._followed_at = 0.0
        self.agent = None              # torch elastic's agent (make_agent)
        self.latch = SignalLatch()     # stop signals torch's handler raised (agent.py)
        self.lost_hosts: set[str] = set()   # hosts whose ranks a spare host took over
        self.announced_base = 0        # the in-job attempt announced when this round started

    # -- set-up ------------------------------------------------------------------------------
    def _setup_logging(self) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        log.setLevel(logging.INFO)
        log.propagate = False
        # the hosts of one job share the run directory's log: each line names its host
        tag = f"myria-supervisor[{self.host}]" if self.max_nodes > 1 else "myria-supervisor"
        fmt = logging.Formatter(f"%(asctime)s {tag} %(levelname)s %(message)s", "%H:%M:%S")
        for h in list(log.handlers):
            log.removeHandler(h)
        for h in (logging.StreamHandler(sys.stderr),
                  logging.FileHandler(self.run_dir / rundir.SUPERVISOR_LOG)):
            h.setFormatter(fmt)
            log.addHandler(h)

    def _environment(self) -> None:
        """What the workers inherit: heartbeat store, restart safety, NCCL fault settings."""
        r = self.r
        os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
        os.environ.setdefault("OMP_NUM_THREADS",
                              str(max(1, (os.cpu_count() or 1) // self.nproc)))
        nccl = {"NCCL_IB_TIMEOUT": r.nccl_ib_timeout, "NCCL_IB_RETRY_CNT": r.nccl_ib_retry_cnt,
                "TORCH_NCCL_ASYNC_ERROR_HANDLING": r.nccl_async_error_handling}
        if r.nccl_trace_buffer:
            nccl.update(TORCH_FR_BUFFER_SIZE=r.nccl_trace_buffer, TORCH_NCCL_DUMP_ON_TIMEOUT=1)
        for k, v in nccl.items():
            os.environ.setdefault(k, str(v))  # a value set by the user wins
        if r.store == "redis":
            self.store = heartbeat.open_store(r.redis_url, timeout_s=10)
            url = r.redis_url
        else:
            self._server, port = serve_tcp_store()
            self.store = heartbeat.TCPHeartbeatStore(self._server)
            url = f"tcp://127.0.0.1:{port}"
        os.environ[heartbeat.ENV_STORE] = url
        if self.across_hosts:   # the store every host's workers share: the rendezvous store
            from myria.train.rejoin import ENV_STORE

            os.environ[ENV_STORE] = f"tcp://{self.rdzv_endpoint}"
        os.environ[heartbeat.ENV_PERIOD] = str(r.heartbeat_s)
        os.environ[heartbeat.ENV_JOB] = self.job
        from myria.train.launch import JOB_START_ENV, LAUNCHER_ENV
        os.environ[LAUNCHER_ENV] = str(os.getpid())  # workers stop when this process dies
        # the wall-time limit counts from the job's start, not from each restart's workers
        os.environ.setdefault(JOB_START_ENV, str(self.started_at))

    # -- the run -----------------------------------------------------------------------------
    def run(self) -> int:
        """Supervise the job to its end; returns the exit status (see the module docstring)."""
        from torch.distributed.elastic.agent.server.api import WorkerState
        from torch.distributed.elastic.multiprocessing.api import SignalException
        from torch.distributed.elastic.rendezvous import RendezvousClosedError, RendezvousError

        # the workers' imports, once, while the hosts gather (myria.train.launch.fork_module);
        # before the heartbeat store's server thread, so that it can be a fork of this process,
        # and before this process's log handlers, which a fork would keep (the workers'
        # environment is given to each: fork_module)
        from myria.train.launch import start_forkserver
        start_forkserver()
        self._setup_logging()
        self._environment()
        self.started_at = time.time()
        log.info("supervising %d worker(s) on %s: job %s, run dir %s, heartbeat every %g s "
                 "to %s, up to %d restarts", self.nproc, self.host, self.job, self.run_dir,
                 self.r.heartbeat_s, os.environ[heartbeat.ENV_STORE], self.r.max_restarts)
        status, code = "failed", 1
        try:
            self.latch.install(first=True)
            if self.injob is not None:
                self.injob.start_spares()
            agent = make_agent(self)
            if self.max_nodes > 1:
                self._wait_for_hosts(None)
            if self.across_hosts:
                from myria.resilience import takeover

                self._beat = takeover.Beat(self._endpoint, self.job, self.host)
                self._takeover = takeover.Watch(self)
                self._beat.start()
                self._takeover.start()
            result = self._run_agent(agent)
            if result.state == WorkerState.SUCCEEDED:
                status, code = "succeeded", 0
            else:
                log.error("ACTION give up: %s; the same command resumes from %s",
                          f"restarts exhausted (resilience.max_restarts = "
                          f"{self.r.max_restarts})" if self.r.max_restarts else
                          "no restarts allowed (resilience.max_restarts = 0)",
                          summary.newest_committed(self.run_dir) or "step 0 (no checkpoint "
                          "was committed)")
        except policy.Stop as e:
            status, code = e.status, e.code
            log.error("ACTION %s: %s", e.action, e)
        except SignalException as e:
            status, code = "preempted", policy.EXIT_PREEMPTED
            f = self.current
            between = f is not None and f.stopped_at and not f.restarted_at
            log.warning("ACTION stopped by %s: %s", e.sigval.name, (
                "the workers were already stopped (recovering from a fault), nothing to save; "
                f"the run resumes from {f.newest_committed or 'step 0 (no checkpoint yet)'}")
                if between else "workers were asked to save and exit" if self.ranks else
                "no worker had started on this host, nothing to save")
        except LaunchError as e:
            log.error("%s", e)
        except RendezvousClosedError:  # the job ended on the other hosts
            if self._takeover is not None and self._takeover.claimed:
                log.info("the rendezvous closed: this host's workers were the takeover's")
            elif self.ranks:
                status, code = multihost.EXCLUDED, 0
                log.warning("ACTION leave: the job went on and ended without this host (its "
                            "rendezvous is closed)")
            else:
                status, code = multihost.SPARE_UNUSED, 0
                log.info("the job ended without needing this spare host")
        except RendezvousError as e:
            status = "rendezvous-failed"
            if self._takeover is not None and self._takeover.claimed:
                log.info("the rendezvous ended (%s): this host's workers are the takeover's",
                         type(e).__name__)
            elif not self.ranks and (how := multihost.job_ended(self.run_dir, self.job)):
                status, code = multihost.SPARE_UNUSED, 0   # the first node left with the store
                log.info("the job ended without needing this spare host (%s)", how)
            elif self.ranks and (why := multihost.moved_on_without(self.run_dir, self.job,
                                                                   self.host)):
                status, code = multihost.EXCLUDED, 0   # cut off: the job went on without it
                log.warning("ACTION leave: %s", why)
            elif self.max_nodes > 1 and (who := multihost.gave_up_gathering(
                    self.run_dir, self.job, self.host)):
                # the job's hosts never gathered: running it again would not gather them
                log.error("ACTION give up: the rendezvous did not complete on %s either "
                          "(%s): the job's hosts never gathered", who,
                          str(e) or type(e).__name__)
            elif self.max_nodes > 1 and (why := multihost.store_lost(self._endpoint)):
                status, code = "rendezvous-lost", multihost.EXIT_STORE_LOST
                self._record_store_lost(why)
                log.error("ACTION give up: %s; the job runs again from the newest committed "
                          "checkpoint (%s) when it is requeued (exit %d: the batch script "
                          "requeues it) or resubmitted", why,
                          summary.newest_committed(self.run_dir) or "none yet",
                          multihost.EXIT_STORE_LOST)
            else:
                log.error("ACTION give up: the rendezvous did not complete (%s)%s",
                          str(e) or type(e).__name__,
                          f"; host(s) {', '.join(self._waiting.missing)} never rejoined"
                          if self._waiting is not None and self._waiting.missing else "")
        finally:
            if self._takeover is not None and self._takeover.claimed:
                status, code = self._takeover.outcome()   # this spare took a host over
            with self.latch.deferred():   # a second stop signal does not lose the summary
                self._check_stragglers(time.time(), force=True)
                summary.write(self, summary.build(self, status))
            self._close()
        return code

    def _run_agent(self, agent):
        """The agent's run; a success closes the rendezvous, so a spare waiting in it leaves.
        Across hosts in-job, a spare whose wait timed out waits again while the job goes on
        (the members took a lost host over without a new round) for a later full restart."""
        from torch.distributed.elastic import rendezvous as rdzv
        from torch.distributed.elastic.agent.server.api import WorkerState

        while True:
            try:
                result = agent.run()
                if result is None:   # torch's way to end a spare when the job closes the rdzv
                    raise rdzv.RendezvousClosedError("the job closed the rendezvous")
                if self.max_nodes > 1 and result.state == WorkerState.SUCCEEDED:
                    multihost.close_rendezvous(agent)
                return result
            except rdzv.RendezvousTimeoutError:
                if not self.across_hosts or self.ranks or self._takeover is None or \
                        self._takeover.claimed or multihost.job_ended(self.run_dir, self.job, 0):
                    raise
                log.info("SPARE: %s's wait in the rendezvous timed out while the job goes on "
                         "without a new round: it waits again", self.host)
                agent = make_agent(self)

    def _remove_shared(self) -> None:
        """The peer snapshots in shared memory of workers that no longer run."""
        from myria.train import peer

        try:
            peer.remove_shared(self.job)
        except OSError:
            pass

    def _close(self) -> None:
        self._stop_waiting()
        for t in (self._beat, self._takeover):
            if t is not None:
                t.stop_event.set()
        if self.injob is not None:
            self.injob.close()
        self._remove_shared()
        if self.store is not None:
            try:
                self.store.close()
            except Exception:
                pass
        self._server = None

    # -- agent hooks -------------------------------------------------------------------------
    def before_start(self, agent, wg) -> None:
        """Clear the heartbeats of a previous attempt so nothing stale is read."""
        keys = [heartbeat.key(self.job, r) for r in range(self.nproc * self.max_nodes)]
        try:
            self.store.delete(keys)
        except Exception:
            pass

    def started(self, agent, wg) -> None:
        self.attempt = wg.spec.max_restarts - agent._remaining_restarts
        rnd = rundir.job_round(self.job)
        if self.max_nodes > 1 and rnd is not None:
            # across hosts the workers' attempt is the rendezvous round (rundir.job_attempt):
            # a membership change starts a round without spending one of torch's restarts,
            # and its rows, milestones and faults must not be booked to the round before
            self.attempt = rnd
        self.ranks = [w.global_rank for w in wg.workers]
        self.stderr_pos = {}
        self.new_watch()
        self._attempt_at = time.time()
        if self.current is not None:
            self.current.restarted_at = time.time()
        log.info("attempt %d: started ranks %s (pids %s)", self.attempt, self.ranks,
                 [w.id for w in wg.workers])
        if self.max_nodes > 1:
            self._joined(agent, wg)
        if self.across_hosts:
            from myria.resilience import takeover

            try:
                self.announced_base = takeover.announced(self.shared_store(), self.job)
            except Exception:
                pass
            takeover.publish(self, wg, agent._pcontext.envs)

    def shared_store(self):
        """The main thread's client of the rendezvous store (several hosts)."""
        if self._shared is None:
            from myria.resilience.multihost import store_client

            self._shared = store_client(self._endpoint)
        return self._shared

    def announce_store(self):
        """Where in-job recovery announces an attempt: the store every host's workers share."""
        return self.shared_store() if self.across_hosts else self._server

    def new_watch(self) -> None:
        """A watchdog for the ranks of attempt `self.attempt`."""
        self.workers_since = self.workers_since or time.time()
        r, t = self.r, self.cfg.training
        self.watch = Watchdog(self.ranks, r.heartbeat_s, r.missed_heartbeats, r.hang_timeout_s,
                              r.traffic_timeout_s, startup_timeout_s=t.init_timeout_s,
                              keywords=tuple(k.strip() for k in r.alarm_keywords.split(",")),
                              attempt=self.attempt, cpu=cpu_seconds)
        self.alarms = []

    def monitor(self, agent, wg, result):
        """Called every monitor interval with the agent's own verdict; may turn it UNHEALTHY."""
        from torch.distributed.elastic.agent.server.api import RunResult, WorkerState

        if self.watch is None:
            return result
        now = time.time()
        if self.across_hosts and now - self._followed_at > 0.5:
            from myria.resilience import takeover

            self._followed_at = now
            takeover.follow(self, agent)   # an attempt another host announced
        self._scan_stderr(agent, wg, now)
        records = self._read_heartbeats()
        self._track_recovery(records, now)
        if result.state == WorkerState.FAILED:
            self._on_exit(result, records, now)
            return result
        if result.state != WorkerState.HEALTHY:
            return result
        self._check_stragglers(now)
        found = self.watch.heartbeats(records, now)
        found += self._expired_alarms(agent, now)
        for d in found:
            log.warning("DETECTED %s on rank(s) %s: %s", d.kind, d.ranks, d.evidence)
        act = [d for d in found if d.kind in ACTIONABLE and d.kind != "alarm" or
               d.kind == "alarm" and d.details.get("expired")]
        if act:
            f = self._record(act[0], [d for d in found if d is not act[0]])
            if act[0].kind in ("hang", "missed-heartbeats", "traffic-stopped"):
                self._hang_report(wg, f)
            if self.injob is not None and self.injob.kill_frozen(agent, wg, f):
                return result  # the killed rank is replaced in-job at the next poll
            return RunResult(state=WorkerState.UNHEALTHY)
        return result

    def _check_link(self) -> None:
        """Several hosts: probe this host's link to the rendezvous host (multihost.LinkProbe);
        a degraded link is logged and recorded once, naming this host's ranks."""
        from myria.resilience.multihost import LinkProbe

        if self._link is None:
            self._link = LinkProbe(self._endpoint, self.job, self.host)
        if why := self._link.probe():
            from myria import detections

            log.warning("DETECTED slow link on %s (ranks %s): %s", self.host, self.ranks, why)
            detections.record(self.run_dir, "slow-link", None, self.host, self.max_step,
                              {"ranks": self.ranks, "evidence": why}, "none (reported)")

    def _check_stragglers(self, now: float, force: bool = False) -> None:
        """Every few seconds (and once at the end), score each rank's compute-only time from the
        event files against its peers (myria.observe.straggler); report each new straggler
        once."""
        r = self.r
        if r.straggler_action == "none" or \
                (not force and now - self._straggler_at < STRAGGLER_CHECK_S):
            return
        self._straggler_at = now
        if self.max_nodes > 1 and not force:
            self._check_link()
        from myria import detections
        from myria.observe import straggler

        try:
            found = straggler.detect_dir(self.run_dir, since=self.started_at,
                                         window=r.straggler_window,
                                         threshold=r.straggler_threshold,
                                         windows=r.straggler_windows)
        except Exception as e:  # evidence, never a reason to stop the job
            log.debug("straggler check failed: %s", e)
            return
        for s in found:
            if s.rank in self.stragglers:
                continue
            self.stragglers[s.rank] = s
            action = r.straggler_action
            note = ""
            if action == "replace":
                note = (f"; its host {s.host} is to be replaced at the next restart" if
                        self.max_nodes > self.min_nodes else
                        "; no spare host to replace it with: training continues on it")
            log.warning("DETECTED straggler rank %d on %s: %.0f%% slower than its peers from "
                        "step %d (detected at step %d), costing %.3f s per step%s", s.rank,
                        s.host, 100 * s.slowdown, s.first_step, s.detected_step,
                        s.cost_s_per_step, note)
            detections.record(self.run_dir, "straggler", s.rank, s.host, s.detected_step,
                              s.evidence(), action + note)

    def _hang_report(self, wg, f: Fault) -> None:
        """Ask every worker what it is doing (SIGUSR1), merge into RUN_DIR/report/hang.json."""
        from myria.observe import hang

        pids = {w.global_rank: w.id for w in wg.workers if w.id}
        try:
            since = hang.request(pids, self.run_dir)
            rep = hang.merge(self.run_dir, sorted(pids), since)
            hang.add_stacks(rep, hang.request_stacks(pids, self.run_dir))
            rep["fault"] = f.kind   # a hang, or what else asked for the stacks
            path = hang.write(self.run_dir, rep)
        except Exception as e:  # the report is evidence; never let it stop recovery
            log.warning("hang report failed: %s", e)
            return
        line = hang.summary_line(rep)
        log.warning("HANG REPORT %s (%s)", line, path)
        f.evidence += f" | hang report: {line}"
        f.action.append("hang report")

    def recover(self, agent, wg) -> None:
        """Stop the group, diagnose this host, blocklist it if bad, back off; then restart."""
        f = self.current
        if f is None or f.restarted_at:   # not a fault this supervisor detected: torch's agent
            # restarts for a host waiting in the rendezvous (a fault already recovered from
            # stays `current`, and this is a new event of its own)
            why, silent_s, gone = self._membership_change(agent)
            now = time.time()
            f = self._record(Detection("membership-change", [], now, now - silent_s, why), [])
            f.hosts_lost = gone
            log.warning("DETECTED membership-change: %s", f.evidence)
            if self.max_nodes > 1:   # its ranks' stacks: live ones wait on the host that left
                self._hang_report(wg, f)
        f.action.append("stop worker group")
        log.info("ACTION stop the worker group of attempt %d (SIGKILL)", self.attempt)
        agent._stop_workers(wg)
        f.stopped_at = time.time()
        self._remove_shared()
        self.reached(f)
        if self.r.diagnose:
            policy.diagnose(self, f)
        f.decided_at = time.time()
        restarts = sum(1 for x in self.faults if x.restarted_at) + 1
        wait = min(self.r.backoff_s * 2 ** (restarts - 1), self.r.backoff_max_s)
        newest = f.newest_committed
        from myria.train.launch import JOB_START_ENV

        try:
            policy.check_time_to_restart(self.cfg.training.max_time_s,
                                         float(os.environ.get(JOB_START_ENV) or
                                               self.started_at), wait, self.startup_s)
        except policy.TimeUp:
            f.action.append("no restart: the wall-time limit is too near")
            raise
        f.action.append(f"restart after {wait:.1f} s back-off from the newest valid checkpoint")
        log.info("ACTION restart (attempt %d; %d more allowed by resilience.max_restarts) after "
                 "%.1f s back-off; workers resume from the newest checkpoint that verifies (newest "
                 "committed: %s)",
                 self.attempt + 1, agent._remaining_restarts, wait, newest or "none")
        time.sleep(wait)
        f.backoff_done_at = time.time()
        if self.max_nodes > 1:
            self._wait_for_hosts(f)

    # -- several hosts (myria.resilience.multihost) ------------------------------------------
    def _membership_change(self, agent) -> tuple[str, float, list[str]]:
        """What changed in the rendezvous, how long before now it happened at the least (a host
        that left was silent for the rendezvous' keep-alive window), and the hosts of this
        round that left it."""
        if self.max_nodes <= 1:
            return "a host joined or left the rendezvous", 0.0, []
        gone = multihost.left_round(agent, self.members)
        if not gone:
            return "a host joined the rendezvous", 0.0, []
        try:
            s = agent._rdzv_handler.settings
            window = (s.keep_alive_interval * s.keep_alive_max_attempt).total_seconds()
        except AttributeError:
            window = 0.0
        return (f"host(s) {', '.join(gone)} of this round dropped out of the rendezvous (no "
                f"keep-alive for {window:g} s: lost or cut off)", window, gone)

    def _joined(self, agent, wg) -> None:
        """The round's hosts, and this host's ranks among them, once its workers started. The
        hosts of the previous round missing from this one are those the fault that ended it
        cost the job (`Fault.hosts_lost`, set once, while its recovery has not trained a step):
        the fault itself was found here, on a survivor."""
        self._stop_waiting()
        before = self.members
        self.members = multihost.members(agent) or self.members
        f = self.current
        if f is not None and before and not f.hosts_lost and not f.first_step_at:
            f.hosts_lost = [h for h in before if h not in self.members]
        log.info("placement: %s runs ranks %s of %d; hosts in this round: %s", self.host,
                 self.ranks, wg.spec.local_world_size * max(1, len(self.members)),
                 ", ".join(self.members) or "?")

    def rendezvoused(self, agent, wg) -> None:
        """A rendezvous round completed: its workers carry the round (myria.rundir.FENCE_ENV)
        and the first host records it as the job's current round, fencing off older rounds'
        workers (a host cut off by a partition) before this round's workers start."""
        if self.max_nodes <= 1:
            return
        try:
            rnd = int(agent._rdzv_handler._state_holder.state.round)
        except AttributeError:
            return
        os.environ[rundir.FENCE_ENV] = f"{self.job}:{rnd}"
        self.lost_hosts.clear()   # a new round: its hosts are all there
        if wg.group_rank == 0:
            hosts = multihost.members(agent)
            rundir.fence_bump(self.run_dir, self.job, rnd, hosts)
            if self.across_hosts:   # the members a spare host watches
                import json

                from myria.train.rejoin import key

                self.shared_store().set(key(self.job, "members"), json.dumps(hosts))
            log.info("round %d of the rendezvous: hosts %s; workers of earlier rounds are "
                     "fenced off the run directory", rnd, ", ".join(hosts) or "?")

    def _wait_for_hosts(self, f: Fault | None) -> None:
        """Report, while the agent waits in the rendezvous, which hosts it waits for (after
        fault `f`: the previous round's; at the start: how many more), or that it is a spare."""
        self._stop_waiting()
        self._waiting = multihost.RendezvousWait(
            log, self._endpoint, self.job, self.host,
            [h for h in self.members if h != self.host] if f else [],
            f.fault_at if f else time.time(), self.cfg.training.init_timeout_s, self.min_nodes)
        self._waiting.start()

    def _stop_waiting(self) -> None:
        if self._waiting is not None:
            self._waiting.stop()
            if self._waiting.missing and self.current is not None:
                self.current.action.append(f"waited for host(s) {', '.join(self._waiting.missing)}"
                                           " (did not rejoin)")
            self._waiting = None

    def reached(self, f: Fault) -> None:
        """The newest committed checkpoint and the step reached before fault `f`."""
        f.newest_committed = summary.newest_committed(self.run_dir)
        # The heartbeats read at detection can lag the workers by a beat (a loaded host): the
        # step a committed checkpoint or a metrics row of this attempt proves was reached
        # counts too, so the steps lost are never negative.
        since = self.watch.started if self.watch else self.started_at
        done = [int(f.newest_committed.split("_")[1])] if f.newest_committed else []
        f.last_step = max([f.last_step, *done, *summary.metrics_rows(self.run_dir, since)])

    # -- detection helpers -------------------------------------------------------------------
    def _read_heartbeats(self) -> dict[int, dict | None]:
        keys = [heartbeat.key(self.job, r) for r in self.ranks]
        try:
            raw = self.store.get_many(keys)
        except Exception as e:
            log.warning("heartbeat store unreadable: %s", e)
            return {}
        out: dict[int, dict | None] = {}
        for r, v in zip(self.ranks, raw):
            try:
                out[r] = heartbeat.decode(v)
            except ValueError:
                out[r] = None
        return out

    def _scan_stderr(self, agent, wg, now: float) -> None:
        pc = getattr(agent, "_pcontext", None)
        files = getattr(pc, "stderrs", None) or {}
        for local, path in files.items():
            if not path or not os.path.exists(path):
                continue
            rank = wg.workers[local].global_rank
            pos = self.stderr_pos.get(rank, 0)
            try:
                with open(path, errors="replace") as fh:
                    fh.seek(pos)
                    text = fh.read()
            except OSError:
                continue
            if not text:
                continue
            complete = text.rfind("\n") + 1  # leave a partial last line for the next read
            if complete == 0:
                continue
            self.stderr_pos[rank] = pos + len(text[:complete].encode(errors="replace"))
            for d in self.watch.stderr(rank, text[:complete].splitlines(), now):
                log.warning("ALARM rank %d: %s", rank, d.evidence)
                self.alarms.append(d)

    def _expired_alarms(self, agent, now: float) -> list[Detection]:
        out = []
        for d in self.alarms:
            if d.details.get("handled"):
                continue
            rank = d.ranks[0]
            if self.watch.progressed_since(rank, d.detected_at + 1e-6):
                d.details["handled"] = True
                log.info("alarm on rank %d not acted on: the rank kept making progress", rank)
            elif now - d.detected_at > self.r.alarm_grace_s:
                d.details.update(handled=True, expired=True)
                d.evidence += (f" (no progress and no exit {now - d.detected_at:.1f} s later, "
                               f"alarm_grace_s {self.r.alarm_grace_s:g})")
                d.detected_at = now
                out.append(d)
        return out

    def sdc_pending(self) -> bool:
        """Whether a worker of this attempt stopped on a silent-corruption verdict."""
        return self.watch is not None and \
            summary.sdc_verdict(self.run_dir, self.watch.started) is not None

    def _on_exit(self, result, records, now: float) -> None:
        failures = result.failures
        self.watch.heartbeats(records, now)
        d = self.watch.exit_detection(failures, self.ranks, now)
        culprit = d.ranks[0]
        log.warning("DETECTED exit on rank(s) %s: %s", d.ranks, d.evidence)
        f = self._record(d, self.alarms)
        f.cause = self.watch.cause_line(culprit) or (
            f"signal {failures[culprit].signal_name()}" if failures[culprit].exitcode < 0
            else f"exit code {failures[culprit].exitcode}")
        data = failures[culprit].error_file_data
        msg = data.get("message") if isinstance(data, dict) else None
        if failures[culprit].exitcode in (MyriaError.exit_code, policy.SAVE_FAILED):
            f.cause = msg if isinstance(msg, str) and msg else f.cause
        if failures[culprit].exitcode == MyriaError.exit_code:
            f.action.append("stop: input error")
            raise policy.UserError(f"rank {culprit}: {f.cause}")
        if failures[culprit].exitcode == policy.SAVE_FAILED:
            f.newest_committed = summary.newest_committed(self.run_dir)
            f.action.append("stop: checkpoints cannot be saved")
            raise policy.SaveFailed(f"rank {culprit}: {f.cause}")
        if v := summary.sdc_verdict(self.run_dir, self.watch.started):
            # the workers stopped on a silent-corruption verdict (myria.train.sdc): a rollback
            f.kind, f.sdc, f.ranks = "sdc", v, v["ranks"]
            f.cause = (f"silent data corruption on rank(s) {v['ranks']} at step {v['step']} "
                       f"({v['check']} check): {v['verdict']}")
            log.warning("DETECTED sdc on rank(s) %s at step %s (%s check): %s", v["ranks"],
                        v["step"], v["check"], v["verdict"])
            if v["persistent"] and set(v["ranks"]) <= set(self.ranks):   # this host's device
                policy.blocklist(self, f, f.cause)
                spare = self.max_nodes > self.min_nodes
                if spare and self.r.bad_host_action == "exit":
                    raise policy.BadHost(f"{self.host}: {f.cause}")
                log.warning("ACTION %s stays in the job: %s; the restart resumes from the "
                            "newest verified checkpoint", self.host,
                            "no spare host to replace it" if not spare else
                            "bad_host_action = recheck")
                f.action.append("host kept: no spare host" if not spare else "host kept")
            return   # a rollback, not a start-up error: restart from the newest checkpoint
        # before any step of this attempt: the same error as last time is deterministic
        started = not f.before_first_step
        if started or failures[culprit].exitcode == -signal.SIGKILL:
            return  # a SIGKILL comes from outside (OOM killer, operator, node agent, a fault
            # during recovery): no evidence of a deterministic start-up error, even twice
        sign = policy.signature(failures[culprit].exitcode, msg if isinstance(msg, str) and msg
                          else f.cause)
        prev = self.faults[-2] if len(self.faults) > 1 else None
        if prev is not None and prev.before_first_step and prev.signature == sign and \
                prev.attempt == self.attempt - 1:
            f.action.append("stop: the same error before the first step twice")
            raise policy.StartupError(
                f"attempts {prev.attempt} and {self.attempt} failed the same way before their "
                f"first step, so a restart cannot fix it (a deterministic start-up error such "
                f"as the config or the environment): rank {culprit}: {f.cause}")
        f.signature = sign

    def _record_store_lost(self, why: str) -> Fault:
        """The loss of the job's first node (its rendezvous store) as this host found it: a
        fault, the host lost named (the member of the round at the store's address), so the
        job's summary and report list it; the job ends here, to run again."""
        now = time.time()
        f = self._record(Detection(rundir.STORE_LOST, list(self.ranks), now, now, why), [])
        f.cause = why
        f.hosts_lost = multihost.hosts_at(self.members, self._endpoint.rpartition(":")[0])
        f.action.append("give up: the job runs again from the newest committed checkpoint")
        return f

    def _record(self, d: Detection, related: list[Detection]) -> Fault:
        injected, at = summary.injected(self.run_dir, self.watch.started if self.watch else 0)
        recs = [rec for rec in (self.watch.last(r) for r in self.ranks) if rec] \
            if self.watch else []
        steps = [rec.get("step", 0) for rec in recs]
        # an injected fault's marker is written the instant it fires: the exact fault time
        f = Fault(d.kind, list(d.ranks), self.attempt, at or d.fault_at,
                  d.detected_at, d.evidence, injected=injected,
                  last_step=max(steps + [self.max_step]))
        # whatever detected it (an exit, missed heartbeats, a hang): had this attempt finished
        # a step on any rank?
        f.before_first_step = not any(x.get("attempt") == self.attempt and
                                      x.get("first_step_at") for x in recs)
        if not f.cause:
            f.cause = d.kind if d.kind != "hang" else "no progress: " + d.evidence.split(";")[0]
        extra = [x.evidence for x in related if x is not d]
        if extra:
            f.evidence += " | also: " + " | ".join(extra[:5])
        if injected:
            log.info("fault hook %s fired (MYRIA_FAULT)", injected)
        self.faults.append(f)
        self.current = f
        return f

    def _track_recovery(self, records: dict[int, dict | None], now: float) -> None:
        recs = [x for x in records.values() if x and x.get("attempt") == self.attempt]
        if not recs:
            return
        step = max(x.get("step", 0) for x in recs)
        self.max_step = max(self.max_step, step)
        if self._attempt_at and len(recs) == len(self.ranks) and \
                all(x.get("first_step_at") for x in recs):
            first = max(x["first_step_at"] for x in recs)
            self.startup_s = max(self.startup_s, first - self._attempt_at)
            self._attempt_at = 0.0
        known = [x["resumed_from"] for x in recs if x.get("resumed_from", -1) >= 0]
        if self.initial_step is None and self.attempt == 0 and len(known) == len(recs):
            self.initial_step = min(known)  # -1 means "not resumed yet", never a step
        # the fault is followed once its new group started (a membership change restarts the
        # group without using a restart: same attempt, restarted_at set)
        f = self.current
        if f is None or f.attempt == self.attempt and not f.restarted_at:
            return
        if f.resumed_from is None and all(x.get("resumed_from", -1) >= 0 for x in recs):
            f.resumed_from = min(x.get("resumed_from", 0) for x in recs)
        firsts = [x.get("first_step_at", 0) for x in recs]
        if not f.first_step_at and firsts and all(firsts) and len(recs) == len(self.ranks):
            f.first_step_at = max(firsts)
            log.info("RESUMED attempt %d from step %s: first step done %.1f s after the fault "
                     "(lost steps to redo: %s)", self.attempt, f.resumed_from,
                     f.first_step_at - f.fault_at,
                     f.last_step - f.resumed_from if f.resumed_from is not None else "?")
        # regained once every rank is back at the step reached before the fault (an in-job
        # recovery that lost no step gets there on restoring, not on its first step)
        if not f.regained_at and len(recs) == len(self.ranks) and \
                min(x.get("step", 0) for x in recs) >= f.last_step:
            f.regained_at = now

