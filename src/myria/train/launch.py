"""Start N local worker processes through torch elastic (the launcher behind torchrun).

`myria train --nproc N` runs itself as N workers, each one rank, with the same arguments without
--nproc; the workers are forked from a forkserver that imported torch and the trainer once
(`WORKER_PRELOAD`). Across hosts, use torchrun (or `myria supervise`) with a rendezvous
endpoint instead: the workers are the same. `myria supervise` (myria.resilience.supervisor) uses
the same torch elastic agent with heartbeats, fault detection and recovery on top, and forks its
workers from the same forkserver (`fork_module`).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from myria.errors import LaunchError
from myria.fsutil import atomic_write, pid_alive


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def inside_launcher() -> bool:
    """True when this process is already a worker started by torchrun / torch elastic."""
    return "TORCHELASTIC_RUN_ID" in os.environ or "RANK" in os.environ


QUIET_ENV = "MYRIA_LAUNCHER_REPORTS"  # set for workers whose launcher prints their errors
LAUNCHER_ENV = "MYRIA_LAUNCHER_PID"    # the process that starts the workers (their parent)
# The job's start (seconds since the epoch), set by `myria train` and `myria supervise` for the
# processes they start: the wall-time limit (training.max_time_s) counts from it, restarts
# included. Without it, from the worker process's own start.
JOB_START_ENV = "MYRIA_JOB_START"
ORPHAN_GRACE_S = 120.0  # after its launcher died, a worker that has not stopped is killed
PR_SET_PDEATHSIG = 1
_watching = False


def own_run_dir(run_dir) -> None:
    """Lock `run_dir` for this job (myria.rundir.lock: a second job is refused); in a worker,
    also stop at the next step when the launcher dies (`stop_with_launcher`)."""
    from myria import rundir

    if inside_launcher():
        stop_with_launcher()
        stop_when_fenced(run_dir)
    rundir.lock(run_dir, "train")


def stop_when_fenced(run_dir) -> None:
    """In a worker of a multi-host job (myria.rundir.FENCE_ENV set by its supervisor): exit,
    writing nothing, as soon as the job has moved on to a newer rendezvous round without it
    (a host cut off by a partition). Writes that matter also check the fence under its lock
    (myria.rundir.fence_guard); this watch ends the worker between them."""
    from myria import rundir

    if not os.environ.get(rundir.FENCE_ENV):
        return
    import threading

    def watch() -> None:
        signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())
        while True:
            time.sleep(rundir.FENCE_POLL_S)
            with rundir.fence_guard(run_dir):   # exits the process when fenced
                pass

    threading.Thread(target=watch, name="myria-fence-watch", daemon=True).start()


_first_ppid: int | None = None  # this worker's parent when stop_with_launcher() ran


def launcher_gone() -> bool:
    """True in a worker (after `stop_with_launcher`) whose launcher has died."""
    return _first_ppid is not None and os.getppid() != _first_ppid


def _parent_of(pid: int) -> int | None:
    from myria.fsutil import proc_stat

    stat = proc_stat(pid)
    return int(stat[1]) if stat and len(stat) > 1 and stat[1].isdigit() else None


_stopping = threading.Lock()


def stop_once(message: str | None = None) -> bool:
    """Send this process one SIGTERM (the trainer saves at the end of the step and exits),
    printing `message` first; True if this call sent it. Every way a worker learns that its
    launcher is gone (the parent-death signal, the watch thread, the supervisor's store lost)
    stops it through here: a second SIGTERM would end the save half-way."""
    if not _stopping.acquire(blocking=False):
        return False
    if message:
        print(message, file=sys.stderr, flush=True)
    os.kill(os.getpid(), signal.SIGTERM)
    return True


def stop_with_launcher() -> None:
    """Make this worker stop when its launcher (`myria supervise`, torchrun: the parent
    process; `myria train --nproc`: the parent of its forkserver, which ends with it) dies,
    instead of training on as an orphan.

    On Linux the kernel signals the worker at its parent's death (prctl PR_SET_PDEATHSIG;
    torch elastic starts the workers from the agent's main thread, so the signal follows the
    agent process or the forkserver). The signal is SIGUSR2, not SIGTERM: the kernel sends it
    once per thread that inherited the setting, and a second SIGTERM would end a save
    half-way. Its handler, and a thread that watches the parent where prctl is missing, send
    this process one SIGTERM: the trainer saves a checkpoint at the end of the current step
    and exits, as on a preemption. The thread kills the process if it has not stopped
    ORPHAN_GRACE_S later (a hung rank never reaches its next step). Call from the main
    thread."""
    global _watching, _first_ppid
    if _watching:
        return
    _watching = True
    want = os.environ.get(LAUNCHER_ENV, "")
    _first_ppid = os.getppid()
    # a worker of `launch_local` is forked by the launcher's forkserver, which ends with it
    parents = {_first_ppid, _parent_of(_first_ppid)}

    def stop(*_) -> None:
        stop_once(f"myria: rank {os.environ.get('RANK', '?')} (pid {os.getpid()}): its launcher "
                  f"(pid {want or _first_ppid}) died; stopping (after the current step, with a "
                  "checkpoint; at once if no step has begun)")

    signal.signal(signal.SIGUSR2, stop)
    if sys.platform.startswith("linux"):
        try:
            import ctypes
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGUSR2),
                                                    0, 0, 0)
        except (OSError, AttributeError):
            pass
    if (want.isdigit() and int(want) not in parents) or _first_ppid == 1:
        print(f"myria: the launcher of this worker (pid {want or '?'}) is gone before it "
              "started: exiting", file=sys.stderr, flush=True)
        os._exit(1)

    def watch() -> None:
        # signals are the main thread's and the SIGUSR1 dump thread's (myria.observe.events)
        signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())
        while os.getppid() == _first_ppid:
            time.sleep(0.5)
        stop()
        time.sleep(ORPHAN_GRACE_S)
        print(f"myria: rank {os.environ.get('RANK', '?')} (pid {os.getpid()}) did not stop "
              f"within {ORPHAN_GRACE_S:g} s of its launcher's death: killing itself",
              file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="myria-orphan-watch", daemon=True).start()


def record_worker_error(message: str, exit_code: int) -> bool:
    """In a worker of torch elastic, write `message` to the error file its agent reads.

    torch elastic hands each worker a path in TORCHELASTIC_ERROR_FILE and reads it when the
    worker fails (`ProcessFailure`); we add the exact time, so the launcher can tell which
    rank failed first. Returns True when the launcher will print the message itself (the
    worker then stays quiet, so a message shared by every rank appears once).

    The file appears whole or not at all (a temporary file and a rename): the agent stops the
    other workers as soon as one fails, and one stopped between truncating the file and
    writing it would leave it empty, which `ProcessFailure` cannot parse and re-raises in the
    launcher, ending the job as failed instead of recovering it.
    """
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return False
    now = time.time()
    try:
        atomic_write(path, json.dumps({"message": message, "timestamp": int(now),
                                       "myria": {"time": now, "exit_code": exit_code}}),
                     durable=False)
    except OSError:
        return False
    quiet = os.environ.get(QUIET_ENV) == "1"
    if quiet and any(m in message for m in PEER_LOST):
        # `myria train --nproc`'s agent keeps one failure per poll, the lowest rank among the
        # processes found ended (torch.multiprocessing's ProcessContext.join): a survivor
        # ending in the same poll as the peer it lost would be named instead of the peer
        time.sleep(PEER_LOST_LINGER_S)
    return quiet


# what a survivor's error says when a peer is gone (collective or store), or when the agent
# stopped it after another rank failed: a consequence of another rank's failure, not a cause
# (the launcher, the supervisor's reading of a rank's error and in-job recovery judge by it)
PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "Broken pipe",
             "connection was closed", "Socket Timeout", "Timed out", "timed out",
             "ProcessGroupGloo", "gloo", "DistBackendError", "Connection refused",
             "has not been initialized", "aborted", "Aborted", "SIGTERM")
# how often `myria train --nproc`'s agent looks at its workers (launch_local), and how long a
# survivor whose error is a lost peer waits before it exits (`record_worker_error`): several
# of those looks
MONITOR_INTERVAL_S = 0.2
PEER_LOST_LINGER_S = 5 * MONITOR_INTERVAL_S
# torch elastic's message of a rank that wrote no error file
NO_MESSAGE = "<NONE>"


class Stopped(LaunchError):
    """The launcher was asked to stop by a signal, which it forwarded: the workers saved a
    checkpoint at the end of their step and exited (or, past torch elastic's grace period,
    were killed). The exit status is the shell's for that signal, 128 + its number."""

    def __init__(self, sig: signal.Signals) -> None:
        super().__init__(f"stopped by {sig.name}")
        self.signal_name = sig.name
        self.exit_code = 128 + int(sig)


