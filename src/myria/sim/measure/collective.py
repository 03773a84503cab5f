"""Collective and point-to-point benchmarks with nccl-tests' bandwidth conventions and data checks.

Every function runs inside an initialised process group (gloo on CPU, NCCL on GPU) and must be
called by all ranks of `group`. Each benchmark first checks the result of one call against the
values it must hold (a wrong reduction or a corrupted transfer is a failure in its own right),
then times `iters` back-to-back calls after `warmup` untimed ones. A rank's time is the mean
over the timed calls; the reported time is the slowest rank's, so every rank returns the same
figures.

Bandwidths follow nccl-tests (doc/PERFORMANCE.md):

- algorithm bandwidth `algbw = S / t`, with S the per-rank buffer size in bytes: the reduced
  buffer for all-reduce, the full (gathered / pre-scatter) buffer for all-gather and
  reduce-scatter, the whole send buffer for all-to-all;
- bus bandwidth `busbw = algbw * factor`, with factor 2(n-1)/n for all-reduce and (n-1)/n for
  all-gather, reduce-scatter and all-to-all, so busbw is comparable to the link's speed
  whatever the number of ranks.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any

OPS = ("all_reduce", "all_to_all", "all_gather", "reduce_scatter")


def busbw_factor(op: str, n: int) -> float:
    """nccl-tests' bus-bandwidth factor of collective `op` on `n` ranks."""
    if n < 1:
        raise ValueError(f"number of ranks must be >= 1, got {n}")
    if op == "all_reduce":
        return 2.0 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n
    if op in ("broadcast", "reduce", "send_recv"):
        return 1.0
    raise ValueError(f"unknown collective {op!r}; known: {', '.join(OPS)}")


def bus_bandwidth(op: str, algbw_gbs: float, n: int) -> float:
    """Bus bandwidth (GB/s) from algorithm bandwidth (GB/s), as nccl-tests computes it."""
    return algbw_gbs * busbw_factor(op, n)


@dataclass
class CollectiveResult:
    """Timing and data check of one collective; identical on every rank."""

    op: str
    nbytes: int              # S of the nccl-tests convention (see the module docstring)
    world: int
    time_s: float            # mean time of one call on the slowest rank
    algbw_gbs: float
    busbw_gbs: float
    correct: bool            # every rank's result of the checked call held the right values
    bad_ranks: list[int]     # ranks whose checked result was wrong
    max_error: float         # largest absolute deviation seen on any rank

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class P2PResult:
    """Send/recv ring: each rank sends to rank+1 and receives from rank-1 at the same time."""

    world: int
    nbytes: int
    latency_us: float        # one hop of a small message, slowest rank
    bandwidth_gbs: float     # payload bytes / time of one hop of the large message
    correct: bool
    bad_ranks: list[int]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _sync(device: Any) -> None:
    import torch

    if getattr(device, "type", str(device)) == "cuda":
        torch.cuda.synchronize(device)


def _gather_flags(ok: bool, err: float, elapsed: float, device: Any,
                  group: Any = None) -> tuple[list[int], float, float]:
    """(bad ranks, max error, max time) over the group, from each rank's own figures."""
    import torch
    import torch.distributed as dist

    n = dist.get_world_size(group)
    mine = torch.tensor([0.0 if ok else 1.0, err, elapsed], dtype=torch.float64, device=device)
    everyone = [torch.empty_like(mine) for _ in range(n)]
    dist.all_gather(everyone, mine, group=group)
    rows = [t.cpu().tolist() for t in everyone]
    bad = [r for r, row in enumerate(rows) if row[0] > 0.5]
    return bad, max(row[1] for row in rows), max(row[2] for row in rows)


