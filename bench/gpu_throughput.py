"""`myria train` on one GPU against a plain PyTorch loop and the performance model's prediction.

    python bench/gpu_throughput.py                 # on a GPU: 0.5B, 1.5B, 3B at seq 4096, bf16
    python bench/gpu_throughput.py --cpu           # toy sizes on the CPU (CI keeps it alive)

Three Llama-style configs (about 0.5B, 1.5B and 3B parameters, sequence 4096, vocabulary
32000, bf16, micro-batch 1, 2 microbatches per step), each with per-block `torch.compile` on and
off. Each case is measured in several ways in one process, one after the other:

- **myria**: `myria.train.trainer.train` on a prepared corpus, exactly as `myria train` runs it
  (one process: FSDP2 on a one-rank mesh with the bf16 mixed-precision policy, fp32 reduction;
  the event timer on, its compute spans timed by CUDA events), checkpoint writes left out;
- **myria-nochecks**: the same with `resilience.sdc_interval = 0` (no at-rest checksums of the
  state every step, no replica or compute checks): what the checks cost;
- **myria-zero2**: the same with `training.data_parallel = zero2`: on a one-rank mesh, the
  blocks keep their gathered bf16 weights from the forward to the backward instead of gathering
  them again (what FSDP2's resharding costs where nothing is sharded);
- **plain-fsdp**: the plain loop with FSDP2 on a one-rank mesh and its bf16 mixed-precision
  policy instead of autocast (how `myria train` runs one GPU in bf16): what FSDP2 costs alone;
- **plain**: a minimal PyTorch loop of the same model class, the same optimizer
  (`myria.optim.build_optimizer`: AdamW), the same data and batch, compiled the same way, with
  `torch.autocast(bfloat16)` (fp32 weights and gradients, bf16 compute);
- **predicted**: the performance model's step time and memory for this chip and config
  (`myria.sim.perf.config_run` + `simulate`, as `myria train --dry-run` prices a config; compile
  maps to fused elementwise kernels, float8 to the fp8 GEMM precision).

Reported per case: tokens/s, MFU against the chip's dense bf16 peak from `myria.device` (the
one table of device facts), peak memory (`torch.cuda.max_memory_allocated`), the step-time
breakdown (forward, backward, clip, optimizer, data wait), and for float8 (`--float8`, 1.5B
with compile) its losses beside the bf16 run's. The first case's plain, myria and myria-nochecks
loops run one more step under torch.profiler, untimed (`--profile-loops`): how much of that step
the device was busy (under all of it: it waited for the host) and the kernels that took most.
Step times are medians over the measured steps after `--warmup` steps (compilation happens in
the first). Each config runs in its own child
process (a failure or an out-of-memory in one does not lose the others) and the children run
in priority order within `--budget-s`; what did not fit is listed as skipped. Writes JSON
(`--out`, default bench/results/gpu_<device>.json) and prints a table.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

SEQ = 4096
VOCAB = 32000
CONFIGS = {  # name: (hidden, layers, heads, kv_heads, ffn_hidden; 0 = llama's 8/3 rule)
    "0.5b": (1280, 24, 10, 5, 0),
    "1.5b": (2048, 28, 16, 8, 0),
    "3b": (3072, 28, 24, 8, 8192),
}
TOY = (64, 2, 4, 2, 0)  # --cpu
TOY_SEQ, TOY_VOCAB = 128, 1024
BREAKDOWN = ("data_wait", "forward", "backward", "grad_clip", "loss_mean", "optimizer")


def overrides(name: str, cpu: bool, compile_: bool, float8: bool, steps: int, micro: int,
              accum: int, data: str, checks: bool = True, zero2: bool = False) -> list[str]:
    hidden, layers, heads, kv, ffn = TOY if cpu else CONFIGS[name]
    return [*([] if checks else ["--resilience.sdc_interval=0"]),
            *(["--training.data_parallel=zero2"] if zero2 else []),
            f"--model.hidden={hidden}", f"--model.layers={layers}", f"--model.heads={heads}",
            f"--model.kv_heads={kv}", f"--model.ffn_hidden={ffn}",
            f"--model.vocab_size={TOY_VOCAB if cpu else VOCAB}",
            f"--model.seq_len={TOY_SEQ if cpu else SEQ}", f"--training.steps={steps}",
            f"--training.micro_batch={micro}", f"--training.global_batch={micro * accum}",
            f"--training.dtype={'float32' if cpu else 'bfloat16'}",
            f"--training.device={'cpu' if cpu else 'cuda'}",
            f"--training.float8={'true' if float8 else 'false'}",
            f"--parallel.compile={'true' if compile_ else 'false'}",
            # a peak lr the 8 steps of every loop take without a spike, so that the loops'
            # losses (float8's against bf16's) can be compared step by step
            "--optimizer.lr=3e-4", "--optimizer.warmup_steps=2", "--checkpoint.interval=0",
            "--logging.tensorboard=false", "--logging.progress=false", "--data.prefetch=2",
            f"--data.path={data}", "--training.gc_interval=0"]


# -- one case, in the child process ---------------------------------------------------------------
def _sync(device):
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()


def _reset(device) -> None:
    import gc

    import torch

    torch._dynamo.reset()  # no recompiles (and no automatic dynamic shapes) across cases
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def _peak_gb(device) -> dict:
    import torch

    if device.type != "cuda":
        return {}
    return {"peak_allocated_gb": torch.cuda.max_memory_allocated() / 1e9,
            "peak_reserved_gb": torch.cuda.max_memory_reserved() / 1e9}


def run_myria(cfg, device, warmup: int, profile: bool = False) -> dict:
    """`myria.train.trainer.train` as `myria train` runs it, without checkpoint writes.
    `profile`: its last step runs under torch.profiler (the trainer's own [profiling] window),
    is left out of the timings, and its trace gives `device_profile`."""
    from myria.train import trainer
    from myria.train.checkpoint.pipeline import CheckpointManager

    class NoSave(CheckpointManager):  # a 3B checkpoint is ~36 GB: not what is measured here
        def save(self, step, target, extra):
            return True

    _reset(device)
    with tempfile.TemporaryDirectory() as d, _patched(trainer, "CheckpointManager", NoSave):
        t0 = time.perf_counter()
        trainer.train(cfg, d)
        wall = time.perf_counter() - t0
        rows = [json.loads(x) for x in (Path(d) / "metrics.jsonl").read_text().splitlines()]
        rows = [r for r in rows if "step_time_s" in r]
        spans = _spans(Path(d) / "events" / "rank00000.jsonl")
        trace = Path(d) / "profile" / "trace_rank00000.json"
        prof = device_profile(trace) if profile and trace.exists() else None
    last = cfg.training.steps - (1 if profile else 0)
    measured = [r for r in rows if warmup < r["step"] <= last]
    out = {"step_s": statistics.median(r["step_time_s"] for r in measured),
           "step_s_all": [r["step_time_s"] for r in rows],
           "losses": [r["loss"] for r in rows], "wall_s": wall,
           "breakdown_s": {k: statistics.median(spans.get((r["step"], k), 0.0) for r in measured)
                           for k in BREAKDOWN}}
    if profile:
        out["profile"] = prof
    out.update(_peak_gb(device))
    return out


@contextlib.contextmanager
def _patched(obj, name, value):
    old = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, old)


def _spans(path: Path) -> dict:
    """{(step, name): seconds} summed over the microbatches, from a rank's event file."""
    out: dict = {}
    if not path.exists():
        return out
    for line in path.read_text().splitlines():
        e = json.loads(line)
        if "n" in e and "t1" in e:
            key = (e["s"], e["n"])
            out[key] = out.get(key, 0.0) + (e["t1"] - e["t0"]) / 1e6
    return out


DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


def device_profile(trace: Path, top: int = 10) -> dict | None:
    """Where one profiled step's device time went, from its Chrome trace (torch.profiler's):
    the window (first to last event), the time the device was busy (the union of its kernels,
    copies and sets), that share of the window (under 1: the device waited for the host), and
    the kernels taking the most of it. None when the trace has no device event (a CPU run)."""
    events = json.loads(Path(trace).read_text()).get("traceEvents", [])
    timed = [e for e in events if e.get("ph") == "X" and "dur" in e and "ts" in e]
    dev = sorted((float(e["ts"]), float(e["ts"]) + float(e["dur"]), e.get("name", "?"))
                 for e in timed if e.get("cat") in DEVICE_CATS)
    if not dev:
        return None
    lo = min(float(e["ts"]) for e in timed)
    hi = max(float(e["ts"]) + float(e["dur"]) for e in timed)
    busy, end = 0.0, -math.inf
    by_name: dict[str, float] = {}
    for a, b, name in dev:
        busy += max(0.0, b - max(a, end))
        end = max(end, b)
        key = name if len(name) <= 80 else name[:77] + "..."
        by_name[key] = by_name.get(key, 0.0) + (b - a)
    kernels = sorted(by_name.items(), key=lambda kv: -kv[1])[:top]
    return {"window_s": (hi - lo) / 1e6, "device_busy_s": busy / 1e6,
            "device_busy_share": busy / (hi - lo) if hi > lo else None,
            "device_events": len(dev),
            "top": [[k, v / 1e6, v / busy] for k, v in kernels]}


def run_plain(cfg, device, warmup: int, fsdp: bool = False, profile: bool = False) -> dict:
    """A minimal PyTorch loop: the same model class, optimizer, data and batch; autocast bf16.
    `fsdp`: the model sharded by FSDP2 on a one-rank mesh with the bf16 mixed-precision policy
    instead of autocast, as `myria train` runs one GPU in bf16 (what FSDP2 itself costs).
    `profile`: the last step runs under torch.profiler, left out of the timings."""
    import torch
    import torch.distributed as dist

    from myria.data.dataset import TokenDataset
    from myria.data.loader import BatchLoader
    from myria.models.transformer import build_model
    from myria.optim import build_optimizer
    from myria.optim.schedules import build_scheduler

    _reset(device)
    t = cfg.training
    torch.manual_seed(t.seed)
    model = build_model(cfg.model, "meta")
    if cfg.parallel.compile:
        for name, block in list(model.layers.items()):
            model.layers[name] = torch.compile(block)
    if fsdp:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29517")
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0,
                                world_size=1)
        mesh = init_device_mesh(device.type, (1,))
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
            if device.type == "cuda" and t.dtype != "float32" else None
        kw = {"mesh": mesh, **({"mp_policy": mp} if mp else {})}
        for block in model.layers.values():
            fully_shard(block, **kw)
        fully_shard(model, reshard_after_forward=False, **kw)
    model.to_empty(device=device)
    model.init_weights(t.seed)
    opt = build_optimizer(model, cfg.optimizer)
    sched = build_scheduler(opt, cfg.optimizer, t.steps)
    loader = BatchLoader(TokenDataset(cfg.data.path, cfg.model.seq_len), t.global_batch,
                         t.micro_batch, 0, 1, t.seed, prefetch=2)
    amp = torch.autocast("cuda", torch.bfloat16) if device.type == "cuda" \
        and t.dtype != "float32" and not fsdp else contextlib.nullcontext()
    cuda = device.type == "cuda"
    times, losses, parts = [], [], []
    t_start = time.perf_counter()
    prof = trace = None
    for i in range(t.steps):
        if profile and i == t.steps - 1:
            acts = [torch.profiler.ProfilerActivity.CPU] + (
                [torch.profiler.ProfilerActivity.CUDA] if device.type == "cuda" else [])
            prof = torch.profiler.profile(activities=acts)
            prof.__enter__()
        marks = []

        def mark(marks=marks):
            if cuda:
                ev = torch.cuda.Event(enable_timing=True)
                ev.record()
                marks.append(ev)
            else:
                marks.append(time.perf_counter())

        _sync(device)
        t0 = time.perf_counter()
        b = next(loader)
        x_all = b.inputs.to(device, non_blocking=True)
        y_all = b.targets.to(device, non_blocking=True)
        mark()
        total = torch.zeros((), device=device)
        fwd = bwd = 0.0
        for i in range(x_all.shape[0]):
            with amp:
                loss = model(x_all[i], y_all[i]) / x_all.shape[0]
            mark()
            loss.backward()
            mark()
            total += loss.detach()
        torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip, foreach=True)
        mark()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        mark()
        losses.append(float(total))
        _sync(device)
        times.append(time.perf_counter() - t0)
        el = [(a.elapsed_time(b) / 1e3 if cuda else b - a) for a, b in zip(marks, marks[1:])]
        fwd, bwd = sum(el[0:-2:2]), sum(el[1:-2:2])
        parts.append({"forward": fwd, "backward": bwd, "grad_clip": el[-2], "optimizer": el[-1]})
    loader.close()
    wall = time.perf_counter() - t_start
    if prof is not None:
        prof.__exit__(None, None, None)
        with tempfile.TemporaryDirectory() as d:
            prof.export_chrome_trace(str(Path(d) / "trace.json"))
            trace = device_profile(Path(d) / "trace.json")
    last = t.steps - (1 if profile else 0)
    m = parts[warmup:last]
    out = {"step_s": statistics.median(times[warmup:last]), "step_s_all": times, "losses": losses,
           "wall_s": wall,
           "breakdown_s": {k: statistics.median(p[k] for p in m) for k in m[0]}}
    if profile:
        out["profile"] = trace
    out.update(_peak_gb(device))
    del model, opt
    if fsdp:
        dist.destroy_process_group()
    return out


