"""Mixture-of-experts feed-forward layer: top-k router, expert capacity, router losses.

`MoE` replaces the dense MLP of a block when `model.experts > 0`. Each token is routed to
`top_k` of `experts` feed-forward networks (the maths of `transformer.MLP`), and its output is
the gate-weighted sum of theirs. Routing runs in fp32 at least: ``probs = softmax(x @
W_router^T)``, the top-k experts chosen; with top-1 the gate is the chosen probability, with
k > 1 the k probabilities are renormalised to sum to one. Each expert takes at most ``capacity =
ceil(capacity_factor * tokens * top_k / experts)`` of a microbatch's assignments, first choices
first; a dropped assignment contributes nothing (``capacity_factor = 0``: unlimited).
`moe_aux_loss` gives the load-balancing loss (coefficient `LOAD_BALANCE_COEF`) and router
z-loss (`Z_LOSS_COEF`), which `Transformer.forward` adds to the training loss. Capacity and
losses are computed over one forward call's tokens on one rank, so an expert-parallel run
(`myria.parallel.expert`) computes exactly the single-process values. Expert weights are stacked,
one 3-D parameter per matrix (``experts.w1`` [E, ffn, hidden], ``experts.w2`` [E, hidden, ffn],
``experts.w3`` [E, ffn, hidden]; gpt adds ``experts.w1_bias`` and ``experts.w2_bias``), so
expert parallelism shards dim 0. Sources: docs/architectures.md, "Reasons behind the model
modules".
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from myria.config import ModelConfig

LOAD_BALANCE_COEF = 1e-2  # Switch Transformer (Fedus et al. 2021), alpha = 10^-2
Z_LOSS_COEF = 1e-3        # ST-MoE (Zoph et al. 2022), c_z = 10^-3

log = logging.getLogger(__name__)


def expert_capacity(tokens: int, experts: int, top_k: int, capacity_factor: float) -> int | None:
    """Assignments one expert may take from `tokens` tokens; None when unlimited (factor 0)."""
    if capacity_factor <= 0:
        return None
    return math.ceil(capacity_factor * tokens * top_k / experts)


@dataclass
class Routing:
    """Where a microbatch's tokens go.

    The kept assignments are listed sorted by expert (then by priority): ``token[j]`` is the
    token row of assignment j, ``gate[j]`` its gate value, and ``counts[e]`` how many kept
    assignments expert e received, so expert e's inputs are a contiguous slice.
    """

    token: torch.Tensor      # [kept] long
    gate: torch.Tensor       # [kept] routing precision
    counts: torch.Tensor     # [E] long, kept assignments per expert
    routed: torch.Tensor     # [E] long, assignments per expert before capacity dropping
    expert: torch.Tensor     # [T, k] long, chosen experts
    probs: torch.Tensor      # [T, E] router probabilities
    logits: torch.Tensor     # [T, E] router logits
    capacity: int | None

    @property
    def dropped(self) -> int:
        return int(self.routed.sum() - self.counts.sum())


def route(logits: torch.Tensor, top_k: int, capacity: int | None) -> Routing:
    """Top-k routing of router logits [T, E] with optional capacity (see module docstring)."""
    t, e = logits.shape
    probs = logits.softmax(dim=-1)
    top_p, top_e = probs.topk(top_k, dim=-1)
    gates = top_p if top_k == 1 else top_p / top_p.sum(dim=-1, keepdim=True)
    # Assignment a = choice * T + token: sorting stably by expert keeps "first choices first,
    # then token order" inside every expert's slice, which is the dropping priority.
    flat_e = top_e.t().reshape(-1)
    order = torch.argsort(flat_e, stable=True)
    routed = torch.bincount(flat_e, minlength=e)
    counts = routed
    if capacity is not None:
        starts = routed.cumsum(0) - routed
        slot = torch.arange(flat_e.numel(), device=logits.device) - starts[flat_e[order]]
        order = order[slot < capacity]
        counts = routed.clamp(max=capacity)
    return Routing(token=order % t, gate=gates.t().reshape(-1)[order], counts=counts,
                   routed=routed, expert=top_e, probs=probs, logits=logits, capacity=capacity)


def load_balancing_loss(routing: Routing) -> torch.Tensor:
    """Switch Transformer's E * sum_i f_i * P_i (1.0 when routing is uniform)."""
    e = routing.probs.shape[1]
    f = routing.routed.to(routing.probs.dtype) / routing.expert.numel()
    p = routing.probs.mean(dim=0)
    return e * (f * p).sum()