def first_failure(failures: dict) -> tuple[int, Any]:
    """The rank that failed first among torch elastic's ProcessFailures.

    A rank that reported an error of its own (error file) comes before one killed by a signal,
    which comes before one whose error says a peer was lost (`PEER_LOST`: the survivors of a
    killed rank), which comes before one the agent stopped with SIGTERM because a peer had
    failed; ties go to the earliest recorded time, then the lowest rank.
    """
    def order(item):
        rank, f = item
        data = getattr(f, "error_file_data", None)
        mine = data.get("myria") if isinstance(data, dict) else None
        t = mine["time"] if mine else float(getattr(f, "timestamp", 0) or 0)
        message = own_message(f)
        if message:
            kind = 2 if any(m in message for m in PEER_LOST) else 0
        elif f.exitcode == -signal.SIGTERM:
            kind = 3
        else:
            kind = 1
        return (kind, t, rank)

    return min(failures.items(), key=order)


def own_message(f) -> str:
    """The error a failed rank wrote of itself ("" when it wrote none)."""
    data = getattr(f, "error_file_data", None)
    msg = data.get("message") if isinstance(data, dict) else None
    return msg if isinstance(msg, str) and msg != NO_MESSAGE else ""


LOGS_PREFIX = "myria-launch-"   # a launcher's directory of worker error files, in the temp dir
LOGS_OWNER = "launcher.json"    # in it: the launcher's identity (`_launcher`)
UNOWNED_AGE_S = 86400.0         # a directory without a full owner record, removed this old


