"""Sub-quadratic mixers: the forms of each agree, FLOPs equal torch's FLOP counter, config
combinations that cannot run are refused with one line."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from myria.config import ModelConfig, validate_model
from myria.errors import ConfigError
from myria.models.attention import block_sparse_mask, blockwise_block_sparse
from myria.models.flops import block_sparse_keys, forward_flops_per_token, param_counts
from myria.models.griffin import linear_scan, linear_scan_reference
from myria.models.linear_attention import (
    feature_map,
    linear_attention_chunked,
    linear_attention_prefix,
    linear_attention_step,
)
from myria.models.retention import (
    log_decays,
    retention_chunkwise,
    retention_parallel,
    retention_step,
)
from myria.models.transformer import build_model, count_params

TOL = dict(atol=1e-5, rtol=1e-5)


def _qkv(b=2, h=4, s=50, d=8, kv_heads=None, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, s, d, generator=g)
    k = torch.randn(b, kv_heads or h, s, d, generator=g)
    v = torch.randn(b, kv_heads or h, s, d, generator=g)
    return q.to(device), k.to(device), v.to(device)


@pytest.mark.parametrize("s,window,n_global,block", [(50, 8, 3, 8), (64, 16, 0, 16),
                                                     (37, 5, 12, 4), (40, 40, 2, 7)])
def test_blockwise_block_sparse_equals_masked_dense(s, window, n_global, block):
    q, k, v = _qkv(s=s, kv_heads=2)
    q.requires_grad_(True)
    mask = block_sparse_mask(s, s, window, n_global, "cpu")
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    got = blockwise_block_sparse(q, k, v, window, n_global, block)
    assert torch.allclose(got, ref, **TOL)
    g_ref, = torch.autograd.grad(ref.sum(), q)
    g_got, = torch.autograd.grad(got.sum(), q)
    assert torch.allclose(g_got, g_ref, **TOL)
    # the mask: local band, global keys seen by all, global queries see all before them
    i, j = s - 1, 0
    assert mask[i, j] == (n_global > 0) and mask[i, i] and not mask[0, 1]
    # exact pair count of the causal convention
    assert block_sparse_keys(s, window, n_global, block, "causal") * s == int(mask.sum())


def test_linear_attention_forms_agree(device="cpu"):
    """(tests/gpu/test_mixers_gpu.py runs this body on CUDA too, as do the next two.)"""
    q, k, v = _qkv(s=45, kv_heads=2, device=device)
    q, k = feature_map(q, "elu1"), feature_map(k, "elu1")
    ref = linear_attention_prefix(q, k, v)
    for chunk in (1, 8, 16, 64):
        assert torch.allclose(linear_attention_chunked(q, k, v, chunk), ref, **TOL)
    # recurrent: the first 20 tokens chunked (carrying state out), the rest one at a time
    out, state = linear_attention_chunked(q[:, :, :20], k[:, :, :20], v[:, :, :20], 8,
                                          return_state=True)
    outs = [out]
    for t in range(20, 45):
        o, state = linear_attention_step(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1],
                                         state)
        outs.append(o)
    assert torch.allclose(torch.cat(outs, dim=2), ref, **TOL)


def test_retention_forms_agree(device="cpu"):
    q, k, v = _qkv(s=70, device=device)
    q = q / 8 ** 0.5
    lg = log_decays(4, device=device)
    assert torch.allclose(torch.exp(lg).cpu(), 1 - 2.0 ** (-5 - torch.arange(4.0)))
    ref = retention_parallel(q, k, v, lg)
    for chunk in (1, 16, 32, 128):
        assert torch.allclose(retention_chunkwise(q, k, v, lg, chunk), ref, **TOL)
    state = torch.zeros(2, 4, 8, 8, device=device)
    outs = []
    for t in range(70):
        o, state = retention_step(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1], lg,
                                  state)
        outs.append(o)
    assert torch.allclose(torch.cat(outs, dim=2), ref, **TOL)
    # the chunkwise state carried across calls equals the recurrent one
    _, st = retention_chunkwise(q, k, v, lg, 16, return_state=True)
    assert torch.allclose(st, state, **TOL)


def test_rglru_scan_equals_step_by_step(device="cpu"):
    g = torch.Generator().manual_seed(1)
    a = (torch.rand(3, 300, 16, generator=g) * 0.5 + 0.5).to(device)
    b = torch.randn(3, 300, 16, generator=g).to(device)
    h0 = torch.randn(3, 16, generator=g).to(device)
    assert torch.allclose(linear_scan(a, b), linear_scan_reference(a, b), **TOL)
    assert torch.allclose(linear_scan(a, b, h0), linear_scan_reference(a, b, h0), **TOL)


# -- whole models ------------------------------------------------------------------------------
ARCHS = {
    "block_sparse": dict(attention="block_sparse", attention_window=12, global_tokens=3,
                         chunk_size=8),
    "linear": dict(attention="linear", chunk_size=16),
    "retnet": dict(arch="retnet", chunk_size=16),
    "retnet-parallel": dict(arch="retnet", chunk_size=64),
    "griffin": dict(arch="griffin", attention_window=64, layers=3),
    "griffin-block-sparse": dict(arch="griffin", attention="block_sparse", attention_window=8,
                                 chunk_size=8, block_pattern="RA"),
}


def _cfg(name, **over) -> ModelConfig:
    kw = dict(vocab_size=128, layers=2, hidden=32, heads=4, seq_len=64)
    kw.update(ARCHS.get(name, {}))
    kw.update(over)
    cfg = ModelConfig(**kw)
    validate_model(cfg)
    return cfg


@pytest.mark.parametrize("name", list(ARCHS))
def test_flops_equal_torch_flop_counter(name):
    """Forward matmul/convolution FLOPs of the whole model (logits included) equal
    FlopCounterMode's count; elementwise work (scan, feature maps, gates' activations) is
    counted by neither. torch 2.13's counter does not count CPU's fused SDPA kernel
    (_scaled_dot_product_flash_attention_for_cpu) at all: SDPA runs its math backend here,
    whose two batched matmuls it counts (Griffin's window = seq_len: the dense convention
    charges a sliding window's band, the masked kernel multiplies all S keys)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    cfg = _cfg(name)
    model = build_model(cfg, "cpu")
    model.init_weights(0)
    x = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len))
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as fc:
        model(x)
    want = forward_flops_per_token(cfg).total * x.numel()
    assert fc.get_total_flops() == pytest.approx(want, rel=1e-9)
    assert count_params(model) == param_counts(cfg).total(cfg.layers)


