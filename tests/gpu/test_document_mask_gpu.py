"""Document masking on CUDA (FlexAttention with a document block mask): the loss of a packed
sequence equals the sum of its documents' losses run alone, as on CPU (tests/models/
test_document_mask.py), and a one-GPU run with `model.document_mask` trains (`pytest -m gpu`)."""

from __future__ import annotations

import torch

from tests.gpu.conftest import GPU
from tests.models.test_document_mask import _alone_sum, _model, _packed, _packed_sum

pytestmark = GPU


def test_flex_document_mask_matches_documents_alone():
    for window, positions in ((0, False), (5, True)):
        model = _model(attention_window=window, document_positions=positions).cuda().float()
        x, y = (t.cuda() for t in _packed())
        with torch.no_grad():
            packed = _packed_sum(model, x, y, positions)
            alone = _alone_sum(model, x, y)
        assert abs(float(packed - alone)) / float(alone) < 1e-4, (window, packed, alone)
