"""The run directory: the interface between the worker side and the tools above it.

Every path under RUN_DIR that more than one part of myria reads or writes is named here, each
constant with what it holds, beside helpers for the per-rank files (rankNNNNN: the global rank)
and `read_jsonl`, which skips a line cut by a crash. `lock` makes a process the owner of a run
directory (RUN_DIR/run.lock: an advisory exclusive flock, JSON host, pid, command, job, time),
held by `myria train` or `myria supervise` (for its workers too) while it runs; every worker
also holds the shared RUN_DIR/workers.lock.
"""

from __future__ import annotations

import atexit
import json
import math
import os
import socket
import sys
import time
from pathlib import Path

from myria.fsutil import atomic_write, pid_alive

CONFIG = "config.json"                      # the resolved config of the run (rank 0, at start)
GENERATION_CONFIG = "generation_config.json"  # model.init_from's (rank 0, at start): its
#                                             stop tokens and sampling defaults, for export
CONFIG_CHANGES = "config_changes.jsonl"     # fields changed on resume: step, field, old, new
CONFIG_CHANGES_ABANDONED = "config_changes.abandoned.jsonl"  # those of a timeline given up
METRICS = "metrics.jsonl"                   # one row per logged step (rank 0)
METRICS_ABANDONED = "metrics.abandoned.jsonl"  # the rows of steps redone after a rollback
CHECKPOINTS = "checkpoints"                 # two-stage checkpoints (myria.train.checkpoint)
CHECKPOINT_STATS = "checkpoint_stats"       # rankNNNNN.json: bytes read to resume, save stalls
DATA_STATS = "stats"                        # data_rankNNNNN.json: samples read from token files
TENSORBOARD = "tensorboard"                 # TensorBoard's copy of the metrics
FAULTS = "faults"                           # markers of injected faults that fired (once a run)
SUPERVISOR_LOG = "supervisor.log"
SUPERVISOR_SUMMARY = "supervisor_summary.json"   # the newest supervised job's summary
SUPERVISOR_JOBS = "supervisor_jobs"         # <job>.json: every supervised job's summary, kept
#                                             so that a run of several jobs reports them all
LOGS_DIR = "logs"                           # the workers' output
DIAGNOSTICS_DIR = "diagnostics"             # the doctor's reports at a fault
BLOCKLIST = "blocklist.txt"                 # hosts the supervisor excluded
EVENTS_DIR = "events"                       # rankNNNNN.jsonl: timed events (myria.observe.events)
HANG_DIR = "hang"                           # rankNNNNN.json: what the rank did at a hang dump
REPORT_DIR = "report"                       # `myria report`: index.html, trace.json, blame.json,
#                                             PNGs; hang.json (the supervisor's merged report)
DETECTIONS = "events.jsonl"                 # stragglers, corruption, numerical faults, health
OFFLOAD_DIR = "offload"                     # rankNNNNN/: nvme tier files (or parallel.offload_dir)
OFFLOAD_STATS = "offload_stats"             # rankNNNNN.json: nvme tier I/O, waits, peak memory
LOCK = "run.lock"                           # the owning job's exclusive flock (`lock`)
WORKERS_LOCK = "workers.lock"               # every worker's shared flock, so a new job waits
#                                             for the workers of a dead one to stop
LOCK_ENV = "MYRIA_RUN_LOCK"   # set by the lock's owner: its workers run under its lock


def checkpoints_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / CHECKPOINTS


def checkpoint_stats_file(run_dir: str | Path, rank: int) -> Path:
    return Path(run_dir) / CHECKPOINT_STATS / f"rank{rank:05d}.json"


def data_stats_file(run_dir: str | Path, rank: int) -> Path:
    return Path(run_dir) / DATA_STATS / f"data_rank{rank:05d}.json"


def events_file(run_dir: str | Path, rank: int) -> Path:
    return Path(run_dir) / EVENTS_DIR / f"rank{rank:05d}.jsonl"


def hang_file(run_dir: str | Path, rank: int) -> Path:
    return Path(run_dir) / HANG_DIR / f"rank{rank:05d}.json"