def _start_time(pid: int | str = "self") -> str | None:
    """When process `pid` started (`fsutil.proc_stat`'s [19], clock ticks since boot)."""
    from myria.fsutil import proc_stat

    stat = proc_stat(pid)
    return stat[19] if stat and len(stat) > 19 else None


def _launcher() -> dict:
    """This process as another launcher can tell it apart: its host, pid, PID namespace (the
    inode of /proc/self/ns/pid), boot (/proc/sys/kernel/random/boot_id) and start time; a part
    that cannot be read is None. Two containers can share /tmp and the hostname and each have
    a pid 1234: the namespace and boot tell them apart, the start time a pid reused after the
    launcher's death."""
    def read(f):
        try:
            return f()
        except OSError:
            return None

    return {"host": socket.gethostname(), "pid": os.getpid(),
            "pidns": read(lambda: os.stat("/proc/self/ns/pid").st_ino),
            "boot": read(lambda: Path("/proc/sys/kernel/random/boot_id").read_text().strip()),
            "start": _start_time()}


def _stale(d: Path, me: dict) -> bool:
    """Whether launcher directory `d` (this user's) was left by a launcher that is gone: its
    owner record names this host, PID namespace and boot, and a pid that no longer runs or
    runs with another start time; one of another host, namespace or boot is that one's to
    judge. A directory without a record to compare (no owner file, one cut short, or one
    without namespace and boot) is removed once it is UNOWNED_AGE_S old: a launcher writes
    its record right after creating the directory."""
    try:
        owner = json.loads((d / LOGS_OWNER).read_text())
        if all(owner.get(k) is not None for k in ("pidns", "boot")):
            if any(owner.get(k) != me[k] for k in ("host", "pidns", "boot")):
                return False
            pid = int(owner["pid"])
            return not pid_alive(pid) or owner.get("start") not in (None, _start_time(pid))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        pass
    try:
        return time.time() - d.stat().st_mtime > UNOWNED_AGE_S
    except OSError:
        return False


