"""Context parallelism: ring attention over a cp process group, and sequence sharding helpers.

Each rank of the cp group holds a slice of the sequence of Q, K and V (B, H, S_local, D). K/V
blocks travel around the ring (rank r sends to r+1, receives from r-1) while the current block
is computed, and partial outputs merge by the log-sum-exp rule of online softmax; in the
backward the dK/dV accumulators travel with their K/V block, so after a final hop each rank
holds the gradients of its own K/V. With load balancing the sequence is cut into 2*cp chunks and
rank r holds chunks r and 2*cp-1-r, the same causal work on every rank. Masks follow
`myria.models.attention.window_mask` on absolute positions: fully masked blocks are skipped,
fully visible ones run unmasked. Unmasked and causal blocks run a fused attention kernel
(FlashAttention on CUDA, its CPU counterpart on a CPU); the others run fp32 einsums (fp64 for
fp64 inputs).

Use `swap_core_attention` on a model (its positions from `positions_for_rank`) and
`shard_sequence` on its inputs and targets; `gather_sequence` joins the slices again.
docs/parallelism.md says why this is not torch's `context_parallel`.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from myria.models.attention import CoreAttention, window_mask

log = logging.getLogger("myria")

__all__ = ["RingAttention", "chunk_bounds", "gather_sequence", "positions_for_rank",
           "ring_attention", "shard_sequence", "swap_core_attention", "unshard_sequence"]


# -- sequence layout ----------------------------------------------------------------------------

def chunk_bounds(seq_len: int, cp_rank: int, cp_size: int,
                 load_balance: bool = True) -> list[tuple[int, int]]:
    """(start, length) of the contiguous pieces of the sequence rank `cp_rank` holds, in order.

    Load-balanced: chunks r and 2*cp-1-r of 2*cp equal chunks; otherwise the r-th of cp chunks.
    """
    parts = 2 * cp_size if load_balance else cp_size
    if seq_len % parts:
        raise ValueError(f"sequence length {seq_len} is not divisible by {parts} "
                         f"({'2 * ' if load_balance else ''}cp = {cp_size}); context "
                         "parallelism needs equal chunks")
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank {cp_rank} out of range for cp_size {cp_size}")
    c = seq_len // parts
    if not load_balance:
        return [(cp_rank * c, c)]
    return [(cp_rank * c, c), ((parts - 1 - cp_rank) * c, c)]


def positions_for_rank(seq_len: int, cp_rank: int, cp_size: int, load_balance: bool = True,
                       device: torch.device | str | None = None) -> torch.Tensor:
    """Absolute token positions (int64, length seq_len / cp) that rank `cp_rank` holds.

    The model needs them for position embeddings (RoPE tables indexed by these positions).
    """
    return torch.cat([torch.arange(s, s + n, device=device)
                      for s, n in chunk_bounds(seq_len, cp_rank, cp_size, load_balance)])


def shard_sequence(x: torch.Tensor, cp_rank: int, cp_size: int, dim: int = 1,
                   load_balance: bool = True) -> torch.Tensor:
    """The part of full-sequence tensor `x` (sequence along `dim`) that rank `cp_rank` holds."""
    pieces = [x.narrow(dim, s, n)
              for s, n in chunk_bounds(x.shape[dim], cp_rank, cp_size, load_balance)]
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim)


def unshard_sequence(shards: Sequence[torch.Tensor], dim: int = 1,
                     load_balance: bool = True) -> torch.Tensor:
    """Inverse of `shard_sequence`: the full sequence from every rank's shard (in rank order)."""
    cp = len(shards)
    if not load_balance:
        return torch.cat(list(shards), dim)
    chunks: list[torch.Tensor | None] = [None] * (2 * cp)
    for r, s in enumerate(shards):
        head, tail = s.chunk(2, dim)
        chunks[r], chunks[2 * cp - 1 - r] = head, tail
    return torch.cat(chunks, dim)


