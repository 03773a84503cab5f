"""Measurements among local processes (gloo): collectives' alpha-beta points and fits, and what
FSDP2 costs per unit and around myria's own block, for the CPU profile (`measure.cpu`)."""

from __future__ import annotations

import dataclasses
import statistics
import time

from myria.sim.operators import LayerShape

GLOO_SIZES = (1 << 16, 1 << 21, 1 << 24)   # 64 KiB, 2 MiB, 16 MiB per rank
GLOO_OPS = ("all_reduce", "all_gather", "reduce_scatter")


def fit_alpha_bw(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares t = alpha + x / bw over (x, t); alpha >= 0."""
    n = len(points)
    mx = sum(x for x, _ in points) / n
    mt = sum(t for _, t in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    slope = sum((x - mx) * (t - mt) for x, t in points) / sxx if sxx else 0.0
    if slope <= 0:
        x, t = max(points)
        return 0.0, x / t
    alpha = mt - slope * mx
    if alpha < 0:
        alpha = 0.0
        slope = sum(x * t for x, t in points) / sum(x * x for x, _ in points)
    return alpha, 1.0 / slope


def fsdp_in_context(world: int, shape: LayerShape, repeats: int = 5) -> list[float]:
    """What FSDP2 adds to myria's own block and model ends, measured around their compute.

    Both processes run one block of this shape forward + backward (then the ends: embedding,
    final norm, loss) at the same time, first unsharded, then sharded as
    `parallel/parallelize.apply_fsdp` shards them (the block resharded after forward under a
    root; the ends as the root, kept after forward), gradient sync off (a non-last
    microbatch) and on (the last one). Returns [block per microbatch, block reduce per step,
    ends per microbatch, ends reduce per step] in seconds: sharded minus unsharded, and sync on
    minus off. Unlike `fsdp_unit_points` this includes what the gathers, copies and gloo's
    threads cost the compute they run beside, as in training.
    """
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from myria.models.transformer import build_model

    mesh = init_device_mesh("cpu", (world,))
    cfg = dataclasses.replace(shape.model_config(), layers=1)
    b, s = shape.micro_batch, shape.seq_len
    g = torch.Generator().manual_seed(0)
    x = torch.randn(b, s, cfg.hidden, generator=g, requires_grad=True)
    dy = torch.randn(b, s, cfg.hidden, generator=g)
    tokens = torch.randint(0, cfg.vocab_size, (b, s), generator=g)

    class Holder(nn.Module):
        def __init__(self, block: nn.Module, rope):
            super().__init__()
            self.block, self.rope = block, rope

        def forward(self, inp):
            return self.block(inp, self.rope)

    def block_module(sharded: bool) -> nn.Module:
        model = build_model(cfg, "cpu")
        model.init_weights(0)
        rope = model.rope_tables_for(s, torch.float32) if cfg.arch == "llama" else None
        m = Holder(model.layers["0"], rope)
        if sharded:
            fully_shard(m.block, mesh=mesh, reshard_after_forward=True)
            fully_shard(m, mesh=mesh)
        return m

    def ends_module(sharded: bool) -> nn.Module:
        model = build_model(cfg, "cpu")
        model.init_weights(0)
        model.layers = nn.ModuleDict()
        if sharded:
            fully_shard(model, mesh=mesh, reshard_after_forward=False)
        return model

    def run_block(m) -> None:
        m(x).backward(dy)

    def run_ends(m) -> None:
        if shape.ce_chunk:
            m(tokens, tokens).backward()
        else:
            F.cross_entropy(m(tokens).flatten(0, 1), tokens.flatten()).backward()

    def timed(fn, m, sync=None) -> float:
        if sync is not None:
            m.set_requires_gradient_sync(sync)
        dist.barrier()
        t0 = time.perf_counter()
        fn(m)
        return time.perf_counter() - t0

    out: list[float] = []
    for make, fn in ((block_module, run_block), (ends_module, run_ends)):
        plain, sharded = make(False), make(True)
        timed(fn, plain)
        timed(fn, sharded, False)
        base, off, on = [], [], []
        for _ in range(repeats):   # interleaved, so that drifts hit all three alike
            base.append(timed(fn, plain))
            off.append(timed(fn, sharded, False))
            on.append(timed(fn, sharded, True))
            for p in sharded.parameters():
                p.grad = None
        med = statistics.median
        out += [max(0.0, med(off) - med(base)), max(0.0, med(on) - med(off))]
    return out


def fsdp_unit_points(world: int, units: tuple, repeats: int = 7) -> list:
    """(unit bytes, block s, root s, reduce s) of FSDP2 as myria applies it, per unit size.

    Each unit is one fp32 parameter `fully_shard`-ed over the `world` local processes under an
    (empty) FSDP root, as myria shards each block under the model's root
    (`parallel/parallelize.apply_fsdp`); its forward is a trivial (w * x).sum(). Timed per
    forward + backward, against the same module unsharded:

    - block: resharded after forward, gradient sync off (a non-last microbatch): the forward
      and backward all-gathers with their copy-in/copy-out, the hooks and the frees;
    - root: kept unsharded after forward (myria's root when pp = 1): one all-gather;
    - reduce: gradient sync on minus off (the last microbatch): chunk_cat copy-in, gloo
      reduce-scatter, division and the sharded gradient.

    Times are not linear in the size: an unsharded parameter is freed at reshard and allocated
    again at unshard, and above the allocator's mmap threshold that means fresh pages every
    time; so the model's own unit sizes are measured and interpolated between.
    """
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    class Unit(nn.Module):
        def __init__(self, numel: int):
            super().__init__()
            self.w = nn.Parameter(torch.zeros(numel // 1024, 1024))

        def forward(self, x):
            return (self.w * x).sum()

    class Root(nn.Module):
        def __init__(self, unit: nn.Module):
            super().__init__()
            self.unit = unit

        def forward(self, x):
            return self.unit(x)

    mesh = init_device_mesh("cpu", (world,))
    x = torch.ones(())

    def timed(m, sync=None) -> float:
        if sync is not None:
            m.set_requires_gradient_sync(sync)
        dist.barrier()
        t0 = time.perf_counter()
        m(x).backward()
        return time.perf_counter() - t0

    pts = []
    for nbytes in units:
        numel = max(world * 1024, nbytes // 4 // (1024 * world) * 1024 * world)
        plain = Root(Unit(numel))
        t_plain = statistics.median(timed(plain) for _ in range(repeats))
        res = {}
        for reshard in (True, False):
            m = Root(Unit(numel))
            fully_shard(m.unit, mesh=mesh, reshard_after_forward=reshard)
            fully_shard(m, mesh=mesh)
            off, on = [], []
            for _ in range(repeats):
                off.append(timed(m, False))
                on.append(timed(m, True))
                m.unit.w.grad = None
            res[reshard] = (statistics.median(off[1:]), statistics.median(on[1:]))
        pts.append((nbytes, max(0.0, res[True][0] - t_plain), max(0.0, res[False][0] - t_plain),
                    max(0.0, res[True][1] - res[True][0])))
    return pts


def gloo_points(world: int, sizes: tuple = GLOO_SIZES, repeats: int = 5) -> dict:
    """(bus bytes, seconds) per size for each collective, and (bytes, seconds) of send/recv.

    Medians over `repeats` timings of 3 calls each (`measure.collective`: slowest rank's mean).
    """
    import torch

    from myria.sim.measure.collective import bench_collective, bench_p2p_ring, busbw_factor

    cpu = torch.device("cpu")
    raw: dict[str, list] = {}
    for op in GLOO_OPS:
        raw[op] = [(size * busbw_factor(op, world), statistics.median(
            bench_collective(op, size, device=cpu, warmup=1, iters=3).time_s
            for _ in range(repeats))) for size in sizes]
    raw["p2p"] = [(float(size), statistics.median(
        size / (bench_p2p_ring(size, device=cpu, latency_iters=5, iters=3).bandwidth_gbs * 1e9)
        for _ in range(repeats))) for size in sizes]
    return raw
