"""Ring attention: sequence layout helpers, block plan, and equivalence with full attention.

The multi-process tests spawn one gloo job per world size (2 and 4) that runs every case and
writes its errors to JSON; the test functions then check them.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.nn.functional as F

from myria.models.attention import window_mask
from myria.parallel.context import (
    FULL,
    MASKED,
    SKIP,
    RingAttention,
    _block_kind,
    _plan,
    chunk_bounds,
    positions_for_rank,
    ring_attention,
    shard_sequence,
    swap_core_attention,
    unshard_sequence,
)
from tests.dist import finish, init, spawn

CHUNK = 4  # tokens per chunk; the sequence is 2 * cp * CHUNK long (cp * CHUNK unbalanced)

# name: (heads, kv_heads, window, load_balance, dtype)
CASES = {
    "causal": (4, 4, 0, True, torch.float32),
    "causal_gqa": (4, 2, 0, True, torch.float32),
    "window_lt_chunk_gqa": (4, 1, 3, True, torch.float32),
    "window_gt_chunk_gqa": (4, 2, 6, True, torch.float32),
    "window_gt_2chunks": (2, 2, 2 * CHUNK + 3, True, torch.float32),
    "causal_contiguous": (4, 2, 0, False, torch.float32),
    "window_contiguous": (4, 2, 5, False, torch.float32),
    "causal_gqa_fp64": (4, 2, 0, True, torch.float64),
}
TOL = {torch.float32: 1e-5, torch.float64: 1e-12}


def reference(q, k, v, dout, window):
    """Full single-process attention (SDPA) output and input gradients."""
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    s = q.shape[2]
    gqa = q.shape[1] != k.shape[1]
    if window:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=window_mask(s, s, window, "cpu"),
                                             enable_gqa=gqa)
    else:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


def make_inputs(seq_len, heads, kv_heads, dtype, seed=0, batch=2, dim=8):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, seq_len, dim, generator=g, dtype=dtype)
    k = torch.randn(batch, kv_heads, seq_len, dim, generator=g, dtype=dtype)
    v = torch.randn(batch, kv_heads, seq_len, dim, generator=g, dtype=dtype)
    dout = torch.randn(batch, heads, seq_len, dim, generator=g, dtype=dtype)
    return q, k, v, dout


def run_case(name, group, rank, size):
    """Max abs errors of this rank's ring output and gradients against full attention."""
    heads, kv_heads, window, balance, dtype = CASES[name]
    seq = (2 if balance else 1) * size * CHUNK
    q, k, v, dout = make_inputs(seq, heads, kv_heads, dtype)
    ref = reference(q, k, v, dout, window)
    shard = lambda t: shard_sequence(t, rank, size, dim=2, load_balance=balance)
    ql, kl, vl = (shard(t).requires_grad_() for t in (q, k, v))
    out = RingAttention(group, window, balance)(ql, kl, vl)
    out.backward(shard(dout))
    got = (out.detach(), ql.grad, kl.grad, vl.grad)
    return {key: (a - shard(b)).abs().max().item()
            for key, a, b in zip(("out", "dq", "dk", "dv"), got, ref, strict=True)}


# -- single process -----------------------------------------------------------------------------

def test_positions_and_shard_roundtrip():
    assert positions_for_rank(16, 0, 4).tolist() == [0, 1, 14, 15]
    assert positions_for_rank(16, 1, 4).tolist() == [2, 3, 12, 13]
    assert positions_for_rank(16, 3, 4).tolist() == [6, 7, 8, 9]
    assert positions_for_rank(16, 1, 4, load_balance=False).tolist() == [4, 5, 6, 7]
    assert chunk_bounds(12, 0, 1) == [(0, 6), (6, 6)]
    x = torch.arange(2 * 24 * 3).view(2, 24, 3)
    for cp in (1, 2, 3, 4):
        for balance in (True, False):
            shards = [shard_sequence(x, r, cp, dim=1, load_balance=balance) for r in range(cp)]
            for r, s in enumerate(shards):
                pos = positions_for_rank(24, r, cp, balance)
                assert torch.equal(s, x[:, pos])
            assert torch.equal(unshard_sequence(shards, dim=1, load_balance=balance), x)
    with pytest.raises(ValueError, match="divisible"):
        chunk_bounds(10, 0, 3)