def gather_sequence(x: torch.Tensor, group: dist.ProcessGroup | None = None, dim: int = 1,
                    load_balance: bool = True) -> torch.Tensor:
    """All-gather every rank's shard over the cp group and return the full sequence (no grad)."""
    n = dist.get_world_size(group)
    shards = [torch.empty_like(x) for _ in range(n)]
    dist.all_gather(shards, x.contiguous(), group=group)
    return unshard_sequence(shards, dim, load_balance)


# -- block plan ---------------------------------------------------------------------------------

SKIP, FULL, MASKED = 0, 1, 2


def _block_kind(q_start: int, q_len: int, k_start: int, k_len: int, window: int) -> int:
    """SKIP, FULL or MASKED for contiguous query and key position ranges (window 0 = causal)."""
    d_min = q_start - (k_start + k_len - 1)  # smallest query-key distance in the block
    d_max = q_start + q_len - 1 - k_start
    if d_max < 0 or (window and d_min >= window):
        return SKIP
    if d_min >= 0 and (not window or d_max < window):
        return FULL
    return MASKED


# One computed block: local query offset and length, local key offset and length, mask or None,
# and whether that mask is exactly causal (a chunk against itself, no window within it, no
# documents).
Block = tuple[int, int, int, int, "torch.Tensor | None", bool]


def _plan(rank: int, size: int, local_len: int, window: int, load_balance: bool,
          device: torch.device | str | None = None) -> list[list[Block]]:
    """For ring step i (K/V from rank (rank - i) mod size): the blocks to compute."""
    seq_len = local_len * size
    q_bounds = chunk_bounds(seq_len, rank, size, load_balance)
    masks: dict[tuple[int, int, int], torch.Tensor] = {}
    steps = []
    for i in range(size):
        src = (rank - i) % size
        blocks: list[Block] = []
        qo = 0
        for qs, ql in q_bounds:
            ko = 0
            for ks, kl in chunk_bounds(seq_len, src, size, load_balance):
                kind = _block_kind(qs, ql, ks, kl, window)
                if kind != SKIP:
                    mask = None
                    if kind == MASKED:  # the mask depends only on the offset between chunks
                        key = (ql, kl, qs - ks)
                        if key not in masks:
                            masks[key] = window_mask(ql, kl, window, device, qs, ks)
                        mask = masks[key]
                    # a chunk against itself: the window (if any) reaches past the chunk
                    causal = kind == MASKED and qs == ks and ql == kl and \
                        (not window or window >= ql)
                    blocks.append((qo, ql, ko, kl, mask, causal))
                ko += kl
            qo += ql
        steps.append(blocks)
    return steps


def _document_plan(plan: list[list[Block]], doc_ids: torch.Tensor, rank: int, size: int,
                   load_balance: bool) -> list[list[Block]]:
    """`plan` with each block's mask narrowed to query-key pairs of the same document
    (doc_ids: (B, S) of the whole sequence); blocks left with no such pair are dropped, and
    masks are (B, 1, 1, Sq, Sk) to broadcast over the (B, Hkv, G) score dimensions."""
    q_ids = shard_sequence(doc_ids, rank, size, dim=1, load_balance=load_balance)
    out = []
    for i, blocks in enumerate(plan):
        k_ids = shard_sequence(doc_ids, (rank - i) % size, size, dim=1, load_balance=load_balance)
        kept: list[Block] = []
        for qo, ql, ko, kl, mask, causal in blocks:
            same = q_ids[:, qo:qo + ql, None] == k_ids[:, None, ko:ko + kl]
            keep = same if mask is None else same & mask
            if not keep.any():
                continue
            kept.append((qo, ql, ko, kl, None if keep.all() else keep[:, None, None],
                         causal and bool(same.all())))
        out.append(kept)
    return out


# -- ring communication -------------------------------------------------------------------------

