"""Does LAMB at 4x the batch reach AdamW's loss at 1x in the same number of tokens?

    python bench/lamb_vs_adamw.py [--batch 8] [--scale 4] [--steps 256]
        [--adamw-lrs 1.5e-3,3e-3,6e-3] [--lamb-lrs 5e-3,1e-2,2e-2]

MegaScale (Jiang et al. 2024, section 3.1) uses LAMB to scale the batch 4x "without
accuracy loss". This benchmark tests that claim on the demo task with the real trainer: every
run is `myria train --config configs/demo.toml --run-dir ... --section.key=value` in a fresh
single process (`--training.threads` threads), reading the run's metrics.jsonl afterwards.

- AdamW (PyTorch's) at global batch B for N steps, LAMB (ours) at scale*B for N/scale steps:
  the same tokens, the same model, initialisation seed, corpus and token-matched warm-up
  (`--warmup-frac` of the run) and cosine decay to 10% of the peak.
- A learning-rate sweep per optimizer; all runs are reported and the best of each (lowest final
  validation loss) is compared.
- Validation loss at the same token counts (`--evals` times per run) on the same sequences: all
  of the demo corpus's validation split (`--data.eval_batches` is set so that both batch sizes
  cover all of it). Training loss is compared as the mean over token windows, since one step's
  loss is noisy.

The model is a smaller variant of the demo config (`--model-overrides`, by default 2 layers,
hidden 256, 128-token sequences) so that the sweep fits in about half an hour on one CPU core.
Runs whose directory already holds complete metrics are reused (`--runs-dir`), so a sweep can
be extended. Writes bench/results/lamb_vs_adamw.json and .png and prints a table and a verdict.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_MODEL = "--model.layers=2 --model.hidden=256 --model.seq_len=128"


def floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def read_metrics(run_dir: Path) -> tuple[list[dict], list[dict]]:
    """(training rows, validation rows) of RUN_DIR/metrics.jsonl."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return [], []
    rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    return [r for r in rows if "loss" in r], [r for r in rows if "val_loss" in r]


def window_mean(curve: list[tuple[int, float]], lo: float, hi: float) -> float:
    """Mean loss of the steps whose token count (at the end of the step) is in (lo, hi]."""
    vals = [loss for tok, loss in curve if lo < tok <= hi]
    return sum(vals) / len(vals)


def run_one(spec: dict, args, runs_dir: Path) -> dict:
    """Train one configuration with the myria CLI (or reuse a complete earlier run)."""
    run_dir = runs_dir / spec["name"]
    train_rows, val_rows = read_metrics(run_dir)
    complete = (train_rows and train_rows[-1]["step"] == spec["steps"]
                and val_rows and val_rows[-1]["step"] == spec["steps"])
    overrides = [
        *args.model_overrides.split(),
        f"--data.path={args.data}",
        f"--training.threads={args.threads}",
        f"--training.steps={spec['steps']}",
        f"--training.global_batch={spec['batch']}",
        f"--training.micro_batch={min(spec['batch'], args.micro_batch)}",
        f"--training.eval_interval={spec['eval_interval']}",
        f"--data.eval_batches={spec['eval_batches']}",
        f"--optimizer.name={spec['optimizer']}",
        f"--optimizer.lr={spec['lr']}",
        f"--optimizer.warmup_steps={spec['warmup']}",
        "--optimizer.schedule=cosine",
        "--checkpoint.interval=0", "--checkpoint.keep=1",
        "--logging.tensorboard=false", "--logging.progress=false",
    ]
    cmd = [sys.executable, "-m", "myria", "train", "--config", args.config,
           "--run-dir", str(run_dir), *overrides]
    wall = None
    if complete:
        wall = args.previous_walls.get(spec["name"])
        print(f"{spec['name']}: reusing the complete run in {run_dir}", flush=True)
    else:
        shutil.rmtree(run_dir, ignore_errors=True)  # never resume a partial run
        print(f"{spec['name']}: {spec['steps']} steps of {spec['batch']} sequences ...",
              flush=True)
        t0 = time.perf_counter()
        p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True,
                           env=dict(os.environ, PYTHONUNBUFFERED="1"))
        wall = time.perf_counter() - t0
        if p.returncode != 0:
            raise SystemExit(f"{' '.join(cmd)}\nexited {p.returncode}\n{p.stdout[-2000:]}\n"
                             f"{p.stderr[-4000:]}")
        train_rows, val_rows = read_metrics(run_dir)
    tps = spec["batch"] * spec["seq_len"]
    curve = [(r["step"] * tps, r["loss"]) for r in train_rows]
    total = spec["steps"] * tps
    last = window_mean(curve, total * (1 - args.final_frac), total)
    result = dict(spec, tokens=total, wall_s=wall, command=" ".join(
                      ["myria", "train", "--config", args.config, "--run-dir", str(run_dir),
                       *overrides]),
                  final_train_loss=last, last_step_loss=train_rows[-1]["loss"],
                  final_val_loss=val_rows[-1]["val_loss"],
                  val=[(r["step"] * tps, r["val_loss"]) for r in val_rows],
                  train=curve)
    print(f"  final train loss (mean of the last {args.final_frac:.0%} of tokens) {last:.4f}, "
          f"val loss {result['final_val_loss']:.4f}"
          + (f", {wall:.0f} s" if wall is not None else ""), flush=True)
    return result


