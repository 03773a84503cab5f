"""MoE layer: routing and capacity against a per-token reference, router losses, FLOPs, the
grouped expert GEMMs against the per-expert loop."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from myria.config import ModelConfig
from myria.models import moe as moe_mod
from myria.models.flops import param_counts
from myria.models.moe import (
    LOAD_BALANCE_COEF,
    Z_LOSS_COEF,
    MoE,
    expert_capacity,
    expert_mlps,
    grouped_expert_mlps,
    looped_expert_mlps,
    moe_aux_loss,
    route,
)
from myria.models.transformer import MLP, build_model, count_params
from tests.conftest import moe_cfg
from tests.models import test_model as _dense_model_tests  # noqa: F401 (CPU SDPA, grouped GEMM FLOPs)


def make_moe(cfg: ModelConfig, seed: int = 0) -> MoE:
    """An MoE layer in float64 with random weights (and biases) so the references are exact."""
    moe = MoE(cfg).double()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.3)
    return moe


def naive_moe(moe: MoE, x: torch.Tensor, capacity: int | None) -> tuple[torch.Tensor, list[int]]:
    """Per-token reference: softmax, top-k, gates, first-choices-first capacity, expert MLPs."""
    ex = moe.experts
    probs = (x @ moe.router.weight.t()).softmax(-1)
    k = moe.top_k
    choices = [sorted(range(moe.num_experts), key=lambda e: -probs[t, e].item())[:k]
               for t in range(x.shape[0])]
    used = [0] * moe.num_experts
    rows = [torch.zeros_like(x[0]) for _ in range(x.shape[0])]
    for j in range(k):  # priority: every token's j-th choice before any (j+1)-th choice
        for t in range(x.shape[0]):
            e = choices[t][j]
            if capacity is not None and used[e] >= capacity:
                continue
            used[e] += 1
            total = sum(probs[t, c] for c in choices[t])
            gate = probs[t, e] if k == 1 else probs[t, e] / total
            if ex.gated:
                h = F.silu(ex.w1[e] @ x[t]) * (ex.w3[e] @ x[t])
                y = ex.w2[e] @ h
            else:
                h = F.gelu(ex.w1[e] @ x[t] + ex.w1_bias[e], approximate="tanh")
                y = ex.w2[e] @ h + ex.w2_bias[e]
            rows[t] = rows[t] + gate * y
    return torch.stack(rows), used


@pytest.mark.parametrize("arch,top_k,cf", [("llama", 1, 0.0), ("llama", 2, 0.0),
                                           ("gpt", 1, 0.0), ("gpt", 2, 0.0), ("gpt", 3, 0.0),
                                           ("llama", 1, 1.0), ("llama", 2, 0.75),
                                           ("gpt", 2, 1.25)])
def test_matches_per_token_reference(arch, top_k, cf):
    cfg = moe_cfg(arch=arch, top_k=top_k, capacity_factor=cf)
    moe = make_moe(cfg)
    x = torch.randn(2, 20, cfg.hidden, dtype=torch.float64, requires_grad=True)
    dy = torch.randn_like(x)
    out = moe(x)
    params = [x, *moe.parameters()]
    got = torch.autograd.grad((out * dy).sum(), params)
    cap = expert_capacity(40, cfg.experts, top_k, cf)
    ref, used = naive_moe(moe, x.view(40, -1), cap)
    want = torch.autograd.grad((ref * dy.view(40, -1)).sum(), params)
    torch.testing.assert_close(out.view(40, -1), ref, rtol=1e-10, atol=1e-12)
    assert moe.stats["kept"].tolist() == used
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_expert_matches_dense_mlp():
    for arch in ("llama", "gpt"):
        cfg = moe_cfg(arch=arch)
        moe, mlp = make_moe(cfg), MLP(cfg).double()
        e = 2
        with torch.no_grad():
            mlp.w1.weight.copy_(moe.experts.w1[e])
            mlp.w2.weight.copy_(moe.experts.w2[e])
            if arch == "llama":
                mlp.w3.weight.copy_(moe.experts.w3[e])
            else:
                mlp.w1.bias.copy_(moe.experts.w1_bias[e])
                mlp.w2.bias.copy_(moe.experts.w2_bias[e])
        x = torch.randn(5, cfg.hidden, dtype=torch.float64)
        counts = torch.tensor([0, 0, 5, 0])
        torch.testing.assert_close(expert_mlps(x, counts, *moe.experts.weights()), mlp(x))


def test_capacity_drops_in_priority_order():
    # top-1, 8 tokens, 4 experts, factor 1: capacity 2; choices 0,0,0,0,0,1,1,2.
    logits = F.one_hot(torch.tensor([0, 0, 0, 0, 0, 1, 1, 2]), 4).double() * 5
    assert expert_capacity(8, 4, 1, 1.0) == 2
    r = route(logits, 1, 2)
    assert r.routed.tolist() == [5, 2, 1, 0] and r.counts.tolist() == [2, 2, 1, 0]
    assert r.dropped == 3 and r.token.tolist() == [0, 1, 5, 6, 7]
    # top-2, capacity 2: first choices beat second choices for expert 0.
    first, second = torch.tensor([0, 0, 1, 3]), torch.tensor([1, 2, 0, 0])
    logits = F.one_hot(first, 4).double() * 4 + F.one_hot(second, 4).double() * 2
    assert expert_capacity(4, 4, 2, 1.0) == 2
    r = route(logits, 2, 2)
    assert r.routed.tolist() == [4, 2, 1, 1] and r.counts.tolist() == [2, 2, 1, 1]
    assert r.dropped == 2
    assert r.token.tolist() == [0, 1, 2, 0, 1, 3]  # expert 0 keeps tokens 0 and 1
    # gates renormalised over the two choices: p1/(p1+p2) = 1/(1+e^-2)
    assert r.gate[0].item() == pytest.approx(1 / (1 + math.exp(-2)))


def test_dropped_tokens_pass_through_with_zero_output():
    cfg = moe_cfg(capacity_factor=0.5)
    moe = make_moe(cfg)
    with torch.no_grad():
        moe.router.weight.zero_()
        moe.router.weight[0] = 1.0  # positive inputs: every token prefers expert 0
    x = torch.rand(1, 16, cfg.hidden, dtype=torch.float64) + 0.1
    out = moe(x)
    cap = expert_capacity(16, 4, 1, 0.5)
    assert cap == 2 and moe.stats["kept"].tolist() == [2, 0, 0, 0]
    assert moe.stats["dropped"].item() == 14
    assert out[0, :2].abs().sum() > 0 and torch.all(out[0, 2:] == 0)


def test_capacity_factor_zero_drops_nothing():
    cfg = moe_cfg(top_k=2, capacity_factor=0.0)
    moe = make_moe(cfg)
    with torch.no_grad():
        moe.router.weight.zero_()
        moe.router.weight[0], moe.router.weight[1] = 1.0, 0.5  # all tokens -> experts 0, 1
    x = torch.rand(3, 16, cfg.hidden, dtype=torch.float64) + 0.1
    moe(x)
    assert moe.stats["routed"].tolist() == [48, 48, 0, 0]
    assert moe.stats["kept"].tolist() == [48, 48, 0, 0] and moe.stats["dropped"].item() == 0


def test_aux_loss_hand_example():
    # Two experts, router = identity: logits are the inputs themselves.
    cfg = moe_cfg(hidden=2, heads=1, ffn_hidden=4, experts=2)
    moe = make_moe(cfg)
    with torch.no_grad():
        moe.router.weight.copy_(torch.eye(2))
    a = math.log(3)  # softmax([ln 3, 0]) = [3/4, 1/4]
    x = torch.tensor([[a, 0.0], [a, 0.0], [a, 0.0], [0.0, a]], dtype=torch.float64)
    moe(x)
    # f = [3/4, 1/4], P = [(3*3/4 + 1/4)/4, (3*1/4 + 3/4)/4] = [5/8, 3/8]
    lb = 2 * (3 / 4 * 5 / 8 + 1 / 4 * 3 / 8)  # = 1.125
    z = math.log(4) ** 2  # logsumexp([ln 3, 0]) = ln 4 for every token
    assert moe.stats["load_balancing_loss"].item() == pytest.approx(lb, rel=1e-12)
    assert moe.stats["z_loss"].item() == pytest.approx(z, rel=1e-12)
    assert moe.aux_loss.item() == pytest.approx(LOAD_BALANCE_COEF * lb + Z_LOSS_COEF * z,
                                                rel=1e-12)
    # Uniform router: load balancing loss is exactly 1 whatever the tie-breaking, z = ln(E)^2.
    with torch.no_grad():
        moe.router.weight.zero_()
    moe(torch.randn(10, 2, dtype=torch.float64))
    assert moe.stats["load_balancing_loss"].item() == pytest.approx(1.0, rel=1e-12)
    assert moe.stats["z_loss"].item() == pytest.approx(math.log(2) ** 2, rel=1e-12)


@pytest.mark.parametrize("arch", ["llama", "gpt"])
def test_model_gradients_reach_router_and_every_expert(arch):
    cfg = moe_cfg(arch=arch, top_k=2, capacity_factor=1.5)
    model = build_model(cfg, "cpu")
    model.init_weights(0)
    x = torch.randint(0, cfg.vocab_size, (4, cfg.seq_len))
    model(x, torch.roll(x, -1, 1)).backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name
        if "experts" in name:  # every expert of every layer got tokens and a gradient
            assert all(g.abs().sum() > 0 for g in p.grad), name
    # The router losses alone also train the router.
    model.zero_grad()
    model(x)
    moe_aux_loss(model).backward()
    assert model.layers["0"].feed_forward.router.weight.grad.abs().sum() > 0


def test_training_loss_includes_router_losses_eval_does_not():
    cfg = moe_cfg(top_k=2)
    model = build_model(cfg, "cpu")
    model.init_weights(1)
    x = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len))
    y = torch.roll(x, -1, 1)
    ce = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
    aux = sum(b.feed_forward.aux_loss for b in model.layers.values())
    assert aux.item() > 0
    torch.testing.assert_close(model(x, y), ce + aux)
    model.eval()
    torch.testing.assert_close(model(x, y), ce)
    # a part without MoE layers (the CPU profile's head alone, a pipeline stage of the ends)
    # trains on its loss alone
    model.train()
    model.layers = torch.nn.ModuleDict()
    torch.testing.assert_close(model(x, y), F.cross_entropy(model(x).flatten(0, 1), y.flatten()))


def test_init_and_param_counts():
    for arch in ("llama", "gpt"):
        cfg = moe_cfg(arch=arch, experts=8, layers=4, hidden=64, heads=4)
        model = build_model(cfg, "cpu")
        model.init_weights(2)
        assert count_params(model) == param_counts(cfg).total(cfg.layers)
        p = dict(model.named_parameters())
        ff = "layers.1.feed_forward."
        assert p[ff + "router.weight"].std().item() == pytest.approx(0.02, rel=0.05)
        assert p[ff + "experts.w1"].std().item() == pytest.approx(0.02, rel=0.05)
        assert p[ff + "experts.w2"].std().item() == pytest.approx(0.02 / math.sqrt(8), rel=0.05)
        if arch == "gpt":
            assert not p[ff + "experts.w1_bias"].any() and not p[ff + "experts.w2_bias"].any()
        # experts differ from each other
        assert not torch.equal(p[ff + "experts.w1"][0], p[ff + "experts.w1"][1])


@pytest.mark.parametrize("kw", [dict(arch="llama", top_k=1), dict(arch="llama", top_k=2),
                                dict(arch="gpt", top_k=2, parallel_block=True)])
def test_flops_count_active_experts(kw):
    from tests.models.test_model import assert_flops_match_counter

    assert_flops_match_counter(moe_cfg(capacity_factor=0.0, **kw))


def _expert_operands(arch: str, dtype=torch.float32, device="cpu", seed: int = 0):
    """x and the stacked weights (w1, w2, w3, b1, b2) of 4 experts, hidden 16, ffn 24, leaves
    that require gradients; `counts` gives expert 1 no rows."""
    g = torch.Generator().manual_seed(seed)
    e, h, f = 4, 16, 24

    def leaf(*shape):
        return (torch.randn(shape, generator=g) * 0.3).to(device, dtype).requires_grad_()

    rows = [7, 0, 12, 5]
    counts = torch.tensor(rows, device=device)
    x = leaf(sum(rows), h)
    ws = (leaf(e, f, h), leaf(e, h, f), leaf(e, f, h) if arch == "llama" else None,
          None if arch == "llama" else leaf(e, f), None if arch == "llama" else leaf(e, h))
    return x, counts, ws


@pytest.mark.parametrize("align", [1, 16], ids=["as-routed", "cuda-padding"])
@pytest.mark.parametrize("arch", ["llama", "gpt"])
def test_grouped_experts_equal_the_per_expert_loop(arch, align):
    """One grouped GEMM per weight = each expert in turn, output and every gradient (an expert
    without rows included; fp32, to rounding: the two take different GEMM kernels), as routed
    (the CPU path) and with each expert's rows moved to 16-row boundaries as on CUDA (the
    padding rows add nothing)."""
    x, counts, ws = _expert_operands(arch)
    leaves = [t for t in (x, *ws) if t is not None]
    ref = looped_expert_mlps(x, counts.tolist(), *ws)
    dy = torch.randn(ref.shape, generator=torch.Generator().manual_seed(1))
    ref_grads = torch.autograd.grad(ref, leaves, dy)
    got = grouped_expert_mlps(x, counts, *ws, align=align)
    got_grads = torch.autograd.grad(got, leaves, dy)
    for a, b in zip((got, *got_grads), (ref, *ref_grads), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert got_grads[1][1].abs().max() == 0   # expert 1 had no rows: w1[1] has no gradient
    assert got_grads[1][0].abs().min() > 0    # the others' gradients are not zero


@pytest.mark.parametrize("align", [1, 16])
def test_grouped_experts_never_read_the_routing_on_the_host(align):
    """The grouped path runs forward and backward on meta tensors, which hold no values: no
    step of it reads `counts` (or anything) back to the host, so on a GPU the host never waits
    for the router."""
    for arch in ("llama", "gpt"):
        x, counts, ws = _expert_operands(arch, torch.bfloat16, "meta")
        y = grouped_expert_mlps(x, counts, *ws, align=align)
        y.backward(torch.empty_like(y))
        assert y.shape == x.shape and ws[0].grad.shape == ws[0].shape


def test_moe_layer_runs_grouped_gemms_where_torch_takes_them():
    """An fp32 MoE layer on a CPU runs torch._grouped_mm (three a forward for SwiGLU) instead of
    a GEMM per expert; float64, which the grouped kernel does not take, runs the loop."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.seen.append(func)
            return func(*args, **(kwargs or {}))

    cfg = moe_cfg(top_k=2)
    for dtype, grouped in ((torch.float32, 3), (torch.float64, 0)):
        layer = make_moe(cfg).to(dtype)
        x = torch.randn(2, 8, cfg.hidden, dtype=dtype)
        with Ops() as ops:
            layer(x)
        assert ops.seen.count(torch.ops.aten._grouped_mm.default) == grouped, dtype
        # the router's GEMM, and with the loop one per expert and SwiGLU matrix (4 x 3)
        assert ops.seen.count(torch.ops.aten.mm.default) == (1 if grouped else 13), dtype


