"""A Hugging Face model imported by myria (`model.init_from`), on CUDA: its logits against
transformers' own on the same GPU, in fp32 and bf16, for Llama 3 (rope scaling), Mistral and
Qwen2 (q/k/v biases, tied embeddings) made on the spot (`pytest -m gpu`; the CPU case is
tests/interop/test_hf_import.py, whose body this runs)."""

from __future__ import annotations

from tests.gpu.conftest import GPU
from tests.interop import test_hf_import as hf_import
from tests.interop.conftest import hf_models  # noqa: F401  (the fixture)

pytestmark = GPU


def test_imported_logits_equal_transformers_on_cuda(hf_models, record_property):  # noqa: F811
    hf_import.test_logits_equal_transformers_on_one_process(hf_models, device="cuda",
                                                             record=record_property)
