"""The model: FLOP counts against torch's counter, parameter counts, fused loss, init."""

import contextlib

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode, register_flop_formula, sdpa_flop_count

from myria.config import ModelConfig
from myria.models.flops import (
    forward_flops_per_token,
    loss_chunk_rows,
    megatron_gpt_flops_per_iteration,
    model_flops_per_token,
    param_counts,
)
from myria.models.loss import fused_linear_cross_entropy
from myria.models.transformer import build_model, count_params

# torch's FLOP counter knows the CUDA SDPA kernels but not the CPU one; count it the same way.
try:
    @register_flop_formula(torch.ops.aten._scaled_dot_product_flash_attention_for_cpu)
    def _sdpa_cpu_flop(query, key, value, *args, out_val=None, **kwargs) -> int:
        return sdpa_flop_count(query, key, value)  # the counter passes shapes

    @register_flop_formula(torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward)
    def _sdpa_cpu_bwd_flop(grad_out, query, key, value, *args, out_val=None, **kwargs) -> int:
        # Model FLOPs: the backward of two matmuls is four (torch's own backward formula
        # also charges the flash kernel's recomputation of QK^T, which MFU excludes).
        return 2 * sdpa_flop_count(query, key, value)
except (AttributeError, RuntimeError):  # already registered by a newer torch
    pass

# ... nor torch._grouped_mm (the MoE experts, models.moe.grouped_expert_mlps): 2 x the rows each
# group contracts x its output columns, summed over the groups.
try:
    @register_flop_formula(torch.ops.aten._grouped_mm)
    def _grouped_mm_flop(a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:
        if len(a_shape) == 2 and len(b_shape) == 2:   # the groups split the contraction
            return 2 * a_shape[0] * a_shape[1] * b_shape[1]
        n = 1
        for d in out_shape:
            n *= d
        return 2 * n * a_shape[-1]
except (AttributeError, RuntimeError):  # already registered by a newer torch
    pass

OPTIONS = [
    dict(arch="llama"), dict(arch="gpt"), dict(arch="llama", parallel_block=True),
    dict(arch="llama", kv_heads=2), dict(arch="gpt", parallel_block=True, kv_heads=2),
    dict(arch="llama", tie_embeddings=True), dict(arch="llama", ffn_hidden=96),
]


def small(**kw):
    base = dict(vocab_size=384, layers=2, hidden=64, heads=4, seq_len=32)
    base.update(kw)
    return ModelConfig(**base)


def assert_flops_match_counter(cfg) -> None:
    """torch's FLOP counter on one training step of the model == flops.py's count."""
    model = build_model(cfg, "cpu")
    model.init_weights(0)
    x = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len))
    with FlopCounterMode(display=False) as fc:
        logits = model(x)
        F.cross_entropy(logits.flatten(0, 1), x.flatten()).backward()
    assert fc.get_total_flops() == pytest.approx(model_flops_per_token(cfg) * x.numel(),
                                                 rel=1e-9)


@pytest.mark.parametrize("kw", OPTIONS)
def test_flops_match_torch_flop_counter(kw):
    assert_flops_match_counter(small(**kw))


def test_windowed_and_causal_conventions():
    cfg = small(attention_window=8)
    f_dense = forward_flops_per_token(cfg, "dense")
    f_causal = forward_flops_per_token(cfg, "causal")
    # dense charges min(window, S) keys per query; causal the exact unmasked pairs.
    assert f_dense.attn_scores == cfg.layers * 2 * cfg.hidden * 8
    exact = sum(min(i + 1, 8) for i in range(32)) / 32
    assert f_causal.attn_scores == pytest.approx(cfg.layers * 2 * cfg.hidden * exact)
    # unmasked pairs counted by brute force from the mask
    from myria.models.attention import window_mask
    assert window_mask(32, 32, 8, "cpu").sum().item() / 32 == pytest.approx(exact)


