"""Self-check diagnostics of one host (`myria doctor`), also run by the supervisor before a restart.

Checks, each with a pass/fail/skip status and the reason (measured vs expected):

1. `gemm-correctness` (per local rank): random matmuls in the training dtype against a float64
   reference of the same (rounded) inputs; fails if any element's error exceeds the rounding
   bound `2 * (k * u_fp32 + u_out) * (|A| |B|)_ij` (fp32 accumulation, output rounding).
2. `gemm-throughput` (per local rank): best TFLOP/s of repeated matmuls against the expected
   figure: on CPU the measured fp32 peak cached by `myria.device.cpu_device_spec`; on GPU the
   datasheet peak times an achievable fraction. Fails below `tolerance` (default 0.5) of it.
3. `memory-bandwidth`: a large buffer copy (GB/s counting read + write) against the first
   measurement, cached per CPU model / thread count (CPU; once per host, since the ranks share
   the memory) or the datasheet HBM bandwidth times an achievable fraction (GPU, per rank).
4. `all-reduce`, `all-to-all` (optionally `all-gather`, `reduce-scatter`) among the host's
   `nproc` local ranks (gloo over loopback on CPU, NCCL on GPU): the data are checked, and the
   bus bandwidth, computed as nccl-tests does (see `collective_bench`), is compared with the
   expected value (on CPU a modest floor).
5. `neighbor-all-reduce`: under a multi-host launch this host forms a group with its neighbour
   (hosts are paired in list order, (0, 1), (2, 3), ..., the last three together when the count
   is odd: list hosts in switch order) and all-reduces one buffer per host. The host list comes
   from `--peer-hosts`, else `MYRIA_HOSTS` (comma-separated), else Slurm's `SLURM_STEP_NODELIST`
   inside `srun`; this host's position from `--host-index`, `MYRIA_HOST_INDEX`, `SLURMD_NODENAME`
   or its host name. The group's first host serves the rendezvous on `--peer-port` (default
   29571, or `MYRIA_DOCTOR_PORT`) plus the group's first index. On one host: skipped.
6. `p2p-loopback`: a send/recv ring among the local ranks: payload integrity and hop latency.

A worker that crashes or hangs is a failure of the `workers` check naming the rank and the check
it was running. The host passes when no check fails. Local rendezvous binds 127.0.0.1 only.

Test hook (inert unless set): `MYRIA_DOCTOR_FAULT` holds comma-separated faults, each
`kind[:rank=R][:fraction=F]`:

- `slow-gemm`  every timed GEMM sleeps so that it runs at `fraction` (default 0.25) of the
  expected throughput or of its own speed, whichever is lower: the throughput check fails;
- `wrong-gemm` every GEMM result gets one element perturbed: the correctness check fails.

Without `rank=` the fault applies to every local rank. Reports name an active fault hook.

Python API (for the supervisor): `run_diagnostics(nproc, expected, timeout_s) -> HostReport`.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import ipaddress
import json
import math
import os
import platform
import queue as _queue
import re
import socket
import sys
import time
import traceback
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from myria.errors import ConfigError, MyriaError

FAULT_ENV = "MYRIA_DOCTOR_FAULT"
FAULT_KINDS = ("slow-gemm", "wrong-gemm")
DEFAULT_TOLERANCE = 0.5
DEFAULT_PEER_PORT = 29571
DTYPES = ("float32", "bfloat16", "float16")

# Check names in report order.
CHECKS = ("gemm-correctness", "gemm-throughput", "memory-bandwidth", "all-reduce", "all-to-all",
          "all-gather", "reduce-scatter", "p2p-loopback", "neighbor-all-reduce", "workers")

EXPECTED_KEYS: dict[str, str] = {
    "gemm_tflops": "GEMM throughput per rank, TFLOP/s",
    "membw_gbs": "memory copy bandwidth, GB/s (read + write)",
    "all_reduce_busbw_gbs": "local all-reduce bus bandwidth, GB/s",
    "all_to_all_busbw_gbs": "local all-to-all bus bandwidth, GB/s",
    "all_gather_busbw_gbs": "local all-gather bus bandwidth, GB/s",
    "reduce_scatter_busbw_gbs": "local reduce-scatter bus bandwidth, GB/s",
    "neighbor_all_reduce_busbw_gbs": "all-reduce bus bandwidth with the neighbour host(s), GB/s",
    "p2p_latency_max_us": "largest acceptable send/recv hop latency, microseconds",
    "gemm_error_bound": "override of the GEMM error bound, max |C - C64| / (|A||B|)",
    "tolerance": "fail a throughput below this fraction of its expected figure (default 0.5)",
}

# CPU: modest floors for gloo over loopback (a healthy 2-core host measures ~0.5-1 GB/s).
CPU_COLLECTIVE_FLOOR_GBS = 0.1
CPU_P2P_LATENCY_MAX_US = 20_000.0
# GPU: fractions of datasheet figures a healthy device reaches (nccl-tests on DGX A100 give
# ~230 GB/s all-reduce bus bandwidth over 300 GB/s NVLink per direction, hardware.md).
GPU_GEMM_FRACTION = 0.6
GPU_MEMBW_FRACTION = 0.8
GPU_NVLINK_FRACTION = {"all_reduce": 0.75, "all_gather": 0.75, "reduce_scatter": 0.75,
                       "all_to_all": 0.5}
GPU_NEIGHBOR_BUSBW_GBS = 20.0    # one 200 Gb/s NIC (~24 GB/s in nccl-tests)
GPU_P2P_LATENCY_MAX_US = 1_000.0

_UNIT_ROUNDOFF = {"float32": 2.0**-24, "bfloat16": 2.0**-8, "float16": 2.0**-11}


# ---------------------------------------------------------------------------------------------
# Report types


@dataclass
class Check:
    """One check's outcome; `rank` is the local rank, or None for a host-wide check."""

    name: str
    status: str                    # "pass" | "fail" | "skip"
    reason: str
    rank: int | None = None
    measured: float | None = None
    expected: float | None = None
    unit: str = ""
    details: dict[str, Any] = field(default_factory=dict)

    @property
    def failed(self) -> bool:
        return self.status == "fail"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class HostReport:
    """All checks of one host; the host passes when no check failed."""

    host: str
    nproc: int
    device: str
    backend: str
    dtype: str
    checks: list[Check]
    expected: dict[str, float | None] = field(default_factory=dict)
    expected_sources: dict[str, str] = field(default_factory=dict)
    tolerance: float = DEFAULT_TOLERANCE
    faults: list[str] = field(default_factory=list)
    neighbors: list[str] = field(default_factory=list)
    started_at: str = ""
    duration_s: float = 0.0
    versions: dict[str, str] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return bool(self.checks) and not any(c.failed for c in self.checks)

    @property
    def failures(self) -> list[Check]:
        return [c for c in self.checks if c.failed]

    @property
    def counts(self) -> str:
        n_pass = sum(c.status == "pass" for c in self.checks)
        n_skip = sum(c.status == "skip" for c in self.checks)
        return (f"{n_pass} passed, {len(self.failures)} failed, {n_skip} skipped "
                f"in {self.duration_s:.1f} s")

    @property
    def summary(self) -> str:
        """One line: host, PASS/FAIL, counts, and the failed checks with their reasons."""
        head = f"{self.host}: {'PASS' if self.passed else 'FAIL'} ({self.counts})"
        if not self.checks:
            return head + ": no check ran"
        if self.passed:
            return head
        return head + ": " + "; ".join(f"{_label(c)}: {c.reason}" for c in self.failures)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["passed"] = self.passed
        d["summary"] = self.summary
        return d

    def to_json(self, indent: int | None = 1) -> str:
        return json.dumps(_json_safe(self.to_dict()), indent=indent)

    def write_json(self, path: str | Path) -> Path:
        """Write the report atomically (temporary file + rename); returns the path."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(self.to_json() + "\n")
        tmp.replace(path)
        return path

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> HostReport:
        d = dict(d)
        d.pop("passed", None)
        d.pop("summary", None)
        d["checks"] = [Check(**c) for c in d.get("checks", [])]
        return cls(**d)


def _json_safe(x: Any) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return None if math.isnan(x) else ("inf" if x > 0 else "-inf")
    if isinstance(x, dict):
        return {k: _json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_json_safe(v) for v in x]
    return x


def _label(c: Check) -> str:
    return c.name if c.rank is None else f"{c.name}[rank {c.rank}]"


def _pct(frac: float) -> str:
    return f"{frac:.1%}" if frac < 1 else f"{frac:.0%}"


def _fmt(x: float | None) -> str:
    if x is None:
        return "-"
    if x == 0 or not math.isfinite(x):
        return str(x)
    if abs(x) >= 1000:
        return f"{x:.0f}"
    return f"{x:.4g}" if abs(x) >= 1 else f"{x:.3g}"


# ---------------------------------------------------------------------------------------------
# Fault hook


@dataclass(frozen=True)
class DoctorFault:
    """One injected fault of the MYRIA_DOCTOR_FAULT test hook."""

    kind: str
    rank: int | None = None
    fraction: float = 0.25

    def applies(self, rank: int | None) -> bool:
        return self.rank is None or rank is None or self.rank == rank

    def describe(self) -> str:
        s = self.kind
        if self.rank is not None:
            s += f":rank={self.rank}"
        if self.kind == "slow-gemm" and self.fraction != 0.25:
            s += f":fraction={self.fraction:g}"
        return s


def parse_faults(text: str | None) -> list[DoctorFault]:
    """Parse MYRIA_DOCTOR_FAULT, e.g. `slow-gemm`, `wrong-gemm:rank=1,slow-gemm:rank=0`."""
    faults: list[DoctorFault] = []
    for item in (text or "").split(","):
        item = item.strip()
        if not item:
            continue
        kind, *params = item.split(":")
        if kind not in FAULT_KINDS:
            raise ConfigError(f"{FAULT_ENV}: unknown fault {kind!r} in {item!r}; "
                              f"known: {', '.join(FAULT_KINDS)}")
        rank: int | None = None
        fraction = 0.25
        for p in params:
            key, _, value = p.partition("=")
            try:
                if key == "rank":
                    rank = int(value)
                    if rank < 0:
                        raise ValueError
                elif key == "fraction" and kind == "slow-gemm":
                    fraction = float(value)
                    if not 0 < fraction < 1:
                        raise ValueError
                else:
                    raise KeyError(key)
            except KeyError:
                raise ConfigError(f"{FAULT_ENV}: unknown parameter {key!r} in {item!r}; "
                                  "valid: rank=R" + (", fraction=F (0..1)"
                                                     if kind == "slow-gemm" else "")) from None
            except ValueError:
                raise ConfigError(f"{FAULT_ENV}: bad value {p!r} in {item!r} (rank: an integer "
                                  ">= 0, fraction: between 0 and 1)") from None
        faults.append(DoctorFault(kind, rank, fraction))
    return faults


def _fault(faults: Sequence[DoctorFault], kind: str, rank: int | None) -> DoctorFault | None:
    for f in faults:
        if f.kind == kind and f.applies(rank):
            return f
    return None


# ---------------------------------------------------------------------------------------------
# Measurements (run in the workers, and in the caller for the cached CPU baselines)


def _sync(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _matmul(a: Any, b: Any, out: Any, *, device: Any, wrong: DoctorFault | None = None,
            slow: DoctorFault | None = None, expected_tflops: float | None = None) -> None:
    """out = a @ b, through the fault hook when one is active."""
    import torch

    t0 = time.perf_counter()
    torch.matmul(a, b, out=out)
    if wrong is not None:
        # Silent data corruption of one element, well above any rounding error.
        flat = out.view(-1)
        i = flat.numel() // 2 + 1 if flat.numel() > 1 else 0
        flat[i] += 1.0 + float(out.abs().max())
    if slow is not None:
        _sync(device)
        elapsed = time.perf_counter() - t0
        flops = 2.0 * a.shape[0] * a.shape[1] * b.shape[1]
        target = elapsed / slow.fraction
        if expected_tflops:
            target = max(target, flops / (slow.fraction * expected_tflops * 1e12))
        time.sleep(max(0.0, target - elapsed))


def gemm_error_bound(k: int, dtype: str) -> float:
    """Bound on |C - C64|_ij / (|A||B|)_ij: fp32 accumulation over k terms, output rounding, x2."""
    return 2.0 * (k * _UNIT_ROUNDOFF["float32"] + _UNIT_ROUNDOFF[dtype])


GEMM_SHAPES = ((384, 1024, 256), (257, 1031, 129))   # (m, k, n), one with odd sizes


def check_gemm_correctness(device: Any, dtype: str, *, rank: int | None = None,
                           faults: Sequence[DoctorFault] = (), bound: float | None = None,
                           seed: int = 0) -> Check:
    """GEMM in `dtype` vs a float64 reference of the same inputs, with a rounding-error bound."""
    import torch

    wrong = _fault(faults, "wrong-gemm", rank)
    gen = torch.Generator().manual_seed(1234 + seed)
    dt = getattr(torch, dtype)
    worst, worst_at, worst_bound, rel_fro, finite = 0.0, "", 0.0, 0.0, True
    for m, k, n in GEMM_SHAPES:
        a = torch.randn(m, k, generator=gen).to(dt)
        b = torch.randn(k, n, generator=gen).to(dt)
        a_d, b_d = a.to(device), b.to(device)
        c = torch.empty(m, n, dtype=dt, device=device)
        _matmul(a_d, b_d, c, device=device, wrong=wrong)
        _sync(device)
        a64, b64, c64 = a.double(), b.double(), c.cpu().double()
        ref = a64 @ b64
        scale = a64.abs() @ b64.abs()
        ratio = (c64 - ref).abs() / scale.clamp_min(1e-300)
        lim = bound if bound is not None else gemm_error_bound(k, dtype)
        if not bool(torch.isfinite(c64).all()):
            finite = False
        r = float(ratio.max())
        if not math.isfinite(r) or r / lim > (worst / worst_bound if worst_bound else -1):
            idx = int(ratio.argmax())
            worst, worst_bound = r, lim
            worst_at = f"shape {m}x{k}x{n} element ({idx // n}, {idx % n})"
        rel_fro = max(rel_fro, float((c64 - ref).norm() / ref.norm()))
    hook = f" (fault hook {wrong.describe()} active)" if wrong else ""
    ok = finite and math.isfinite(worst) and worst <= worst_bound
    details = {"dtype": dtype, "shapes": [list(s) for s in GEMM_SHAPES],
               "max_scaled_error": worst, "bound": worst_bound, "relative_frobenius": rel_fro,
               "worst_element": worst_at, "fault": wrong.describe() if wrong else None}
    if not finite:
        reason = f"non-finite values in the {dtype} GEMM result{hook}"
    elif ok:
        reason = (f"max |C-C64|/(|A||B|) = {worst:.2g} <= bound {worst_bound:.2g} "
                  f"({dtype}, {len(GEMM_SHAPES)} shapes){hook}")
    else:
        reason = (f"max |C-C64|/(|A||B|) = {worst:.2g} > bound {worst_bound:.2g} at "
                  f"{worst_at} ({dtype}){hook}")
    return Check("gemm-correctness", "pass" if ok else "fail", reason, rank, worst, worst_bound,
                 "scaled error", details)


def measure_gemm_tflops(device: Any, dtype: str, *, n: int, seconds: float, reps: int,
                        slow: DoctorFault | None = None,
                        expected_tflops: float | None = None) -> float:
    """Best TFLOP/s of groups of `reps` n x n x n matmuls within about `seconds` (>= 2 groups)."""
    import torch

    dt = getattr(torch, dtype)
    a = torch.randn(n, n, dtype=dt, device=device)
    b = torch.randn(n, n, dtype=dt, device=device)
    c = torch.empty(n, n, dtype=dt, device=device)
    torch.matmul(a, b, out=c)  # warm-up
    _sync(device)
    best, groups = 0.0, 0
    deadline = time.perf_counter() + seconds
    while groups < 2 or time.perf_counter() < deadline:
        t0 = time.perf_counter()
        for _ in range(reps):
            _matmul(a, b, c, device=device, slow=slow, expected_tflops=expected_tflops)
        _sync(device)
        dt_s = (time.perf_counter() - t0) / reps
        best = max(best, 2.0 * n**3 / dt_s / 1e12)
        groups += 1
    return best


def measure_memory_bandwidth(device: Any, nbytes: int, seconds: float = 0.3) -> float:
    """Best GB/s of copying an `nbytes` buffer (read + write counted, as STREAM copy does)."""
    import torch

    src = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)  # first touch
    _sync(device)
    best, reps = 0.0, 0
    deadline = time.perf_counter() + seconds
    while reps < 3 or time.perf_counter() < deadline:
        t0 = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        best = max(best, 2.0 * src.numel() * 4 / (time.perf_counter() - t0) / 1e9)
        reps += 1
    return best


def _throughput_check(name: str, rank: int | None, measured: float, expected: float | None,
                      source: str, tolerance: float, unit: str, note: str = "",
                      details: dict[str, Any] | None = None) -> Check:
    """Pass when `measured` >= tolerance x `expected`; skip when there is no expected figure."""
    details = dict(details or {}, expected_source=source, tolerance=tolerance)
    if expected is None:
        return Check(name, "skip", f"measured {_fmt(measured)} {unit}{note}; no expected figure "
                     f"({source}): set one with --expect", rank, measured, None, unit, details)
    frac = measured / expected if expected > 0 else float("inf")
    ok = frac >= tolerance
    verdict = "" if ok else f"; below the {tolerance:.0%} floor"
    return Check(name, "pass" if ok else "fail",
                 f"{_fmt(measured)} {unit} is {_pct(frac)} of the expected {_fmt(expected)}{note} "
                 f"[expected: {source}]{verdict}", rank, measured, expected, unit, details)


# ---------------------------------------------------------------------------------------------
# Expected figures


def _baseline_path() -> Path:
    from myria.device import cache_dir

    return cache_dir() / "doctor_baseline.json"


def _cached_baseline(name: str, threads: int, measure: Any, refresh: bool) -> tuple[float, str]:
    """A CPU figure measured once and cached under $MYRIA_CACHE/doctor_baseline.json."""
    from myria.device import cpu_key

    path, key = _baseline_path(), cpu_key(threads)
    cache: dict[str, Any] = {}
    try:
        cache = json.loads(path.read_text())
    except (OSError, ValueError):
        cache = {}
    entry = cache.get(key, {})
    if not refresh and isinstance(entry.get(name), (int, float)):
        return float(entry[name]), f"cached first measurement, {threads} threads"
    value = float(measure())
    entry[name] = value
    entry[name + "_measured_at"] = _dt.datetime.now().isoformat(timespec="seconds")
    cache[key] = entry
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(cache, indent=1))
        tmp.replace(path)
    except OSError:
        pass
    return value, f"first measurement (now cached), {threads} threads"


def resolve_expected(device_type: str, dtype: str, threads: int,
                     overrides: dict[str, float] | None = None, rebaseline: bool = False,
                     ) -> tuple[dict[str, float | None], dict[str, str]]:
    """Expected figures and where each comes from; `overrides` (e.g. --expect) win."""
    overrides = dict(overrides or {})
    values: dict[str, float | None] = {}
    sources: dict[str, str] = {}

    def put(key: str, value: float | None, source: str) -> None:
        if key in overrides:
            values[key], sources[key] = float(overrides[key]), "configured"
        else:
            values[key], sources[key] = value, source

    ops = ["all_reduce", "all_to_all", "all_gather", "reduce_scatter"]
    if device_type == "cpu":
        import torch

        if "gemm_tflops" not in overrides:
            if dtype == "float32":
                from myria.device import cpu_device_spec

                spec = cpu_device_spec(threads=threads, refresh=rebaseline)
                put("gemm_tflops", spec.peak_fp32_tflops, f"cached CPU peak, {spec.source}")
            else:
                from myria.device import measure_matmul_tflops

                v, src = _cached_baseline(f"gemm_tflops[{dtype}]", threads,
                                          lambda: measure_matmul_tflops(dtype=dtype,
                                                                        threads=threads),
                                          rebaseline)
                put("gemm_tflops", v, f"CPU {dtype} peak, {src}")
        else:
            put("gemm_tflops", None, "")
        if "membw_gbs" not in overrides:
            def _measure_bw() -> float:
                old = torch.get_num_threads()
                torch.set_num_threads(threads)
                try:
                    return measure_memory_bandwidth(torch.device("cpu"), _MEMBW_BYTES["cpu"])
                finally:
                    torch.set_num_threads(old)

            v, src = _cached_baseline("membw_gbs", threads, _measure_bw, rebaseline)
            put("membw_gbs", v, src)
        else:
            put("membw_gbs", None, "")
        for op in ops:
            put(f"{op}_busbw_gbs", CPU_COLLECTIVE_FLOOR_GBS, "CPU gloo floor, default")
        put("neighbor_all_reduce_busbw_gbs", CPU_COLLECTIVE_FLOOR_GBS, "CPU gloo floor, default")
        put("p2p_latency_max_us", CPU_P2P_LATENCY_MAX_US, "CPU gloo ceiling, default")
    else:
        from myria.device import cuda_device_spec

        spec = cuda_device_spec()
        if spec is None:
            unknown = "unknown GPU: no datasheet entry"
            put("gemm_tflops", None, unknown)
            put("membw_gbs", None, unknown)
            for op in ops:
                put(f"{op}_busbw_gbs", None, unknown)
        else:
            put("gemm_tflops", spec.peak_tflops(dtype) * GPU_GEMM_FRACTION,
                f"{spec.name} datasheet {dtype} x {GPU_GEMM_FRACTION}")
            put("membw_gbs", spec.memory_bw_gbs * GPU_MEMBW_FRACTION,
                f"{spec.name} datasheet x {GPU_MEMBW_FRACTION}")
            for op in ops:
                f = GPU_NVLINK_FRACTION[op]
                put(f"{op}_busbw_gbs", spec.nvlink_gbs * f or None,
                    f"{spec.name} NVLink {spec.nvlink_gbs:g} GB/s per direction x {f}")
        put("neighbor_all_reduce_busbw_gbs", GPU_NEIGHBOR_BUSBW_GBS,
            "one 200 Gb/s NIC, nccl-tests figure, default")
        put("p2p_latency_max_us", GPU_P2P_LATENCY_MAX_US, "NCCL ceiling, default")
    if "gemm_error_bound" in overrides:
        put("gemm_error_bound", None, "")
    return values, sources


def _validate_expected(expected: dict[str, Any] | None) -> tuple[dict[str, float], float]:
    out: dict[str, float] = {}
    tolerance = DEFAULT_TOLERANCE
    for key, value in (expected or {}).items():
        if key not in EXPECTED_KEYS:
            raise ConfigError(f"unknown expected figure {key!r}; valid: "
                              f"{', '.join(EXPECTED_KEYS)}")
        try:
            v = float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"expected figure {key}={value!r} is not a number") from None
        if not (v > 0 and math.isfinite(v)):
            raise ConfigError(f"expected figure {key}={value!r} must be a positive number")
        if key == "tolerance":
            if v > 1:
                raise ConfigError(f"tolerance={value!r} must be a fraction in (0, 1]")
            tolerance = v
        else:
            out[key] = v
    return out, tolerance


# ---------------------------------------------------------------------------------------------
# Multi-host neighbour


def expand_nodelist(text: str) -> list[str]:
    """Expand a Slurm node list such as `gpu[01-03,07],login1` into host names."""
    items, depth, cur = [], 0, ""
    for ch in text.strip():
        if ch == "," and depth == 0:
            items.append(cur)
            cur = ""
            continue
        depth += ch == "["
        depth -= ch == "]"
        cur += ch
    items.append(cur)
    hosts: list[str] = []
    for item in filter(None, (i.strip() for i in items)):
        hosts.extend(_expand_item(item))
    return hosts


def _expand_item(item: str) -> list[str]:
    m = re.match(r"([^\[]*)\[([^\]]*)\](.*)$", item)
    if not m:
        return [item]
    prefix, ranges, rest = m.groups()
    heads: list[str] = []
    for part in ranges.split(","):
        lo, sep, hi = part.partition("-")
        if sep:
            width = len(lo)
            heads.extend(f"{prefix}{i:0{width}d}" for i in range(int(lo), int(hi) + 1))
        else:
            heads.append(prefix + part)
    return [h + t for h in heads for t in _expand_item(rest)]


def neighbor_group(n_hosts: int, index: int) -> list[int]:
    """Indices of the hosts `index` is tested with: pairs in list order, a trio at an odd end."""
    if not 0 <= index < n_hosts:
        raise ValueError(f"host index {index} outside 0..{n_hosts - 1}")
    if n_hosts < 2:
        return [index]
    start = index - index % 2
    if n_hosts % 2 == 1 and start >= n_hosts - 3:
        return [n_hosts - 3, n_hosts - 2, n_hosts - 1]
    return [start, start + 1]


def discover_hosts(peer_hosts: Sequence[str] | None = None,
                   host_index: int | None = None) -> tuple[list[str], int | None, str]:
    """(host list, this host's index or None, where the list came from)."""
    env = os.environ
    if peer_hosts:
        hosts, source = [h.strip() for h in peer_hosts if h.strip()], "--peer-hosts"
    elif env.get("MYRIA_HOSTS"):
        hosts, source = [h.strip() for h in env["MYRIA_HOSTS"].split(",") if h.strip()], \
            "MYRIA_HOSTS"
    elif env.get("SLURM_STEP_NODELIST"):
        hosts, source = expand_nodelist(env["SLURM_STEP_NODELIST"]), "SLURM_STEP_NODELIST"
    else:
        return [socket.gethostname()], 0, "this host only"
    if host_index is None and env.get("MYRIA_HOST_INDEX"):
        try:
            host_index = int(env["MYRIA_HOST_INDEX"])
        except ValueError:
            raise ConfigError(f"MYRIA_HOST_INDEX={env['MYRIA_HOST_INDEX']!r} is not an "
                              "integer") from None
    if host_index is None:
        names = {socket.gethostname(), socket.gethostname().split(".")[0], socket.getfqdn()}
        if env.get("SLURMD_NODENAME"):
            names = {env["SLURMD_NODENAME"]}
        matches = [i for i, h in enumerate(hosts) if h in names or h.split(".")[0] in names]
        host_index = matches[0] if len(matches) == 1 else None
    if host_index is not None and not 0 <= host_index < len(hosts):
        raise ConfigError(f"host index {host_index} is outside the host list of {len(hosts)} "
                          f"hosts ({source})")
    return hosts, host_index, source


# ---------------------------------------------------------------------------------------------
# Worker processes

_MEMBW_BYTES = {"cpu": 128 * 2**20, "cuda": 1 << 30}
_GEMM_N = {"cpu": 1024, "cuda": 8192}
_GEMM_REPS = {"cpu": 2, "cuda": 10}
_COLL_BYTES = {"cpu": 16 * 2**20, "cuda": 256 * 2**20}
_COLL_ITERS = {"cpu": 5, "cuda": 20}
_P2P_BYTES = {"cpu": 2**20, "cuda": 64 * 2**20}


def _serve_store(addr: str, port: int, timeout: _dt.timedelta) -> Any:
    """A TCPStore server listening on `addr` only (TCPStore itself would bind every address)."""
    import torch.distributed as dist

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((addr, port))
        sock.listen(128)
        port = sock.getsockname()[1]
    except BaseException:
        sock.close()
        raise
    fd = sock.detach()  # the store owns the descriptor from here on
    try:
        return dist.TCPStore(addr, port, is_master=True, wait_for_workers=False,
                             timeout=timeout, master_listen_fd=fd)
    except BaseException:
        os.close(fd)
        raise


def _put(q: Any, *msg: Any) -> None:
    q.put(msg)


def _exit_after_error(q: Any) -> None:
    try:
        q.close()
        q.join_thread()
    finally:
        os._exit(1)


def _compute_checks(rank: int, cfg: dict[str, Any], device: Any, q: Any) -> None:
    faults = [DoctorFault(**f) for f in cfg["faults"]]
    exp, src, tol = cfg["expected"], cfg["sources"], cfg["tolerance"]
    dev = device.type

    _put(q, "phase", rank, "gemm-correctness")
    c = check_gemm_correctness(device, cfg["dtype"], rank=rank, faults=faults,
                               bound=exp.get("gemm_error_bound"), seed=rank)
    _put(q, "check", rank, c.to_dict())

    _put(q, "phase", rank, "gemm-throughput")
    slow = _fault(faults, "slow-gemm", rank)
    tflops = measure_gemm_tflops(device, cfg["dtype"], n=_GEMM_N[dev], seconds=cfg["gemm_s"],
                                 reps=_GEMM_REPS[dev], slow=slow,
                                 expected_tflops=exp.get("gemm_tflops"))
    hook = f" (fault hook {slow.describe()} active)" if slow else ""
    c = _throughput_check("gemm-throughput", rank, tflops, exp.get("gemm_tflops"),
                          src.get("gemm_tflops", ""), tol, "TFLOP/s", hook,
                          {"n": _GEMM_N[dev], "dtype": cfg["dtype"],
                           "fault": slow.describe() if slow else None})
    _put(q, "check", rank, c.to_dict())

    if dev == "cuda" or rank == 0:      # host memory is shared: measured once on CPU
        _put(q, "phase", rank, "memory-bandwidth")
        bw = measure_memory_bandwidth(device, _MEMBW_BYTES[dev])
        c = _throughput_check("memory-bandwidth", rank if dev == "cuda" else None, bw,
                              exp.get("membw_gbs"), src.get("membw_gbs", ""), tol, "GB/s",
                              details={"bytes": _MEMBW_BYTES[dev]})
        _put(q, "check", rank, c.to_dict())


def _collective_check(name: str, res: Any, expected: float | None, source: str, tol: float,
                      rank: int | None = None, what: str = "") -> Check:
    details = res.to_dict()
    if not res.correct:
        return Check(name, "fail", f"wrong result on rank(s) {res.bad_ranks} (max deviation "
                     f"{res.max_error:.3g}){what}", rank, res.busbw_gbs, expected, "GB/s busbw",
                     details)
    note = f" ({res.world} ranks, {res.nbytes / 2**20:.0f} MiB{what})"
    c = _throughput_check(name, rank, res.busbw_gbs, expected, source, tol, "GB/s busbw", note,
                          details=details)
    if c.status == "skip":   # the data check passed: that is a pass, without a figure to meet
        c.status = "pass"
        c.reason = "data correct; " + c.reason
    return c


def _worker(rank: int, cfg: dict[str, Any], q: Any) -> None:
    """One local rank: compute checks (taking turns on CPU), then collectives and the ring."""
    phase = "startup"
    try:
        import warnings

        warnings.filterwarnings("ignore")
        os.environ["GLOO_SOCKET_IFNAME"] = "lo"     # local ranks talk over loopback only
        import torch
        import torch.distributed as dist

        from myria.resilience import collective_bench as cb

        torch.set_num_threads(cfg["threads"])
        n = cfg["nproc"]
        if cfg["device"] == "cuda":
            device = torch.device("cuda", rank)
            torch.cuda.set_device(device)
            torch.backends.cuda.matmul.allow_tf32 = False
            torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
            torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = False
        else:
            device = torch.device("cpu")
        timeout = _dt.timedelta(seconds=max(1.0, cfg["deadline"] - time.time()))
        phase = "rendezvous"
        _put(q, "phase", rank, phase)
        store = dist.TCPStore("127.0.0.1", cfg["port"], is_master=False, timeout=timeout)
        dist.init_process_group(cfg["backend"], store=dist.PrefixStore("doctor", store),
                                rank=rank, world_size=n, timeout=timeout)
        # On CPU the ranks share the cores: run the compute checks one rank at a time.
        serialize = cfg["device"] == "cpu" and n > 1
        for turn in range(n if serialize else 1):
            if not serialize or turn == rank:
                phase = "compute checks"
                _compute_checks(rank, cfg, device, q)
            if serialize:
                phase = f"barrier (compute checks of rank {turn})"
                if turn != rank:
                    _put(q, "phase", rank, phase)
                dist.barrier()
        exp, src, tol = cfg["expected"], cfg["sources"], cfg["tolerance"]
        dev = device.type
        if n > 1:
            for op in cfg["collectives"]:
                name = op.replace("_", "-")
                phase = name
                _put(q, "phase", rank, name)
                res = cb.bench_collective(op, _COLL_BYTES[dev], device=device,
                                          iters=_COLL_ITERS[dev])
                if rank == 0:
                    key = f"{op}_busbw_gbs"
                    c = _collective_check(name, res, exp.get(key), src.get(key, ""), tol)
                    _put(q, "check", rank, c.to_dict())
            phase = "p2p-loopback"
            _put(q, "phase", rank, phase)
            p2p = cb.bench_p2p_ring(_P2P_BYTES[dev], device=device)
            if rank == 0:
                lim = exp.get("p2p_latency_max_us")
                ok_lat = lim is None or p2p.latency_us <= lim
                if not p2p.correct:
                    status, reason = "fail", f"payload corrupted on receiving rank(s) " \
                        f"{p2p.bad_ranks}"
                elif not ok_lat:
                    status, reason = "fail", f"hop latency {_fmt(p2p.latency_us)} us > " \
                        f"ceiling {_fmt(lim)} us ({src.get('p2p_latency_max_us', '')})"
                else:
                    status = "pass"
                    reason = (f"ring of {n}: payload intact, hop latency "
                              f"{_fmt(p2p.latency_us)} us <= {_fmt(lim)} us, "
                              f"{_fmt(p2p.bandwidth_gbs)} GB/s per link")
                c = Check("p2p-loopback", status, reason, None, p2p.latency_us, lim, "us",
                          p2p.to_dict())
                _put(q, "check", rank, c.to_dict())
        phase = "shutdown"
        dist.destroy_process_group()
        _put(q, "done", rank)
    except BaseException as e:  # noqa: BLE001 - reported to the parent, then exit
        _put(q, "error", rank, phase, f"{type(e).__name__}: {e}", traceback.format_exc())
        _exit_after_error(q)


def _neighbor_worker(cfg: dict[str, Any], q: Any, release: Any) -> None:
    """One process per host of the neighbour group: all-reduce once the local checks are done."""
    key, phase = "neighbor", "startup"
    try:
        import warnings

        warnings.filterwarnings("ignore")
        hosts, pos, port = cfg["group_hosts"], cfg["pos"], cfg["port"]
        master = socket.gethostbyname(hosts[0])
        mine = socket.gethostbyname(hosts[pos])
        if ipaddress.ip_address(mine).is_loopback:
            os.environ["GLOO_SOCKET_IFNAME"] = "lo"
        import torch
        import torch.distributed as dist

        from myria.resilience import collective_bench as cb

        device = torch.device("cuda", 0) if cfg["device"] == "cuda" else torch.device("cpu")
        if device.type == "cuda":
            torch.cuda.set_device(device)
        timeout = _dt.timedelta(seconds=max(1.0, cfg["deadline"] - time.time()))
        phase = f"rendezvous with {', '.join(h for i, h in enumerate(hosts) if i != pos)}"
        _put(q, "phase", key, phase)
        if pos == 0:
            store = _serve_store(master, port, timeout)
        else:
            store = dist.TCPStore(master, port, is_master=False, timeout=timeout)
        dist.init_process_group(cfg["backend"], store=dist.PrefixStore("doctor-neighbor", store),
                                rank=pos, world_size=len(hosts), timeout=timeout)
        phase = "waiting for the local checks"
        release.wait(max(0.0, cfg["deadline"] - time.time()))
        phase = "all-reduce with the neighbour host(s)"
        _put(q, "phase", key, phase)
        dist.barrier()
        res = cb.bench_collective("all_reduce", _COLL_BYTES[device.type], device=device,
                                  iters=_COLL_ITERS[device.type])
        k = "neighbor_all_reduce_busbw_gbs"
        others = ", ".join(h for i, h in enumerate(hosts) if i != pos)
        c = _collective_check("neighbor-all-reduce", res, cfg["expected"].get(k),
                              cfg["sources"].get(k, ""), cfg["tolerance"], what=f", with {others}")
        c.details.update(group=hosts, position=pos)
        _put(q, "check", key, c.to_dict())
        dist.barrier()
        dist.destroy_process_group()
        _put(q, "done", key)
    except BaseException as e:  # noqa: BLE001
        _put(q, "error", key, phase, f"{type(e).__name__}: {e}", traceback.format_exc())
        _exit_after_error(q)


# ---------------------------------------------------------------------------------------------
# The caller side


def run_diagnostics(nproc: int = 2, expected: dict[str, float] | None = None,
                    timeout_s: float = 60, *, device: str = "auto", dtype: str | None = None,
                    collectives: Sequence[str] = ("all_reduce", "all_to_all"),
                    peer_hosts: Sequence[str] | None = None, host_index: int | None = None,
                    peer_port: int | None = None, rebaseline: bool = False,
                    gemm_seconds: float | None = None,
                    faults: str | None = None) -> HostReport:
    """Run every check on this host with `nproc` local ranks and return the report.

    `expected` overrides expected figures (keys: EXPECTED_KEYS, e.g. {"gemm_tflops": 0.05,
    "tolerance": 0.5}). Workers are separate processes started with the "spawn" method, so the
    caller's process never joins a process group (a calling script needs the usual
    `if __name__ == "__main__":` guard). Raises ConfigError on bad arguments; every host fault
    (wrong or slow result, crash, hang past `timeout_s`) is a failed check in the report.
    `faults` is a MYRIA_DOCTOR_FAULT spec used instead of the environment variable when given
    ("" disables the hook).
    """
    import multiprocessing as mp

    import torch

    t_start = time.time()
    started_at = _dt.datetime.now().isoformat(timespec="seconds")
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device not in ("cpu", "cuda"):
        raise ConfigError(f"device {device!r}: use auto, cpu or cuda")
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device 'cuda' requested but no CUDA device is available")
    limit = torch.cuda.device_count() if device == "cuda" else 64
    if not isinstance(nproc, int) or not 1 <= nproc <= limit:
        raise ConfigError(f"nproc={nproc!r}: must be an integer in 1..{limit}"
                          + (" (the local GPU count)" if device == "cuda" else ""))
    if not timeout_s or timeout_s <= 0:
        raise ConfigError(f"timeout_s={timeout_s!r} must be positive")
    dtype = dtype or ("float32" if device == "cpu" else "bfloat16")
    if dtype not in DTYPES:
        raise ConfigError(f"dtype {dtype!r}: use one of {', '.join(DTYPES)}")
    from myria.resilience.collective_bench import OPS

    bad = [op for op in collectives if op not in OPS]
    if bad:
        raise ConfigError(f"unknown collective(s) {bad}; known: {', '.join(OPS)}")
    overrides, tolerance = _validate_expected(expected)
    fault_list = parse_faults(os.environ.get(FAULT_ENV) if faults is None else faults)
    threads = torch.get_num_threads()
    values, sources = resolve_expected(device, dtype, threads, overrides, rebaseline)
    backend = "nccl" if device == "cuda" else "gloo"
    host = socket.gethostname()
    deadline = t_start + timeout_s

    # Neighbour group (multi-host) or the reason it is skipped.
    hosts, index, host_source = discover_hosts(peer_hosts, host_index)
    checks: list[Check] = []
    group_hosts: list[str] = []
    if len(hosts) < 2:
        checks.append(Check("neighbor-all-reduce", "skip",
                            "skipped: single host (no --peer-hosts, MYRIA_HOSTS or Slurm step "
                            "node list)"))
    elif index is None:
        checks.append(Check("neighbor-all-reduce", "skip",
                            f"skipped: this host ({host}) is not found in the host list from "
                            f"{host_source}; give --host-index or MYRIA_HOST_INDEX"))
    else:
        members = neighbor_group(len(hosts), index)
        group_hosts = [hosts[i] for i in members]
        try:
            base = peer_port or int(os.environ.get("MYRIA_DOCTOR_PORT", DEFAULT_PEER_PORT))
        except ValueError:
            raise ConfigError(f"MYRIA_DOCTOR_PORT={os.environ['MYRIA_DOCTOR_PORT']!r} is not "
                              "a port number") from None
        neighbor_cfg = dict(group_hosts=group_hosts, pos=members.index(index),
                            port=base + members[0])

    if nproc == 1:
        for name in [op.replace("_", "-") for op in collectives] + ["p2p-loopback"]:
            checks.append(Check(name, "skip", "skipped: single local rank (--nproc 1)"))

    cfg: dict[str, Any] = dict(
        nproc=nproc, device=device, backend=backend, dtype=dtype, threads=threads,
        faults=[asdict(f) for f in fault_list], expected=values, sources=sources,
        tolerance=tolerance, collectives=list(collectives), deadline=deadline - 2,
        gemm_s=gemm_seconds if gemm_seconds is not None else (0.5 if device == "cpu" else 1.0),
    )
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    release = ctx.Event()
    procs: dict[Any, Any] = {}
    started: list[Any] = []
    # The local rendezvous: a TCPStore served from this process on 127.0.0.1 and a free port.
    store = _serve_store("127.0.0.1", 0, _dt.timedelta(seconds=timeout_s))
    cfg["port"] = store.port
    received: list[Check] = []
    try:
        if group_hosts:
            ncfg = dict(cfg, **neighbor_cfg, deadline=deadline - 3)
            procs["neighbor"] = ctx.Process(target=_neighbor_worker, args=(ncfg, q, release),
                                            daemon=True, name="myria-doctor-neighbor")
        for r in range(nproc):
            procs[r] = ctx.Process(target=_worker, args=(r, cfg, q), daemon=True,
                                   name=f"myria-doctor-rank{r}")
        for p in procs.values():
            p.start()
            started.append(p)
        received = _collect(procs, q, release, nproc, deadline)
    finally:
        release.set()
        for p in started:
            if p.is_alive():
                p.terminate()
        for p in started:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        del store
        q.close()
    checks.extend(received)
    order = {name: i for i, name in enumerate(CHECKS)}
    checks.sort(key=lambda c: (order.get(c.name, len(order)),
                               -1 if c.rank is None else c.rank))
    import myria

    return HostReport(
        host=host, nproc=nproc, device=device, backend=backend, dtype=dtype, checks=checks,
        expected=values, expected_sources=sources, tolerance=tolerance,
        faults=[f.describe() for f in fault_list], neighbors=group_hosts,
        started_at=started_at, duration_s=round(time.time() - t_start, 2),
        versions={"myria": myria.__version__, "torch": torch.__version__,
                  "python": platform.python_version()},
    )


def _collect(procs: dict[Any, Any], q: Any, release: Any, nproc: int,
             deadline: float) -> list[Check]:
    """Read worker messages until every worker is done, failed, or the deadline passes."""
    checks: list[Check] = []
    phase = {k: "startup" for k in procs}
    pending = set(procs)
    errors: dict[Any, str] = {}
    local_deadline = deadline
    while pending:
        now = time.time()
        local_pending = pending & set(range(nproc))
        if local_pending and now >= local_deadline:
            for k in local_pending:     # hung (or waiting on a failed rank): stop them
                errors.setdefault(k, f"did not finish in time: still in {phase[k]}")
                pending.discard(k)
                procs[k].terminate()
            continue
        if not local_pending:
            release.set()               # the neighbour check may start
        if now >= deadline:
            break
        try:
            kind, who, *payload = q.get(timeout=0.2)
        except _queue.Empty:
            for k in list(pending):
                p = procs[k]
                if not p.is_alive() and p.exitcode not in (0, None):
                    pending.discard(k)
                    errors.setdefault(k, f"exited with code {p.exitcode} during "
                                         f"{phase[k]}")
                    if k != "neighbor":
                        local_deadline = min(local_deadline, time.time() + 5)
            continue
        if kind == "phase":
            phase[who] = payload[0]
        elif kind == "check":
            checks.append(Check(**payload[0]))
        elif kind == "done":
            pending.discard(who)
        elif kind == "error":
            where, msg, tb = payload
            pending.discard(who)
            errors[who] = f"{msg} (during {where})"
            if who != "neighbor":
                # The other ranks are probably stuck in a collective with this one.
                local_deadline = min(local_deadline, time.time() + 5)
            print(f"myria doctor: worker {who} failed:\n{tb}", file=sys.stderr)
    for k in sorted(pending, key=str):
        errors.setdefault(k, f"did not finish in time: still in {phase[k]}")
    for k, msg in sorted(errors.items(), key=lambda kv: str(kv[0])):
        if k == "neighbor":
            checks = [c for c in checks if c.name != "neighbor-all-reduce"]
            checks.append(Check("neighbor-all-reduce", "fail", f"neighbour check: {msg}",
                                details={"error": msg}))
        else:
            checks.append(Check("workers", "fail", f"local rank {k}: {msg}", k,
                                details={"error": msg, "phase": phase[k]}))
    return checks


# ---------------------------------------------------------------------------------------------
# Output and CLI


def render_report(report: HostReport, file: Any = None) -> None:
    """Print the per-check table and the host's overall verdict with rich."""
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    file = file or sys.stdout
    console = Console(file=file, width=None if file.isatty() else 150, highlight=False)
    table = Table(title=f"myria doctor: {report.host} ({report.nproc} local ranks, "
                  f"{report.device}/{report.backend}, {report.dtype})", title_justify="left")
    for col in ("check", "rank", "status", "measured", "expected", "reason"):
        table.add_column(col, overflow="fold", no_wrap=col != "reason")
    style = {"pass": "green", "fail": "bold red", "skip": "yellow"}
    for c in report.checks:
        unit = f" {c.unit}" if c.unit and c.measured is not None else ""
        table.add_row(c.name, "all" if c.rank is None else str(c.rank),
                      Text(c.status.upper(), style=style[c.status]),
                      Text(_fmt(c.measured) + unit), Text(_fmt(c.expected)), Text(c.reason))
    console.print(table)
    if report.faults:
        console.print(Text(f"fault hook {FAULT_ENV} active: {', '.join(report.faults)}",
                           style="yellow"))
    verdict = Text("PASS", style="bold green") if report.passed else \
        Text("FAIL", style="bold red")
    console.print(Text.assemble(verdict, f" {report.host}: {report.counts}"))
    for c in report.failures:
        console.print(Text(f"  {_label(c)}: {c.reason}"))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = (
        "expected figures (--expect KEY=VALUE):\n"
        + "\n".join(f"  {k:<30} {v}" for k, v in EXPECTED_KEYS.items())
        + f"\n\ntest hook: {FAULT_ENV}=slow-gemm|wrong-gemm[:rank=R][,...] injects a slow or "
        "wrong GEMM.\nexit status: 0 if the host passes, 1 if a check fails, 2 on bad usage."
    )
    parser.add_argument("--nproc", type=int, default=None,
                        help="local ranks (default: 2 on CPU, the GPU count on GPU)")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--dtype", choices=DTYPES, default=None,
                        help="GEMM dtype, the training dtype (default: float32 on CPU, "
                             "bfloat16 on GPU)")
    parser.add_argument("--expect", action="append", default=[], metavar="KEY=VALUE",
                        help="override an expected figure (repeatable; keys below)")
    parser.add_argument("--tolerance", type=float, default=None,
                        help="fail a throughput below this fraction of its expected figure "
                             f"(default {DEFAULT_TOLERANCE})")
    parser.add_argument("--collectives", default="all_reduce,all_to_all",
                        help="local collectives to test (comma-separated: all_reduce, "
                             "all_to_all, all_gather, reduce_scatter)")
    parser.add_argument("--timeout", type=float, default=60.0,
                        help="seconds before a hung check counts as failed (default 60)")
    parser.add_argument("--json", default=None, metavar="PATH",
                        help="write the JSON report here ('-' prints it to stdout and the table "
                             "to stderr)")
    parser.add_argument("--run-dir", default=None,
                        help="write the JSON report to RUN_DIR/doctor/HOST.json")
    parser.add_argument("--peer-hosts", default=None,
                        help="comma-separated hosts of a multi-host launch, in switch order "
                             "(default: MYRIA_HOSTS or the Slurm step node list)")
    parser.add_argument("--host-index", type=int, default=None,
                        help="this host's position in the host list (default: by host name)")
    parser.add_argument("--peer-port", type=int, default=None,
                        help=f"rendezvous port of the neighbour check (default "
                             f"{DEFAULT_PEER_PORT} + the group's first index)")
    parser.add_argument("--rebaseline", action="store_true",
                        help="re-measure the cached CPU peak and memory bandwidth baselines")


