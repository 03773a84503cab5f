"""Decoder-only language model, with no parallelism code inside.

Llama-style or GPT-style, with softmax, block-sparse (Longformer) or linear attention; or RetNet
(retention in place of attention), Griffin (RG-LRU recurrent blocks mixed with local
attention) or a hybrid (Gated DeltaNet, Mamba-2, attention and RG-LRU layers per
`block_pattern`). Every block is norm -> temporal mixer (`Block.attention`) -> norm -> MLP;
only the mixer differs (`make_mixer`), so parallelism, checkpoints and the trainer treat them
alike.

Build it on the meta device, let parallelism wrap it, move it with `to_empty`, then call
`init_weights(seed)`. Initial values are a pure function of (seed, parameter name), whatever
the sharding, so every parallel layout starts from the same model.
"""

from __future__ import annotations

import math
import zlib

import torch
import torch.nn.functional as F
from torch import nn

from myria.config import ModelConfig
from myria.models.attention import (
    BlockSparseAttention,
    CoreAttention,
    apply_rope,
    rope_tables,
)
from myria.models.flops import layer_kind
from myria.models.linear_attention import LinearAttention
from myria.models.loss import fused_linear_cross_entropy


def _norm(cfg: ModelConfig) -> nn.Module:
    if cfg.arch == "gpt":
        return nn.LayerNorm(cfg.hidden, eps=cfg.norm_eps)
    return nn.RMSNorm(cfg.hidden, eps=cfg.norm_eps)


