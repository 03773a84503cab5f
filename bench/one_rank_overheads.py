"""Host-side costs of one process's step that a GPU exposes, measured on the CPU.

    PYTHONPATH=src python bench/one_rank_overheads.py [--layers 28] [--out FILE]

On one GPU the first H200 run (bench/RESULTS.md) found `myria train` 60-141% behind a plain
loop of the same model, by a cost per step that did not grow with the model. Two suspects do
per-module or per-tensor host work that a small CPU model shows without a GPU (the second,
the at-rest checks, is measured two ways):

- **FSDP2 on a one-rank mesh** (how one GPU trains in bf16: its mixed-precision policy): the
  forward and backward of a stand-in with the 1.5B config's block count (hidden 128, sequence
  64, 2 microbatches), bare and under `fully_shard` (fp32 policy here: the hooks, not casts);
- **the at-rest ledger's host time**: its four passes a step over the same stand-in sharded
  by FSDP2 on one rank, after an AdamW step, through the device path; and the gradients'
  record taken in one pass after the backward against one checksum per gradient as it is
  reduced;
- **the at-rest checksums** (`myria.train.checksums.sums`, four passes a step): the operations
  that issue a kernel on a device for the 1.5B config's state tensors (3 per parameter,
  shapes shrunk), one reduction per tensor against the grouped device path, counted with
  torch's profiler on the CPU.

Writes JSON (default bench/results/one_rank_overheads.json) and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from myria import config as config_mod  # noqa: E402
from myria.models.transformer import build_model  # noqa: E402
from myria.train import checksums  # noqa: E402

KERNEL_OPS = {"aten::sum", "aten::copy_", "aten::cat", "aten::index_add_", "aten::index_put_",
              "aten::remainder", "aten::add", "aten::sub", "aten::fill_", "aten::zero_",
              "aten::repeat_interleave", "aten::arange", "aten::stack"}


def _stand_in(layers: int):
    """The config of the launch-bound stand-in (the 1.5B config's block count, tiny shapes),
    with this process's one-rank gloo group started."""
    cfg = config_mod.load(None, [f"--model.layers={layers}", "--model.hidden=128",
                                 "--model.heads=16", "--model.kv_heads=8", "--model.seq_len=64",
                                 "--model.vocab_size=8192"])
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29541")
    dist.init_process_group("gloo", rank=0, world_size=1)
    return cfg


def fsdp_cost(layers: int, steps: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    cfg = _stand_in(layers)
    x = torch.randint(0, 8192, (1, 64))

    def make(fsdp: bool):
        m = build_model(cfg.model, "meta")
        if fsdp:
            mesh = init_device_mesh("cpu", (1,))
            mp = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
            for b in m.layers.values():
                fully_shard(b, mesh=mesh, mp_policy=mp)
            fully_shard(m, mesh=mesh, mp_policy=mp, reshard_after_forward=False)
        m.to_empty(device="cpu")
        m.init_weights(0)
        return m

    out: dict[str, list[float]] = {"bare": [], "fsdp": []}
    for _ in range(2):   # alternate: a drift of the host's speed hits both
        for name in out:
            m = make(name == "fsdp")
            times = []
            for _ in range(steps):
                t0 = time.perf_counter()
                for _ in range(2):
                    m(x, x).backward()
                times.append(time.perf_counter() - t0)
            out[name].append(statistics.median(times[2:]))
    dist.destroy_process_group()
    bare, sharded = min(out["bare"]), min(out["fsdp"])
    return {"layers": layers, "bare_s": bare, "fsdp_s": sharded, "rounds": out,
            "extra_per_module_microbatch_ms": 1e3 * (sharded - bare) / ((layers + 1) * 2)}


def ledger_cost(layers: int, steps: int) -> dict:
    """Host time of the at-rest ledger's four passes a step (record and verify the state,
    record and verify the gradients) over a one-rank FSDP2 stand-in after an AdamW step, on the
    device path (`checksums._gathered`, here on host tensors; `SMALL` lowered so that the
    stand-in's matrices take one reduction each, as a real model's do on a GPU)."""
    from types import SimpleNamespace

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from myria.train import sdc

    cfg = _stand_in(layers)
    m = build_model(cfg.model, "meta")
    mesh = init_device_mesh("cpu", (1,))
    for b in m.layers.values():
        fully_shard(b, mesh=mesh)
    fully_shard(m, mesh=mesh, reshard_after_forward=False)
    m.to_empty(device="cpu")
    m.init_weights(0)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    x = torch.randint(0, 8192, (1, 64))
    m(x, x).backward()
    opt.step()
    cpu = torch.device("cpu")
    small, saved, saved_one = checksums.SMALL, sdc.sums, sdc.one_sum
    checksums.SMALL = 128
    sdc.sums = lambda ts: checksums._gathered(ts, [], cpu)
    sdc.one_sum = checksums._device_sum
    try:
        ledger = sdc.StateLedger(SimpleNamespace(parts=[m], optimizers=[opt]))

        def step():
            ledger.verify_state()
            ledger.record_grads()
            ledger.verify_grads()
            ledger.record_state()

        step()
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t0)
        n_state, n_grads = len(ledger.params() + ledger.optim()), len(ledger.grads())
        # the gradients' record: one grouped pass after the backward, or a checksum per
        # gradient as FSDP2's reduction writes it (the hooks `watch_grads` registers; called
        # here directly) gathered after the backward
        grads = [p for _, p in ledger._owned() if p.grad is not None]
        record = {"after the backward": [], "as reduced": []}
        for _ in range(steps):
            t0 = time.perf_counter()
            ledger.record_grads()
            record["after the backward"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            for p in grads:
                ledger._written(p)
            ledger.record_grads()
            record["as reduced"].append(time.perf_counter() - t0)
    finally:
        checksums.SMALL, sdc.sums, sdc.one_sum = small, saved, saved_one
        dist.destroy_process_group()
    return {"layers": layers, "state_tensors": n_state, "gradients": n_grads,
            "ms_per_step": 1e3 * statistics.median(times),
            "record_grads_ms": {k: 1e3 * statistics.median(v) for k, v in record.items()}}


def checksum_ops(layers: int) -> dict:
    from torch.profiler import ProfilerActivity, profile

    def one_per_tensor(ts):
        out = []
        for t in ts:
            width, acc = checksums._width(t)
            out.append(t.detach().reshape(-1).view(width).sum(dtype=acc).to(torch.int64))
        return torch.stack(out)

    hidden, ffn = 16, 43
    shapes = [(hidden, hidden)] * 2 + [(hidden // 2, hidden)] * 2 + [(ffn, hidden)] * 2 + \
        [(hidden, ffn)] + [(hidden,)] * 2
    ts = [torch.randn(s) for _ in range(layers) for s in shapes for _ in range(3)]
    cpu = torch.device("cpu")
    ways = {"one reduction per tensor": lambda: one_per_tensor(ts),
            "grouped (myria)": lambda: checksums._gathered(ts, [], cpu)}
    assert ways["one reduction per tensor"]().tolist() == ways["grouped (myria)"]().tolist()
    out = {"tensors": len(ts)}
    for name, f in ways.items():
        with profile(activities=[ProfilerActivity.CPU]) as p:
            f()
        out[name] = sum(1 for e in p.events() if e.name in KERNEL_OPS)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=28, help="blocks (the 1.5B config's: 28)")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" /
                                         "one_rank_overheads.json"))
    args = ap.parse_args()
    f = fsdp_cost(args.layers, args.steps)
    led = ledger_cost(args.layers, args.steps)
    c = checksum_ops(args.layers)
    res = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "machine": f"{platform.machine()}, {torch.get_num_threads()} threads, "
                      f"torch {torch.__version__}, load {os.getloadavg()[0]:.1f}",
           "fsdp_one_rank": f, "ledger_host": led, "checksum_kernel_ops": c}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1))
    print(f"2 microbatches forward+backward, {f['layers']} blocks: bare {1e3 * f['bare_s']:.1f} "
          f"ms, FSDP2 one rank {1e3 * f['fsdp_s']:.1f} ms "
          f"(+{f['extra_per_module_microbatch_ms']:.2f} ms per module and microbatch)")
    print(f"at-rest ledger, 4 passes over {led['state_tensors']} state tensors and "
          f"{led['gradients']} gradients: {led['ms_per_step']:.1f} ms of host time a step")
    print("  of which the gradients' record, " + ", ".join(
        f"{k}: {v:.1f} ms" for k, v in led["record_grads_ms"].items()))
    print(f"checksums of {c['tensors']} state tensors, kernel-issuing operations: "
          + ", ".join(f"{k} {v}" for k, v in c.items() if k != "tensors"))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
