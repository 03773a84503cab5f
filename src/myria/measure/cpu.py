"""Measuring this CPU for the simulator's "cpu" device: the physics of the self-check.

This part runs torch, the trainer's model and the doctor's collective bench; it sits above the
trainer and hands its figures to the analytic model through the cache that
`myria.sim.cpu_profile` reads (the model itself never measures, so `--dry-run` calls downward).
It measures each kernel as the trainer will run it: `nproc` processes at once, each with the
threads the trainer gives it (`myria.train.distributed.set_cpu_threads`), and caches the figures
in `myria.device.cache_dir() / "cpu_profile.json"` under `myria.device.cpu_key(threads)` and the
number of processes: GEMM rates per shape and operand layout (nt, nn, tn, tna), SDPA forward and
backward rates, eager bandwidths of one block's and the model's ends' elementwise kernels plus a
generic figure, host time per block, kernel dispatch overhead, the clip + AdamW step per
parameter, and (several processes) gloo's alpha and bus bandwidth per collective, send/receive,
and FSDP2's unit all-gather. Times are medians; compute is timed on the thread's CPU clock with
one thread per process (`compute_clock`), else on the wall clock, collectives always on the
wall clock. Shapes the table lacks are interpolated (`op_timing.measured_rate`); GEMMs above
GEMM_FLOP_CAP are measured halved. What each figure is and why it is timed so:
docs/performance_model.md, "Reasons behind the simulator modules".
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import statistics
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from myria.errors import ConfigError
from myria.sim.cpu_profile import (  # noqa: F401  (the cache's names, used here and by tests)
    CpuProfile,
    compute_key,
    default_threads,
    eager_key,
    gloo_key,
    key_str,
    key_tuple,
    load_profile,
    read_cache,
    update_cache,
    write_cache,
)
from myria.sim.op_timing import rate_key
from myria.sim.operators import (
    LayerShape,
    Op,
    head_ops,
    layer_ops,
)

GEMM_FLOP_CAP = 4e9          # larger GEMMs are measured on a halved shape (asymptotic rate)
ATTN_FLOP_CAP = 4e9
MEASURE_SECONDS = 0.15       # per shape: median of the calls made in this time (at least 5)
GLOO_SIZES = (1 << 16, 1 << 21, 1 << 24)   # 64 KiB, 2 MiB, 16 MiB per rank
GLOO_OPS = ("all_reduce", "all_gather", "reduce_scatter")
FSDP_SIZES = (1 << 18, 1 << 23)   # parameters per FSDP unit besides the model's (1, 32 MiB fp32)
PARAM_TENSOR_BYTES = 1 << 24               # parameter-sized passes: 16 MiB tensors
# Sustained compute before measuring: the trainer's step times are read after its warm-up steps,
# when the machine has been busy for seconds; on this VM a GEMM run straight after an idle spell
# is up to 25% slower than a minute into training (bench/RESULTS_selfcheck.md probes), and a
# 5 s measurement would sit entirely in that slow phase
WARMUP_SECONDS = 4.0
# A single measuring process times its block and its ends for at least this long each (several
# processes time 5 barrier-synchronised repeats, which already last 20-30 s in all): medians
# over a few seconds sample this VM's drifting speed better than five back-to-back runs
IN_SITU_SECONDS = 3.0


# -- what a model runs ----------------------------------------------------------------------------
def shape_ops(shape: LayerShape, pp: int = 1) -> list[Op]:
    """Every GEMM and attention op a model of `shape` runs on any of `pp` pipeline stages."""
    ops = [op for op in layer_ops(shape) if op.kind in ("gemm", "attn")]
    ends = [(True, True)] if pp == 1 else [(True, False), (False, True)]
    for first, last in ends:
        ops += [op for op in head_ops(shape, first, last) if op.kind in ("gemm", "attn")]
    return ops


def missing_ops(shape: LayerShape, profile: CpuProfile | None, pp: int = 1) -> list[Op]:
    """Ops of `shape` whose exact rate is not in `profile` (one per key)."""
    have = {k for k, _ in profile.rates} if profile else set()
    have |= {(k[0], k[2], k[1], k[3]) for k in have if len(k) == 4}
    out: dict[tuple, Op] = {}
    for op in shape_ops(shape, pp):
        k = rate_key(op)
        if k not in have:
            out.setdefault(k, op)
    return list(out.values())


def _loadavg() -> float:
    try:
        return os.getloadavg()[0]
    except OSError:
        return float("nan")


# -- measurements (in this process) ---------------------------------------------------------------
def compute_clock(threads: int):
    """The clock compute timings read at `threads` threads per process (see the module's
    docstring): the calling thread's CPU time with one thread, else the wall clock."""
    return time.thread_time if threads == 1 else time.perf_counter


