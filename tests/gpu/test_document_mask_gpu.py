"""Document masking on CUDA (FlexAttention with a document block mask): the loss of a packed
sequence equals the sum of its documents' losses run alone, as on CPU (tests/models/
test_document_mask.py), and so do its gradients (FlexAttention's backward; the gradient case
takes the device, its CPU case runs in the suite). A one-GPU run with `model.document_mask`
trains in bf16: tests/gpu/test_mixers_gpu.py."""

from __future__ import annotations

import pytest
import torch

from tests.gpu.conftest import GPU, cuda_seconds, gpu_only
from tests.models.test_document_mask import _alone_sum, _model, _packed, _packed_sum


@gpu_only
def test_flex_document_mask_matches_documents_alone():
    for window, positions in ((0, False), (5, True)):
        model = _model(attention_window=window, document_positions=positions).cuda().float()
        x, y = (t.cuda() for t in _packed())
        with torch.no_grad():
            packed = _packed_sum(model, x, y, positions)
            alone = _alone_sum(model, x, y)
        assert abs(float(packed - alone)) / float(alone) < 1e-4, (window, packed, alone)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=GPU)])
def test_document_mask_gradients_equal_documents_alone(device):
    """Every parameter's gradient of the packed loss equals that of the documents run alone,
    within 1e-5 of its largest entry in fp64 (CPU; RoPE's tables hold fp32 values, and a
    document's positions differ packed and alone) and 1e-4 in fp32 (CUDA), the forward's
    tolerances."""
    dtype, tol = (torch.float64, 1e-5) if device == "cpu" else (torch.float32, 1e-4)
    for window, positions in ((0, False), (5, True)):
        model = _model(attention_window=window, document_positions=positions).to(device, dtype)
        params = [p for p in model.parameters() if p.requires_grad]
        x, y = (t.to(device) for t in _packed())
        g_packed = torch.autograd.grad(_packed_sum(model, x, y, positions), params)
        g_alone = torch.autograd.grad(_alone_sum(model, x, y), params)
        errs = [float((a - b).abs().max() / b.abs().max()) for a, b in zip(g_packed, g_alone)
                if b.abs().max() > 0]
        assert len(errs) == len(params) and max(errs) < tol, (window, max(errs))


@gpu_only
def test_long_sequences_run_compiled_flex_equal_to_blockwise(record_property):
    """Past CoreAttention.DENSE_MASK_MAX tokens the document mask runs FlexAttention compiled
    (eagerly it would hold every head's S x S scores): output and gradients equal the blockwise
    SDPA form's (fp32, 1e-4 of the largest entry); the first call's compile time is recorded."""
    import time

    from myria.models import attention as att

    s = 2 * att.CoreAttention.DENSE_MASK_MAX
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(2, 4, s, 64, device="cuda", generator=g).requires_grad_()
               for _ in range(3))
    tokens = torch.randint(4, 100, (2, s), device="cuda", generator=g)
    tokens[tokens % 37 == 0] = 3                                       # ~1 in 37 an EOS
    ids, _ = att.document_segments(tokens, 3)
    # one compile (a sliding window would be another; the CPU tests cover windows)
    t0 = time.perf_counter()
    out = att._flex_document(q, k, v, ids, 0, False)
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    torch.cuda.synchronize()
    record_property("flex_first_call_s", time.perf_counter() - t0)
    ref = att.blockwise_document(q, k, v, ids, 0, 256)
    ref_grads = torch.autograd.grad(ref.square().sum(), (q, k, v))
    assert att._FLEX is not None                                       # the compiled kernel ran
    for a, b in zip((out, *grads), (ref, *ref_grads)):
        assert float((a - b).abs().max() / b.abs().max()) < 1e-4


@gpu_only
def test_sliding_window_with_grouped_heads_runs_flex(record_property):
    """A sliding window with grouped-query heads on CUDA runs FlexAttention's block mask (SDPA
    with a mask and GQA would run its math kernel, every head's S x S scores): output and
    gradients equal the masked SDPA form's on repeated key/value heads (fp32, 1e-4 of the
    largest entry); the compiled kernel's time and the math kernel's are recorded."""
    import torch.nn.functional as F

    from myria.models import attention as att

    s, w = 2 * att.CoreAttention.DENSE_MASK_MAX, 256
    g = torch.Generator(device="cuda").manual_seed(1)
    q = torch.randn(2, 8, s, 64, device="cuda", generator=g).requires_grad_()
    k, v = (torch.randn(2, 2, s, 64, device="cuda", generator=g).requires_grad_()
            for _ in range(2))
    core = att.CoreAttention(window=w)

    def run(fn):
        out = fn()
        return out, torch.autograd.grad(out.square().sum(), (q, k, v))

    out, grads = run(lambda: core(q, k, v))
    mask = att.window_mask(s, s, w, "cuda")
    ref, ref_grads = run(lambda: F.scaled_dot_product_attention(
        q, k.repeat_interleave(4, 1), v.repeat_interleave(4, 1), attn_mask=mask))
    for a, b in zip((out, *grads), (ref, *ref_grads)):
        assert float((a - b).abs().max() / b.abs().max()) < 1e-4
    def sdpa_gqa():   # what the window ran before: SDPA's math kernel under GQA and a mask
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)

    for name, fn in (("flex", lambda: core(q, k, v)), ("sdpa_math", sdpa_gqa)):
        record_property(f"window_gqa_{name}_s", cuda_seconds(lambda fn=fn: run(fn)))
