"""Throughput and MFU of `myria train` vs a minimal plain-PyTorch loop, and vs a nanoGPT-style GPT.

    python bench/train_throughput.py [--config configs/demo.toml] [--steps 10] [--rounds 2]
                                     [--without-checks]
    python bench/train_throughput.py --cpu-time --threads 1 [--steps 12] [--rounds 3]

In one process and one run: measures this CPU's fp32 matmul peak, then alternates three
trainings on the same data and global batch, `--rounds` times each:

- plain: a nanoGPT-style loop (forward, backward, clip, AdamW, schedule) on myria's demo model;
- myria: `myria.train.trainer.train` on the same config (framework overhead = 1 - myria/plain);
- nanogpt: a nanoGPT-style GPT (LayerNorm, GELU MLP, learned positions, full-vocabulary
  logits + F.cross_entropy) of the same width and depth, in the plain loop;
- with `--without-checks`, myria_no_checks: myria without the silent-corruption checks.

Tokens/s is the median over steps after warm-up; the best round of each is kept (the machine is
shared, so rounds differ). With `--cpu-time` each loop also runs a short schedule (`--warmup`
steps) beside the full one, and its steady-state cost is the difference of the two runs' CPU
seconds (user + system, every thread of this process) over the difference of their steps:
start-up cancels, and on a shared host CPU seconds move less with the load than wall time
(use `--threads 1`, so no thread spins waiting for another). nanoGPT is left out in that mode.
MFU uses model FLOPs from `myria.models.flops` (dense convention).
Writes bench/results/train_throughput.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import resource
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


def cpu_seconds() -> float:
    """User + system CPU seconds of this process so far, every thread included."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def cpu_per_step(run, short: int, long: int) -> tuple[float, float]:
    """(CPU seconds per steady-state step, wall tokens/s of the long run) of `run(steps)`: the
    CPU of a `short`-step run subtracted from a `long`-step one's, over the extra steps."""
    c0 = cpu_seconds()
    run(short)
    c1 = cpu_seconds()
    tokens_per_s = run(long)
    c2 = cpu_seconds()
    return ((c2 - c1) - (c1 - c0)) / (long - short), tokens_per_s


def bench_config(path: str, steps: int, *extra: str):
    """The config the trainer is measured with: `steps` steps, no checkpoint interval, no
    progress bar, a fresh run."""
    cfg = config_mod.load(path, [f"--training.steps={steps}", "--checkpoint.interval=0",
                                 "--logging.progress=false", "--logging.tensorboard=false",
                                 "--data.prefetch=2", *extra])
    cfg.checkpoint.resume = False
    return cfg


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(ROOT / "configs" / "demo.toml"))
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--cpu-time", action="store_true",
                    help="also compare CPU seconds per steady-state step (plain and myria only)")
    ap.add_argument("--threads", type=int, default=0,
                    help="torch threads of both loops (0: torch's default)")
    ap.add_argument("--out", default=None, help="result JSON (default bench/results/"
                    "train_throughput.json, or train_throughput_cpu.json with --cpu-time)")
    ap.add_argument("--without-checks", action="store_true",
                    help="a fourth loop: myria with resilience.sdc_interval = 0 (no at-rest "
                    "ledger, no compute check), to show what the checks cost")
    args = ap.parse_args()
    if args.cpu_time:
        return cpu_main(args)

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
    loops = {"plain": lambda: plain_loop(cfg, args.steps, args.warmup, full_logits=False),
             "myria": lambda: myria_loop(cfg, args.steps, args.warmup),
             "nanogpt": lambda: plain_loop(gpt, args.steps, args.warmup, full_logits=True)}
    if args.without_checks:
        bare = bench_config(args.config, args.steps, "--resilience.sdc_interval=0")
        loops["myria_no_checks"] = lambda: myria_loop(bare, args.steps, args.warmup)
        fpt["myria_no_checks"] = fpt["myria"]
    runs: dict[str, list[float]] = {k: [] for k in loops}
    names = list(loops)
    for r in range(args.rounds):
        k = r % len(names)
        for name in names[k:] + names[:k]:  # rotate the order: no loop always first
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
        "framework_overhead_without_checks": 1 - best["myria_no_checks"] / best["plain"]
        if "myria_no_checks" in best else None,
        "model_flops_per_token": fpt,
    }
    out = Path(args.out or ROOT / "bench" / "results" / "train_throughput.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"\nmeasured fp32 matmul peak: {peak:.3f} TFLOP/s ({threads} threads)")
    print(f"{'loop':<10}{'tokens/s':>12}{'MFU':>8}")
    for k in best:
        print(f"{k:<10}{best[k]:>12,.0f}{100 * result['mfu'][k]:>7.1f}%")
    print(f"framework overhead (1 - myria/plain): {100 * result['framework_overhead']:.1f}%")
    print(f"wrote {out}")
    return 0


def cpu_main(args) -> int:
    """--cpu-time: plain and myria, CPU seconds per steady-state step, interleaved rounds."""
    extra = [f"--training.threads={args.threads}"] if args.threads else []
    cfg = bench_config(args.config, args.steps, *extra)
    if args.threads:
        torch.set_num_threads(args.threads)
    if not (Path(cfg.data.path) / "index.json").exists():
        print(f"{cfg.data.path} is not prepared: run `myria prepare --corpus demo --out "
              f"{cfg.data.path}` first", file=sys.stderr)
        return 2
    short = max(args.warmup, 1)

    def with_steps(n: int):
        return dataclasses.replace(cfg, training=dataclasses.replace(cfg.training, steps=n))

    loops = {"plain": lambda n: plain_loop(with_steps(n), n, min(args.warmup, n - 1), False),
             "myria": lambda n: myria_loop(with_steps(n), n, min(args.warmup, n - 1))}
    cpu: dict[str, list[float]] = {k: [] for k in loops}
    wall: dict[str, list[float]] = {k: [] for k in loops}
    load = []
    for r in range(args.rounds):
        order = list(loops) if r % 2 == 0 else list(loops)[::-1]
        for name in order:
            load.append(os.getloadavg()[0])
            c, w = cpu_per_step(loops[name], short, args.steps)
            cpu[name].append(c)
            wall[name].append(w)
        print(f"round {r + 1}: " + ", ".join(f"{k} {cpu[k][-1]:.3f} CPU s/step "
                                             f"({wall[k][-1]:,.0f} tok/s wall)" for k in loops),
              flush=True)
    med = {k: statistics.median(v) for k, v in cpu.items()}
    tokens = cfg.training.global_batch * cfg.model.seq_len
    result = {
        "date": time.strftime("%Y-%m-%d"), "machine": f"{platform.machine()}, "
        f"{torch.get_num_threads()} threads, torch {torch.__version__}", "config": args.config,
        "steps": args.steps, "short_steps": short, "rounds": args.rounds,
        "load_average_1min": load,
        "cpu_s_per_step": cpu, "median_cpu_s_per_step": med,
        "tokens_per_cpu_s": {k: tokens / v for k, v in med.items()},
        "wall_tokens_per_s": wall,
        "framework_overhead_cpu": med["myria"] / med["plain"] - 1,
    }
    out = Path(args.out or ROOT / "bench" / "results" / "train_throughput_cpu.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"median CPU s per step: plain {med['plain']:.3f}, myria {med['myria']:.3f}; "
          f"framework overhead (myria/plain - 1): {100 * result['framework_overhead_cpu']:.2f}%")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
