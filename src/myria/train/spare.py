"""A hot spare (`resilience.spares`, in-job recovery): a process the supervisor starts with the
job (`python -m myria.train.spare I WORKER_ARGS`) that imports torch and the trainer, then waits
on the supervisor's store for a rank; given one, it becomes that rank's worker (`myria train`
with the worker's arguments and environment) and takes the lost rank's state from its ring
neighbour's memory (myria.train.rejoin). It dies with the supervisor (PR_SET_PDEATHSIG)."""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import myria.train.trainer  # noqa: F401  (the import a fresh replacement would pay)
from myria.observe import heartbeat_store
from myria.train.rejoin import ENV_ASSIGNED_AT, connect, key


def main(index: int, worker_argv: list[str]) -> int:
    """Wait for a rank, then run as its worker; the worker's exit status."""
    if sys.platform.startswith("linux"):  # go with the supervisor
        try:
            import ctypes
            ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL), 0, 0, 0)
        except (OSError, AttributeError):
            pass
    store = connect(3600.0)
    job = os.environ.get(heartbeat_store.ENV_JOB, "local")
    k = key(job, f"spare{index}")
    store.set(key(job, f"spare{index}/ready"), str(time.time()))
    while not store.check([k]):
        time.sleep(0.02)
    got = json.loads(store.get(k).decode())
    os.environ.update(got["env"])
    os.environ[ENV_ASSIGNED_AT] = str(time.time())
    for fd, path in ((1, got.get("stdout")), (2, got.get("stderr"))):
        if path:  # the lost worker's log files: the supervisor's tee goes on showing them
            f = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            os.dup2(f, fd)
            os.close(f)
    # become `python -m myria WORKER_ARGS` in this process: torch stays imported
    import runpy

    sys.argv = ["myria", *worker_argv]
    runpy.run_module("myria", run_name="__main__", alter_sys=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(int(sys.argv[1]), sys.argv[2:]))
