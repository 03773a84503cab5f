"""GEMM checks: correctness against a float64 reference of the same (rounded) inputs, with the
rounding bound `2 * (k * u_fp32 + u_out) * (|A| |B|)_ij`; throughput as the best TFLOP/s of
repeated matmuls."""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import Any

from myria.resilience.checks.hooks import DoctorFault, find_fault
from myria.resilience.checks.report import Check

_UNIT_ROUNDOFF = {"float32": 2.0**-24, "bfloat16": 2.0**-8, "float16": 2.0**-11}


def sync(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def matmul(a: Any, b: Any, out: Any, *, device: Any, wrong: DoctorFault | None = None,
            slow: DoctorFault | None = None, expected_tflops: float | None = None) -> None:
    """out = a @ b, through the fault hook when one is active."""
    import torch

    t0 = time.perf_counter()
    torch.matmul(a, b, out=out)
    if wrong is not None:
        # Silent data corruption of one element, well above any rounding error.
        flat = out.view(-1)
        i = flat.numel() // 2 + 1 if flat.numel() > 1 else 0
        flat[i] += 1.0 + float(out.abs().max())
    if slow is not None:
        sync(device)
        elapsed = time.perf_counter() - t0
        flops = 2.0 * a.shape[0] * a.shape[1] * b.shape[1]
        target = elapsed / slow.fraction
        if expected_tflops:
            target = max(target, flops / (slow.fraction * expected_tflops * 1e12))
        time.sleep(max(0.0, target - elapsed))


def gemm_error_bound(k: int, dtype: str) -> float:
    """Bound on |C - C64|_ij / (|A||B|)_ij: fp32 accumulation over k terms, output rounding, x2."""
    return 2.0 * (k * _UNIT_ROUNDOFF["float32"] + _UNIT_ROUNDOFF[dtype])


GEMM_SHAPES = ((384, 1024, 256), (257, 1031, 129))   # (m, k, n), one with odd sizes


def check_gemm_correctness(device: Any, dtype: str, *, rank: int | None = None,
                           faults: Sequence[DoctorFault] = (), bound: float | None = None,
                           seed: int = 0) -> Check:
    """GEMM in `dtype` vs a float64 reference of the same inputs, with a rounding-error bound."""
    import torch

    wrong = find_fault(faults, "wrong-gemm", rank)
    gen = torch.Generator().manual_seed(1234 + seed)
    dt = getattr(torch, dtype)
    worst, worst_at, worst_bound, rel_fro, finite = 0.0, "", 0.0, 0.0, True
    for m, k, n in GEMM_SHAPES:
        a = torch.randn(m, k, generator=gen).to(dt)
        b = torch.randn(k, n, generator=gen).to(dt)
        a_d, b_d = a.to(device), b.to(device)
        c = torch.empty(m, n, dtype=dt, device=device)
        matmul(a_d, b_d, c, device=device, wrong=wrong)
        sync(device)
        a64, b64, c64 = a.double(), b.double(), c.cpu().double()
        ref = a64 @ b64
        scale = a64.abs() @ b64.abs()
        ratio = (c64 - ref).abs() / scale.clamp_min(1e-300)
        lim = bound if bound is not None else gemm_error_bound(k, dtype)
        if not bool(torch.isfinite(c64).all()):
            finite = False
        r = float(ratio.max())
        if not math.isfinite(r) or r / lim > (worst / worst_bound if worst_bound else -1):
            idx = int(ratio.argmax())
            worst, worst_bound = r, lim
            worst_at = f"shape {m}x{k}x{n} element ({idx // n}, {idx % n})"
        rel_fro = max(rel_fro, float((c64 - ref).norm() / ref.norm()))
    hook = f" (fault hook {wrong.describe()} active)" if wrong else ""
    ok = finite and math.isfinite(worst) and worst <= worst_bound
    details = {"dtype": dtype, "shapes": [list(s) for s in GEMM_SHAPES],
               "max_scaled_error": worst, "bound": worst_bound, "relative_frobenius": rel_fro,
               "worst_element": worst_at, "fault": wrong.describe() if wrong else None}
    if not finite:
        reason = f"non-finite values in the {dtype} GEMM result{hook}"
    elif ok:
        reason = (f"max |C-C64|/(|A||B|) = {worst:.2g} <= bound {worst_bound:.2g} "
                  f"({dtype}, {len(GEMM_SHAPES)} shapes){hook}")
    else:
        reason = (f"max |C-C64|/(|A||B|) = {worst:.2g} > bound {worst_bound:.2g} at "
                  f"{worst_at} ({dtype}){hook}")
    return Check("gemm-correctness", "pass" if ok else "fail", reason, rank, worst, worst_bound,
                 "scaled error", details)


def measure_gemm_tflops(device: Any, dtype: str, *, n: int, seconds: float, reps: int,
                        slow: DoctorFault | None = None,
                        expected_tflops: float | None = None) -> float:
    """Best TFLOP/s of groups of `reps` n x n x n matmuls within about `seconds` (>= 2 groups)."""
    import torch

    from myria.device import operands, time_matmul

    a, b = operands(n, getattr(torch, dtype), device)
    c = torch.empty_like(a)
    times = time_matmul(a, b, c, seconds=seconds, groups=2, reps=reps,
                        call=lambda x, y, o: matmul(x, y, o, device=device, slow=slow,
                                                    expected_tflops=expected_tflops),
                        sync=lambda: sync(device))
    return 2.0 * n**3 / min(times) / 1e12