def job_summary_file(run_dir: str | Path, job: str) -> Path:
    """Where supervised job `job`'s summary is kept (its id made a safe file name)."""
    safe = "".join(c if c.isalnum() or c in "._-" else "_" for c in job) or "job"
    return Path(run_dir) / SUPERVISOR_JOBS / f"{safe}.json"


def write_job_summary(run_dir: str | Path, summary: dict) -> None:
    """Write a supervised job's summary as the run's newest (SUPERVISOR_SUMMARY) and under
    its job's id (`job_summary_file`), so a later job does not erase it."""
    text = json.dumps(summary, indent=1)
    kept = job_summary_file(run_dir, str(summary.get("job", "")))
    kept.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(kept, text)
    atomic_write(Path(run_dir) / SUPERVISOR_SUMMARY, text)


def report_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / REPORT_DIR


def offload_stats_file(run_dir: str | Path, rank: int) -> Path:
    return Path(run_dir) / OFFLOAD_STATS / f"rank{rank:05d}.json"


def json_safe(x):
    """`x` with its non-finite floats as strict JSON takes them: NaN as null, infinities as
    "inf"/"-inf" (Python's bare NaN and Infinity are not JSON: jq and browsers refuse the
    line). Dicts, lists and tuples are walked."""
    if isinstance(x, float) and not math.isfinite(x):
        return None if math.isnan(x) else ("inf" if x > 0 else "-inf")
    if isinstance(x, dict):
        return {k: json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [json_safe(v) for v in x]
    return x


def read_jsonl(path: str | Path, skipped: list[int] | None = None) -> list[dict]:
    """The JSON objects of a JSON-lines file of the run directory; a line cut by a crash (or
    otherwise unparsable, not an object, or one whose "step" is neither a whole number nor
    null) is skipped, its number (from 1) appended to `skipped` when given; a missing file is
    empty."""
    path = Path(path)
    out = []
    if path.exists():
        for i, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            try:
                row = json.loads(line)
            except ValueError:
                row = None
            step = row.get("step") if isinstance(row, dict) else "?"
            if step is None or isinstance(step, int) and not isinstance(step, bool):
                out.append(row)
            elif skipped is not None and line.strip():
                skipped.append(i)
    return out


# -- the run directory's lock ----------------------------------------------------------------
_held: dict[str, int] = {}   # lock path -> fd, in this process
# How long a process that finds the lock held waits for the holder's record while it is empty:
# a holder writes it right after taking the flock (a takeover truncates the old one first) and
# clears it right before letting go, so an empty record is one in flux, not an owner; acting on
# it would refuse the hosts of the holder's own job.
OWNER_RECORD_WAIT_S = 5.0


def _read_owner(fd: int) -> dict:
    try:
        os.lseek(fd, 0, os.SEEK_SET)
        data = json.loads(os.read(fd, 65536).decode() or "{}")
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _describe(owner: dict) -> str:
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(owner["time"])) \
        if isinstance(owner.get("time"), (int, float)) else "?"
    return (f"`myria {owner.get('command', '?')}` (pid {owner.get('pid', '?')} on host "
            f"{owner.get('host', '?')}, since {since})")


def _open_dir(run_dir: Path) -> None:
    from myria.errors import ConfigError

    if run_dir.exists() and not run_dir.is_dir():
        raise ConfigError(f"--run-dir {run_dir} is a file, not a directory; give a directory "
                          "(it is created if missing)")
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"--run-dir {run_dir}: cannot create it ({e.strerror})") from None


