"""Silent data corruption, every layout x every target (issue 27): is a flipped bit reported as
`sdc` naming its rank within one interval, and does `myria supervise` end bit-equal to a clean run?

    .venv/bin/python bench/sdc_matrix.py [--layouts fsdp,hsdp,ddp,tp2dp2,pp2dp2]
                                         [--targets param,grad,optimizer,compute] [--data DIR]

A tiny model (the test suite's TINY) trains 8 steps on 2 or 4 gloo ranks with checkpoints every
4 steps and `resilience.sdc_interval = 3`; the fault `bitflip:rank=R:step=5:target=T` acts in
step 6 (a checked step). For each layout one clean `myria train` with the checks off is the
reference (so bit-equal also says the checks leave no trace in training). Each row:
the `sdc` lines of events.jsonl (rank, step, check), what the supervisor filed the fault as (kind
`sdc` and the verdict) and its blocklist, its restarts and resumed step,
and whether the final parameters equal the reference's bit for bit. Writes
bench/results/sdc_matrix.json and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
OUT = ROOT / "bench" / "results" / "sdc_matrix.json"

TINY = ["--model.vocab_size=1024", "--model.layers=2", "--model.hidden=64", "--model.heads=4",
        "--model.kv_heads=2", "--model.seq_len=64", "--training.micro_batch=2",
        "--optimizer.warmup_steps=4", "--logging.tensorboard=false", "--data.prefetch=2",
        "--training.eval_interval=0"]
COMMON = [*TINY, "--training.steps=8", "--checkpoint.interval=4", "--resilience.sdc_interval=3",
          "--resilience.diagnose=false", "--resilience.heartbeat_s=0.5",
          "--resilience.backoff_s=0.2"]
LAYOUTS = {   # name: (processes, arguments, the rank to corrupt)
    "fsdp": (2, ["--training.global_batch=8"], 1),
    "hsdp": (4, ["--training.global_batch=16", "--parallel.dp_replicate=2"], 2),
    "ddp": (2, ["--training.global_batch=8", "--training.data_parallel=ddp"], 1),
    "tp2dp2": (4, ["--training.global_batch=16", "--parallel.tp=2"], 3),
    "pp2dp2": (4, ["--training.global_batch=16", "--parallel.pp=2"], 3),
}
TARGETS = ("param", "grad", "optimizer", "compute")


def cli(*args: str, fault: str | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "MYRIA_FAULT"}
    if fault:
        env["MYRIA_FAULT"] = fault
    env["PYTHONPATH"] = str(ROOT / "src")
    return subprocess.run([sys.executable, "-m", "myria", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)


def params(run: Path) -> dict:
    from myria.train.export import load_checkpoint_model

    return dict(load_checkpoint_model(run, None)[0].state_dict())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layouts", default=",".join(LAYOUTS))
    ap.add_argument("--targets", default=",".join(TARGETS))
    ap.add_argument("--data", default="")
    a = ap.parse_args()
    import torch

    from myria import detections

    tmp = Path(tempfile.mkdtemp(prefix="myria-sdc-matrix-"))
    data = a.data
    if not data:
        data = str(tmp / "data")
        cli("prepare", "--corpus", "demo", "--max-docs", "20", "--vocab-size", "1024",
            "--out", data, "--quiet").check_returncode()
    rows = []
    try:
        for lay in a.layouts.split(","):
            nproc, extra, rank = LAYOUTS[lay]
            args = ["--nproc", str(nproc), f"--data.path={data}", *COMMON, *extra]
            ref = tmp / f"{lay}-clean"
            p = cli("train", "--run-dir", str(ref), *args, "--resilience.sdc_interval=0")
            if p.returncode:
                rows.append({"layout": lay, "target": "-", "error": p.stderr[-400:]})
                continue
            clean = params(ref)
            for target in a.targets.split(","):
                run = tmp / f"{lay}-{target}"
                t0 = time.time()
                p = cli("supervise", "--run-dir", str(run), *args,
                        fault=f"bitflip:rank={rank}:step=5:target={target}")
                sdc = detections.read(run, "sdc")
                summary = json.loads((run / "supervisor_summary.json").read_text()) \
                    if (run / "supervisor_summary.json").exists() else {}
                got = params(run) if p.returncode == 0 else {}
                equal = bool(got) and got.keys() == clean.keys() and \
                    all(torch.equal(got[k], clean[k]) for k in clean)
                rows.append({
                    "layout": lay, "target": target, "fault_rank": rank,
                    "sdc": [{"rank": r["rank"], "step": r["step"],
                             "check": r["evidence"].get("check"),
                             "verdict": r["evidence"].get("verdict")} for r in sdc],
                    "named": [r["rank"] for r in sdc] == [rank],
                    "filed_as": [(f.get("kind"), (f.get("sdc") or {}).get("verdict"))
                                 for f in summary.get("faults", [])],
                    "blocklist": summary.get("blocklist"),
                    "status": summary.get("status"), "restarts": summary.get("restarts"),
                    "resumed_from": [f.get("resumed_from") for f in summary.get("faults", [])],
                    "bit_equal": equal, "wall_s": round(time.time() - t0, 1)})
                print(json.dumps(rows[-1]), flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps({"command": "bench/sdc_matrix.py " + " ".join(sys.argv[1:]),
                               "date": time.strftime("%Y-%m-%d %H:%M"), "rows": rows}, indent=1))
    print("\n| layout | target | sdc (rank @ step, check) | named the rank | supervisor filed | "
          "restarts | resumed from | bit-equal to clean |\n|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['layout']} | - | clean run failed: {r['error'][-80:]!r} | | | | | |")
            continue
        s = ", ".join(f"{x['rank']} @ {x['step']} ({x['check']}"
                      + (f", {x['verdict']}" if x["verdict"] else "") + ")" for x in r["sdc"])
        filed = ", ".join(f"{k} ({v})" if v else str(k) for k, v in r["filed_as"]) or "-"
        print(f"| {r['layout']} | {r['target']} | {s or 'none'} | {r['named']} | {filed} | "
              f"{r['restarts']} | {r['resumed_from']} | {r['bit_equal']} |")


if __name__ == "__main__":
    main()