def logs_dir() -> str:
    """A new directory for this launcher's worker error files (removed when the launch
    returns), after removing the directories of this user that a killed launcher left behind
    (SIGKILL skips its clean-up; `_stale`)."""
    import shutil
    import tempfile

    me = _launcher()
    for d in Path(tempfile.gettempdir()).glob(f"{LOGS_PREFIX}*"):
        try:
            mine = d.is_dir() and not d.is_symlink() and d.stat().st_uid == os.getuid()
        except OSError:
            continue
        if mine and _stale(d, me):
            shutil.rmtree(d, ignore_errors=True)
    path = tempfile.mkdtemp(prefix=f"{LOGS_PREFIX}{os.getpid()}-")
    atomic_write(Path(path) / LOGS_OWNER, json.dumps(me), durable=False)
    return path


# What a worker imports before its first step: torch, the trainer and the command line;
# torch._dynamo, which torch.optim imports on a process's first optimizer; the pipeline
# schedules; the supervisor's hot spare (myria.train.spare). The launcher's forkserver imports
# them once, each worker is forked from it: N processes each importing torch (seconds of CPU
# apiece, and of the file system on a shared one) is much of a job's start-up. The forkserver
# never touches a GPU (torch's import does not, and it is not forked from a process that has:
# `cuda_driver_loaded`), so forked workers may use CUDA.
WORKER_PRELOAD = ("torch", "torch._dynamo", "torch.distributed.pipelining", "myria.cli",
                  "myria.train.cli", "myria.train.trainer", "myria.parallel.pipeline",
                  "myria.train.spare")
PR_SET_NAME = 15


def as_forked_worker(name: str | None = None) -> None:
    """Ready this process, just forked from the launcher's forkserver, to be a worker; `name`
    is its name in `top` and `ps -o comm` (default: myria-rankN, N its RANK)."""
    from multiprocessing import forkserver

    # The forkserver hands each child a copy of the launcher's end of the pipe whose closing
    # ends the forkserver (so that children may fork children of their own): a worker holding
    # it would keep its parent, the forkserver, alive after the launcher's death, and would
    # never learn of that death (stop_with_launcher). Workers fork nothing.
    server = getattr(forkserver, "_forkserver", None)
    if isinstance(fd := getattr(server, "_forkserver_alive_fd", None), int):
        os.close(fd)
        server._forkserver_alive_fd = None
    if sys.platform.startswith("linux"):   # `top` and `ps -o comm` name the rank
        try:
            import ctypes
            comm = (name or f"myria-rank{os.environ.get('RANK', '')}").encode()[:15]
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_NAME, ctypes.c_char_p(comm), 0, 0, 0)
        except (OSError, AttributeError):
            pass


# A Unix socket's path holds at most 107 bytes (sun_path, with its NUL).
UNIX_PATH_MAX = 107


def start_forkserver() -> None:
    """Start this process's forkserver, importing `WORKER_PRELOAD` (it inherits the environment
    as it is now), while the launcher goes on to the rendezvous. It listens on a socket in a
    new directory under the temporary directory (TMPDIR/pymp-XXXXXXXX/listener-XXXXXXXX): under
    a TMPDIR too long for that (a job's own directory under a batch system), in /tmp.

    A launcher with one thread forks its forkserver (`_fork_forkserver`): it has imported torch
    already, so the forkserver does not start an interpreter and import torch again (seconds of
    CPU per job); with other threads (a store's server) it starts one, as multiprocessing does,
    since a fork copies only the calling thread (`one_thread_at_fork`), and so it does once it
    has loaded the CUDA driver (`cuda_driver_loaded`)."""
    import tempfile
    from multiprocessing import forkserver

    forkserver.set_forkserver_preload(list(WORKER_PRELOAD))
    saved = tempfile.tempdir
    try:
        probe = os.path.join(tempfile.gettempdir(), "pymp-XXXXXXXX", "listener-XXXXXXXX")
        if len(os.fsencode(probe)) > UNIX_PATH_MAX:
            tempfile.tempdir = "/tmp"
        if not _fork_forkserver():
            forkserver.ensure_running()
    finally:
        tempfile.tempdir = saved


