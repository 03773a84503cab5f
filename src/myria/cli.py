"""The `myria` command: one entry point for every subcommand.

Each subcommand lives in its own module exposing `add_arguments(parser)` and `run(args) -> int`;
only the chosen one is imported, so `myria --help` answers without importing torch.
Errors a user can cause (`MyriaError`) print one clear line and exit with status 2.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from myria.exits import exit_now, program_status, wind_down

# name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "prepare": ("myria.data.prepare", "text files -> BPE tokenizer -> memory-mapped token shards"),
    "train": ("myria.train.cli", "train a model (--nproc N starts N local processes)"),
    "export": ("myria.train.export", "export a checkpoint (HF safetensors + config.json)"),
    "generate": ("myria.generate", "continue a prompt with a checkpoint (KV cache, greedy or "
                 "sampled)"),
    "supervise": ("myria.resilience.cli_supervise", "run training under the fault-tolerant "
                  "supervisor"),
    "doctor": ("myria.resilience.diagnostics", "self-check diagnostics of this host"),
    "analyze": ("myria.sim.cli_analyze", "per-operator roofline table of a config"),
    "simulate": ("myria.sim.cli_simulate", "predict step time, memory and MFU of runs"),
    "simulate-network": ("myria.sim.netsim.cli", "a collective on a simulated cluster fabric "
                         "(CLOS, ECMP/adaptive routing)"),
    "plan": ("myria.sim.cli_plan", "search parallel layouts and rank them by predicted MFU"),
    "report": ("myria.observe.report", "merged timeline, heat maps and curves of a run"),
    "cluster": ("myria.cluster", "an emulated cluster of hosts on this machine under Slurm "
                "(up, down, faults)"),
}


class Parser(argparse.ArgumentParser):
    """argparse with myria's error style: one line saying what is wrong and where the help is
    (argparse's usage block above it hid the line that matters), and the closest flag for a
    mistyped one."""

    def error(self, message: str):
        if message.startswith("unrecognized arguments:"):
            from myria.config import suggest

            known = [o for a in self._actions for o in a.option_strings]
            typed = [a.split("=")[0] for a in message.split(":", 1)[1].split()
                     if a.startswith("-")]
            message += next((hint for f in typed if (hint := suggest(f, known))), "")
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


def _top_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="myria",
        description="myria: 4D-parallel LLM pre-training that plans, explains and survives runs.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="commands:\n" + "\n".join(f"  {n:<16} {h}" for n, (_, h) in COMMANDS.items())
        + "\n\nRun `myria COMMAND --help` for a command's options.",
    )
    p.add_argument("command", nargs="?", help="one of: " + ", ".join(COMMANDS))
    p.add_argument("--version", action="store_true", help="print the version and exit")
    return p


def main(argv: list[str] | None = None) -> int:
    """Run the command `argv` (default: this process's arguments) and return its exit status.

    As the `myria` program, the process then ends through `exit_now` (myria.exits: without
    the interpreter's finalization)."""
    if argv is not None:
        return _command(list(argv))
    code = _command(sys.argv[1:])
    exit_now(code)
    return code


def worker(argv: list[str]) -> None:
    """A worker of `myria train --nproc` (`train.launch.launch_local`), forked from the
    launcher's forkserver: `myria *argv` in this process, ending as `python -m myria *argv`
    would (a failure's status is its exit code; on success torch elastic collects the return
    value before the process exits)."""
    from myria.train.launch import as_forked_worker, launcher_gone

    as_forked_worker()
    sys.argv = ["myria", *argv]
    code = program_status(lambda: main(argv))
    if code or launcher_gone():   # no launcher to collect a return value: it would wait
        exit_now(code)
    wind_down()


# commands users of other tools look for, and what does their work here
ELSEWHERE = {"import": "a Hugging Face model is a run's start: myria train "
                       "--model.init_from=MODEL_DIR, after myria prepare --tokenizer MODEL_DIR; "
                       "docs/interop.md"}


def _command(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help") or argv[0] == "--version" or \
            argv[0] not in COMMANDS:
        top = _top_parser()
        ns, _ = top.parse_known_args(argv[:1])
        if ns.version:
            from myria import __version__
            print(f"myria {__version__}")
            return 0
        if argv and argv[0] not in ("-h", "--help"):
            import difflib
            close = difflib.get_close_matches(argv[0], COMMANDS, n=1)
            hint = f" ({ELSEWHERE[argv[0]]})" if argv[0] in ELSEWHERE else \
                f" (did you mean {close[0]!r}?)" if close else ""
            print(f"myria: unknown command {argv[0]!r}{hint}\n", file=sys.stderr)
            top.print_help(sys.stderr)
            return 2
        top.print_help()
        return 0
    name, rest = argv[0], argv[1:]
    module_name, help_text = COMMANDS[name]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name and e.name.startswith("myria"):
            print(f"myria {name}: not available in this build ({e.name} is missing)",
                  file=sys.stderr)
            return 2
        raise
    parser = Parser(prog=f"myria {name}", description=help_text,
                    formatter_class=argparse.RawDescriptionHelpFormatter)
    module.add_arguments(parser)
    from myria.errors import MyriaError

    args = None
    try:
        args, unknown = parser.parse_known_args(rest)
        if unknown and not getattr(module, "ACCEPTS_OVERRIDES", False):
            parser.error(f"unrecognized arguments: {' '.join(unknown)}")
        args.overrides = unknown
        args.argv = rest
        return int(module.run(args) or 0)
    except BrokenPipeError:
        # the reader of our output went away (`myria ... | head`): stop quietly, as a command
        # killed by SIGPIPE does, with stdout pointed away so that its flush at exit is silent
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except MyriaError as e:
        from myria.train.launch import record_worker_error

        if not record_worker_error(str(e), e.exit_code):
            print(f"myria {name}: error: {e}", file=sys.stderr)
        return e.exit_code
    except Exception as e:
        from myria.train.launch import record_worker_error

        record_worker_error(f"{type(e).__name__}: {e} (traceback in this rank's output)", 1)
        if (line := _after_a_lost_peer(e, getattr(args, "run_dir", None))) is not None:
            print(f"myria {name}: {line}", file=sys.stderr)
            return 1
        raise
    except KeyboardInterrupt:
        # prepare keeps what it committed: the same command goes on from there
        again = "; the same command resumes it" if name == "prepare" else ""
        import os

        from myria.train.launch import QUIET_ENV

        if not os.environ.get(QUIET_ENV):   # a launcher's worker: the launcher says it
            print(f"myria {name}: interrupted{again}", file=sys.stderr)
        return 130


def _after_a_lost_peer(e: BaseException, run_dir: str | None) -> str | None:
    """One line for a worker whose collective failed because another rank was lost (killed,
    stopped, or failed first with its own error, which the launcher prints): the traceback
    goes to RUN_DIR/errors/rankN-traceback.txt instead of the console. None for any other
    error, or outside a launcher, whose traceback is printed as usual."""
    import os
    import traceback

    from myria.errors import first_line
    from myria.train.launch import PEER_LOST

    text = f"{type(e).__name__}: {e}"
    rank = os.environ.get("RANK")
    if rank is None or not run_dir or not (
            type(e).__name__ in ("DistNetworkError", "DistBackendError")
            or any(s in text for s in PEER_LOST)):
        return None
    from pathlib import Path

    path = Path(run_dir) / "errors" / f"rank{int(rank):05d}-traceback.txt"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(traceback.format_exception(e)))
    except OSError:
        return None
    first = first_line(text)
    return f"rank {rank} stopped: a collective failed after another rank was lost ({first}); " \
        f"traceback in {path}"


if __name__ == "__main__":
    raise SystemExit(main())
