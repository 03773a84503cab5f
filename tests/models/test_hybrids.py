"""Gated DeltaNet, Mamba-2 and per-layer hybrids: the chunked training forms equal the
recurrences (output and gradient, fp32), a whole hybrid's forward equals its token-by-token
decode (its greedy generation: tests/models/test_architectures.py), FLOPs equal torch's FLOP
counter, the generation state is constant and priced exactly, and combinations that cannot
run stop with one line."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from myria.config import ModelConfig, validate_model
from myria.errors import ConfigError
from myria.models.deltanet import gated_delta_chunked, gated_delta_recurrent
from myria.models.flops import forward_flops_per_token, param_counts
from myria.models.mamba2 import ssd_chunked, ssd_recurrent
from myria.models.transformer import build_model, count_params

TOL = dict(atol=1e-5, rtol=1e-5)


def _inputs(kind: str, b=2, h=3, s=45, dk=8, dv=6, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, s, dk, generator=g)
    k = torch.randn(b, h, s, dk, generator=g)
    v = torch.randn(b, h, s, dv, generator=g)
    log_a = -torch.rand(b, h, s, generator=g) * 0.7
    state = torch.randn(b, h, dk, dv, generator=g) * 0.5
    if kind == "deltanet":   # the block's normalised keys and scaled queries
        q, k = F.normalize(q, dim=-1) * dk ** -0.5, F.normalize(k, dim=-1)
        xs = [q, k, v, log_a, torch.rand(b, h, s, generator=g)]
    else:
        xs = [q * dk ** -0.5, k * dk ** -0.5, v, log_a]
    return [x.to(device) for x in xs], state.to(device)


FORMS = {"deltanet": (gated_delta_chunked, gated_delta_recurrent),
         "mamba2": (ssd_chunked, ssd_recurrent)}


@pytest.mark.parametrize("kind", list(FORMS))
def test_chunked_form_equals_recurrence(kind, device="cpu"):
    """Output, final state and the gradients of every input (q, k, v, decays, beta and the
    initial state) agree within 1e-5 in fp32, at chunk sizes that do and do not divide S
    (tests/gpu/test_mixers_gpu.py runs this body on CUDA)."""
    chunked, recurrent = FORMS[kind]
    xs, state = _inputs(kind, device=device)
    xs = [x.requires_grad_(True) for x in [*xs, state]]
    w = torch.randn(2, 3, 45, 6, generator=torch.Generator().manual_seed(9)).to(device)
    ref, ref_state = recurrent(*xs)
    g_ref = torch.autograd.grad((ref * w).sum() + ref_state.sum(), xs)
    for chunk in (1, 7, 16, 64):
        out, st = chunked(*xs[:-1], chunk, xs[-1], True)
        assert torch.allclose(out, ref, **TOL) and torch.allclose(st, ref_state, **TOL)
        grads = torch.autograd.grad((out * w).sum() + st.sum(), xs)
        for a, b in zip(grads, g_ref, strict=True):
            assert torch.allclose(a, b, **TOL), (chunk, (a - b).abs().max())


def test_delta_rule_overwrites_a_key():
    """With no decay and beta = 1, writing v2 under the key of v1 replaces v1 (the delta rule;
    additive linear attention would return v1 + v2)."""
    k = F.normalize(torch.randn(1, 1, 1, 4), dim=-1).expand(1, 1, 2, 4)
    v = torch.randn(1, 1, 2, 3)
    ones, zeros = torch.ones(1, 1, 2), torch.zeros(1, 1, 2)
    out = gated_delta_chunked(k, k, v, zeros, ones, 2)
    assert torch.allclose(out[0, 0, 1], v[0, 0, 1], atol=1e-6)


SIZE = dict(vocab_size=64, layers=4, hidden=32, heads=4, kv_heads=2, seq_len=64, chunk_size=16,
            ssm_state=8)


def _cfg(pattern: str, **over) -> ModelConfig:
    cfg = ModelConfig(**{**SIZE, "arch": "hybrid", "block_pattern": pattern, **over})
    validate_model(cfg)
    return cfg


@pytest.mark.parametrize("pattern", ["DDDA", "MMMA", "DMAR"])
def test_flops_and_parameters_equal_torch_counts(pattern):
    """Forward FLOPs (logits included) equal FlopCounterMode's count over a sequence that is
    not a whole number of chunks, less the triangular solves it does not count; parameters
    equal the model's (SDPA's math backend: the counter skips CPU's fused kernel)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    cfg = _cfg(pattern, vocab_size=128)
    model = build_model(cfg, "cpu")
    model.init_weights(0)
    x = torch.randint(0, cfg.vocab_size, (2, 50))
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as fc:
        model(x)
    f = forward_flops_per_token(cfg, seq_len=50)
    assert fc.get_total_flops() == pytest.approx((f.total - f.solve) * x.numel(), rel=1e-9)
    assert (f.solve > 0) == ("D" in pattern)
    assert count_params(model) == param_counts(cfg).total(cfg.layers)