def predict(cfg, spec, float8: bool) -> dict:
    """The performance model's step time and memory for this config on `spec` (one GPU)."""
    import dataclasses

    from myria.sim.hardware import build_hardware
    from myria.sim.perf import config_run, simulate

    run, spec, _ = config_run(cfg, 1, spec, 1)
    kernels = dataclasses.replace(run.kernels, fused_ops=cfg.parallel.compile)
    training, cluster = run.training, run.cluster
    if float8:  # fp8 GEMMs at the device's fp8 peak (config_run pins the bf16 one)
        training = dataclasses.replace(training, precision="fp8")
        cluster = dataclasses.replace(cluster, peak_tflops=0.0)
    run = dataclasses.replace(run, kernels=kernels, training=training, cluster=cluster)
    res = simulate(run, hw=build_hardware(run.cluster, run.training.precision, spec=spec))
    return {"device": spec.name, "step_s": res.iteration_time_s, "mfu": res.mfu,
            "memory_gb": res.memory_gb_per_gpu, "memory_parts_gb": res.memory.gb(),
            "breakdown_s": {k: v for k, v in res.breakdown.items() if v}}


def child(args) -> int:
    """Measure one config, each loop of --loops, and append JSON lines to --jsonl."""
    import torch

    from myria import config as config_mod
    from myria import device as device_mod
    from myria.models.flops import model_flops_per_token, param_counts

    dev = torch.device("cpu" if args.cpu else "cuda")
    if dev.type == "cuda":
        spec = device_mod.cuda_device_spec()
        pred_spec = spec or device_mod.lookup("h100")
        peak = spec.peak_tflops("bfloat16") if spec else None
        peak_source = f"{spec.name} datasheet (myria.device)" if spec else "unknown device"
    else:  # toy run: the prediction is an H100's (no comparison), the peak this CPU's
        pred_spec = device_mod.lookup("h100")
        peak = device_mod.cpu_device_spec().peak_fp32_tflops
        peak_source = "this CPU, measured fp32 matmul (myria.device)"
    steps = args.warmup + args.steps
    kinds = [k for k in args.loops.split(",") if k]
    profiled = set((args.profile_loops or "").split(",")) - {""}
    for kind in kinds:
        float8 = kind == "myria-float8"
        prof = kind in profiled   # one more step, under the profiler, not timed
        extra = [f"--profiling.start_step={steps + 1}", "--profiling.steps=1"] \
            if prof and not kind.startswith("plain") else []
        cfg = config_mod.load(None, overrides(args.one, args.cpu, args.compile == "on", float8,
                                              steps + prof, args.micro, args.accum, args.data,
                                              checks=kind != "myria-nochecks",
                                              zero2=kind == "myria-zero2") + extra)
        cfg.checkpoint.resume = False
        fpt = model_flops_per_token(cfg.model)
        tokens = cfg.training.global_batch * cfg.model.seq_len
        row = {"config": args.one, "compile": args.compile == "on", "loop": kind,
               "params": param_counts(cfg.model).total(cfg.model.layers),
               "tokens_per_step": tokens, "peak_tflops": peak, "peak_source": peak_source}
        try:
            res = run_plain(cfg, dev, args.warmup, fsdp=kind == "plain-fsdp", profile=prof) \
                if kind.startswith("plain") else run_myria(cfg, dev, args.warmup, profile=prof)
            row.update(res)
            row["tokens_per_s"] = tokens / res["step_s"]
            row["mfu"] = fpt * row["tokens_per_s"] / (peak * 1e12) if peak else None
            row["predicted"] = predict(cfg, pred_spec, float8)
        except Exception as e:  # one line in the results, the other loops still run
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            if dev.type == "cuda" and "out of memory" in str(e):
                row.update(_peak_gb(dev))
        with open(args.jsonl, "a") as fh:
            fh.write(json.dumps(row) + "\n")
        print(f"  {args.one} compile={args.compile} {kind}: "
              + (row.get("error") or f"{row['step_s']:.4f} s/step, "
                 f"{row['tokens_per_s']:,.0f} tok/s"), flush=True)
    return 0


