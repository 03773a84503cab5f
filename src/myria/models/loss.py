"""Fused output projection + cross-entropy, computed in chunks of tokens.

Why our own: PyTorch has no fused linear-cross-entropy. The plain path materialises the full
(tokens x vocab) logits, then log-softmax, then its gradient: several full passes over the
largest activation of the model (about 12% of a small GPT's step on CPU). Here each chunk of
tokens computes its logits, turns them into probabilities in place, and immediately produces
the gradients for the hidden states and the weight, so the logits never exist whole and the
backward pass is a scaling of stored gradients. The matmul work is the same three GEMMs.
"""

from __future__ import annotations

import contextlib

import torch

from myria.models.flops import loss_chunk_rows

# Per-token losses of every fused loss computed under `record_row_losses` (None: not recorded).
_ROWS: list[torch.Tensor] | None = None


@contextlib.contextmanager
def record_row_losses():
    """Collect the per-token cross-entropy (fp32, detached, in row order) of each fused loss
    computed inside; a data mixture's training loss per source is made from them."""
    global _ROWS
    prev, _ROWS = _ROWS, []
    try:
        yield _ROWS
    finally:
        _ROWS = prev


def on_accelerator(t: torch.Tensor) -> bool:
    """Whether `t` lives on an accelerator (its GEMMs then run on tensor cores)."""
    return t.device.type != "cpu"


def gemm_dtype(h: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The dtype the loss's GEMMs run in: autocast's where it is on (as `h @ weight.T` would
    run), else the inputs' common dtype."""
    dev = h.device.type
    if torch.is_autocast_enabled(dev):
        return torch.get_autocast_dtype(dev)
    return torch.promote_types(h.dtype, weight.dtype)


class _FusedLinearCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h: torch.Tensor, weight: torch.Tensor, bias, targets: torch.Tensor,
                chunk: int):
        n = h.shape[0]
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        need_b = bias is not None and ctx.needs_input_grad[2]
        # accumulate in fp32 (fp64 stays fp64)
        acc = torch.float64 if h.dtype == torch.float64 else torch.float32
        # On an accelerator all three GEMMs run in the forward's dtype (bf16 under FSDP2's
        # policy or autocast: tensor cores), each chunk's weight gradient summed into the fp32
        # one, as precise as any other layer's bf16 weight gradient; an fp32 GEMM runs at
        # ~1/15 of the bf16 rate on a Hopper. A CPU keeps the fp32 weight-gradient GEMM.
        accel = on_accelerator(h)
        gdt = gemm_dtype(h, weight) if accel else h.dtype
        wc = weight.to(gdt) if accel else weight
        grad_h = torch.empty_like(h) if need_h else None
        grad_w = torch.zeros_like(weight, dtype=acc) if need_w else None
        grad_b = torch.zeros_like(bias, dtype=acc) if need_b else None
        total = torch.zeros((), dtype=acc, device=h.device)
        for start in range(0, n, chunk):
            hc = h[start:start + chunk].to(gdt)
            tc = targets[start:start + chunk]
            logits = hc @ wc.t()
            if bias is not None:
                logits += bias
            logits = logits.to(acc)
            m = logits.amax(dim=-1, keepdim=True)
            picked = logits.gather(1, tc.unsqueeze(1))
            logits.sub_(m).exp_()
            s = logits.sum(dim=-1, keepdim=True)
            rows = (s.log() + m - picked).squeeze(1)
            total += rows.sum()
            if _ROWS is not None:
                _ROWS.append(rows.detach().float())
            if need_h or need_w or need_b:
                p = logits.div_(s)  # softmax, in place
                p.scatter_add_(1, tc.unsqueeze(1), torch.full_like(picked, -1.0))
                p = p.to(gdt)
                if need_h:
                    if gdt == h.dtype:
                        torch.matmul(p, wc, out=grad_h[start:start + chunk])
                    else:
                        grad_h[start:start + chunk] = p @ wc
                if need_w:
                    if accel and gdt != acc:
                        grad_w.add_(p.t() @ hc)
                    else:
                        grad_w.addmm_(p.t().to(acc), hc.to(acc))
                if need_b:
                    grad_b += p.to(acc).sum(0)
        scale = 1.0 / n
        ctx.save_for_backward(
            grad_h if need_h else None,
            grad_w if need_w else None,
            grad_b if need_b else None,
        )
        ctx.scale = scale
        ctx.dtypes = (h.dtype, weight.dtype)
        return total * scale

    @staticmethod
    def backward(ctx, grad_out):
        grad_h, grad_w, grad_b = ctx.saved_tensors
        g = grad_out * ctx.scale
        out_h = (grad_h * g.to(grad_h.dtype)) if grad_h is not None else None
        out_w = (grad_w * g).to(ctx.dtypes[1]) if grad_w is not None else None
        out_b = (grad_b * g).to(ctx.dtypes[1]) if grad_b is not None else None
        return out_h, out_w, out_b, None, None


def fused_linear_cross_entropy(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                               bias: torch.Tensor | None = None,
                               chunk: int | None = None) -> torch.Tensor:
    """Mean cross-entropy of `h @ weight.T (+ bias)` against `targets`; h is (..., hidden)."""
    h2 = h.reshape(-1, h.shape[-1])
    t = targets.reshape(-1)
    return _FusedLinearCE.apply(h2, weight, bias, t,
                                chunk or loss_chunk_rows(weight.shape[0], h.device.type))
