"""The supervisor's torch elastic agent: a `LocalElasticAgent` whose monitor, stop, restart,
rendezvous and start steps call the supervisor's hooks (myria.resilience.supervisor), and the
TCPStore the supervisor serves the heartbeats from."""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import signal
import socket
import sys

from myria import rundir


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


class SignalLatch:
    """Remembers a stop signal that torch elastic's handler turned into an exception.

    Once workers run, torch's agent raises `SignalException` for SIGTERM, SIGINT, SIGHUP and
    SIGQUIT wherever the main thread is, and forwards the signal to the workers only when the
    exception reaches its own run loop. A `try: ... except Exception` on the way (a store read
    that may fail, a report that must not stop recovery) would swallow it, and the job would run
    to its end as if never signalled. The latch wraps torch's handler to note the signal, and
    `check()`, called at every monitor tick, raises it again where the agent handles it."""

    SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")

    def __init__(self):
        self.signum: int | None = None

    def install(self, first: bool = False) -> None:
        """Wrap torch's handler, which every start of the workers installs afresh. `first`:
        install it before any worker starts too (torch installs it only then), so that a stop
        signal while the hosts gather ends the supervisor the same way, with its summary and
        exit status, instead of by the signal's default action. Main thread only."""
        import threading

        from torch.distributed.elastic.multiprocessing import api

        if threading.current_thread() is not threading.main_thread():
            return

        def handler(signum, frame):
            self.signum = signum
            api._terminate_process_handler(signum, frame)

        for name in self.SIGNALS:
            s = getattr(signal, name, None)
            if s is not None and (first or signal.getsignal(s) is api._terminate_process_handler):
                signal.signal(s, handler)

    @contextlib.contextmanager
    def deferred(self):
        """Stop signals only noted (`signum`) while the block runs, then the handlers as they
        were: the supervisor's last words (its summary) are not cut by a second signal, as a
        scheduler's repeated SIGTERM or a second Ctrl-C would. Main thread only (elsewhere the
        block runs as it is)."""
        import threading

        if threading.current_thread() is not threading.main_thread():
            yield
            return
        saved = {}
        for name in self.SIGNALS:
            s = getattr(signal, name, None)
            if s is not None:
                saved[s] = signal.signal(s, lambda signum, frame: setattr(self, "signum", signum))
        try:
            yield
        finally:
            for s, h in saved.items():
                signal.signal(s, h)

    def check(self) -> None:
        if self.signum is not None:
            from torch.distributed.elastic.multiprocessing.api import SignalException

            sig = signal.Signals(self.signum)
            raise SignalException(f"Process {os.getpid()} got signal: {sig}", sigval=sig)


class ForkedHandler:
    """torch elastic's SubprocessHandler for a worker command (`python -u -m myria ...`) run as
    a process forked from the supervisor's forkserver (myria.train.launch.fork_module), which
    imported torch and the trainer once: with Popen every worker, every restart and every
    replacement imports them again (seconds of CPU per process). The same output files (the
    agent's tee reads them), environment, session and signals as torch's handler."""

    def __init__(self, entrypoint: str, args: tuple, env: dict, stdout: str | None,
                 stderr: str | None, local_rank_id: int, numa_options=None) -> None:
        from myria.train.launch import fork_module

        if numa_options is not None:
            raise ValueError("NUMA binding is not supported by the supervisor's workers")
        self.local_rank_id = local_rank_id
        for path in {stdout, stderr} - {None}:
            open(path, "w").close()   # a new start's files begin empty, as torch's do
        self.proc = fork_module(args, {**os.environ, **env}, stdout, stderr)

    def close(self, death_sig=None) -> None:
        self.proc.signal_group(death_sig or signal.SIGTERM)


def agent_class():
    """The agent class (defined on first use: torch elastic is imported only then)."""
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    class SupervisedAgent(LocalElasticAgent):
        """torch elastic's local agent with the supervisor's detection and recovery hooks."""

        def __init__(self, sup, *a, **kw):
            super().__init__(*a, **kw)
            self.sup = sup
            self.latch = sup.latch

        def _monitor_workers(self, worker_group):
            self.latch.check()
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

        def _exit_barrier(self):
            # a host whose ranks a spare took over (in-job, myria.resilience.takeover) never
            # reaches the barrier: the first host passes it in its place
            if self.sup.lost_hosts and self._worker_group.group_rank == 0:
                from torch.distributed.elastic.agent.server.api import _TERMINAL_STATE_SYNC_ID
                from torch.distributed.elastic.utils.store import _barrier_nonblocking

                for _ in self.sup.lost_hosts:
                    _barrier_nonblocking(self._store, self._worker_group.group_world_size,
                                         _TERMINAL_STATE_SYNC_ID)
            super()._exit_barrier()

        def _rendezvous(self, worker_group):
            super()._rendezvous(worker_group)
            self.sup.rendezvoused(self, worker_group)

        def _start_workers(self, worker_group):
            # torch elastic starts a command's workers with `Popen` (SubprocessHandler) and has
            # no hook for how: its handler factory is swapped for `ForkedHandler` while it does
            from torch.distributed.elastic.multiprocessing import api

            saved = api.get_subprocess_handler
            api.get_subprocess_handler = ForkedHandler
            try:
                return super()._start_workers(worker_group)
            finally:
                api.get_subprocess_handler = saved

        def _initialize_workers(self, worker_group):
            self.latch.check()   # a stop signal swallowed while the hosts gathered
            self.sup.before_start(self, worker_group)
            super()._initialize_workers(worker_group)
            self.latch.install()
            self.sup.started(self, worker_group)

    return SupervisedAgent


