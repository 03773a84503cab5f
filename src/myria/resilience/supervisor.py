"""`myria supervise`: training under torch elastic with heartbeats, fault detection and recovery.

    myria supervise --config configs/demo.toml --run-dir runs/demo --nproc 2 [--section.key=value]
    # several hosts: the same command on each, plus
    #   --nnodes 4 --rdzv-endpoint HOST0:29400 --rdzv-id JOB

The supervisor is MegaScale's robust-training driver, built on torch elastic's agent API (the
agent behind torchrun): a `LocalElasticAgent` subclass starts this host's workers (`myria train`
processes), and its monitor loop also

- reads every worker's heartbeat (a TCPStore the supervisor serves on 127.0.0.1, or Redis) and
  scans the workers' stderr for alarm keywords (`myria.resilience.watch`);
- on a fault (a worker exited, missed heartbeats, a hang, traffic stopped, an alarm the rank did
  not recover from) logs the detection with its evidence, stops the worker group, runs the
  self-check diagnostics on this host (`myria.resilience.diagnostics.run_diagnostics`; skipped,
  with the reason in the fault's `decision`, when the host passed them within
  `resilience.diagnostics_ttl_s` and the fault does not point at the hardware), puts a
  failing host on the blocklist and hands it to the scheduler through `resilience.blocklist_hook`,
  waits a back-off (doubling) and restarts the group, whose workers resume from the newest
  checkpoint that verifies; up to `resilience.max_restarts` times;
- at the end writes RUN_DIR/supervisor_summary.json: every fault with its cause, evidence,
  action, detection latency and time lost, each recovery by phase (`recovery_phases`:
  detection, tear-down, decision = diagnostics, back-off, starting processes, process groups,
  model build, restoring state, redoing lost steps; they add up to its time lost), the
  effective training time ratio (time in training steps whose result was kept / wall time) and
  the goodput ledger (`goodput`: every second of the wall time by category, with its own ETTR
  and a timeline; myria.observe.goodput). A hang's report (RUN_DIR/report/hang.json) holds
  each rank's Python stack beside the collective it waits in (myria.observe.hang).

Recovery is a full restart of this host's worker group (`resilience.recovery = "restart"`, the
default), or with "in-job" the survivors stay and a hot spare or a fresh process takes the lost
rank's state from its ring neighbour's memory (myria.resilience.injob, myria.train.rejoin);
what in-job recovery cannot serve falls back to the full restart.

The supervisor's log (stderr and RUN_DIR/supervisor.log) has one line per detection (DETECTED),
per action (ACTION) and per recovery milestone (RESUMED). Workers' own output goes to the console
prefixed by their rank and to RUN_DIR/logs/. Restarts use `TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`
and explicit rendezvous timeouts (torch issues #135712, #167288: restarts are flaky otherwise).
A restart is not tried where it cannot help: an input error a worker reports as such (exit 2,
a `MyriaError`: config, data, checkpoint), checkpoints that cannot be saved (exit 4: a full disk,
checkpoint.pipeline.SaveError), and the same error before the first step on two attempts in
a row (a deterministic start-up error; a SIGKILL, from outside, never counts): the supervisor
says so in one line, records the fault in the summary and exits non-zero. It owns the run
directory while it runs (RUN_DIR/run.lock, myria.rundir.lock: a second job on it is refused)
and its workers stop at their next step if it dies (myria.train.launch.stop_with_launcher).

Exit status: 0 done, 1 gave up (restarts exhausted, unrecoverable, or the same start-up error
twice), 2 input error, 3 this host failed its diagnostics and left the job (bad_host_action =
exit), 4 checkpoints could not be saved (free space, then run again to resume), 143 stopped by
SIGTERM after the workers saved a checkpoint.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from myria import config as config_mod
from myria import rundir
from myria.errors import ConfigError, LaunchError, MyriaError
from myria.fsutil import atomic_write
from myria.observe import goodput
from myria.observe import heartbeat_store as heartbeat
from myria.resilience.watch import Detection, Watchdog

ACCEPTS_OVERRIDES = True
EXIT_BAD_HOST = 3
STRAGGLER_CHECK_S = 5.0  # how often the supervisor scores the ranks' compute times
EXIT_PREEMPTED = 143
SAVE_FAILED = 4  # checkpoint.pipeline.SaveError.exit_code (not imported: torch-free here)
ACTIONABLE = ("exit", "missed-heartbeats", "no-heartbeat", "hang", "traffic-stopped", "alarm")

log = logging.getLogger("myria.supervisor")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="TOML run config (default: built-in defaults)")
    p.add_argument("--run-dir", required=True, help="run directory (checkpoints, metrics, logs, "
                   "supervisor_summary.json)")
    p.add_argument("--nproc", type=int, default=1, help="worker processes (ranks) on this host")
    p.add_argument("--nnodes", default="1", help="hosts in the job: N or MIN:MAX (elastic)")
    p.add_argument("--rdzv-endpoint", default="", help="HOST:PORT of the rendezvous (default: "
                   "127.0.0.1 and a free port, one host)")
    p.add_argument("--rdzv-id", default="", help="job id shared by the hosts of one job")
    p.add_argument("--job-status", action="store_true", help="print job --rdzv-id's outcome "
                   "from RUN_DIR's summary and exit 0 only if it succeeded (the Slurm script's "
                   "exit)")
    p.epilog = ("Config overrides --section.key=value pass to the workers as in `myria train`; "
                "[resilience] sets heartbeats, timeouts, restarts and the blocklist hook.")


def run(args) -> int:
    if args.job_status:
        from myria.resilience.multihost import job_status

        return job_status(Path(args.run_dir), args.rdzv_id)
    from myria.train.preflight import run_config

    cfg, _ = run_config(args.config, args.overrides, args.run_dir)  # model.init_from too
    min_nodes, max_nodes = _parse_nnodes(args.nnodes)
    from myria import faults, rundir
    from myria.data.mixture import open_dataset
    from myria.layout import Layout
    from myria.train.preflight import check_nproc, check_run, preflight

    faults.parse(os.environ.get("MYRIA_FAULT"))  # a bad test hook: one line, no restarts
    # one line each, before anything; what needs torch (seconds to import) comes last
    if args.nproc < 1 or cfg.training.device == "cpu":
        check_nproc(args.nproc, "cpu")
    data = open_dataset(cfg.data, cfg.model.seq_len, verify=False)
    if done := preflight(cfg, args.run_dir, None):
        print(done)
        return 0
    from myria.train.distributed import device_type
    from myria.train.trainer import check_vocab

    check_nproc(args.nproc, device_type(cfg.training.device))
    check_vocab(cfg, data)
    check_run(cfg, Layout.resolve(cfg.parallel, args.nproc * min_nodes),
              device_type(cfg.training.device))
    from myria.resilience import injob

    injob.check(cfg, min_nodes, max_nodes, args.nproc)
    rundir.lock(args.run_dir, "supervise", job=args.rdzv_id)   # one job per run directory
    worker_argv = ["train", "--run-dir", str(args.run_dir)]
    if args.config:
        worker_argv += ["--config", str(args.config)]
    worker_argv += list(args.overrides)
    sup = Supervisor(cfg, Path(args.run_dir), args.nproc, worker_argv, min_nodes=min_nodes,
                     max_nodes=max_nodes, rdzv_endpoint=args.rdzv_endpoint,
                     rdzv_id=args.rdzv_id)
    return sup.run()


def _parse_nnodes(text: str) -> tuple[int, int]:
    try:
        lo, _, hi = str(text).partition(":")
        a, b = int(lo), int(hi or lo)
    except ValueError:
        raise ConfigError(f"--nnodes {text!r}: expected N or MIN:MAX") from None
    if not 1 <= a <= b:
        raise ConfigError(f"--nnodes {text!r}: need 1 <= MIN <= MAX")
    return a, b


def serve_tcp_store(timeout_s: float = 60.0):
    """A TCPStore server bound to 127.0.0.1 only, on a free port; returns (store, port)."""
    import torch.distributed as dist

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    port = sock.getsockname()[1]
    fd = sock.detach()  # TCPStore would otherwise listen on every address
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=timeout_s), master_listen_fd=fd)
    return store, port


def parse_expect(text: str) -> dict[str, float]:
    """`resilience.doctor_expect` ("key=value,...") as a dict for run_diagnostics."""
    from myria.resilience.diagnostics import EXPECTED_KEYS

    out: dict[str, float] = {}
    for item in filter(None, (x.strip() for x in text.split(","))):
        k, _, v = item.partition("=")
        if k not in EXPECTED_KEYS:
            raise ConfigError(f"resilience.doctor_expect: unknown key {k!r}; valid: "
                              f"{', '.join(EXPECTED_KEYS)}")
        try:
            out[k] = float(v)
        except ValueError:
            raise ConfigError(f"resilience.doctor_expect: {item!r} needs a number") from None
    return out


@dataclass
class Fault:
    """One fault as the summary reports it."""

    kind: str
    ranks: list[int]
    attempt: int
    fault_at: float
    detected_at: float
    evidence: str
    cause: str = ""
    injected: str = ""
    last_step: int = 0
    action: list[str] = field(default_factory=list)
    diagnostics: list[str] = field(default_factory=list)
    stopped_at: float = 0.0
    decided_at: float = 0.0      # diagnostics done (or skipped)
    decision: str = ""           # diagnostics run or skipped, and why
    backoff_done_at: float = 0.0  # the back-off wait over: the restart begins
    restarted_at: float = 0.0
    newest_committed: str = ""
    resumed_from: int | None = None
    first_step_at: float = 0.0
    regained_at: float = 0.0
    before_first_step: bool = False  # the attempt had not finished a step when it failed
    sdc: dict | None = None      # kind sdc: the workers' verdict (rank, step, check, verdict)
    recovery: str = "restart"   # or "in-job: spare" / "in-job: fresh process"
    signature: str = field(default="", repr=False)  # the error, numbers masked

    @property
    def detection_s(self) -> float:
        return max(0.0, self.detected_at - self.fault_at)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("signature")
        d["detection_s"] = round(self.detection_s, 3)
        d["fault_to_first_step_s"] = round(self.first_step_at - self.fault_at, 3) \
            if self.first_step_at else None
        d["lost_steps"] = (self.last_step - self.resumed_from) \
            if self.resumed_from is not None else None
        d["time_lost_s"] = round(self.regained_at - self.fault_at, 3) if self.regained_at \
            else None
        return d


class _BadHost(Exception):
    pass


class _UserError(Exception):
    """A rank failed with an error of the user's input (exit 2): a restart cannot fix it."""


