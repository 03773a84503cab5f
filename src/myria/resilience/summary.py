"""The supervisor's summary of a job (RUN_DIR/supervisor_summary.json and its log lines), and
the run directory's records it is built from: metrics rows, the workers' silent-corruption
verdicts, the newest committed checkpoint, the fault hooks that fired and what detected them."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from myria import rundir
from myria.observe import goodput

log = logging.getLogger("myria.supervisor")


def build(sup, status: str) -> dict[str, Any]:
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
    wall = end - sup.started_at
    rows = metrics_rows(sup.run_dir, sup.started_at)
    final = max(rows) if rows else sup.max_step
    start = sup.initial_step if sup.initial_step is not None else (
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
    for f in sup.faults:
        d = f.to_dict()
        d["recovery_phases"] = goodput.breakdown(d, goodput.read_marks(sup.run_dir,
                                                                       f.attempt + 1))
        faults.append(d)
    ledger = goodput.summarize(sup.run_dir, sup.started_at, end, faults,
                               [{"first_step": s.first_step,
                                 "cost_s_per_step": s.cost_s_per_step}
                                for s in sup.stragglers.values()])
    kept = productive  # the step-time measure; the ledger's when it has rows
    from myria.train.checkpoint.store import step_of

    newest = newest_committed(sup.run_dir)
    target = sup.cfg.training.steps
    if status == "succeeded" and max(final, step_of(newest)) < target:
        from myria.resilience.multihost import STOPPED

        status = STOPPED
    if ledger["seconds"]["productive"] > 0:
        productive, ettr_ledger = ledger["seconds"]["productive"], ledger["ettr"]
    else:
        ettr_ledger = ettr
    return {
        "status": status, "host": sup.host, "job": sup.job,
        "started_at": round(sup.started_at, 3),
        "target_steps": target, "start_step": max(0, start),
        "final_step": final, "steps_trained": steps,
        "restarts": sum(1 for f in sup.faults if f.restarted_at),
        "attempts": sup.attempt,   # after the first: restarts, in-job shrinks and grows
        "wall_s": round(wall, 3), "productive_s": round(productive, 3),
        "mean_step_s": round(kept / steps, 4) if steps else 0.0,
        "effective_training_time_ratio": round(ettr_ledger, 4),
        "step_time_ratio": round(ettr, 4),
        "time_lost_s": round(wall - productive, 3),
        "newest_checkpoint": newest,
        "faults": faults, "blocklist": sup.blocklist, "goodput": ledger,
        # a hook that fired before this host ran workers (on another host of the job, while
        # this one waited as a spare) was not this host's to detect
        "undetected_hooks": undetected(sup.run_dir, sup.workers_since or float("inf"),
                                        {f.injected for f in sup.faults}),
        "heartbeat_s": sup.r.heartbeat_s, "store": sup.r.store,
        **({"ranks": sup.ranks, "members": sup.members} if sup.max_nodes > 1 else {}),
        **({"resizes": sup.injob.resizes} if sup.injob and sup.injob.resizes else {}),
    }

def attempts_line(s: dict[str, Any]) -> str:
    """The attempts after the first, counted as the log numbers them (each uses one of
    resilience.max_restarts), by what each was: "2 attempt(s) after the first (1 shrink,
    1 grow)"; "no restart" when there was none."""
    kinds = {"restart": 0, "in-job recovery": 0, "shrink": 0, "grow": 0}
    for f in s["faults"]:
        if f.get("restarted_at"):
            how = f.get("recovery") or "restart"
            kinds["shrink" if how == "in-job: shrink" else
                  "in-job recovery" if how.startswith("in-job") else "restart"] += 1
    kinds["grow"] = sum(1 for r in s.get("resizes", []) if r["kind"] == "grow")
    # a multi-host job restarted by a new rendezvous round counts no attempt of its own
    # supervisor: its faults' restarts count
    n = max(s["attempts"], s.get("restarts", 0))
    if not n:
        return "no restart"
    parts = ", ".join(f"{n} {k}" for k, n in kinds.items() if n)
    return f"{n} attempt(s) after the first" + (f" ({parts})" if parts else "")