def matched_windows(a: dict, b: dict, n: int) -> list[dict]:
    """Mean training loss of runs a and b over n equal token windows."""
    total = a["tokens"]
    out = []
    for i in range(n):
        lo, hi = total * i / n, total * (i + 1) / n
        out.append({"tokens_from": int(lo), "tokens_to": int(hi),
                    a["optimizer"]: window_mean(a["train"], lo, hi),
                    b["optimizer"]: window_mean(b["train"], lo, hi)})
    return out


def tokens_to_reach(run: dict, target: float, window: int) -> float | None:
    """First token count at which `run`'s training loss, averaged over the last `window` tokens,
    is at or below `target`; None if it never is."""
    curve = run["train"]
    for tok, _ in curve:
        if tok < window:
            continue
        if window_mean(curve, tok - window, tok) <= target:
            return tok
    return None


def plot(results: list[dict], best: dict, path: Path, window: int) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 5))
    strong = {"adamw-1x": "#08519c", "lamb": "#d94801", "adamw-control": "#238b45"}
    light = {"adamw-1x": ["#9ecae1", "#6baed6", "#4292c6", "#2171b5"],
             "lamb": ["#fdd0a2", "#fdae6b", "#fd8d3c", "#f16913", "#e6550d", "#a63603"],
             "adamw-control": ["#a1d99b", "#74c476"]}
    for group in best:
        runs = sorted((r for r in results if r["group"] == group), key=lambda r: r["lr"])
        others = [r for r in runs if r is not best[group]]
        for r in runs:
            is_best = r is best[group]
            c = strong[group] if is_best else \
                light[group][min(others.index(r), len(light[group]) - 1)]
            label = f"{r['optimizer']} B={r['batch']} lr={r['lr']:g}" + \
                (" (best)" if is_best else "")
            xs = [t for t, _ in r["train"] if t >= window]
            ys = [window_mean(r["train"], t - window, t) for t in xs]
            ax1.plot([x / 1e3 for x in xs], ys, color=c, lw=2.2 if is_best else 1.0,
                     ls="-" if is_best else "--", label=label)
            vx, vy = zip(*r["val"], strict=True)
            ax2.plot([x / 1e3 for x in vx], vy, color=c, lw=2.2 if is_best else 1.0,
                     ls="-" if is_best else "--", marker="o", ms=4, label=label)
    ax1.set_title(f"training loss (mean over the last {window // 1000}k tokens)")
    ax2.set_title("validation loss (whole validation split)")
    for ax in (ax1, ax2):
        ax.set_xlabel("tokens (thousands)")
        ax.set_ylabel("loss (nats)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("LAMB at 4x batch vs AdamW at 1x (and AdamW at 4x), same tokens "
                 "(myria demo corpus, small model)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/demo.toml", help="base run config")
    ap.add_argument("--data", default="data/demo", help="prepared demo corpus")
    ap.add_argument("--model-overrides", default=DEFAULT_MODEL,
                    help="overrides that shrink the demo model, space-separated; pass as "
                    "--model-overrides='--model.layers=4 ...' (default: %(default)s)")
    ap.add_argument("--batch", type=int, default=8, help="AdamW's global batch (sequences)")
    ap.add_argument("--scale", type=int, default=4, help="LAMB's batch = scale x --batch")
    ap.add_argument("--steps", type=int, default=256, help="AdamW's steps; LAMB runs steps/scale")
    ap.add_argument("--micro-batch", type=int, default=32, help="largest micro-batch")
    ap.add_argument("--warmup-frac", type=float, default=0.09375,
                    help="warm-up as a fraction of the run (the same tokens for both)")
    ap.add_argument("--evals", type=int, default=4, help="validations per run")
    ap.add_argument("--adamw-lrs", type=floats, default=floats("1.5e-3,3e-3,6e-3"),
                    help="comma-separated peak learning rates of the AdamW sweep")
    ap.add_argument("--lamb-lrs", type=floats, default=floats("5e-3,1e-2,2e-2"),
                    help="comma-separated peak learning rates of the LAMB sweep")
    ap.add_argument("--control-lrs", type=floats, default=[],
                    help="also run AdamW at the LAMB batch with these lrs (a control: how much "
                    "the larger batch itself costs); empty for none")
    ap.add_argument("--threads", type=int, default=1, help="--training.threads of each run")
    ap.add_argument("--final-frac", type=float, default=0.1,
                    help="final training loss = mean over this last fraction of the tokens")
    ap.add_argument("--tolerance", type=float, default=0.02,
                    help="LAMB matches AdamW if its final val loss is at most this much higher")
    ap.add_argument("--runs-dir", default="/tmp/myria-lamb-vs-adamw",
                    help="run directories (complete runs found here are reused)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "lamb_vs_adamw.json"))
    ap.add_argument("--plot", default=str(ROOT / "bench" / "results" / "lamb_vs_adamw.png"))
    args = ap.parse_args()

    if args.steps % args.scale or args.steps % (args.scale * args.evals):
        ap.error("--steps must be divisible by --scale x --evals")
    seq_len = next((int(o.split("=")[1]) for o in args.model_overrides.split()
                    if o.startswith("--model.seq_len=")), None)
    if seq_len is None:
        sys.path.insert(0, str(ROOT / "src"))
        from myria import config as config_mod
        seq_len = config_mod.load(ROOT / args.config).model.seq_len
    # eval_batches x batch >= 4096 sequences: the whole validation split for both batch sizes.
    specs = []
    big, few = args.batch * args.scale, args.steps // args.scale
    for group, opt, lrs, batch, steps in (
            ("adamw-1x", "adamw", args.adamw_lrs, args.batch, args.steps),
            ("lamb", "lamb", args.lamb_lrs, big, few),
            ("adamw-control", "adamw", args.control_lrs, big, few)):
        for lr in lrs:
            specs.append({"name": f"{opt}-b{batch}-lr{lr:g}", "group": group,
                          "optimizer": opt, "lr": lr,
                          "batch": batch, "steps": steps, "seq_len": seq_len,
                          "warmup": max(1, round(steps * args.warmup_frac)),
                          "eval_interval": steps // args.evals,
                          "eval_batches": -(-4096 // batch)})
    runs_dir = Path(args.runs_dir)
    args.previous_walls = {}
    if Path(args.out).exists():  # wall times of runs reused from an earlier invocation
        try:
            prev = json.loads(Path(args.out).read_text())
            args.previous_walls = {r["name"]: r["wall_s"] for r in prev.get("runs", [])}
        except (ValueError, KeyError):
            pass
    t0 = time.perf_counter()
    results = [run_one(s, args, runs_dir) for s in specs]
    total_wall = time.perf_counter() - t0
    runs_wall = sum(r["wall_s"] or 0.0 for r in results)

    best = {g: min((r for r in results if r["group"] == g), key=lambda r: r["final_val_loss"])
            for g in ("adamw-1x", "lamb", "adamw-control") if any(r["group"] == g for r in results)}
    a, b = best["adamw-1x"], best["lamb"]
    gap = b["final_val_loss"] - a["final_val_loss"]
    train_gap = b["final_train_loss"] - a["final_train_loss"]
    window = a["tokens"] // 8
    reach = tokens_to_reach(a, window_mean(b["train"], b["tokens"] - window, b["tokens"]),
                            window)
    windows = matched_windows(a, b, args.evals)
    edge = [g for g, lrs in (("adamw-1x", args.adamw_lrs), ("lamb", args.lamb_lrs),
                             ("adamw-control", args.control_lrs))
            if len(lrs) > 1 and best[g]["lr"] in (min(lrs), max(lrs))]

    hdr = (f"{'optimizer':<9} {'batch':>5} {'steps':>5} {'lr':>8} {'tokens':>8} "
           f"{'final train':>11} {'final val':>9}")
    print("\n" + hdr + "\n" + "-" * len(hdr))
    for r in results:
        mark = f"  <- best {r['group']}" if r is best[r["group"]] else ""
        print(f"{r['optimizer']:<9} {r['batch']:>5} {r['steps']:>5} {r['lr']:>8g} "
              f"{r['tokens']:>8,} {r['final_train_loss']:>11.4f} {r['final_val_loss']:>9.4f}"
              + mark)
    print(f"\nfinal train loss = mean over the last {args.final_frac:.0%} of the tokens; "
          "final val loss = mean over the whole validation split at the last step.")
    print("\nvalidation loss at matched tokens (best runs):")
    for (tok, va), (tok_b, vb) in zip(a["val"], b["val"], strict=True):
        assert tok == tok_b
        print(f"  {tok:>8,} tokens: adamw {va:.4f}  lamb {vb:.4f}  (lamb - adamw {vb - va:+.4f})")
    print("training loss at matched tokens (mean over each window, best runs):")
    for w in windows:
        print(f"  {w['tokens_from']:>8,}-{w['tokens_to']:<8,}: adamw {w['adamw']:.4f}  "
              f"lamb {w['lamb']:.4f}  ({w['lamb'] - w['adamw']:+.4f})")
    matched = gap <= args.tolerance
    verdict = (f"LAMB at {args.scale}x batch (B={b['batch']}, lr {b['lr']:g}) "
               + ("MATCHES" if matched else "does NOT match")
               + f" AdamW at 1x (B={a['batch']}, lr {a['lr']:g}) within {args.tolerance} nats "
               f"after {a['tokens']:,} tokens: final val loss {b['final_val_loss']:.4f} vs "
               f"{a['final_val_loss']:.4f} (LAMB - AdamW = {gap:+.4f} nats); final train loss "
               f"{train_gap:+.4f} nats.")
    if reach is not None and not matched:
        verdict += (f" AdamW's training loss reached LAMB's final level after {reach:,} tokens "
                    f"({reach / a['tokens']:.0%} of the budget).")
    control = best.get("adamw-control")
    control_gap = None
    if control is not None:
        control_gap = control["final_val_loss"] - a["final_val_loss"]
        verdict += (f" Control: AdamW at {args.scale}x batch (B={control['batch']}, lr "
                    f"{control['lr']:g}, best of its {len(args.control_lrs)}) ends at val loss "
                    f"{control['final_val_loss']:.4f} ({control_gap:+.4f} nats vs AdamW at 1x), "
                    f"so LAMB recovers {control_gap - gap:+.4f} nats of the large-batch loss.")
    if edge:
        verdict += (f" Caution: the best lr of {', '.join(edge)} is at the edge of its sweep.")
    print("\n" + verdict)
    print(f"wall time: {runs_wall / 60:.1f} min of training runs (reused runs included), "
          f"{total_wall / 60:.1f} min in this invocation")

    out = {
        "benchmark": "lamb_vs_adamw", "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores (shared), "
                   f"{args.threads} thread per run, python {platform.python_version()}",
        "command": "python bench/lamb_vs_adamw.py " + " ".join(sys.argv[1:]),
        "settings": {k: v for k, v in vars(args).items()
                     if k not in ("out", "plot", "previous_walls")},
        "runs_wall_s": runs_wall, "invocation_wall_s": total_wall,
        "runs": results,
        "best": {k: v["name"] for k, v in best.items()},
        "val_gap_nats": gap, "control_val_gap_nats": control_gap, "train_gap_nats": train_gap,
        "adamw_tokens_to_reach_lamb_final_train": reach,
        "matched_train_windows": windows, "matched": matched, "lr_at_sweep_edge": edge,
        "verdict": verdict,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    plot(results, best, Path(args.plot), window)
    print(f"wrote {args.out} and {args.plot}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