def test_block_kind():
    assert _block_kind(0, 4, 4, 4, 0) == SKIP          # keys entirely in the future
    assert _block_kind(4, 4, 0, 4, 0) == FULL          # keys entirely in the past
    assert _block_kind(4, 4, 4, 4, 0) == MASKED        # diagonal
    assert _block_kind(12, 4, 0, 4, 3) == SKIP         # entirely outside the window
    assert _block_kind(12, 4, 0, 4, 13) == MASKED      # window edge crosses the block
    assert _block_kind(12, 4, 0, 4, 16) == FULL        # max distance 15 < 16
    for qs, ks, w in [(0, 0, 0), (8, 0, 3), (8, 4, 6), (4, 8, 0), (20, 0, 5), (5, 2, 1)]:
        m = window_mask(4, 4, w, "cpu", qs, ks)
        kind = _block_kind(qs, 4, ks, 4, w)
        assert kind == (SKIP if not m.any() else FULL if m.all() else MASKED)


def test_plan_skips_future_and_out_of_window_blocks():
    cp, local = 4, 2 * CHUNK
    for r in range(cp):
        plan = _plan(r, cp, local, 0, True)
        # Step 0 (own K/V): two diagonal blocks and tail queries over the head chunk; every
        # later step computes 2 of its 4 chunk pairs. Same work on every rank: 2*cp+1 blocks.
        assert [len(b) for b in plan] == [3] + [2] * (cp - 1)
        assert sum(m is not None for b in plan for *_, m, _causal in b) == 2
    # Window smaller than a chunk: only the diagonal and the chunk just before it are touched.
    for r in range(cp):
        n_blocks = sum(len(b) for b in _plan(r, cp, local, 3, True))
        assert n_blocks == 4 - (r == 0)  # chunk 0 has no predecessor


@pytest.mark.parametrize("name", ["causal_gqa", "window_lt_chunk_gqa", "window_gt_chunk_gqa",
                                  "causal_contiguous"])
def test_single_process_matches_sdpa(name):
    errs = run_case(name, None, 0, 1)  # no process group: plain attention, cp = 1
    assert max(errs.values()) < TOL[CASES[name][4]], errs