def router_z_loss(logits: torch.Tensor) -> torch.Tensor:
    """ST-MoE's mean over tokens of logsumexp(logits)^2."""
    return torch.logsumexp(logits, dim=-1).square().mean()


# Rows at which each expert's slice of a CUDA grouped GEMM starts a multiple of: the weight
# gradient contracts over the tokens, and each expert's slice of its operands must start on a
# 16-byte boundary (8 bf16 rows); 16 also covers float8 operands (torchtitan aligns its token
# groups the same way for `torch._grouped_mm`).
CUDA_GROUP_ALIGN = 16
GROUPED_CHECK_TOL = 2e-2   # bf16 grouped GEMMs against the per-expert loop, of the largest entry
_CUDA_GROUPED: bool | None = None   # this process's check of the CUDA grouped GEMM (None: not run)


def expert_mlps(x: torch.Tensor, counts: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                w3: torch.Tensor | None, b1: torch.Tensor | None,
                b2: torch.Tensor | None) -> torch.Tensor:
    """Run expert i on rows [sum(counts[:i]), sum(counts[:i+1])) of x; weights stacked on dim 0.

    SwiGLU when `w3` is given, else GELU (tanh) with biases: `transformer.MLP` per expert. Every
    expert's weights are in the autograd graph on every rank, even with no rows (data-parallel
    gradient reductions then see the same parameters everywhere).

    Where torch's grouped GEMM takes the operands (`grouped_ok`), one `torch._grouped_mm` per
    weight runs all experts from `counts` as it lies on the device, so the host never waits for
    the routing; it computes what the per-expert loop computes, to rounding. Elsewhere
    (fp32 on a GPU, float64, widths off 16-byte strides, a compiled model on a CPU) each expert
    runs in turn, after reading `counts`.
    """
    ws = (w1, w2, w3, b1, b2)
    if grouped_ok(x, w1, w2, w3):
        return grouped_expert_mlps(x, counts, *ws,
                                   align=CUDA_GROUP_ALIGN if x.is_cuda else 1)
    return looped_expert_mlps(x, counts.tolist(), *ws)


def looped_expert_mlps(x: torch.Tensor, counts: list[int], w1: torch.Tensor, w2: torch.Tensor,
                       w3: torch.Tensor | None, b1: torch.Tensor | None,
                       b2: torch.Tensor | None) -> torch.Tensor:
    """`expert_mlps` one expert at a time (`counts` read to the host)."""
    w1s, w2s = w1.unbind(0), w2.unbind(0)
    w3s = w3.unbind(0) if w3 is not None else None
    b1s = b1.unbind(0) if b1 is not None else None
    b2s = b2.unbind(0) if b2 is not None else None
    outs = []
    for i, xi in enumerate(x.split(counts)):
        if w3s is not None:
            h = F.silu(F.linear(xi, w1s[i])) * F.linear(xi, w3s[i])
        else:
            h = F.gelu(F.linear(xi, w1s[i], b1s[i] if b1s else None), approximate="tanh")
        outs.append(F.linear(h, w2s[i], b2s[i] if b2s else None))
    return torch.cat(outs)


