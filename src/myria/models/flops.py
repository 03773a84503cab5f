"""Model FLOPs and parameter counts: the one source for the live MFU meter and the planner.

Counts multiply-adds as 2 FLOPs; a training step is forward + backward = 3x the forward FLOPs
of every matmul (no recomputation: these are *model* FLOPs). Conventions for attention and the
output layer: ``dense`` (default, the MFU meter's: every query charged for all keys its band can
hold), ``causal`` (only unmasked (query, key) pairs) and ``megatron`` (Narayanan et al. 2021
scaled to model FLOPs; for GPT F = 72 B s l h^2 (1 + s/6h + V/16lh) per iteration). The
sub-quadratic mixers are charged what their implementation multiplies, under every convention.
All counts are of matmuls (and the convolution), exactly as
`torch.utils.flop_counter.FlopCounterMode` counts them (tested); elementwise work is not
counted. With ``model.document_mask`` attention is charged as if every sequence were documents
of the mean length ``model.document_len`` (0: the trainer's meter uses the training data's).
The formula of each mixer: docs/architectures.md, "Reasons behind the model modules".
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from myria.config import ModelConfig

CONVENTIONS = ("dense", "causal", "megatron")


# Elements of fp32 logits per chunk of the fused loss, by device type. A CPU's 4 Mi (16 MB);
# an accelerator's 64 Mi (256 MB): ~2k rows at a 32k vocabulary, so that the chunk's three
# GEMMs are long enough for the tensor cores (a few hundred rows run far below their rate:
# the M sweep of bench/gpu_gemm_shapes.py) and the loop issues a few dozen kernels, not hundreds.
LOSS_CHUNK_ELEMS = {"cpu": 1 << 22}
LOSS_CHUNK_ELEMS_ACCELERATOR = 1 << 26


def loss_chunk_rows(vocab: int, device_type: str = "cpu") -> int:
    """Rows per chunk of myria's fused linear + cross-entropy (models/loss.py) on a device of
    `device_type`: logits of about LOSS_CHUNK_ELEMS elements at a time (the planner prices the
    CPU's chunks: the eager runtime it prices runs there)."""
    target = LOSS_CHUNK_ELEMS.get(device_type, LOSS_CHUNK_ELEMS_ACCELERATOR)
    return max(16, target // max(vocab, 1))


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
    gate: float = 0.0          # retention's swish gate, Griffin's gate branch and RG-LRU gates
    conv: float = 0.0          # Griffin's temporal convolution
    state: float = 0.0         # recurrent state update and readout (linear attention, retention)
    solve: float = 0.0         # Gated DeltaNet's triangular solves (the WY representation)

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


# block_pattern letters of model.arch = "hybrid" -> layer kinds
HYBRID_KINDS = {"D": "deltanet", "M": "mamba2", "A": "attention", "R": "recurrent"}


def layer_kind(cfg: ModelConfig, index: int) -> str:
    """The temporal mixer of layer `index`: attention, retention, recurrent (RG-LRU),
    deltanet (Gated DeltaNet) or mamba2."""
    if cfg.arch == "retnet":
        return "retention"
    if cfg.arch == "griffin":
        pat = cfg.block_pattern
        return "recurrent" if pat[index % len(pat)] == "R" else "attention"
    if cfg.arch == "hybrid":
        return HYBRID_KINDS[cfg.block_pattern[index % len(cfg.block_pattern)]]
    return "attention"


def block_sparse_keys(seq_len: int, window: int, n_global: int, block: int,
                      convention: str = "dense") -> float:
    """Average keys per query of block-sparse attention (`models.attention`): what the kernel
    multiplies (dense masked SDPA or the blockwise form), or the unmasked pairs (causal)."""
    s, w, g = seq_len, window, n_global
    if convention == "causal":
        total = sum(i + 1 if i < g else min(i + 1, w) + max(0, min(g, i + 1 - w))
                    for i in range(s))
        return total / s
    if convention not in CONVENTIONS:
        raise ValueError(f"unknown FLOP convention {convention!r}; valid: {CONVENTIONS}")
    if s <= g + w + block:
        return float(s)
    total = 0
    for i0 in range(0, s, block):
        i1 = min(s, i0 + block)
        lo = max(0, i0 - w + 1)
        keys = i1 if (i0 < g or lo <= g) else g + i1 - lo
        total += (i1 - i0) * keys
    return total / s


def _chunked_per_token(s: int, chunk: int, d: int, pad: bool) -> tuple[float, float, float]:
    """(scores, values, state) FLOPs per token and head of a chunked linear form; `pad`: the
    last chunk is padded to full length (linear attention) rather than cut (retention)."""
    if pad:
        padded = -(-s // chunk) * chunk / s
        return padded * 2 * chunk * d, padded * 2 * chunk * d, padded * 4 * d * d
    full, last = divmod(s, chunk)
    pairs = full * chunk * chunk + last * last
    return 2 * d * pairs / s, 2 * d * pairs / s, 4 * d * d


def _ssm_flops(cfg: ModelConfig, kind: str, s: int) -> ForwardFlops:
    """Forward FLOPs per token of a Gated DeltaNet or Mamba-2 mixer, as their chunked forms
    run them (the sequence padded to whole chunks of C = chunk_size tokens)."""
    h, n_heads, c = cfg.hidden, cfg.heads, cfg.chunk_size
    padded = -(-s // c) * c / s
    f = ForwardFlops()
    if kind == "deltanet":   # d_k = d_v = head_dim, width = hidden
        w, d = n_heads * cfg.head_dim, cfg.head_dim
        f.qkv = 2 * h * 3 * w
        f.gate = 2 * h * w + 2 * h * 2 * n_heads          # W_g; beta and decay projections
        f.conv = 3 * 2 * w * 4
        f.attn_out = 2 * w * h
        # per head: K K^T and Q K^T (2CD each), scores x U (2CD); W S, Q S and K^T U (2D^2 each)
        f.attn_scores = n_heads * padded * 2 * 2 * c * d
        f.attn_values = n_heads * padded * 2 * c * d
        f.state = n_heads * padded * 3 * 2 * d * d
        # unit lower-triangular solve, C x C against 2D right-hand sides: C(C-1) per column
        f.solve = n_heads * padded * (c - 1) * 2 * d
        return f
    inner = cfg.ssm_expand * h
    p, n, bc = inner // n_heads, cfg.ssm_state, cfg.n_kv_heads * cfg.ssm_state
    f.qkv = 2 * h * (inner + 2 * bc)                       # W_x, W_B, W_C
    f.gate = 2 * h * inner + 2 * h * n_heads               # W_z, W_dt
    f.conv = 2 * 4 * (inner + 2 * bc)
    f.attn_out = 2 * inner * h
    # per head: C B^T (2CN), scores x X (2CP); state read and write (2NP each)
    f.attn_scores = n_heads * padded * 2 * c * n
    f.attn_values = n_heads * padded * 2 * c * p
    f.state = n_heads * padded * 2 * 2 * n * p
    return f


def _mixer_flops(cfg: ModelConfig, kind: str, s: int, convention: str) -> ForwardFlops:
    """Forward FLOPs per token of one layer's temporal mixer."""
    h, hd = cfg.hidden, cfg.head_dim
    q_dim, kv_dim = cfg.heads * hd, cfg.n_kv_heads * hd
    if kind in ("deltanet", "mamba2"):
        return _ssm_flops(cfg, kind, s)
    f = ForwardFlops()
    if kind == "recurrent":   # Griffin: width = hidden
        w = h
        f.qkv = 2 * h * w                       # W_x
        f.gate = 2 * h * w + 2 * 2 * w * (w // cfg.heads)   # W_y and the two gates
        f.conv = 2 * w * 4
        f.attn_out = 2 * w * h
        return f
    f.qkv = 2 * h * (q_dim + 2 * kv_dim)
    f.attn_out = 2 * q_dim * h
    if kind == "retention":
        f.gate = 2 * h * q_dim
        if s <= cfg.chunk_size:
            f.attn_scores = f.attn_values = 2 * q_dim * s
        else:
            sc, va, st = _chunked_per_token(s, cfg.chunk_size, hd, pad=False)
            f.attn_scores, f.attn_values, f.state = (cfg.heads * x for x in (sc, va, st))
        return f
    if cfg.attention == "linear":
        sc, va, st = _chunked_per_token(s, cfg.chunk_size, hd, pad=True)
        f.attn_scores, f.attn_values, f.state = (cfg.heads * x for x in (sc, va, st))
        return f
    if cfg.attention == "block_sparse" or cfg.arch == "griffin":
        keys = block_sparse_keys(s, cfg.attention_window, cfg.global_tokens, cfg.chunk_size,
                                 convention)
    else:
        keys = keys_per_query(s, cfg.attention_window, convention)
    f.attn_scores = 2 * q_dim * keys
    f.attn_values = 2 * q_dim * keys
    return f


def forward_flops_per_token(cfg: ModelConfig, convention: str = "dense",
                            seq_len: int | None = None) -> ForwardFlops:
    """Forward FLOPs per token of the whole model, by operator."""
    h, L = cfg.hidden, cfg.layers
    s = seq_len or cfg.seq_len
    if cfg.document_mask and cfg.document_len:
        s = min(s, cfg.document_len)  # attention stays inside documents of this mean length
    f = ForwardFlops()
    kinds = [layer_kind(cfg, i) for i in range(L)]
    for kind in set(kinds):
        part = _mixer_flops(cfg, kind, s, convention)
        n = kinds.count(kind)
        for k, v in part.as_dict().items():
            setattr(f, k, getattr(f, k) + n * v)
    n_mats = 3 if cfg.arch != "gpt" else 2
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
    per_layer_dense: float   # attention + norms (+ dense MLP); Griffin: mean over its layers
    per_layer_experts: int   # all experts of one layer (0 for a dense model)
    per_layer_active_experts: int
    final_norm: int
    head: int                # 0 when tied

    def total(self, layers: int) -> int:
        return round(self.embedding + self.positional + self.final_norm + self.head
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
    if cfg.arch == "retnet":
        attn = 5 * h * q_dim                     # wq, wk, wv, swish gate, wo
    elif cfg.arch in ("griffin", "hybrid"):   # layers differ: the per-layer figure is a mean
        w, blk = h, h // cfg.heads
        nh = cfg.heads
        inner, bc = cfg.ssm_expand * h, cfg.n_kv_heads * cfg.ssm_state
        mixer = {
            "attention": attn,
            # W_x W_y W_o, conv, gates, decay
            "recurrent": 3 * h * w + 5 * w + 2 * (w * blk + w) + w,
            # W_q W_k W_v W_g W_o, beta and decay projections, 3 convs, A_log, dt_bias, norm
            "deltanet": 5 * h * q_dim + 2 * h * nh + 3 * 4 * q_dim + 2 * nh + q_dim,
            # W_z W_x W_o, W_B W_C, W_dt, convs with biases, A_log dt_bias D, norm
            "mamba2": 3 * h * inner + 2 * h * bc + h * nh + 5 * (inner + 2 * bc) + 3 * nh
            + inner,
        }
        attn = sum(mixer[layer_kind(cfg, i)] for i in range(cfg.layers)) / cfg.layers
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
