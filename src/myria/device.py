"""Device facts: dense peak FLOP/s and bandwidths, read by the MFU meter and the simulator alike.

Accelerator figures are datasheet peaks (dense, no 2:4 sparsity); an unknown device has no peak,
so MFU shows as unknown rather than wrong. A CPU's fp32 peak is measured once per processor model
and torch version as a *core* peak (`cpu_core_peak`: a high quantile of one thread's matmul
rates on its own CPU time, so the host's other jobs do not lower it), pinned in
`cache_dir()`/machine_figures.json (`myria doctor --refresh` measures it again); a process with t
threads has t x that peak. Every figure says whether it was looked up or measured, how and when.
`measured_figure` keeps the doctor's throughput history: the best of several probes, never
lowered. Why: docs/observability.md, "MFU on a CPU".
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path

from myria.fsutil import atomic_write_json


@dataclass(frozen=True)
class DeviceSpec:
    """Peak figures of one device."""

    name: str
    peak_bf16_tflops: float          # dense tensor-core bf16/fp16
    peak_fp32_tflops: float
    memory_gb: float
    memory_bw_gbs: float             # HBM / DRAM bandwidth, GB/s
    nvlink_gbs: float = 0.0          # per GPU, one direction, GB/s
    source: str = "datasheet"

    def peak_tflops(self, dtype: str = "bfloat16") -> float:
        return self.peak_fp32_tflops if dtype in ("float32", "fp32") else self.peak_bf16_tflops


# Public datasheets (NVIDIA A100/H100/H200 SXM).
DEVICES: dict[str, DeviceSpec] = {
    "a100-sxm-80gb": DeviceSpec("a100-sxm-80gb", 312.0, 19.5, 80, 2039, 300),
    "a100-sxm-40gb": DeviceSpec("a100-sxm-40gb", 312.0, 19.5, 40, 1555, 300),
    "h100-sxm-80gb": DeviceSpec("h100-sxm-80gb", 989.0, 67.0, 80, 3350, 450),
    "h200": DeviceSpec("h200", 989.0, 67.0, 141, 4800, 450),
    "h800-sxm-80gb": DeviceSpec("h800-sxm-80gb", 989.0, 67.0, 80, 3350, 200),
}
ALIASES = {"a100": "a100-sxm-80gb", "h100": "h100-sxm-80gb", "h200-sxm-141gb": "h200"}


def lookup(name: str) -> DeviceSpec | None:
    """The datasheet entry for `name` (case-insensitive, common aliases), or None."""
    key = name.lower()
    key = ALIASES.get(key, key)
    return DEVICES.get(key)


def cuda_device_spec(index: int = 0) -> DeviceSpec | None:
    """Match the local CUDA device's marketing name against the table."""
    import torch

    if not torch.cuda.is_available():
        return None
    n = torch.cuda.get_device_name(index).lower()
    for key, pattern in (("h200", "h200"), ("h100-sxm-80gb", "h100"), ("h800-sxm-80gb", "h800"),
                         ("a100-sxm-80gb", "a100")):
        if pattern in n:
            return DEVICES[key]
    return None


def cache_dir() -> Path:
    """Where measured machine figures are cached: $MYRIA_CACHE, else $XDG_CACHE_HOME/myria (an
    absolute path, as the XDG base directory specification requires), else ~/.cache/myria."""
    if os.environ.get("MYRIA_CACHE"):
        return Path(os.environ["MYRIA_CACHE"])
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    if xdg and os.path.isabs(xdg):
        return Path(xdg) / "myria"
    return Path.home() / ".cache" / "myria"


def _figures_path() -> Path:
    return cache_dir() / "machine_figures.json"


HISTORY = 20   # samples kept per figure


@dataclass(frozen=True)
class Figure:
    """A measured figure: its best value, where it comes from, and the samples behind it."""

    value: float
    source: str
    samples: tuple = ()       # (iso time, value, load average) of the most recent probes
    measured_at: str = ""     # when the best value was measured


def read_cache_file(path: Path) -> dict:
    """A JSON cache of measured figures ({} when missing or unreadable: measure again)."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def write_cache_file(path: Path, cache: dict) -> None:
    """Replace a JSON cache atomically (a temporary file per process, then rename); a cache
    that cannot be written is skipped, never an error."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(path, cache, durable=False)
    except OSError:
        pass