def lock(run_dir: str | Path, command: str, job: str = "") -> None:
    """Make this process the owner of `run_dir` for as long as it runs (an exclusive flock on
    RUN_DIR/run.lock, released at exit), or raise ConfigError naming the owner.

    Workers started by an owner (its environment carries LOCK_ENV) run under its lock and take
    only the shared workers' lock; a worker of a launcher that is not myria's (torchrun) locks
    on its host's local rank 0. Before owning the directory, waits (up to a minute) for the
    workers of a previous owner that died (they stop at their next step) to exit. A lock left
    by a process that no longer runs on this host is taken over with a message; an owner of
    the same `job` (the hosts of one multi-host job) shares it."""
    import fcntl

    run_dir = Path(run_dir).resolve()
    _open_dir(run_dir)
    path = run_dir / LOCK
    if str(path) in _held:
        return
    worker = "TORCHELASTIC_RUN_ID" in os.environ or "RANK" in os.environ
    if worker:
        _lock_worker(run_dir)
        if os.environ.get(LOCK_ENV) == str(path) or os.environ.get("LOCAL_RANK", "0") != "0":
            return  # the launcher owns the directory (or this host's local rank 0 does)
        job = job or os.environ.get("TORCHELASTIC_RUN_ID", "")
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    settle = time.monotonic() + OWNER_RECORD_WAIT_S
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            owner = _read_owner(fd)
            if not owner.get("pid") and time.monotonic() < settle:
                time.sleep(0.05)   # a holder between taking the flock and writing its record
                continue
            os.close(fd)
            if job and owner.get("job") == job:
                return  # another host of the same job owns it
            from myria.errors import ConfigError
            raise ConfigError(f"run directory {run_dir} is in use by {_describe(owner)}; wait "
                              f"for it to end, stop it, or use another --run-dir") from None
        except OSError as e:  # a filesystem without locks: say so once, go on unlocked
            os.close(fd)
            print(f"myria: warning: cannot lock {path} ({e.strerror}); nothing stops a second "
                  "job on this run directory", file=sys.stderr)
            return
    owner = _read_owner(fd)
    if owner.get("pid"):
        here = owner.get("host") == socket.gethostname()
        gone = "is no longer running" if here and not pid_alive(int(owner["pid"])) else \
            "left it (it holds no lock)"
        print(f"myria: taking over the lock of {run_dir} from {_describe(owner)}, which {gone}",
              file=sys.stderr)
    if not worker:
        _wait_for_workers(run_dir)
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps({"host": socket.gethostname(), "pid": os.getpid(),
                              "command": command, "job": job, "time": time.time()}).encode(), 0)
    os.fsync(fd)
    _held[str(path)] = fd
    os.environ[LOCK_ENV] = str(path)
    atexit.register(_release, str(path))


