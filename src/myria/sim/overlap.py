"""What communication costs beside its transfer: data-parallel buckets and what of them stays
exposed behind compute, the slowdown of compute that hides a collective, and the wait for the
slowest of the ranks that synchronise (the step model's rules: docs/performance_model.md,
"Overlap rules" and "Costs that grow with the ranks that synchronise")."""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

from myria.sim import collectives as coll
from myria.sim.hardware import Hardware

BUCKET_PARAMS = 40e6          # Megatron-Core DDP's smallest bucket (parameters)


BUCKET_PARAMS_PER_RANK = 1e6  # ... growing with the data-parallel ranks: max(40M, 1M x dp)


# Slowdown of compute while communication hides behind it, as a share of the hidden time, on a
# device whose SMs are not known (overlap_interference prices the others). A prior, not fitted.
OVERLAP_INTERFERENCE = 0.10


# -- helpers -------------------------------------------------------------------------------
def chunked_exposed(t: float, n: int, t_hide: float) -> float:
    """Exposed time of a collective cut into n chunks pipelined against t_hide of compute."""
    n = max(1, n)
    return t / n + max(0.0, t * (n - 1) / n - t_hide)


@dataclass(frozen=True)
class Buckets:
    """A data-parallel collective cut into buckets, run one after another: the serial time of
    all of them (`total`), the time of the one that finishes last (`last`), and how many."""

    total: float = 0.0
    last: float = 0.0
    n: int = 1

    def __add__(self, o: Buckets) -> Buckets:
        return Buckets(self.total + o.total, max(self.last, o.last), self.n + o.n)

    def scaled(self, share: float) -> Buckets:
        """The share of the buckets that one interleaved chunk holds."""
        n = max(1, round(self.n * share))
        return Buckets(self.total * share, min(self.last, self.total * share), n)


def bucketed(fn, params: float, bytes_per: float, grp: coll.Group, bucket: float
             ) -> Buckets:
    """`params` parameters' collective `fn` over `grp` in buckets of `bucket` parameters."""
    if params <= 0 or grp.n <= 1:
        return Buckets()
    n = max(1, math.ceil(params / bucket - 1e-9))
    t = fn(params / n * bytes_per, grp)[0]
    return Buckets(n * t, t, n)


def dp_bucket_params(dp: int) -> float:
    """Parameters per gradient bucket of Megatron-Core's DistributedDataParallel when it
    overlaps: max(40M, 1M x the data-parallel ranks), so that a bucket's bandwidth term
    outweighs its latency over many ranks."""
    return max(BUCKET_PARAMS, BUCKET_PARAMS_PER_RANK * dp)


def megatron_buckets(fn, dense: float, expert: float, bytes_per: float, grps: tuple,
                     bucket: float) -> Buckets:
    """Dense and expert parameters (over their own groups) in Megatron-Core's buckets."""
    return bucketed(fn, dense, bytes_per, grps[0], bucket) + \
        bucketed(fn, expert, bytes_per, grps[1], bucket)


def fsdp_buckets(fn, dense: float, expert: float, layers: float, block: tuple,
                 bytes_per: float, grps: tuple) -> Buckets:
    """FSDP's collectives, one per wrapped unit: `layers` transformer blocks (`block`: dense,
    expert parameters each) and the root (what the stage holds beyond its blocks: embedding,
    final norm, head). The root's collective runs first in forward and last in backward, next
    to the first block's, so both are exposed together (`last`)."""
    if grps[0].n <= 1 and grps[1].n <= 1:
        return Buckets()
    units = max(1, round(layers))
    one = (fn(block[0] * bytes_per, grps[0])[0] if block[0] > 0 else 0.0) + \
        (fn(block[1] * bytes_per, grps[1])[0] if block[1] > 0 else 0.0)
    root = max(0.0, dense - layers * block[0]) + max(0.0, expert - layers * block[1])
    t_root = fn(root * bytes_per, grps[0])[0] if root > 1 else 0.0
    return Buckets(units * one + t_root, one + t_root, units + (1 if t_root else 0))


def buckets_exposed(b: Buckets, hide: float) -> float:
    """Exposed time of buckets that become final evenly over `hide` seconds of compute (the last
    when it ends) and run one after another: max(last bucket, total - hide (n - 1) / n)."""
    if b.total <= 0:
        return 0.0
    return min(b.total, max(b.last, b.total - hide * (b.n - 1) / b.n))