def _load_figures() -> dict:
    return read_cache_file(_figures_path())


def _save_figures(cache: dict) -> None:
    write_cache_file(_figures_path(), cache)


@contextlib.contextmanager
def _locked():
    """An exclusive lock on the figures file's neighbour (fcntl; a no-op where it is missing)."""
    try:
        import fcntl

        path = _figures_path().with_suffix(".lock")
        path.parent.mkdir(parents=True, exist_ok=True)
        f = path.open("a")
    except (ImportError, OSError):
        yield
        return
    with f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _load_average() -> float | None:
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return None


def record_samples(name: str, threads: int, values: list[float]) -> dict:
    """Merge measurements of a figure taken now into its history (the best is raised, never
    lowered); returns the figure's cache entry. Other processes of this host may do the same."""
    import datetime as _dt

    at = _dt.datetime.now().isoformat(timespec="seconds")
    new = [[at, round(float(v), 6), _load_average()] for v in values]
    key = cpu_key(threads)
    with _locked():
        cache = _load_figures()
        entry = dict(cache.get(key, {}).get(name) or {"best": 0.0, "best_at": "", "samples": []})
        entry["samples"] = (entry["samples"] + new)[-HISTORY:]
        for t, v, _ in new:
            if v > entry["best"]:
                entry["best"], entry["best_at"] = v, t
        cache.setdefault(key, {})[name] = entry
        _save_figures(cache)
    return entry


def measured_figure(name: str, threads: int, measure, *, refresh: bool = False, probes: int = 3,
                    what: str = "") -> Figure:
    """The best-known value of a machine figure (`name`, e.g. "fp32_matmul_tflops") at
    `threads` threads: the cached best when `refresh` is false and one exists, else `probes`
    calls of `measure()` merged into the cache (the best is raised, never lowered)."""
    key = cpu_key(threads)
    entry = _load_figures().get(key, {}).get(name)
    if refresh or not entry:
        entry = record_samples(name, threads, [float(measure()) for _ in range(max(1, probes))])
    value = float(entry["best"])
    n = len(entry["samples"])
    # the best of every probe ever made survives the HISTORY trim, so it may predate the kept
    # samples
    source = (f"measured ({threads} threads{', ' + what if what else ''}, the best probe ever, "
              f"at {entry['best_at']}; the last {n} kept since "
              f"{entry['samples'][0][0] if n else '?'})")
    return Figure(value, source, tuple(tuple(x) for x in entry["samples"]), entry["best_at"])


def cpu_key(threads: int) -> str:
    """Cache key of a CPU figure: processor model, threads and torch version."""
    import torch

    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{model}|threads={threads}|torch={torch.__version__}"


def time_matmul(a, b, out=None, *, seconds: float = 0.0, groups: int = 1, reps: int = 1,
                warmup_s: float = 0.0, warmup_calls: int = 1, clock=time.perf_counter,
                call=None, sync=None) -> list[float]:
    """The one GEMM timer (the measured CPU peak, the doctor's throughput check and the CPU
    profile's rates use it): seconds per call of `a @ b`, one figure per group of `reps`
    calls, for at least `groups` groups and until `seconds` have passed, after `warmup_calls`
    untimed calls and more until `warmup_s` have passed. `call(a, b, out)` replaces
    `torch.matmul(a, b, out=out)` (another layout, the doctor's fault hook); `sync()` waits for
    the device after the warm-up and after each group; a group the clock times as 0 is not
    counted."""
    import torch

    mm = call or (lambda x, y, o: torch.matmul(x, y, out=o))
    deadline = time.perf_counter() + warmup_s
    done = 0
    while done < warmup_calls or time.perf_counter() < deadline:
        mm(a, b, out)
        done += 1
    if sync is not None:
        sync()
    times: list[float] = []
    deadline = time.perf_counter() + seconds
    while len(times) < groups or time.perf_counter() < deadline:
        t0 = clock()
        for _ in range(reps):
            mm(a, b, out)
        if sync is not None:
            sync()
        t = (clock() - t0) / reps
        if t > 0:
            times.append(t)
    return times