def grouped_expert_mlps(x: torch.Tensor, counts: torch.Tensor, w1: torch.Tensor,
                        w2: torch.Tensor, w3: torch.Tensor | None, b1: torch.Tensor | None,
                        b2: torch.Tensor | None, align: int = 1) -> torch.Tensor:
    """`expert_mlps` as three (two for GELU) grouped GEMMs, with no host read of `counts`.

    With `align` > 1 each expert's rows are copied to a slice that starts at a multiple of
    `align` in a zero-filled buffer whose size is bounded without reading `counts` (rows + E x
    (align - 1), rounded up); the slack after the last expert's rows goes to the last expert,
    so every row of the buffer belongs to an expert and holds finite values. Padding rows are
    zero in, and their outputs are never read, so they add nothing to any gradient."""
    e, rows = counts.numel(), x.shape[0]
    dev = x.device
    biased = b1 is not None or b2 is not None
    expert = None   # each row's expert, where a bias or the padding needs it
    if align > 1 or biased:
        expert = torch.repeat_interleave(torch.arange(e, device=dev), counts, output_size=rows)
    if align > 1:
        padded = (counts + align - 1) // align * align
        start, pstart = counts.cumsum(0) - counts, padded.cumsum(0) - padded
        dest = pstart[expert] + torch.arange(rows, device=dev) - start[expert]
        cap = -(-(rows + e * (align - 1)) // align) * align
        xin = x.new_zeros(cap, x.shape[1]).index_copy(0, dest, x)
        offs = torch.cat([padded.cumsum(0)[:-1], padded.new_full((1,), cap)]).to(torch.int32)
        if biased:
            expert = torch.bucketize(torch.arange(cap, device=dev), offs, right=True).clamp_(
                max=e - 1)
    else:
        xin, offs = x, counts.cumsum(0).to(torch.int32)

    def mm(a: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        out = torch._grouped_mm(a, w.transpose(-2, -1), offs=offs)
        return out if b is None else out + b[expert]

    if w3 is not None:
        h = F.silu(mm(xin, w1, b1)) * mm(xin, w3, None)
    else:
        h = F.gelu(mm(xin, w1, b1), approximate="tanh")
    y = mm(h, w2, b2)
    return y[dest] if align > 1 else y


def grouped_ok(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
               w3: torch.Tensor | None) -> bool:
    """Whether `torch._grouped_mm` runs these experts: one dtype for all (bf16 on CUDA, where
    the kernel's check passed once in this process; fp32, bf16 or fp16 on a CPU), both widths
    16-byte strides and every operand at a 16-byte aligned address (the kernel's own rules).
    Under torch.compile the kernel's rules are its CUDA form's (bf16 only) and a CPU has no
    compiled form, so a compiled CPU model runs the loop; the compiler places its buffers."""
    dt = x.dtype
    if not hasattr(torch, "_grouped_mm") or any(
            w is not None and w.dtype != dt for w in (w1, w2, w3)):
        return False
    size = x.element_size()
    if (w1.shape[-1] * size) % 16 or (w1.shape[-2] * size) % 16:
        return False
    compiling = torch.compiler.is_compiling()
    aligned = compiling or all(w is None or w.data_ptr() % 16 == 0 for w in (x, w1, w2, w3))
    if x.is_cuda:
        return dt == torch.bfloat16 and aligned and _cuda_grouped_ok(x.device)
    return x.device.type == "cpu" and dt in (torch.float32, torch.bfloat16, torch.float16) \
        and aligned and not compiling


@torch.compiler.disable
def _cuda_grouped_ok(device: torch.device) -> bool:
    """Whether the CUDA grouped GEMM runs this process's experts: checked once, on three small
    bf16 experts (one of them without rows), forward and backward against the per-expert
    loop; a failure or a disagreement leaves the loop, with one warning."""
    global _CUDA_GROUPED
    if _CUDA_GROUPED is None:
        try:
            g = torch.Generator(device=device).manual_seed(0)
            counts = torch.tensor([37, 0, 91], device=device)
            ins = [torch.randn(*s, device=device, generator=g).to(torch.bfloat16)
                   for s in ((128, 64), (3, 32, 64), (3, 64, 32), (3, 32, 64))]
            got_in = [t.clone().requires_grad_() for t in ins]
            ref_in = [t.clone().requires_grad_() for t in ins]
            got = grouped_expert_mlps(got_in[0], counts, got_in[1], got_in[2], got_in[3],
                                      None, None, align=CUDA_GROUP_ALIGN)
            ref = looped_expert_mlps(ref_in[0], counts.tolist(), ref_in[1], ref_in[2],
                                     ref_in[3], None, None)
            dy = torch.randn(ref.shape, device=device, generator=g).to(torch.bfloat16)
            got.backward(dy)
            ref.backward(dy)
            worst = max(float((a.float() - b.float()).abs().max() / b.float().abs().max())
                        for a, b in zip((got, *(t.grad for t in got_in)),
                                        (ref, *(t.grad for t in ref_in)), strict=True))
            _CUDA_GROUPED = worst < GROUPED_CHECK_TOL
            why = f"it differs from the per-expert loop by {worst:.3g} of the largest entry"
        except (RuntimeError, TypeError, ValueError, NotImplementedError) as e:
            _CUDA_GROUPED, why = False, f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        if not _CUDA_GROUPED:
            log.warning(
                "MoE: torch's grouped GEMM is not used (%s); experts run one at a time", why)
    return _CUDA_GROUPED


class Experts(nn.Module):
    """E feed-forward experts as stacked parameters; `forward` runs them on sorted tokens.

    `myria.parallel.expert.apply_expert_parallel` replaces this module by one holding E/ep
    experts per rank (same parameter names, global shapes as DTensors) that exchanges tokens.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        e, h, f = cfg.experts, cfg.hidden, cfg.ffn_dim
        self.num_experts = e
        self.gated = cfg.arch != "gpt"
        self.w1 = nn.Parameter(torch.empty(e, f, h))
        self.w2 = nn.Parameter(torch.empty(e, h, f))
        if self.gated:
            self.w3 = nn.Parameter(torch.empty(e, f, h))
            self.w1_bias = self.w2_bias = None
        else:
            self.w3 = None
            # Names end in "bias" so Transformer._init_rule initialises them to zero.
            self.w1_bias = nn.Parameter(torch.empty(e, f))
            self.w2_bias = nn.Parameter(torch.empty(e, h))

    def weights(self) -> tuple[torch.Tensor | None, ...]:
        """(w1, w2, w3, w1_bias, w2_bias) as the forward computes with them (None where absent)."""
        return self.w1, self.w2, self.w3, self.w1_bias, self.w2_bias

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x: kept assignments sorted by expert; counts: [E] rows per expert."""
        return expert_mlps(x, counts, *self.weights())

    def extra_repr(self) -> str:
        return f"experts={self.num_experts}, gated={self.gated}"


class MoE(nn.Module):
    """Routed mixture-of-experts MLP; after each forward, `aux_loss` holds its router losses.

    `aux_loss` = LOAD_BALANCE_COEF * load balancing + Z_LOSS_COEF * z-loss of that forward
    (differentiable); `stats` holds detached diagnostics (the two losses, tokens per expert
    before and after capacity, dropped assignments).
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        if cfg.experts < 1 or not 1 <= cfg.top_k <= cfg.experts:
            raise ValueError(f"MoE needs experts >= 1 and 1 <= top_k <= experts, got "
                             f"experts={cfg.experts}, top_k={cfg.top_k}")
        self.num_experts, self.top_k = cfg.experts, cfg.top_k
        self.capacity_factor = cfg.capacity_factor
        self.router = nn.Linear(cfg.hidden, cfg.experts, bias=False)
        self.experts = Experts(cfg)
        self.aux_loss: torch.Tensor | None = None
        self.stats: dict[str, torch.Tensor] = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        t = x2.shape[0]
        rdt = torch.promote_types(x.dtype, torch.float32)  # route in fp32 (or fp64)
        logits = F.linear(x2.to(rdt), self.router.weight.to(rdt))
        capacity = expert_capacity(t, self.num_experts, self.top_k, self.capacity_factor)
        r = route(logits, self.top_k, capacity)
        lb, z = load_balancing_loss(r), router_z_loss(logits)
        self.aux_loss = LOAD_BALANCE_COEF * lb + Z_LOSS_COEF * z
        self.stats = {"load_balancing_loss": lb.detach(), "z_loss": z.detach(),
                      "routed": r.routed, "kept": r.counts,
                      "dropped": r.routed.sum() - r.counts.sum()}
        y = self.experts(x2[r.token], r.counts)
        weighted = (y.to(r.gate.dtype) * r.gate.unsqueeze(1)).to(x.dtype)
        out = x2.new_zeros(t, shape[-1]).index_add(0, r.token, weighted)
        return out.view(shape)

    def extra_repr(self) -> str:
        return (f"experts={self.num_experts}, top_k={self.top_k}, "
                f"capacity_factor={self.capacity_factor}")


def moe_aux_loss(model: nn.Module) -> torch.Tensor | None:
    """Sum of the router losses of every MoE layer of `model` from its latest forward."""
    losses = [m.aux_loss for m in model.modules() if isinstance(m, MoE) and m.aux_loss is not None]
    return torch.stack(losses).sum() if losses else None
