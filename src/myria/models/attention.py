"""Core attention (softmax(QK^T)V) as a swappable module, and rotary position embeddings.

`CoreAttention` is its own module so that parallelism can replace it (ring attention for context
parallelism) without the model knowing. On CPU it runs SDPA: causal via `is_causal`, sliding
window via an explicit banded boolean mask; on GPU SDPA picks FlashAttention for the causal
case, and the sliding window runs FlexAttention. With `model.document_mask`,
`document_segments` gives every token the index of its document (an EOS token opens the next
one) and its position in it, and `CoreAttention` attends only within a document: SDPA with a
block-diagonal causal mask, blockwise for long sequences (`blockwise_document`), FlexAttention
on CUDA. `BlockSparseAttention` is Longformer's pattern made causal: a sliding window of
`window` keys plus `n_global` leading tokens every later query attends to; dense-masked SDPA for
short sequences, `blockwise_block_sparse` for long ones (work and memory linear in the
sequence), FlexAttention on CUDA. The blockwise forms never build the S x S mask. Why the
kernels are chosen so: docs/architectures.md, "Reasons behind the model modules".
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


def window_mask(q_len: int, k_len: int, window: int, device, q_offset: int = 0,
                k_offset: int = 0) -> torch.Tensor:
    """Boolean mask (True = attend) for causal attention limited to the last `window` keys.

    Query i (absolute position q_offset+i) sees key j (absolute k_offset+j) when
    0 <= qpos - kpos < window; window = 0 means no limit (plain causal).
    """
    qpos = torch.arange(q_len, device=device).unsqueeze(1) + q_offset
    kpos = torch.arange(k_len, device=device).unsqueeze(0) + k_offset
    d = qpos - kpos
    mask = d >= 0
    if window:
        mask &= d < window
    return mask


def document_segments(tokens: torch.Tensor, eos_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(document index, position inside the document) of every token of packed sequences.

    tokens: (..., S) token ids. An EOS token ends a document and opens the next segment: it
    plays the part of the next document's BOS, so the last token of a document predicts EOS
    with the whole document in view and the next document's first token is predicted from the
    EOS alone. The tokens before the first EOS (the tail of a document cut by the window) form
    segment 0, with positions from 0.
    """
    is_eos = tokens == eos_id
    ids = torch.cumsum(is_eos, dim=-1)
    idx = torch.arange(tokens.shape[-1], device=tokens.device).expand_as(tokens)
    start = torch.cummax(torch.where(is_eos, idx, torch.zeros_like(idx)), dim=-1).values
    return ids, idx - start


def document_mask(q_ids: torch.Tensor, k_ids: torch.Tensor, window: int, q_offset: int = 0,
                  k_offset: int = 0) -> torch.Tensor:
    """Boolean mask (B, 1, Sq, Sk) of causal (window > 0: sliding) attention inside documents,
    for queries at positions q_offset.. with document ids q_ids (B, Sq) and keys at k_offset..
    with ids k_ids (B, Sk)."""
    base = window_mask(q_ids.shape[-1], k_ids.shape[-1], window, q_ids.device, q_offset, k_offset)
    return (base & (q_ids.unsqueeze(-1) == k_ids.unsqueeze(-2))).unsqueeze(1)


def blockwise_document(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, doc_ids: torch.Tensor,
                       window: int, block: int) -> torch.Tensor:
    """Document-masked causal attention on (B, H, S, D) one block of queries at a time.

    A block [i0, i1) needs keys from the start of the document of its first query (and no
    earlier than its window reaches) up to i1, so the largest mask is block x (document or
    window length): work and memory grow with the documents, not with S^2.
    """
    s = q.shape[2]
    gqa = k.shape[1] != q.shape[1]
    # first index of each token's document: the last index with a smaller id, plus one
    first = torch.searchsorted(doc_ids.contiguous(), doc_ids.contiguous(), right=False)
    outs = []
    for i0 in range(0, s, block):
        i1 = min(s, i0 + block)
        lo = int(first[:, i0].min())
        if window:
            lo = max(lo, i0 - window + 1)
        mask = document_mask(doc_ids[:, i0:i1], doc_ids[:, lo:i1], window, i0, lo)
        outs.append(F.scaled_dot_product_attention(q[:, :, i0:i1], k[:, :, lo:i1],
                                                   v[:, :, lo:i1], attn_mask=mask,
                                                   enable_gqa=gqa))
    return torch.cat(outs, dim=2)


_FLEX = None                            # flex_attention compiled (flex_attention_for)
_DOC_MASK: tuple | None = None          # (doc_ids ref, its version, window, BlockMask)