class Attention(nn.Module):
    """Multi-head / grouped-query self-attention with RoPE (llama) or none (gpt)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        bias = cfg.arch == "gpt"
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.heads, cfg.n_kv_heads, cfg.head_dim
        self.use_rope = cfg.arch != "gpt" and cfg.attention != "linear"
        qkv_bias = bias or cfg.qkv_bias
        self.wq = nn.Linear(cfg.hidden, cfg.heads * cfg.head_dim, bias=qkv_bias)
        self.wk = nn.Linear(cfg.hidden, cfg.n_kv_heads * cfg.head_dim, bias=qkv_bias)
        self.wv = nn.Linear(cfg.hidden, cfg.n_kv_heads * cfg.head_dim, bias=qkv_bias)
        self.wo = nn.Linear(cfg.heads * cfg.head_dim, cfg.hidden, bias=bias)
        if cfg.attention == "block_sparse" or cfg.arch == "griffin":  # Griffin: local only
            self.core = BlockSparseAttention(cfg.attention_window, cfg.global_tokens,
                                             cfg.chunk_size)
        elif cfg.attention == "linear":
            self.core = LinearAttention(cfg.feature_map, cfg.chunk_size)
        else:
            self.core = CoreAttention(cfg.attention_window)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None,
                doc_ids: torch.Tensor | None = None):
        b, s, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds a slice of the heads.
        q = self.wq(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        if self.use_rope:
            cos, sin = rope
            if cos.dim() == 2:  # one table for every sequence (else (B, 1, S, D) per sequence)
                cos, sin = cos[:s], sin[:s]
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        o = self.core(q, k, v) if doc_ids is None else self.core(q, k, v, doc_ids)
        return self.wo(o.transpose(1, 2).reshape(b, s, -1))


def make_mixer(cfg: ModelConfig, index: int) -> nn.Module:
    """The temporal-mixing module of layer `index` (called `attention` in every block)."""
    kind = layer_kind(cfg, index)
    if kind == "retention":
        from myria.models.retention import Retention
        return Retention(cfg)
    if kind == "recurrent":
        from myria.models.griffin import RecurrentBlock
        return RecurrentBlock(cfg)
    if kind == "deltanet":
        from myria.models.deltanet import GatedDeltaNet
        return GatedDeltaNet(cfg)
    if kind == "mamba2":
        from myria.models.mamba2 import Mamba2
        return Mamba2(cfg)
    return Attention(cfg)


def _ssm_init_rule(name: str) -> tuple[str, float] | None:
    """Initialisation of the Gated DeltaNet and Mamba-2 parameters that are not projections:
    decay rates A in [1, 16] (A_log = log A), steps dt log-uniform in [0.001, 0.1] through
    softplus (dt_bias), skip D = 1 (as both papers' reference code), and the short
    convolutions with the variance of torch's default uniform(+-1/sqrt(4))."""
    if name.endswith(".A_log"):
        return ("a_log", 0.0)
    if name.endswith(".dt_bias"):
        return ("dt_bias", 0.0)
    if name.endswith("attention.D"):
        return ("ones", 0.0)
    if ".attention.conv_" in name and name.endswith("_weight") \
            and not name.endswith("attention.conv_weight"):
        return ("normal", (1 / 12) ** 0.5)
    return None


class MLP(nn.Module):
    """SwiGLU (llama) or GELU (gpt) feed-forward network."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gated = cfg.arch != "gpt"
        bias = cfg.arch == "gpt"
        self.w1 = nn.Linear(cfg.hidden, cfg.ffn_dim, bias=bias)
        self.w2 = nn.Linear(cfg.ffn_dim, cfg.hidden, bias=bias)
        self.w3 = nn.Linear(cfg.hidden, cfg.ffn_dim, bias=False) if self.gated else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gated:
            return self.w2(F.silu(self.w1(x)) * self.w3(x))
        return self.w2(F.gelu(self.w1(x), approximate="tanh"))


class Block(nn.Module):
    """Pre-norm transformer block; `parallel_block` computes attention and MLP from one input."""

    def __init__(self, cfg: ModelConfig, index: int = 0):
        super().__init__()
        self.parallel = cfg.parallel_block
        self.attention_norm = _norm(cfg)
        self.attention = make_mixer(cfg, index)
        self.ffn_norm = None if self.parallel else _norm(cfg)
        if cfg.experts:
            from myria.models.moe import MoE  # optional layer; dense models never import it
            self.feed_forward = MoE(cfg)
        else:
            self.feed_forward = MLP(cfg)

    def forward(self, x: torch.Tensor, rope=None, doc_ids: torch.Tensor | None = None):
        kw = {} if doc_ids is None else {"doc_ids": doc_ids}  # document masking (softmax only)
        if self.parallel:  # MegaScale §3.1: y = x + Attn(LN(x)) + MLP(LN(x))
            n = self.attention_norm(x)
            return x + self.attention(n, rope, **kw) + self.feed_forward(n)
        h = x + self.attention(self.attention_norm(x), rope, **kw)
        return h + self.feed_forward(self.ffn_norm(h))


class LMHead(nn.Linear):
    """Output projection; given targets it returns the mean cross-entropy (fused, chunked).

    A Linear subclass (no bias) so tensor parallelism can shard it like any projection.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg.hidden, cfg.vocab_size, bias=False)

    def forward(self, h: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        if targets is None:
            return F.linear(h, self.weight)
        return fused_linear_cross_entropy(h, self.weight, targets)


class Transformer(nn.Module):
    """Decoder-only LM: embeddings -> blocks -> final norm -> output head.

    Submodules may be set to None (pipeline stages keep only their part); `layers` is a
    ModuleDict keyed by the global layer index so that parameter names never change.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden)
        self.pos_embeddings = nn.Embedding(cfg.seq_len, cfg.hidden) if cfg.arch == "gpt" else None
        self.layers = nn.ModuleDict({str(i): Block(cfg, i) for i in range(cfg.layers)})
        self.norm = _norm(cfg)
        self.output = LMHead(cfg)
        if cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.register_buffer("rope_cos", torch.empty(0), persistent=False)
        self.register_buffer("rope_sin", torch.empty(0), persistent=False)
        # Absolute positions of the tokens this module is given, when they are not 0..S-1
        # (a context-parallel rank holds a head and a tail chunk of each sequence).
        self.positions: torch.Tensor | None = None

    # -- initialisation -------------------------------------------------------------------
    def to_empty(self, *, device, recurse: bool = True):
        """nn.Module's, keeping tied embeddings one tensor: materialising gives every module a
        parameter of its own, so the output layer is pointed back at the embedding's (FSDP2
        swaps parameters in place and keeps them tied already)."""
        super().to_empty(device=device, recurse=recurse)
        if (self.cfg.tie_embeddings and self.output is not None
                and self.tok_embeddings is not None
                and self.output.weight is not self.tok_embeddings.weight):
            self.output.weight = self.tok_embeddings.weight
        return self

    def _init_rule(self, name: str) -> tuple[str, float]:
        """How parameter `name` is initialised: ('normal', std), ('ones', 0) or ('zeros', 0)."""
        ssm_rule = _ssm_init_rule(name)   # Gated DeltaNet and Mamba-2
        if ssm_rule is not None:
            return ssm_rule
        if "norm" in name:
            return ("ones", 0.0) if name.endswith("weight") else ("zeros", 0.0)
        if name.endswith("bias"):
            return ("zeros", 0.0)
        if name.endswith("rglru.a_param"):
            return ("lru", 0.0)
        std = self.cfg.init_std
        if name.endswith(("wo.weight", "w2.weight")) or ".experts.w2" in name:
            std = std / math.sqrt(2 * self.cfg.layers)  # GPT-2 residual scaling
        return ("normal", std)

    @torch.no_grad()
    def init_weights(self, seed: int = 0, buffers_only: bool = False) -> None:
        """Fill every parameter as a pure function of (seed, name); also rebuild RoPE tables."""
        if self.cfg.arch != "gpt":
            dev = self.rope_cos.device if self.rope_cos.device.type != "meta" else "cpu"
            cos, sin = rope_for(self.cfg, self.cfg.seq_len, dev)
            self.rope_cos, self.rope_sin = cos, sin
        if buffers_only:
            return
        seen = set()
        for name, p in self.named_parameters():
            if id(p) in seen:
                continue
            seen.add(id(p))
            self.init_parameter(name, p, seed)

    @torch.no_grad()
    def init_parameter(self, name: str, p: torch.Tensor, seed: int) -> None:
        """Fill parameter `name` (as named_parameters gives it) as a pure function of
        (seed, name); init_weights does this for all, parameter offload one layer at a time."""
        from myria.models.init import canonical_name, fill_parameter

        name = canonical_name(name)
        if self.cfg.tie_embeddings and name == "output.weight":
            # a pipeline's last stage holds its own copy of the tied embedding (the first
            # stage has the embedding): the same values
            name = "tok_embeddings.weight"
        kind, std = self._init_rule(name)
        key = (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63)
        fill_parameter(p, kind, std, key)

    # -- forward ---------------------------------------------------------------------------
    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None,
                documents: tuple[torch.Tensor, torch.Tensor | None] | None = None):
        """tokens (B, S) -> logits (B, S, V), or the mean loss when targets are given.

        In training mode an MoE model's loss includes its router losses (`models.moe`).

        `documents` (document masking): the document ids of the whole sequence (B, S_full;
        under context parallelism every rank gets all of them, for the keys of other ranks) and,
        when positions restart per document, this rank's positions (B, S) — from
        `attention.document_segments`. Without it attention is causal over the whole sequence.

        A pipeline stage without embeddings takes hidden states (B, S, H) instead of tokens;
        one without a head returns hidden states.
        """
        doc_ids, doc_pos = documents if documents is not None else (None, None)
        if self.tok_embeddings is not None:
            h = self.tok_embeddings(tokens)
            if self.pos_embeddings is not None:
                pos = self.positions if self.positions is not None else \
                    torch.arange(tokens.shape[1], device=tokens.device)
                h = h + self.pos_embeddings(pos)
        else:
            h = tokens
        rope = None
        if self.cfg.arch != "gpt":
            if doc_pos is not None:  # positions restart in every document: a table per sequence
                rope = (self.rope_cos[doc_pos].unsqueeze(1).to(h.dtype),
                        self.rope_sin[doc_pos].unsqueeze(1).to(h.dtype))
            else:
                rope = self.rope_tables_for(h.shape[1], h.dtype)
        for layer in self.layers.values():
            h = layer(h, rope) if doc_ids is None else layer(h, rope, doc_ids)
        if self.norm is not None:
            h = self.norm(h)
        if self.output is None:
            return h
        out = self.output(h, targets)
        if targets is not None and self.training and self.cfg.experts:
            from myria.models.moe import moe_aux_loss  # router losses of this forward's layers
            # a part without MoE layers (a pipeline stage of the ends, the CPU profile's head
            # alone) has none
            if (aux := moe_aux_loss(self)) is not None:
                out = out + aux
        return out

    def rope_tables_for(self, s: int, dtype: torch.dtype):
        if self.positions is not None:
            cos, sin = self.rope_cos[self.positions], self.rope_sin[self.positions]
        else:  # the whole table: under sequence parallelism attention sees more than `s`
            cos, sin = self.rope_cos, self.rope_sin
        return cos.to(dtype), sin.to(dtype)


def rope_for(cfg: ModelConfig, length: int, device=None):
    """cos and sin tables of `length` positions for model `cfg` (its theta and scaling)."""
    scaling = {"none": None, "linear": ("linear", cfg.rope_factor),
               "llama3": ("llama3", cfg.rope_factor, cfg.rope_low_freq_factor,
                          cfg.rope_high_freq_factor, cfg.rope_original_max_len)}[cfg.rope_scaling]
    return rope_tables(length, cfg.head_dim, cfg.rope_theta, device, scaling=scaling)


def build_model(cfg: ModelConfig, device: str | torch.device = "meta") -> Transformer:
    """Construct the model on `device` (meta by default: no memory, no initialisation)."""
    with torch.device(device):
        return Transformer(cfg)


def count_params(model: nn.Module, exclude_embeddings: bool = False) -> int:
    """Number of distinct parameters (tied weights counted once)."""
    seen, total = set(), 0
    for name, p in model.named_parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        if exclude_embeddings and ("embeddings" in name):
            continue
        total += p.numel()
    return total