# -- the run: children in priority order within the budget ----------------------------------------
def prepare_data(out: Path, docs: int) -> Path:
    if not (out / "index.json").exists():
        subprocess.run([sys.executable, "-m", "myria", "prepare", "--corpus", "demo",
                        "--max-docs", str(docs), "--vocab-size", "1024", "--out", str(out),
                        "--quiet"], check=True, cwd=ROOT, env=_env())
    return out


def _env() -> dict:
    e = dict(os.environ)
    e["PYTHONPATH"] = str(ROOT / "src") + (os.pathsep + e["PYTHONPATH"]
                                           if e.get("PYTHONPATH") else "")
    return e


def plan(args) -> list[tuple[str, str, list[str]]]:
    """(config, compile on/off, loops) in priority order: the 1.5B compiled (MFU, float8)
    first, then every config eager (cheap: memory and step time against the model for all
    three), then the other configs compiled (each compile costs tens of seconds)."""
    names = ["toy"] if args.cpu else [n for n in ("1.5b", "0.5b", "3b")
                                        if n in args.configs.split(",")]
    modes = args.compile_modes.split(",")
    cases = [(n, c) for n in names for c in modes]
    rank = {("1.5b", "on"): 0}
    cases.sort(key=lambda nc: rank.get(nc, 1 if nc[1] == "off" else 2))
    out = []
    for n, comp in cases:
        extra = ["myria-float8"] if args.float8 and n == "1.5b" and comp == "on" \
            and not args.cpu else []
        out.append((n, comp, ["myria", "plain", "myria-nochecks", "myria-zero2", "plain-fsdp"]
                    + extra))
    return out


