"""What the supervisor does about a fault: the faults it records (`Fault`), the stops a restart
cannot fix (one `Stop` subclass per row: status, exit code, action), what makes two failures
the same, and the host's diagnostics and blocklist after a fault."""

from __future__ import annotations

import logging
import os
import re
import shlex
import subprocess
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from myria import rundir
from myria.errors import ConfigError
from myria.fsutil import atomic_write
from myria.resilience.multihost import STOPPED

log = logging.getLogger("myria.supervisor")

EXIT_BAD_HOST = 3
EXIT_PREEMPTED = 143
SAVE_FAILED = 4  # checkpoint.pipeline.SaveError.exit_code (not imported: torch-free here)


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
    # hosts of the job's round the job went on without after this fault (lost or cut off):
    # the host that found the fault is the summary part's, which is not the one that failed
    hosts_lost: list[str] = field(default_factory=list)
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


class Stop(Exception):
    """A fault a restart cannot fix. Each subclass is one row of the policy: the job's status
    in the summary, the supervisor's exit status, and the action its log names."""

    status, code, action = "failed", 1, "stop"


class BadHost(Stop):
    """This host failed its diagnostics (or keeps corrupting data) and leaves the job."""

    status, code, action = "host-blocklisted", EXIT_BAD_HOST, "leave the job"


class UserError(Stop):
    """A rank failed with an error of the user's input (exit 2)."""

    status, code = "input-error", 2
    action = "stop without restarting (a restart cannot fix bad input)"


class SaveFailed(Stop):
    """Checkpoints could not be saved (exit 4, a full disk): a restart would redo unsaved work."""

    status, code = "checkpoint-failed", SAVE_FAILED
    action = "stop without restarting (the work would not be saved)"


class TimeUp(Stop):
    """The job's wall-time limit would pass before restarted workers could train a step: the
    job ends as the limit would end it (status `stopped`, exit 0: the same command resumes from
    the newest committed checkpoint) instead of spending its last minutes on a start-up."""

    status, code = STOPPED, 0
    action = "stop without restarting"


def check_time_to_restart(limit_s: float, job_start: float, wait_s: float,
                          startup_s: float) -> None:
    """Raise `TimeUp` when the job's wall-time limit (`training.max_time_s`, 0: none, counted
    from `job_start`) leaves less than the back-off `wait_s` and a start-up to the first step
    (`startup_s`: the longest this job measured, 0 before any)."""
    if not limit_s:
        return
    left = job_start + limit_s - time.time()
    if left < wait_s + startup_s:
        raise TimeUp(f"the wall-time limit (training.max_time_s = {limit_s:g} s) leaves "
                     f"{max(0.0, left):.1f} s, less than the back-off ({wait_s:.1f} s) and a "
                     f"start-up to the first step ({startup_s:.1f} s, the longest in this job); "
                     "the same command resumes from the newest committed checkpoint")


class StartupError(Stop):
    """The same error ended two attempts in a row before their first step: deterministic."""

    status, code, action = "startup-error", 1, "stop without restarting"


def signature(exitcode: int, cause: str) -> str:
    """What makes two failures the same: the exit code and the message with its numbers (pids,
    ports, times, addresses) masked."""
    return f"{exitcode}:" + re.sub(r"0x[0-9a-fA-F]+|\d+", "#", cause or "")


def doctor_fault_once(run_dir: Path, spec: str) -> str:
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