_clock = time.perf_counter   # set by `measure_compute` for its measurements


def _time(fn, seconds: float = MEASURE_SECONDS, min_calls: int = 5) -> float:
    """Median time of `fn` over the calls made in `seconds` (at least `min_calls`)."""
    fn()  # warm-up (allocations, kernel selection)
    times: list[float] = []
    deadline = time.perf_counter() + seconds
    while len(times) < min_calls or time.perf_counter() < deadline:
        t0 = _clock()
        fn()
        times.append(_clock() - t0)
    return statistics.median(times)


def warm_up(seconds: float = WARMUP_SECONDS) -> None:
    """Keep this process's threads busy with GEMMs for `seconds` (see WARMUP_SECONDS)."""
    import torch

    a, b = torch.randn(512, 512), torch.randn(512, 512)
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        torch.mm(a, b)


def _capped(dims: list[int], flops_per_unit: float, cap: float) -> list[int]:
    dims = list(dims)
    while flops_per_unit * math.prod(dims) > cap and max(dims) > 64:
        i = dims.index(max(dims))
        dims[i] = max(64, dims[i] // 2)
    return dims


def measure_gemm(layout: str, m: int, n: int, k: int, seconds: float = MEASURE_SECONDS) -> float:
    """Best achieved FLOP/s of one (M x K) by (K x N) product in `layout` (current threads)."""
    import torch

    m, n, k = _capped([max(1, m), max(1, n), max(1, k)], 2.0, GEMM_FLOP_CAP)
    g = torch.Generator().manual_seed(0)
    if layout == "nt":      # x @ W^T
        a, b = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g).t()
    elif layout == "nn":    # dy @ W
        a, b = torch.randn(m, k, generator=g), torch.randn(k, n, generator=g)
    elif layout in ("tn", "tna"):   # x^T @ dy (weight gradient)
        a, b = torch.randn(k, m, generator=g).t(), torch.randn(k, n, generator=g)
    else:
        raise ValueError(f"unknown GEMM layout {layout!r}")
    if layout == "tna":
        c = torch.zeros(m, n)
        t = _time(lambda: c.addmm_(a, b), seconds)
    else:
        t = _time(lambda: torch.mm(a, b), seconds)
    return 2.0 * m * n * k / t


