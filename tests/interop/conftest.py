"""Hugging Face model directories made on the spot (random weights, `save_pretrained`): nothing
is downloaded. Their vocabulary (1024) fits the shared tiny corpus's tokenizer."""

from __future__ import annotations

from pathlib import Path

import pytest

SHAPE = dict(vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)


def make_hf_model(kind: str, out: Path, **kw) -> Path:
    """A random `kind` (llama, mistral, qwen2) model saved with save_pretrained in `out`.

    llama: Llama 3's rope scaling, untied, saved in shards with an index; qwen2: q/k/v biases
    (random, not zero) and tied embeddings; mistral: a sliding window (32) shorter than the
    runs' sequences (64)."""
    import torch
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    torch.manual_seed({"llama": 1, "mistral": 2, "qwen2": 3}[kind])
    shard = "100KB" if kind == "llama" else "50GB"
    if kind == "llama":
        cfg = LlamaConfig(**SHAPE, rope_theta=500000.0, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 32}, **kw)
        model = LlamaForCausalLM(cfg)
    elif kind == "mistral":
        model = MistralForCausalLM(MistralConfig(**SHAPE, **{"sliding_window": 32, **kw}))
    else:
        model = Qwen2ForCausalLM(Qwen2Config(**SHAPE, tie_word_embeddings=True, **kw))
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("bias"):
                    p.normal_(0, 0.5)
    model.save_pretrained(out, max_shard_size=shard)
    return out


@pytest.fixture(scope="session")
def hf_models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf")
    return {k: make_hf_model(k, root / k) for k in ("llama", "mistral", "qwen2")}


def hf_logits(d: Path, tokens, dtype=None):
    """transformers' logits of `tokens` (B, S) for model directory `d`, the model in `dtype`
    (fp32 by default) on the tokens' device."""
    import torch
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(d, dtype=dtype or torch.float32).eval()
    with torch.no_grad():
        return ref.to(tokens.device)(tokens).logits
