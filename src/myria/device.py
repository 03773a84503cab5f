"""Device facts: dense peak FLOP/s and bandwidths, read by the MFU meter and the simulator alike.

Accelerator figures are datasheet peaks (dense, no 2:4 sparsity). A CPU has no datasheet entry
here: its fp32 peak is *measured* once by a matmul benchmark and cached, and every figure says
whether it was looked up or measured. An unknown device has no peak, so MFU is shown as unknown
rather than a wrong number.
"""

from __future__ import annotations

import json
import os
import platform
import time
from dataclasses import asdict, dataclass
from pathlib import Path


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
    """Where measured machine figures are cached: $MYRIA_CACHE or ~/.cache/myria."""
    return Path(os.environ.get("MYRIA_CACHE", Path.home() / ".cache" / "myria"))


def _cache_path() -> Path:
    return cache_dir() / "cpu_peak.json"


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


def measure_matmul_tflops(n: int = 1024, dtype: str = "float32", seconds: float = 1.0,
                          threads: int | None = None) -> float:
    """Best achieved TFLOP/s of an n x n x n matmul on this CPU (the measured peak)."""
    import torch

    old = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        dt = getattr(torch, dtype)
        a = torch.randn(n, n, dtype=dt)
        b = torch.randn(n, n, dtype=dt)
        c = torch.empty(n, n, dtype=dt)
        torch.matmul(a, b, out=c)  # warm-up
        best = 0.0
        deadline = time.perf_counter() + seconds
        while True:
            t0 = time.perf_counter()
            for _ in range(4):
                torch.matmul(a, b, out=c)
            dt_s = (time.perf_counter() - t0) / 4
            best = max(best, 2 * n**3 / dt_s / 1e12)
            if time.perf_counter() > deadline:
                break
        return best
    finally:
        torch.set_num_threads(old)


def cpu_device_spec(threads: int | None = None, refresh: bool = False) -> DeviceSpec:
    """This CPU, with its fp32 matmul peak measured once and cached (labelled 'measured')."""
    import torch

    threads = threads or torch.get_num_threads()
    path, key = _cache_path(), cpu_key(threads)
    cache: dict = {}
    if path.exists():
        try:
            cache = json.loads(path.read_text())
        except (OSError, ValueError):
            cache = {}
    if not refresh and key in cache:
        return DeviceSpec(**cache[key])
    # A measurement on a busy machine reads low, and a peak is a ceiling: keep the best one.
    tflops = measure_matmul_tflops(threads=threads, seconds=0.5 if key in cache else 1.0)
    if key in cache:
        tflops = max(tflops, cache[key]["peak_fp32_tflops"])
    spec = DeviceSpec("cpu", peak_bf16_tflops=tflops, peak_fp32_tflops=tflops, memory_gb=0.0,
                      memory_bw_gbs=0.0, source=f"measured ({threads} threads, fp32 matmul)")
    cache[key] = asdict(spec)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(cache, indent=1))
        tmp.replace(path)
    except OSError:
        pass
    return spec


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
        spec = cpu_device_spec(refresh=True)  # half a second; keeps the best figure seen
        return spec.peak_fp32_tflops, spec.source
    spec = cuda_device_spec()
    if spec is None:
        return None, "unknown device"
    return spec.peak_tflops(dtype), f"{spec.name} datasheet"
