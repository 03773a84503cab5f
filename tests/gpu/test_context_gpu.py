"""Context parallelism's ring attention on one GPU (a cp group of one: every block computed on
this rank): its unmasked and causal blocks run FlashAttention's kernels (their check against
fp32 SDPA passed), its output and gradients equal SDPA's, and its time and SDPA's are recorded
(`myria.parallel.context`: the other blocks run fp32 einsums)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tests.gpu.conftest import GPU, cuda_seconds

pytestmark = GPU


def test_ring_attention_on_one_gpu_against_sdpa(record_property):
    from myria.parallel import context
    from myria.parallel.context import ring_attention

    g = torch.Generator(device="cuda").manual_seed(0)
    s = 4096
    q = torch.randn(1, 16, s, 128, device="cuda", generator=g, dtype=torch.bfloat16)
    k, v = (torch.randn(1, 4, s, 128, device="cuda", generator=g, dtype=torch.bfloat16)
            for _ in range(2))
    for t in (q, k, v):
        t.requires_grad_()

    def run(fn):
        out = fn()
        return out, torch.autograd.grad(out.float().square().sum(), (q, k, v))

    def ring():
        return ring_attention(q, k, v)

    def sdpa():
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    out, grads = run(ring)
    record_property("ring_fused_kernel", context._CUDA_FUSED)
    assert context._CUDA_FUSED, "the fused kernel failed its check: see the warning logged"
    ref, ref_grads = run(sdpa)
    for a, b in zip((out, *grads), (ref, *ref_grads)):   # bf16 in and out
        assert float((a.float() - b.float()).abs().max() / b.float().abs().max()) < 2e-2
    for name, fn in (("ring", ring), ("sdpa", sdpa)):
        record_property(f"{name}_attention_fwd_bwd_s", cuda_seconds(lambda fn=fn: run(fn)))
