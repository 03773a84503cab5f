"""Throughput and MFU of `myria train` vs a minimal plain-PyTorch loop, and vs a nanoGPT-style GPT.

    python bench/train_throughput.py [--config configs/demo.toml] [--steps 10] [--rounds 2]

In one process and one run: measures this CPU's fp32 matmul peak, then alternates three
trainings on the same data and global batch, `--rounds` times each:

- plain: a nanoGPT-style loop (forward, backward, clip, AdamW, schedule) on myria's demo model;
- myria: `myria.train.trainer.train` on the same config (framework overhead = 1 - myria/plain);
- nanogpt: a nanoGPT-style GPT (LayerNorm, GELU MLP, learned positions, full-vocabulary
  logits + F.cross_entropy) of the same width and depth, in the plain loop.

Tokens/s is the median over steps after warm-up; the best round of each is kept (the machine is
shared, so rounds differ). MFU uses model FLOPs from `myria.models.flops` (dense convention).
Writes bench/results/train_throughput.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from myria import config as config_mod  # noqa: E402
from myria.data.dataset import TokenDataset  # noqa: E402
from myria.data.loader import BatchLoader  # noqa: E402
from myria.device import measure_matmul_tflops  # noqa: E402
from myria.models.flops import model_flops_per_token  # noqa: E402
from myria.models.transformer import build_model  # noqa: E402
from myria.optim import build_optimizer  # noqa: E402
from myria.optim.schedules import build_scheduler  # noqa: E402


def plain_loop(cfg, steps: int, warmup: int, full_logits: bool) -> float:
    """nanoGPT-style loop; returns median tokens/s over the steps after warm-up."""
    torch.manual_seed(0)
    model = build_model(cfg.model, "cpu")
    model.init_weights(cfg.training.seed)
    opt = build_optimizer(model, cfg.optimizer)
    sched = build_scheduler(opt, cfg.optimizer, cfg.training.steps)
    data = TokenDataset(cfg.data.path, cfg.model.seq_len)
    t = cfg.training
    loader = BatchLoader(data, t.global_batch, t.micro_batch, 0, 1, t.seed, prefetch=2)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        b = next(loader)
        for i in range(b.inputs.shape[0]):
            x, y = b.inputs[i], b.targets[i]
            if full_logits:
                loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
            else:
                loss = model(x, y)
            (loss / b.inputs.shape[0]).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        float(loss.detach())
        times.append(time.perf_counter() - t0)
    loader.close()
    tokens = t.global_batch * cfg.model.seq_len
    return tokens / statistics.median(times[warmup:])


def myria_loop(cfg, steps: int, warmup: int) -> float:
    from myria.train.trainer import train

    with tempfile.TemporaryDirectory() as d:
        c = dataclasses.replace(cfg)
        train(c, d)
        rows = [json.loads(x) for x in (Path(d) / "metrics.jsonl").read_text().splitlines()]
    times = [r["step_time_s"] for r in rows if "step_time_s" in r][warmup:steps]
    return cfg.training.global_batch * cfg.model.seq_len / statistics.median(times)


def bench_config(path: str, steps: int):
    """The config the trainer is measured with: `steps` steps, no checkpoint interval, no
    progress bar, a fresh run."""
    cfg = config_mod.load(path, [f"--training.steps={steps}", "--checkpoint.interval=0",
                                 "--logging.progress=false", "--logging.tensorboard=false",
                                 "--data.prefetch=2"])
    cfg.checkpoint.resume = False
    return cfg


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(ROOT / "configs" / "demo.toml"))
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "train_throughput.json"))
    args = ap.parse_args()

    cfg = bench_config(args.config, args.steps)
    if not (Path(cfg.data.path) / "index.json").exists():
        print(f"{cfg.data.path} is not prepared: run `myria prepare --corpus demo --out "
              f"{cfg.data.path}` first", file=sys.stderr)
        return 2
    gpt = config_mod.load(args.config, ["--model.arch=gpt", "--model.kv_heads=0"])
    gpt.training, gpt.data, gpt.optimizer = cfg.training, cfg.data, cfg.optimizer
    threads = torch.get_num_threads()
    peak = measure_matmul_tflops(n=1024, seconds=2.0, threads=threads)
    fpt = {"plain": model_flops_per_token(cfg.model), "myria": model_flops_per_token(cfg.model),
           "nanogpt": model_flops_per_token(gpt.model)}
    runs: dict[str, list[float]] = {"plain": [], "myria": [], "nanogpt": []}
    loops = {"plain": lambda: plain_loop(cfg, args.steps, args.warmup, full_logits=False),
             "myria": lambda: myria_loop(cfg, args.steps, args.warmup),
             "nanogpt": lambda: plain_loop(gpt, args.steps, args.warmup, full_logits=True)}
    names = list(loops)
    for r in range(args.rounds):
        for name in names[r % 3:] + names[:r % 3]:  # rotate the order: no loop always first
            runs[name].append(loops[name]())
        print(f"round {r + 1}: " + ", ".join(f"{k} {v[-1]:,.0f} tok/s" for k, v in runs.items()),
              flush=True)
    peak_end = measure_matmul_tflops(n=1024, seconds=2.0, threads=threads)
    peak = max(peak, peak_end)
    best = {k: max(v) for k, v in runs.items()}
    result = {
        "date": time.strftime("%Y-%m-%d"), "machine": f"{platform.machine()}, "
        f"{threads} threads, torch {torch.__version__}", "config": args.config,
        "steps": args.steps, "warmup": args.warmup, "rounds": args.rounds,
        "peak_tflops_fp32_measured": peak,
        "tokens_per_s": best, "all_rounds": runs,
        "mfu": {k: fpt[k] * best[k] / (peak * 1e12) for k in best},
        "framework_overhead": 1 - best["myria"] / best["plain"],
        "model_flops_per_token": fpt,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"\nmeasured fp32 matmul peak: {peak:.3f} TFLOP/s ({threads} threads)")
    print(f"{'loop':<10}{'tokens/s':>12}{'MFU':>8}")
    for k in best:
        print(f"{k:<10}{best[k]:>12,.0f}{100 * result['mfu'][k]:>7.1f}%")
    print(f"framework overhead (1 - myria/plain): {100 * result['framework_overhead']:.1f}%")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