class _Ring:
    """Rank, size and global neighbour ranks of a cp group (group None = default group or none)."""

    def __init__(self, group: dist.ProcessGroup | None):
        self.group = group
        if group is None and not (dist.is_available() and dist.is_initialized()):
            self.rank, self.size = 0, 1
            return
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)
        g = group if group is not None else dist.group.WORLD
        self.next = dist.get_global_rank(g, (self.rank + 1) % self.size)
        self.prev = dist.get_global_rank(g, (self.rank - 1) % self.size)

    def exchange(self, sends: Sequence[torch.Tensor], recvs: Sequence[torch.Tensor]) -> list:
        """Start sending `sends` to the next rank and receiving `recvs` from the previous one.

        The i-th send of a rank pairs with the i-th receive of its successor; the tag keeps
        them apart on backends that match by tag.
        """
        ops = []
        for tag, (s, r) in enumerate(zip(sends, recvs, strict=True)):
            ops.append(dist.P2POp(dist.isend, s, self.next, self.group, tag))
            ops.append(dist.P2POp(dist.irecv, r, self.prev, self.group, tag))
        return dist.batch_isend_irecv(ops) if ops else []


def _wait(works: list) -> None:
    for w in works:
        w.wait()


# -- block math (q: (B, Hkv, G, Sq, D); k, v: (B, Hkv, Sk, D); G query heads per kv head) ------

def _scores(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None,
            scale: float) -> torch.Tensor:
    s = torch.einsum("bhgqd,bhkd->bhgqk", q, k).mul_(scale)
    if mask is not None:
        s.masked_fill_(~mask, float("-inf"))
    return s


def _finite(x: torch.Tensor) -> torch.Tensor:
    """-inf (rows with no visible key) replaced by 0, so that exp(-inf - x) stays 0, not NaN."""
    return torch.where(torch.isneginf(x), torch.zeros_like(x), x)


def _attend_block(q, k, v, mask, scale) -> tuple[torch.Tensor, torch.Tensor]:
    """Normalised block output (B, Hkv, G, Sq, D) and its log-sum-exp (B, Hkv, G, Sq)."""
    s = _scores(q, k, mask, scale)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - _finite(lse).unsqueeze(-1))
    return torch.einsum("bhgqk,bhkd->bhgqd", p, v), lse


def _merge(out: torch.Tensor, lse: torch.Tensor, blk_out: torch.Tensor,
           blk_lse: torch.Tensor) -> None:
    """Online-softmax merge of a block's (output, lse) into the running (out, lse), in place."""
    new = torch.logaddexp(lse, blk_lse)
    ref = _finite(new)
    out.mul_(torch.exp(lse - ref).unsqueeze(-1))
    out.add_(blk_out * torch.exp(blk_lse - ref).unsqueeze(-1))
    lse.copy_(new)


# -- fused blocks (q: (B, H, Sq, D); k, v: (B, Hkv, Sk, D), grouped heads as SDPA takes them) ---
# A block with no mask, or with exactly the causal one, runs a fused attention kernel that also
# returns the block's log-sum-exp: FlashAttention on CUDA (fp16/bf16 inputs: fp32 accumulation,
# the block's scores never held) or its CPU counterpart (fp32/fp64). Its backward kernel, given
# the merged output and log-sum-exp of the whole row, returns the block's share of dQ, dK and dV,
# the rule the einsum backward follows. Blocks with other masks (a window's edge, documents),
# and fp32 inputs on CUDA, run the einsums. torch's own context parallelism merges its flash
# blocks the same way; it is not used here (docs/parallelism.md).
_CUDA_FUSED: bool | None = None   # the CUDA kernels' check in this process (None: not yet run)
FUSED_CHECK_TOL = 3e-2            # bf16 blocks against fp32 SDPA, relative to the largest entry


def _fused_block(q, k, v, causal: bool, scale: float) -> tuple:
    """A block's output (B, H, Sq, D) and log-sum-exp (B, H, Sq) from the fused kernel, and
    what the CUDA kernel's backward takes back from its forward (None on a CPU): the sequence
    offsets and random state of a non-variable-length, dropout-free call, alike for every
    block (torch's own ring passes one call's back for every step the same way)."""
    if q.is_cuda:   # the kernel takes the blocks' slices as dense tensors
        q, k, v = (t.contiguous() for t in (q, k, v))
        out, lse, cum_q, cum_k, _, _, seed, offset, _ = \
            torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False,
                                                               scale=scale)
        return out, lse, (cum_q, cum_k, seed, offset)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal,
                                                                          scale=scale)
    return out, lse, None