def _lock_worker(run_dir: Path) -> None:
    import fcntl

    p = run_dir / WORKERS_LOCK
    if str(p) in _held:
        return
    fd = os.open(p, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
    except OSError:
        os.close(fd)
        return
    _held[str(p)] = fd  # released when the process ends


def _wait_for_workers(run_dir: Path, wait_s: float = 60.0) -> None:
    """Wait until no worker process holds RUN_DIR/workers.lock (those of a dead owner stop at
    their next step); ConfigError after `wait_s`."""
    import fcntl

    fd = os.open(run_dir / WORKERS_LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        deadline, said = time.time() + wait_s, False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                fcntl.flock(fd, fcntl.LOCK_UN)
                return
            except BlockingIOError:
                if time.time() > deadline:
                    from myria.errors import ConfigError
                    raise ConfigError(
                        f"run directory {run_dir}: worker processes of an earlier job still "
                        f"run after {wait_s:.0f} s (they hold {run_dir / WORKERS_LOCK}; see "
                        f"`fuser {run_dir / WORKERS_LOCK}`); stop them and run again") from None
                if not said:
                    print(f"myria: waiting for the workers of an earlier job on {run_dir} to "
                          "stop", file=sys.stderr)
                    said = True
                time.sleep(0.2)
            except OSError:
                return
    finally:
        os.close(fd)


def _release(path: str) -> None:
    """Give up ownership at exit: the file stays (removing it would race with a waiter)."""
    import fcntl

    fd = _held.pop(path, None)
    if fd is None:
        return
    try:
        os.ftruncate(fd, 0)
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)
    except OSError:
        pass
    if os.environ.get(LOCK_ENV) == path:
        os.environ.pop(LOCK_ENV, None)


# -- fencing: the workers of a superseded round of a multi-host job ----------------------------
FENCE = "fence.json"
FENCE_LOCK = "fence.lock"
FENCE_ENV = "MYRIA_FENCE"   # "JOB:ROUND" of the rendezvous round a worker was started in
EXIT_FENCED = 75            # a fenced worker's exit status
FENCE_POLL_S = 0.5          # how often a worker of a multi-host job looks at the fence


def fence_bump(run_dir: str | Path, job: str, generation: int, hosts: list[str]) -> None:
    """Record that job `job` runs in rendezvous round `generation` on `hosts`: from now on the
    workers of its older rounds (a host cut off by a partition, say) may not write the run
    directory. Taken under the fence's exclusive lock, so no fenced write is half done."""
    import fcntl

    from myria.fsutil import atomic_write

    run_dir = Path(run_dir)
    with open(run_dir / FENCE_LOCK, "a+") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        atomic_write(run_dir / FENCE, json.dumps({
            "job": job, "generation": int(generation), "hosts": hosts,
            "by": socket.gethostname(), "time": time.time()}))


# the fault kind of a multi-host job's first node lost, its rendezvous store with it: the job
# ends there (recorded by the supervisor, said by the report)
STORE_LOST = "store-lost"
JOB_ATTEMPT_ENV = "MYRIA_JOB_ATTEMPT"   # the in-job attempt a worker joined (job_attempt)


def job_attempt() -> int:
    """This worker's attempt of the job: the in-job attempt it joined (JOB_ATTEMPT_ENV, set by
    an in-job rejoin and for a replacement: numbered through the job's store); else in a
    multi-host job the rendezvous round it was started in (FENCE_ENV), which every host's
    workers of a round share and each restart of the job renews, as each host's agent numbers
    only its own restarts; else the agent's restart count (TORCHELASTIC_RESTART_COUNT, 0 the
    first start). Across hosts an in-job attempt's number and a later round's are not ordered."""
    joined = os.environ.get(JOB_ATTEMPT_ENV, "")
    if joined.isdigit():
        return int(joined)
    rnd = job_round()
    if rnd is not None:
        return rnd
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


def job_round(job: str | None = None) -> int | None:
    """The rendezvous round this process's workers run in (FENCE_ENV, set in a multi-host
    job: by the supervisor for the round it starts, inherited by its workers), of job `job`
    when given; None outside one."""
    name, _, rnd = os.environ.get(FENCE_ENV, "").rpartition(":")
    return int(rnd) if rnd.isdigit() and (job is None or name == job) else None


def fenced(run_dir: str | Path) -> str:
    """Why this worker may not write `run_dir` (its round was superseded), or ""."""
    mine = os.environ.get(FENCE_ENV, "")
    if not mine:
        return ""
    job, _, gen = mine.rpartition(":")
    try:
        f = json.loads((Path(run_dir) / FENCE).read_text())
    except (OSError, ValueError):
        return ""
    if f.get("job") == job and gen.isdigit() and int(f.get("generation", -1)) > int(gen):
        return (f"fenced: job {job} moved on to round {f['generation']} on "
                f"{', '.join(f.get('hosts', [])) or '?'} while this worker ran round {gen}")
    return ""


class fence_guard:
    """`with fence_guard(run_dir): <write>`: the write happens only if this worker's round is
    still current, and no new round begins during it (a shared lock against fence_bump's
    exclusive one); a fenced worker says so in one line and exits EXIT_FENCED, writing
    nothing."""

    def __init__(self, run_dir: str | Path) -> None:
        self.run_dir = Path(run_dir)
        self.fh = None

    def __enter__(self):
        if not os.environ.get(FENCE_ENV):
            return self
        import fcntl

        self.fh = open(self.run_dir / FENCE_LOCK, "a+")
        fcntl.flock(self.fh, fcntl.LOCK_SH)
        if why := fenced(self.run_dir):
            print(f"myria: rank {os.environ.get('RANK', '?')} on {socket.gethostname()}: {why}; "
                  "exiting without writing", file=sys.stderr, flush=True)
            os._exit(EXIT_FENCED)
        return self

    def __exit__(self, *exc) -> None:
        if self.fh is not None:
            self.fh.close()
            self.fh = None
