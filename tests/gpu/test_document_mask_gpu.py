"""Document masking on CUDA (FlexAttention with a document block mask): the loss of a packed
sequence equals the sum of its documents' losses run alone, as on CPU (tests/models/
test_document_mask.py), and so do its gradients (FlexAttention's backward; the gradient case
takes the device, its CPU case runs in the suite). A one-GPU run with `model.document_mask`
trains in bf16: tests/gpu/test_mixers_gpu.py."""

from __future__ import annotations

import pytest
import torch

from tests.gpu.conftest import GPU, gpu_only
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
