"""Model FLOPs and parameter counts: the one source for the live MFU meter and the planner.

Counts multiply-adds as 2 FLOPs; a training step is forward + backward = 3x the forward FLOPs
of every matmul (no recomputation: these are *model* FLOPs). Attention's two batched matmuls
(QK^T and PV) cost 4 * (query heads * head_dim) FLOPs per (query, key) pair.

Conventions for attention and the output layer:

- ``dense`` (default, used by the MFU meter): every query is charged for the keys its band can
  hold: all S keys for plain causal attention (as in PaLM, Megatron-LM and MegaScale, and as
  `torch.utils.flop_counter` counts SDPA), min(window, S) with a sliding window.
- ``causal``: only unmasked (query, key) pairs: (S+1)/2 keys per query on average for causal,
  fewer with a window. This is the work a block-sparse kernel must do at least.
- ``megatron``: the convention of Narayanan et al. 2021 scaled to model FLOPs, as the published
  MFU figures use it: 3/4 of the recomputing count (4 layer passes, 3 logit passes), i.e. dense
  attention with the logit layer charged 2.25x its forward instead of 3x. For the GPT
  architecture it equals F = 72 B s l h^2 (1 + s/6h + V/16lh) per iteration.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from myria.config import ModelConfig

CONVENTIONS = ("dense", "causal", "megatron")


def loss_chunk_rows(vocab: int, target_elems: int = 1 << 22) -> int:
    """Rows per chunk of myria's fused linear + cross-entropy (models/loss.py): logits of
    about `target_elems` elements at a time (the planner prices the same chunks)."""
    return max(16, target_elems // max(vocab, 1))


@dataclass
class ForwardFlops:
    """Forward FLOPs per token, by operator, summed over all layers."""

    qkv: float = 0.0
    attn_scores: float = 0.0   # QK^T
    attn_values: float = 0.0   # PV
    attn_out: float = 0.0      # output projection
    mlp: float = 0.0           # dense MLP or the active experts
    router: float = 0.0        # MoE gate
    logits: float = 0.0        # output layer

    @property
    def total(self) -> float:
        return sum(getattr(self, f.name) for f in fields(self))

    def as_dict(self) -> dict[str, float]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def keys_per_query(seq_len: int, window: int, convention: str) -> float:
    """Average number of keys a query is charged for under `convention`."""
    s, w = seq_len, (window or seq_len)
    w = min(w, s)
    if convention in ("dense", "megatron"):
        return float(w)
    if convention == "causal":
        # query i (0-based) sees min(i + 1, w) keys
        full = w * (w + 1) / 2 + (s - w) * w
        return full / s
    raise ValueError(f"unknown FLOP convention {convention!r}; valid: {CONVENTIONS}")


def forward_flops_per_token(cfg: ModelConfig, convention: str = "dense",
                            seq_len: int | None = None) -> ForwardFlops:
    """Forward FLOPs per token of the whole model, by operator."""
    h, hd, L = cfg.hidden, cfg.head_dim, cfg.layers
    q_dim, kv_dim = cfg.heads * hd, cfg.n_kv_heads * hd
    s = seq_len or cfg.seq_len
    f = ForwardFlops()
    f.qkv = L * 2 * h * (q_dim + 2 * kv_dim)
    keys = keys_per_query(s, cfg.attention_window, convention)
    f.attn_scores = L * 2 * q_dim * keys
    f.attn_values = L * 2 * q_dim * keys
    f.attn_out = L * 2 * q_dim * h
    n_mats = 3 if cfg.arch == "llama" else 2
    active = cfg.top_k if cfg.experts else 1
    f.mlp = L * active * n_mats * 2 * h * cfg.ffn_dim
    f.router = L * 2 * h * cfg.experts if cfg.experts else 0.0
    f.logits = 2 * h * cfg.vocab_size
    return f


def model_flops_per_token(cfg: ModelConfig, convention: str = "dense",
                          seq_len: int | None = None) -> float:
    """Training (forward + backward) model FLOPs per token."""
    f = forward_flops_per_token(cfg, convention, seq_len)
    logit_factor = 2.25 if convention == "megatron" else 3.0
    return 3.0 * (f.total - f.logits) + logit_factor * f.logits


def megatron_gpt_flops_per_iteration(batch: int, seq_len: int, layers: int, hidden: int,
                                     vocab: int) -> float:
    """F = 72 B s l h^2 (1 + s/6h + V/16lh): the published model-FLOPs formula for GPT."""
    b, s, n, h, v = batch, seq_len, layers, hidden, vocab
    return 72.0 * b * s * n * h * h * (1 + s / (6 * h) + v / (16 * n * h))


@dataclass
class ParamCounts:
    """Parameter counts by group (tied embeddings counted once)."""

    embedding: int
    positional: int
    per_layer_dense: int     # attention + norms (+ dense MLP)
    per_layer_experts: int   # all experts of one layer (0 for a dense model)
    per_layer_active_experts: int
    final_norm: int
    head: int                # 0 when tied

    def total(self, layers: int) -> int:
        return (self.embedding + self.positional + self.final_norm + self.head
                + layers * (self.per_layer_dense + self.per_layer_experts))


def param_counts(cfg: ModelConfig) -> ParamCounts:
    """Parameters of the model described by `cfg`, matching `Transformer` exactly."""
    h, hd = cfg.hidden, cfg.head_dim
    q_dim, kv_dim = cfg.heads * hd, cfg.n_kv_heads * hd
    gpt = cfg.arch == "gpt"
    norm = 2 * h if gpt else h
    attn = h * (q_dim + 2 * kv_dim) + q_dim * h
    if gpt:
        attn += q_dim + 2 * kv_dim + h
    mlp = (3 if not gpt else 2) * h * cfg.ffn_dim
    if gpt:
        mlp += cfg.ffn_dim + h
    n_norms = 1 if cfg.parallel_block else 2
    dense = attn + n_norms * norm
    experts = active = 0
    if cfg.experts:
        experts = cfg.experts * mlp + h * cfg.experts
        active = cfg.top_k * mlp + h * cfg.experts
    else:
        dense += mlp
    return ParamCounts(
        embedding=cfg.vocab_size * h,
        positional=cfg.seq_len * h if gpt else 0,
        per_layer_dense=dense,
        per_layer_experts=experts,
        per_layer_active_experts=active,
        final_norm=norm,
        head=0 if cfg.tie_embeddings else cfg.vocab_size * h,
    )
