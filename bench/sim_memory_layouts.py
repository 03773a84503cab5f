"""The memory model against measured per-rank peaks of multi-process myria runs on this CPU.

    PYTHONPATH=src .venv/bin/python bench/sim_memory_layouts.py

Each configuration starts 2 processes (gloo), builds the trainer's `Engine` for the layout
(pipeline, FSDP or DDP, recomputation), runs one training step (so optimizer state exists and
gradients are freed, as between steps), then profiles the next step's forward and backward
(`Engine.forward_backward`, all microbatches) with torch's memory profiler on every rank: the
peak of live tensor bytes above the step's start. The model's figure for the busiest rank is
what `myria.sim.perf` prices for the same config (`config_run`): activations + temporaries +
gradients (allocated during the step; under FSDP2 sharded, plus the unsharded accumulation
buffer when gradients accumulate over microbatches). Writes bench/results/sim_memory_layouts.json.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench" / "results" / "sim_memory_layouts.json"
BASE = ["--model.vocab_size=512", "--model.layers=4", "--model.hidden=128", "--model.heads=4",
        "--model.kv_heads=2", "--model.seq_len=256", "--training.micro_batch=2",
        "--logging.tensorboard=false"]
CASES = {
    "pp2-1f1b-none": ["--parallel.pp=2", "--training.global_batch=8"],
    "pp2-1f1b-full": ["--parallel.pp=2", "--training.global_batch=8",
                      "--parallel.activation_checkpoint=full"],
    "pp2-gpipe-none": ["--parallel.pp=2", "--parallel.schedule=gpipe",
                       "--training.global_batch=8"],
    "fsdp2-none": ["--training.global_batch=4"],
    "fsdp2-selective": ["--training.global_batch=4", "--parallel.activation_checkpoint=selective"],
    "ddp2-none": ["--training.global_batch=4", "--training.data_parallel=ddp"],
}


def _rank(rank: int, world: int, port: int, args: list[str], q) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    from torch.profiler import ProfilerActivity, profile

    from myria import config as config_mod
    from myria.train import distributed
    from myria.train.engine import Engine

    env = distributed.init("cpu")
    torch.set_num_threads(1)
    cfg = config_mod.load(None, BASE + args)
    from myria.layout import Layout
    from myria.parallel.dims import ParallelDims

    dims = ParallelDims.build(Layout.resolve(cfg.parallel, world), "cpu")
    torch.manual_seed(0)
    eng = Engine(cfg, dims, env.device)
    m = cfg.model
    x = torch.randint(0, m.vocab_size, (eng.microbatches, cfg.training.micro_batch, m.seq_len + 1))
    eng.forward_backward(x[..., :-1], x[..., 1:])
    eng.step()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        eng.forward_backward(x[..., :-1], x[..., 1:])
    events = sorted((e for e in prof.profiler.kineto_results.events()
                     if e.name() == "[memory]"), key=lambda e: e.start_ns())
    live = peak = 0
    for e in events:
        live += e.nbytes()
        peak = max(peak, live)
    q.put((rank, peak))
    distributed.shutdown()


def measure(args: list[str], world: int = 2) -> list[int]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, world, port, args, q)) for r in range(world)]
    for p in procs:
        p.start()
    out = dict(q.get(timeout=600) for _ in procs)
    for p in procs:
        p.join()
    return [out[r] for r in range(world)]


def model(args: list[str], world: int = 2) -> dict:
    from myria import config as config_mod
    from myria.device import DeviceSpec
    from myria.sim.perf import config_run, simulate

    cfg = config_mod.load(None, BASE + args)
    cpu = DeviceSpec("cpu", 0.2, 0.2, 16.0, 20.0, 0.0, source="described")
    run, _, _ = config_run(cfg, world, cpu)
    mem = simulate(run).memory
    # gradients are allocated inside the profiled step (freed by the previous step's
    # zero_grad) and are live at the activation peak only when a later microbatch runs after
    # an earlier one's backward; DDP's gradients are views of its persistent buckets
    accum = run.training.global_batch // (run.dp * run.training.micro_batch)
    grads = mem.gradients if accum > 1 and cfg.training.data_parallel != "ddp" else 0.0
    return {"stage": mem.stage, "activations": mem.activations, "temporary": mem.temporary,
            "gradients": grads, "step": mem.activations + mem.temporary + grads}


def main() -> int:
    rows = []
    for name, args in CASES.items():
        peaks = measure(args)
        pred = model(args)
        err = pred["step"] / max(peaks) - 1
        rows.append({"case": name, "args": args, "measured_per_rank": peaks, "model": pred,
                     "error": err})
        print(f"{name:<18} measured per rank {[round(p / 1e6, 2) for p in peaks]} MB, model "
              f"{pred['step'] / 1e6:.2f} MB ({pred['stage']}: act {pred['activations'] / 1e6:.2f}"
              f" temp {pred['temporary'] / 1e6:.2f} grads {pred['gradients'] / 1e6:.2f}) "
              f"error {err:+.1%}", flush=True)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps({"command": "bench/sim_memory_layouts.py",
                               "date": time.strftime("%Y-%m-%d"), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
