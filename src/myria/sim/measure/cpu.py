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
from dataclasses import replace
from pathlib import Path

from myria.device import time_matmul
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
    quiet_to_measure,
    read_cache,
    update_cache,
    write_cache,
)
from myria.sim.measure.multiproc import (
    fit_alpha_bw,
    fsdp_in_context,
    fsdp_unit_points,
    gloo_points,
)
from myria.sim.measure.profile_summary import missing_ops
from myria.sim.op_timing import rate_key
from myria.sim.operators import (
    LayerShape,
    Op,
    layer_ops,
)

GEMM_FLOP_CAP = 4e9          # larger GEMMs are measured on a halved shape (asymptotic rate)
ATTN_FLOP_CAP = 4e9
MEASURE_SECONDS = 0.15       # per shape: median of the calls made in this time (at least 5)
FSDP_SIZES = (1 << 18, 1 << 23)   # parameters per FSDP unit besides the model's (1, 32 MiB fp32)
PARAM_TENSOR_BYTES = 1 << 24               # parameter-sized passes: 16 MiB tensors
# Sustained compute before measuring: the trainer's step times are read after its warm-up steps,
# when the machine has been busy for seconds; on a shared VM a GEMM run straight after an idle
# spell can be markedly slower than a minute into training (bench/RESULTS_selfcheck.md, the
# probes), and a short measurement would sit entirely in that slow phase
WARMUP_SECONDS = 4.0
# A single measuring process times its block and its ends for at least this long each (several
# processes time 5 barrier-synchronised repeats, which already last 20-30 s in all): medians
# over a few seconds sample this VM's drifting speed better than five back-to-back runs
IN_SITU_SECONDS = 3.0


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
        out, call = torch.zeros(m, n), lambda x, y, o: o.addmm_(x, y)
    else:
        out, call = None, lambda x, y, o: torch.mm(x, y)
    t = statistics.median(time_matmul(a, b, out, seconds=seconds, groups=5, clock=_clock,
                                      call=call))
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
    rope = model.rope_tables_for(s, torch.float32) if cfg.arch != "gpt" else None  # as forward
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
    if measure and prof is not None and prof.busy() and \
            _loadavg() <= quiet_to_measure(threads, nproc):
        refresh = True   # figures of a busy host, and this one is quiet now: measure again
    if measure:
        missing = missing_ops(shape, prof, pp) if not refresh else missing_ops(shape, None, pp)
        no_bw = prof is None or ("bw", "eltwise") not in dict(prof.rates)
        no_gloo = nproc > 1 and (refresh or not read_cache().get(gloo_key(threads, nproc)))
        if refresh or prof is None or missing or no_bw or no_gloo:
            run_measurements(shape, threads, nproc, missing, base=refresh or prof is None,
                             eager=refresh or no_bw, gloo=no_gloo, fsdp=pp == 1,
                             replace=refresh)
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
    from myria.sim.memory import layer_act, layer_params

    pc = layer_params(shape)
    block = pc.per_layer_dense + pc.per_layer_experts
    ends = pc.embedding + pc.head
    return 16.0 * (block + ends) + 2 * layer_act(dataclasses.replace(shape, act_bytes=4), "none")


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
                     base: bool, eager: bool, gloo: bool, fsdp: bool = True,
                     replace: bool = False) -> None:
    """Measure on `nproc` concurrent processes (this one if 1) and merge into the cache (with
    `replace`, in place of this CPU's figures at these threads and processes)."""
    check_measurable(shape, nproc)
    if nproc <= 1:
        entries = [measure_compute(shape, threads, ops, base=base, eager=eager)]
    else:
        import subprocess
        import sys

        import torch.distributed as dist

        # The parent hosts the rendezvous store on a free port (the pattern of tests/dist.py);
        # workers are fresh interpreters (`python -m myria.sim.measure.cpu JOB RANK`), so this works
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
            procs = [subprocess.Popen([sys.executable, "-m", "myria.sim.measure.cpu",
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
        update_cache(compute_key(threads, nproc), merged, replace=replace)
    if points:
        fsdp = points.pop("fsdp", [])
        context = points.pop("fsdp_context", None)
        cache = read_cache()
        prev = {} if replace else cache.get(gloo_key(threads, nproc), {})
        old = prev.get("fsdp", {})
        ctx = dict(prev.get("fsdp_context", {}))
        if context is not None and shape is not None:
            ctx[eager_key(shape)] = context
        cache[gloo_key(threads, nproc)] = {
            "fits": {op: list(fit_alpha_bw([tuple(p) for p in pts])) for op, pts in points.items()},
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
            entry["gloo_points"] = gloo_points(world)
            dist.barrier()
            if shape is not None and fsdp:
                entry["gloo_points"]["fsdp_context"] = fsdp_in_context(world, shape)
            elif fsdp:
                entry["gloo_points"]["fsdp"] = fsdp_unit_points(world, units)
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(entry))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def with_gloo(profile: CpuProfile, nproc: int) -> CpuProfile:
    """`profile` with the cached gloo figures for `nproc` processes (if any)."""
    if nproc <= 1:
        return replace(profile, nproc=1, gloo=())
    g = read_cache().get(gloo_key(profile.threads, nproc), {})
    gloo = tuple(sorted((op, float(a), float(b)) for op, (a, b) in g.get("fits", {}).items()))
    return replace(profile, nproc=nproc, gloo=gloo)


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
