"""The model section of a run's config, and the checks of its sizes and mixers.

The planner checks a model with the same rules as the trainer (`validate_model`), without a
whole run's config.
"""

from __future__ import annotations

from dataclasses import dataclass

from myria.config.schema import schema_field as _f
from myria.errors import ConfigError


@dataclass
class ModelConfig:
    """The decoder-only language model."""

    arch: str = _f("llama", "architecture: llama (RMSNorm, RoPE, SwiGLU, GQA), gpt (LayerNorm, "
                   "learned positions, GELU MLP, biases), retnet (multi-scale retention instead "
                   "of attention, llama's other parts) or griffin (RG-LRU recurrent blocks mixed "
                   "with local attention per block_pattern, llama's other parts) or hybrid (a "
                   "mixer per layer from block_pattern: Gated DeltaNet, Mamba-2, attention, "
                   "RG-LRU; llama's other parts)",
                   choices=("llama", "gpt", "retnet", "griffin", "hybrid"))
    vocab_size: int = _f(8192, "vocabulary size of the embedding and output layers", min=2)
    layers: int = _f(4, "number of transformer blocks", min=1)
    hidden: int = _f(256, "model width (embedding dimension)", min=1)
    heads: int = _f(8, "attention heads", min=1)
    kv_heads: int = _f(0, "key/value heads for grouped-query attention; 0 means equal to heads",
                       min=0)
    ffn_hidden: int = _f(0, "MLP inner width; 0 means 4*hidden (gpt) or 8/3*hidden rounded up "
                         "to a multiple of 64 (llama)", min=0)
    seq_len: int = _f(256, "training sequence length in tokens", min=1)
    parallel_block: bool = _f(False, "parallel transformer block: y = x + Attn(LN(x)) + MLP(LN(x))")
    attention_window: int = _f(0, "sliding-window attention size in tokens; 0 means full causal "
                               "(block_sparse and griffin: the local window, required); a "
                               "window >= seq_len trains as full causal attention and bounds "
                               "generation past it", min=0)
    tie_embeddings: bool = _f(False, "share the input embedding and output projection weights")
    norm_eps: float = _f(1e-5, "epsilon of RMSNorm / LayerNorm", min=0.0)
    rope_theta: float = _f(10000.0, "RoPE base frequency (llama)", min=1.0)
    init_std: float = _f(0.02, "standard deviation of the normal weight initialisation", min=0.0)
    experts: int = _f(0, "mixture-of-experts: experts per MLP layer; 0 means a dense MLP", min=0)
    top_k: int = _f(1, "experts each token is routed to (MoE)", min=1)
    capacity_factor: float = _f(0.0, "expert capacity factor; 0 means no token is dropped", min=0.0)
    attention: str = _f("softmax", "attention of llama/gpt: softmax (causal, or sliding with "
                        "attention_window), block_sparse (Longformer: "
                        "a local window of attention_window keys plus global_tokens leading "
                        "tokens every query sees) or linear (kernel feature map, no softmax, "
                        "no RoPE); griffin's A layers are always local (block_sparse adds global "
                        "tokens)", choices=("softmax", "block_sparse", "linear"))
    global_tokens: int = _f(0, "block_sparse: leading tokens that attend to all before them and "
                            "that every later query attends to", min=0)
    feature_map: str = _f("elu1", "linear attention's positive feature map: elu1 (elu(x)+1) or "
                          "relu", choices=("elu1", "relu"))
    block_pattern: str = _f("RRA", "griffin and hybrid: layer types repeated over the layers, "
                            "R = RG-LRU recurrent block, A = attention (griffin: local), and "
                            "for hybrid D = Gated DeltaNet, M = Mamba-2 (e.g. RRA, DDDA, MMMA)")
    chunk_size: int = _f(64, "block length of blockwise block-sparse attention and of the "
                         "chunkwise forms of linear attention, retention, Gated DeltaNet and "
                         "Mamba-2", min=1)
    ssm_state: int = _f(64, "Mamba-2: state channels N of B and C per group (groups: kv_heads)",
                        min=1)
    ssm_expand: int = _f(2, "Mamba-2: inner width = ssm_expand x hidden", min=1)
    document_mask: bool = _f(False, "attention stays inside each document of a packed sequence "
                             "(EOS tokens separate them; llama or gpt with softmax attention, "
                             "full or sliding window)")
    document_positions: bool = _f(False, "with document_mask: RoPE positions restart at 0 in "
                                  "every document (llama)")
    document_len: int = _f(0, "with document_mask: the mean document length in tokens over which "
                           "FLOP counts and the performance model charge attention; 0 means the "
                           "training data's own mean (seq_len where no data is at hand)", min=0)
    init_from: str = _f("", "a Hugging Face model directory (config.json + safetensors) to start "
                        "from: its config.json sets the model's fields (seq_len stays the run's) "
                        "and step 0 loads its weights, each rank reading only its own slices "
                        "(myria.interop.hf; Llama 2/3, Mistral, Qwen2)")
    qkv_bias: bool = _f(False, "biases on the query, key and value projections only (Qwen2)")
    rope_scaling: str = _f("none", "RoPE frequency scaling for long context, as Hugging Face's "
                           "rope_type: none, linear (positions / rope_factor) or llama3 "
                           "(Llama 3.1's by wavelength band)", choices=("none", "linear", "llama3"))
    rope_factor: float = _f(1.0, "rope_scaling's factor", min=1.0)
    rope_low_freq_factor: float = _f(1.0, "llama3 rope_scaling: low_freq_factor", min=0.0)
    rope_high_freq_factor: float = _f(4.0, "llama3 rope_scaling: high_freq_factor", min=0.0)
    rope_original_max_len: int = _f(8192, "llama3 rope_scaling: "
                                    "original_max_position_embeddings", min=1)
    max_positions: int = _f(0, "the longest sequence the model is meant to serve, written to an "
                            "export's config.json (max_position_embeddings) and tokenizer "
                            "(model_max_length); 0: seq_len. init_from sets it from config.json",
                            min=0)

    @property
    def n_kv_heads(self) -> int:
        return self.kv_heads or self.heads

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def ffn_dim(self) -> int:
        if self.ffn_hidden:
            return self.ffn_hidden
        if self.arch == "gpt":
            return 4 * self.hidden
        return 64 * ((int(8 * self.hidden / 3) + 63) // 64)


def validate_model(m: ModelConfig) -> None:
    """Raise ConfigError for a model whose sizes do not fit together (shared with the planner)."""
    if m.hidden % m.heads:
        raise ConfigError(f"model.heads = {m.heads} does not divide model.hidden = {m.hidden}; "
                          "hidden must be a multiple of heads")
    if m.n_kv_heads > m.heads or m.heads % m.n_kv_heads:
        raise ConfigError(f"model.kv_heads = {m.kv_heads} must divide model.heads = {m.heads}")
    if m.arch != "gpt" and m.head_dim % 2:
        raise ConfigError(f"head dimension hidden/heads = {m.head_dim} must be even for RoPE")
    if m.attention_window > m.seq_len and (m.attention != "softmax" or m.arch == "griffin"):
        # the window is these mixers' block structure; softmax attention's may be longer than
        # the training sequence (it trains as full causal attention and bounds generation
        # past it, as an imported Mistral's does)
        raise ConfigError(f"model.attention_window = {m.attention_window} is larger than "
                          f"model.seq_len = {m.seq_len}; use a window <= {m.seq_len}")
    if m.experts and m.top_k > m.experts:
        raise ConfigError(f"model.top_k = {m.top_k} exceeds model.experts = {m.experts}")
    if m.qkv_bias and m.arch != "llama":
        raise ConfigError(f"model.qkv_bias is for model.arch = 'llama' (got {m.arch!r}; gpt "
                          "has biases on every projection already)")
    if m.rope_scaling == "llama3" and m.rope_high_freq_factor <= m.rope_low_freq_factor:
        raise ConfigError(f"model.rope_high_freq_factor = {m.rope_high_freq_factor} must exceed "
                          f"model.rope_low_freq_factor = {m.rope_low_freq_factor}")
    validate_mixer(m)


def inert_settings(m: ModelConfig) -> list[tuple[tuple[str, ...], str]]:
    """The model's settings that do nothing in `m`, in groups, each with why: the router's on a
    dense model, a layer pattern on an architecture without one, a feature map without linear
    attention, Mamba-2's sizes without an M layer."""
    nothing = "setting(s) that would do nothing; leave them out, or choose the mixer they belong to"
    out = []
    if not m.experts:
        out.append((("top_k", "capacity_factor"), "mixture-of-experts setting(s) on a dense "
                    "model; set model.experts > 0, or leave them out"))
    if m.arch not in ("griffin", "hybrid"):
        out.append((("block_pattern",), f"a layer pattern for arch griffin or hybrid "
                    f"(model.arch = {m.arch!r}) {nothing}"))
    if m.attention != "linear":
        out.append((("feature_map",), f"linear attention's (model.attention = "
                    f"{m.attention!r}) {nothing}"))
    if not (m.arch == "hybrid" and "M" in m.block_pattern):
        out.append((("ssm_state", "ssm_expand"), "Mamba-2's, for the M layers of model.arch = "
                    f"'hybrid' (this model: arch {m.arch!r}"
                    + (f", block_pattern {m.block_pattern!r} without M" if m.arch == "hybrid"
                       else "") + f") {nothing}"))
    return out


def pattern_note(m: ModelConfig) -> str:
    """A note when a griffin or hybrid layer pattern does not divide the layers (it repeats and
    is cut at the last layer: the layers built are said), else ""."""
    if m.arch not in ("griffin", "hybrid") or not m.layers % len(m.block_pattern):
        return ""
    built = (m.block_pattern * m.layers)[:m.layers]
    return (f"note: model.block_pattern = {m.block_pattern!r} repeated over model.layers = "
            f"{m.layers} builds {built!r} (the pattern does not divide the layers)")


def refuse_settings_that_do_nothing(m: ModelConfig) -> None:
    """A training config that sets what its model does not use has a mistake in it (the
    setting would be recorded and do nothing, and then be frozen on resume): the router's
    settings on a dense model, a layer pattern on an architecture without one, a feature map
    without linear attention, Mamba-2's sizes without an M layer; and a pattern longer than the
    model (its last letters would be cut without a word: griffin's default RRA on 2 layers has
    no attention layer). The planner's models carry defaults of their own."""
    for keys, why in inert_settings(m):
        found = " and ".join(f"model.{k} = {getattr(m, k)!r}" for k in keys
                             if getattr(m, k) != getattr(ModelConfig, k))
        if found:
            raise ConfigError(f"{found}: {why}")
    if m.arch in ("griffin", "hybrid") and m.layers < len(m.block_pattern):
        raise ConfigError(f"model.block_pattern = {m.block_pattern!r} is longer than "
                          f"model.layers = {m.layers}: its last letters would have no layer; "
                          f"use at least {len(m.block_pattern)} layers or a shorter pattern")


def validate_mixer(m: ModelConfig) -> None:
    """Clear errors for combinations of arch, attention, window, global tokens and pattern."""
    if m.document_mask and (m.arch not in ("llama", "gpt") or m.attention != "softmax"):
        raise ConfigError(f"model.document_mask needs softmax attention in llama or gpt; "
                          f"model.arch = {m.arch!r}, model.attention = {m.attention!r} attend "
                          "across documents (set model.document_mask = false)")
    if m.document_positions and (not m.document_mask or m.arch != "llama"):
        raise ConfigError("model.document_positions restarts RoPE positions per document: it "
                          "needs model.document_mask = true and model.arch = 'llama'")
    if m.arch == "retnet" and m.attention != "softmax":
        raise ConfigError(f"model.attention = {m.attention!r} does not apply to model.arch = "
                          "'retnet' (retention replaces attention); leave it 'softmax'")
    if m.arch == "retnet" and (m.attention_window or m.kv_heads not in (0, m.heads)):
        raise ConfigError("model.arch = 'retnet' has no attention window and no grouped "
                          "key/value heads; set model.attention_window = 0 and model.kv_heads = 0")
    if m.arch == "griffin":
        if not m.block_pattern or set(m.block_pattern) - {"R", "A"}:
            raise ConfigError(f"model.block_pattern = {m.block_pattern!r}: use the letters R "
                              "(recurrent) and A (local attention), e.g. 'RRA'")
        if "A" in m.block_pattern and m.attention == "softmax" and not m.attention_window:
            raise ConfigError("model.arch = 'griffin' attends locally: set "
                              "model.attention_window > 0 (e.g. 1024; at most model.seq_len)")
        if m.attention == "linear":
            raise ConfigError("model.arch = 'griffin' mixes recurrences with local softmax "
                              "attention; model.attention = 'linear' is for llama or gpt")
    if m.arch == "hybrid":
        validate_hybrid(m)
    if m.attention == "block_sparse":
        if not m.attention_window:
            raise ConfigError("model.attention = 'block_sparse' needs model.attention_window > 0 "
                              "(the local window)")
        if m.global_tokens >= m.seq_len:
            raise ConfigError(f"model.global_tokens = {m.global_tokens} must be smaller than "
                              f"model.seq_len = {m.seq_len}")
    elif m.global_tokens:
        raise ConfigError(f"model.global_tokens = {m.global_tokens} needs model.attention = "
                          f"'block_sparse' (got {m.attention!r})")
    if m.attention == "linear" and m.attention_window:
        raise ConfigError("model.attention = 'linear' has no window: set model.attention_window "
                          "= 0 (or use attention = 'block_sparse')")


HYBRID_LETTERS = {"D": "Gated DeltaNet", "M": "Mamba-2", "A": "attention", "R": "RG-LRU"}


def validate_hybrid(m: ModelConfig) -> None:
    """model.arch = 'hybrid': a known letter for every layer type."""
    bad = set(m.block_pattern) - set(HYBRID_LETTERS)
    if not m.block_pattern or bad:
        raise ConfigError(f"model.block_pattern = {m.block_pattern!r}: use the letters "
                          + ", ".join(f"{k} ({v})" for k, v in HYBRID_LETTERS.items())
                          + ", e.g. 'DDDA'")
