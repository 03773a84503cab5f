"""The fault matrix under `myria supervise`: each fault ends bit-equal, nothing
committed is lost.

    python bench/fault_matrix.py [--recovery restart|in-job] [--nproc 2] [--steps 24]
                                 [--cases kill,hang,...] [--data DIR] [--no-prolog]

A `--nproc`-rank CPU job of the tests' tiny model (tests/conftest.py TINY), `--steps` steps,
a checkpoint every 4 (all kept), heartbeats every 0.5 s, a hang declared after 5 s, under
`myria supervise` with the diagnostics on (floors 10x below the tests', see FLOORS). Before the
cases, one `myria doctor` run (a scheduler's prolog) records a pass in the matrix's own host cache
(MYRIA_CACHE), so the supervisor's diagnostics policy (resilience.diagnostics_ttl_s) decides
per fault whether to run them; `--no-prolog` leaves no pass, so every restart runs them. Cases:

- `kill`: a worker SIGKILLed mid-run;
- `hang`: a worker stops making progress while its heartbeats go on;
- `raise`: a worker raises an exception;
- `during-recovery`: a worker is killed, then another right after the restart resumed, before
  the first redone step completes (MYRIA_FAULT `attempt=1`);
- `during-recovery-twice`: the same, and a third kill (another rank) right after the second
  restart: two attempts in a row killed before their first step;
- `two-at-once`: two ranks killed at the same step (no peer holds their state: falls back to
  the newest checkpoint on disk, on every recovery path);
- `killed-supervisor`: the `myria supervise` process is killed (-9) mid-run; its workers save
  and stop; the same command is started again and resumes;
- `killed-spare`: with `--recovery in-job` only (spares exist only there): a hot spare process
  is killed mid-run and the job goes on; skipped with a note otherwise or when the tree
  refuses `resilience.spares`.

Each case is checked against an uninterrupted supervised run of the same config: the job ends
with every step run once (metrics.jsonl), the same loss at every step, and its final
checkpoint's tensors (model and optimizer, every DCP entry) equal to the reference's bit for
bit; every checkpoint committed before the (first) fault is still there and verifies (a
thread lists committed checkpoints every 0.2 s during the run, each with the time its directory
was renamed into place); each restart resumed from the
newest checkpoint committed when it was decided. Per case: status (pass / FAIL with the
problems / skipped), wall time, and per fault its detection, the diagnostics decision, MTTR
(the fault to the first step completed after it), time lost (the fault to the step reached
before it, done again) and steps redone.

`--shrink` (with `--recovery in-job`): the same matrix on a job that shrinks instead of
replacing a lost rank (`resilience.shrink`, no hot spare, so every in-job recovery is a shrink,
grown back when the spare the supervisor then starts is ready): pure DDP (`training.data_parallel
= ddp`), at least 3 ranks, global batch 6 (3 microbatches: 2 and 1 on the 2 ranks left). Its
cases are judged within the shrink tolerance instead of bit for bit: every step's loss within
1e-4 (relative) of the reference's, the layout tests' reduction-order tolerance; the final
state's largest relative difference is reported (`state_max_rel_diff`), `bit_equal` says
whether it is exact. Writes fault_matrix_in-job-shrink.json.

`--recovery restart|in-job` passes `--resilience.recovery=...` to every job (the reference
too), so the same matrix runs on the in-job path once the tree has it; where the tree does
not know `resilience.recovery`, `restart` runs the tree's only path and `in-job` stops with a
note. Writes bench/results/fault_matrix_RECOVERY.json; the table in bench/RESULTS.md is
written by hand from it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT))

from tests.conftest import TINY  # noqa: E402

# Floors 10x below the tests' generous ones and a 5-minute limit: the matrix tests recovery, not
# the host, and this shared 2-core host at load 20 reads 0.005 TFLOP/s and needs over a minute
# (the tests' floors and the 60 s default then fail a healthy host: a false blocklisting).
FLOORS = ("gemm_tflops=0.002,membw_gbs=0.02,all_reduce_busbw_gbs=0.0005,"
          "all_to_all_busbw_gbs=0.0005,p2p_latency_max_us=1e7")
DOCTOR_TIMEOUT_S = 300
CASES = ("kill", "hang", "raise", "during-recovery", "during-recovery-twice", "two-at-once",
         "killed-supervisor", "killed-spare")


def fault_of(case: str, nproc: int, recovery: str = "restart") -> str:
    """The MYRIA_FAULT of a case (checkpoints every 4 steps: at 4, 8, 12, ...). In-job, a
    recovery resumes from peer memory at step 9 or 10 (whether the lost rank's copy of step 10
    had reached its holder), or from disk at 8 when it falls back: a fault "right after the
    resume" is then a kill at each of those steps for that attempt (each fires at most once, and
    only the one at the resumed step can: the others are past or follow the kill)."""
    last = nproc - 1
    if recovery == "in-job" and case in ("during-recovery", "during-recovery-twice"):
        def at(rank, attempt):
            return ",".join(f"kill:rank={rank}:step={s}:attempt={attempt}" for s in (8, 9, 10))
        spec = f"kill:rank={last}:step=10,{at(0, 1)}"
        return spec + (f",{at(last, 2)}" if case == "during-recovery-twice" else "")
    return {
        "kill": f"kill:rank={last}:step=9",
        "hang": "hang:rank=0:step=10",
        "raise": f"raise:rank={last}:step=7",
        # killed after 10 steps; the restart resumes from 8 and rank 0 dies before step 9
        "during-recovery": f"kill:rank={last}:step=10,kill:rank=0:step=8:attempt=1",
        # ... and again, another rank, right after the second restart
        "during-recovery-twice": f"kill:rank={last}:step=10,kill:rank=0:step=8:attempt=1,"
                                 f"kill:rank={last}:step=8:attempt=2",
        "two-at-once": f"kill:rank=0:step=10,kill:rank={last}:step=10",
    }.get(case, "")


class Env:
    """What every job of the matrix shares."""

    def __init__(self, args: argparse.Namespace, work: Path, data: Path):
        self.args, self.work, self.data = args, work, data
        self.cache = work / "cache"
        from myria.config import ResilienceConfig

        fields = ResilienceConfig.__dataclass_fields__
        self.extra = [f"--training.steps={args.steps}", "--checkpoint.interval=4",
                      "--checkpoint.keep=1000", "--resilience.heartbeat_s=0.5",
                      "--resilience.hang_timeout_s=5", "--resilience.backoff_s=0.2",
                      f"--resilience.doctor_expect={FLOORS}",
                      f"--resilience.doctor_timeout_s={DOCTOR_TIMEOUT_S}",
                      "--logging.progress=false"]
        self.note = ""
        if "recovery" in fields:
            self.extra.append(f"--resilience.recovery={args.recovery}")
            if args.recovery == "in-job" and "spares" in fields:
                self.extra.append(f"--resilience.spares={0 if args.shrink else args.spares}")
            if args.shrink:
                if args.recovery != "in-job" or "shrink" not in fields:
                    raise SystemExit("--shrink needs --recovery in-job and a tree with "
                                     "resilience.shrink")
                self.extra += ["--resilience.shrink=true", "--training.data_parallel=ddp",
                               "--training.global_batch=6"]
        elif args.recovery == "in-job":
            raise SystemExit("in-job recovery is not available in this tree (the config has no "
                             "resilience.recovery): run with --recovery restart")
        else:
            self.note = "this tree has no resilience.recovery: its only path (restart) runs"

    def env(self, fault: str = "") -> dict[str, str]:
        e = dict(os.environ, PYTHONPATH=str(ROOT / "src"), MYRIA_CACHE=str(self.cache))
        e.pop("MYRIA_FAULT", None)
        e.pop("MYRIA_DOCTOR_FAULT", None)
        if fault:
            e["MYRIA_FAULT"] = fault
        return e

    def cmd(self, run_dir: Path) -> list[str]:
        return [sys.executable, "-m", "myria", "supervise", "--run-dir", str(run_dir),
                "--nproc", str(self.args.nproc), f"--data.path={self.data}", *TINY,
                *self.extra]


class Watcher(threading.Thread):
    """Lists the committed checkpoints of a run every 0.2 s: name -> when committed."""

    def __init__(self, run_dir: Path):
        super().__init__(daemon=True)
        self.dir = run_dir / "checkpoints"
        self.seen: dict[str, float] = {}
        self.done = threading.Event()

    def run(self) -> None:
        # CheckpointManager.committed()'s rule, without a manager: constructing one in rank 0's
        # place would remove the workers' checkpoints in progress (its crash clean-up)
        while not self.done.wait(0.2):
            try:
                for p in self.dir.iterdir():
                    if p.name.startswith("step_") and p.name[5:].isdigit() and \
                            p.name not in self.seen and (p / "meta.json").exists():
                        # committed when renamed into place: the rename sets the directory's
                        # ctime (a poll on a loaded host can come 0.2 s or more later)
                        self.seen[p.name] = min(time.time(), p.stat().st_ctime)
            except OSError:
                pass

    def stop(self) -> dict[str, float]:
        self.done.set()
        self.join(timeout=5)
        return dict(self.seen)


def losses(run_dir: Path) -> dict[int, list[float]]:
    out: dict[int, list[float]] = {}
    path = run_dir / "metrics.jsonl"
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if "loss" in row:
            out.setdefault(int(row["step"]), []).append(row["loss"])
    return out


def step_times(run_dir: Path) -> list[tuple[float, int]]:
    """(time, step) of every logged training step, kept or set aside, in time order."""
    rows = []
    for name in ("metrics.jsonl", "metrics_abandoned.jsonl"):
        p = run_dir / name
        for line in p.read_text().splitlines() if p.exists() else []:
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if "loss" in row and "time" in row:
                rows.append((float(row["time"]), int(row["step"])))
    return sorted(rows)


def tensors(ckpt: Path) -> dict:
    """Every entry of a DCP checkpoint (model and optimizer), loaded without a template."""
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    flat: dict = {}

    def walk(prefix: str, x) -> None:
        if isinstance(x, dict):
            for k, v in x.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)
        elif isinstance(x, list | tuple):
            for i, v in enumerate(x):
                walk(f"{prefix}.{i}", v)
        else:
            flat[prefix] = x

    import warnings

    with warnings.catch_warnings():   # "assuming the intent is to load in a single process"
        warnings.simplefilter("ignore")
        walk("", _load_state_dict_from_keys(checkpoint_id=str(ckpt)))
    return flat


def same_state(a: Path, b: Path) -> tuple[bool, str, int]:
    """Whether two checkpoints hold the same tensors bit for bit (and the same other values)."""
    import torch

    ta, tb = tensors(a), tensors(b)
    if ta.keys() != tb.keys():
        return False, f"different entries: {sorted(ta.keys() ^ tb.keys())[:5]}", 0
    n = 0
    for k in sorted(ta):
        x, y = ta[k], tb[k]
        if isinstance(x, torch.Tensor):
            n += 1
            if not (isinstance(y, torch.Tensor) and x.dtype == y.dtype and x.shape == y.shape
                    and torch.equal(x.view(-1).view(torch.uint8) if x.numel() else x,
                                    y.view(-1).view(torch.uint8) if y.numel() else y)):
                return False, f"tensor {k} differs", n
        elif x != y:
            return False, f"{k}: {x!r} != {y!r}", n
    return True, "", n


def newest(run_dir: Path) -> Path | None:
    from myria.train.checkpoint.pipeline import CheckpointManager

    c = CheckpointManager(run_dir / "checkpoints").committed()
    return c[-1] if c else None


def run_job(env: Env, run_dir: Path, fault: str, timeout: float = 1500) -> dict:
    w = Watcher(run_dir)
    w.start()
    t0 = time.time()
    p = subprocess.run(env.cmd(run_dir), cwd=ROOT, env=env.env(fault), capture_output=True,
                       text=True, timeout=timeout)
    seen = w.stop()
    return {"rc": p.returncode, "wall_s": round(time.time() - t0, 2), "seen": seen,
            "stderr": p.stderr[-3000:]}


def killed_supervisor(env: Env, run_dir: Path, kill_after: int = 10) -> dict:
    """kill -9 the supervisor once `kill_after` steps are logged; its workers save and stop;
    the same command again resumes."""
    w = Watcher(run_dir)
    w.start()
    t0 = time.time()
    err = open(run_dir.parent / f"{run_dir.name}.sup1.err", "w")
    sup = subprocess.Popen(env.cmd(run_dir), cwd=ROOT, env=env.env(), stdout=subprocess.DEVNULL,
                           stderr=err)
    try:
        while sup.poll() is None and max(losses(run_dir) or [0]) < kill_after:
            time.sleep(0.05)
        if sup.poll() is not None:
            w.stop()
            return {"rc": sup.returncode, "wall_s": round(time.time() - t0, 2), "seen": w.seen,
                    "problem": "the job ended before the supervisor could be killed"}
        log = (run_dir / "supervisor.log").read_text()
        pids = json.loads(log.rsplit("(pids ", 1)[1].split(")")[0])
        at_step = max(losses(run_dir))
        kill_at = time.time()
        sup.send_signal(signal.SIGKILL)
        sup.wait()
    finally:
        if sup.poll() is None:
            sup.kill()
        err.close()
    while time.time() - kill_at < 120 and any(_alive(p) for p in pids):
        time.sleep(0.05)
    workers_gone_s = time.time() - kill_at
    p = subprocess.run(env.cmd(run_dir), cwd=ROOT, env=env.env(), capture_output=True,
                       text=True, timeout=1500)
    seen = w.stop()
    # MTTR: the kill to the first step completed after it by the new supervisor's workers
    after = [(t, s) for t, s in step_times(run_dir) if t > kill_at]
    stopped = max([s for t, s in step_times(run_dir) if t <= kill_at + workers_gone_s] or [0])
    second = json.loads((run_dir / "supervisor_summary.json").read_text()) \
        if (run_dir / "supervisor_summary.json").exists() else {}
    resumed = second.get("start_step")
    first_after = next(((t, s) for t, s in after
                        if resumed is None or s > resumed), None)
    reached = max(at_step, stopped)   # the old workers finish the step they are in and save
    regained = next((t for t, s in after if s >= reached and t > kill_at + workers_gone_s),
                    None)
    fault = {"kind": "supervisor killed (-9)", "ranks": [], "fault_at": kill_at,
             "last_step": reached, "logged_at_kill": at_step, "stopped_step": stopped,
             "resumed_from": resumed,
             "workers_gone_s": round(workers_gone_s, 2),
             "mttr_s": round(first_after[0] - kill_at, 2) if first_after else None,
             "time_lost_s": round(regained - kill_at, 2) if regained else None,
             "lost_steps": (reached - resumed) if resumed is not None else None,
             "decision": "none: the supervisor itself died; the command was started again"}
    return {"rc": p.returncode, "wall_s": round(time.time() - t0, 2), "seen": seen,
            "stderr": p.stderr[-3000:], "faults": [fault], "fault_at": kill_at}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return "Z" not in open(f"/proc/{pid}/stat").read().split(")")[1].split()[0]
    except (ProcessLookupError, OSError):
        return False


def killed_spare(env: Env, run_dir: Path, kill_after: int = 6) -> dict:
    """In-job recovery only: kill -9 a hot spare (a descendant of the supervisor whose command
    line or environment names it a spare) mid-run; the job must go on and end bit-equal."""
    w = Watcher(run_dir)
    w.start()
    t0 = time.time()
    sup = subprocess.Popen(env.cmd(run_dir), cwd=ROOT, env=env.env(), stdout=subprocess.DEVNULL,
                           stderr=subprocess.PIPE, text=True)
    killed = None
    while sup.poll() is None and killed is None:
        if max(losses(run_dir) or [0]) >= kill_after:
            for pid in _descendants(sup.pid):
                if _is_spare(pid):
                    os.kill(pid, signal.SIGKILL)
                    killed = (pid, time.time())
                    break
            else:
                break
        time.sleep(0.1)
    _, err = sup.communicate(timeout=1500)
    seen = w.stop()
    out = {"rc": sup.returncode, "wall_s": round(time.time() - t0, 2), "seen": seen,
           "stderr": err[-3000:]}
    if killed is None:
        out["skipped"] = "no spare process found under the supervisor"
    else:
        out["fault_at"] = killed[1]
        out["spare_pid"] = killed[0]
    return out


def _descendants(pid: int) -> list[int]:
    kids: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().split(")")[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            kids.setdefault(ppid, []).append(int(d.name))
    out, todo = [], [pid]
    while todo:
        for c in kids.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def _is_spare(pid: int) -> bool:
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return False
    # the spare's module, not the word: every worker's command line has --resilience.spares=N
    return "myria.train.spare" in cmd or any(e.startswith(b"MYRIA_SPARE=") for e in environ)


SHRINK_RTOL = 1e-4   # the layout tests' reduction-order tolerance (tests/parallel/test_layouts)


def max_rel_diff(a: Path, b: Path) -> float:
    """The largest |x - y| / max|y| over the floating tensors of two checkpoints."""
    import torch

    ta, tb = tensors(a), tensors(b)
    worst = 0.0
    for k, x in ta.items():
        y = tb.get(k)
        if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and \
                x.is_floating_point() and x.shape == y.shape and x.numel():
            scale = float(y.abs().max()) or 1.0
            worst = max(worst, float((x.double() - y.double()).abs().max()) / scale)
    return worst


def check_case(name: str, run_dir: Path, ref: Path, job: dict, steps: int,
               shrink: bool = False) -> dict:
    """Every promise of the matrix for one finished case; returns its record (`shrink`:
    losses within SHRINK_RTOL instead of equal, the final state's difference reported)."""
    from myria.train.checkpoint.pipeline import CheckpointManager

    problems = []
    if job["rc"] != 0:
        problems.append(f"exit status {job['rc']}: {job.get('stderr', '')[-400:]}")
    path = run_dir / "supervisor_summary.json"
    summary = json.loads(path.read_text()) if path.exists() else {}
    faults = job.get("faults") or [
        {k: f.get(k) for k in ("kind", "ranks", "attempt", "last_step", "resumed_from",
                               "newest_committed", "detection_s", "fault_to_first_step_s",
                               "time_lost_s", "lost_steps", "decision", "diagnostics",
                               "recovery_phases", "fault_at", "injected", "recovery")}
        for f in summary.get("faults", [])]
    for f in faults:
        f.setdefault("mttr_s", f.get("fault_to_first_step_s"))
    if summary.get("status") != "succeeded" or summary.get("final_step") != steps:
        problems.append(f"status {summary.get('status')} at step {summary.get('final_step')}")
    got, want = losses(run_dir), losses(ref)
    if sorted(got) != list(range(1, steps + 1)) or any(len(v) != 1 for v in got.values()):
        problems.append(f"steps logged: {sorted(got)} (counts {[len(v) for v in got.values()]})")
    if shrink:
        diff = [s for s in range(1, steps + 1) if not got.get(s) or not want.get(s) or
                abs(got[s][-1] - want[s][-1]) > SHRINK_RTOL * abs(want[s][-1])]
    else:
        diff = [s for s in range(1, steps + 1) if got.get(s) != want.get(s)]
    if diff:
        problems.append(f"losses differ at steps {diff[:6]}")
    a, b = newest(run_dir), newest(ref)
    bit_equal, n, state_diff = False, 0, None
    if a is None or b is None or a.name != b.name:
        problems.append(f"final checkpoint {a and a.name} vs reference {b and b.name}")
    else:
        bit_equal, why, n = same_state(a, b)
        if shrink:
            state_diff = 0.0 if bit_equal else max_rel_diff(a, b)
        elif not bit_equal:
            problems.append(f"final state not bit-equal: {why}")
    # nothing committed was lost
    fault_at = job.get("fault_at") or min([f.get("fault_at") or 1e18 for f in faults] + [1e18])
    mgr = CheckpointManager(run_dir / "checkpoints")
    before = sorted(k for k, t in job["seen"].items() if t < fault_at)
    for ckpt in before:
        p = run_dir / "checkpoints" / ckpt
        if not p.is_dir():
            problems.append(f"{ckpt}, committed before the fault, is gone")
        elif (why := mgr.verify(p)) is not None:
            problems.append(f"{ckpt}, committed before the fault, does not verify: {why}")
    for f in faults:
        # a restart resumes from the newest committed checkpoint; an in-job recovery from
        # peer memory, at a step never older than it (older would lose committed work)
        nc = f.get("newest_committed")
        r = f.get("resumed_from")
        if nc and r is not None and (r < int(nc.split("_")[1]) or (
                r != int(nc.split("_")[1]) and
                not str(f.get("recovery") or "restart").startswith("in-job"))):
            problems.append(f"resumed from {r}, newest committed was {nc}"
                            f" ({f.get('recovery') or 'restart'})")
    # the case as a whole (several faults: the first fault to the end of the last recovery)
    rows = step_times(run_dir)
    first = next((t for t, _ in rows if t > fault_at), None)
    reached = faults[0].get("last_step") if faults else None
    regained = next((t for t, s in rows if t > fault_at and reached is not None and
                     s >= reached), None)
    return {"case": name, "status": "FAIL" if problems else "pass", "problems": problems,
            "wall_s": job["wall_s"], "restarts": summary.get("restarts"),
            "mttr_s": faults[0].get("mttr_s") if len(faults) == 1 else
            round(first - fault_at, 2) if first and fault_at < 1e18 else None,
            "time_lost_s": faults[0].get("time_lost_s") if len(faults) == 1 else
            round(regained - fault_at, 2) if regained else None,
            "bit_equal": bit_equal, "tensors_compared": n, "state_max_rel_diff": state_diff,
            "resizes": summary.get("resizes", []),
            "committed_before_fault": before, "faults": faults}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recovery", choices=("restart", "in-job"), default="restart")
    ap.add_argument("--spares", type=int, default=1, help="resilience.spares under in-job")
    ap.add_argument("--shrink", action="store_true",
                    help="in-job with resilience.shrink on a DDP job (nproc >= 3, no spare)")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--data", default="", help="prepared tiny data (default: prepare it)")
    ap.add_argument("--no-prolog", action="store_true",
                    help="no `myria doctor` pass before the cases: every restart diagnoses")
    ap.add_argument("--keep", action="store_true", help="keep the run directories")
    args = ap.parse_args()
    if args.shrink:
        args.nproc = max(3, args.nproc)
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    if bad := [c for c in cases if c not in CASES]:
        raise SystemExit(f"--cases: unknown {bad}; valid: {', '.join(CASES)}")
    work = Path(tempfile.mkdtemp(prefix="fault-matrix-"))
    data = Path(args.data) if args.data else work / "data"
    env = Env(args, work, data)
    env.cache.mkdir()
    home = Path.home() / ".cache" / "myria" / "machine_figures.json"
    if home.exists():   # the host's measured figures, not its doctor reports
        shutil.copy(home, env.cache)
    if not args.data:
        subprocess.run([sys.executable, "-m", "myria", "prepare", "--corpus", "demo",
                        "--max-docs", "20", "--vocab-size", "1024", "--out", str(data),
                        "--quiet"], cwd=ROOT, check=True, env=env.env())
    prolog = None
    if not args.no_prolog:
        t = time.time()
        p = subprocess.run([sys.executable, "-m", "myria", "doctor", "--nproc", str(args.nproc),
                            "--timeout", str(DOCTOR_TIMEOUT_S), "--json", str(work / "prolog.json"),
                            *[a for kv in FLOORS.split(",") for a in ("--expect", kv)]],
                           cwd=ROOT, env=env.env(), capture_output=True, text=True, timeout=900)
        summary = json.loads((work / "prolog.json").read_text())["summary"] \
            if (work / "prolog.json").exists() else p.stderr[-300:]
        prolog = {"rc": p.returncode, "s": round(time.time() - t, 1), "summary": summary}
        print(f"prolog: myria doctor exit {p.returncode} in {prolog['s']} s: {summary[:300]}",
              flush=True)
        (env.cache / "doctor").mkdir(exist_ok=True)   # where the supervisor looks for a pass
        if (work / "prolog.json").exists():
            shutil.copy(work / "prolog.json", env.cache / "doctor" /
                        f"{json.loads((work / 'prolog.json').read_text())['host']}-prolog.json")
    t = time.time()
    ref = work / "reference"
    r = run_job(env, ref, "")
    if r["rc"] != 0:
        raise SystemExit(f"the reference run failed ({r['rc']}):\n{r['stderr']}")
    print(f"reference: {r['wall_s']} s", flush=True)
    results = []
    for case in cases:
        run_dir = work / case
        if case == "killed-spare":
            if args.recovery != "in-job":
                results.append({"case": case, "status": "skipped",
                                "note": "spares exist only under --recovery in-job"})
                print(f"{case}: skipped", flush=True)
                continue
            job = killed_spare(env, run_dir)
            if "skipped" in job:
                results.append({"case": case, "status": "skipped", "note": job["skipped"],
                                "rc": job["rc"]})
                continue
        elif case == "killed-supervisor":
            job = killed_supervisor(env, run_dir)
        else:
            job = run_job(env, run_dir, fault_of(case, args.nproc, args.recovery))
        rec = check_case(case, run_dir, ref, job, args.steps, args.shrink)
        rec["fault"] = fault_of(case, args.nproc, args.recovery) or case
        results.append(rec)
        fs = "; ".join(f"{f.get('kind')} {f.get('ranks')}: MTTR {f.get('mttr_s')} s, lost "
                       f"{f.get('time_lost_s')} s, {f.get('lost_steps')} steps redone, "
                       f"diagnostics {str(f.get('decision'))[:40]}" for f in rec["faults"])
        print(f"{case}: {rec['status']} in {rec['wall_s']} s ({fs})"
              + (f" PROBLEMS: {rec['problems']}" if rec["problems"] else ""), flush=True)
    out = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "machine": f"{platform.machine()}, {os.cpu_count()} CPUs (shared), torch CPU",
           "command": " ".join(["python", *sys.argv]), "recovery": args.recovery,
           "shrink": args.shrink,
           "note": env.note, "nproc": args.nproc, "steps": args.steps,
           "config": [*TINY, *env.extra], "prolog": prolog, "reference_wall_s": r["wall_s"],
           "total_s": round(time.time() - t, 1), "cases": results}
    (ROOT / "bench" / "results").mkdir(exist_ok=True)
    path = ROOT / "bench" / "results" / \
        f"fault_matrix_{args.recovery}{'-shrink' if args.shrink else ''}.json"
    path.write_text(json.dumps(out, indent=1, default=str))
    print(f"wrote {path}")
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    else:
        print(f"run directories kept in {work}")
    sys.exit(0 if all(c["status"] != "FAIL" for c in results) else 1)


if __name__ == "__main__":
    main()
