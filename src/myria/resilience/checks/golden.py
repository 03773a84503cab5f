"""Golden tests: computations whose exact answer is known in advance, so a wrong bit is a fault
and never rounding (the silent-data-corruption screen of a host, as the Llama 3 team and
MegaScale run before a host joins a job).

- integer GEMM: small-integer matrices whose products and sums are exact in the dtype's
  significand, compared with the same product in int64, element for element;
- reduction: a sum of powers of two that every summation order computes exactly;
- softmax: rows of equal logits give exactly 1/n for n a power of two, and rows of one large and
  many very negative logits give exactly one-hot.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from myria.resilience.checks.compute import matmul, sync
from myria.resilience.checks.hooks import DoctorFault, find_fault
from myria.resilience.checks.report import Check

# Integer ranges keeping every partial sum exact: |a||b|k <= 2^significand bits.
_INT_RANGE = {"float32": (8, 1024), "bfloat16": (2, 32), "float16": (2, 128)}   # (|max|, k)


def check_golden(device: Any, dtype: str, *, rank: int | None = None,
                 faults: Sequence[DoctorFault] = (), seed: int = 0) -> Check:
    import torch

    wrong = find_fault(faults, "wrong-gemm", rank)
    dt = getattr(torch, dtype)
    gen = torch.Generator().manual_seed(4321 + seed)
    failed: list[str] = []

    lim, k = _INT_RANGE[dtype]
    a = torch.randint(-lim, lim + 1, (96, k), generator=gen)
    b = torch.randint(-lim, lim + 1, (k, 80), generator=gen)
    c = torch.empty(96, 80, dtype=dt, device=device)
    matmul(a.to(dt).to(device), b.to(dt).to(device), c, device=device, wrong=wrong)
    sync(device)
    bad = int((c.cpu().to(torch.int64) != a @ b).sum())
    if bad:
        failed.append(f"integer GEMM: {bad} of {c.numel()} elements differ from the exact "
                      "int64 product")

    n = 1 << 16
    x = torch.full((n,), 2.0**-8, dtype=torch.float32, device=device)
    s = float(x.sum())
    if s != n * 2.0**-8:
        failed.append(f"reduction: sum of {n} x 2^-8 = {s!r}, exactly {n * 2.0**-8!r} expected")

    logits = torch.zeros(8, 64, dtype=torch.float32, device=device)
    p = torch.softmax(logits, dim=-1)
    if not bool((p == 1.0 / 64).all()):
        failed.append("softmax: equal logits did not give exactly 1/64")
    one_hot = torch.full((4, 64), -1e4, dtype=torch.float32, device=device)
    one_hot[:, 3] = 10.0
    q = torch.softmax(one_hot, dim=-1)
    if not bool((q[:, 3] == 1.0).all() and (q.sum(dim=-1) == 1.0).all()):
        failed.append("softmax: a dominant logit did not give exactly one-hot")

    hook = f" (fault hook {wrong.describe()} active)" if wrong else ""
    if failed:
        return Check("golden", "fail", "; ".join(failed) + hook, rank, float(len(failed)), 0.0,
                     "wrong answers", {"dtype": dtype, "failed": failed})
    return Check("golden", "pass", f"integer GEMM ({dtype}, k={k}), reduction and softmax give "
                 f"the exact known answers{hook}", rank, 0.0, 0.0, "wrong answers",
                 {"dtype": dtype})
