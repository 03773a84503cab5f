"""What cutting a tensor-parallel GEMM into pieces costs on this GPU: the shape prior measured.

    python bench/gpu_gemm_shapes.py --out gemm.json   # on a GPU (bench/gpu/run.sh runs it)
    python bench/gpu_gemm_shapes.py --cpu             # toy sizes on the CPU (CI keeps it alive)

The performance model discounts a GEMM of dims (M, N, K) by prod d / (d + GEMM_HALF_DIM)
(`op_timing.shape_factor`; `Efficiency.half_dim`, a prior of 32 that the calibration runs cannot
pin, since they all run long GEMMs). The tensor-parallel overlap rests on it: TransformerEngine's
ring exchange cuts each tensor-parallel GEMM into tp pieces of M / tp rows (256 of 2,048 for
MegaScale's 175B at tp 8), and the prior charges those pieces ~11% more time than the whole
GEMM, which takes back most of what hiding the collectives gains (bench/sim_ladder.py, the
"tp overlap" rung). Only a GPU can measure it.

Measured here, in bf16 on the device in use:

- **pieces**: the forward GEMMs of one layer of the ladder's model (GPT-3 175B shape, tp 8,
  sequence parallel, micro-batch 1: the (M, N, K) of `operators.layer_ops`, the model's own
  operator list), each timed whole and as its tp pieces one after the other (the ring
  exchange's order), beside the model's predicted ratio at the prior;
- **sweep**: one (N, K) of those over M = 64 .. 8,192 rows, and the GEMM_HALF_DIM that fits
  the measured rates best (least squares on the log-rates, the large-GEMM rate free), with its
  residual, so that the prior can be replaced by this device's figure.

Times are medians of CUDA-synchronised groups (`myria.device.time_matmul`, the one GEMM timer).
`--cpu` runs the same code at toy sizes and states that CPU figures say nothing of a GPU.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

TP = 8
SWEEP_M = (64, 128, 256, 512, 1024, 2048, 4096, 8192)
TOY = {"hidden": 256, "tp": 4, "seq": 256, "sweep": (16, 32, 64, 128, 256)}   # --cpu


def ladder_gemms(cpu: bool) -> tuple[int, list[tuple[str, int, int, int]]]:
    """(tp, [(name, M, N, K)]) of the forward GEMMs of one layer the ring exchange cuts: the
    ladder's model (MegaScale 175B, expert_layouts.toml) as the performance model shapes it."""
    from myria.sim import runspec
    from myria.sim.operators import layer_ops, layer_shape

    path = runspec.calibration_path().with_name("expert_layouts.toml")
    run = {r.name: r for r in runspec.load(path)}["megascale-175b"]
    cfg = runspec.model_config_of(run.model)
    tp = TP
    if cpu:
        import dataclasses

        tp = TOY["tp"]
        cfg = dataclasses.replace(cfg, hidden=TOY["hidden"], heads=4, kv_heads=4,
                                  ffn_hidden=4 * TOY["hidden"], seq_len=TOY["seq"])
    shape = layer_shape(cfg, 1, tp=tp, sp=True, flash=True)
    out = []
    for op in layer_ops(shape):
        if op.kind == "gemm" and op.phase == "fwd" and op.batch == 1:
            m, n, k = (int(round(d)) for d in op.dims)
            out.append((op.name, m, n, k))
    return tp, out


def gemm_seconds(m: int, n: int, k: int, device, dtype, seconds: float) -> float:
    """Median seconds of one (m x k) @ (k x n) product on `device`."""
    import torch

    from myria.device import time_matmul

    a = torch.randn(m, k, device=device, dtype=dtype)
    b = torch.randn(k, n, device=device, dtype=dtype)
    out = torch.empty(m, n, device=device, dtype=dtype)
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else None
    # calls per timed group: ~2 TFLOP (a few ms on an H100) so that the synchronisation
    # after each group is under 1% of it even for 64-row GEMMs; ~0.1 GFLOP on a CPU
    reps = max(1, min(1000, int((2e12 if cuda else 1e8) / (2.0 * m * n * k))))
    times = time_matmul(a, b, out, seconds=seconds, groups=5, reps=reps, warmup_calls=3,
                        sync=sync)
    return statistics.median(times)


def fit_half_dim(points: list[tuple[tuple[int, int, int], float]]) -> dict:
    """The GEMM_HALF_DIM h and large-GEMM rate r that best explain measured rates
    (dims, FLOP/s) as r x prod d / (d + h): least squares on log-rates, r closed-form for each
    h; h on a grid (0 .. 1,024), refined around the best point by scipy's bounded search (the
    grid first, so that a sum with several dips cannot trap it); returns h, r and the rms
    relative residual."""
    from scipy.optimize import minimize_scalar

    from myria.sim.op_timing import shape_factor

    def score(h: float) -> tuple[float, float]:
        logs = [math.log(rate / shape_factor(d, h)) for d, rate in points]
        log_r = sum(logs) / len(logs)
        return sum((x - log_r) ** 2 for x in logs), math.exp(log_r)

    grid = [0.5 * i for i in range(0, 2049)]
    best = min(grid, key=lambda h: score(h)[0])
    found = minimize_scalar(lambda h: score(h)[0], bounds=(max(0.0, best - 0.5), best + 0.5),
                            method="bounded", options={"xatol": 1e-4})
    h = float(found.x) if found.fun <= score(best)[0] else best
    sse, r = score(h)
    return {"half_dim": h, "large_gemm_flops": r,
            "rms_log_residual": math.sqrt(sse / len(points))}