def grad_reduce_exposed(b: Buckets, b_last: float, pp: int, v: int) -> float:
    """Exposed time of a once-per-step gradient reduction (buckets `b`) on the first pipeline
    rank (the last to finish), overlapped with backward (Megatron-LM's overlap_grad_reduce:
    a bucket is reduced as soon as its gradients are final).

    One chunk per rank: the buckets reduce during the last microbatch's backward (`b_last`),
    the last bucket after it (`buckets_exposed`). Interleaved (v chunks, each its own buckets,
    MegaScale 3.2's "overlapping on a model chunk basis"): Megatron's order ends with groups
    of pp backwards per chunk, chunk v-1 first, so chunk j >= 1 is final j x G before the end
    (G = pp x b_last / v). Its share r = t (v-1)/v / (v-1) queues on one communication stream:
    the last of them ends max(0, (v-1)(r - G)) after the backward; chunk 0's share then follows
    the bucket rule behind its own last backward (b_last / v). Mirrored, the same holds for the
    updated parameters' all-gather before the first forwards (Megatron's overlap_param_gather:
    chunk j's parameters are needed j x G after the start), with `b_last` the first
    microbatch's forward."""
    if pp <= 1 or v <= 1:
        return buckets_exposed(b, b_last)
    own = b.scaled(1 / v)
    r = (b.total - own.total) / (v - 1)
    return (v - 1) * max(0.0, r - pp * b_last / v) + buckets_exposed(own, b_last / v)


@lru_cache(maxsize=4096)
def overlap_interference(hw: Hardware, mem_share: float, grp: coll.Group, sms_taken: int = 0
                         ) -> float:
    """Extra compute time per second of `grp`'s communication hidden behind it (module
    docstring): s / (1 - s) with s = the SMs the communication holds (`sms_taken`, else NCCL's
    channels, one thread block each) over the device's SMs, plus the memory-bound share of the
    compute (`mem_share`) slowed by the HBM bandwidth the collective takes (its per-rank bus
    rate x NCCL_HBM_BYTES_PER_WIRE_BYTE of the device's). TransformerEngine's ring exchange
    (`initialize_ub` defaults: num_sm 1, use_ce) moves its chunks by copy engine: one SM."""
    from myria.sim.hardware import NCCL_CHANNELS, NCCL_HBM_BYTES_PER_WIRE_BYTE, SM_COUNT

    sms = SM_COUNT.get(hw.device)
    if not sms or hw.cpu is not None:
        return OVERLAP_INTERFERENCE
    s = (sms_taken or NCCL_CHANNELS) / sms
    hbm = min(0.9, NCCL_HBM_BYTES_PER_WIRE_BYTE * grp.ring_busbw / hw.mem_bw) \
        if grp.n > 1 else 0.0
    return s / (1 - s) + mem_share * hbm / (1 - hbm)


@lru_cache(maxsize=1024)
def expected_max_normal(n: int) -> float:
    """E[max] of n independent standard normal variables (Blom's approximation,
    Phi^-1((n - 0.375) / (n + 0.25)); 0 for one)."""
    if n <= 1:
        return 0.0
    from statistics import NormalDist

    return NormalDist().inv_cdf((n - 0.375) / (n + 0.25))


def sync_wait(hw: Hardware, compute_s: float) -> float:
    """What the slowest of the ranks that synchronise costs a step: every rank waits, at each
    step's data-parallel collective (and each layer's tensor-parallel one, each microbatch's
    pipeline exchange), for the slowest of all `hw.gpus`; with their compute times spread
    independently by `hw.jitter` (ClusterSpec.rank_jitter: sigma, a share of `compute_s`, and
    the straggler tail) the step takes sigma x `expected_max_jitter` x compute_s longer. 0 on a
    measured device (the CPU self-check: its few local processes are measured as they run)."""
    if hw.cpu is not None or hw.measured:
        return 0.0
    sigma, share, excess = hw.jitter
    return sigma * expected_max_jitter(hw.gpus, share, excess) * compute_s


