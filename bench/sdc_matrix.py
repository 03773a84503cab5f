"""Silent data corruption, every layout x every target, at the checkpoint's edges: is a flipped
bit reported as `sdc` naming its rank, does `myria supervise` end bit-equal to a clean run, and
does no checkpoint left to resume from hold a corrupted tensor?

    .venv/bin/python bench/sdc_matrix.py [--layouts fsdp,hsdp,ddp,tp2dp2,pp2dp2]
        [--targets param,grad,optimizer,compute,wgrad] [--positions ckpt,after]
        [--snapshots overlap,async,sync] [--recovery restart,in-job] [--data DIR] [--out F]

A tiny model (the test suite's TINY) trains 8 steps on 2 or 4 gloo ranks with checkpoints every
2 steps (all kept) and `resilience.sdc_interval = 4`. Where the bit flips (`--positions`):

- `ckpt`: `bitflip:rank=R:step=3:target=T` acts in step 4, a checkpoint step and a checked step;
- `after`: `step=4` acts in step 5, the step after a checkpoint, while its overlapped snapshot
  is being copied (the copy is made to come after the flip: CheckpointManager._flip_due); a
  compute fault there is `sticky=yes` (wrong from step 5 on, found by the check of step 8: the
  checkpoint of step 6 was committed meanwhile and must not be resumed from), since a one-step
  compute fault between two checks is not recomputed (the check is sampled); the same for
  `wgrad` (a wrong weight-gradient GEMM result: every block's, every microbatch).

`--targets peer` (with `--recovery in-job` only, not in the default list): the bit flips in the
newest peer-memory snapshot the rank holds for its left ring neighbour (`bitflip:target=peer`,
at the start of step 4 or 5, once that copy of step 3 or 4 has landed), and that neighbour
raises at the same step start: its replacement needs that copy. Recovery must refuse it (its
CRC-32) and resume from the copy of the step before, held in memory too; `refused` and
`restored` (RUN_DIR/peer/injob.json) say what it did; `named` there means the damaged step was
refused.

`--snapshots`: `overlap` (the default: two-stage, copied during the next step), `async` (two-
stage, copied before the save returns), `sync`. `--recovery`: restart (default) or in-job (peer
memory snapshots every step). For each layout and snapshot mode one clean `myria train` with the
checks off is the reference. Each row: the `sdc` lines of events.jsonl (rank, step, check;
`named`: all of them name the corrupted rank), what the supervisor filed, its restarts and
resumed step, whether the final parameters equal the reference's bit for bit, the quarantined
checkpoints (and why), and `clean_ckpts`: every checkpoint left in checkpoints/ compared, model
and optimizer state, tensor by tensor with the reference's of the same step (`bad_ckpts` lists
any that differs). Writes bench/results/sdc_matrix.json (or --out) and prints a Markdown table.
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
COMMON = [*TINY, "--training.steps=8", "--checkpoint.interval=2", "--checkpoint.keep=100",
          "--resilience.sdc_interval=4", "--resilience.diagnose=false",
          "--resilience.heartbeat_s=0.5", "--resilience.backoff_s=0.2"]
POSITIONS = {"ckpt": 3, "after": 4}   # the fault's step=: acts in step 4 / step 5
SNAPSHOTS = {
    "overlap": ["--resilience.async_checkpoint=true", "--resilience.snapshot_overlap=true"],
    "async": ["--resilience.async_checkpoint=true", "--resilience.snapshot_overlap=false"],
    "sync": ["--resilience.async_checkpoint=false"],
}
LAYOUTS = {   # name: (processes, arguments, the rank to corrupt)
    "fsdp": (2, ["--training.global_batch=8"], 1),
    "hsdp": (4, ["--training.global_batch=16", "--parallel.dp_replicate=2"], 2),
    "ddp": (2, ["--training.global_batch=8", "--training.data_parallel=ddp"], 1),
    "tp2dp2": (4, ["--training.global_batch=16", "--parallel.tp=2"], 3),
    "pp2dp2": (4, ["--training.global_batch=16", "--parallel.pp=2"], 3),
}
TARGETS = ("param", "grad", "optimizer", "compute", "wgrad")


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


def ckpt_state(path: Path) -> dict:
    """Every tensor of a checkpoint (model and optimizer), whole, by key."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as d:
        f = Path(d) / "state.pt"
        dcp_to_torch_save(str(path), str(f))
        state = torch.load(f, weights_only=False)
    out = {}

    def walk(prefix, v):
        if isinstance(v, dict):
            for k, x in v.items():
                walk(f"{prefix}/{k}", x)
        elif isinstance(v, torch.Tensor):
            out[prefix] = v
    walk("", state)
    return out