@pytest.mark.parametrize("window,fused", [(0, 3), (20, 3), (3, 0)])
def test_unmasked_and_causal_blocks_run_the_fused_kernel(monkeypatch, window, fused):
    """Blocks with no mask or exactly the causal one run the fused kernel (the CPU counterpart
    of FlashAttention here), forward and backward, and other blocks the einsums: two chunks of
    8 make two diagonal blocks and one full one; a window of 20 reaches past both chunks (all
    three fused), a window of 3 cuts every block (none)."""
    from myria.parallel import context

    calls = {"fwd": 0, "bwd": 0}
    real_f, real_b = context._fused_block, context._fused_block_grads
    monkeypatch.setattr(context, "_fused_block",
                        lambda *a: calls.__setitem__("fwd", calls["fwd"] + 1) or real_f(*a))
    monkeypatch.setattr(context, "_fused_block_grads",
                        lambda *a: calls.__setitem__("bwd", calls["bwd"] + 1) or real_b(*a))
    q, k, v, dout = make_inputs(4 * CHUNK, 4, 2, torch.float32)
    ref = reference(q, k, v, dout, window)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = ring_attention(q, k, v, window=window)
    out.backward(dout)
    assert calls == {"fwd": fused, "bwd": fused}
    for got, want in zip((out, q.grad, k.grad, v.grad), ref, strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_a_fused_kernel_that_fails_its_check_leaves_the_einsums(monkeypatch, caplog):
    """The CUDA kernels' one-time check: a kernel that raises (here: a device with no such
    kernel) is not used again in the process, and says why once."""
    from myria.parallel import context

    monkeypatch.setattr(context, "_CUDA_FUSED", None)
    q = torch.empty(1, 4, 8, 64, device="meta")
    with caplog.at_level("WARNING", logger="myria"):
        assert context._cuda_fused_ok(q) is False
        assert context._cuda_fused_ok(q) is False
    assert context._CUDA_FUSED is False
    msgs = [r.getMessage() for r in caplog.records if "fused CUDA kernel" in r.getMessage()]
    assert len(msgs) == 1 and "blocks run as fp32 einsums" in msgs[0], msgs


def test_bf16_inputs_compute_in_fp32():
    q, k, v, dout = make_inputs(16, 4, 2, torch.float32)
    ref = reference(q, k, v, dout, 5)
    qb, kb, vb = (t.bfloat16().requires_grad_() for t in (q, k, v))
    out = ring_attention(qb, kb, vb, window=5)
    out.backward(dout.bfloat16())
    assert out.dtype == qb.grad.dtype == kb.grad.dtype == torch.bfloat16
    for got, want in zip((out, qb.grad, kb.grad, vb.grad), ref, strict=True):
        torch.testing.assert_close(got.float(), want, atol=5e-2, rtol=5e-2)


def test_swap_core_attention():
    from myria.config import ModelConfig
    from myria.models.transformer import build_model

    model = build_model(ModelConfig(vocab_size=32, layers=2, hidden=16, heads=2,
                                    attention_window=5, seq_len=16), "cpu")
    assert swap_core_attention(model, None) == 2
    core = model.layers["1"].attention.core
    assert isinstance(core, RingAttention) and core.window == 5


# -- multi-process (gloo) -----------------------------------------------------------------------



def _model_case(group, rank, size):
    """A llama model with ring attention on sharded tokens vs the same model unsharded."""
    import torch.distributed as dist

    from myria.config import ModelConfig
    from myria.models.transformer import build_model

    cfg = ModelConfig(vocab_size=64, layers=2, hidden=32, heads=4, kv_heads=2,
                      seq_len=2 * size * CHUNK, attention_window=6)
    ref, cp = build_model(cfg, "cpu"), build_model(cfg, "cpu")
    ref.init_weights(3)
    cp.init_weights(3)
    tokens = torch.randint(0, 64, (2, cfg.seq_len + 1), generator=torch.Generator().manual_seed(5))
    inp, tgt = tokens[:, :-1], tokens[:, 1:]
    ref(inp, tgt).backward()
    swap_core_attention(cp, group)
    pos = positions_for_rank(cfg.seq_len, rank, size)
    cos, sin = cp.rope_cos[pos], cp.rope_sin[pos]
    cp.rope_tables_for = lambda s, dtype: (cos.to(dtype), sin.to(dtype))
    loss = cp(shard_sequence(inp, rank, size), shard_sequence(tgt, rank, size)) / size
    loss.backward()  # equal tokens per rank: the mean of local means is the global mean
    total = loss.detach().clone()
    dist.all_reduce(total, group=group)
    err = {"loss": abs(total.item() - ref(inp, tgt).item())}
    grad_err = 0.0
    for (_, a), (_, b) in zip(cp.named_parameters(), ref.named_parameters(), strict=True):
        dist.all_reduce(a.grad, group=group)
        grad_err = max(grad_err, (a.grad - b.grad).abs().max().item())
    err["grad"] = grad_err
    return err


def _worker(rank: int, world: int, port: int, out_dir: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    init(rank, world, port)
    try:
        results = {}
        group = dist.group.WORLD
        for name in CASES:
            results[name] = run_case(name, group, rank, world)
        results["model"] = _model_case(group, rank, world)
        if world == 4:
            # Two cp groups of 2 with non-adjacent global ranks: {0, 2} and {1, 3}.
            subs = [dist.new_group([0, 2]), dist.new_group([1, 3])]
            sub = subs[rank % 2]
            results["subgroup_window_gqa"] = run_case("window_gt_chunk_gqa", sub,
                                                      dist.get_rank(sub), 2)
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(results, f)
    except BaseException:
        dist.destroy_process_group()
        raise
    finish()  # barrier, then leave without torch's gloo teardown (see tests/dist.finish)


@pytest.fixture(scope="module", params=[2, 4], ids=lambda w: f"world{w}")
def ring_results(request, tmp_path_factory):
    world = request.param
    out = tmp_path_factory.mktemp(f"ring{world}")
    spawn(_worker, world, str(out))
    return world, [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_ring_matches_full_attention(ring_results, name):
    world, results = ring_results
    tol = TOL[CASES[name][4]]
    for rank, res in enumerate(results):
        assert max(res[name].values()) < tol, f"world {world} rank {rank} {name}: {res[name]}"


@pytest.mark.slow
def test_ring_on_subgroups_and_in_model(ring_results):
    world, results = ring_results
    for rank, res in enumerate(results):
        assert res["model"]["loss"] < 1e-5 and res["model"]["grad"] < 1e-5, (rank, res["model"])
        if world == 4:
            assert max(res["subgroup_window_gqa"].values()) < 1e-5, (rank, res)