class _SaveFailed(Exception):
    """Checkpoints could not be saved (exit 4, a full disk): a restart would redo unsaved work."""


class _StartupError(Exception):
    """The same error ended two attempts in a row before their first step: deterministic."""


def _agent_class():
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    class SupervisedAgent(LocalElasticAgent):
        """torch elastic's local agent with the supervisor's detection and recovery hooks."""

        def __init__(self, sup: Supervisor, *a, **kw):
            super().__init__(*a, **kw)
            self.sup = sup

        def _monitor_workers(self, worker_group):
            if self.sup.injob is not None:  # a lost worker replaced in-job, or None
                handled = self.sup.injob.poll(self, worker_group)
                if handled is not None:
                    return handled
            return self.sup.monitor(self, worker_group, super()._monitor_workers(worker_group))

        def _stop_workers(self, worker_group):
            # A faulty group is killed outright: a frozen (SIGSTOP) or hung rank would ignore
            # SIGTERM, and the restart resumes from the last committed checkpoint anyway.
            if self.sup.max_nodes > 1:   # but a fenced-off group stops on the fence first
                from myria.resilience.multihost import await_fenced_exit

                await_fenced_exit(self.sup.run_dir, [w.id for w in worker_group.workers
                                                     if w.id])
            self._shutdown(death_sig=signal.SIGKILL, timeout=10)

        def _restart_workers(self, worker_group):
            self.sup.recover(self, worker_group)
            super()._restart_workers(worker_group)

        def _rendezvous(self, worker_group):
            super()._rendezvous(worker_group)
            self.sup.rendezvoused(self, worker_group)

        def _initialize_workers(self, worker_group):
            self.sup.before_start(self, worker_group)
            super()._initialize_workers(worker_group)
            self.sup.started(self, worker_group)

    return SupervisedAgent


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
        self.expect = parse_expect(self.r.doctor_expect)
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
        os.environ[heartbeat.ENV_PERIOD] = str(r.heartbeat_s)
        os.environ[heartbeat.ENV_JOB] = self.job
        from myria.train.launch import LAUNCHER_ENV
        os.environ[LAUNCHER_ENV] = str(os.getpid())  # workers stop when this process dies

    def _agent(self):
        from torch.distributed.elastic.agent.server.api import WorkerSpec
        from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
        from torch.distributed.elastic.rendezvous import RendezvousParameters
        from torch.distributed.elastic.rendezvous import registry as rdzv_registry

        from myria.train.launch import free_port

        endpoint = self.rdzv_endpoint or f"127.0.0.1:{free_port()}"
        self._endpoint = endpoint
        t = self.cfg.training
        params = RendezvousParameters(
            backend="c10d", endpoint=endpoint, run_id=self.job, min_nodes=self.min_nodes,
            max_nodes=self.max_nodes, join_timeout=int(t.init_timeout_s),
            last_call_timeout=1 if self.min_nodes == self.max_nodes else 30,
            close_timeout=30, read_timeout=int(max(60, t.init_timeout_s)),
            # a host silent this long is out of the round, so a spare can take its place
            keep_alive_interval=max(1, round(self.r.heartbeat_s)),
            keep_alive_max_attempt=max(3, 2 * self.r.missed_heartbeats))
        spec = WorkerSpec(
            role="trainer", local_world_size=self.nproc, entrypoint=sys.executable,
            args=("-u", "-m", "myria", *self.worker_argv),
            rdzv_handler=rdzv_registry.get_rendezvous_handler(params),
            max_restarts=self.r.max_restarts,
            monitor_interval=max(0.05, min(0.5, self.r.heartbeat_s / 4)))
        logs = DefaultLogsSpecs(log_dir=str(self.run_dir / rundir.LOGS_DIR), tee=Std.ALL)
        return _agent_class()(self, spec, logs, start_method="spawn", exit_barrier_timeout=60,
                              shutdown_timeout=int(self.r.sigterm_grace_s))

    # -- the run -----------------------------------------------------------------------------
    def run(self) -> int:
        """Supervise the job to its end; returns the exit status (see the module docstring)."""
        from torch.distributed.elastic.agent.server.api import WorkerState
        from torch.distributed.elastic.multiprocessing.api import SignalException
        from torch.distributed.elastic.rendezvous import RendezvousClosedError, RendezvousError

        self._setup_logging()
        self._environment()
        self.started_at = time.time()
        log.info("supervising %d worker(s) on %s: job %s, run dir %s, heartbeat every %g s "
                 "to %s, up to %d restarts", self.nproc, self.host, self.job, self.run_dir,
                 self.r.heartbeat_s, os.environ[heartbeat.ENV_STORE], self.r.max_restarts)
        status, code = "failed", 1
        try:
            if self.injob is not None:
                self.injob.start_spares()
            agent = self._agent()
            if self.max_nodes > 1:
                self._wait_for_hosts(None)
            result = agent.run()
            if result is not None and result.state == WorkerState.SUCCEEDED:
                status, code = "succeeded", 0
            else:
                log.error("ACTION give up: %s", "restarts exhausted"
                          if self.r.max_restarts else "no restarts allowed")
        except _BadHost as e:
            status, code = "host-blocklisted", EXIT_BAD_HOST
            log.error("ACTION leave the job: %s", e)
        except _UserError as e:
            status, code = "input-error", 2
            log.error("ACTION stop without restarting (a restart cannot fix bad input): %s", e)
        except _SaveFailed as e:
            status, code = "checkpoint-failed", SAVE_FAILED
            log.error("ACTION stop without restarting (the work would not be saved): %s", e)
        except _StartupError as e:
            status, code = "startup-error", 1
            log.error("ACTION stop without restarting: %s", e)
        except SignalException as e:
            status, code = "preempted", EXIT_PREEMPTED
            log.warning("ACTION stopped by %s: workers were asked to save and exit", e.sigval)
        except LaunchError as e:
            log.error("%s", e)
        except RendezvousClosedError:  # the job ended on the other hosts
            from myria.resilience.multihost import EXCLUDED, SPARE_UNUSED

            if self.ranks:
                status, code = EXCLUDED, 0
                log.warning("ACTION leave: the job went on and ended without this host (its "
                            "rendezvous is closed)")
            else:
                status, code = SPARE_UNUSED, 0
                log.info("the job ended without needing this spare host")
        except RendezvousError as e:
            from myria.resilience.multihost import EXCLUDED, moved_on_without, store_lost

            status = "rendezvous-failed"
            if self.ranks and (why := moved_on_without(self.run_dir, self.job, self.host)):
                status, code = EXCLUDED, 0   # cut off: the job went on (fenced) without it
                log.warning("ACTION leave: %s", why)
            elif self.max_nodes > 1 and (why := store_lost(self._endpoint)):
                from myria.resilience.multihost import EXIT_STORE_LOST

                status, code = "rendezvous-lost", EXIT_STORE_LOST
                log.error("ACTION give up: %s; resubmit the job: it resumes from the newest "
                          "committed checkpoint (%s)", why,
                          _newest_committed(self.run_dir) or "none yet")
            else:
                log.error("ACTION give up: the rendezvous did not complete (%s)%s",
                          str(e) or type(e).__name__,
                          f"; host(s) {', '.join(self._waiting.missing)} never rejoined"
                          if self._waiting is not None and self._waiting.missing else "")
        finally:
            self._check_stragglers(time.time(), force=True)
            summary = self.summary(status)
            self._write_summary(summary)
            self._close()
        return code

    def _remove_shared(self) -> None:
        """The peer snapshots in shared memory of workers that no longer run."""
        from myria.train import peer

        try:
            peer.remove_shared(self.job)
        except OSError:
            pass

    def _close(self) -> None:
        self._stop_waiting()
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
        self.ranks = [w.global_rank for w in wg.workers]
        self.stderr_pos = {}
        self.new_watch()
        if self.current is not None:
            self.current.restarted_at = time.time()
        log.info("attempt %d: started ranks %s (pids %s)", self.attempt, self.ranks,
                 [w.id for w in wg.workers])
        if self.max_nodes > 1:
            self._joined(agent, wg)

    def new_watch(self) -> None:
        """A watchdog for the ranks of attempt `self.attempt`."""
        r, t = self.r, self.cfg.training
        self.watch = Watchdog(self.ranks, r.heartbeat_s, r.missed_heartbeats, r.hang_timeout_s,
                              r.traffic_timeout_s, startup_timeout_s=t.init_timeout_s,
                              keywords=tuple(k.strip() for k in r.alarm_keywords.split(",")),
                              attempt=self.attempt)
        self.alarms = []

    def monitor(self, agent, wg, result):
        """Called every monitor interval with the agent's own verdict; may turn it UNHEALTHY."""
        from torch.distributed.elastic.agent.server.api import RunResult, WorkerState

        if self.watch is None:
            return result
        now = time.time()
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
        if f is None:
            why, silent_s = self._membership_change(agent)
            now = time.time()
            f = self._record(Detection("membership-change", [], now, now - silent_s, why), [])
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
            self._diagnose(f)
        f.decided_at = time.time()
        restarts = sum(1 for x in self.faults if x.restarted_at) + 1
        wait = min(self.r.backoff_s * 2 ** (restarts - 1), self.r.backoff_max_s)
        newest = f.newest_committed
        f.action.append(f"restart after {wait:.1f} s back-off from the newest valid checkpoint")
        log.info("ACTION restart (attempt %d, %d restart(s) left) after %.1f s back-off; "
                 "workers resume from the newest checkpoint that verifies (newest committed: "
                 "%s)", self.attempt + 1, agent._remaining_restarts, wait, newest or "none")
        time.sleep(wait)
        f.backoff_done_at = time.time()
        if self.max_nodes > 1:
            self._wait_for_hosts(f)

    # -- several hosts (myria.resilience.multihost) ------------------------------------------
    def _membership_change(self, agent) -> tuple[str, float]:
        """What changed in the rendezvous (the hosts of this round that left it, if any), and
        how long before now it happened at the least (a host that left was silent for the
        rendezvous' keep-alive window)."""
        from myria.resilience import multihost

        if self.max_nodes <= 1:
            return "a host joined or left the rendezvous", 0.0
        gone = multihost.left_round(agent, self.members)
        if not gone:
            return "a host joined the rendezvous", 0.0
        try:
            s = agent._rdzv_handler.settings
            window = (s.keep_alive_interval * s.keep_alive_max_attempt).total_seconds()
        except AttributeError:
            window = 0.0
        return (f"host(s) {', '.join(gone)} of this round dropped out of the rendezvous (no "
                f"keep-alive for {window:g} s: lost or cut off)", window)

    def _joined(self, agent, wg) -> None:
        """The round's hosts, and this host's ranks among them, once its workers started."""
        from myria.resilience import multihost

        self._stop_waiting()
        self.members = multihost.members(agent) or self.members
        log.info("placement: %s runs ranks %s of %d; hosts in this round: %s", self.host,
                 self.ranks, wg.spec.local_world_size * max(1, len(self.members)),
                 ", ".join(self.members) or "?")

    def rendezvoused(self, agent, wg) -> None:
        """A rendezvous round completed: its workers carry the round (myria.rundir.FENCE_ENV)
        and the first host records it as the job's current round, fencing off older rounds'
        workers (a host cut off by a partition) before this round's workers start."""
        if self.max_nodes <= 1:
            return
        from myria.resilience import multihost

        try:
            rnd = int(agent._rdzv_handler._state_holder.state.round)
        except AttributeError:
            return
        os.environ[rundir.FENCE_ENV] = f"{self.job}:{rnd}"
        if wg.group_rank == 0:
            hosts = multihost.members(agent)
            rundir.fence_bump(self.run_dir, self.job, rnd, hosts)
            log.info("round %d of the rendezvous: hosts %s; workers of earlier rounds are "
                     "fenced off the run directory", rnd, ", ".join(hosts) or "?")

    def _wait_for_hosts(self, f: Fault | None) -> None:
        """Report, while the agent waits in the rendezvous, which hosts it waits for (after
        fault `f`: the previous round's; at the start: how many more), or that it is a spare."""
        from myria.resilience import multihost

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
        f.newest_committed = _newest_committed(self.run_dir)
        # The heartbeats read at detection can lag the workers by a beat (a loaded host): the
        # step a committed checkpoint or a metrics row of this attempt proves was reached
        # counts too, so the steps lost are never negative.
        since = self.watch.started if self.watch else self.started_at
        done = [int(f.newest_committed.split("_")[1])] if f.newest_committed else []
        f.last_step = max([f.last_step, *done, *_metrics_rows(self.run_dir, since)])

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
            _sdc_verdict(self.run_dir, self.watch.started) is not None

    def _on_exit(self, result, records, now: float) -> None:
        failures = result.failures
        self.watch.heartbeats(records, now)
        ranks = sorted(failures)

        def order(r):
            f = failures[r]
            # SIGTERM came from the agent stopping the others, peer errors are consequences:
            # killed by another signal < failed by itself < failed because of a peer < SIGTERM
            if f.exitcode == -signal.SIGTERM:
                rank_of = 3
            elif f.exitcode < 0:
                rank_of = 0
            else:
                rank_of = 2 if self.watch.is_secondary(r) else 1
            return (rank_of, f.timestamp, r)

        ranks.sort(key=order)
        culprit = ranks[0]
        parts = []
        for r in ranks:
            f = failures[r]
            how = f"signal {f.signal_name()}" if f.exitcode < 0 else f"exit code {f.exitcode}"
            last = self.watch.last(r) or {}
            cause = self.watch.cause_line(r)
            parts.append(f"rank {r} (pid {f.pid}) ended with {how} at step {last.get('step')}, "
                         f"phase {last.get('phase')}" + (f"; stderr: {cause}" if cause else ""))
        others = [r for r in self.ranks if r not in failures]
        evidence = "; ".join(parts) + (f"; ranks {others} still running" if others else "")
        last = self.watch.state[culprit].seen_at or now
        d = Detection("exit", [culprit] + [r for r in ranks if r != culprit], now, last,
                      evidence, {"exitcodes": {r: failures[r].exitcode for r in ranks}})
        log.warning("DETECTED exit on rank(s) %s: %s", d.ranks, d.evidence)
        f = self._record(d, self.alarms)
        f.cause = self.watch.cause_line(culprit) or (
            f"signal {failures[culprit].signal_name()}" if failures[culprit].exitcode < 0
            else f"exit code {failures[culprit].exitcode}")
        data = failures[culprit].error_file_data
        msg = data.get("message") if isinstance(data, dict) else None
        if failures[culprit].exitcode in (MyriaError.exit_code, SAVE_FAILED):
            f.cause = msg if isinstance(msg, str) and msg else f.cause
        if failures[culprit].exitcode == MyriaError.exit_code:
            f.action.append("stop: input error")
            raise _UserError(f"rank {culprit}: {f.cause}")
        if failures[culprit].exitcode == SAVE_FAILED:
            f.newest_committed = _newest_committed(self.run_dir)
            f.action.append("stop: checkpoints cannot be saved")
            raise _SaveFailed(f"rank {culprit}: {f.cause}")
        if v := _sdc_verdict(self.run_dir, self.watch.started):
            # the workers stopped on a silent-corruption verdict (myria.train.sdc): a rollback
            f.kind, f.sdc, f.ranks = "sdc", v, v["ranks"]
            f.cause = (f"silent data corruption on rank(s) {v['ranks']} at step {v['step']} "
                       f"({v['check']} check): {v['verdict']}")
            log.warning("DETECTED sdc on rank(s) %s at step %s (%s check): %s", v["ranks"],
                        v["step"], v["check"], v["verdict"])
            if v["persistent"] and set(v["ranks"]) <= set(self.ranks):   # this host's device
                self._blocklist(f, f.cause)
                spare = self.max_nodes > self.min_nodes
                if spare and self.r.bad_host_action == "exit":
                    raise _BadHost(f"{self.host}: {f.cause}")
                log.warning("ACTION %s stays in the job: %s; the restart resumes from the "
                            "newest verified checkpoint", self.host,
                            "no spare host to replace it" if not spare else
                            "bad_host_action = recheck")
                f.action.append("host kept: no spare host" if not spare else "host kept")
            return   # a rollback, not a start-up error: restart from the newest checkpoint
        # before any step of this attempt: the same error as last time is deterministic
        started = any(x and x.get("attempt") == self.attempt and x.get("first_step_at")
                      for x in records.values())
        f.before_first_step = not started
        if started or failures[culprit].exitcode == -signal.SIGKILL:
            return  # a SIGKILL comes from outside (OOM killer, operator, node agent, a fault
            # during recovery): no evidence of a deterministic start-up error, even twice
        sign = _signature(failures[culprit].exitcode, msg if isinstance(msg, str) and msg
                          else f.cause)
        prev = self.faults[-2] if len(self.faults) > 1 else None
        if prev is not None and prev.before_first_step and prev.signature == sign and \
                prev.attempt == self.attempt - 1:
            f.action.append("stop: the same error before the first step twice")
            raise _StartupError(
                f"attempts {prev.attempt} and {self.attempt} failed the same way before their "
                f"first step, so a restart cannot fix it (a deterministic start-up error such "
                f"as the config or the environment): rank {culprit}: {f.cause}")
        f.signature = sign

    def _record(self, d: Detection, related: list[Detection]) -> Fault:
        injected, at = _injected(self.run_dir, self.watch.started if self.watch else 0)
        steps = [rec.get("step", 0) for rec in
                 (self.watch.last(r) for r in self.ranks) if rec] if self.watch else []
        # an injected fault's marker is written the instant it fires: the exact fault time
        f = Fault(d.kind, list(d.ranks), self.attempt, at or d.fault_at,
                  d.detected_at, d.evidence, injected=injected,
                  last_step=max(steps + [self.max_step]))
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
                     "(%s lost steps to redo)", self.attempt, f.resumed_from,
                     f.first_step_at - f.fault_at,
                     f.last_step - f.resumed_from if f.resumed_from is not None else "?")
        # regained once every rank is back at the step reached before the fault (an in-job
        # recovery that lost no step gets there on restoring, not on its first step)
        if not f.regained_at and len(recs) == len(self.ranks) and \
                min(x.get("step", 0) for x in recs) >= f.last_step:
            f.regained_at = now

    def _diagnose(self, f: Fault) -> None:
        from myria.resilience.checks.hooks import host_fault
        from myria.resilience.diagnostics import FAULT_ENV, decide_for_supervisor, run_diagnostics

        spec = _doctor_fault_once(self.run_dir, os.environ.get(FAULT_ENV, "") or host_fault())
        d = decide_for_supervisor(self.run_dir, self.host, self.nproc, f.to_dict(),
                                  [x.to_dict() for x in self.faults if x is not f],
                                  self.r.diagnostics_ttl_s,
                                  self.watch.started if self.watch else 0.0, hook=bool(spec))
        f.decision = d.reason
        log.info("DECISION diagnostics %s", d.reason)
        if not d.run:
            f.action.append(f"diagnostics {d.reason.split(' (')[0]}")
            return
        log.info("ACTION self-check diagnostics of %s (%d local ranks)%s", self.host,
                 self.nproc, f" with test hook {FAULT_ENV}={spec}" if spec else "")
        # this host's own checks only: after a fault the other hosts are restarting, lost or
        # in their own diagnostics, so a neighbour check would wait for them and blame this one
        report = run_diagnostics(self.nproc, self.expect or None, self.r.doctor_timeout_s,
                                 faults=spec, peer_hosts=[self.host])
        out = report.write_json(self.run_dir / rundir.DIAGNOSTICS_DIR /
                                f"{self.host}-attempt{self.attempt}.json")
        if not spec:   # the host's record (as `myria doctor`'s): every run directory reuses it
            from myria.resilience.diagnostics import default_report_path

            try:
                report.write_json(default_report_path(self.host))
            except OSError as e:
                log.warning("diagnostics not recorded in the host cache: %s", e)
        f.diagnostics.append(report.summary)
        f.action.append(f"diagnostics: {'pass' if report.passed else 'FAIL'}")
        log.info("diagnostics %s (report %s)", report.summary, out)
        keep = report.performance_only and self.max_nodes <= self.min_nodes
        if report.warnings or not report.passed:
            from myria import detections

            detections.record(self.run_dir, "health", None, self.host, f.last_step,
                              {"summary": report.summary, "report": str(out),
                               "checks": [c.to_dict() for c in report.failures +
                                          report.warnings]},
                              "none" if report.passed else
                              "restart on it: no spare host" if keep else "blocklist")
        if report.passed:
            return
        if keep:
            # Our own throughput measurement alone never ends a job: with no spare host the
            # choice is this host or nothing.
            log.warning("ACTION %s measured below its expected throughput (%s); no spare host "
                        "to replace it with: restarting on it (evidence in %s)", self.host,
                        "; ".join(c.reason for c in report.failures), out)
            f.action.append("slow host kept: no spare host")
            return
        self._blocklist(f, report.summary)
        if self.r.bad_host_action == "exit":
            raise _BadHost(f"{self.host} failed its diagnostics and is blocklisted")
        log.info("ACTION re-run the diagnostics after the blocklist hook (bad_host_action = "
                 "recheck)")
        again = run_diagnostics(self.nproc, self.expect or None, self.r.doctor_timeout_s,
                                faults="", peer_hosts=[self.host])
        again.write_json(self.run_dir / rundir.DIAGNOSTICS_DIR /
                         f"{self.host}-attempt{self.attempt}-recheck.json")
        f.diagnostics.append(again.summary)
        f.action.append(f"diagnostics re-run: {'pass' if again.passed else 'FAIL'}")
        log.info("diagnostics re-run: %s", again.summary)
        if not again.passed:
            raise _BadHost(f"{self.host} failed its diagnostics again")

    def _blocklist(self, f: Fault, reason: str) -> None:
        path = self.run_dir / rundir.BLOCKLIST
        hosts = set(path.read_text().split()) if path.exists() else set()
        hosts.add(self.host)
        atomic_write(path, "".join(h + "\n" for h in sorted(hosts)))
        self.blocklist = sorted(hosts)
        f.action.append(f"blocklist {self.host}")
        log.warning("ACTION blocklist host %s (%s); blocklist: %s", self.host, reason, path)
        hook = self.r.blocklist_hook
        if not hook:
            return
        cmd = hook.replace("{host}", shlex.quote(self.host)).replace(
            "{blocklist}", shlex.quote(str(path)))
        try:
            p = subprocess.run(cmd, shell=True, capture_output=True, text=True, timeout=120)
            out = (p.stdout + p.stderr).strip()[-500:]
            log.info("ACTION blocklist hook `%s` exited %d%s", cmd, p.returncode,
                     f": {out}" if out else "")
            f.action.append(f"blocklist hook exit {p.returncode}")
        except subprocess.TimeoutExpired:
            log.error("blocklist hook `%s` timed out after 120 s", cmd)
            f.action.append("blocklist hook timed out")

    # -- the summary -------------------------------------------------------------------------
    def summary(self, status: str) -> dict[str, Any]:
        """Faults, causes, actions, time lost and the effective training time ratio.

        ETTR = productive / wall from the goodput ledger (myria.observe.goodput: the wall
        time tiled by category; productive = the first run of each step, less its data wait
        and any straggler's cost). `step_time_ratio` is the older measure, kept for comparison:
        the recorded time of the training steps the final model went through, run under this
        supervisor (metrics rows since it started; each row carries the step time since the
        previous row, and rows of steps redone after a rollback were set aside by the trainer)
        over the wall time; `mean_step_s` is from it. Both lie in [0, 1] by construction.
        """
        end = time.time()
        wall = end - self.started_at
        rows = _metrics_rows(self.run_dir, self.started_at)
        final = max(rows) if rows else self.max_step
        start = self.initial_step if self.initial_step is not None else (
            min(rows) - 1 if rows else final)
        productive = sum(r.get("interval_time_s", r.get("step_time_s", 0.0))
                         for s, r in rows.items() if s > start)
        steps = max(0, final - start)
        ettr = productive / wall if wall > 0 else 0.0
        if not 0.0 <= ettr <= 1.0 + 1e-9:  # recorded step times lie inside the wall time
            log.error("effective training time ratio %.4f outside [0, 1] (productive %.1f s, "
                      "wall %.1f s): clamped; please report", ettr, productive, wall)
        ettr = min(max(ettr, 0.0), 1.0)
        faults = []
        for f in self.faults:
            d = f.to_dict()
            d["recovery_phases"] = goodput.breakdown(d, goodput.read_marks(self.run_dir,
                                                                           f.attempt + 1))
            faults.append(d)
        ledger = goodput.summarize(self.run_dir, self.started_at, end, faults,
                                   [{"first_step": s.first_step,
                                     "cost_s_per_step": s.cost_s_per_step}
                                    for s in self.stragglers.values()])
        kept = productive  # the step-time measure; the ledger's when it has rows
        if ledger["seconds"]["productive"] > 0:
            productive, ettr_ledger = ledger["seconds"]["productive"], ledger["ettr"]
        else:
            ettr_ledger = ettr
        return {
            "status": status, "host": self.host, "job": self.job,
            "target_steps": self.cfg.training.steps, "start_step": max(0, start),
            "final_step": final, "steps_trained": steps,
            "restarts": sum(1 for f in self.faults if f.restarted_at),
            "attempts": self.attempt,   # after the first: restarts, in-job shrinks and grows
            "wall_s": round(wall, 3), "productive_s": round(productive, 3),
            "mean_step_s": round(kept / steps, 4) if steps else 0.0,
            "effective_training_time_ratio": round(ettr_ledger, 4),
            "step_time_ratio": round(ettr, 4),
            "time_lost_s": round(wall - productive, 3),
            "newest_checkpoint": _newest_committed(self.run_dir),
            "faults": faults, "blocklist": self.blocklist, "goodput": ledger,
            "undetected_hooks": _undetected(self.run_dir, self.started_at,
                                            {f.injected for f in self.faults}),
            "heartbeat_s": self.r.heartbeat_s, "store": self.r.store,
            **({"ranks": self.ranks, "members": self.members} if self.max_nodes > 1 else {}),
            **({"resizes": self.injob.resizes} if self.injob and self.injob.resizes else {}),
        }

    def _write_summary(self, s: dict[str, Any]) -> None:
        path = self.run_dir / rundir.SUPERVISOR_SUMMARY
        if self.max_nodes > 1:   # one summary of the job, every host's part in it
            from myria.resilience.multihost import write_part_and_merge

            path = write_part_and_merge(self.run_dir, s)
        else:
            atomic_write(path, json.dumps(s, indent=1))
        kinds = [r["kind"] for r in s.get("resizes", [])]
        resized = (f"; {s['attempts']} attempt(s) after the first ({kinds.count('shrink')} "
                   f"shrink, {kinds.count('grow')} grow)" if kinds else "")
        log.info("summary: %s at step %s/%s after %d restart(s)%s; wall %.1f s, training %.1f "
                 "s, effective training time ratio %s; %s", s["status"], s["final_step"],
                 s["target_steps"], s["restarts"], resized, s["wall_s"], s["productive_s"],
                 s["effective_training_time_ratio"], path)
        for f in s["faults"]:
            back = (f"fault to first resumed step {f['fault_to_first_step_s']} s; lost steps "
                    f"{f['lost_steps']}") if f["fault_to_first_step_s"] is not None else \
                "training did not resume after it"
            log.info("  fault %s rank(s) %s at step %s: cause %s; detected in %.2f s; actions: "
                     "%s; %s", f["kind"], f["ranks"], f["last_step"], f["cause"],
                     f["detection_s"], ", ".join(f["action"]) or "-", back)
            if f.get("recovery_phases"):
                log.info("    recovery phases (s): %s", ", ".join(
                    f"{k} {v:.2f}" for k, v in f["recovery_phases"].items()))
        for name in s.get("undetected_hooks", []):
            log.warning("fault hook %s fired (MYRIA_FAULT) and no check detected it: its "
                        "effect, if any, was trained in%s", name,
                        " (the compute check recomputes one microbatch every "
                        "resilience.sdc_interval steps: a step between two checks is not "
                        "recomputed)" if "targetcompute" in name else "")
        g = s["goodput"]
        log.info("goodput ledger: ETTR %.4f; %s; accounted %.1f of %.1f s", g["ettr"],
                 ", ".join(f"{k} {v:.1f}" for k, v in g["seconds"].items() if v),
                 g["accounted_s"], g["wall_s"])


