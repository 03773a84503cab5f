"""Mamba-2 (Dao & Gu 2024, arXiv 2405.21060): the selective state space model in its SSD form.

Per head h (scalar decay A_h < 0, head dimension P) with a state H (N x P), input-dependent
step dt_t > 0 and, shared by the heads of a group, input and output projections B_t, C_t in R^N:

    H_t = exp(dt_t A_h) H_{t-1} + B_t (dt_t x_t)^T        y_t = H_t^T C_t + D_h x_t

The block is Mamba-2's: z, and short-convolved, SiLU'd x, B, C projections, dt = softplus(W_dt
u + dt_bias), A = -exp(A_log), out = W_o(RMSNorm((y + D x) * SiLU(z))). The inner width is
ssm_expand * hidden over model.heads heads; B and C have model.kv_heads groups (all heads' own
when 0) of ssm_state channels; the gated RMSNorm is per head, so tensor parallelism splits heads
with no communication inside the block. Two forms agree (tested, output and gradient within
1e-5 in fp32): `ssd_step`, one token at a time (generation: constant memory), and
`ssd_chunked`, the training form (the SSD algorithm). The block's formulas and the chunked
form: docs/architectures.md, "Reasons behind the model modules".
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from myria.models.deltanet import CONV_WIDTH, causal_conv, chunk_decays, pad_chunks
from myria.tensors import local_shard


def ssd_chunked(q, k, v, log_a, chunk: int, state=None, return_state: bool = False):
    """Chunked form on q, k (B, H, S, N), v (B, H, S, P) and log decays (B, H, S);
    `state` (B, H, N, P) carried in from earlier tokens, the final one returned if asked."""
    b, h, s, n_state = q.shape
    p = v.shape[-1]
    q, k, v, log_a = pad_chunks(chunk, s, q, k, v, log_a)
    n = q.shape[2] // chunk
    qc, kc, vc = (t.reshape(b, h, n, chunk, -1) for t in (q, k, v))
    L, decay = chunk_decays(log_a.reshape(b, h, n, chunk), chunk)
    inner = ((qc @ kc.transpose(-1, -2)) * decay) @ vc
    q_read = qc * torch.exp(L).unsqueeze(-1)
    k_write = kc * torch.exp(L[..., -1:] - L).unsqueeze(-1)
    chunk_decay = torch.exp(L[..., -1]).unsqueeze(-1).unsqueeze(-1)
    st = q.new_zeros(b, h, n_state, p) if state is None else state
    outs = []
    for c in range(n):
        outs.append(inner[:, :, c] + q_read[:, :, c] @ st)
        st = chunk_decay[:, :, c] * st + k_write[:, :, c].transpose(-1, -2) @ vc[:, :, c]
    out = torch.stack(outs, dim=2).reshape(b, h, n * chunk, p)[:, :, :s]
    return (out, st) if return_state else out


def ssd_step(q, k, v, log_a, state):
    """One token: q, k (B, H, 1, N), v (B, H, 1, P), log_a (B, H, 1), state (B, H, N, P)."""
    st = torch.exp(log_a).unsqueeze(-1) * state + k.transpose(-1, -2) @ v
    return q @ st, st


def ssd_recurrent(q, k, v, log_a, state=None):
    """Every token through `ssd_step` (the definition; the reference of the tests)."""
    b, h, s, n_state = q.shape
    st = q.new_zeros(b, h, n_state, v.shape[-1]) if state is None else state
    outs = []
    for t in range(s):
        sl = slice(t, t + 1)
        o, st = ssd_step(q[:, :, sl], k[:, :, sl], v[:, :, sl], log_a[:, :, sl], st)
        outs.append(o)
    return torch.cat(outs, dim=2), st


class Mamba2(nn.Module):
    """The Mamba-2 token mixer (see the module docstring for its shapes)."""

    def __init__(self, cfg):
        super().__init__()
        inner = cfg.ssm_expand * cfg.hidden
        n_heads, groups, n_state = cfg.heads, cfg.n_kv_heads, cfg.ssm_state
        self.head_dim, self.n_state = inner // n_heads, n_state
        self.chunk, self.eps = cfg.chunk_size, cfg.norm_eps
        self.wz = nn.Linear(cfg.hidden, inner, bias=False)
        self.wx = nn.Linear(cfg.hidden, inner, bias=False)
        self.wB = nn.Linear(cfg.hidden, groups * n_state, bias=False)
        self.wC = nn.Linear(cfg.hidden, groups * n_state, bias=False)
        self.wdt = nn.Linear(cfg.hidden, n_heads, bias=False)
        for name, width in (("x", inner), ("B", groups * n_state), ("C", groups * n_state)):
            setattr(self, f"conv_{name}_weight", nn.Parameter(torch.empty(width, CONV_WIDTH)))
            setattr(self, f"conv_{name}_bias", nn.Parameter(torch.empty(width)))
        self.A_log = nn.Parameter(torch.empty(n_heads))
        self.dt_bias = nn.Parameter(torch.empty(n_heads))
        self.D = nn.Parameter(torch.empty(n_heads))
        self.norm_weight = nn.Parameter(torch.empty(inner))
        self.wo = nn.Linear(inner, cfg.hidden, bias=False)

    def inputs(self, u: torch.Tensor, state: dict | None = None):
        """q = C, k = B (B, H, S, N), v = dt x, x (B, H, S, P) and log decays (B, H, S) of
        u (B, S, hidden); with `state`, the convolutions continue from its last inputs."""
        b, s, _ = u.shape
        out = {}
        for name, proj in (("x", self.wx), ("B", self.wB), ("C", self.wC)):
            past = None if state is None else state.get(f"conv_{name}")
            c, new_past = causal_conv(proj(u), getattr(self, f"conv_{name}_weight"),
                                      getattr(self, f"conv_{name}_bias"), past)
            if state is not None:
                state[f"conv_{name}"] = new_past
            out[name] = F.silu(c)
        x = out["x"].view(b, s, -1, self.head_dim).transpose(1, 2)             # (B, H, S, P)
        kb = out["B"].view(b, s, -1, self.n_state).transpose(1, 2)            # (B, G, S, N)
        qc = out["C"].view(b, s, -1, self.n_state).transpose(1, 2)
        if kb.shape[1] != x.shape[1]:   # heads of a group share B and C
            r = x.shape[1] // kb.shape[1]
            kb, qc = kb.repeat_interleave(r, dim=1), qc.repeat_interleave(r, dim=1)
        dt = F.softplus(self.wdt(u) + local_shard(self.dt_bias)).transpose(1, 2)    # (B, H, S)
        log_a = -torch.exp(local_shard(self.A_log)).unsqueeze(-1) * dt
        return qc, kb, x * dt.unsqueeze(-1), x, log_a

    def out(self, u: torch.Tensor, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """W_o(RMSNorm per head of (y + D x) * SiLU(z)); y, x (B, H, S, P)."""
        b, _, s, _ = y.shape
        y = y + local_shard(self.D).view(1, -1, 1, 1) * x
        y = y.transpose(1, 2) * F.silu(self.wz(u)).view(b, s, -1, self.head_dim)
        y = F.rms_norm(y, (self.head_dim,), eps=self.eps).reshape(b, s, -1)
        return self.wo(y * local_shard(self.norm_weight))

    def forward(self, u: torch.Tensor, rope=None) -> torch.Tensor:  # noqa: ARG002
        q, k, v, x, log_a = self.inputs(u)
        y = ssd_chunked(*(t.float() for t in (q, k, v, log_a)), self.chunk)   # fp32 inside
        return self.out(u, y.to(u.dtype), x)

    def forward_recurrent(self, u: torch.Tensor, rope, state: dict,  # noqa: ARG002
                          pos0: int) -> torch.Tensor:  # noqa: ARG002
        """u (B, S, hidden) after the tokens summarised by `state` (the convolutions' last
        inputs, the SSM state 's'); extends the state. Constant memory per token."""
        q, k, v, x, log_a = self.inputs(u, state)
        q, k, v, log_a = (t.float() for t in (q, k, v, log_a))
        prev = state.get("s")   # fp32
        if q.shape[2] == 1 and prev is not None:
            y, state["s"] = ssd_step(q, k, v, log_a, prev)
        else:
            y, state["s"] = ssd_chunked(q, k, v, log_a, self.chunk, prev, True)
        return self.out(u, y.to(u.dtype), x)
