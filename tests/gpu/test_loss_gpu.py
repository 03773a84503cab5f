"""The fused linear + cross-entropy on CUDA, at the output layer of bench/gpu_throughput.py's 1.5B
config (4,096 tokens, hidden 2,048, vocabulary 32,000): every GEMM in bf16, the gradients of the
unfused bf16 computation, and its time against that computation's (recorded; the CPU cases of
the same contract: tests/models/test_model.py)."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F

from tests.gpu.conftest import GPU, cuda_seconds
from tests.models.test_model import _GemmDtypes

pytestmark = GPU

T, H, V = 4096, 2048, 32000


@pytest.mark.parametrize("autocast", [False, True], ids=["bf16", "autocast"])
def test_fused_loss_on_cuda_runs_bf16_gemms_as_fast_as_unfused(autocast, record_property):
    from myria.models.loss import fused_linear_cross_entropy

    torch.manual_seed(0)
    dt = torch.float32 if autocast else torch.bfloat16
    h = torch.randn(T, H, device="cuda").to(dt).requires_grad_()
    w = (torch.randn(V, H, device="cuda") * 0.02).to(dt).requires_grad_()
    t = torch.randint(0, V, (T,), device="cuda")
    amp = torch.autocast("cuda", torch.bfloat16) if autocast else contextlib.nullcontext()

    def fused():
        with amp:
            out = fused_linear_cross_entropy(h, w, t)
        return out, torch.autograd.grad(out, (h, w))

    def unfused():
        with amp:
            out = F.cross_entropy(F.linear(h, w).float(), t)
        return out, torch.autograd.grad(out, (h, w))

    with _GemmDtypes() as rec:
        out, (fh, fw) = fused()
    assert rec.seen and all(d == (torch.bfloat16,) * 2 for d in rec.seen), rec.seen
    ref, (gh, gw) = unfused()
    assert abs(out.item() - ref.item()) < 1e-2 * abs(ref.item())
    for a, b in ((fh, gh), (fw, gw)):
        assert (a.float() - b.float()).abs().max() <= 2e-2 * b.float().abs().max()
    t_fused, t_plain = cuda_seconds(fused), cuda_seconds(unfused)
    record_property(f"fused_loss_s_{'autocast' if autocast else 'bf16'}", t_fused)
    record_property(f"unfused_loss_s_{'autocast' if autocast else 'bf16'}", t_plain)
    assert t_fused <= 1.5 * t_plain, (t_fused, t_plain)