def threads_of_this_process() -> int:
    """The threads of this process, the interpreter's and the libraries' (OpenMP, stores) alike;
    0 where the system does not say (no /proc)."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return 0


def one_thread_at_fork() -> bool:
    """Whether a fork of this process would copy all of it: it has one thread once the thread
    pools that stop themselves before a fork have (numpy's OpenBLAS starts one at import and
    shuts it down in its pthread_atfork handler, to restart it at its next use). A trial fork,
    whose child exits at once, runs those handlers."""
    if threads_of_this_process() > 1:
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        os.waitpid(pid, 0)
    return threads_of_this_process() == 1


def cuda_driver_loaded() -> bool:
    """Whether this process has loaded the CUDA driver (libcuda, which the CUDA runtime loads
    at its first call: `torch.cuda.is_available()` is one). The driver does not survive a
    fork: a forked child's first CUDA call fails, so a launcher that asked it anything does
    not fork its workers' forkserver. True where the system does not say (no /proc)."""
    try:
        with open("/proc/self/maps") as f:
            return any("/libcuda.so" in line for line in f)
    except OSError:
        return True


def _fork_forkserver() -> bool:
    """Start multiprocessing's forkserver as a fork of this process rather than a new
    interpreter: what `ForkServer.ensure_running` does (the resource tracker, a listening
    socket, the pipe whose end tells the server its clients are gone), with `os.fork` in place
    of its spawn. False, and nothing started, unless this process has exactly one thread, no
    forkserver yet and no CUDA driver loaded. The standard library has no forking variant; the
    server's loop is its own (`forkserver.main`)."""
    from multiprocessing import connection, forkserver, resource_tracker, util

    server = forkserver._forkserver
    if server._forkserver_pid is not None or cuda_driver_loaded():
        return False
    with server._lock:
        resource_tracker.ensure_running()   # a process of its own (it imports nothing large)
        if not one_thread_at_fork():
            return False
        with socket.socket(socket.AF_UNIX) as listener:
            address = connection.arbitrary_address("AF_UNIX")
            listener.bind(address)
            if not util.is_abstract_socket_namespace(address):
                os.chmod(address, 0o600)
            listener.listen()
            alive_r, alive_w = os.pipe()
            # read to its end once the server has let go of this process's files (the write
            # end is one of them)
            ready_r, ready_w = os.pipe()
            pid = os.fork()
            if pid == 0:
                code = 1
                try:
                    os.close(alive_w)
                    os.close(ready_r)
                    _serve_forks(listener.fileno(), alive_r, list(server._preload_modules))
                    code = 0
                except SystemExit:   # the server's end: its clients are gone
                    code = 0
                except BaseException:   # said where a new interpreter's server would say it
                    sys.excepthook(*sys.exc_info())
                    sys.stderr.flush()
                finally:
                    os._exit(code)
            os.close(alive_r)
            os.close(ready_w)
            os.read(ready_r, 1)
            os.close(ready_r)
        server._forkserver_address = address
        server._forkserver_alive_fd = alive_w
        server._forkserver_pid = pid
    return True


def _serve_forks(listener_fd: int, alive_r: int, preload: list[str]) -> None:
    """The forked forkserver's body: the state a new interpreter's server would start from,
    then multiprocessing's server loop. What the launcher installed is not a worker's: its
    Python signal handlers go back to the defaults, its root logger to a new interpreter's (no
    handlers, level WARNING: a worker's records then reach its stderr through logging's last
    resort, not a launcher's file or a test runner's capture), and every file it holds open
    beyond the standard streams (a run directory's lock, sockets, logs) is pointed at
    /dev/null, so that no worker keeps one alive; the numbers stay taken, so that an object of
    the launcher that closes its file later closes /dev/null, not a file the worker opened
    since."""
    from multiprocessing import forkserver

    global _FORKING
    # locks the launcher held while it forked (this process's copies stay locked)
    forkserver._forkserver._lock = threading.Lock()
    _FORKING = threading.Lock()
    for sig in signal.valid_signals():
        try:
            if callable(signal.getsignal(sig)) and sig != signal.SIGINT:
                signal.signal(sig, signal.SIG_DFL)
        except (OSError, ValueError, TypeError):
            pass
    signal.signal(signal.SIGINT, signal.default_int_handler)
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    root.setLevel(logging.WARNING)
    keep = {0, 1, 2, listener_fd, alive_r}
    null = os.open(os.devnull, os.O_RDWR)
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd not in keep and fd != null:
            os.dup2(null, fd, inheritable=False)   # (the listing's own, closed since: harmless)
    os.close(null)
    forkserver.main(listener_fd, alive_r, preload)


