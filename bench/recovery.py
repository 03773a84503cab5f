"""Recovery from a killed worker, phase by phase, and the goodput ledger of the run.

    python bench/recovery.py [--part all|recovery|snapshot|ettr] [--nproc 4] [--steps 12]
                             [--kill-step 7] [--data DIR] [--snapshot-steps 8] [--rounds 2]

A `--nproc`-rank run of the demo config (configs/demo.toml: Llama-style, 4 layers, hidden 512,
seq 256, global batch 16) under `myria supervise`, one worker (rank nproc-2) killed (SIGKILL)
at the start of step kill_step+1, checkpoints every 5 steps; the diagnostics run before the
restart with the tests' generous floors (this shared host fails the default ones). For each
recovery path available it reports MTTR (the kill to the first step completed after it), the
time lost (the kill to the step reached before it, done again) and the phases of
`supervisor_summary.json`'s `recovery_phases`: detection, tear-down, decision (diagnostics),
back-off, starting processes, process groups, model build, restoring state, redoing lost steps;
and the run's goodput ledger (seconds per category, ETTR, accounted / wall).

Paths, run side by side in one invocation: `full-restart` (`resilience.recovery = "restart"`:
the supervisor stops the whole group, runs the diagnostics, backs off and restarts it from the
newest checkpoint on disk), `in-job-spare` (`recovery = "in-job"`, one hot spare: the survivors
stay and the spare takes the lost rank's state from its ring neighbour's memory,
myria.train.rejoin), `in-job-fresh` (in-job without a spare: a fresh process replaces the
lost one) and `in-job-shrink` (in-job without a spare, `resilience.shrink`: the survivors go
on as nproc-1 data-parallel replicas on the same global batch and grow back when the spare
the supervisor starts is ready; shrinking needs full replicas, so this path runs the demo
with `training.data_parallel = ddp` for `--shrink-steps` steps, enough for the grow). Each
path's final weights are compared bit for bit with an uninterrupted `myria train` of the same
job (`bit_equal`; the shrink path's with a DDP run, and its losses step by step:
`max_rel_loss_diff`, against the layout tests' 1e-4), and its MTTR with the targets: <= 10 s,
and <= 3 step times + detection.

`--part snapshot`: the cost of holding each rank's state in its ring neighbour's memory every
step (myria.train.peer) on the same demo run without faults, `myria train` with
`resilience.memory_snapshot_interval` 1 vs 0 in interleaved rounds: mean step time, and the
snapshots' CPU time (copy + exchange thread) as a share of the process's CPU time, which on
this all-cores-busy host is what they cost, whatever the load of the moment.

`--part ettr`: a 200-step 2-rank supervised run with three workers killed (`--ettr-recovery`:
in-job with a spare, the default, or restart; `--ettr-model`: the tests' tiny model, ~0.1 s
steps, or the demo's as shipped, steps of seconds, written to recovery-ettr-demo.json): the
goodput ledger's total against the wall time, and its ETTR.

Writes bench/results/recovery.json (recovery-PART.json for one part); the tables in
bench/RESULTS.md are written by hand from them.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GENEROUS = ("gemm_tflops=0.02,membw_gbs=0.2,all_reduce_busbw_gbs=0.005,"
            "all_to_all_busbw_gbs=0.005,p2p_latency_max_us=1e6")
PHASES = ("detection", "teardown", "decision", "backoff", "start_processes", "process_groups",
          "build_model", "restore", "redo_steps")


def supervise(run_dir: Path, data: Path, nproc: int, fault: str, extra: list[str]) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), MYRIA_FAULT=fault)
    if not fault:
        env.pop("MYRIA_FAULT")
    cmd = [sys.executable, "-m", "myria", "supervise", "--config", "configs/demo.toml",
           "--run-dir", str(run_dir), "--nproc", str(nproc), f"--data.path={data}",
           "--logging.tensorboard=false", "--logging.progress=false",
           f"--resilience.doctor_expect={GENEROUS}", *extra]
    t = time.time()
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=3000)
    outside = time.time() - t
    if p.returncode != 0:
        raise SystemExit(f"supervise failed ({p.returncode}):\n{p.stderr[-4000:]}")
    s = json.loads((run_dir / "supervisor_summary.json").read_text())
    s["outside_wall_s"] = round(outside, 3)
    return s


def train(run_dir: Path, data: Path, nproc: int, steps: int, interval: int) -> dict:
    """A plain `myria train` of the demo config; returns mean step time (steps after the first)
    and rank 0's peer-snapshot statistics."""
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    env.pop("MYRIA_FAULT", None)
    cmd = [sys.executable, "-m", "myria", "train", "--config", "configs/demo.toml",
           "--run-dir", str(run_dir), "--nproc", str(nproc), f"--data.path={data}",
           "--logging.tensorboard=false", "--logging.progress=false", "--checkpoint.interval=0",
           f"--training.steps={steps}", f"--resilience.memory_snapshot_interval={interval}"]
    import resource

    def cpu() -> float:  # every waited-for descendant: the launcher and its workers
        u = resource.getrusage(resource.RUSAGE_CHILDREN)
        return u.ru_utime + u.ru_stime

    c0 = cpu()
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=3000)
    if p.returncode != 0:
        raise SystemExit(f"train failed ({p.returncode}):\n{p.stderr[-4000:]}")
    cpu_s = cpu() - c0
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    times = [r["step_time_s"] for r in rows if "loss" in r][1:]
    out = {"mean_step_s": sum(times) / len(times), "steps": len(times), "cpu_s": cpu_s}
    stats = run_dir / "peer" / "rank00000.json"
    if stats.exists():
        out["peer"] = json.loads(stats.read_text())
    return out