def compare_ckpts(run: Path, ref: Path) -> tuple[list[str], list[str]]:
    """(the checkpoints of `run` equal to the reference's of the same step, those that are not
    or have no counterpart)."""
    import torch

    good, bad = [], []
    for p in sorted((run / "checkpoints").glob("step_*")):
        if not (p / "meta.json").exists():
            continue
        q = ref / "checkpoints" / p.name
        if not q.exists():
            bad.append(f"{p.name} (no reference)")
            continue
        a, b = ckpt_state(p), ckpt_state(q)
        diff = [k for k in b if k not in a or not torch.equal(a[k], b[k])]
        (bad if diff or a.keys() != b.keys() else good).append(
            p.name + (f" ({diff[0]})" if diff else ""))
    return good, bad


def supervisor_summary(run: Path) -> dict:
    """RUN/supervisor_summary.json, or {} when the supervisor wrote none."""
    p = run / "supervisor_summary.json"
    return json.loads(p.read_text()) if p.exists() else {}


def quarantined(run: Path) -> dict[str, str]:
    """{checkpoint name: the start of its quarantine reason} of RUN/checkpoints/quarantine."""
    qdir = run / "checkpoints" / "quarantine"
    return {q.name.split(".")[0]: json.loads((q / "QUARANTINED.json").read_text())["reason"][:120]
            for q in (sorted(qdir.iterdir()) if qdir.is_dir() else [])
            if (q / "QUARANTINED.json").exists()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layouts", default=",".join(LAYOUTS))
    ap.add_argument("--targets", default=",".join(TARGETS))
    ap.add_argument("--positions", default="ckpt,after")
    ap.add_argument("--snapshots", default="overlap")
    ap.add_argument("--recovery", default="restart")
    ap.add_argument("--data", default="")
    ap.add_argument("--out", default=str(OUT))
    ap.add_argument("--keep", action="store_true", help="keep the run directories (printed)")
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
        cells = [(lay, snap) for lay in a.layouts.split(",") for snap in a.snapshots.split(",")]
        for lay, snap in cells:
            nproc, extra, rank = LAYOUTS[lay]
            args = ["--nproc", str(nproc), f"--data.path={data}", *COMMON, *extra,
                    *SNAPSHOTS[snap]]
            ref = tmp / f"{lay}-{snap}-clean"
            p = cli("train", "--run-dir", str(ref), *args, "--resilience.sdc_interval=0")
            if p.returncode:
                rows.append({"layout": lay, "snapshots": snap, "target": "-",
                             "error": p.stderr[-400:]})
                continue
            clean = params(ref)
            for recovery, pos, target in [(r, q, t) for r in a.recovery.split(",")
                                          for q in a.positions.split(",")
                                          for t in a.targets.split(",")]:
                run = tmp / f"{lay}-{snap}-{recovery}-{pos}-{target}"
                t0 = time.time()
                sticky = ":sticky=yes" if target in ("compute", "wgrad") and pos == "after" \
                    else ""
                fault = f"bitflip:rank={rank}:step={POSITIONS[pos]}:target={target}{sticky}"
                if target == "peer":   # its holder's copy damaged, then the neighbour is lost
                    if recovery != "in-job":
                        continue
                    fault += f",raise:rank={(rank - 1) % nproc}:step={POSITIONS[pos]}"
                p = cli("supervise", "--run-dir", str(run), *args,
                        f"--resilience.recovery={recovery}", fault=fault)
                sdc = detections.read(run, "sdc")
                injob = run / "peer" / "injob.json"
                restored = json.loads(injob.read_text()) if injob.exists() else []
                damaged = POSITIONS[pos]   # the step of the copy the peer fault damages
                refused = [x for x in restored if f"refused, CRC-32: [{damaged}]" in
                           x.get("facts", "")]
                summary = supervisor_summary(run)
                got = params(run) if p.returncode == 0 else {}
                equal = bool(got) and got.keys() == clean.keys() and \
                    all(torch.equal(got[k], clean[k]) for k in clean)
                good, bad = compare_ckpts(run, ref) if run.exists() else ([], [])
                rows.append({
                    "layout": lay, "snapshots": snap, "recovery": recovery, "position": pos,
                    "target": target + (" sticky" if sticky else ""), "fault_rank": rank,
                    "sdc": [{"rank": r["rank"], "step": r["step"],
                             "check": r["evidence"].get("check"),
                             "verdict": r["evidence"].get("verdict")} for r in sdc],
                    # every detection names the faulted rank (a persistent compute fault on
                    # two ranks is found in both microbatches: two detections, one rank)
                    "named": bool(refused) and not sdc if target == "peer" else
                    bool(sdc) and all(r["rank"] == rank for r in sdc),
                    "refused": bool(refused),
                    "restored": [{"step": x.get("step"), "sources": x.get("sources"),
                                  "facts": x.get("facts")} for x in restored],
                    "filed_as": [(f.get("kind"), (f.get("sdc") or {}).get("verdict"))
                                 for f in summary.get("faults", [])],
                    "blocklist": summary.get("blocklist"),
                    "status": summary.get("status"), "restarts": summary.get("restarts"),
                    "rc": p.returncode, "stderr_tail": p.stderr[-600:] if p.returncode else "",
                    "resumed_from": [f.get("resumed_from") for f in summary.get("faults", [])],
                    "recovered_by": [f.get("recovery") for f in summary.get("faults", [])],
                    "bit_equal": equal, "clean_ckpts": good, "bad_ckpts": bad,
                    "quarantined": quarantined(run), "wall_s": round(time.time() - t0, 1)})
                print(json.dumps(rows[-1]), flush=True)
    finally:
        if a.keep:
            print(f"run directories kept in {tmp}", flush=True)
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"command": "bench/sdc_matrix.py " + " ".join(sys.argv[1:]),
                               "date": time.strftime("%Y-%m-%d %H:%M"), "rows": rows}, indent=1))
    print("\n| layout | snapshots | recovery | flip | target | sdc (rank @ step, check) | "
          "named | restarts | resumed from | quarantined | checkpoints left clean | "
          "bit-equal |\n|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['layout']} | {r['snapshots']} | | | - | clean run failed: "
                  f"{r['error'][-80:]!r} | | | | | | |")
            continue
        s = ", ".join(f"{x['rank']} @ {x['step']} ({x['check']}"
                      + (f", {x['verdict']}" if x["verdict"] else "") + ")" for x in r["sdc"])
        q = ", ".join(f"{k[5:].lstrip('0')}" for k in r["quarantined"]) or "-"
        left = f"{len(r['clean_ckpts'])}/{len(r['clean_ckpts']) + len(r['bad_ckpts'])}"
        print(f"| {r['layout']} | {r['snapshots']} | {r['recovery']} | {r['position']} | "
              f"{r['target']} | {s or 'none'} | {r['named']} | {r['restarts']} | "
              f"{r['resumed_from']} | {q} | {left} | {r['bit_equal']} |")


if __name__ == "__main__":
    main()