def flex_attention_for(s: int):
    """FlexAttention for sequences of `s` tokens. Called eagerly it materialises the whole
    S x S score matrix of every head (torch warns as much): that is what a sequence of up to
    CoreAttention.DENSE_MASK_MAX tokens gets (as the CPU's dense mask), without a compile's
    one-time cost of tens of seconds; a longer one gets the compiled, fused kernel (compiled
    once per process on first use, inlined where a block is itself compiled)."""
    global _FLEX
    from torch.nn.attention.flex_attention import flex_attention

    if s <= CoreAttention.DENSE_MASK_MAX:
        return flex_attention
    if _FLEX is None:
        _FLEX = torch.compile(flex_attention, dynamic=False)
    return _FLEX


def use_flex(q: torch.Tensor) -> bool:
    """Whether FlexAttention runs the masked attention of `q` (CUDA: its backward does not run
    on a CPU)."""
    return q.is_cuda


def _document_block_mask(doc_ids: torch.Tensor, window: int):
    """FlexAttention's block mask of causal (window > 0: sliding) attention inside documents.
    Every layer of one forward gets the same `doc_ids` tensor: the mask is built once per
    forward and window (outside a compiled region, where it is part of the graph instead)."""
    global _DOC_MASK
    import weakref

    from torch.nn.attention.flex_attention import create_block_mask

    compiling = torch.compiler.is_compiling()
    if not compiling and _DOC_MASK is not None:
        ref, version, w, mask = _DOC_MASK
        if ref() is doc_ids and version == doc_ids._version and w == window:
            return mask

    def keep(b, h, qi, kj):
        ok = (kj <= qi) & (doc_ids[b, qi] == doc_ids[b, kj])
        return ok & (qi - kj < window) if window else ok

    b, s = doc_ids.shape
    mask = create_block_mask(keep, b, None, s, s, device=doc_ids.device)
    if not compiling:
        _DOC_MASK = (weakref.ref(doc_ids), doc_ids._version, window, mask)
    return mask


def _flex_document(q, k, v, doc_ids: torch.Tensor, window: int, gqa: bool) -> torch.Tensor:
    """FlexAttention with a document block mask."""
    return flex_attention_for(q.shape[2])(q, k, v, enable_gqa=gqa,
                                          block_mask=_document_block_mask(doc_ids, window))


class CoreAttention(nn.Module):
    """Causal (optionally sliding-window) scaled dot-product attention on (B, H, S, D) tensors,
    inside documents when given their ids."""

    # sequences longer than this run the document mask block by block (never S x S)
    DENSE_MASK_MAX = 1024

    def __init__(self, window: int = 0, block: int = 256):
        super().__init__()
        self.window, self.block = window, block
        self._mask_cache: dict = {}

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                doc_ids: torch.Tensor | None = None) -> torch.Tensor:
        enable_gqa = k.shape[1] != q.shape[1]
        s = q.shape[2]
        if doc_ids is not None:
            if use_flex(q):
                return _flex_document(q, k, v, doc_ids, self.window, enable_gqa)
            if s > self.DENSE_MASK_MAX:
                return blockwise_document(q, k, v, doc_ids, self.window, self.block)
            mask = document_mask(doc_ids, doc_ids, self.window)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=enable_gqa)
        if self.window and self.window < s:
            # SDPA with a mask cannot run FlashAttention, and with grouped-query heads not the
            # memory-efficient kernel either (torch: GQA runs on flash and math only): on CUDA
            # the window is FlexAttention's block mask, whose kernel skips blocks outside it
            flex = use_flex(q)
            key = (s, q.device, flex)
            mask = self._mask_cache.get(key)
            if mask is None:
                mask = self._mask_cache[key] = _flex_window_mask(s, self.window, q.device) \
                    if flex else window_mask(s, s, self.window, q.device)
            if flex:
                return flex_attention_for(s)(q, k, v, block_mask=mask, enable_gqa=enable_gqa)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=enable_gqa)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=enable_gqa)


def _flex_window_mask(s: int, window: int, device):
    """FlexAttention's block mask of causal attention to the last `window` keys."""
    from torch.nn.attention.flex_attention import create_block_mask

    def keep(b, h, qi, kj):
        return (kj <= qi) & (qi - kj < window)

    return create_block_mask(keep, None, None, s, s, device=device)


def block_sparse_mask(q_len: int, k_len: int, window: int, n_global: int, device,
                      q_offset: int = 0) -> torch.Tensor:
    """Boolean mask (True = attend) of causal local-window + global-token attention.

    Query at absolute position i sees key j <= i when i - j < window, when j < n_global
    (a global key) or when i < n_global (a global query sees everything before it).
    """
    mask = window_mask(q_len, k_len, window, device, q_offset=q_offset)
    if n_global:
        qpos = torch.arange(q_len, device=device).unsqueeze(1) + q_offset
        kpos = torch.arange(k_len, device=device).unsqueeze(0)
        mask |= (kpos <= qpos) & ((kpos < n_global) | (qpos < n_global))
    return mask