def snapshot_cost(work: Path, data: Path, nproc: int, steps: int, rounds: int) -> dict:
    """Peer snapshots every step vs none, interleaved rounds (the host's load drifts)."""
    runs: dict[str, list[dict]] = {"off": [], "every step": []}
    for rnd in range(rounds):
        for name, interval in (("off", 0), ("every step", 1)):
            r = train(work / f"snap-{interval}-{rnd}", data, nproc, steps, interval)
            runs[name].append(r)
            line = (f"snapshot cost round {rnd + 1} {name}: mean step {r['mean_step_s']:.3f} s, "
                    f"CPU {r['cpu_s']:.1f} s")
            if "peer" in r:
                q = r["peer"]
                n = q["snapshots"]
                line += (f"; training thread {1e3 * (q['copy_s'] + q['stall_s']) / n:.1f} ms "
                         f"per snapshot, exchange {1e3 * q['exchange_s'] / n:.1f} ms, "
                         f"{q['bytes'] / n / 2**20:.1f} MiB")
            print(line, flush=True)
    off = sum(r["mean_step_s"] for r in runs["off"]) / rounds
    on = sum(r["mean_step_s"] for r in runs["every step"]) / rounds
    p = [r["peer"] for r in runs["every step"]]
    n = sum(x["snapshots"] for x in p)
    thread_ms = 1e3 * sum(x["copy_s"] + x["stall_s"] for x in p) / n
    # CPU: the copy (training thread, CPU-bound) and the exchange thread's own CPU time, as a
    # share of rank 0's process CPU time: load-independent, unlike the step-time difference
    cpu = sum(x["copy_s"] + x["exchange_cpu_s"] for x in p)
    # the CPU time of the whole job (all ranks, start-up included, the same in both): the
    # difference per rank-step is what a snapshot costs a host whose cores are all busy
    c_off = sum(r["cpu_s"] for r in runs["off"]) / rounds
    c_on = sum(r["cpu_s"] for r in runs["every step"]) / rounds
    rank_steps = nproc * steps
    return {"mean_step_off_s": round(off, 4), "mean_step_on_s": round(on, 4),
            "job_cpu_off_s": round(c_off, 2), "job_cpu_on_s": round(c_on, 2),
            "cpu_ms_per_rank_step": round(1e3 * (c_on - c_off) / rank_steps, 1),
            "cpu_share_of_step": round((c_on - c_off) / c_off, 4),
            "step_time_change": round(on / off - 1, 4),
            "training_thread_ms_per_snapshot": round(thread_ms, 2),
            "training_thread_share_of_step": round(thread_ms / 1e3 / off, 5),
            "exchange_ms_per_snapshot": round(1e3 * sum(x["exchange_s"] for x in p) / n, 2),
            "thread_cpu_ms_per_snapshot": round(1e3 * cpu / n, 2),
            "mib_per_snapshot": round(sum(x["bytes"] for x in p) / n / 2**20, 2),
            "crc_failures": sum(x["crc_failures"] for x in p), "runs": runs}


def losses(run_dir: Path) -> dict[int, float]:
    out = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        if "loss" in r and "step" in r:
            out[r["step"]] = r["loss"]   # a step done again after a recovery: the last one
    return out


