"""The end-to-end integrity check as a user runs it: a bit flipped on rank 1 of the demo's
default layout (FSDP, the default overlapped two-stage checkpoint, 2 processes) is reported as
`sdc` on rank 1, and the supervised job ends bit-equal to a clean run.

    .venv/bin/python bench/sdc_judge.py [--targets param,grad,optimizer] [--data data/demo]
        [--out bench/results/sdc_judge.json] [--keep]

The clean run is `myria train --config configs/demo.toml --data.path=DATA --training.steps=12
--checkpoint.interval=3 --logging.interval=1 --training.seed=5 --run-dir runs/clean --nproc 2`;
each fault the same under `myria supervise` with `MYRIA_FAULT=bitflip:rank=1:step=6:target=T`
(both through `python -m myria` on this tree). Per target: the `sdc` lines of events.jsonl,
what the supervisor filed and resumed from, the quarantined checkpoints, the losses of all 12
steps (the last value logged for each step) against the clean run's, every exported model
tensor and every tensor of the final checkpoint (model and optimizer) against the clean run's
(`torch.equal`), and every checkpoint left in checkpoints/ against the clean run's of the same
step. Writes bench/results/sdc_judge.json and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "src"))
from bench.sdc_matrix import (  # noqa: E402
    ckpt_state,
    cli,
    compare_ckpts,
    params,
    quarantined,
    supervisor_summary,
)

OUT = ROOT / "bench" / "results" / "sdc_judge.json"
ARGS = ["--config", "configs/demo.toml", "--training.steps=12", "--checkpoint.interval=3",
        "--logging.interval=1", "--training.seed=5", "--nproc", "2"]


def losses(run: Path) -> dict[int, float]:
    """{step: loss}, the last value logged for each step (a redone step's second value)."""
    out = {}
    for line in (run / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        if "loss" in row and "step" in row:
            out[row["step"]] = row["loss"]
    return out


def final_ckpt(run: Path) -> Path:
    return max((p for p in (run / "checkpoints").glob("step_*") if (p / "meta.json").exists()),
               key=lambda p: int(p.name.split("_")[1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--targets", default="param,grad,optimizer")
    ap.add_argument("--data", default="data/demo")
    ap.add_argument("--out", default=str(OUT))
    ap.add_argument("--keep", action="store_true", help="keep the run directories (printed)")
    a = ap.parse_args()
    import torch

    from myria import detections

    tmp = Path(tempfile.mkdtemp(prefix="myria-sdc-judge-"))
    rows: list[dict] = []
    try:
        ref = tmp / "clean"
        t0 = time.time()
        p = cli("train", *ARGS, f"--data.path={a.data}", "--run-dir", str(ref))
        if p.returncode:
            raise SystemExit(f"the clean run failed: {p.stderr[-800:]}")
        clean_wall = round(time.time() - t0, 1)
        clean_w, clean_l = params(ref), losses(ref)
        clean_final = ckpt_state(final_ckpt(ref))
        print(f"clean run: {len(clean_w)} tensors, {clean_wall} s", flush=True)
        for target in a.targets.split(","):
            run = tmp / f"flip-{target}"
            t0 = time.time()
            p = cli("supervise", *ARGS, f"--data.path={a.data}", "--run-dir", str(run),
                    fault=f"bitflip:rank=1:step=6:target={target}")
            sdc = detections.read(run, "sdc")
            summary = supervisor_summary(run)
            got = params(run) if p.returncode == 0 else {}
            equal_w = [k for k in clean_w if k in got and torch.equal(got[k], clean_w[k])]
            fin = ckpt_state(final_ckpt(run)) if p.returncode == 0 else {}
            equal_f = [k for k in clean_final if k in fin and torch.equal(fin[k],
                                                                         clean_final[k])]
            lo = losses(run) if (run / "metrics.jsonl").exists() else {}
            good, bad = compare_ckpts(run, ref)
            rows.append({
                "target": target, "rc": p.returncode,
                "stderr_tail": p.stderr[-600:] if p.returncode else "",
                "sdc": [{"rank": r["rank"], "step": r["step"],
                         "check": r["evidence"].get("check"),
                         "when": r["evidence"].get("when"),
                         "verdict": r["evidence"].get("verdict")} for r in sdc],
                "named": bool(sdc) and all(r["rank"] == 1 for r in sdc),
                "status": summary.get("status"),
                "filed_as": [(f.get("kind"), f.get("ranks"),
                              (f.get("sdc") or {}).get("verdict"))
                             for f in summary.get("faults", [])],
                "resumed_from": [f.get("resumed_from") for f in summary.get("faults", [])],
                "quarantined": quarantined(run),
                "losses_equal": lo == clean_l, "steps": len(lo),
                "first_loss_diff": next(([s, lo.get(s), clean_l[s]] for s in sorted(clean_l)
                                         if lo.get(s) != clean_l[s]), None),
                "weights_equal": f"{len(equal_w)}/{len(clean_w)}",
                "final_ckpt_equal": f"{len(equal_f)}/{len(clean_final)}",
                "bit_equal": len(equal_w) == len(clean_w) > 0 and
                len(equal_f) == len(clean_final) > 0,
                "clean_ckpts": good, "bad_ckpts": bad, "wall_s": round(time.time() - t0, 1)})
            print(json.dumps(rows[-1]), flush=True)
    finally:
        if a.keep:
            print(f"run directories kept in {tmp}", flush=True)
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"command": "bench/sdc_judge.py " + " ".join(sys.argv[1:]),
                               "date": time.strftime("%Y-%m-%d %H:%M"), "clean_wall_s":
                               clean_wall, "rows": rows}, indent=1))
    print("\n| target | sdc (rank, step, check, verdict) | supervisor | resumed from | "
          "quarantined | losses equal | weights | final checkpoint | left clean |\n"
          "|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        s = "; ".join(f"{x['rank']}, {x['step']}, {x['check']}, {x['verdict']}"
                      for x in r["sdc"]) or "none"
        q = ", ".join(k[5:].lstrip("0") for k in r["quarantined"]) or "-"
        print(f"| {r['target']} | {s} | {r['status']}, {r['filed_as']} | {r['resumed_from']} | "
              f"{q} | {r['losses_equal']} | {r['weights_equal']} | {r['final_ckpt_equal']} | "
              f"{len(r['clean_ckpts'])}/{len(r['clean_ckpts']) + len(r['bad_ckpts'])} |")


if __name__ == "__main__":
    main()