def measure_attention(op: Op, seconds: float = MEASURE_SECONDS) -> tuple[float, float]:
    """(forward, backward) FLOP/s of causal SDPA with the shape of attention op `op`.

    `op.flops` is the forward's (or backward's, 2.5x) count for `op.batch` heads; the measured
    call runs batch / gqa sequences of gqa query heads sharing one key/value head, with the
    query laid out (b, s, heads, d) and transposed, as `Attention.forward` hands it over.
    """
    import torch
    import torch.nn.functional as F

    s_q, s_kv, d = (int(x) for x in op.dims)
    gqa = max(1, int(op.gqa))
    fwd_flops = op.flops / (2.5 if op.phase == "bwd" else 1.0)
    per_seq = fwd_flops / max(1, op.batch) * gqa
    b = max(1, int(op.batch) // gqa)
    while b > 1 and per_seq * b > ATTN_FLOP_CAP:
        b //= 2
    scale = b * gqa / max(1, op.batch)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(b, s_q, gqa, d, generator=g).transpose(1, 2).requires_grad_()
    k = torch.randn(b, s_kv, 1, d, generator=g).transpose(1, 2).requires_grad_()
    v = torch.randn(b, s_kv, 1, d, generator=g).transpose(1, 2).requires_grad_()
    kw = {"is_causal": True, "enable_gqa": gqa > 1}
    grad = torch.randn(b, gqa, s_q, d, generator=g)
    t_fwd = _time(lambda: F.scaled_dot_product_attention(q, k, v, **kw), seconds)
    times: list[float] = []
    deadline = time.perf_counter() + seconds
    while len(times) < 5 or time.perf_counter() < deadline:
        out = F.scaled_dot_product_attention(q, k, v, **kw)
        t0 = _clock()
        torch.autograd.grad(out, (q, k, v), grad)
        times.append(_clock() - t0)
    return fwd_flops * scale / t_fwd, 2.5 * fwd_flops * scale / statistics.median(times)


def measure_elementwise(nbytes: int, seconds: float = 0.4) -> float:
    """Bytes/s of a mix of eager elementwise kernels on fp32 tensors of `nbytes` each.

    Out-of-place kernels allocate their outputs, as the model's do. Bytes per kernel: inputs
    read + output written (a reduction writes nothing worth counting).
    """
    import torch
    import torch.nn.functional as F

    n = max(1024, nbytes // 4)
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(n, generator=g), torch.randn(n, generator=g)
    w = torch.randn(n, generator=g)
    kernels = [
        (lambda: a * b, 3),
        (lambda: a + b, 3),
        (lambda: a.pow(2), 2),
        (lambda: F.silu(a), 2),
        (lambda: torch.exp(a), 2),
        (lambda: a.sum(), 1),
        (lambda: w.mul_(0.999), 2),
    ]
    t = sum(_time(fn, seconds / len(kernels)) for fn, _ in kernels)
    return 4 * n * sum(p for _, p in kernels) / t


_VIEWS = {"view", "t", "transpose", "_unsafe_view", "expand", "detach", "slice", "unsqueeze",
          "select", "alias", "as_strided", "permute", "squeeze", "_reshape_alias", "empty",
          "empty_like", "lift_fresh"}
_NOT_ELEMENTWISE = {"mm", "addmm", "addmm_", "bmm", "matmul",
                    "_scaled_dot_product_flash_attention_for_cpu",
                    "_scaled_dot_product_flash_attention_for_cpu_backward"}


def _gemm_key(name: str, args: tuple) -> tuple | None:
    """(layout, M, N, K) of an aten mm / addmm / addmm_ call from its operands' strides."""
    if name == "mm":
        x, w = args[0], args[1]
    elif name in ("addmm", "addmm_"):
        x, w = args[1], args[2]
    else:
        return None
    if x.dim() != 2 or w.dim() != 2:
        return None

    def tr(t) -> str:
        return "t" if t.shape[0] > 1 and t.stride(0) == 1 else "n"
    layout = tr(x) + tr(w) + ("a" if name == "addmm_" else "")
    return (layout, int(x.shape[0]), int(w.shape[1]), int(x.shape[1]))


class _Trace:
    """Per-call timings of one traced run: elementwise bytes and seconds, GEMMs, SDPA."""

    def __init__(self) -> None:
        self.bytes = 0
        self.seconds = 0.0
        self.gemm: dict[tuple, list[float]] = {}
        self.sdpa: dict[str, list[float]] = {"fwd": [], "bwd": []}


def _timed_trace(fn, repeats: int = 5, after=None, before=None,
                 min_seconds: float = 0.0) -> list[_Trace]:
    """Run `fn` under a timing dispatch mode `repeats` times, and on until `min_seconds` have
    passed when there is no `before` (after a warm-up; `after()` after each); one _Trace each.

    Each aten call that is not a view is timed on its own (the mode's bookkeeping stays outside
    the timed region): GEMMs by (layout, M, N, K), SDPA forward and backward, and every other
    kernel as elementwise, with its bytes counted as inputs read + output written (in-place:
    inputs only), the convention of the eager byte counts in `operators` (the tests check that
    the counts agree).
    """
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    def nbytes(x) -> int:
        return sum(t.numel() * t.element_size() for t in tree_leaves(x)
                   if isinstance(t, torch.Tensor))

    cur = [_Trace()]

    class Timed(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket.__name__
            if name in _VIEWS:
                return func(*args, **(kwargs or {}))
            t0 = _clock()
            out = func(*args, **(kwargs or {}))
            dt = _clock() - t0
            tr = cur[0]
            if name.startswith("_scaled_dot_product"):
                tr.sdpa["bwd" if name.endswith("backward") else "fwd"].append(dt)
            elif name in _NOT_ELEMENTWISE:
                key = _gemm_key(name, args)
                if key:
                    tr.gemm.setdefault(key, []).append(dt)
            else:
                tr.seconds += dt
                tr.bytes += nbytes((args, kwargs)) + (0 if name.endswith("_") else nbytes(out))
            return out

    fn(None)  # warm-up
    traces = []
    deadline = time.perf_counter() + min_seconds
    # with `before` (a barrier among processes) every process must run the same count
    while len(traces) < repeats or (before is None and time.perf_counter() < deadline):
        if before is not None:
            before()
        cur[0] = _Trace()
        fn(Timed)
        traces.append(cur[0])
        if after is not None:
            after()
    return traces


def measure_in_situ(shape: LayerShape, sync=None) -> dict | None:
    """Rates of myria's own kernels, timed one by one while the model runs at this shape.

    Runs `myria.models.transformer` itself: one block forward + backward, then the ends
    (embedding, final norm and loss: the fused chunked one when `shape.ce_chunk`, else logits
    and F.cross_entropy as the pipeline's last stage computes them), under `_timed_trace`.
    Returns {"rates": {key: FLOP/s}, "eager_bw": (block bytes/s, ends bytes/s)}: GEMMs by
    (layout, M, N, K) and SDPA by the simulator's keys, each the FLOPs of one call over the
    median time of its calls; elementwise bandwidth as the median run's bytes over seconds.
    Operands are in the cache state the model leaves them in, which isolated calls are not.
    None when an activation would exceed 64 MiB (then only isolated kernels are measured).
    """
    import contextlib

    import torch
    import torch.nn.functional as F

    from myria.models.transformer import build_model

    cfg = dataclasses.replace(shape.model_config(), layers=1)
    b, s = shape.micro_batch, shape.seq_len
    if 4 * b * s * max(shape.hidden, shape.ffn) > (1 << 26):
        b = 1
        if 4 * s * max(shape.hidden, shape.ffn) > (1 << 26):
            return None
    model = build_model(cfg, "cpu")
    model.init_weights(0)
    block = model.layers["0"]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(b, s, cfg.hidden, generator=g, requires_grad=True)
    rope = model.rope_tables_for(s, torch.float32) if cfg.arch == "llama" else None
    dy = torch.randn(b, s, cfg.hidden, generator=g)

    def mode(cls):
        return cls() if cls else contextlib.nullcontext()

    def run_block(cls):
        with mode(cls):
            y = block(x, rope)
            y.backward(dy)

    model.layers = torch.nn.ModuleDict()   # the ends only: embedding, final norm, head
    tokens = torch.randint(0, cfg.vocab_size, (b, s), generator=g)

    def run_head(cls):
        with mode(cls):
            if shape.ce_chunk:
                loss = model(tokens, tokens)
            else:
                logits = model(tokens)
                loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens.flatten())
            loss.backward()

    walls: dict[str, list[float]] = {"block": [], "head": []}

    def untraced(name: str, fn) -> None:
        t0 = _clock()
        fn(None)
        walls[name].append(_clock() - t0)
    # each traced run is followed by an untraced one, so that drifts of the machine's speed
    # do not pass for host time
    # `sync` (a barrier among the measuring processes) starts every repeat together
    block_runs = _timed_trace(run_block, after=lambda: untraced("block", run_block),
                              before=sync, min_seconds=IN_SITU_SECONDS)
    head_runs = _timed_trace(run_head, after=lambda: untraced("head", run_head), before=sync,
                             min_seconds=IN_SITU_SECONDS)
    rates: dict[str, float] = {}
    for runs in (block_runs, head_runs):
        for key in runs[0].gemm:
            times = [t for r in runs for t in r.gemm.get(key, [])]
            _, m, n, k = key
            rates[key_str(key)] = 2.0 * m * n * k / statistics.median(times)
    sdpa = [o for o in layer_ops(dataclasses.replace(shape, micro_batch=b))
            if o.kind == "attn"]
    for op in sdpa:
        times = [t for r in block_runs for t in r.sdpa[op.phase]]
        if times:
            rates[key_str(rate_key(dataclasses.replace(op, batch=shape.micro_batch *
                                                          shape.heads)))] = \
                op.flops / statistics.median(times)

    def bw(runs: list[_Trace]) -> float:
        r = sorted(runs, key=lambda r: r.seconds)[len(runs) // 2]
        return r.bytes / r.seconds if r.seconds else 0.0

    def kernels(r: _Trace) -> float:
        return r.seconds + sum(sum(v) for v in r.gemm.values()) + sum(r.sdpa["fwd"]) + \
            sum(r.sdpa["bwd"])
    # host time: an untraced run's wall time minus the kernels of the traced run before it
    # (Python, autograd and module calls between kernels), median over the pairs
    scale = shape.micro_batch / b
    for name, runs in (("block", block_runs), ("head", head_runs)):
        gaps = [w - kernels(r) for w, r in zip(walls[name], runs)]
        rates[key_str(("host", name))] = max(0.0, statistics.median(gaps)) * scale
    return {"rates": rates, "eager_bw": (bw(block_runs), bw(head_runs))}


def measure_kernel_overhead() -> float:
    """Seconds of one tiny eager kernel (dispatch, allocation, no work)."""
    import torch

    a, b = torch.ones(16), torch.ones(16)

    def ten():
        for _ in range(10):
            a * b
    return _time(ten, 0.1, min_calls=20) / 10


def measure_optimizer(n_params: int = 1 << 23, tensor_numel: int = 1 << 20) -> float:
    """Seconds per parameter of myria's step tail: gradient clip, then AdamW (foreach)."""
    import torch
    from torch import nn

    from myria.config import OptimizerConfig
    from myria.optim import build_optimizer
    from myria.parallel.expert import clip_grad_norm_

    cols = 1024
    rows = max(1, tensor_numel // cols)
    k = max(1, n_params // (rows * cols))
    model = nn.ParameterList([nn.Parameter(torch.randn(rows, cols) * 0.02) for _ in range(k)])
    opt = build_optimizer(model, OptimizerConfig())
    for p in model:
        p.grad = torch.randn_like(p)

    def step():
        clip_grad_norm_(list(model), 1.0, foreach=True)
        opt.step()
    return _time(step, 0.5) / (k * rows * cols)


def measure_compute(shape: LayerShape | None, threads: int, ops: list[Op] | None = None,
                    base: bool = True, eager: bool = True,
                    seconds: float = MEASURE_SECONDS, sync=None) -> dict:
    """Measure (at `threads` threads) the rates of `ops`, if `eager` the elementwise bandwidths
    of this model's own kernels, and if `base` the scalar figures."""
    import torch

    global _clock
    old, old_clock = torch.get_num_threads(), _clock
    torch.set_num_threads(threads)
    _clock = compute_clock(threads)
    try:
        warm_up()
        rates: dict[str, float] = {}
        in_situ: dict[str, float] = {}
        entry: dict = {}
        if eager and shape is not None:
            found = measure_in_situ(shape, sync)
            if found:
                in_situ = found["rates"]
                entry["eager_bw"] = {eager_key(shape): list(found["eager_bw"])}
        covered = {key_tuple(k) for k in in_situ}
        covered |= {(k[0], k[2], k[1], k[3]) for k in covered if len(k) == 4}
        attn_done: dict[tuple, tuple[float, float]] = {}
        for op in ops or []:
            if rate_key(op) in covered:
                continue
            key = rate_key(op)
            if op.kind == "attn":
                base_key = (op.batch, *op.dims, op.gqa)
                if base_key not in attn_done:
                    attn_done[base_key] = measure_attention(op, seconds)
                f, b = attn_done[base_key]
                rates[key_str(("attn-fwd", *key[1:]))] = f
                rates[key_str(("attn-bwd", *key[1:]))] = b
            else:
                rates[key_str(key)] = measure_gemm(key[0], *key[1:], seconds=seconds)
        entry["rates"] = rates
        entry["rates_in_situ"] = in_situ
        if base and shape is not None:
            entry.update(
                elementwise_bw=measure_elementwise(PARAM_TENSOR_BYTES),
                kernel_overhead_s=measure_kernel_overhead(),
                optimizer_s_per_param=measure_optimizer(),
                elementwise_tensor_bytes=PARAM_TENSOR_BYTES,
            )
        entry.update(measured_at=time.strftime("%Y-%m-%dT%H:%M:%S"), loadavg=_loadavg(),
                     threads=threads,
                     clock="thread CPU time" if _clock is time.thread_time else "wall")
        return entry
    finally:
        torch.set_num_threads(old)
        _clock = old_clock


def profile_for(shape: LayerShape, threads: int, nproc: int = 1, pp: int = 1,
                measure: bool = True, refresh: bool = False) -> CpuProfile | None:
    """The profile covering every GEMM/attention shape of `shape`, measuring what is missing.

    `nproc` processes with `threads` threads each (the layout the trainer runs) measure at once;
    with several, the gloo figures among them are measured too. `refresh` re-measures all of
    it now (the self-check does, so that its figures and its runs see the same machine).
    """
    prof = None if refresh else load_profile(threads, nproc, shape)
    if measure:
        missing = missing_ops(shape, prof, pp) if not refresh else missing_ops(shape, None, pp)
        no_bw = prof is None or ("bw", "eltwise") not in dict(prof.rates)
        no_gloo = nproc > 1 and (refresh or not read_cache().get(gloo_key(threads, nproc)))
        if refresh or prof is None or missing or no_bw or no_gloo:
            run_measurements(shape, threads, nproc, missing, base=refresh or prof is None,
                             eager=refresh or no_bw, gloo=no_gloo, fsdp=pp == 1)
        prof = load_profile(threads, nproc, shape)
    return prof


def measured_profile(cfg, nproc: int, device_spec, gpus_per_node: int = 0
                     ) -> CpuProfile | None:
    """The CPU profile `myria.sim.perf.simulate_config` needs for a myria Config on `nproc`
    processes of this CPU, measuring the shapes the cache lacks (never more processes than
    cores nor shapes beyond the memory: `check_measurable`); None off this CPU."""
    from myria.sim.perf import config_run, measured_here, run_shape

    run, spec, threads = config_run(cfg, nproc, device_spec, gpus_per_node)
    if not threads or not measured_here(spec):
        return None
    return profile_for(run_shape(run), threads, run.cluster.gpus_per_node, pp=run.parallel.pp)


def measurement_bytes(shape: LayerShape) -> float:
    """What one measuring process holds for `shape`: a block's fp32 weights, gradients and
    two Adam moments, and its activations at the micro-batch (as the trainer keeps them)."""
    from myria.sim.memory import _act, _params

    pc = _params(shape)
    block = pc.per_layer_dense + pc.per_layer_experts
    ends = pc.embedding + pc.head
    return 16.0 * (block + ends) + 2 * _act(dataclasses.replace(shape, act_bytes=4), "none")


def check_measurable(shape: LayerShape | None, nproc: int) -> None:
    """Refuse, with one clear line, a measurement that would ask more than this machine has:
    more processes than cores, or shapes that do not fit the memory available to them."""
    cores = os.cpu_count() or 1
    if nproc > cores:
        raise ConfigError(
            f"measuring this CPU as {nproc} processes needs {nproc} cores; this machine has "
            f"{cores}. Predict for an accelerator instead (--gpu h100-sxm-80gb, a100-sxm-80gb, "
            f"... in myria analyze, simulate and plan), or on this CPU with at most {cores} "
            "processes")
    if shape is None:
        return
    from myria.sim.hardware import available_memory_bytes

    need = nproc * measurement_bytes(shape)
    have = 0.8 * available_memory_bytes()
    if need > have:
        raise ConfigError(
            f"measuring this CPU at this model's shapes needs about {need / 1e9:.1f} GB "
            f"({nproc} process(es)); {have / 1e9:.1f} GB is available. This model is for an "
            "accelerator: pass --gpu (h100-sxm-80gb, a100-sxm-80gb, ...)")


def run_measurements(shape: LayerShape | None, threads: int, nproc: int, ops: list[Op],
                     base: bool, eager: bool, gloo: bool, fsdp: bool = True) -> None:
    """Measure on `nproc` concurrent processes (this one if 1) and merge into the cache."""
    check_measurable(shape, nproc)
    if nproc <= 1:
        entries = [measure_compute(shape, threads, ops, base=base, eager=eager)]
    else:
        import subprocess
        import sys

        import torch.distributed as dist

        # The parent hosts the rendezvous store on a free port (the pattern of tests/dist.py);
        # workers are fresh interpreters (`python -m myria.measure.cpu JOB RANK`), so this works
        # from any caller, whatever its __main__ module.
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        with tempfile.TemporaryDirectory() as tmp:
            job = {"world": nproc, "port": store.port, "out": tmp, "threads": threads,
                   "shape": dataclasses.asdict(shape) if shape is not None else None,
                   "ops": [dataclasses.asdict(o) for o in ops], "base": base, "eager": eager,
                   "gloo": gloo, "units": list(fsdp_units(shape)) if gloo else [],
                   "fsdp": fsdp}
            Path(tmp, "job.json").write_text(json.dumps(job))
            env = dict(os.environ, OMP_NUM_THREADS=str(threads))
            procs = [subprocess.Popen([sys.executable, "-m", "myria.measure.cpu",
                                      str(Path(tmp, "job.json")), str(r)], env=env)
                     for r in range(nproc)]
            codes = [p.wait(timeout=900) for p in procs]
            if any(codes):
                raise RuntimeError(f"CPU measurement workers exited with {codes}")
            entries = [json.loads(Path(tmp, f"rank{r}.json").read_text())
                       for r in range(nproc)]
    merged = _mean_entries(entries)
    points = merged.pop("gloo_points", None)
    if shape is not None or base:
        update_cache(compute_key(threads, nproc), merged)
    if points:
        fsdp = points.pop("fsdp", [])
        context = points.pop("fsdp_context", None)
        cache = read_cache()
        prev = cache.get(gloo_key(threads, nproc), {})
        old = prev.get("fsdp", {})
        ctx = dict(prev.get("fsdp_context", {}))
        if context is not None and shape is not None:
            ctx[eager_key(shape)] = context
        cache[gloo_key(threads, nproc)] = {
            "fits": {op: list(_fit([tuple(p) for p in pts])) for op, pts in points.items()},
            "points": points,
            "fsdp": {**old, **{str(int(p[0])): list(p[1:]) for p in fsdp}},
            "fsdp_context": ctx,
            "measured_at": merged.get("measured_at"),
            "loadavg": merged.get("loadavg"), "threads": threads, "nproc": nproc}
        write_cache(cache)


def fsdp_units(shape: LayerShape | None) -> tuple[int, ...]:
    """Bytes of the FSDP units myria shards (a block, the root) plus FSDP_SIZES, fp32."""
    units = {4 * n for n in FSDP_SIZES}
    if shape is not None:
        from myria.sim.memory import stage_params

        block = sum(stage_params(shape, 1, False, False, 1))
        for first, last in ((True, True), (True, False), (False, True)):
            root = sum(stage_params(shape, 0, first, last, 1))
            if root:
                units.add(int(4 * root))
        units.add(int(4 * block))
    return tuple(sorted(units))


def _mean_entries(entries: list[dict]) -> dict:
    """The mean over processes of every measured figure (rank 0's gloo points)."""
    out = dict(entries[0])
    n = len(entries)
    for k, v in entries[0].items():
        if isinstance(v, float) and k != "loadavg":
            out[k] = sum(e[k] for e in entries) / n
    for name in ("rates", "rates_in_situ"):
        out[name] = {k: sum(e[name][k] for e in entries) / n for k in entries[0].get(name, {})}
    ctx = [e.get("gloo_points", {}).get("fsdp_context") for e in entries]
    if ctx[0] is not None:
        out["gloo_points"] = dict(out["gloo_points"])
        out["gloo_points"]["fsdp_context"] = [sum(c[i] for c in ctx) / n
                                              for i in range(len(ctx[0]))]
    if "eager_bw" in entries[0]:
        out["eager_bw"] = {k: [sum(e["eager_bw"][k][i] for e in entries) / n for i in (0, 1)]
                           for k in entries[0]["eager_bw"]}
    return out


def _worker(rank: int, world: int, port: int, out_dir: str, threads: int,
            shape: LayerShape | None, ops: list[Op], base: bool, eager: bool,
            gloo: bool, units: tuple, fsdp: bool = True) -> None:
    """One of the concurrent measuring processes (rank `rank` of `world`)."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    store = dist.TCPStore("127.0.0.1", port, is_master=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    try:
        dist.barrier()
        entry = measure_compute(shape, threads, ops, base=base, eager=eager, sync=dist.barrier)
        if gloo:
            dist.barrier()
            entry["gloo_points"] = _gloo_points(world)
            dist.barrier()
            if shape is not None and fsdp:
                entry["gloo_points"]["fsdp_context"] = _fsdp_in_context(world, shape)
            elif fsdp:
                entry["gloo_points"]["fsdp"] = _fsdp_unit_points(world, units)
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(entry))
        dist.barrier()
    finally:
        dist.destroy_process_group()


# -- gloo between local processes -----------------------------------------------------------------
def _fit(points: list[tuple[float, float]]) -> tuple[float, float]:
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


def _fsdp_in_context(world: int, shape: LayerShape, repeats: int = 5) -> list[float]:
    """What FSDP2 adds to myria's own block and model ends, measured around their compute.

    Both processes run one block of this shape forward + backward (then the ends: embedding,
    final norm, loss) at the same time, first unsharded, then sharded as
    `parallel/parallelize.apply_fsdp` shards them (the block resharded after forward under a
    root; the ends as the root, kept after forward), gradient sync off (a non-last
    microbatch) and on (the last one). Returns [block per microbatch, block reduce per step,
    ends per microbatch, ends reduce per step] in seconds: sharded minus unsharded, and sync on
    minus off. Unlike `_fsdp_unit_points` this includes what the gathers, copies and gloo's
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


def _fsdp_unit_points(world: int, units: tuple, repeats: int = 7) -> list:
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


def _gloo_points(world: int, sizes: tuple = GLOO_SIZES, repeats: int = 5) -> dict:
    """(bus bytes, seconds) per size for each collective, and (bytes, seconds) of send/recv.

    Medians over `repeats` timings of 3 calls each (`measure.collective`: slowest rank's mean).
    """
    import torch

    from myria.measure.collective import bench_collective, bench_p2p_ring, busbw_factor

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


def with_gloo(profile: CpuProfile, nproc: int) -> CpuProfile:
    """`profile` with the cached gloo figures for `nproc` processes (if any)."""
    if nproc <= 1:
        return replace(profile, nproc=1, gloo=())
    g = read_cache().get(gloo_key(profile.threads, nproc), {})
    gloo = tuple(sorted((op, float(a), float(b)) for op, (a, b) in g.get("fits", {}).items()))
    return replace(profile, nproc=nproc, gloo=gloo)


@dataclass
class Summary:
    """Human-readable view of a profile (for reports)."""

    threads: int
    gemm_gflops: dict = field(default_factory=dict)
    attn_gflops: dict = field(default_factory=dict)
    elementwise_gbs: float = 0.0
    eager_bw_gbs: dict = field(default_factory=dict)
    host_ms: dict = field(default_factory=dict)
    kernel_overhead_us: float = 0.0
    optimizer_ns_per_param: float = 0.0
    gloo: dict = field(default_factory=dict)
    fsdp_ms: dict = field(default_factory=dict)
    fsdp_context_ms: dict = field(default_factory=dict)


def summarize(profile: CpuProfile, shape: LayerShape | None = None, pp: int = 1) -> Summary:
    """Readable figures of `profile` (with `shape`: only the rates that model uses)."""
    keep = None
    if shape is not None:
        keep = {rate_key(op) for op in shape_ops(shape, pp)}
        keep |= {(k[0], k[2], k[1], k[3]) for k in keep if len(k) == 4}
        keep |= {("bw", "eltwise"), ("bw", "head"), ("host", "block"), ("host", "head")}
    s = Summary(threads=profile.threads,
                elementwise_gbs=profile.elementwise_bw / 1e9,
                kernel_overhead_us=profile.kernel_overhead_s * 1e6,
                optimizer_ns_per_param=profile.optimizer_s_per_param * 1e9)
    for k, r in profile.rates:
        if keep is not None and k not in keep:
            continue
        if k[0] == "bw":
            s.eager_bw_gbs[k[1]] = r / 1e9
        elif k[0] == "host":
            s.host_ms[k[1]] = r * 1e3
        else:
            (s.attn_gflops if k[0].startswith("attn") else s.gemm_gflops)[key_str(k)] = r / 1e9
    for op, a, b in profile.gloo:
        s.gloo[op] = {"alpha_us": a * 1e6, "bw_gbs": b / 1e9}
    if profile.fsdp_context:
        s.fsdp_context_ms = {k: round(t * 1e3, 2) for k, t in zip(
            ("block per microbatch", "block reduce per step", "ends per microbatch",
             "ends reduce per step"), profile.fsdp_context)}
    else:
        for nbytes, *ts in profile.fsdp:
            s.fsdp_ms[f"{nbytes / 2**20:.1f} MiB"] = {k: round(t * 1e3, 2) for k, t in
                                                       zip(("block", "root", "reduce"), ts)}
    return s


def _worker_main(argv: list[str]) -> None:
    import warnings

    # torch 2.13 deprecates the collective names the doctor's bench times; a measuring worker's
    # stderr is the user's terminal (`myria report`, `train --dry-run`): no warnings there
    warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")
    job = json.loads(Path(argv[0]).read_text())
    sh = job["shape"]
    shape = LayerShape(**{**sh, "model": tuple(
        (k, tuple(v) if isinstance(v, list) else v) for k, v in sh["model"])}) if sh else None
    ops = [Op(**{k: tuple(v) if k == "dims" else v for k, v in o.items()}) for o in job["ops"]]
    _worker(int(argv[1]), job["world"], job["port"], job["out"], job["threads"], shape, ops,
            job["base"], job["eager"], job["gloo"], tuple(job["units"]), job.get("fsdp", True))


if __name__ == "__main__":
    import sys

    _worker_main(sys.argv[1:])
