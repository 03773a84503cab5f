"""The figures checks are judged against, where each comes from, and the judgement.

On CPU the GEMM peak and the memory bandwidth are this host's own measured history
(`myria.device.measured_figure`: best of several probes, raised never lowered); on GPU the
datasheet figure times an achievable fraction; `--expect` overrides either. A throughput below
`tolerance` of its figure is re-measured before it counts (`remeasure`), and then judged
(`judge`): against the host's peers first (a local rank far below the others fails), against its
own history second (every rank equally low, or nothing to compare with: a warning with the
evidence, since a busy shared host reads low too). Configured and datasheet figures fail.
"""

from __future__ import annotations

import math
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

from myria.device import measure_copy_bandwidth
from myria.errors import ConfigError
from myria.resilience.checks.memory import MEMBW_BYTES
from myria.resilience.checks.report import DEFAULT_TOLERANCE, Check, fmt, pct

# Sources of expected figures that are this host's own measured history (judged softly).
OWN_HISTORY = "own history: "

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


def throughput_check(name: str, rank: int | None, measured: float, expected: float | None,
                      source: str, tolerance: float, unit: str, note: str = "",
                      details: dict[str, Any] | None = None) -> Check:
    """Pass when `measured` >= tolerance x `expected`; skip when there is no expected figure."""
    details = dict(details or {}, expected_source=source, tolerance=tolerance, note=note)
    if expected is None:
        return Check(name, "skip", f"measured {fmt(measured)} {unit}{note}; no expected figure "
                     f"({source}): set one with --expect", rank, measured, None, unit, details)
    frac = measured / expected if expected > 0 else float("inf")
    ok = frac >= tolerance
    verdict = "" if ok else f"; below the {tolerance:.0%} floor"
    return Check(name, "pass" if ok else "fail",
                 f"{fmt(measured)} {unit} is {pct(frac)} of the expected {fmt(expected)}{note} "
                 f"[expected: {source}]{verdict}", rank, measured, expected, unit, details)



def resolve_expected(device_type: str, dtype: str, threads: int,
                     overrides: dict[str, float] | None = None, refresh: bool = False,
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

        if "gemm_tflops" not in overrides:
            if dtype == "float32":
                from myria.device import cpu_device_spec

                spec = cpu_device_spec(threads=threads, refresh=refresh)
                put("gemm_tflops", spec.peak_fp32_tflops, f"{OWN_HISTORY}CPU peak, {spec.source}")
            else:
                from myria.device import measure_matmul_tflops, measured_figure

                fig = measured_figure(f"{dtype}_matmul_tflops", threads,
                                      lambda: measure_matmul_tflops(dtype=dtype, threads=threads,
                                                                    seconds=0.2),
                                      refresh=refresh, what=f"{dtype} matmul")
                put("gemm_tflops", fig.value, f"{OWN_HISTORY}CPU {dtype} peak, {fig.source}")
        else:
            put("gemm_tflops", None, "")
        if "membw_gbs" not in overrides:
            from myria.device import measured_figure

            def _measure_bw() -> float:
                return measure_copy_bandwidth("cpu", MEMBW_BYTES["cpu"], seconds=0.1,
                                              threads=threads)

            fig = measured_figure("membw_gbs", threads, _measure_bw, refresh=refresh,
                                  what="memory copy")
            put("membw_gbs", fig.value, f"{OWN_HISTORY}{fig.source}")
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


def validate_expected(expected: dict[str, Any] | None) -> tuple[dict[str, float], float]:
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
        if key == "tolerance":
            if not 0 < v <= 1:
                raise ConfigError(f"tolerance={value!r} must be a fraction in (0, 1]")
            tolerance = v
            continue
        if not (v > 0 and math.isfinite(v)):
            raise ConfigError(f"expected figure {key}={value!r} must be a positive number")
        out[key] = v
    return out, tolerance




# ---------------------------------------------------------------------------------------------
# Judgement


def remeasure(check: Check, measure: Callable[[], float], tries: int = 2,
              pause_s: float = 0.3) -> Check:
    """A failed throughput check measured `tries` more times (a pause between): the best sample
    decides; every sample is kept in `details["samples"]`."""
    if check.status != "fail" or check.expected is None or check.measured is None:
        return check
    samples = [check.measured]
    for _ in range(tries):
        time.sleep(pause_s)
        samples.append(float(measure()))
    best = max(samples)
    d = check.details
    again = throughput_check(check.name, check.rank, best, check.expected,
                             d.get("expected_source", ""), d.get("tolerance", DEFAULT_TOLERANCE),
                             check.unit, f"{d.get('note', '')} (best of {len(samples)} "
                             "measurements)", d)
    again.details["samples"] = samples
    return again


def host_load() -> dict[str, Any]:
    """The host's load average and core count (the evidence of a busy host)."""
    try:
        load = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        load = None
    return {"load_average": load, "cores": os.cpu_count()}


def judge(checks: list[Check], load: dict | None = None) -> list[Check]:
    """Peers first, own history second: a throughput check that failed against this host's own
    measured history stays failed only when the rank is also below `tolerance` of the median of
    its peers (the other local ranks' same check) on a host that is not oversubscribed; with
    every peer as low, or no peer, or more runnable processes than cores (`load`, default the
    host's: the ranks' checks ran at different moments of a varying load, so they are not
    comparable), it becomes a warning with the evidence. Failures against configured or
    datasheet figures stand."""
    ev = load or host_load()
    one_minute = (ev.get("load_average") or [0.0])[0]   # [1, 5, 15 minutes]
    crowded = bool(ev.get("cores")) and one_minute > ev["cores"]
    out = []
    for c in checks:
        src = c.details.get("expected_source", "") if c.details else ""
        if c.status != "fail" or not src.startswith(OWN_HISTORY) or c.measured is None:
            out.append(c)
            continue
        peers = [p.measured for p in checks if p.name == c.name and p.rank != c.rank
                 and p.measured is not None]
        tol = c.details.get("tolerance", DEFAULT_TOLERANCE)
        c.details.update(ev, peers=peers)
        odd = bool(peers) and c.measured < tol * statistics.median(peers)
        if odd and not crowded:
            c.reason += (f"; {pct(c.measured / statistics.median(peers))} of its peers' "
                         f"median {fmt(statistics.median(peers))}: this rank is the odd one out")
        else:
            why = ("its peers, measured at other moments of an oversubscribed host, are not "
                   "comparable" if odd else
                   "its peers read as low" if peers else "no peer to compare with")
            c.status = "warn"
            c.reason += (f"; {why} and the figure is this host's own history: a busy host reads "
                         f"low too (load {ev['load_average']} on {ev['cores']} cores), so this "
                         "is a warning, not a fault")
        out.append(c)
    return out
