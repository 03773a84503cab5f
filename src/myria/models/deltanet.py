"""Gated DeltaNet (Yang, Kautz & Hatamizadeh 2024, arXiv 2412.06464): the gated delta rule.

Per head, with a state S (d_k x d_v), a data-dependent decay alpha_t = exp(g_t) in (0, 1] and a
writing strength beta_t in (0, 1):

    S_t = alpha_t (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T        o_t = S_t^T q_t

The block around it is the paper's: short-convolved, SiLU'd q/k/v projections, L2-normalised
q and k (q scaled by d_k^-1/2), per-head beta and g, and out = W_o(RMSNorm_head(o) * SiLU(W_g x)).
Two forms agree (tested: output and gradient within 1e-5 in fp32): `gated_delta_step`, the
recurrence one token at a time (generation: constant memory), and `gated_delta_chunked`, the
training form (one unit-triangular solve per chunk, the WY representation; every exponent is
<= 0, so nothing overflows). On a GPU, `flash-linear-attention` (package `fla`) serves the
chunked form when it is installed (not a dependency); otherwise the torch code below runs. The
block's formulas and the chunked derivation: docs/architectures.md, "Reasons behind the model
modules".
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from myria.tensors import local_shard

CONV_WIDTH = 4


def causal_conv(u: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                past: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal convolution of u (B, S, W) with weight (W, CONV_WIDTH); `past` = the
    CONV_WIDTH - 1 inputs before u (zeros at the start). Returns (output, the new past)."""
    w = local_shard(weight)
    if past is None:
        past = u.new_zeros(u.shape[0], CONV_WIDTH - 1, u.shape[2])
    full = torch.cat([past, u], dim=1)
    bias = None if bias is None else local_shard(bias)
    out = F.conv1d(full.transpose(1, 2), w.unsqueeze(1), bias, groups=w.shape[0]).transpose(1, 2)
    return out, full[:, -(CONV_WIDTH - 1):]


def pad_chunks(chunk: int, s: int, *ts: torch.Tensor) -> list[torch.Tensor]:
    """Pad dim 2 of each (B, H, S, ...) tensor to a multiple of `chunk` with zeros (zero keys
    write nothing, zero log decay keeps the state; padded outputs are dropped)."""
    pad = (-s) % chunk
    if not pad:
        return list(ts)
    return [F.pad(t, (0, 0) * (t.dim() - 3) + (0, pad)) for t in ts]


def chunk_decays(g: torch.Tensor, chunk: int):
    """From log decays g (B, H, n, C): cumulative L, the in-chunk table D (B, H, n, C, C)."""
    L = torch.cumsum(g, dim=-1)
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=g.device).tril()
    diff = (L.unsqueeze(-1) - L.unsqueeze(-2)).masked_fill(~causal, float("-inf"))
    return L, torch.exp(diff)


def gated_delta_chunked(q, k, v, g, beta, chunk: int, state=None, return_state: bool = False):
    """The chunked (WY) form on q, k (B, H, S, Dk), v (B, H, S, Dv), g and beta (B, H, S);
    `state` (B, H, Dk, Dv) carried in from earlier tokens, the final one returned if asked."""
    b, h, s, dk = q.shape
    dv = v.shape[-1]
    q, k, v, g, beta = pad_chunks(chunk, s, q, k, v, g, beta)
    n = q.shape[2] // chunk
    qc, kc, vc = (t.reshape(b, h, n, chunk, -1) for t in (q, k, v))
    gc, bc = g.reshape(b, h, n, chunk), beta.reshape(b, h, n, chunk)
    L, decay = chunk_decays(gc, chunk)
    strict = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril(-1)
    a = ((kc @ kc.transpose(-1, -2)) * decay * bc.unsqueeze(-1)).masked_fill(~strict, 0.0)
    eye = torch.eye(chunk, dtype=q.dtype, device=q.device)
    rhs = torch.cat([vc * bc.unsqueeze(-1), kc * (bc * torch.exp(L)).unsqueeze(-1)], dim=-1)
    sol = torch.linalg.solve_triangular(eye + a, rhs, upper=False, unitriangular=True)
    u_free, w = sol[..., :dv], sol[..., dv:]
    scores = (qc @ kc.transpose(-1, -2)) * decay
    q_read = qc * torch.exp(L).unsqueeze(-1)
    k_write = kc * torch.exp(L[..., -1:] - L).unsqueeze(-1)
    chunk_decay = torch.exp(L[..., -1]).unsqueeze(-1).unsqueeze(-1)         # (B, H, n, 1, 1)
    st = q.new_zeros(b, h, dk, dv) if state is None else state
    outs = []
    for c in range(n):
        u = u_free[:, :, c] - w[:, :, c] @ st
        outs.append(q_read[:, :, c] @ st + scores[:, :, c] @ u)
        st = chunk_decay[:, :, c] * st + k_write[:, :, c].transpose(-1, -2) @ u
    out = torch.stack(outs, dim=2).reshape(b, h, n * chunk, dv)[:, :, :s]
    return (out, st) if return_state else out


def gated_delta_step(q, k, v, g, beta, state):
    """The recurrence for one token: q, k (B, H, 1, Dk), v (B, H, 1, Dv), g, beta (B, H, 1),
    state (B, H, Dk, Dv) -> (o (B, H, 1, Dv), new state)."""
    st = torch.exp(g).unsqueeze(-1) * state
    u = beta.unsqueeze(-1) * (v - k @ st)
    st = st + k.transpose(-1, -2) @ u
    return q @ st, st