def _fused_block_grads(do, q, k, v, out, lse, causal: bool, scale: float,
                       rest: tuple | None) -> tuple[torch.Tensor, ...]:
    """dQ, dK, dV of one block given the rows' merged output `out` and log-sum-exp `lse`
    (`rest`: `_fused_block`'s third value)."""
    if q.is_cuda:
        do, q, k, v, out, lse = (t.contiguous() for t in (do, q, k, v, out, lse))
        cum_q, cum_k, seed, offset = rest
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
            do, q, k, v, out, lse, cum_q, cum_k, q.shape[2], k.shape[2], 0.0, causal, seed,
            offset, scale=scale)
    else:
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            do, q, k, v, out, lse, 0.0, causal, scale=scale)
    if dk.shape[1] != k.shape[1]:   # a kernel that returns the grouped heads expanded
        dk, dv = (t.unflatten(1, (k.shape[1], -1)).sum(2) for t in (dk, dv))
    return dq, dk, dv


def _cuda_fused_ok(q: torch.Tensor) -> bool:
    """Whether the CUDA kernels run this process's blocks: checked once, on a small causal
    block with grouped heads, forward and backward against fp32 SDPA; a failure or a
    disagreement leaves the einsums, with one warning."""
    global _CUDA_FUSED
    if _CUDA_FUSED is None:
        try:
            g = torch.Generator(device=q.device).manual_seed(0)
            d = q.shape[-1]
            qs = torch.randn(1, 4, 128, d, device=q.device, generator=g).to(q.dtype)
            ks, vs = (torch.randn(1, 2, 128, d, device=q.device, generator=g).to(q.dtype)
                      for _ in range(2))
            do = torch.randn_like(qs)
            out, lse, rest = _fused_block(qs, ks, vs, True, 1 / math.sqrt(d))
            grads = _fused_block_grads(do, qs, ks, vs, out, lse, True, 1 / math.sqrt(d), rest)
            ref_in = [t.float().requires_grad_() for t in (qs, ks, vs)]
            ref = F.scaled_dot_product_attention(*ref_in, is_causal=True, enable_gqa=True)
            ref_grads = torch.autograd.grad(ref, ref_in, do.float())
            worst = max(float((a.float() - b).abs().max() / b.abs().max())
                        for a, b in zip((out, *grads), (ref, *ref_grads), strict=True))
            _CUDA_FUSED = worst < FUSED_CHECK_TOL
            why = f"it differs from SDPA by {worst:.3g} of the largest entry"
        except (RuntimeError, TypeError, ValueError) as e:
            _CUDA_FUSED, why = False, f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        if not _CUDA_FUSED:
            log.warning(
                "ring attention: the fused CUDA kernel is not used (%s); blocks run as fp32 "
                "einsums", why)
    return _CUDA_FUSED


def _fused_dtype(q: torch.Tensor) -> torch.dtype | None:
    """The dtype the fused kernel runs `q`'s blocks in, or None where the einsums run them."""
    if q.device.type == "cpu":
        return torch.promote_types(q.dtype, torch.float32)
    if q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] <= 256 \
            and _cuda_fused_ok(q):
        return q.dtype
    return None


