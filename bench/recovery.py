"""Recovery from a killed worker, phase by phase, and the goodput ledger of the run.

    python bench/recovery.py [--nproc 4] [--steps 12] [--kill-step 7] [--data DIR]

A `--nproc`-rank run of the demo config (configs/demo.toml: Llama-style, 4 layers, hidden 512,
seq 256, global batch 16) under `myria supervise`, one worker (rank nproc-2) killed (SIGKILL)
at the start of step kill_step+1, checkpoints every 5 steps; the diagnostics run before the
restart with the tests' generous floors (this shared host fails the default ones). For each
recovery path available it reports MTTR (the kill to the first step completed after it), the
time lost (the kill to the step reached before it, done again) and the phases of
`supervisor_summary.json`'s `recovery_phases`: detection, tear-down, decision (diagnostics),
back-off, starting processes, process groups, model build, restoring state, redoing lost steps;
and the run's goodput ledger (seconds per category, ETTR, accounted / wall).

Paths: `full-restart` (today: the supervisor stops the whole group and restarts it from the
newest checkpoint on disk). In-job recovery is not built yet (issue 26); when it is, it is added
here and run in the same invocation.

Writes bench/results/recovery.json and its section of bench/RESULTS.md.
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--kill-step", type=int, default=7, help="steps done before the kill")
    ap.add_argument("--data", default="", help="prepared demo data (default: prepare it)")
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
    paths = {"full-restart": []}
    results = {}
    for name, more in paths.items():
        s = supervise(work / name, data, args.nproc, fault, extra + more)
        f = s["faults"][0]
        g = s["goodput"]
        results[name] = {
            "mttr_s": f["fault_to_first_step_s"], "time_lost_s": f["time_lost_s"],
            "lost_steps": f["lost_steps"], "phases": f["recovery_phases"],
            "mean_step_s": s["mean_step_s"], "wall_s": s["wall_s"],
            "outside_wall_s": s["outside_wall_s"], "ledger": g["seconds"], "ettr": g["ettr"],
            "accounted_s": g["accounted_s"], "final_step": s["final_step"]}
        print(f"{name}: MTTR {f['fault_to_first_step_s']} s, time lost {f['time_lost_s']} s "
              f"({f['lost_steps']} steps redone); phases {f['recovery_phases']}; "
              f"mean step {s['mean_step_s']} s; ETTR {g['ettr']}", flush=True)
    out = {"date": time.strftime("%Y-%m-%d"), "machine": f"{platform.machine()}, "
           f"{os.cpu_count()} CPUs (shared), torch CPU", "command": " ".join(sys.argv),
           "nproc": args.nproc, "steps": args.steps, "fault": fault, "results": results}
    (ROOT / "bench" / "results").mkdir(exist_ok=True)
    (ROOT / "bench" / "results" / "recovery.json").write_text(json.dumps(out, indent=1))
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
