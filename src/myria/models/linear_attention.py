"""Causal linear attention (Katharopoulos et al. 2020) in three forms that agree.

With a positive feature map phi (elu(x)+1 by default), softmax(q k^T) v becomes
o_i = phi(q_i) S_i / (phi(q_i) . z_i) with S_i = sum_{j<=i} phi(k_j)^T v_j and
z_i = sum_{j<=i} phi(k_j):

- `linear_attention_prefix`: S_i and z_i by prefix sums (cumsum); memory S x D x D per head,
  the reference;
- `linear_attention_chunked`: within chunks of C tokens the masked quadratic form, across chunks
  the state carried by an exclusive cumsum of per-chunk sums (the training form: O(S C D + S D^2));
- `linear_attention_step`: the recurrent form, one token against the (S, z) state (generation:
  constant memory per token).

No softmax scale (the denominator normalises) and no RoPE (the feature map would lose its
positivity). On a GPU, `flash-linear-attention` (package `fla`) serves the chunked form when it
is installed (not a dependency); on CPU, and when it is absent, the torch code below runs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

EPS = 1e-6


def feature_map(x: torch.Tensor, kind: str) -> torch.Tensor:
    """The positive feature map phi: elu(x) + 1 or relu(x)."""
    if kind == "elu1":
        return F.elu(x) + 1.0
    if kind == "relu":
        return F.relu(x)
    raise ValueError(f"unknown feature map {kind!r}")


def _expand_kv(q, k, v):
    if k.shape[1] != q.shape[1]:   # grouped-query heads
        r = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(r, dim=1), v.repeat_interleave(r, dim=1)
    return k, v


def linear_attention_prefix(q, k, v):
    """Reference form on feature-mapped (B, H, S, D) tensors: prefix sums of outer products."""
    k, v = _expand_kv(q, k, v)
    s_state = torch.cumsum(torch.einsum("bhsd,bhse->bhsde", k, v), dim=2)
    z = torch.cumsum(k, dim=2)
    num = torch.einsum("bhsd,bhsde->bhse", q, s_state)
    den = (q * z).sum(-1, keepdim=True)
    return num / (den + EPS)


def linear_attention_chunked(q, k, v, chunk: int, state=None, return_state: bool = False):
    """Chunked form on feature-mapped (B, H, S, D) tensors; `state` = (S (B,H,D,E), z (B,H,D))
    carried in from earlier tokens (generation's prompt), returned when asked."""
    k, v = _expand_kv(q, k, v)
    b, h, s, d = q.shape
    e = v.shape[-1]
    pad = (-s) % chunk
    if pad:  # zero keys and values add nothing to the state; padded queries are dropped
        q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
    n = (s + pad) // chunk
    qc, kc, vc = (t.reshape(b, h, n, chunk, -1) for t in (q, k, v))
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    scores = (qc @ kc.transpose(-1, -2)).masked_fill(~causal, 0.0)     # (b,h,n,C,C)
    num = scores @ vc
    den = scores.sum(-1, keepdim=True)
    kv = kc.transpose(-1, -2) @ vc                                       # (b,h,n,D,E)
    ksum = kc.sum(3)                                                     # (b,h,n,D)
    s_prev = torch.cumsum(kv, dim=2) - kv                                # exclusive
    z_prev = torch.cumsum(ksum, dim=2) - ksum
    if state is not None:
        s_prev = s_prev + state[0].unsqueeze(2)
        z_prev = z_prev + state[1].unsqueeze(2)
    num = num + qc @ s_prev
    den = den + (qc * z_prev.unsqueeze(3)).sum(-1, keepdim=True)
    out = (num / (den + EPS)).reshape(b, h, n * chunk, e)[:, :, :s]
    if not return_state:
        return out
    return out, (s_prev[:, :, -1] + kv[:, :, -1], z_prev[:, :, -1] + ksum[:, :, -1])


def linear_attention_step(q, k, v, state):
    """Recurrent form: one token (B, H, 1, D) against state (S, z); returns (out, state)."""
    k, v = _expand_kv(q, k, v)
    s_state, z = state
    s_state = s_state + k.transpose(-1, -2) @ v                 # (b,h,D,E)
    z = z + k[:, :, 0]
    num = q @ s_state
    den = (q[:, :, 0] * z).sum(-1)[..., None, None]
    return num / (den + EPS), (s_state, z)


def _fla_chunked(q, k, v):
    """flash-linear-attention's chunked kernel (GPU, when installed), same normalisation."""
    from fla.ops.linear_attn import chunk_linear_attn  # optional, GPU only

    k, v = _expand_kv(q, k, v)
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))      # fla takes (B, T, H, D)
    o, _ = chunk_linear_attn(q, k, v, scale=1.0, normalize=True)
    return o.transpose(1, 2)


class LinearAttention(nn.Module):
    """Drop-in for `CoreAttention`: feature map, then the chunked causal linear form."""

    def __init__(self, kind: str, chunk: int):
        super().__init__()
        self.kind, self.chunk = kind, chunk

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        q, k = feature_map(q, self.kind), feature_map(k, self.kind)
        if q.is_cuda:
            try:
                return _fla_chunked(q, k, v)
            except ImportError:
                pass
        return linear_attention_chunked(q, k, v, self.chunk)
