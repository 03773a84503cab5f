"""The MoE experts on CUDA: torch's grouped GEMM (bf16, each expert's rows at 16-row
boundaries) passes its one-time check, equals the per-expert loop, and is timed beside it
(recorded; the CPU cases of the same contract: tests/models/test_moe.py)."""

from __future__ import annotations

import torch

from tests.gpu.conftest import GPU, cuda_seconds

pytestmark = GPU

# 64 experts of a 2,048-wide model with SwiGLU's 1,408-wide hidden layer, 8,192 routed rows
E, H, F, ROWS = 64, 2048, 1408, 8192


def test_grouped_experts_on_cuda_equal_the_loop_and_are_timed(record_property):
    from myria.models import moe

    torch.manual_seed(0)
    dev = torch.device("cuda")
    counts = torch.bincount(torch.randint(0, E, (ROWS,), device=dev), minlength=E)
    counts[5] = 0   # an expert without rows
    x = torch.randn(int(counts.sum()), H, device=dev).to(torch.bfloat16).requires_grad_()
    ws = [(torch.randn(E, *s, device=dev) * 0.02).to(torch.bfloat16).requires_grad_()
          for s in ((F, H), (H, F), (F, H))]
    assert moe.grouped_ok(x, *ws), "the grouped GEMM's check failed on this device"
    assert moe._CUDA_GROUPED is True
    leaves = [x, *ws]
    dy = torch.randn(x.shape, device=dev).to(torch.bfloat16)

    def grouped():
        y = moe.grouped_expert_mlps(x, counts, *ws, None, None, align=moe.CUDA_GROUP_ALIGN)
        return y, torch.autograd.grad(y, leaves, dy)

    def looped():
        y = moe.looped_expert_mlps(x, counts.tolist(), *ws, None, None)
        return y, torch.autograd.grad(y, leaves, dy)

    got, ref = grouped(), looped()
    for a, b in zip((got[0], *got[1]), (ref[0], *ref[1]), strict=True):
        assert (a.float() - b.float()).abs().max() <= 2e-2 * b.float().abs().max()
    t_grouped, t_loop = cuda_seconds(grouped), cuda_seconds(looped)
    record_property("moe_grouped_s", t_grouped)
    record_property("moe_loop_s", t_loop)


def test_compiled_grouped_experts_on_cuda_equal_the_loop(record_property):
    """Under torch.compile (a compiled block) the experts still run the grouped kernel on CUDA,
    output and gradients within 2% of the per-expert loop."""
    import time

    from myria.models import moe

    torch.manual_seed(0)
    dev = torch.device("cuda")
    e, h, f = 8, 256, 512
    counts = torch.bincount(torch.randint(0, e, (1024,), device=dev), minlength=e)
    counts[2] = 0
    x = torch.randn(int(counts.sum()), h, device=dev).to(torch.bfloat16).requires_grad_()
    ws = [(torch.randn(e, *s, device=dev) * 0.05).to(torch.bfloat16).requires_grad_()
          for s in ((f, h), (h, f), (f, h))]
    t0 = time.perf_counter()
    got = torch.compile(moe.expert_mlps)(x, counts, *ws, None, None)
    record_property("moe_compile_first_call_s", time.perf_counter() - t0)
    ref = moe.looped_expert_mlps(x, counts.tolist(), *ws, None, None)
    dy = torch.randn(ref.shape, device=dev).to(torch.bfloat16)
    g_got = torch.autograd.grad(got, [x, *ws], dy)
    g_ref = torch.autograd.grad(ref, [x, *ws], dy)
    for a, b in zip((got, *g_got), (ref, *g_ref), strict=True):
        assert (a.float() - b.float()).abs().max() <= 2e-2 * b.float().abs().max()