def table(rows: list[dict]) -> str:
    head = (f"{'config':<6}{'compile':>8} {'loop':<13}{'tok/s':>10}{'MFU':>7}{'step s':>9}"
            f"{'pred s':>8}{'peak GB':>9}{'pred GB':>8}  breakdown (s): fwd bwd clip opt data")
    lines = [head]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['config']:<6}{'on' if r['compile'] else 'off':>8} "
                         f"{r['loop']:<13}  {r['error'][:90]}")
            continue
        p, b = r.get("predicted", {}), r["breakdown_s"]
        mfu = f"{100 * r['mfu']:.1f}%" if r.get("mfu") is not None else "-"
        peak = r.get("peak_allocated_gb")
        lines.append(
            f"{r['config']:<6}{'on' if r['compile'] else 'off':>8} {r['loop']:<13}"
            f"{r['tokens_per_s']:>10,.0f}{mfu:>7}{r['step_s']:>9.4f}"
            f"{p.get('step_s', float('nan')):>8.3f}"
            f"{(f'{peak:.1f}' if peak is not None else '-'):>9}"
            f"{p.get('memory_gb', float('nan')):>8.1f}  "
            + " ".join(f"{b.get(k, 0.0):.4f}" for k in ("forward", "backward", "grad_clip",
                                                          "optimizer", "data_wait")))
    return "\n".join(lines)