def measure_copy_bandwidth(device="cpu", nbytes: int = 128 * 2**20, seconds: float = 0.3,
                           min_reps: int = 3, threads: int | None = None) -> float:
    """The one memory-bandwidth probe (the simulator's CPU figure and the doctor's check use
    it): the best GB/s of copying an `nbytes` buffer on `device` (bytes read + bytes written,
    as STREAM's copy counts them), over at least `min_reps` copies and `seconds`, on a CPU at
    `threads` torch threads (None: as set)."""
    import torch

    old = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        dev = torch.device(device)
        src = torch.ones(nbytes // 4, dtype=torch.float32, device=dev)
        dst = torch.empty_like(src)

        def sync() -> None:
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)

        dst.copy_(src)  # first touch
        sync()
        best, reps = 0.0, 0
        deadline = time.perf_counter() + seconds
        while reps < min_reps or time.perf_counter() < deadline:
            t0 = time.perf_counter()
            dst.copy_(src)
            sync()
            best = max(best, 2.0 * src.numel() * 4 / (time.perf_counter() - t0) / 1e9)
            reps += 1
        return best
    finally:
        torch.set_num_threads(old)


def operands(n: int, dtype, device="cpu"):
    """Two n x n random matrices for a timed matmul, drawn from a generator of their own: a
    measurement made inside a run (the first to ask for this machine's peak measures it) must
    not move the run's random streams, which its checkpoints save and its resume restores."""
    import torch

    g = torch.Generator(device=device).manual_seed(0)
    return tuple(torch.randn(n, n, dtype=dtype, device=device, generator=g) for _ in range(2))


def measure_matmul_tflops(n: int = 1024, dtype: str = "float32", seconds: float = 1.0,
                          threads: int | None = None) -> float:
    """Best achieved TFLOP/s of an n x n x n matmul on this CPU (the measured peak)."""
    import torch

    old = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        a, b = operands(n, getattr(torch, dtype))
        c = torch.empty_like(a)
        return 2 * n**3 / min(time_matmul(a, b, c, seconds=seconds, reps=4)) / 1e12
    finally:
        torch.set_num_threads(old)


# -- the CPU's core peak ---------------------------------------------------------------------
CORE_PEAK = "fp32_core_matmul_tflops"   # its name in machine_figures.json (under threads=1)
PEAK_QUANTILE = 0.99    # of the per-call rates: nearly the best call, not the best (one outlier)
PEAK_N = 512            # matmul size: a few ms a call
PEAK_WARMUP_S = 0.3     # untimed calls first (kernel selection, caches, clock ramp-up)
# Load only slows a call (caches and the memory bus shared with other processes, a sibling
# hyper-thread, a context switch inside it), never speeds it: the figure is a high quantile of
# every call, measured in rounds of PEAK_ROUND_CALLS (counted in calls, not wall time, so a
# loaded host measures as many) until a round moves it by less than PEAK_SETTLED, after at
# least PEAK_MIN_ROUNDS rounds and at most PEAK_ROUNDS.
PEAK_ROUND_CALLS = 100
PEAK_MIN_ROUNDS = 6
PEAK_ROUNDS = 12
PEAK_SETTLED = 0.005


