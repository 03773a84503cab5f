"""How a myria process ends: the exit status a program's run gives (`program_status`), and the
end without the interpreter's finalization (`exit_now`, after `wind_down`), which tears down
torch's C++ objects (stores, process groups) in no defined order (one whose thread is still
joinable aborts the process with SIGABRT) and, with torch imported, is a large part of a short
job's start-to-exit time. The `myria` command, its launcher's workers and the processes forked
for a supervisor (myria.train.launch.fork_module) all end this way."""

from __future__ import annotations

import os
import sys


def program_status(run) -> int:
    """Call `run` and return the exit status the interpreter would have ended a program with:
    its return value, a SystemExit's code (a string printed, status 1), or, for any other
    exception, status 1 with its traceback printed (130 for KeyboardInterrupt)."""
    try:
        code = run()
        return code if isinstance(code, int) else 0
    except SystemExit as e:
        if isinstance(e.code, str):
            print(e.code, file=sys.stderr)
        return e.code if isinstance(e.code, int) else 0 if e.code is None else 1
    except BaseException as e:
        import signal
        import traceback

        traceback.print_exc()
        return 128 + signal.SIGINT if isinstance(e, KeyboardInterrupt) else 1


def exit_now(code: int) -> None:
    """End the process with `code` after what the interpreter's own exit would have done that
    matters (`wind_down`)."""
    wind_down()
    os._exit(code)


def wind_down() -> None:
    """What the interpreter's own exit would have done that matters: the process's other
    threads joined, its exit handlers run, every file still open flushed."""
    import atexit
    import gc
    import io
    import logging
    import threading

    for t in threading.enumerate():
        if t is not threading.current_thread() and not t.daemon:
            t.join()
    atexit._run_exitfuncs()
    logging.shutdown()
    buffered = (io.TextIOWrapper, io.BufferedWriter, io.BufferedRandom)
    for f in gc.get_objects():  # a writer left open would otherwise lose its buffer
        if type(f) in buffered and not f.closed and f.writable():
            try:
                f.flush()
            except (OSError, ValueError):
                pass
    sys.stdout.flush()
    sys.stderr.flush()