def gated_delta_recurrent(q, k, v, g, beta, state=None):
    """Every token through `gated_delta_step` (the definition; the reference of the tests)."""
    b, h, s, dk = q.shape
    st = q.new_zeros(b, h, dk, v.shape[-1]) if state is None else state
    outs = []
    for t in range(s):
        sl = slice(t, t + 1)
        o, st = gated_delta_step(q[:, :, sl], k[:, :, sl], v[:, :, sl], g[:, :, sl],
                                 beta[:, :, sl], st)
        outs.append(o)
    return torch.cat(outs, dim=2), st


def _fla_chunked(q, k, v, g, beta):
    """flash-linear-attention's gated delta rule kernel (GPU, when installed)."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule  # optional, GPU only

    q, k, v = (t.transpose(1, 2) for t in (q, k, v))         # fla takes (B, T, H, D)
    o, _ = chunk_gated_delta_rule(q, k, v, g.transpose(1, 2), beta.transpose(1, 2), scale=1.0)
    return o.transpose(1, 2)


class GatedDeltaNet(nn.Module):
    """The Gated DeltaNet token mixer: cfg.heads heads of d_k = d_v = cfg.head_dim."""

    def __init__(self, cfg):
        super().__init__()
        self.head_dim, self.chunk, self.eps = cfg.head_dim, cfg.chunk_size, cfg.norm_eps
        width, n_heads = cfg.heads * cfg.head_dim, cfg.heads
        self.wq = nn.Linear(cfg.hidden, width, bias=False)
        self.wk = nn.Linear(cfg.hidden, width, bias=False)
        self.wv = nn.Linear(cfg.hidden, width, bias=False)
        self.wg = nn.Linear(cfg.hidden, width, bias=False)
        self.wb = nn.Linear(cfg.hidden, n_heads, bias=False)
        self.wa = nn.Linear(cfg.hidden, n_heads, bias=False)
        self.conv_q_weight = nn.Parameter(torch.empty(width, CONV_WIDTH))
        self.conv_k_weight = nn.Parameter(torch.empty(width, CONV_WIDTH))
        self.conv_v_weight = nn.Parameter(torch.empty(width, CONV_WIDTH))
        self.A_log = nn.Parameter(torch.empty(n_heads))
        self.dt_bias = nn.Parameter(torch.empty(n_heads))
        self.norm_weight = nn.Parameter(torch.empty(width))
        self.wo = nn.Linear(width, cfg.hidden, bias=False)

    def _heads(self, t: torch.Tensor) -> torch.Tensor:
        b, s, _ = t.shape
        return t.view(b, s, -1, self.head_dim).transpose(1, 2)

    def inputs(self, x: torch.Tensor, state: dict | None = None):
        """q, k, v (B, H, S, D), g and beta (B, H, S) of x (B, S, hidden); with `state`, the
        convolutions continue from (and update) its last inputs."""
        out = []
        for name, proj in (("q", self.wq), ("k", self.wk), ("v", self.wv)):
            past = None if state is None else state.get(f"conv_{name}")
            c, new_past = causal_conv(proj(x), getattr(self, f"conv_{name}_weight"), None, past)
            if state is not None:
                state[f"conv_{name}"] = new_past
            out.append(self._heads(F.silu(c)))
        q, k, v = out
        q = F.normalize(q, dim=-1) * self.head_dim ** -0.5
        k = F.normalize(k, dim=-1)
        beta = torch.sigmoid(self.wb(x)).transpose(1, 2)
        dt = F.softplus(self.wa(x) + local_shard(self.dt_bias)).transpose(1, 2)
        g = -torch.exp(local_shard(self.A_log)).unsqueeze(-1) * dt
        return q, k, v, g, beta

    def out(self, x: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        """W_o(RMSNorm per head of o (B, H, S, D), times SiLU(W_g x))."""
        b, _, s, _ = o.shape
        o = F.rms_norm(o, (self.head_dim,), eps=self.eps).transpose(1, 2).reshape(b, s, -1)
        return self.wo(o * local_shard(self.norm_weight) * F.silu(self.wg(x)))

    def forward(self, x: torch.Tensor, rope=None) -> torch.Tensor:  # noqa: ARG002
        q, k, v, g, beta = self.inputs(x)
        if q.is_cuda:
            try:
                return self.out(x, _fla_chunked(q, k, v, g, beta).to(x.dtype))
            except ImportError:
                pass
        # fp32 inside (decays and the triangular solve; torch has no bf16 triangular solve)
        o = gated_delta_chunked(*(t.float() for t in (q, k, v, g, beta)), self.chunk)
        return self.out(x, o.to(x.dtype))

    def forward_recurrent(self, x: torch.Tensor, rope, state: dict,  # noqa: ARG002
                          pos0: int) -> torch.Tensor:  # noqa: ARG002
        """x (B, S, hidden) after the tokens summarised by `state` (the convolutions' last
        inputs, the delta-rule state 's'); extends the state. Constant memory per token."""
        q, k, v, g, beta = (t.float() for t in self.inputs(x, state))
        prev = state.get("s")   # fp32
        if q.shape[2] == 1 and prev is not None:
            o, state["s"] = gated_delta_step(q, k, v, g, beta, prev)
        else:
            o, state["s"] = gated_delta_chunked(q, k, v, g, beta, self.chunk, prev, True)
        return self.out(x, o.to(x.dtype))