def summary(rows: list[dict]) -> dict:
    """The issue's figures: overhead against the plain loop, prediction errors, float8."""
    by = {(r["config"], r["compile"], r["loop"]): r for r in rows if "error" not in r}
    out = {}
    for (name, comp, loop), r in by.items():
        if loop != "myria":
            continue
        key = f"{name}/compile={'on' if comp else 'off'}"
        s = {"mfu": r.get("mfu"), "step_s": r["step_s"]}
        plain = by.get((name, comp, "plain"))
        if plain:
            s["overhead_vs_plain"] = r["step_s"] / plain["step_s"] - 1
            s["max_abs_loss_diff_vs_plain"] = max(abs(a - b) for a, b in
                                                  zip(r["losses"], plain["losses"]))
        p = r.get("predicted")
        if p:
            s["step_time_error"] = r["step_s"] / p["step_s"] - 1
            if r.get("peak_allocated_gb") is not None:
                s["memory_error"] = r["peak_allocated_gb"] / p["memory_gb"] - 1
        bare = by.get((name, comp, "myria-nochecks"))
        if bare and plain:
            s["overhead_without_checks"] = bare["step_s"] / plain["step_s"] - 1
        kept = by.get((name, comp, "myria-zero2"))
        if kept and plain:
            s["overhead_zero2"] = kept["step_s"] / plain["step_s"] - 1
        sharded = by.get((name, comp, "plain-fsdp"))
        if sharded and plain:   # FSDP2 on one rank against autocast, both plain loops
            s["fsdp_one_rank_vs_autocast"] = sharded["step_s"] / plain["step_s"] - 1
        f8 = by.get((name, comp, "myria-float8"))
        if f8:
            n = min(len(f8["losses"]), len(r["losses"]))
            d = [abs(a - b) for a, b in zip(f8["losses"][:n], r["losses"][:n])]
            s["float8"] = {"speedup": r["step_s"] / f8["step_s"], "max_abs_loss_diff": max(d),
                           "max_rel_loss_diff": max(x / abs(b) for x, b in
                                                    zip(d, r["losses"][:n])),
                           "losses": f8["losses"], "bf16_losses": r["losses"]}
        out[key] = s
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu", action="store_true", help="toy sizes on the CPU (fp32)")
    ap.add_argument("--configs", default="0.5b,1.5b,3b")
    ap.add_argument("--compile-modes", default=None,
                    help="comma-separated on/off (default: on,off; --cpu: off)")
    ap.add_argument("--float8", action="store_true", help="also 1.5B with training.float8")
    ap.add_argument("--warmup", type=int, default=3, help="steps before the measured ones")
    ap.add_argument("--steps", type=int, default=5, help="measured steps")
    ap.add_argument("--micro", type=int, default=1, help="sequences per microbatch")
    ap.add_argument("--accum", type=int, default=2, help="microbatches per step")
    ap.add_argument("--budget-s", type=float, default=330.0,
                    help="wall-clock budget of the whole benchmark; cases that would start "
                    "after it are skipped")
    ap.add_argument("--profile-loops", default="plain,myria,myria-nochecks",
                    help="loops of the first case (1.5B compiled; --cpu: the toy) that run one "
                    "more step under torch.profiler, untimed: the device's busy share of that "
                    "step and its largest kernels ('' for none)")
    ap.add_argument("--data", default="", help="a prepared corpus (default: prepare one)")
    ap.add_argument("--out", default="", help="JSON file (default bench/results/gpu_<dev>.json)")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    ap.add_argument("--compile", help=argparse.SUPPRESS)
    ap.add_argument("--loops", help=argparse.SUPPRESS)
    ap.add_argument("--jsonl", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        return child(args)
    if args.compile_modes is None:
        args.compile_modes = "off" if args.cpu else "on,off"
    import torch

    if not args.cpu and not torch.cuda.is_available():
        print("no CUDA device: run with --cpu for the toy-size check", file=sys.stderr)
        return 2
    t_start = time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix="myria-gpu-bench-"))
    data = Path(args.data) if args.data else prepare_data(work / "data", 40 if args.cpu else 80)
    jsonl = work / "rows.jsonl"
    skipped = []
    for i, (name, comp, loops) in enumerate(plan(args)):
        left = args.budget_s - (time.perf_counter() - t_start)
        if left < 20:
            skipped.append(f"{name}/compile={comp}")
            continue
        cmd = [sys.executable, str(Path(__file__).resolve()), "--one", name, "--compile", comp,
               "--loops", ",".join(loops), "--jsonl", str(jsonl), "--data", str(data),
               "--warmup", str(args.warmup), "--steps", str(args.steps),
               "--micro", str(args.micro), "--accum", str(args.accum)]
        if i == 0 and args.profile_loops:
            cmd += ["--profile-loops", args.profile_loops]
        if args.cpu:
            cmd.append("--cpu")
        print(f"{name} compile={comp} ({', '.join(loops)}), {left:.0f} s left", flush=True)
        try:
            p = subprocess.run(cmd, cwd=ROOT, env=_env(), timeout=left)
            if p.returncode:
                skipped.append(f"{name}/compile={comp} (child exited {p.returncode})")
        except subprocess.TimeoutExpired:
            skipped.append(f"{name}/compile={comp} (stopped at the budget)")
    rows = [json.loads(x) for x in jsonl.read_text().splitlines()] if jsonl.exists() else []
    dev = "cpu" if args.cpu else torch.cuda.get_device_name(0)
    result = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "device": dev,
        "torch": torch.__version__, "python": platform.python_version(),
        "cuda": torch.version.cuda, "seq_len": TOY_SEQ if args.cpu else SEQ,
        "micro_batch": args.micro, "accum": args.accum, "warmup": args.warmup,
        "steps": args.steps, "wall_s": time.perf_counter() - t_start,
        "summary": summary(rows), "rows": rows, "skipped": skipped,
    }
    slug = "cpu" if args.cpu else "".join(c if c.isalnum() else "_" for c in dev.lower())
    out = Path(args.out or ROOT / "bench" / "results" / f"gpu_{slug}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"\n{dev}, torch {torch.__version__}, seq {result['seq_len']}, micro-batch "
          f"{args.micro} x {args.accum}, {args.warmup} warm-up + {args.steps} measured steps")
    print(table(rows))
    for k, s in result["summary"].items():
        parts = [f"MFU {100 * s['mfu']:.1f}%" if s.get("mfu") is not None else "MFU -"]
        parts += [f"{n} {100 * s[n]:+.1f}%" for n in (
            "overhead_vs_plain", "overhead_without_checks", "overhead_zero2",
            "fsdp_one_rank_vs_autocast", "step_time_error", "memory_error") if n in s]
        if "max_abs_loss_diff_vs_plain" in s:
            parts.append(f"max |dloss| vs plain {s['max_abs_loss_diff_vs_plain']:.4f}")
        if "float8" in s:
            parts.append(f"float8 x{s['float8']['speedup']:.2f} (max |dloss| "
                         f"{s['float8']['max_abs_loss_diff']:.4f})")
        print(f"{k}: " + ", ".join(parts))
    for r in rows:
        if "profile" not in r:
            continue
        pr = r["profile"]
        what = f"profiled step, {r['config']} compile={'on' if r['compile'] else 'off'} {r['loop']}"
        if not pr:
            print(f"{what}: no device events")
            continue
        print(f"{what}: device busy {pr['device_busy_s']:.4f} s of {pr['window_s']:.4f} s "
              f"({100 * pr['device_busy_share']:.0f}%), {pr['device_events']} device events; "
              "most time: " + "; ".join(f"{100 * sh:.0f}% {k[:48]}" for k, _, sh in pr["top"][:4]))
    if skipped:
        print("skipped: " + "; ".join(skipped))
    print(f"wrote {out}")
    return 0 if rows and all("error" not in r for r in rows) and not skipped else 1


if __name__ == "__main__":
    raise SystemExit(main())
