"""Griffin's recurrent block (De et al. 2024): the RG-LRU, a gated linear recurrence.

    y = GeLU(W_y x)                         gate branch
    u = CausalConv1D_4(W_x x)               short temporal convolution, per channel
    r = sigmoid(BD_a u),  i = sigmoid(BD_x u)          recurrence and input gates
    log a = -c * r * softplus(Lambda)  (c = 8)         a = sigma(Lambda)^(c r) per channel
    h_t = a_t h_{t-1} + sqrt(1 - a_t^2) (i_t u_t)      the RG-LRU (scan)
    out = W_o(h * y)

BD are block-diagonal projections with one block per head (as in the paper), so tensor
parallelism splits channels by heads with no communication inside the block. The recurrence is
computed by a Hillis-Steele parallel scan (log2 S vectorised steps; products of a only shrink,
so it is stable at any length) and, for generation, one step at a time (`rglru_step`); the two
agree (tested). Griffin's local-attention layers are the model's softmax attention with a
window; the mix is `model.block_pattern` (e.g. RRA).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from myria.tensors import local_shard

C_GATE = 8.0
CONV_WIDTH = 4


def linear_scan(a: torch.Tensor, b: torch.Tensor, h0: torch.Tensor | None = None) -> torch.Tensor:
    """h_t = a_t h_{t-1} + b_t along dim 1 of (B, S, W) tensors, h_{-1} = h0 (or 0).

    Hillis-Steele inclusive scan of the affine maps (a, b): after step d each position holds
    the composition of the 2^d maps ending there.
    """
    if h0 is not None:
        b = torch.cat([b[:, :1] + a[:, :1] * h0.unsqueeze(1), b[:, 1:]], dim=1)
    s, d = b.shape[1], 1
    while d < s:
        b = torch.cat([b[:, :d], b[:, d:] + a[:, d:] * b[:, :-d]], dim=1)
        a = torch.cat([a[:, :d], a[:, d:] * a[:, :-d]], dim=1)
        d *= 2
    return b


def linear_scan_reference(a, b, h0=None):
    """The same recurrence, one step at a time (the definition)."""
    h = torch.zeros_like(b[:, 0]) if h0 is None else h0
    out = []
    for t in range(b.shape[1]):
        h = a[:, t] * h + b[:, t]
        out.append(h)
    return torch.stack(out, dim=1)


class RGLRU(nn.Module):
    """Real-gated linear recurrent unit over `width` channels in `n_heads` gate blocks."""

    def __init__(self, width: int, n_heads: int):
        super().__init__()
        self.n_heads, self.block = n_heads, width // n_heads
        self.gate_x_weight = nn.Parameter(torch.empty(n_heads, self.block, self.block))
        self.gate_x_bias = nn.Parameter(torch.empty(n_heads, self.block))
        self.gate_a_weight = nn.Parameter(torch.empty(n_heads, self.block, self.block))
        self.gate_a_bias = nn.Parameter(torch.empty(n_heads, self.block))
        self.a_param = nn.Parameter(torch.empty(width))

    def _gate(self, u, w, bias):
        b, s, _ = u.shape
        w, bias = local_shard(w), local_shard(bias)
        g = torch.einsum("bshi,hij->bshj", u.view(b, s, w.shape[0], self.block), w) + bias
        return torch.sigmoid(g.reshape(b, s, -1))

    def coefficients(self, u: torch.Tensor, first: bool):
        """(a, b) of h_t = a_t h_{t-1} + b_t for inputs u (B, S, W); `first`: u starts the
        sequence (no earlier state: the input is not rescaled at position 0)."""
        r = self._gate(u, self.gate_a_weight, self.gate_a_bias)
        i = self._gate(u, self.gate_x_weight, self.gate_x_bias)
        log_a = -C_GATE * r * F.softplus(local_shard(self.a_param))
        a = torch.exp(log_a)
        mult = torch.sqrt(-torch.expm1(2 * log_a))          # sqrt(1 - a^2), accurate near 1
        if first:
            mult = torch.cat([torch.ones_like(mult[:, :1]), mult[:, 1:]], dim=1)
        return a, mult * (i * u)

    def forward(self, u: torch.Tensor, h0: torch.Tensor | None = None) -> torch.Tensor:
        a, b = self.coefficients(u, first=h0 is None)
        return linear_scan(a, b, h0)


def rglru_step(lru: RGLRU, u: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """One generation step: u (B, 1, W), previous state h (B, W) -> new state (B, W)."""
    a, b = lru.coefficients(u, first=False)
    return a[:, 0] * h + b[:, 0]


class RecurrentBlock(nn.Module):
    """Griffin's temporal-mixing block: gate branch, conv, RG-LRU, output projection."""

    def __init__(self, cfg):
        super().__init__()
        width = cfg.hidden
        self.wx = nn.Linear(cfg.hidden, width, bias=False)
        self.wy = nn.Linear(cfg.hidden, width, bias=False)
        self.conv_weight = nn.Parameter(torch.empty(width, CONV_WIDTH))
        self.conv_bias = nn.Parameter(torch.empty(width))
        self.rglru = RGLRU(width, cfg.heads)
        self.wo = nn.Linear(width, cfg.hidden, bias=False)

    def conv(self, u: torch.Tensor, past: torch.Tensor | None = None) -> torch.Tensor:
        """Causal depthwise convolution of (B, S, W); `past` = the previous CONV_WIDTH-1 inputs."""
        w, bias = local_shard(self.conv_weight), local_shard(self.conv_bias)
        if past is None:
            past = u.new_zeros(u.shape[0], CONV_WIDTH - 1, u.shape[2])
        x = torch.cat([past, u], dim=1).transpose(1, 2)           # (B, W, S + 3)
        return F.conv1d(x, w.unsqueeze(1), bias, groups=w.shape[0]).transpose(1, 2)

    def forward(self, x: torch.Tensor, rope=None) -> torch.Tensor:  # noqa: ARG002
        y = F.gelu(self.wy(x), approximate="tanh")
        h = self.rglru(self.conv(self.wx(x)))
        return self.wo(h * y)

    def forward_recurrent(self, x: torch.Tensor, rope, state: dict,  # noqa: ARG002
                          pos0: int) -> torch.Tensor:  # noqa: ARG002
        """x (B, S, H) after the tokens summarised by `state` (conv inputs, RG-LRU state);
        extends the state. Memory is constant per token."""
        y = F.gelu(self.wy(x), approximate="tanh")
        u = self.wx(x)
        past = state.get("conv")
        c = self.conv(u, past)
        state["conv"] = torch.cat([past if past is not None else
                                   u.new_zeros(u.shape[0], CONV_WIDTH - 1, u.shape[2]), u],
                                  dim=1)[:, -(CONV_WIDTH - 1):]
        h0 = state.get("h")
        if c.shape[1] == 1 and h0 is not None:
            h = rglru_step(self.rglru, c, h0).unsqueeze(1)
        else:
            h = self.rglru(c, h0)
        state["h"] = h[:, -1]
        return self.wo(h * y)