@lru_cache(maxsize=1024)
def expected_max_jitter(n: int, tail_share: float = 0.0, tail_excess: float = 0.0) -> float:
    """E[max] of n independent draws of a rank's step-time deviation, in units of its spread:
    a standard normal core (`expected_max_normal` when there is no tail), to which a share
    `tail_share` of the draws adds an exponential delay of mean `tail_excess` (the straggler
    tail). With the tail, E[max] = integral of 1 - F(x)^n over x > 0 less that of F(x)^n over
    x < 0, F the mixture's CDF, integrated numerically; it grows like tail_excess x ln(n x
    tail_share) once n x tail_share >> 1, against sqrt(2 ln n) for the normal core."""
    if n <= 1:
        return 0.0
    if tail_share <= 0 or tail_excess <= 0:
        return expected_max_normal(n)
    import numpy as np
    from scipy.special import log_ndtr, ndtr

    top = 8.0 + tail_excess * (math.log(max(2.0, n * tail_share)) + 30.0)
    x = np.linspace(-8.0, top, 200001)
    # the normal core, and the core plus an Exp(mean tail_excess) delay (exponentially
    # modified Gaussian)
    lam = 1.0 / tail_excess
    tail = ndtr(x) - np.exp(lam * lam / 2 - lam * x + log_ndtr(x - lam))
    cdf = (1 - tail_share) * ndtr(x) + tail_share * tail
    fn = np.exp(n * np.log(np.clip(cdf, 1e-300, 1.0)))
    dx = x[1] - x[0]
    return float(np.sum(np.where(x > 0, 1 - fn, -fn)) * dx)


def exchange_wait(hw: Hardware, fwd: float, bwd: float, pp: int, v: int) -> float:
    """Seconds per microbatch a pipeline rank waits for its neighbours when its sends and
    receives are bundled and blocking (Megatron-LM without overlap_p2p_comm: an exchange ends
    only when both neighbours have posted theirs), with each operation's time spread
    independently by `hw.jitter`'s sigma (a share of the operation's time, the rank-jitter prior
    at the grain of one chunk; the straggler tail is not applied here). In the interleaved
    steady state every exchange follows one forward and one backward chunk, so the ranks move
    in lockstep around the ring of stages (the last stage feeds the first's next chunk), each
    step taking `lockstep_rate`(pp) x the spread of one chunk pair longer than its mean:
    sigma x rate x sqrt(F^2 + B^2) / v per exchange, v exchanges per microbatch.
    `bench/sim_pp_exchange.py` replays Megatron's order with the spread: the closed form is
    within ~10% of the replay, asynchronous sends (overlap.pp) lose almost nothing to the same
    spread, and with one chunk per rank (1F1B) the bundling adds nothing beyond the schedule's
    own dependencies, so v = 1 is charged nothing. 0 on a measured device, as `sync_wait`."""
    if pp <= 1 or v <= 1 or hw.cpu is not None or hw.measured:
        return 0.0
    return hw.jitter[0] * lockstep_rate(pp) * math.hypot(fwd, bwd)


@lru_cache(maxsize=256)
def lockstep_rate(n: int) -> float:
    """Mean growth per exchange, in units of one step's spread, of n ranks in a ring that each
    wait for both neighbours at every exchange: t_i <- max(t_i-1, t_i, t_i+1) + Z_i, Z standard
    normal. 1/sqrt(pi) for two ranks, E[max of 3] = 0.85 for three, rising towards ~1.14
    (last-passage percolation, no closed form: simulated once per n, 32 rings x 2,000
    exchanges, a fixed seed, +-1%)."""
    if n <= 1:
        return 0.0
    import numpy as np

    rng = np.random.default_rng(0)
    steps, rings = 2000, 32
    z = rng.standard_normal((steps, rings, n))   # the same draws, step after step
    u = np.zeros((rings, n + 2))    # each ring's times t between its wrap-around neighbours
    t = u[:, 1:-1]
    for k in range(steps):
        u[:, 0], u[:, -1] = t[:, -1], t[:, 0]
        np.maximum(np.maximum(u[:, :-2], t), u[:, 2:], out=t)
        t += z[k]
    return float(t.mean() / steps)


def comm_cost(t: float, exposed: float, kappa: float = OVERLAP_INTERFERENCE) -> float:
    """Time a collective adds: its exposed part plus the interference of its hidden part
    (`kappa` seconds of slowed compute per second hidden: `overlap_interference`)."""
    return exposed + kappa * max(0.0, t - exposed)