def blockwise_block_sparse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int,
                           n_global: int, block: int) -> torch.Tensor:
    """Block-sparse attention on (B, H, S, D) one query block at a time.

    Block [i0, i1) attends to keys [0, n_global) and [i0 - window + 1, i1) only (all of
    [0, i1) when those overlap), with a mask of at most block x (n_global + window + block):
    O(S) work and memory instead of O(S^2).
    """
    s = q.shape[2]
    gqa = k.shape[1] != q.shape[1]
    outs = []
    for i0 in range(0, s, block):
        i1 = min(s, i0 + block)
        lo = max(0, i0 - window + 1)
        if i0 < n_global or lo <= n_global:      # global queries, or global keys adjoin
            kb, vb = k[:, :, :i1], v[:, :, :i1]
            kpos = torch.arange(i1, device=q.device)
        else:
            kb = torch.cat([k[:, :, :n_global], k[:, :, lo:i1]], dim=2)
            vb = torch.cat([v[:, :, :n_global], v[:, :, lo:i1]], dim=2)
            kpos = torch.cat([torch.arange(n_global, device=q.device),
                              torch.arange(lo, i1, device=q.device)])
        qpos = torch.arange(i0, i1, device=q.device).unsqueeze(1)
        kp = kpos.unsqueeze(0)
        mask = (kp <= qpos) & ((qpos - kp < window) | (kp < n_global) | (qpos < n_global))
        outs.append(F.scaled_dot_product_attention(q[:, :, i0:i1], kb, vb, attn_mask=mask,
                                                   enable_gqa=gqa))
    return torch.cat(outs, dim=2)


def _flex_block_mask(s: int, window: int, n_global: int, device):
    """FlexAttention's block mask of the pattern (CUDA only: its backward does not run on CPU)."""
    from torch.nn.attention.flex_attention import create_block_mask

    def keep(b, h, qi, kj):
        return (kj <= qi) & ((qi - kj < window) | (kj < n_global) | (qi < n_global))

    return create_block_mask(keep, None, None, s, s, device=device)


class BlockSparseAttention(nn.Module):
    """Causal local window + global tokens (Longformer) on (B, H, S, D) tensors."""

    def __init__(self, window: int, n_global: int, block: int):
        super().__init__()
        self.window, self.n_global, self.block = window, n_global, block
        self._mask_cache: dict = {}

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        s, gqa = q.shape[2], k.shape[1] != q.shape[1]
        flex = use_flex(q)
        if not flex and s > self.n_global + self.window + self.block:
            return blockwise_block_sparse(q, k, v, self.window, self.n_global, self.block)
        key = (s, q.device)   # a mask per length, built once (not in every forward)
        mask = self._mask_cache.get(key)
        if mask is None:
            mask = _flex_block_mask(s, self.window, self.n_global, q.device) if flex \
                else block_sparse_mask(s, s, self.window, self.n_global, q.device)
            self._mask_cache[key] = mask
        if flex:
            return flex_attention_for(s)(q, k, v, block_mask=mask, enable_gqa=gqa)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)


def rope_scaled(inv: torch.Tensor, scaling: tuple | None) -> torch.Tensor:
    """Inverse frequencies under Hugging Face's rope_type `scaling[0]`: None or ("none",)
    leaves them; ("linear", factor) divides them by factor (positions / factor); ("llama3",
    factor, low_freq_factor, high_freq_factor, original_max_len) divides the low frequencies
    (wavelength above original_max_len / low_freq_factor) by factor, keeps the high ones
    (wavelength below original_max_len / high_freq_factor) and interpolates between (Llama 3.1)."""
    if not scaling or scaling[0] == "none":
        return inv
    if scaling[0] == "linear":
        return inv / scaling[1]
    _, factor, low, high, old_len = scaling
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old_len / low, inv / factor, inv)
    smooth = (old_len / wavelen - low) / (high - low)
    mid = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(mid, (1 - smooth) * scaled / factor + smooth * scaled, scaled)


def rope_tables(seq_len: int, head_dim: int, theta: float, device=None,
                dtype=torch.float32, scaling: tuple | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables of shape (seq_len, head_dim) in the rotate-half layout of HF Llama,
    frequencies scaled by `scaling` (`rope_scaled`)."""
    inv = rope_scaled(1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device,
                                                    dtype=torch.float64) / head_dim)), scaling)
    t = torch.arange(seq_len, device=device, dtype=torch.float64)
    freqs = torch.outer(t, inv)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate (B, H, S, D) by position; cos/sin are (S, D)."""
    half = x.shape[-1] // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rot * sin