class _RingAttentionFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, window, load_balance, doc_ids=None):
        ring = _Ring(group)
        b, h, s, d = q.shape
        hkv = k.shape[1]
        if h % hkv or k.shape != v.shape or k.shape[0] != b or k.shape[2:] != (s, d):
            raise ValueError(f"ring attention: incompatible shapes q {tuple(q.shape)}, "
                             f"k {tuple(k.shape)}, v {tuple(v.shape)}")
        cdtype = torch.promote_types(q.dtype, torch.float32)
        scale = 1.0 / math.sqrt(d)
        plan = _plan(ring.rank, ring.size, s, window, load_balance, q.device)
        if doc_ids is not None:
            plan = _document_plan(plan, doc_ids, ring.rank, ring.size, load_balance)
        g = h // hkv
        qc = q.to(cdtype).reshape(b, hkv, g, s, d)
        fdt = _fused_dtype(q)
        qf = q.to(fdt) if fdt is not None else None
        out = torch.zeros_like(qc)
        lse = torch.full(qc.shape[:-1], float("-inf"), dtype=cdtype, device=q.device)
        cur = torch.stack([k, v])  # one message per hop; sent in the input dtype
        rest = None
        for i, blocks in enumerate(plan):
            works, nxt = [], None
            if i + 1 < ring.size:  # prefetch the next K/V block while computing this one
                nxt = torch.empty_like(cur)
                works = ring.exchange([cur], [nxt])
            kc, vc = cur[0].to(cdtype), cur[1].to(cdtype)
            kf, vf = (cur[0].to(fdt), cur[1].to(fdt)) if fdt is not None else (None, None)
            for qo, ql, ko, kl, mask, causal in blocks:
                qs, ks = slice(qo, qo + ql), slice(ko, ko + kl)
                if fdt is not None and (mask is None or causal):
                    o_blk, l_blk, rest = _fused_block(qf[:, :, qs], kf[:, :, ks], vf[:, :, ks],
                                                      causal, scale)
                    o_blk = o_blk.to(cdtype).reshape(b, hkv, g, ql, d)
                    l_blk = l_blk.to(cdtype).reshape(b, hkv, g, ql)
                else:
                    o_blk, l_blk = _attend_block(qc[..., qs, :], kc[:, :, ks], vc[:, :, ks],
                                                 mask, scale)
                _merge(out[..., qs, :], lse[..., qs], o_blk, l_blk)
            _wait(works)
            if nxt is not None:
                cur = nxt
        o = out.reshape(b, h, s, d).to(q.dtype)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.group, ctx.plan, ctx.scale, ctx.rest = group, plan, scale, rest
        return o

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, o, lse = ctx.saved_tensors
        ring, plan, scale = _Ring(ctx.group), ctx.plan, ctx.scale
        b, h, s, d = q.shape
        hkv = k.shape[1]
        cdtype = lse.dtype
        shape5 = (b, hkv, h // hkv, s, d)
        qc = q.to(cdtype).reshape(shape5)
        do = grad_out.to(cdtype).reshape(shape5)
        delta = (do * o.to(cdtype).reshape(shape5)).sum(-1)  # rowsum(dO * O)
        lse_f = _finite(lse)
        fdt = _fused_dtype(q)
        if fdt is not None:   # the fused kernels' operands, (B, H, S, D) and (B, H, S)
            qf, dof, of = q.to(fdt), grad_out.to(fdt), o.to(fdt)
            lsef = lse.reshape(b, h, s)
        dq = torch.zeros_like(qc)
        cur = torch.stack([k, v])
        acc = None  # dK/dV accumulator of the block computed in the previous step
        for i, blocks in enumerate(plan):
            sends, recvs = [], []
            nxt = incoming = None
            if i + 1 < ring.size:
                nxt = torch.empty_like(cur)
                sends.append(cur)
                recvs.append(nxt)
            if i > 0:  # pass the previous block's dK/dV on; receive this block's so far
                incoming = torch.empty_like(acc)
                sends.append(acc)
                recvs.append(incoming)
            works = ring.exchange(sends, recvs)
            kc, vc = cur[0].to(cdtype), cur[1].to(cdtype)
            kf, vf = (cur[0].to(fdt), cur[1].to(fdt)) if fdt is not None else (None, None)
            local = torch.zeros((2, *kc.shape), dtype=cdtype, device=q.device)
            for qo, ql, ko, kl, mask, causal in blocks:
                qs, ks = slice(qo, qo + ql), slice(ko, ko + kl)
                if fdt is not None and (mask is None or causal):
                    dqb, dkb, dvb = _fused_block_grads(
                        dof[:, :, qs], qf[:, :, qs], kf[:, :, ks], vf[:, :, ks], of[:, :, qs],
                        lsef[:, :, qs], causal, scale, ctx.rest)
                    dq[..., qs, :] += dqb.to(cdtype).reshape(b, hkv, h // hkv, ql, d)
                    local[0][:, :, ks] += dkb.to(cdtype)
                    local[1][:, :, ks] += dvb.to(cdtype)
                    continue
                qb, dob = qc[..., qs, :], do[..., qs, :]
                kb, vb = kc[:, :, ks], vc[:, :, ks]
                p = torch.exp(_scores(qb, kb, mask, scale) - lse_f[..., qs].unsqueeze(-1))
                local[1][:, :, ks] += torch.einsum("bhgqk,bhgqd->bhkd", p, dob)
                dp = torch.einsum("bhgqd,bhkd->bhgqk", dob, vb)
                ds = p.mul_(dp.sub_(delta[..., qs].unsqueeze(-1))).mul_(scale)
                dq[..., qs, :] += torch.einsum("bhgqk,bhkd->bhgqd", ds, kb)
                local[0][:, :, ks] += torch.einsum("bhgqk,bhgqd->bhkd", ds, qb)
            _wait(works)
            acc = local if incoming is None else incoming.add_(local)
            if nxt is not None:
                cur = nxt
        if ring.size > 1:  # final hop: the accumulator goes home to the rank owning the block
            home = torch.empty_like(acc)
            _wait(ring.exchange([acc], [home]))
            acc = home
        dq = dq.reshape(b, h, s, d).to(q.dtype)
        return dq, acc[0].to(k.dtype), acc[1].to(v.dtype), None, None, None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   group: dist.ProcessGroup | None = None, window: int = 0,
                   load_balance: bool = True, doc_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Causal (window > 0: sliding-window) attention over a sequence sharded across `group`.

    q: (B, H, S_local, D); k, v: (B, H_kv, S_local, D) with H a multiple of H_kv (GQA), laid out
    as `shard_sequence` does. Returns this rank's (B, H, S_local, D) output. With no group and no
    initialised process group, it is plain single-process attention. `doc_ids` (B, S) of the
    whole sequence (every rank has them) keeps attention inside documents; blocks with no
    query-key pair in the same document are not computed.
    """
    return _RingAttentionFn.apply(q, k, v, group, window, load_balance, doc_ids)


class RingAttention(nn.Module):
    """Drop-in replacement for `CoreAttention` under context parallelism: (q, k, v) -> out.

    The inputs hold this rank's part of the sequence as laid out by `shard_sequence` with the
    same `load_balance`; absolute positions follow from (cp rank, cp size, local length).
    """

    def __init__(self, cp_group: dist.ProcessGroup | None = None, window: int = 0,
                 load_balance: bool = True):
        super().__init__()
        self.cp_group, self.window, self.load_balance = cp_group, window, load_balance

    @classmethod
    def from_core(cls, core: CoreAttention, cp_group: dist.ProcessGroup | None,
                  load_balance: bool = True) -> RingAttention:
        """A ring attention with the same window as `core`."""
        return cls(cp_group, core.window, load_balance)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                doc_ids: torch.Tensor | None = None) -> torch.Tensor:
        return ring_attention(q, k, v, self.cp_group, self.window, self.load_balance, doc_ids)

    def extra_repr(self) -> str:
        return f"window={self.window}, load_balance={self.load_balance}"


def swap_core_attention(model: nn.Module, cp_group: dist.ProcessGroup | None,
                        load_balance: bool = True) -> int:
    """Replace every `CoreAttention` in `model` by a `RingAttention`; returns how many.

    Position embeddings are not touched: the caller feeds each rank its
    `positions_for_rank` (RoPE rows / learned-position indices).
    """
    targets = [(parent, name, child) for parent in model.modules()
               for name, child in parent.named_children() if isinstance(child, CoreAttention)]
    for parent, name, child in targets:
        setattr(parent, name, RingAttention.from_core(child, cp_group, load_balance))
    return len(targets)