def max_rel_loss_diff(a: Path, b: Path) -> float:
    la, lb = losses(a), losses(b)
    if sorted(la) != sorted(lb):
        return float("inf")
    return max(abs(la[k] - lb[k]) / abs(lb[k]) for k in lb)


def same_weights(a: Path, b: Path) -> bool:
    """Whether the newest checkpoints of runs a and b hold the same parameters, bit for bit."""
    code = ("import sys, torch\nfrom myria.train.export import load_checkpoint_model as L\n"
            "a, b = (dict(L(p, None)[0].state_dict()) for p in sys.argv[1:])\n"
            "print(a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a))")
    p = subprocess.run([sys.executable, "-c", code, str(a), str(b)], cwd=ROOT, text=True,
                       capture_output=True, env=dict(os.environ, PYTHONPATH=str(ROOT / "src")))
    return p.stdout.strip().endswith("True")


TINY = ["--model.layers=2", "--model.hidden=64", "--model.heads=4", "--model.kv_heads=2",
        "--model.seq_len=64", "--training.global_batch=8", "--training.micro_batch=2",
        "--optimizer.warmup_steps=4", "--training.eval_interval=0"]


def ettr_run(work: Path, data: Path, steps: int, faults: int,
             recovery: str = "in-job", model: str = "tiny") -> dict:
    """A `steps`-step 2-rank supervised run with `faults` workers killed: its goodput ledger
    against the wall time (the supervisor's and one measured outside). `model`: "tiny" (the
    tests' model, ~0.1 s steps: start-up and shutdown weigh as much as the faults) or "demo"
    (configs/demo.toml as shipped, evaluation off: steps of seconds, as real steps are)."""
    every = steps // (faults + 1)
    kills = ",".join(f"kill:rank={i % 2}:step={every * (i + 1)}" for i in range(faults))
    shape = TINY if model == "tiny" else ["--training.eval_interval=0"]
    s = supervise(work / f"ettr-{model}", data, 2, kills, [
        *shape, f"--training.steps={steps}", "--checkpoint.interval=10",
        "--resilience.diagnose=false", "--resilience.backoff_s=0.5",
        f"--resilience.recovery={recovery}",
        *(["--resilience.spares=1"] if recovery == "in-job" else [])])
    g = s["goodput"]
    return {"recovery": recovery, "model": model, "faults": kills, "restarts": s["restarts"],
            "wall_s": s["wall_s"],
            "outside_wall_s": s["outside_wall_s"], "accounted_s": g["accounted_s"],
            "other_s": g["seconds"]["other"], "ettr": g["ettr"],
            "step_time_ratio": s["step_time_ratio"], "seconds": g["seconds"],
            "accounted_vs_wall": round(g["accounted_s"] / s["wall_s"] - 1, 5),
            "time_lost_per_fault_s": [f["time_lost_s"] for f in s["faults"]]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--kill-step", type=int, default=7, help="steps done before the kill")
    ap.add_argument("--shrink-steps", type=int, default=30,
                    help="steps of the in-job-shrink path (and its DDP reference): time for "
                    "the spare the supervisor starts at the shrink to be ready, and the grow")
    ap.add_argument("--data", default="", help="prepared demo data (default: prepare it)")
    ap.add_argument("--part", choices=("all", "recovery", "snapshot", "ettr"), default="all")
    ap.add_argument("--ettr-recovery", choices=("in-job", "restart"), default="in-job")
    ap.add_argument("--ettr-model", choices=("tiny", "demo"), default="tiny",
                    help="the 200-step ETTR run's model: the tests' tiny one or the demo's")
    ap.add_argument("--snapshot-steps", type=int, default=8, help="steps of each cost run")
    ap.add_argument("--rounds", type=int, default=2, help="rounds of the snapshot cost runs")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="recovery-bench-"))
    data = Path(args.data) if args.data else work / "data"
    if not args.data:
        subprocess.run([sys.executable, "-m", "myria", "prepare", "--corpus", "demo", "--out",
                        str(data), "--quiet"], cwd=ROOT, check=True,
                       env=dict(os.environ, PYTHONPATH=str(ROOT / "src")))
    rank = max(0, args.nproc - 2)
    fault = f"kill:rank={rank}:step={args.kill_step}"
    extra = [f"--training.steps={args.steps}", "--checkpoint.interval=5"]
    paths = {"full-restart": [],
             "in-job-spare": ["--resilience.recovery=in-job", "--resilience.spares=1"],
             "in-job-fresh": ["--resilience.recovery=in-job"],
             "in-job-shrink": ["--resilience.recovery=in-job", "--resilience.shrink=true",
                               "--training.data_parallel=ddp",
                               f"--training.steps={args.shrink_steps}"]} \
        if args.part in ("all", "recovery") else {}
    if args.part in ("all", "ettr"):
        e = ettr_run(work, data, 200, 3, args.ettr_recovery, args.ettr_model)
        print(f"200 steps, 3 kills: ledger {e['accounted_s']} s of wall {e['wall_s']} s "
              f"(other {e['other_s']} s); ETTR {e['ettr']}", flush=True)
    results = {}
    refs = {}

    def reference(name: str, more: list[str]) -> Path:
        """The uninterrupted `myria train` of a path's job (one per distinct job)."""
        key = "ddp" if name == "in-job-shrink" else "plain"
        if key not in refs:
            refs[key] = work / f"reference-{key}"
            p = subprocess.run([sys.executable, "-m", "myria", "train", "--config",
                                "configs/demo.toml", "--run-dir", str(refs[key]), "--nproc",
                                str(args.nproc), f"--data.path={data}",
                                "--logging.tensorboard=false", "--logging.progress=false",
                                *extra, *[m for m in more if "resilience" not in m]],
                               cwd=ROOT, capture_output=True, text=True,
                               env=dict(os.environ, PYTHONPATH=str(ROOT / "src")))
            if p.returncode != 0:
                raise SystemExit(f"reference run failed:\n{p.stderr[-4000:]}")
        return refs[key]

    for name, more in paths.items():
        ref = reference(name, more)
        s = supervise(work / name, data, args.nproc, fault, extra + more)
        f = s["faults"][0]
        g = s["goodput"]
        results[name] = {
            "mttr_s": f["fault_to_first_step_s"], "time_lost_s": f["time_lost_s"],
            "lost_steps": f["lost_steps"], "phases": f["recovery_phases"],
            "mean_step_s": s["mean_step_s"], "wall_s": s["wall_s"],
            "outside_wall_s": s["outside_wall_s"], "ledger": g["seconds"], "ettr": g["ettr"],
            "accounted_s": g["accounted_s"], "final_step": s["final_step"],
            "recovery": f.get("recovery"), "detection_s": f["detection_s"],
            "bit_equal": same_weights(ref, work / name),
            "max_rel_loss_diff": max_rel_loss_diff(work / name, ref),
            "resizes": s.get("resizes", [])}
        r = results[name]
        if r["mttr_s"] is not None:  # the two targets: <= 10 s, <= 3 steps + detection
            r["three_steps_plus_detection_s"] = round(3 * r["mean_step_s"] + r["detection_s"], 3)
            r["meets_10_s"] = r["mttr_s"] <= 10.0
            r["meets_3_steps"] = r["mttr_s"] <= r["three_steps_plus_detection_s"]
        print(f"{name}: MTTR {f['fault_to_first_step_s']} s, time lost {f['time_lost_s']} s "
              f"({f['lost_steps']} steps redone); phases {f['recovery_phases']}; "
              f"mean step {s['mean_step_s']} s; ETTR {g['ettr']}; bit-equal "
              f"{r['bit_equal']}; max relative loss difference {r['max_rel_loss_diff']:.2e}; "
              f"resizes {[(z['kind'], z.get('to_first_step_s')) for z in r['resizes']]}",
              flush=True)
    out = {"date": time.strftime("%Y-%m-%d"), "machine": f"{platform.machine()}, "
           f"{os.cpu_count()} CPUs (shared), torch CPU", "command": " ".join(sys.argv),
           "nproc": args.nproc, "steps": args.steps, "fault": fault, "results": results}
    if args.part in ("all", "ettr"):
        out["ettr_200_steps"] = e
    if args.part in ("all", "snapshot"):
        out["snapshot_cost"] = snapshot_cost(work, data, args.nproc, args.snapshot_steps,
                                             args.rounds)
    (ROOT / "bench" / "results").mkdir(exist_ok=True)
    name = "recovery.json" if args.part == "all" else f"recovery-{args.part}.json"
    if args.part == "ettr" and args.ettr_model != "tiny":
        name = f"recovery-ettr-{args.ettr_model}.json"
    (ROOT / "bench" / "results" / name).write_text(json.dumps(out, indent=1))
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