def test_megatron_convention_equals_published_formula():
    cfg = ModelConfig(arch="gpt", vocab_size=51200, layers=24, hidden=2304, heads=24,
                      seq_len=2048)
    per_iter = model_flops_per_token(cfg, "megatron") * 512 * 2048
    assert per_iter == pytest.approx(megatron_gpt_flops_per_iteration(512, 2048, 24, 2304, 51200),
                                     rel=1e-12)


def test_moe_counts_active_experts_only():
    dense = small(arch="llama")
    moe = small(arch="llama", experts=4, top_k=2)
    fd, fm = forward_flops_per_token(dense), forward_flops_per_token(moe)
    assert fm.mlp == 2 * fd.mlp and fm.router == dense.layers * 2 * 64 * 4


@pytest.mark.parametrize("kw", OPTIONS)
def test_param_counts_exact(kw):
    cfg = small(**kw)
    assert count_params(build_model(cfg, "cpu")) == param_counts(cfg).total(cfg.layers)


def test_fused_cross_entropy_matches_reference():
    torch.manual_seed(0)
    h = torch.randn(70, 16, dtype=torch.float64, requires_grad=True)
    w = torch.randn(50, 16, dtype=torch.float64, requires_grad=True)
    t = torch.randint(0, 50, (70,))
    ref = F.cross_entropy(h @ w.t(), t)
    gh, gw = torch.autograd.grad(ref * 3.0, (h, w))
    out = fused_linear_cross_entropy(h, w, t, chunk=16)  # several chunks, a ragged last one
    fh, fw = torch.autograd.grad(out * 3.0, (h, w))
    assert torch.allclose(out, ref, atol=1e-12)
    assert torch.allclose(fh, gh, atol=1e-12) and torch.allclose(fw, gw, atol=1e-12)
    with torch.no_grad():
        assert torch.allclose(fused_linear_cross_entropy(h, w, t), ref)


class _GemmDtypes(TorchDispatchMode):
    """Records the input dtypes of every matrix multiply dispatched inside it."""

    GEMMS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default,
             torch.ops.aten.addmm_.default, torch.ops.aten.bmm.default}

    def __init__(self):
        super().__init__()
        self.seen: list[tuple] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in self.GEMMS or func.overloadpacket is torch.ops.aten.mm:
            self.seen.append(tuple(a.dtype for a in args if isinstance(a, torch.Tensor)))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("autocast", [False, True], ids=["bf16-inputs", "autocast"])
def test_fused_loss_runs_every_gemm_in_bf16_on_an_accelerator(monkeypatch, autocast):
    """On an accelerator the loss's three GEMMs run in the forward's dtype (bf16 inputs, or fp32
    inputs under autocast) and its gradients match the unfused bf16 computation; a CPU keeps
    its fp32 weight-gradient GEMM."""
    from myria.models import loss as loss_mod

    torch.manual_seed(0)
    dt = torch.float32 if autocast else torch.bfloat16
    h = torch.randn(300, 64).to(dt).requires_grad_()
    w = (torch.randn(200, 64) * 0.1).to(dt).requires_grad_()
    t = torch.randint(0, 200, (300,))
    ctx = torch.autocast("cpu", torch.bfloat16) if autocast else contextlib.nullcontext()
    hb, wb = h.detach().bfloat16().requires_grad_(), w.detach().bfloat16().requires_grad_()
    ref = F.cross_entropy((hb @ wb.t()).float(), t)
    gh, gw = torch.autograd.grad(ref, (hb, wb))

    def run():
        with ctx, _GemmDtypes() as rec:
            out = fused_linear_cross_entropy(h, w, t, chunk=64)
        return out, torch.autograd.grad(out, (h, w)), rec.seen

    _, _, cpu_gemms = run()
    assert any(torch.float32 in d for d in cpu_gemms)   # the CPU's fp32 weight gradient
    monkeypatch.setattr(loss_mod, "on_accelerator", lambda _t: True)
    out, (fh, fw), gemms = run()
    assert len(gemms) == 3 * 5 and all(d == (torch.bfloat16,) * 2 for d in gemms), gemms
    assert fh.dtype == h.dtype and fw.dtype == w.dtype
    assert abs(out.item() - ref.item()) < 1e-3
    # as close to the unfused bf16 gradients as bf16's resolution allows
    assert (fh.float() - gh.float()).abs().max() <= 2e-2 * gh.float().abs().max()
    assert (fw.float() - gw.float()).abs().max() <= 2e-2 * gw.float().abs().max()