def _signature(exitcode: int, cause: str) -> str:
    """What makes two failures the same: the exit code and the message with its numbers (pids,
    ports, times, addresses) masked."""
    return f"{exitcode}:" + re.sub(r"0x[0-9a-fA-F]+|\d+", "#", cause or "")


def _metrics_rows(run_dir: Path, since: float) -> dict[int, dict]:
    """The last logged row of each training step written since `since`."""
    out: dict[int, dict] = {}
    for row in rundir.read_jsonl(run_dir / rundir.METRICS):
        if "loss" in row and row.get("time", 0) >= since:
            out[int(row["step"])] = row
    return out


def _sdc_verdict(run_dir: Path, since: float) -> dict | None:
    """The workers' silent-corruption verdict written since `since` (RUN_DIR/events.jsonl, kind
    sdc; myria.train.sdc): the ranks named, step, check, verdict and whether it is persistent
    (a device that keeps computing or storing wrong bits); None without one."""
    from myria import detections

    rows = [r for r in detections.read(run_dir, "sdc") if r.get("time", 0) >= since]
    if not rows:
        return None
    ranks, verdicts = [], []
    for r in rows:
        ev = r.get("evidence") or {}
        named = [r["rank"]] if r.get("rank") is not None else ev.get("suspects") or []
        ranks += [x for x in named if x not in ranks]
        verdicts.append(str(ev.get("verdict") or "not classified"))
    first = rows[0].get("evidence") or {}
    persistent = any(v.startswith("persistent") for v in verdicts)
    return {"ranks": sorted(ranks), "step": rows[0].get("step"),
            "check": first.get("check", "replica"), "host": rows[0].get("host"),
            "verdict": next((v for v in verdicts if v.startswith("persistent")), verdicts[0]),
            "persistent": persistent, "detections": len(rows)}