def test_whole_hybrid_training_forward_equals_token_by_token():
    """Every mixer of a D, M, A, R hybrid: the chunked forward of 45 tokens equals a 21-token
    prompt (chunked, carrying the state) followed by one token at a time."""
    from myria.models.decode import KVCache, forward_cached, rope_for

    cfg = _cfg("DMAR")
    model = build_model(cfg, "cpu")
    model.init_weights(3)
    model.eval()
    x = torch.randint(0, cfg.vocab_size, (2, 45), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(x)
    cache, rope = KVCache(), rope_for(model, 45)
    parts = [forward_cached(model, x[:, :21], cache, rope)]
    parts += [forward_cached(model, x[:, i:i + 1], cache, rope) for i in range(21, 45)]
    assert torch.allclose(torch.cat(parts, dim=1), full, **TOL)


def test_generation_state_priced_exactly():
    """`sim.memory.decode_state_bytes` equals what generation holds, and grows with the
    context only through the attention layers."""
    from myria.models.decode import KVCache, forward_cached, rope_for
    from myria.sim.memory import decode_state_bytes

    cfg = _cfg("DMAR")
    model = build_model(cfg, "cpu")
    model.init_weights(0)
    cache, rope = KVCache(), rope_for(model, 80)
    x = torch.randint(0, cfg.vocab_size, (2, 40))
    forward_cached(model, x, cache, rope)
    forward_cached(model, x[:, :1], cache, rope)
    assert cache.nbytes() == decode_state_bytes(cfg, 2, 41, elem_bytes=4)
    recurrent = dataclasses.replace(cfg, block_pattern="DMR")
    assert decode_state_bytes(recurrent, 1, 1_000) == decode_state_bytes(recurrent, 1, 16_000)


def test_unknown_pattern_letter_is_one_line():
    with pytest.raises(ConfigError) as e:
        validate_model(ModelConfig(**{**SIZE, "arch": "hybrid", "block_pattern": "DDXA"}))
    assert "use the letters D (Gated DeltaNet), M (Mamba-2)" in str(e.value)
    assert "\n" not in str(e.value)


def test_a_pattern_that_does_not_divide_the_layers_says_what_is_built():
    from myria.config.model import pattern_note

    note = pattern_note(ModelConfig(**{**SIZE, "arch": "hybrid", "block_pattern": "DDA",
                                       "layers": 4}))
    assert "'DDA' repeated over model.layers = 4 builds 'DDAD'" in note
    assert pattern_note(ModelConfig(**{**SIZE, "arch": "hybrid", "block_pattern": "DA",
                                       "layers": 4})) == ""


def test_context_parallel_refused_for_recurrent_layers():
    from myria.layout import validate_degrees

    with pytest.raises(ConfigError) as e:
        validate_degrees(_cfg("DDDA"), 1, 2, False)
    assert "block_pattern = 'DDDA'" in str(e.value) and "\n" not in str(e.value)
    validate_degrees(_cfg("AA"), 1, 2, False)   # attention only: ring attention applies


# the other mixers, beside the hybrid: each is priced by the same operators
MIXERS = {
    "hybrid DMAR": dict(arch="hybrid", block_pattern="DMAR", layers=8),
    "retnet": dict(arch="retnet", kv_heads=0),
    "griffin RRA": dict(arch="griffin", block_pattern="RRA", layers=3, attention_window=16),
    "block_sparse": dict(arch="llama", attention="block_sparse", attention_window=16,
                         global_tokens=4),
    "linear": dict(arch="llama", attention="linear"),
}


@pytest.mark.parametrize("eager", [False, True])
@pytest.mark.parametrize("mixer", list(MIXERS))
def test_simulator_prices_every_flop_of_a_mixer_layer(mixer, eager):
    """The performance model's operators of a layer carry the model's forward FLOPs (all but
    the logits, per layer: the layer kinds averaged), the recurrent mixers' gates,
    convolutions, state products and solves included, for the hybrids, retention, Griffin,
    block-sparse and linear attention (eager: CPU's SDPA kernel skips the masked half, the
    causal convention; block-sparse forms multiply only their window's blocks either way)."""
    from myria.models.flops import forward_flops_per_token
    from myria.sim.operators import layer_ops, layer_shape

    cfg = ModelConfig(**{**SIZE, "vocab_size": 128, **MIXERS[mixer]})
    validate_model(cfg)
    shape = layer_shape(cfg, 2, eager=eager, flash=False)
    ops = layer_ops(shape)
    priced = sum(o.flops for o in ops if o.phase == "fwd" and
                 (o.kind in ("gemm", "attn") or o.name == "mixer_conv"))
    f = forward_flops_per_token(cfg, "causal" if eager else "dense")
    assert priced == pytest.approx((f.total - f.logits) / cfg.layers * 2 * cfg.seq_len,
                                   rel=1e-9)
    if mixer.startswith("hybrid"):
        assert {"mixer_gates", "mixer_conv", "mixer_state"} <= {o.name for o in ops}