def bench_collective(op: str, nbytes: int, *, device: Any, group: Any = None, warmup: int = 1,
                     iters: int = 5) -> CollectiveResult:
    """Check then time collective `op` on float32 buffers of about `nbytes` (see module doc)."""
    import torch
    import torch.distributed as dist

    n = dist.get_world_size(group)
    rank = dist.get_rank(group)
    busbw_factor(op, n)  # validates op
    # Element count: a multiple of n so every chunk has the same size.
    count = max(n, (nbytes // 4) // n * n)
    chunk = count // n
    f32 = dict(dtype=torch.float32, device=device)

    # Small integers are exact in float32, so the checks below compare with ==.
    if op == "all_reduce":
        x = torch.full((count,), float(rank + 1), **f32)
        dist.all_reduce(x, group=group)
        want = torch.full_like(x, n * (n + 1) / 2)
        out = x
        buf = torch.zeros(count, **f32)  # timed on zeros: repeated sums cannot overflow

        def call() -> None:
            dist.all_reduce(buf, group=group)
    elif op == "all_to_all":
        # Chunk j of rank r holds r*n + j; after the exchange chunk s holds s*n + rank.
        src = (rank * n + torch.arange(n, **f32)).repeat_interleave(chunk)
        out = torch.empty_like(src)
        dist.all_to_all_single(out, src, group=group)
        want = (torch.arange(n, **f32) * n + rank).repeat_interleave(chunk)
        dst = torch.empty_like(src)

        def call() -> None:
            dist.all_to_all_single(dst, src, group=group)
    elif op == "all_gather":
        src = torch.full((chunk,), float(rank), **f32)
        out = torch.empty(count, **f32)
        dist.all_gather_into_tensor(out, src, group=group)
        want = torch.arange(n, **f32).repeat_interleave(chunk)
        dst = torch.empty_like(out)

        def call() -> None:
            dist.all_gather_into_tensor(dst, src, group=group)
    elif op == "reduce_scatter":
        # Chunk j of every rank holds j + 1; the sum of chunk `rank` over n ranks is n(rank+1).
        src = (torch.arange(n, **f32) + 1).repeat_interleave(chunk)
        out = torch.empty(chunk, **f32)
        dist.reduce_scatter_tensor(out, src, group=group)
        want = torch.full_like(out, float(n * (rank + 1)))
        dst = torch.empty_like(out)

        def call() -> None:
            dist.reduce_scatter_tensor(dst, src, group=group)
    else:
        raise ValueError(f"no benchmark for {op!r}; known: {', '.join(OPS)}")

    _sync(device)
    err = float((out - want).abs().max().item()) if out.numel() else 0.0
    ok = bool(torch.isfinite(out).all().item()) and err == 0.0
    for _ in range(warmup):
        call()
    _sync(device)
    dist.barrier(group=group)
    t0 = time.perf_counter()
    for _ in range(iters):
        call()
    _sync(device)
    elapsed = (time.perf_counter() - t0) / max(1, iters)
    bad, max_err, t = _gather_flags(ok, err, elapsed, device, group)
    size = count * 4
    algbw = size / t / 1e9 if t > 0 else float("inf")
    return CollectiveResult(op=op, nbytes=size, world=n, time_s=t, algbw_gbs=algbw,
                            busbw_gbs=bus_bandwidth(op, algbw, n), correct=not bad,
                            bad_ranks=bad, max_error=max_err)


def bench_p2p_ring(nbytes: int, *, device: Any, group: Any = None, latency_iters: int = 50,
                   iters: int = 3) -> P2PResult:
    """Send/recv ring (rank r -> r+1): check a patterned payload, time small and large hops."""
    import torch
    import torch.distributed as dist

    n = dist.get_world_size(group)
    rank = dist.get_rank(group)
    if n < 2:
        raise ValueError("a send/recv ring needs at least 2 ranks")
    nxt, prv = (rank + 1) % n, (rank - 1) % n
    if group is not None:
        nxt, prv = dist.get_global_rank(group, nxt), dist.get_global_rank(group, prv)

    def hop(send: Any, recv: Any) -> None:
        ops = [dist.P2POp(dist.isend, send, nxt, group), dist.P2POp(dist.irecv, recv, prv, group)]
        for req in dist.batch_isend_irecv(ops):
            req.wait()

    # Integrity: the payload of rank s is (arange + 7*s) mod 65521, exact in float32.
    count = max(1, nbytes // 4)
    base = torch.arange(count, dtype=torch.float64)
    payload = torch.remainder(base + 7 * rank, 65521).to(torch.float32).to(device)
    recv = torch.empty_like(payload)
    hop(payload, recv)
    _sync(device)
    want = torch.remainder(base + 7 * ((rank - 1) % n), 65521).to(torch.float32).to(device)
    ok = bool(torch.equal(recv, want))

    small_s, small_r = torch.zeros(2, device=device), torch.empty(2, device=device)
    hop(small_s, small_r)
    _sync(device)
    def seconds_per_hop(send, into, reps: int) -> float:
        dist.barrier(group=group)
        t0 = time.perf_counter()
        for _ in range(reps):
            hop(send, into)
        _sync(device)
        return (time.perf_counter() - t0) / max(1, reps)

    lat = seconds_per_hop(small_s, small_r, latency_iters)
    big = seconds_per_hop(payload, recv, iters)

    bad, _, lat_max = _gather_flags(ok, 0.0, lat, device, group)
    _, _, big_max = _gather_flags(ok, 0.0, big, device, group)
    bw = count * 4 / big_max / 1e9 if big_max > 0 else float("inf")
    return P2PResult(world=n, nbytes=count * 4, latency_us=lat_max * 1e6, bandwidth_gbs=bw,
                     correct=not bad, bad_ranks=bad)