def measure(cpu: bool, seconds: float) -> dict:
    import torch

    from myria.sim.op_timing import shape_factor
    from myria.sim.operators import DEFAULT_EFFICIENCY

    device = torch.device("cpu" if cpu else "cuda")
    dtype = torch.float32 if cpu else torch.bfloat16
    prior = DEFAULT_EFFICIENCY.half_dim
    tp, gemms = ladder_gemms(cpu)
    pieces = []
    for name, m, n, k in gemms:
        whole = gemm_seconds(m, n, k, device, dtype, seconds)
        piece = gemm_seconds(m // tp, n, k, device, dtype, seconds)
        model = shape_factor((m, n, k), prior) / shape_factor((m // tp, n, k), prior)
        pieces.append({"gemm": name, "m": m, "n": n, "k": k, "whole_s": whole,
                       "pieces_s": tp * piece, "measured_ratio": tp * piece / whole,
                       "model_ratio_at_prior": model,
                       "whole_tflops": 2.0 * m * n * k / whole / 1e12})
    # the sweep: the largest (N, K) of the layer (the MLP's first GEMM)
    _, _, n, k = max(gemms, key=lambda g: g[2] * g[3])
    sweep_m = TOY["sweep"] if cpu else SWEEP_M
    sweep = []
    for m in sweep_m:
        t = gemm_seconds(m, n, k, device, dtype, seconds)
        sweep.append({"m": m, "n": n, "k": k, "seconds": t, "tflops": 2.0 * m * n * k / t / 1e12})
    fit = fit_half_dim([((p["m"], p["n"], p["k"]), p["tflops"] * 1e12) for p in sweep])
    whole = sum(p["whole_s"] for p in pieces)
    cut = sum(p["pieces_s"] for p in pieces)
    return {"tp": tp, "dtype": str(dtype).removeprefix("torch."), "prior_half_dim": prior,
            "pieces": pieces, "layer_measured_ratio": cut / whole,
            "layer_model_ratio_at_prior": sum(p["whole_s"] * p["model_ratio_at_prior"]
                                              for p in pieces) / whole,
            "sweep": sweep, "fit": fit}


def device_name(cpu: bool) -> str:
    import torch

    return (platform.processor() or "cpu") if cpu else torch.cuda.get_device_name(0)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cpu", action="store_true",
                    help="toy sizes on the CPU: checks the code, says nothing of a GPU")
    ap.add_argument("--seconds", type=float, default=0.2, help="timing per shape (default 0.2)")
    ap.add_argument("--out", help="write the figures to this JSON file")
    args = ap.parse_args(argv)
    import torch

    if not args.cpu and not torch.cuda.is_available():
        print("no CUDA device: run with --cpu to check the code path", file=sys.stderr)
        return 2
    t0 = time.time()
    res = measure(args.cpu, args.seconds)
    res.update(device=device_name(args.cpu), torch=torch.__version__,
               date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
               wall_s=round(time.time() - t0, 1))
    print(f"{res['device']}, torch {res['torch']}, {res['dtype']}: one layer's forward GEMMs "
          f"whole and as {res['tp']} pieces")
    print(f"| GEMM | M x N x K | whole TFLOP/s | pieces / whole | model at GEMM_HALF_DIM "
          f"{res['prior_half_dim']:g} |")
    print("|---|---|---|---|---|")
    for p in res["pieces"]:
        print(f"| {p['gemm']} | {p['m']} x {p['n']} x {p['k']} | {p['whole_tflops']:.1f} | "
              f"{p['measured_ratio']:.3f} | {p['model_ratio_at_prior']:.3f} |")
    print(f"| layer | | | {res['layer_measured_ratio']:.3f} | "
          f"{res['layer_model_ratio_at_prior']:.3f} |")
    f = res["fit"]
    print("M sweep (N x K = {n} x {k}): ".format(**res["sweep"][0])
          + ", ".join(f"{p['m']}: {p['tflops']:.1f}" for p in res["sweep"]) + " TFLOP/s")
    print(f"fitted GEMM_HALF_DIM = {f['half_dim']:.1f} (large-GEMM rate "
          f"{f['large_gemm_flops'] / 1e12:.1f} TFLOP/s, rms log residual "
          f"{f['rms_log_residual']:.3f}); the model's prior: {res['prior_half_dim']:g}")
    if args.cpu:
        print("(CPU figures: they check the code and say nothing of a GPU)")
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