def test_a_grouped_gemm_that_fails_its_check_leaves_the_loop(monkeypatch, caplog):
    """The once-per-process check of the accelerator's grouped GEMM: passes where the kernel
    agrees with the loop (here the CPU's bf16), and a failure leaves the per-expert loop with
    one warning naming it."""
    monkeypatch.setattr(moe_mod, "_CUDA_GROUPED", None)
    assert moe_mod._cuda_grouped_ok(torch.device("cpu")) is True

    def broken(*args, **kwargs):
        raise RuntimeError("grouped gemm is not supported on this device")

    monkeypatch.setattr(moe_mod, "_CUDA_GROUPED", None)
    monkeypatch.setattr(moe_mod, "grouped_expert_mlps", broken)
    with caplog.at_level("WARNING", logger="myria.models.moe"):
        assert moe_mod._cuda_grouped_ok(torch.device("cpu")) is False
        assert moe_mod._cuda_grouped_ok(torch.device("cpu")) is False
    warned = [r for r in caplog.records if "grouped GEMM is not used" in r.getMessage()]
    assert len(warned) == 1 and "not supported on this device" in warned[0].getMessage()


def test_compiled_experts_on_a_cpu_run_the_loop():
    """Under torch.compile the grouped kernel's shape rules are its CUDA form's (bf16 only): a
    compiled fp32 MoE on a CPU runs the per-expert loop and computes what eager does."""
    x, counts, ws = _expert_operands("llama")
    compiled = torch.compile(expert_mlps, backend="eager", fullgraph=False)
    torch.testing.assert_close(compiled(x, counts, *ws), expert_mlps(x, counts, *ws))