class ForkedProcess:
    """A process forked from this process's forkserver (`fork_module`), with the part of
    `subprocess.Popen`'s interface torch elastic's subprocess table and the supervisor use:
    `pid`, `args`, `returncode`, `poll`, `wait`, `send_signal`, `terminate`, `kill`. Its exit
    status reads as Popen's does (-N for signal N). It is not a child of this process: the
    forkserver reaps it and reports its status through a pipe."""

    def __init__(self, args: tuple, process) -> None:
        self.args, self._process, self.pid = args, process, process.pid
        self.returncode: int | None = None
        self._lock = threading.Lock()   # the status is read from the pipe once

    def poll(self) -> int | None:
        with self._lock:
            if self.returncode is None:
                self.returncode = self._process.exitcode
            return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        import subprocess
        from multiprocessing.connection import wait

        if self.poll() is None:
            wait([self._process.sentinel], timeout)
            if self.poll() is None:
                raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def signal_group(self, sig: int) -> None:
        """`sig` to the process's session (it starts one, as Popen's start_new_session), or to
        the process alone if it has not started it yet."""
        if self.poll() is None:
            try:
                os.killpg(self.pid, sig)
            except (ProcessLookupError, PermissionError):
                self.send_signal(sig)


_FORKING = threading.Lock()   # multiprocessing's table of children is not thread-safe


def fork_module(args: tuple | list, env: dict, stdout: str | None = None,
                stderr: str | None = None, cwd: str | None = None) -> ForkedProcess:
    """`python -u -m MODULE ARGS` (args = ("-u", "-m", MODULE, *ARGS)) as a process forked from
    this process's forkserver (started here if it is not running: `start_forkserver`), with
    the environment `env` (whole, not added to this process's), its output appended to the
    files `stdout` and `stderr`, in the directory `cwd` (default: the forkserver's), in a
    session of its own. What a worker imports is imported once by the forkserver, not again
    in every process (`WORKER_PRELOAD`). Thread-safe."""
    import multiprocessing
    from multiprocessing import process as mp_process

    args = tuple(str(a) for a in args)
    at = args.index("-m") if "-m" in args else -1
    if at < 0 or set(args[:at]) - {"-u"} or len(args) == at + 1:
        raise ValueError(f"not a `python -u -m MODULE ARGS` command: {args}")
    with _FORKING:
        start_forkserver()
        p = multiprocessing.get_context("forkserver").Process(
            target=_module_program, args=(args[at + 1], list(args[at + 2:]), dict(env), stdout,
                                          stderr, cwd), name=f"myria-{args[at + 1]}")
        p.start()
        # multiprocessing's table of children: it would read the exit status from the pipe
        # itself (at the next start of any process, in whatever thread) and join it at exit
        mp_process._children.discard(p)
    return ForkedProcess(args, p)


def _module_program(module: str, argv: list[str], env: dict, stdout: str | None,
                    stderr: str | None, cwd: str | None = None) -> None:
    """The body of a `fork_module` process: what `python -u -m module *argv` would do."""
    import io
    import runpy
    import tempfile

    from myria.exits import exit_now, program_status

    os.setsid()
    os.environ.clear()
    os.environ.update(env)
    tempfile.tempdir = None   # the forkserver's, cached: TMPDIR is read again from `env`
    if cwd is not None:
        os.chdir(cwd)
    as_forked_worker(None if "RANK" in env else f"myria-{module.rpartition('.')[2]}")
    for fd, path in ((1, stdout), (2, stderr)):
        if path:
            f = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            os.dup2(f, fd)
            os.close(f)
    # unbuffered, as -u: a reader of the files sees each line as it is written
    for name, fd in (("stdout", 1), ("stderr", 2)):
        setattr(sys, name, io.TextIOWrapper(io.FileIO(fd, "w", closefd=False),
                                            encoding=getattr(sys, name).encoding,
                                            errors="backslashreplace", write_through=True))
    sys.argv = [module, *argv]
    exit_now(program_status(
        lambda: runpy.run_module(module, run_name="__main__", alter_sys=True)))


