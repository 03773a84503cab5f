"""Fault hooks for tests and benchmarks, inert unless the MYRIA_FAULT environment variable is set.

MYRIA_FAULT holds comma-separated faults, each `kind:key=value:...`, kind one of `kill`, `hang`,
`stop`, `raise`, `busy` (`seconds=T`), `corrupt-checkpoint`, `diskfull`, `offload-kill`,
`offload-diskfull`, `slow`, `bitflip` (`target=param|grad|optimizer|compute|wgrad|peer`,
`sticky=yes`) and `nan` (`sticky=yes`). Each fault fires once per run directory (a marker file
under RUN_DIR/faults/), so a restarted job does not repeat it; `:attempt=A` limits it to the
job's attempt A (`rundir.job_attempt`: 0 the first start, then each restart or in-job
recovery; in a multi-host job the rendezvous round, or the in-job attempt joined in it).
Checkpoint and offload hooks act on console step S; `kill`, `hang`, `stop`, `raise`, `busy`,
`bitflip` and `nan` fire once S steps are done (during console step S+1); `slow` applies from
console step S on. A malformed MYRIA_FAULT is a FaultSpecError (a ConfigError): one line, exit
status 2, checked by the supervisor before it starts any worker. Every kind and its effect:
docs/robustness.md, "The fault grammar in full".
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from myria import rundir
from myria.errors import ConfigError

KINDS = ("kill", "hang", "stop", "raise", "busy", "corrupt-checkpoint", "diskfull", "slow",
         "bitflip", "nan", "offload-kill", "offload-diskfull")
FLOAT_KEYS = ("factor", "seconds")   # parameters that take a number, not an integer
# parameters that take one of a few words
WORD_KEYS = {"target": ("param", "grad", "optimizer", "compute", "wgrad", "peer"),
             "sticky": ("yes", "no")}


class FaultSpecError(ConfigError, ValueError):
    """MYRIA_FAULT does not parse (also a ValueError, as it always was)."""


@dataclass
class Fault:
    kind: str
    params: dict = field(default_factory=dict)

    @property
    def tag(self) -> str:
        return self.kind + "".join(f"_{k}{v}" for k, v in sorted(self.params.items()))

    def matches(self, kind: str, step: int, rank: int | None = None,
                attempt: int | None = None) -> bool:
        if self.kind != kind or self.params.get("step") != step:
            return False
        if attempt is not None and self.params.get("attempt", attempt) != attempt:
            return False
        return "rank" not in self.params or rank is None or self.params["rank"] == rank


def items(text: str | None, kinds: tuple[str, ...],
          unknown: Callable[[str, str], Exception]) -> list[tuple[str, str, list[str]]]:
    """The grammar of the fault hooks (MYRIA_FAULT, MYRIA_DOCTOR_FAULT): comma-separated items,
    each `kind[:key=value]...`; (item, kind, its `key=value` parts) for each, and
    `unknown(item, kind)` raised for a kind not in `kinds`. Each hook judges its own keys."""
    out = []
    for item in (text or "").split(","):
        item = item.strip()
        if not item:
            continue
        kind, *kvs = item.split(":")
        if kind not in kinds:
            raise unknown(item, kind)
        out.append((item, kind, kvs))
    return out


def parse(text: str | None) -> list[Fault]:
    """Parse MYRIA_FAULT; raises FaultSpecError naming the bad item and what is valid."""
    faults = []
    for item, kind, kvs in items(text, KINDS, lambda item, kind: FaultSpecError(
            f"MYRIA_FAULT item {item!r}: unknown fault {kind!r}; valid: {', '.join(KINDS)}")):
        params: dict = {}
        for kv in kvs:
            k, _, v = kv.partition("=")
            if k in WORD_KEYS:
                if v not in WORD_KEYS[k]:
                    raise FaultSpecError(f"MYRIA_FAULT item {item!r}: {k} must be one of "
                                         f"{', '.join(WORD_KEYS[k])}")
                params[k] = v
                continue
            if k in FLOAT_KEYS:
                try:
                    params[k] = float(v)
                except ValueError:
                    raise FaultSpecError(f"MYRIA_FAULT item {item!r}: {k}={v!r} is not a "
                                         "number") from None
                continue
            if k not in ("rank", "step", "attempt"):
                raise FaultSpecError(f"MYRIA_FAULT item {item!r}: unknown parameter {k!r}; "
                                     "valid: rank=N, step=N, attempt=N, factor=F (slow), "
                                     "seconds=T (busy), "
                                     "target=param|grad|optimizer|compute|wgrad|peer (bitflip), "
                                     "sticky=yes|no (nan, bitflip)")
            if not v.lstrip("-").isdigit():
                raise FaultSpecError(f"MYRIA_FAULT item {item!r}: {k}={v!r} is not an integer "
                                     f"(expected {k}=N)")
            params[k] = int(v)
        if kind == "slow":
            if "rank" not in params or params.get("factor", 0) < 1:
                raise FaultSpecError(f"MYRIA_FAULT item {item!r}: slow needs rank=R and "
                                     "factor=F >= 1")
            params.setdefault("step", 1)
        if "step" not in params:
            raise FaultSpecError(f"MYRIA_FAULT item {item!r}: step=N is required")
        if kind == "busy" and params.get("seconds", 0) <= 0:
            raise FaultSpecError(f"MYRIA_FAULT item {item!r}: busy needs seconds=T > 0")
        if kind in ("bitflip", "nan") and "rank" not in params:
            raise FaultSpecError(f"MYRIA_FAULT item {item!r}: {kind} needs rank=R")
        if kind == "bitflip":
            params.setdefault("target", "param")
        faults.append(Fault(kind, params))
    return faults


# kinds that fire once S steps are done (during console step S+1): S < training.steps
AFTER_STEP = ("kill", "hang", "stop", "raise", "busy", "bitflip", "nan")


def unreachable(text: str | None, steps: int, world: int, run_dir: str | Path) -> list[str]:
    """Why each MYRIA_FAULT item cannot fire in a job of `world` ranks that trains to step
    `steps` on `run_dir` (its rank is not in the job, its step is past the run's end, or it
    fired in this run directory before: each fires once per run directory); one line each."""
    out = []
    parse(text)   # a bad item: the error names it and what is valid
    for item, _, _ in items(text, KINDS, lambda item, kind: FaultSpecError(item)):
        (f,) = parse(item)
        step, rank = f.params["step"], f.params.get("rank")
        last = steps - 1 if f.kind in AFTER_STEP else steps
        if rank is not None and not 0 <= rank < world:
            why = f"rank={rank}, and the job has {world} rank(s), 0 to {world - 1}"
        elif step > last:
            why = (f"step={step}, and the run ends at step {steps}" +
                   (" (it fires once that many steps are done, before the next)"
                    if f.kind in AFTER_STEP else ""))
        elif f.kind != "slow" and (marker := Path(run_dir) / rundir.FAULTS / f.tag).exists():
            why = f"it fired in this run directory before ({marker}; once per run directory)"
        else:
            continue
        out.append(f"note: MYRIA_FAULT item {item!r} will not fire: {why}")
    return out


class FaultInjector:
    """Fires the configured faults once per run directory."""

    def __init__(self, run_dir: str | Path, rank: int, text: str | None = None):
        self.faults = parse(os.environ.get("MYRIA_FAULT") if text is None else text)
        self.dir = Path(run_dir) / rundir.FAULTS
        self.rank = rank
        self.attempt = rundir.job_attempt()

    def due(self, kind: str, step: int) -> Fault | None:
        """The fault of `kind` due at `step` on this rank that has not fired yet, if any."""
        for f in self.faults:
            if f.matches(kind, step, self.rank, self.attempt) and \
                    not (self.dir / f.tag).exists():
                return f
        return None

    def slow(self) -> tuple[float, int] | None:
        """(factor, from step) when this rank is to be slowed (not once: from then on)."""
        for f in self.faults:
            if f.kind == "slow" and f.params.get("rank") == self.rank and \
                    f.params.get("attempt", self.attempt) == self.attempt:
                return float(f.params["factor"]), int(f.params["step"])
        return None

    def mark(self, fault: Fault) -> None:
        """Record that `fault` fired (before acting, so a killed process does not repeat it)."""
        self.dir.mkdir(parents=True, exist_ok=True)
        p = self.dir / fault.tag
        with open(p, "w") as fh:
            fh.write(f"fired by rank {self.rank}\n")
            fh.flush()
            os.fsync(fh.fileno())

    def at_step_start(self, step: int) -> None:
        """Apply process faults (kill, hang, raise) due at the start of `step`."""
        if not self.faults:
            return
        import signal
        import time

        if f := self.due("kill", step):
            self.mark(f)
            os.kill(os.getpid(), signal.SIGKILL)
        if f := self.due("stop", step):
            self.mark(f)
            os.kill(os.getpid(), signal.SIGSTOP)
        if f := self.due("hang", step):
            self.mark(f)
            while True:  # alive but making no progress
                time.sleep(3600)
        if f := self.due("busy", step):
            self.mark(f)
            hold_gil(f.params["seconds"])
        if f := self.due("raise", step):
            self.mark(f)
            raise RuntimeError(f"injected fault: raise on rank {self.rank} at step {step} "
                               f"(after {step} steps, before console step {step + 1})")


def hold_gil(seconds: float) -> None:
    """Compute for about `seconds` inside one C call that keeps the GIL, so no other thread of
    the process runs meanwhile (its heartbeat thread included), as a long call into an
    extension or a starved process does: the builtin `sum` over a `range`, sized by a short
    timing of the same call (one call: the interpreter hands the GIL over only between calls)."""
    import time

    t = time.perf_counter()
    sum(range(1_000_000))
    sum(range(int(seconds * 1_000_000 / max(1e-9, time.perf_counter() - t))))
