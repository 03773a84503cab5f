"""Core attention (softmax(QK^T)V) as a swappable module, and rotary position embeddings.

`CoreAttention` is its own module so that parallelism can replace it (ring attention for context
parallelism) without the model knowing. On CPU it runs SDPA: causal via `is_causal`, sliding
window via an explicit banded boolean mask (FlexAttention's backward does not run on CPU in torch
2.13). On GPU, SDPA picks FlashAttention for the causal case.

`BlockSparseAttention` is Longformer's pattern made causal: a sliding window of `window` keys
plus `n_global` leading tokens that every later query attends to (and that attend to all
before them). Short sequences run SDPA with the dense boolean mask; long ones run blockwise
(`blockwise_block_sparse`): each block of `block` queries attends to the global keys and the
keys its window reaches, so work and memory grow linearly with the sequence and the S x S mask
is never built. On CUDA it runs FlexAttention with a block mask instead (its backward needs a
GPU in torch 2.13).
"""

from __future__ import annotations

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


class CoreAttention(nn.Module):
    """Causal (optionally sliding-window) scaled dot-product attention on (B, H, S, D) tensors."""

    def __init__(self, window: int = 0):
        super().__init__()
        self.window = window
        self._mask_cache: dict = {}

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        enable_gqa = k.shape[1] != q.shape[1]
        s = q.shape[2]
        if self.window and self.window < s:
            key = (s, q.device)
            mask = self._mask_cache.get(key)
            if mask is None:
                mask = self._mask_cache[key] = window_mask(s, s, self.window, q.device)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=enable_gqa)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=enable_gqa)


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
        if not q.is_cuda and s > self.n_global + self.window + self.block:
            return blockwise_block_sparse(q, k, v, self.window, self.n_global, self.block)
        key = (s, q.device)   # a mask per length, built once (not in every forward)
        mask = self._mask_cache.get(key)
        if mask is None:
            mask = _flex_block_mask(s, self.window, self.n_global, q.device) if q.is_cuda \
                else block_sparse_mask(s, s, self.window, self.n_global, q.device)
            self._mask_cache[key] = mask
        if q.is_cuda:
            from torch.nn.attention.flex_attention import flex_attention

            return flex_attention(q, k, v, block_mask=mask, enable_gqa=gqa)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)


def rope_tables(seq_len: int, head_dim: int, theta: float, device=None,
                dtype=torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables of shape (seq_len, head_dim) in the rotate-half layout of HF Llama."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float64)
                           / head_dim))
    t = torch.arange(seq_len, device=device, dtype=torch.float64)
    freqs = torch.outer(t, inv)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate (B, H, S, D) by position; cos/sin are (S, D)."""
    half = x.shape[-1] // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rot * sin