def test_block_sparse_cost_grows_linearly():
    cfg = _cfg("block_sparse", seq_len=4096, attention_window=256, global_tokens=16,
               chunk_size=128)
    per_token = [forward_flops_per_token(cfg, seq_len=s).attn_scores for s in (1024, 2048, 4096)]
    assert per_token[0] < per_token[1] < per_token[2] < 1.15 * per_token[0]   # tends to a constant
    dense = [forward_flops_per_token(dataclasses.replace(cfg, attention="softmax",
                                                         attention_window=0, global_tokens=0),
                                     seq_len=s).attn_scores for s in (1024, 2048, 4096)]
    assert dense[2] == pytest.approx(2 * dense[1]) == pytest.approx(4 * dense[0])


@pytest.mark.parametrize("name", ["retnet", "griffin", "linear"])
def test_model_training_forward_uses_forms_that_agree(name):
    """The whole model's chunked/parallel forward equals its step-by-step recurrent forward."""
    from myria.models.decode import KVCache, forward_cached, rope_for

    cfg = _cfg(name)
    model = build_model(cfg, "cpu")
    model.init_weights(3)
    model.eval()
    x = torch.randint(0, cfg.vocab_size, (1, 40))
    with torch.no_grad():
        full = model(x)
    cache = KVCache()
    rope = rope_for(model, 40)
    parts = [forward_cached(model, x[:, :21], cache, rope)]
    parts += [forward_cached(model, x[:, i:i + 1], cache, rope) for i in range(21, 40)]
    assert torch.allclose(torch.cat(parts, dim=1), full, **TOL)


