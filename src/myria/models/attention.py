"""Core attention (softmax(QK^T)V) as a swappable module, and rotary position embeddings.

`CoreAttention` is its own module so that parallelism can replace it (ring attention for context
parallelism) without the model knowing. On CPU it runs SDPA: causal via `is_causal`, sliding
window via an explicit banded boolean mask (FlexAttention's backward does not run on CPU in torch
2.13). On GPU, SDPA picks FlashAttention for the causal case.
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