def make_agent(sup):
    """torch elastic's agent for supervisor `sup`: its rendezvous (c10d), the workers' command
    (`python -m myria WORKER_ARGS`) and the logs under RUN_DIR/logs."""
    from torch.distributed.elastic.agent.server.api import WorkerSpec
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous import registry as rdzv_registry

    from myria.train.launch import free_port

    endpoint = sup.rdzv_endpoint or f"127.0.0.1:{free_port()}"
    sup._endpoint = endpoint
    t = sup.cfg.training
    params = RendezvousParameters(
        backend="c10d", endpoint=endpoint, run_id=sup.job, min_nodes=sup.min_nodes,
        max_nodes=sup.max_nodes, join_timeout=int(t.init_timeout_s),
        last_call_timeout=1 if sup.min_nodes == sup.max_nodes else 30,
        close_timeout=30, read_timeout=int(max(60, t.init_timeout_s)),
        # a host silent this long is out of the round, so a spare can take its place
        keep_alive_interval=max(1, round(sup.r.heartbeat_s)),
        keep_alive_max_attempt=max(3, 2 * sup.r.missed_heartbeats))
    spec = WorkerSpec(
        role="trainer", local_world_size=sup.nproc, entrypoint=sys.executable,
        args=("-u", "-m", "myria", *sup.worker_argv),
        rdzv_handler=rdzv_registry.get_rendezvous_handler(params),
        max_restarts=sup.r.max_restarts,
        monitor_interval=max(0.05, min(0.5, sup.r.heartbeat_s / 4)))
    if sup.max_nodes > 1:
        _waiting_with_room(spec.rdzv_handler)
    if sup.across_hosts:
        _waiting_spares_ignored(sup, spec.rdzv_handler)
    class LogsByAttempt(DefaultLogsSpecs):
        """torch names each start's log folder attempt_<its restart count> and empties it
        first; across hosts a membership change starts the workers again without spending a
        restart, so there the folder is named by the rendezvous round (the workers' own
        attempt, `rundir.job_attempt`): an earlier round's logs are kept. Only the naming
        sees the round: the workers' environment keeps torch's count."""

        def reify(self, envs):
            rnd = rundir.job_round(sup.job)
            if sup.max_nodes <= 1 or rnd is None:
                return super().reify(envs)
            counts = {k: v.get("TORCHELASTIC_RESTART_COUNT") for k, v in envs.items()}
            for v in envs.values():
                v["TORCHELASTIC_RESTART_COUNT"] = str(rnd)
            try:
                return super().reify(envs)
            finally:
                for k, v in envs.items():
                    if counts[k] is None:
                        v.pop("TORCHELASTIC_RESTART_COUNT", None)
                    else:
                        v["TORCHELASTIC_RESTART_COUNT"] = counts[k]

    # several hosts share the run directory: each host's workers write under their host's name
    # (torch names a run's log folder by the job and a random suffix only)
    logs = LogsByAttempt(log_dir=str(sup.run_dir / rundir.LOGS_DIR /
                                     (sup.host if sup.max_nodes > 1 else "")), tee=Std.ALL)
    sup.agent = agent_class()(sup, spec, logs, start_method="spawn", exit_barrier_timeout=60,
                              shutdown_timeout=int(sup.r.sigterm_grace_s))
    return sup.agent



def _waiting_with_room(handler) -> None:
    """The hosts torch's agent restarts the workers for: those waiting in the rendezvous while
    the round has room for them (a member dropped out). While every place of the round is
    taken, none: one left waiting when the round filled up without it becomes a spare
    (myria.resilience.multihost.waiting_without_room), so a restart with a spare or a
    returning host present is followed by one new round, not a restart per round."""
    from myria.resilience.multihost import waiting_without_room

    waiting = handler.num_nodes_waiting
    log = logging.getLogger("myria.supervisor")

    def num_nodes_waiting() -> int:
        try:
            full, moved = waiting_without_room(handler)
        except Exception as e:   # the store unreachable: torch's own count, as without this
            log.debug("the rendezvous' wait list unread: %s", e)
            full, moved = False, []
        if moved:
            log.info("SPARE: host(s) %s waited for a round that filled up without them: they "
                     "wait as spares (no restart for them while every member is there)",
                     ", ".join(moved))
        return 0 if full else waiting()

    handler.num_nodes_waiting = num_nodes_waiting


def _waiting_spares_ignored(sup, handler) -> None:
    """In-job recovery across hosts: a host waiting in the rendezvous (a spare, moved to the
    wait list once a member dropped out) makes torch's agent restart the round; here a spare
    host takes a lost host's ranks over instead (myria.resilience.takeover), so a waiting
    host is ignored once that happened, and for up to twice the takeover's detection window
    while it may still happen."""
    import time

    from myria.resilience import takeover

    waiting = handler.num_nodes_waiting
    window = 2 * sup.r.heartbeat_s * sup.r.missed_heartbeats + 2.0

    def num_nodes_waiting() -> int:
        n = waiting()
        end = time.time() + window
        while n and not sup.lost_hosts and time.time() < end:
            time.sleep(0.25)
            takeover.follow(sup, sup.agent)
        return 0 if sup.lost_hosts else n

    handler.num_nodes_waiting = num_nodes_waiting