def _newest_committed(run_dir: Path) -> str:
    from myria.train.checkpoint.store import CheckpointStore

    store = CheckpointStore(run_dir / rundir.CHECKPOINTS)
    if store.dir.is_dir():
        store.remove_stale_tmp()   # saves whose writer is gone
    ckpts = store.committed()
    return ckpts[-1].name if ckpts else ""


def _injected(run_dir: Path, since: float) -> tuple[str, float]:
    """The newest MYRIA_FAULT hook that fired since `since`, and when (its marker's mtime)."""
    d = run_dir / rundir.FAULTS
    if not d.is_dir():
        return "", 0.0
    marks = [(p.stat().st_mtime, p.name) for p in d.iterdir()
             if p.is_file() and not p.name.startswith("doctor") and p.stat().st_mtime >= since]
    if not marks:
        return "", 0.0
    at, name = max(marks)
    return name, at


def _undetected(run_dir: Path, since: float, detected: set[str]) -> list[str]:
    """The MYRIA_FAULT hooks that fired since `since` and that nothing detected: no fault of
    the supervisor is attributed to them and no worker recorded a detection after them."""
    from myria import detections

    d = run_dir / rundir.FAULTS
    if not d.is_dir():
        return []
    seen = [float(r.get("time") or 0) for r in detections.read(run_dir)]
    out = []
    for p in d.iterdir():
        if not p.is_file() or p.name.startswith("doctor") or p.name in detected:
            continue
        at = p.stat().st_mtime
        if at >= since and not any(t >= at for t in seen):
            out.append(p.name)
    return sorted(out)


def _doctor_fault_once(run_dir: Path, spec: str) -> str:
    """The MYRIA_DOCTOR_FAULT spec for this diagnostics run: once per run directory."""
    if not spec:
        return ""
    tag = "doctor_" + "".join(c if c.isalnum() else "_" for c in spec)
    marker = run_dir / rundir.FAULTS / tag
    if marker.exists():
        return ""
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.write_text(f"fired by the supervisor at {time.time()}\n")
    return spec
