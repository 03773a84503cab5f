"""Host faults on the emulated cluster (`myria cluster`): the fault matrix of a multi-host job.

    python bench/cluster_faults.py [--only lost-host,partition,...] [--out PATH]

Each case brings up emulated hosts under Slurm, submits the shipped scripts/myria.sbatch for a
2-host x 2-process job (tiny model, 12 steps, a checkpoint every 4) with the remaining nodes of
the allocation as spares, injects one host fault at step 6 and waits for the job's end:

- lost-host: every process of a host of the job killed (`kill-host`);
- lost-host-injob: the same with `resilience.recovery = "in-job"`: the spare node takes the
  lost host's ranks over, the other host's workers stay, the lost ranks' state comes from the
  survivors' memory over the network (myria.resilience.takeover), two hot spares per host
  (`resilience.spares`: torch imported before the fault); run beside lost-host for
  the MTTR (kill to the next completed step) of both, phase by phase;
- partition: a host's switch port down for longer than the hang timeout (10 s), then healed;
- slow-link: a host's link limited to 10 Mbit/s with tc tbf from step 3 to the end;
- failed-diagnostics: a host's diagnostics made to fail (`fail-diagnostics`) and one of its
  workers killed: its supervisor runs them, fails, drains the node in Slurm (sinfo), leaves;
- lost-during-recovery: a host killed, then the spare that replaced it killed as soon as the new
  round formed (4 nodes: two spares);
- lost-during-injob-recovery: lost-host-injob with a second spare (4 nodes), and the spare
  host that took the lost ranks over killed as soon as it announced the takeover: the
  survivors give up the in-job attempt and the job restarts its round on the second spare;
- worker-lost-with-spare: one worker of a host of the job killed, the spare node waiting: the
  job's two hosts and the spare race back into one new round, and the host left out waits as a
  spare (torch's rendezvous left it in its wait list, and the members' agents restarted the
  workers for it round after round);
- lost-first-host: the first host (the rendezvous store's, the batch script's) killed: the job
  cannot go on (a documented limit); each survivor says why in one line and hands the job back
  to Slurm (requeued: PENDING until an allocation is free; the bench then cancels it).

Per case: the detection time, the rendezvous rounds the job formed and the restarts for a
change of the rendezvous' membership (`membership-change`: a host joined, or one of the round's
dropped out), the recovery path, the time lost by phase (the supervisor's recovery_phases), the
final weights against a clean run of the same 4 ranks on one host (bit for bit), "nothing
committed lost" (the restart resumed from the newest checkpoint committed when the fault
struck, or later), the Slurm node states, and for the partition whether the cut-off host's
workers were fenced off (exit 75) before writing after the job moved on. Root and Debian's
slurm/munge are needed. JSON to bench/results/cluster_faults.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from myria import cluster  # noqa: E402

STEPS, FAULT_STEP = 12, 6
TINY = ["--model.vocab_size=1024", "--model.layers=2", "--model.hidden=64", "--model.heads=4",
        "--model.kv_heads=2", "--model.seq_len=64", "--training.global_batch=8",
        "--training.micro_batch=2", "--optimizer.warmup_steps=4", "--logging.tensorboard=false",
        f"--training.steps={STEPS}", "--checkpoint.interval=4", "--training.eval_interval=0",
        "--training.init_timeout_s=120", "--resilience.hang_timeout_s=10"]
CASES = ["lost-host", "lost-host-injob", "partition", "slow-link", "failed-diagnostics",
         "lost-during-recovery", "lost-during-injob-recovery", "worker-lost-with-spare",
         "lost-first-host"]
ENV = {"MYRIA": f"{sys.executable} -m myria", "OMP_NUM_THREADS": "1",
       "PYTHONPATH": str(ROOT / "src")}


def myria(*args: str, env: dict | None = None) -> None:
    subprocess.run([sys.executable, "-m", "myria", *args], check=True, cwd=ROOT,
                   env={**os.environ, **ENV, **(env or {})}, capture_output=True, text=True)


def rows(run: Path) -> list[dict]:
    p = run / "metrics.jsonl"
    return [json.loads(x) for x in p.read_text().splitlines()] if p.exists() else []


def metrics(run: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in rows(run) if "loss" in r}


def committed(run: Path) -> list[int]:
    d = run / "checkpoints"
    return sorted(int(p.name.split("_")[1]) for p in d.glob("step_*")
                  if p.is_dir() and (p / "meta.json").exists()) if d.is_dir() else []


def params(run: Path):
    from myria.train.export import load_checkpoint_model

    model, _, _ = load_checkpoint_model(run, None)
    return dict(model.state_dict())


def compare(run: Path, ref: Path) -> dict:
    import torch

    a, b = params(run), params(ref)
    diff = max(float((a[k] - b[k]).abs().max()) for k in a)
    la, lb = metrics(run), metrics(ref)
    return {"bit_equal": a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a),
            "max_abs_diff": diff, "losses_equal": la == lb, "steps_logged": len(la)}


def wait_step(run: Path, step: int, checkpoint: bool = True, timeout: float = 600) -> None:
    end = time.time() + timeout
    while time.time() < end:
        if max(metrics(run) or [0]) >= step and (committed(run) or not checkpoint):
            return
        time.sleep(0.3)
    raise TimeoutError(f"{run}: step {step} not reached")


def round_members(run: Path, round_: int, timeout: float = 300) -> list[str]:
    """The hosts of rendezvous round `round_` (the first host's log line)."""
    end = time.time() + timeout
    while time.time() < end:
        log = (run / "supervisor.log").read_text() if (run / "supervisor.log").exists() else ""
        for line in log.splitlines():
            if f"round {round_} of the rendezvous: hosts " in line:
                return line.split("hosts ")[1].split(";")[0].split(", ")
        time.sleep(0.3)
    raise TimeoutError(f"round {round_} did not form")


def takeover_host(run: Path, timeout: float = 120) -> str:
    """The spare host that announced an in-job takeover (its log line)."""
    end = time.time() + timeout
    while time.time() < end:
        for line in (run / "supervisor.log").read_text().splitlines():
            if "ACTION in-job takeover" in line:
                return line.split(": ")[1].split(" takes over")[0]
        time.sleep(0.1)
    raise TimeoutError("no takeover announced")


def kill_one_worker(host: str) -> int:
    for pid in cluster._ns_pids(cluster.ns(host)):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"myria" in cmd and b"train" in cmd:
            os.kill(pid, signal.SIGKILL)
            return pid
    raise RuntimeError(f"no worker found on {host}")


def run_case(case: str, work: Path, data: Path, ref: Path) -> dict:
    nodes = {"lost-during-recovery": 4, "lost-during-injob-recovery": 4,
             "slow-link": 2}.get(case, 3)
    run = work / case
    cluster.up(nodes, quiet=True)
    extra = ["--resilience.diagnose=true" if case == "failed-diagnostics"
             else "--resilience.diagnose=false"]
    if "injob" in case:   # two hot spares per host: one per rank a host holds
        extra += ["--resilience.recovery=in-job", "--resilience.spares=2"]
    load0 = os.getloadavg()[0]
    t_submit = time.time()
    job = cluster.sbatch(ROOT / "scripts" / "myria.sbatch", nodes,
                         ["--run-dir", str(run), "--nproc", "2", f"--data.path={data}", *TINY,
                          *extra], work / f"{case}.out", {**ENV, "MYRIA_NNODES": "2"})
    members = round_members(run, 0)
    if case == "slow-link":
        wait_step(run, 3, checkpoint=False)
    else:
        wait_step(run, FAULT_STEP)
    victim = members[0] if case == "lost-first-host" else members[1]
    newest = (committed(run) or [0])[-1]
    out: dict = {"case": case, "nodes": nodes, "members": members, "victim": victim,
                 "newest_committed_at_fault": newest}
    t_fault = time.time()
    out["fault_at_step"] = max(metrics(run))
    attempt_at_fault = max(r.get("attempt", 0) for r in rows(run))
    if case in ("lost-host", "lost-host-injob", "lost-first-host"):
        cluster.kill_host(victim)
    elif case == "partition":
        cluster.partition(victim)
        time.sleep(40)
        cluster.partition(victim, heal=True)
        out["partition_s"] = round(time.time() - t_fault, 1)
    elif case == "slow-link":
        cluster.slow_link(victim, "10mbit")
    elif case == "failed-diagnostics":
        cluster.fail_diagnostics(victim)
        out["killed_worker"] = kill_one_worker(victim)
    elif case == "worker-lost-with-spare":
        out["killed_worker"] = kill_one_worker(victim)
    elif case == "lost-during-injob-recovery":
        cluster.kill_host(victim)
        second = takeover_host(run)
        cluster.kill_host(second)
        out["second_victim"] = second
        out["second_killed_after_s"] = round(time.time() - t_fault, 2)
    elif case == "lost-during-recovery":
        cluster.kill_host(victim)
        # never the allocation's first node: it serves the rendezvous store, and its loss
        # ends the job (the lost-first-host case)
        second = next((h for h in round_members(run, 1)
                       if h != members[0] and h != cluster.hosts()[0]), None)
        if second is None:
            raise RuntimeError("the spare that replaced the lost host is the first node "
                               "(the rendezvous store's): not killed (see lost-first-host)")
        cluster.kill_host(second)
        out["second_victim"] = second
        out["second_killed_after_s"] = round(time.time() - t_fault, 2)
    if case == "lost-first-host":   # its survivors hand the job back to Slurm (requeue)
        end = time.time() + 300
        while time.time() < end and cluster.job_state(job) in ("RUNNING", "COMPLETING"):
            time.sleep(1.0)
        out["job_back_to_slurm_s"] = round(time.time() - t_fault, 1)
        state = cluster.job_state(job)
        cluster.exec_on(cluster.LOGIN, ["scancel", str(job)], capture=True)
    else:
        state = cluster.wait_job(job, 900)
    out["slurm_job_state"] = state
    out["load_avg_1min"] = [round(load0, 1), round(os.getloadavg()[0], 1)]
    if case.startswith("lost-host"):   # kill to the next completed step
        nxt = [r for r in rows(run) if r.get("attempt", 0) > attempt_at_fault and "loss" in r]
        out["mttr_s"] = round(min(r["time"] for r in nxt) - t_fault, 2) if nxt else None
    out["wall_s"] = round(time.time() - t_submit, 1)
    out["node_states"] = cluster.node_states()
    log = (run / "supervisor.log").read_text() if (run / "supervisor.log").exists() else ""
    out["rendezvous_rounds"] = len({x.split(" of the rendezvous")[0].rsplit(" ", 1)[1]
                                    for x in log.splitlines() if " of the rendezvous: hosts " in x})
    out["membership_restarts"] = sum(" DETECTED membership-change" in x
                                     for x in log.splitlines())
    if case == "lost-first-host":
        log = (run / "supervisor.log").read_text()
        out["survivor_says"] = [x.split(" ACTION ")[1] for x in log.splitlines()
                                if " ACTION give up" in x and f"[{victim}]" not in x]
        out["nothing_committed_lost"] = bool(committed(run)) and \
            committed(run)[-1] >= newest
        out["recovery_path"] = "none: the job ends (its rendezvous lived on the lost host)"
        out["final_weights"] = {"bit_equal": False, "max_abs_diff": float("nan"),
                                "note": "the job did not finish"}
        cluster.down(quiet=True)
        return out
    s = json.loads((run / "supervisor_summary.json").read_text())
    out["status"], out["host_status"] = s["status"], s.get("host_status")
    out["placement_final"] = s.get("placement")
    out["faults"] = [{k: f.get(k) for k in ("host", "kind", "ranks", "detection_s", "cause",
                                            "resumed_from", "time_lost_s", "recovery",
                                            "recovery_phases", "action", "newest_committed")}
                     for f in s.get("faults", [])]
    first = next((f for f in s.get("faults", []) if f.get("host") == members[0]), None)
    if case == "lost-host-injob":
        first = next((f for f in s.get("faults", []) if f.get("kind") == "host-lost"), None)
    if case == "lost-during-injob-recovery":   # the restart that followed the failed takeover
        first = next((f for f in s.get("faults", []) if f.get("host") == members[0] and
                      f.get("recovery") == "restart"), first)
    if first:
        out["detection_s"] = first.get("detection_s")
        out["time_lost_s"] = first.get("time_lost_s")
        out["recovery_phases"] = first.get("recovery_phases")
        resumed = [f.get("resumed_from") for f in s["faults"] if f.get("host") == members[0]
                   and f.get("resumed_from") is not None]
        if case == "lost-host-injob":
            resumed = [first["resumed_from"]] if first.get("resumed_from") is not None else []
            # the phases of the MTTR: kill -> the spare's verdict -> its workers started ->
            # state restored -> the first step done
            out["mttr_phases"] = {
                "detection": round(first["detected_at"] - t_fault, 2),
                "announce_and_start": round(first["restarted_at"] - first["detected_at"], 2),
                **{k: v for k, v in (first.get("recovery_phases") or {}).items()
                   if k not in ("detection", "teardown", "decision", "backoff")}}
            p = run / "peer" / "injob.json"
            out["restored"] = json.loads(p.read_text())[-1] if p.exists() else None
        out["resumed_from"] = resumed
        out["nothing_committed_lost"] = bool(resumed) and resumed[0] >= newest
        final = [h for h in (s.get("placement") or {}) if s["host_status"].get(h) == "succeeded"]
        out["recovery_path"] = (f"restart of the job's workers from checkpoint step "
                                f"{resumed[0] if resumed else '?'} on {', '.join(final)}")
        if case == "lost-host-injob":
            rs = out.get("restored") or {}
            out["recovery_path"] = (
                f"in-job: {first.get('host')} took over ranks {first.get('ranks')}, "
                f"{members[0]}'s workers stayed; state of step {rs.get('step')} from ranks "
                f"{sorted(set((rs.get('sources') or {}).values()))}' memory "
                f"({', '.join(sorted(set((rs.get('copy') or {}).values())))}, CRC-checked)")
    else:
        out["nothing_committed_lost"] = committed(run)[-1] == STEPS
        out["recovery_path"] = "none needed: the job went on"
    if case == "partition":
        fence = json.loads((run / "fence.json").read_text())
        fenced = []
        for p in (run / "logs").rglob("stderr.log"):
            text = p.read_text(errors="replace")
            if f"on {victim}: fenced" in text:
                fenced.append(round(p.stat().st_mtime - fence["time"], 2))
        out["fence"] = {"generation": fence["generation"], "hosts": fence["hosts"],
                        "cut_off_workers_fenced": len(fenced),
                        "their_exit_after_fence_s": fenced,
                        "commits_after_fence_by_cut_off_host": 0 if fenced or
                        victim not in fence["hosts"] else None}
    if case == "slow-link":
        dets = [json.loads(x) for x in (run / "events.jsonl").read_text().splitlines()] \
            if (run / "events.jsonl").exists() else []
        out["straggler_detections"] = [(d.get("rank"), d.get("host")) for d in dets
                                       if d.get("kind") == "straggler"]
        out["slow_link_detections"] = [{"host": d.get("host"), "step": d.get("step"),
                                        **d.get("evidence", {})} for d in dets
                                       if d.get("kind") == "slow-link"]
        out["slowed_at_s"] = round(t_fault - t_submit, 1)
        if sl := [d for d in dets if d.get("kind") == "slow-link"]:
            out["detection_s"] = round(sl[0]["time"] - t_fault, 2)
        myria("report", str(run), "--no-prediction")
        b = json.loads((run / "report" / "blame.json").read_text())
        out["blame"] = {"slow_links": b.get("slow_links"),
                        "most_blamed_rank": b["most_blamed_rank"],
                        "standout_ranks": b["standout_ranks"],
                        "by_rank": {r["rank"]: {"host": r["host"], "waited_s": round(
                            r["waited_s"], 2), "blamed_s": round(r["blamed_s"], 2)}
                                    for r in b["ranks"]}}
    out["final_weights"] = compare(run, ref)
    cluster.down(quiet=True)
    return out


def table(results: dict) -> str:
    """The markdown table of bench/RESULTS.md from the JSON."""
    rows = ["| case | detected (s) | recovery path | time lost (s): by phase | final weights | "
            "nothing committed lost | Slurm |", "|---|---|---|---|---|---|---|"]
    for c in results["cases"]:
        if "error" in c:
            rows.append(f"| {c['case']} | error: {c['error']} | | | | | |")
            continue
        ph = c.get("recovery_phases") or {}
        phases = ", ".join(f"{k} {v:.1f}" for k, v in ph.items() if v >= 0.05)
        w = c["final_weights"]
        weights = "bit-equal" if w["bit_equal"] else w.get("note") or \
            f"max diff {w['max_abs_diff']:.2e}"
        det = c.get("detection_s")
        if c["case"] == "slow-link":
            sl = c.get("slow_link_detections") or []
            det = (f"{c.get('detection_s')}: slow link on " + ", ".join(
                f"{d['host']} ranks {d.get('ranks')}" for d in sl) if sl else "not detected")
        extra = ""
        if c.get("survivor_says"):
            extra = (f"; each survivor: `{c['survivor_says'][0][:150]}...`; job back to Slurm "
                     f"{c.get('job_back_to_slurm_s')} s after the kill")
        if c.get("fence"):
            f = c["fence"]
            extra = (f"; cut-off host's {f['cut_off_workers_fenced']} workers fenced "
                     f"{', '.join(str(x) for x in f['their_exit_after_fence_s'])} s after "
                     f"round {f['generation']}")
        if c.get("rendezvous_rounds"):
            extra += (f"; {c['rendezvous_rounds']} rendezvous rounds, "
                      f"{c.get('membership_restarts', 0)} restarts for a membership change")
        nodes = ", ".join(f"{h} {s}" for h, s in sorted((c.get("node_states") or {}).items()))
        rows.append(f"| {c['case']} ({c['victim']}) | {det} | {c.get('recovery_path')}{extra} | "
                    f"{c.get('time_lost_s')}: {phases or '-'} | {weights} | "
                    f"{'yes' if c.get('nothing_committed_lost') else 'NO'} | "
                    f"job {c.get('slurm_job_state')}; {nodes} |")
    mt = [c for c in results["cases"] if c.get("mttr_s") is not None]
    if mt:
        rows += ["", "| case | recovery | MTTR: kill to the next step (s) | by phase (s) | "
                 "load (1 min, start/end) |", "|---|---|---|---|---|"]
        for c in mt:
            ph = c.get("mttr_phases") or {"detection": c.get("detection_s"),
                                          **(c.get("recovery_phases") or {})}
            rows.append(f"| {c['case']} | {'in-job' if 'injob' in c['case'] else 'restart'} | "
                        f"{c['mttr_s']} | " + ", ".join(f"{k} {v:.1f}" for k, v in ph.items()
                                                     if v is not None and v >= 0.05) +
                        f" | {c.get('load_avg_1min')} |")
    return "\n".join(rows)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", default=",".join(CASES))
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "cluster_faults.json"))
    ap.add_argument("--table", action="store_true", help="print the table of --out and exit")
    args = ap.parse_args()
    if args.table:
        print(table(json.loads(Path(args.out).read_text())))
        return 0
    if why := cluster.missing():
        print(f"cluster_faults: skipped: {why}")
        return 0
    work = Path(tempfile.mkdtemp(prefix="myria-cluster-faults-"))
    data, ref = work / "data", work / "reference"
    myria("prepare", "--corpus", "demo", "--max-docs", "20", "--vocab-size", "1024",
          "--out", str(data), "--quiet")
    t = time.time()
    myria("supervise", "--run-dir", str(ref), "--nproc", "4", f"--data.path={data}", *TINY,
          "--resilience.diagnose=false")
    old = json.loads(Path(args.out).read_text()) if Path(args.out).exists() else {}
    results = {"machine": f"{platform.node()} ({os.cpu_count()} cores, {platform.platform()})",
               "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
               "command": "python bench/cluster_faults.py", "steps": STEPS,
               "fault_step": FAULT_STEP, "reference_wall_s": round(time.time() - t, 1),
               "cases": [c for c in old.get("cases", [])    # a rerun replaces its cases
                         if c.get("case") not in args.only.split(",")]}
    try:
        for case in args.only.split(","):
            print(f"== {case}", flush=True)
            try:
                r = run_case(case, work, data, ref)
            except Exception as e:  # record and go on: one case's failure is a result too
                r = {"case": case, "error": f"{type(e).__name__}: {e}"}
                cluster.down(quiet=True)
            print(json.dumps({k: r.get(k) for k in (
                "status", "detection_s", "time_lost_s", "nothing_committed_lost",
                "final_weights", "error")}), flush=True)
            results["cases"].append(r)
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(results, indent=1))
    finally:
        cluster.down(quiet=True)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
