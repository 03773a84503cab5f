"""Document masking: a packed sequence's loss is the sum of its documents' losses run alone.

Each case packs documents separated by EOS into one sequence, computes the packed loss with
`documents=` (the ids from `document_segments`), and compares it with every segment run as a
sequence of its own (an EOS opens a segment, as a BOS would). Softmax attention, a sliding
window, positions restarting per document, the blockwise path for long sequences, and context
parallelism (ring attention on 2 gloo ranks).
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from myria.config import ModelConfig
from myria.models.attention import CoreAttention, document_segments
from myria.models.transformer import build_model
from tests.dist import finish, init, spawn

EOS = 3
SEQ = 32
# EOS positions of two packed sequences: a cut document first, documents of 1 to 13 tokens
EOS_AT = ([5, 6, 19, 27], [0, 11, 12, 13, 30])


def _model(**kw) -> torch.nn.Module:
    cfg = ModelConfig(vocab_size=64, layers=2, hidden=32, heads=4, kv_heads=2, seq_len=SEQ,
                      init_std=0.3, document_mask=True, **kw)
    torch.manual_seed(0)
    m = build_model(cfg, "cpu").double()
    m.init_weights(seed=1)
    return m.double()


def _packed() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    window = torch.randint(EOS + 1, 64, (len(EOS_AT), SEQ + 1), generator=g)
    for row, at in enumerate(EOS_AT):
        window[row, at] = EOS
    return window[:, :-1], window[:, 1:]


def _alone_sum(model, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Sum over tokens of the loss of every document segment run as its own sequence."""
    ids, _ = document_segments(x, EOS)
    total = torch.zeros((), dtype=torch.float64, device=x.device)
    for row in range(x.shape[0]):
        for d in ids[row].unique():
            sel = ids[row] == d
            xs, ys = x[row, sel][None], y[row, sel][None]
            total += model(xs, ys) * xs.shape[1]
    return total


def _packed_sum(model, x, y, positions: bool) -> torch.Tensor:
    ids, pos = document_segments(x, EOS)
    return model(x, y, documents=(ids, pos if positions else None)) * x.numel()


@pytest.mark.parametrize("window,positions", [(0, False), (0, True), (5, False), (5, True)])
def test_packed_loss_is_sum_of_documents(window, positions):
    model = _model(attention_window=window, document_positions=positions)
    x, y = _packed()
    with torch.no_grad():
        packed, alone = _packed_sum(model, x, y, positions), _alone_sum(model, x, y)
        causal = model(x, y) * x.numel()   # without the mask documents see each other
    assert abs(float(packed - alone)) / float(alone) < 1e-5
    assert abs(float(causal - alone)) / float(alone) > 1e-3


def test_blockwise_path_matches(monkeypatch):
    """Long sequences run block by block and never build the S x S mask: same loss."""
    model = _model(attention_window=7)
    x, y = _packed()
    with torch.no_grad():
        dense = _packed_sum(model, x, y, False)
        monkeypatch.setattr(CoreAttention, "DENSE_MASK_MAX", 8)
        for mod in model.modules():
            if isinstance(mod, CoreAttention):
                mod.block = 6
        blockwise = _packed_sum(model, x, y, False)
    assert abs(float(dense - blockwise)) / float(dense) < 1e-9


def test_segments():
    ids, pos = document_segments(torch.tensor([[7, 3, 8, 9, 3, 3, 5]]), 3)
    assert ids.tolist() == [[0, 1, 1, 1, 2, 3, 3]]
    assert pos.tolist() == [[0, 0, 1, 2, 0, 0, 1]]


def _cp_worker(rank, world, port, out_dir):
    init(rank, world, port)
    import torch.distributed as dist

    from myria.parallel.context import shard_sequence
    from myria.parallel.parallelize import apply_cp

    out = {}
    for window, positions in ((0, False), (5, True)):
        model = _model(attention_window=window, document_positions=positions)
        x, y = _packed()
        with torch.no_grad():
            alone = float(_alone_sum(model, x, y))
            apply_cp(model, None, rank, world, SEQ, torch.device("cpu"))
            ids, pos = document_segments(x, EOS)
            local = model(shard_sequence(x, rank, world), shard_sequence(y, rank, world),
                          documents=(ids, shard_sequence(pos, rank, world) if positions
                                     else None))
            total = local * (x.numel() // world)
            dist.all_reduce(total)
        out[f"{window}-{positions}"] = abs(float(total) - alone) / alone
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(out, f)
    finish()


@pytest.mark.slow
def test_context_parallel_2(tmp_path):
    spawn(_cp_worker, 2, str(tmp_path))
    for rank in range(2):
        errors = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert errors and all(e < 1e-5 for e in errors.values()), errors


def test_flops_count_attention_inside_documents():
    """Attention FLOPs scale with the mean document length; the rest does not change."""
    from myria.models.flops import forward_flops_per_token

    base = ModelConfig(seq_len=4096, hidden=256, heads=8, layers=2)
    plain = forward_flops_per_token(base)
    docs = forward_flops_per_token(ModelConfig(seq_len=4096, hidden=256, heads=8, layers=2,
                                               document_mask=True, document_len=1024))
    assert docs.attn_scores == pytest.approx(plain.attn_scores / 4)
    assert docs.mlp == plain.mlp and docs.qkv == plain.qkv


@pytest.mark.parametrize("long", [False, True], ids=["eager-flex", "compiled-flex"])
def test_flex_path_builds_the_block_mask_once_per_forward(monkeypatch, long):
    """Where FlexAttention runs the mask (CUDA; forced here, forward only, as its backward does
    not run on a CPU), the block mask is built once per forward for every layer, and a sequence
    longer than DENSE_MASK_MAX runs the compiled kernel (a stand-in here: compiling takes
    minutes on a CPU), a shorter one the eager form; the loss is the dense mask's."""
    from torch.nn.attention import flex_attention as fa

    from myria.models import attention as att

    model = _model(attention_window=5)
    x, y = _packed()
    with torch.no_grad():
        dense = _packed_sum(model, x, y, False)
    built, compiled = [], []
    real = fa.create_block_mask
    monkeypatch.setattr(fa, "create_block_mask", lambda *a, **k: built.append(1) or real(*a, **k))
    monkeypatch.setattr(att, "_FLEX",
                        lambda *a, **k: compiled.append(1) or fa.flex_attention(*a, **k))
    monkeypatch.setattr(att, "use_flex", lambda q: True)
    if long:
        monkeypatch.setattr(CoreAttention, "DENSE_MASK_MAX", 8)
    with torch.no_grad():
        flex = _packed_sum(model, x, y, False)
        assert len(built) == 1 and len(compiled) == (2 if long else 0)   # 2 layers
        _packed_sum(model, x, y, False)                                  # a new forward
        assert len(built) == 2
    assert abs(float(flex - dense)) / float(dense) < 1e-6