def _parse_expect(items: Sequence[str]) -> dict[str, float]:
    out: dict[str, float] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"--expect {item!r}: use KEY=VALUE; keys: "
                              f"{', '.join(EXPECTED_KEYS)}")
        try:
            out[key.strip()] = float(value)
        except ValueError:
            raise ConfigError(f"--expect {item!r}: {value!r} is not a number") from None
    return out


def default_report_path(host: str) -> Path:
    from myria.device import cache_dir

    root = cache_dir()
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    return root / "doctor" / f"{host}-{stamp}.json"


def run(args: argparse.Namespace) -> int:
    expected = _parse_expect(args.expect)
    if args.tolerance is not None:
        expected["tolerance"] = args.tolerance
    device = args.device
    nproc = args.nproc
    if nproc is None:
        import torch

        use_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
        nproc = torch.cuda.device_count() if use_cuda else 2
    peers = [h for h in args.peer_hosts.split(",")] if args.peer_hosts else None
    collectives = [c.strip() for c in args.collectives.split(",") if c.strip()]
    report = run_diagnostics(nproc, expected, args.timeout, device=device, dtype=args.dtype,
                             collectives=collectives, peer_hosts=peers,
                             host_index=args.host_index, peer_port=args.peer_port,
                             rebaseline=args.rebaseline)
    to_stdout = args.json == "-"
    render_report(report, file=sys.stderr if to_stdout else sys.stdout)
    if to_stdout:
        print(report.to_json())
    else:
        if args.json:
            path = Path(args.json)
        elif args.run_dir:
            path = Path(args.run_dir) / "doctor" / f"{report.host}.json"
        else:
            path = default_report_path(report.host)
        try:
            report.write_json(path)
        except OSError as e:
            raise MyriaError(f"cannot write the JSON report to {path}: {e}") from None
        print(f"JSON report: {path}")
    return 0 if report.passed else 1