@pytest.mark.parametrize("over,msg", [
    (dict(arch="retnet", attention="linear"), "retention replaces attention"),
    (dict(arch="griffin"), "attention_window > 0"),
    (dict(arch="griffin", attention_window=8, block_pattern="RXA"), "letters R"),
    (dict(attention="block_sparse"), "needs model.attention_window"),
    (dict(global_tokens=4), "needs model.attention = 'block_sparse'"),
    (dict(attention="linear", attention_window=8), "has no window"),
    (dict(arch="retnet", kv_heads=2), "no grouped"),
])
def test_invalid_combinations_are_one_line(over, msg):
    with pytest.raises(ConfigError) as e:
        validate_model(ModelConfig(**over))
    assert msg in str(e.value) and "\n" not in str(e.value)


# a Gated DeltaNet + Mamba-2 + RG-LRU hybrid: every recurrent mixer of models/ in one model
HYBRID = dict(arch="hybrid", block_pattern="DMR", layers=3, kv_heads=2, chunk_size=16,
              ssm_state=8)


@pytest.mark.parametrize("name", ["retnet", "griffin", "linear", "block_sparse", "hybrid"])
def test_recurrent_generation_equals_full_forward_greedy(name):
    """`generate` (state or trimmed cache, one token per step) picks the argmax of the full
    forward over the whole sequence at every step; the state stops growing."""
    from myria.models.decode import KVCache, forward_cached, generate, rope_for

    over = {"griffin": {"attention_window": 16}, "hybrid": HYBRID}.get(name, {})
    cfg = _cfg(name, vocab_size=64, **over)
    model = build_model(cfg, "cpu")
    model.init_weights(5)
    prompt = torch.randint(1, cfg.vocab_size, (10,), generator=torch.Generator().manual_seed(2))
    new = generate(model, prompt.tolist(), 30, temperature=0.0)
    seq = prompt.tolist()
    with torch.no_grad():
        for _ in range(30):
            seq.append(int(model(torch.tensor([seq]))[0, -1].argmax()))
    assert new == seq[10:]
    cache, rope = KVCache(), rope_for(model, 60)
    forward_cached(model, torch.tensor([seq[:30]]), cache, rope)
    size = cache.nbytes()
    for t in seq[30:40]:
        forward_cached(model, torch.tensor([[t]]), cache, rope)
    assert cache.nbytes() == size and len(cache) == 40


@pytest.mark.parametrize("name", ["retnet", "griffin", "linear", "block_sparse"])
def test_performance_model_state_memory_matches_generation(name):
    from myria.models.decode import KVCache, forward_cached, rope_for
    from myria.sim.memory import decode_state_bytes

    cfg = _cfg(name, **({"attention_window": 16} if name == "griffin" else {}))
    model = build_model(cfg, "cpu")
    model.init_weights(0)
    cache, rope = KVCache(), rope_for(model, 80)
    x = torch.randint(0, cfg.vocab_size, (2, 40))
    forward_cached(model, x, cache, rope)
    forward_cached(model, x[:, :1], cache, rope)
    assert cache.nbytes() == decode_state_bytes(cfg, 2, 41, elem_bytes=4)
    assert decode_state_bytes(cfg, 1, 10_000) == decode_state_bytes(cfg, 1, 20_000)  # constant
    dense = dataclasses.replace(cfg, arch="llama", attention="softmax", attention_window=0,
                                global_tokens=0)
    assert decode_state_bytes(dense, 1, 20_000) == 2 * decode_state_bytes(dense, 1, 10_000)