def quantile(values: list[float], q: float) -> float:
    """The q-quantile of `values` (linear interpolation between order statistics)."""
    xs = sorted(values)
    pos = q * (len(xs) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def core_matmul_rates(n: int = PEAK_N, calls: int = PEAK_ROUND_CALLS,
                      warmup_s: float = PEAK_WARMUP_S, dtype: str = "float32") -> list[float]:
    """TFLOP/s of each of `calls` n x n x n matmuls on one thread, each timed on the thread's
    own CPU time (the time it ran, not the time other processes held its core)."""
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(1)    # the intra-op work then runs on this thread
    try:
        a, b = operands(n, getattr(torch, dtype))
        c = torch.empty_like(a)
        # warm-up: kernel selection, caches, clock ramp-up
        times = time_matmul(a, b, c, groups=calls, warmup_s=warmup_s, warmup_calls=0,
                            clock=time.thread_time)
        rates = [2 * n**3 / t / 1e12 for t in times]
        return rates
    finally:
        torch.set_num_threads(old)


def core_peak_rounds() -> tuple[list[float], list[float]]:
    """(every call's rate, the PEAK_QUANTILE of all calls after each round) of rounds of
    `core_matmul_rates` until a round moves the figure by less than PEAK_SETTLED (after
    PEAK_MIN_ROUNDS), or PEAK_ROUNDS rounds."""
    rates: list[float] = []
    rounds: list[float] = []
    while len(rounds) < PEAK_ROUNDS:
        rates += core_matmul_rates(warmup_s=PEAK_WARMUP_S if not rounds else 0.0)
        rounds.append(quantile(rates, PEAK_QUANTILE))
        if len(rounds) >= PEAK_MIN_ROUNDS and rounds[-1] <= (1 + PEAK_SETTLED) * rounds[-2]:
            break
    return rates, rounds


def cpu_core_peak(refresh: bool = False) -> Figure:
    """The fp32 matmul peak of one core of this CPU: measured once (`core_peak_rounds`: a high
    quantile of one-thread calls, settled), pinned in the cache and re-used; `refresh`
    measures it again. Processes that ask at once measure once (a file lock)."""
    import datetime as _dt

    key = cpu_key(1)
    entry = None if refresh else _load_figures().get(key, {}).get(CORE_PEAK)
    if not entry:
        with _locked():
            entry = None if refresh else _load_figures().get(key, {}).get(CORE_PEAK)
            if not entry:
                rates, rounds = core_peak_rounds()
                entry = {"value": round(rounds[-1], 6),
                         "quantile": PEAK_QUANTILE, "calls": len(rates), "n": PEAK_N,
                         "rounds": [round(x, 6) for x in rounds],
                         "q10_q50_q90": [round(quantile(rates, q), 6) for q in (.1, .5, .9)],
                         "measured_at": _dt.datetime.now().isoformat(timespec="seconds"),
                         "loadavg": _load_average()}
                cache = _load_figures()
                cache.setdefault(key, {})[CORE_PEAK] = entry
                _save_figures(cache)
    source = (f"{entry['value'] * 1e3:.0f} GFLOP/s per core: fp32 matmul {entry['n']}^3, "
              f"q{round(100 * entry['quantile'])} of {entry['calls']} one-thread calls on their "
              f"CPU time, measured {entry['measured_at']}")
    return Figure(float(entry["value"]), source, (), entry["measured_at"])


MEASURED = "measured"   # how a CPU peak measured here begins its source


def measured_threads(source: str) -> int | None:
    """The threads a CPU peak measured on this machine was taken at (`cpu_peak_figure`'s
    source), or None for a figure from elsewhere (a datasheet, one described by hand)."""
    import re

    m = re.match(rf"{MEASURED} \((\d+) threads? x ", source)
    return int(m.group(1)) if m else None


def cpu_peak_figure(threads: int, refresh: bool = False) -> Figure:
    """The fp32 matmul peak of this CPU at `threads` threads: threads x the core peak; its
    source says the threads (`measured_threads` reads them back)."""
    core = cpu_core_peak(refresh)
    return Figure(threads * core.value,
                  f"{MEASURED} ({threads} thread{'s' if threads != 1 else ''} x {core.source})",
                  (), core.measured_at)


def cpu_device_spec(threads: int | None = None, refresh: bool = False) -> DeviceSpec:
    """This CPU at `threads` threads (default: this process's), its peak `cpu_peak_figure`
    (labelled 'measured (N threads ...'; `myria.sim.perf.measured_here` reads that)."""
    import torch

    threads = threads or torch.get_num_threads()
    fig = cpu_peak_figure(threads, refresh)
    return DeviceSpec("cpu", peak_bf16_tflops=fig.value, peak_fp32_tflops=fig.value,
                      memory_gb=0.0, memory_bw_gbs=0.0, source=fig.source)


# GPUs in one server of the planning stand-in (an HGX/DGX H100 or A100 node: 8 on NVLink)
SERVER_GPUS = 8


def planning_device(dtype: str) -> DeviceSpec:
    """The device a prediction of a config is made for when none is named: the local GPU, an
    H100 for a bf16/fp16 config on a machine without one, else this CPU (measured)."""
    spec = cuda_device_spec()
    if spec is None:
        spec = lookup("h100-sxm-80gb") if dtype in ("bfloat16", "float16") \
            else cpu_device_spec()
    return spec


def local_peak_tflops(device_type: str, dtype: str) -> tuple[float | None, str]:
    """Peak TFLOP/s of this process's device for `dtype`, and where the figure comes from."""
    if device_type == "cpu":
        spec = cpu_device_spec()   # the pinned core peak x this process's threads
        return spec.peak_fp32_tflops, spec.source
    spec = cuda_device_spec()
    if spec is None:
        return None, "unknown device"
    return spec.peak_tflops(dtype), f"{spec.name} datasheet"