def test_fused_loss_chunks_are_long_on_an_accelerator():
    assert loss_chunk_rows(32000) == 131                 # a CPU's: 4 Mi logits
    assert loss_chunk_rows(32000, "cuda") == 2097        # 64 Mi: GEMMs of ~2k rows
    assert loss_chunk_rows(128256, "cuda") == 523
    assert loss_chunk_rows(10 ** 9, "cuda") == 16


def test_model_loss_equals_logits_loss():
    cfg = small()
    model = build_model(cfg, "cpu")
    model.init_weights(3)
    x = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len))
    y = torch.roll(x, -1, 1)
    ref = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
    assert torch.allclose(model(x, y), ref, atol=1e-6)


def test_init_is_a_function_of_seed_and_name():
    cfg = small()
    a, b, c = (build_model(cfg, "cpu") for _ in range(3))
    a.init_weights(5)
    b.init_weights(5)
    c.init_weights(6)
    for (n, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb), n
        if "norm" not in n:
            assert not torch.equal(pa, pc), n
    # meta construction + to_empty + init gives the same values
    m = build_model(cfg, "meta")
    m.to_empty(device="cpu")
    m.init_weights(5)
    for pa, pm in zip(a.parameters(), m.parameters()):
        assert torch.equal(pa, pm)


def test_sliding_window_limits_attention():
    cfg = small(attention_window=4, layers=1)
    model = build_model(cfg, "cpu")
    model.init_weights(0)
    x = torch.randint(0, cfg.vocab_size, (1, cfg.seq_len))
    x2 = x.clone()
    x2[0, 0] = (x[0, 0] + 1) % cfg.vocab_size  # change token 0
    out, out2 = model(x), model(x2)
    # with one layer, positions >= window cannot see token 0
    assert torch.allclose(out[0, 4:], out2[0, 4:], atol=1e-6)
    assert not torch.allclose(out[0, :4], out2[0, :4])


@pytest.mark.parametrize("s", [24, 40])
def test_sliding_window_on_the_flex_path_equals_the_banded_mask(monkeypatch, s):
    """Where FlexAttention runs (CUDA; forced here, forward only), the sliding window is its
    block mask, not SDPA's banded mask (with grouped-query heads SDPA would run its math kernel
    on a GPU): the same output, grouped-query heads included, and past DENSE_MASK_MAX (lowered
    to 32 here) the compiled kernel (a stand-in)."""
    from torch.nn.attention import flex_attention as fa

    from myria.models import attention as att
    from myria.models.attention import CoreAttention

    g = torch.Generator().manual_seed(4)
    q = torch.randn(2, 4, s, 8, generator=g, dtype=torch.float64)
    k, v = (torch.randn(2, 2, s, 8, generator=g, dtype=torch.float64) for _ in range(2))
    banded = CoreAttention(window=7)(q, k, v)
    compiled = []
    monkeypatch.setattr(att, "_FLEX",
                        lambda *a, **kw: compiled.append(1) or fa.flex_attention(*a, **kw))
    monkeypatch.setattr(att, "use_flex", lambda q: True)
    monkeypatch.setattr(CoreAttention, "DENSE_MASK_MAX", 32)
    flex = CoreAttention(window=7)(q, k, v)
    assert len(compiled) == (s > 32)
    assert torch.allclose(flex, banded, atol=1e-12)