def diagnose(sup, f: Fault) -> None:
    """After fault `f`: run this host's self-check diagnostics (or skip them, saying why), record
    the verdict, keep a slow host without a spare, else blocklist it (BadHost when it leaves)."""
    from myria.resilience.checks.hooks import host_fault
    from myria.resilience.decision import decide_for_supervisor
    from myria.resilience.diagnostics import FAULT_ENV, run_diagnostics

    spec = doctor_fault_once(sup.run_dir, os.environ.get(FAULT_ENV, "") or host_fault())
    d = decide_for_supervisor(sup.run_dir, sup.host, sup.nproc, f.to_dict(),
                              [x.to_dict() for x in sup.faults if x is not f],
                              sup.r.diagnostics_ttl_s,
                              sup.watch.started if sup.watch else 0.0, hook=bool(spec))
    f.decision = d.reason
    log.info("DECISION diagnostics %s", d.reason)
    if not d.run:
        f.action.append(f"diagnostics {d.reason.split(' (')[0]}")
        return
    log.info("ACTION sup-check diagnostics of %s (%d local ranks)%s", sup.host,
             sup.nproc, f" with test hook {FAULT_ENV}={spec}" if spec else "")
    # this host's own checks only: after a fault the other hosts are restarting, lost or
    # in their own diagnostics, so a neighbour check would wait for them and blame this one
    report = run_diagnostics(sup.nproc, sup.expect or None, sup.r.doctor_timeout_s,
                             faults=spec, peer_hosts=[sup.host])
    out = report.write_json(sup.run_dir / rundir.DIAGNOSTICS_DIR /
                            f"{sup.host}-attempt{sup.attempt}.json")
    if not spec:   # the host's record (as `myria doctor`'s): every run directory reuses it
        from myria.resilience.diagnostics import default_report_path

        try:
            report.write_json(default_report_path(sup.host))
        except OSError as e:
            log.warning("diagnostics not recorded in the host cache: %s", e)
    f.diagnostics.append(report.summary)
    f.action.append(f"diagnostics: {'pass' if report.passed else 'FAIL'}")
    log.info("diagnostics %s (report %s)", report.summary, out)
    keep = report.performance_only and sup.max_nodes <= sup.min_nodes
    if report.warnings or not report.passed:
        from myria import detections

        detections.record(sup.run_dir, "health", None, sup.host, f.last_step,
                          {"summary": report.summary, "report": str(out),
                           "checks": [c.to_dict() for c in report.failures +
                                      report.warnings]},
                          "passed with warnings, no action" if report.passed else
                          "restart on it: no spare host" if keep else "blocklist")
    if report.passed:
        return
    if keep:
        # Our own throughput measurement alone never ends a job: with no spare host the
        # choice is this host or nothing.
        log.warning("ACTION %s measured below its expected throughput (%s); no spare host "
                    "to replace it with: restarting on it (evidence in %s)", sup.host,
                    "; ".join(c.reason for c in report.failures), out)
        f.action.append("slow host kept: no spare host")
        return
    blocklist(sup, f, report.summary)
    if sup.r.bad_host_action == "exit":
        raise BadHost(f"{sup.host} failed its diagnostics and is blocklisted")
    log.info("ACTION re-run the diagnostics after the blocklist hook (bad_host_action = "
             "recheck)")
    again = run_diagnostics(sup.nproc, sup.expect or None, sup.r.doctor_timeout_s,
                            faults="", peer_hosts=[sup.host])
    again.write_json(sup.run_dir / rundir.DIAGNOSTICS_DIR /
                     f"{sup.host}-attempt{sup.attempt}-recheck.json")
    f.diagnostics.append(again.summary)
    f.action.append(f"diagnostics re-run: {'pass' if again.passed else 'FAIL'}")
    log.info("diagnostics re-run: %s", again.summary)
    if not again.passed:
        raise BadHost(f"{sup.host} failed its diagnostics again")

def blocklist(sup, f: Fault, reason: str) -> None:
    """Put this host on RUN_DIR's blocklist and hand it to `resilience.blocklist_hook`."""
    path = sup.run_dir / rundir.BLOCKLIST
    hosts = set(path.read_text().split()) if path.exists() else set()
    hosts.add(sup.host)
    atomic_write(path, "".join(h + "\n" for h in sorted(hosts)))
    sup.blocklist = sorted(hosts)
    f.action.append(f"blocklist {sup.host}")
    log.warning("ACTION blocklist host %s (%s); blocklist: %s", sup.host, reason, path)
    hook = sup.r.blocklist_hook
    if not hook:
        return
    cmd = hook.replace("{host}", shlex.quote(sup.host)).replace(
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
