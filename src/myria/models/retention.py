"""RetNet's multi-scale retention (Sun et al. 2023): one mechanism, three forms that agree.

Head h decays its memory by gamma_h = 1 - 2^(-5-h) per token (multi-scale: slow heads remember
longer). With q already rotated (RoPE, the xPos rotation without its scale) and scaled by
d^-1/2, and D[n, m] = gamma^(n-m) for n >= m (0 above the diagonal):

- parallel (training):     O = (Q K^T * D) V
- recurrent (generation):  S_n = gamma S_{n-1} + k_n^T v_n,  o_n = q_n S_n   (constant memory)
- chunkwise (long inputs): inside a chunk the parallel form, across chunks the state
  S_c = gamma^C S_{c-1} + sum_j gamma^(C-1-j) k_j^T v_j, read by query i as gamma^(i+1) q_i S.

The block output is W_O(swish(X W_G) * GroupNorm(O)), GroupNorm being per head over its
channels. The paper's extra normalisations of D and of Q K^T * D scale each (position, head)
row by a positive number, which the per-head group norm removes: they are left out here (the
forms then agree exactly, not only after the norm). The group norm has no affine weights
(as in torchscale), so every parameter is a plain projection and tensor parallelism splits
heads like attention's.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from myria.models.attention import apply_rope


def log_decays(n_heads: int, offset: int = 0, device=None) -> torch.Tensor:
    """log gamma_h for heads offset .. offset + n_heads - 1 (float32)."""
    h = torch.arange(offset, offset + n_heads, device=device, dtype=torch.float64)
    return torch.log1p(-torch.pow(2.0, -5.0 - h)).float()


def retention_parallel(q, k, v, log_gamma):
    """Parallel form on (B, H, S, D) tensors; log_gamma is (H,)."""
    s = q.shape[2]
    n = torch.arange(s, device=q.device)
    dist = (n.unsqueeze(1) - n.unsqueeze(0)).to(q.dtype)                # (S, S)
    decay = torch.exp(dist * log_gamma.view(-1, 1, 1)).masked_fill(dist < 0, 0.0)
    return (q @ k.transpose(-1, -2) * decay) @ v


def retention_step(q, k, v, log_gamma, state):
    """Recurrent form: one token (B, H, 1, D) and state (B, H, D, E) -> (out, state)."""
    g = torch.exp(log_gamma).view(1, -1, 1, 1)
    state = g * state + k.transpose(-1, -2) @ v
    return q @ state, state


def _chunk_decays(n: int, log_gamma: torch.Tensor, dtype):
    """Decay tables of a chunk of n tokens: inside it, for the queries' reading of the state,
    for the keys' writing into it, and of the state across it."""
    lg = log_gamma.view(1, -1, 1, 1)
    i = torch.arange(n, device=log_gamma.device, dtype=dtype)
    dist = i.unsqueeze(1) - i.unsqueeze(0)
    inner = torch.exp(dist * lg).masked_fill(dist < 0, 0.0)             # (1,H,n,n)
    return (inner, torch.exp((i + 1).view(-1, 1) * lg), torch.exp((n - 1 - i).view(-1, 1) * lg),
            torch.exp(n * lg))


def retention_chunkwise(q, k, v, log_gamma, chunk: int, state=None,
                        return_state: bool = False):
    """Chunkwise form; `state` (B, H, D, E) carried in from earlier tokens, returned if asked."""
    b, h, s, d = q.shape
    if state is None:
        state = q.new_zeros(b, h, d, v.shape[-1])
    tables = {}
    outs = []
    for c0 in range(0, s, chunk):
        n = min(chunk, s - c0)
        if n not in tables:
            tables[n] = _chunk_decays(n, log_gamma, q.dtype)
        inner, q_decay, k_decay, chunk_decay = tables[n]
        qc, kc, vc = q[:, :, c0:c0 + n], k[:, :, c0:c0 + n], v[:, :, c0:c0 + n]
        outs.append((qc @ kc.transpose(-1, -2) * inner) @ vc + (qc * q_decay) @ state)
        state = chunk_decay * state + (kc * k_decay).transpose(-1, -2) @ vc
    out = torch.cat(outs, dim=2)
    return (out, state) if return_state else out


class Retention(nn.Module):
    """Multi-scale retention with swish gate and per-head group norm, replacing attention."""

    def __init__(self, cfg):
        super().__init__()
        self.n_heads, self.head_dim = cfg.heads, cfg.head_dim
        self.chunk, self.eps = cfg.chunk_size, cfg.norm_eps
        width = cfg.heads * cfg.head_dim
        self.wq = nn.Linear(cfg.hidden, width, bias=False)
        self.wk = nn.Linear(cfg.hidden, width, bias=False)
        self.wv = nn.Linear(cfg.hidden, width, bias=False)
        self.wg = nn.Linear(cfg.hidden, width, bias=False)
        self.wo = nn.Linear(width, cfg.hidden, bias=False)
        # index of this module's first head: tensor parallelism gives each rank a slice of the
        # heads, and each head keeps its own decay (set by parallel.parallelize.apply_tp)
        self.head_offset = 0

    def qkv(self, x, rope, pos0: int = 0):
        b, s, _ = x.shape
        q, k, v = (w(x).view(b, s, -1, self.head_dim).transpose(1, 2)
                   for w in (self.wq, self.wk, self.wv))
        cos, sin = rope[0][pos0:pos0 + s], rope[1][pos0:pos0 + s]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        return q * (1.0 / math.sqrt(self.head_dim)), k, v

    def log_gamma(self, n_heads: int, device) -> torch.Tensor:
        return log_decays(n_heads, self.head_offset, device)

    def out(self, x, o):
        """W_O(swish(X W_G) * GroupNorm(O)); o is (B, H, S, D)."""
        b, _, s, _ = o.shape
        o = F.layer_norm(o, (self.head_dim,), eps=self.eps)        # per-head group norm
        o = o.transpose(1, 2).reshape(b, s, -1)
        return self.wo(F.silu(self.wg(x)) * o)

    def forward(self, x: torch.Tensor, rope) -> torch.Tensor:
        # fp32 inside: the decays are fp32 (a bf16 run would multiply bf16 scores by them)
        q, k, v = (t.float() for t in self.qkv(x, rope))
        lg = self.log_gamma(q.shape[1], q.device)
        if q.shape[2] <= self.chunk:
            o = retention_parallel(q, k, v, lg)
        else:
            o = retention_chunkwise(q, k, v, lg, self.chunk)
        return self.out(x, o.to(x.dtype))

    def forward_recurrent(self, x: torch.Tensor, rope, state: dict, pos0: int) -> torch.Tensor:
        """x (B, S, H) at positions pos0.. given the retention state of the earlier tokens
        (state['s'], created when missing); extends the state. Chunkwise for S > 1."""
        q, k, v = (t.float() for t in self.qkv(x, rope, pos0))   # fp32 inside, as forward
        lg = self.log_gamma(q.shape[1], q.device)
        prev = state.get("s")
        if q.shape[2] == 1 and prev is not None:
            o, state["s"] = retention_step(q, k, v, lg, prev)
        else:
            o, state["s"] = retention_chunkwise(q, k, v, lg, self.chunk, prev, True)
        return self.out(x, o.to(x.dtype))