def run_entry(entry: str, argv: list[str]) -> None:
    """A worker's body: the function `entry` names ("module:function", as a console script
    is named) called with `argv`."""
    import importlib

    module, _, name = entry.partition(":")
    getattr(importlib.import_module(module), name)(argv)


def launch_local(nproc: int, argv: list[str], entry: str, max_restarts: int = 0) -> None:
    """Run the worker entry point `entry` ("myria.cli:worker": `myria *argv` in the worker) on
    `argv` as `nproc` ranks on this host, forked from a forkserver that has imported what a
    worker needs (`WORKER_PRELOAD`); raise LaunchError on failure."""
    import shutil

    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    # The agent and the workers would otherwise share one TCPStore, which makes restarts
    # flaky in torch 2.13 (upstream issues #135712, #167288).
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=str(uuid.uuid4()),
        rdzv_backend="c10d", rdzv_endpoint=f"127.0.0.1:{free_port()}",
        # explicit timeouts: joining, waiting for late hosts (none: fixed size), closing, and
        # each rendezvous-store read
        rdzv_configs={"join_timeout": 300, "last_call_timeout": 1, "close_timeout": 30,
                      "read_timeout": 120},
        max_restarts=max_restarts, monitor_interval=MONITOR_INTERVAL_S,
        start_method="forkserver",
        # the workers' error files, read into the failures before the launch returns; torch's
        # default is a new /tmp/torchelastic_* per launch that nothing removes
        logs_specs=DefaultLogsSpecs(log_dir=(logs := logs_dir())),
    )
    os.environ[QUIET_ENV] = "1"
    os.environ[LAUNCHER_ENV] = str(os.getpid())
    # We report a failure ourselves (the rank that failed first, its message once): torch
    # elastic's own error lines and tracebacks about its children would repeat it.
    # (every such logger: torch's elastic modules give each its own level, which a parent's
    # level does not override, e.g. the agent's "Received 2 death signal" on Ctrl-C)
    quiet = [logging.getLogger(n) for n in list(logging.root.manager.loggerDict)
             if n.startswith(("torch.distributed.elastic", "torch.distributed.launcher",
                              "torch.multiprocessing"))]
    levels = [lg.level for lg in quiet]
    try:
        # the workers' server before the launcher's loggers are quieted: a forked server keeps
        # what this process set, and the workers' loggers are their own
        start_forkserver()
        for lg in quiet:
            lg.setLevel(logging.CRITICAL)
        elastic_launch(config, entrypoint=run_entry)(entry, list(argv))
    except SignalException as e:  # the agent forwarded it; workers save at their next step
        raise Stopped(e.sigval) from None
    except ChildFailedError as e:
        rank, f = first_failure(e.failures)
        data = f.error_file_data if isinstance(f.error_file_data, dict) else {}
        msg = own_message(f)
        how = f"signal {f.signal_name()}" if f.exitcode < 0 else f"exit code {f.exitcode}"
        others = len(e.failures) - 1
        said = "killed: no error of its own" if f.exitcode < 0 else "its output is above"
        err = LaunchError(
            (msg or f"rank {rank} ended with {how} ({said})")
            + f"  [rank {rank} of {nproc} failed first"
            + (f"; {others} other rank(s) stopped after it]" if others else "]"))
        err.exit_code = (data.get("myria") or {}).get("exit_code", 1)
        err.killed = not msg and f.exitcode < 0   # by a signal, not by an error of the run
        raise err from None
    finally:
        os.environ.pop(QUIET_ENV, None)
        for lg, level in zip(quiet, levels):
            lg.setLevel(level)
        shutil.rmtree(logs, ignore_errors=True)