def write(sup, s: dict[str, Any]) -> None:
    """Write summary `s` (one file for the job: each host's part merged) and log it. The
    newest job's summary is RUN_DIR/supervisor_summary.json; every job's is also kept under
    its id (`rundir.write_job_summary`), so a later job on the same run directory does not
    erase an earlier one's faults and ledger from the report."""
    path = sup.run_dir / rundir.SUPERVISOR_SUMMARY
    if sup.max_nodes > 1:   # one summary of the job, every host's part in it
        from myria.resilience.multihost import write_part_and_merge

        path = write_part_and_merge(sup.run_dir, s)
    else:
        rundir.write_job_summary(sup.run_dir, s)
    log.info("summary: %s at step %s/%s after %s; wall %.1f s, training %.1f s, effective "
             "training time ratio %s; %s", s["status"], s["final_step"], s["target_steps"],
             attempts_line(s), s["wall_s"], s["productive_s"],
             s["effective_training_time_ratio"], path)
    for f in s["faults"]:
        back = (f"fault to first resumed step {f['fault_to_first_step_s']} s; lost steps "
                f"{f['lost_steps']}") if f["fault_to_first_step_s"] is not None else \
            "training did not resume after it"
        lost = f" (host(s) {', '.join(f['hosts_lost'])} lost)" if f.get("hosts_lost") else ""
        log.info("  fault %s rank(s) %s after step %s%s: cause %s; detected in %.2f s; actions: "
                 "%s; %s", f["kind"], f["ranks"], f["last_step"], lost, f["cause"],
                 f["detection_s"], ", ".join(f["action"]) or "-", back)
        if f.get("recovery_phases"):
            log.info("    recovery phases (s): %s", ", ".join(
                f"{k} {v:.2f}" for k, v in f["recovery_phases"].items()))
    for name in s.get("undetected_hooks", []):
        log.warning("fault hook %s fired (MYRIA_FAULT) and no check detected it: its "
                    "effect, if any, was trained in%s", name,
                    " (the compute check recomputes one microbatch every "
                    "resilience.sdc_interval steps: a step between two checks is not "
                    "recomputed)" if "targetcompute" in name or "targetwgrad" in name else "")
    g = s["goodput"]
    log.info("goodput ledger: ETTR %.4f; %s; accounted %.1f of %.1f s", g["ettr"],
             ", ".join(f"{k} {v:.1f}" for k, v in g["seconds"].items() if v),
             g["accounted_s"], g["wall_s"])


def metrics_rows(run_dir: Path, since: float) -> dict[int, dict]:
    """The last logged row of each training step written since `since`."""
    out: dict[int, dict] = {}
    for row in rundir.read_jsonl(run_dir / rundir.METRICS):
        if "loss" in row and row.get("time", 0) >= since:
            out[int(row["step"])] = row
    return out


def sdc_verdict(run_dir: Path, since: float) -> dict | None:
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


def newest_committed(run_dir: Path) -> str:
    from myria.train.checkpoint.store import CheckpointStore

    store = CheckpointStore(run_dir / rundir.CHECKPOINTS)
    if store.dir.is_dir():
        store.remove_stale_tmp()   # saves whose writer is gone
    ckpts = store.committed()
    return ckpts[-1].name if ckpts else ""


def injected(run_dir: Path, since: float) -> tuple[str, float]:
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


def undetected(run_dir: Path, since: float, detected: set[str]) -> list[str]:
    """The MYRIA_FAULT hooks that fired since `since` and that nothing detected: no fault of
    the supervisor is attributed to them and no worker recorded a detection after them. A
    delay (`busy`, `slow`) changes no value, so it has nothing to be trained in: not listed."""
    from myria import detections

    d = run_dir / rundir.FAULTS
    if not d.is_dir():
        return []
    seen = [float(r.get("time") or 0) for r in detections.read(run_dir)]
    out = []
    for p in d.iterdir():
        if not p.is_file() or p.name.startswith(("doctor", "busy", "slow")) or \
                p.name in detected:
            continue
        at = p.stat().st_mtime
        if at >= since and not any(t >= at for t in seen):
            out.append(p.name)
    return sorted(out)
