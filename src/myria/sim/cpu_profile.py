"""Measured figures of this CPU as the analytic model reads them: `CpuProfile` and its cache.

A leaf of the simulator: it imports no other part of `myria.sim` (the step model turns a profile
into its `Efficiency`, `myria.sim.perf.efficiency_for`), so `hardware` can load a profile and
`operators` can read `hardware`'s constants without a circle.
`myria.sim.measure.cpu` measures (torch, the trainer's model, gloo) and writes the cache
`myria.device.cache_dir() / "cpu_profile.json"`, keyed by `myria.device.cpu_key(threads)` and the
number of processes; this module only reads it, so the analytic model imports no trainer code.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# `shape` arguments are a myria.sim.operators.LayerShape, read by attribute: this module imports
# no other part of the simulator (it sits below hardware.py and operators.py)
LayerShape = Any

PROFILE_FILE = "cpu_profile.json"


def default_threads(nproc: int) -> int:
    """Threads per process as the trainer sets them: cores // local processes (at least 1)."""
    return max(1, (os.cpu_count() or 1) // max(1, nproc))


def quiet_load(threads: int, nproc: int = 1) -> float:
    """The highest load average, read as a measurement ends, at which `nproc` measuring
    processes of `threads` threads had the cores to themselves: their own threads, and half a
    core for everything else."""
    return threads * max(1, nproc) + 0.5


def quiet_to_measure(threads: int, nproc: int = 1) -> float:
    """The highest load average, read before measuring, that leaves `nproc` processes of
    `threads` threads their cores: what the cores they will not use hold, and half a core."""
    return max(0.0, (os.cpu_count() or 1) - threads * max(1, nproc)) + 0.5


def busy_note(prof: CpuProfile | None, command: str) -> str:
    """The caveat a prediction priced from `prof` carries when its figures are a busy host's
    (`CpuProfile.busy`), with what to do, for the output of `command`; else ""."""
    why = prof.busy() if prof is not None else ""
    if not why:
        return ""
    return (f"{why}; run `{command}` again on a quiet host: figures timed on a busy one are "
            f"measured again the first time the load average is at most "
            f"{quiet_to_measure(prof.threads, prof.nproc):g}")


@dataclass(frozen=True)
class CpuProfile:
    """What the simulator needs about this CPU at `threads` threads per process (hashable)."""

    threads: int
    rates: tuple = ()                 # ((rate_key, FLOP/s), ...): GEMMs and SDPA by shape
    elementwise_bw: float = 0.0       # bytes/s of eager elementwise kernels
    kernel_overhead_s: float = 0.0    # dispatch time of one eager kernel
    optimizer_s_per_param: float = 0.0
    nproc: int = 1
    gloo: tuple = ()                  # ((op, alpha_s, busbw bytes/s), ...) among nproc processes
    fsdp: tuple = ()                  # ((unit bytes, block s, root s, reduce s), ...): FSDP2
    # FSDP2 around this model's own block and ends, with their compute (`_fsdp_in_context`):
    # (block s per microbatch, block reduce s per step, root s per microbatch, root reduce s)
    fsdp_context: tuple = ()
    source: str = "measured"
    clock: str = ""                   # what compute was timed on: "thread CPU time" or "wall"
    loadavg: float = 0.0              # the host's load average when it was measured

    def fsdp_time(self, nbytes: float, kind: str) -> float | None:
        """Seconds FSDP2 adds for a unit of `nbytes`: "block" (per microbatch, resharded after
        forward), "root" (per microbatch, kept), "reduce" (per step); piecewise linear in the
        measured unit sizes, extrapolated along the last segment. None if not measured."""
        col = {"block": 1, "root": 2, "reduce": 3}[kind]
        pts = [(p[0], p[col]) for p in self.fsdp]
        if not pts:
            return None
        if len(pts) == 1:
            return pts[0][1] * nbytes / pts[0][0]
        for (x0, t0), (x1, t1) in zip(pts, pts[1:]):
            if nbytes <= x1 or (x1, t1) == pts[-1]:
                return max(0.0, t0 + (t1 - t0) * (nbytes - x0) / (x1 - x0))
        return None

    def busy(self) -> str:
        """Why these figures are not a quiet host's, or "": compute timed on the wall clock
        (several threads per process) while other work held the cores (load average above
        the measuring processes' own threads). Threads that wait for a descheduled peer inside
        a kernel make such figures too slow by anything up to hundreds of times, shape by shape."""
        if self.clock == "thread CPU time" or not self.loadavg > quiet_load(self.threads,
                                                                             self.nproc):
            return ""
        return (f"this CPU's figures were timed on the wall clock ({self.threads} threads per "
                f"process) at load average {self.loadavg:.1f} on {os.cpu_count()} cores: other "
                "jobs held the cores, so the predicted step is too long")

    def gloo_fit(self, op: str) -> tuple[float, float] | None:
        """(alpha_s, bandwidth) of a collective ("all_reduce", ..., "p2p"), if measured."""
        for name, alpha, bw in self.gloo:
            if name == op:
                return alpha, bw
        return None


# -- cache ----------------------------------------------------------------------------------------
def profile_path() -> Path:
    """The cache file of measured CPU profiles (under `myria.device.cache_dir()`)."""
    from myria.device import cache_dir

    return cache_dir() / PROFILE_FILE



def read_cache() -> dict:
    from myria.device import read_cache_file

    return read_cache_file(profile_path())


def write_cache(cache: dict) -> None:
    from myria.device import write_cache_file

    write_cache_file(profile_path(), cache)


def update_cache(key: str, entry: dict, replace: bool = False) -> None:
    """Merge `entry` into the cache under `key` (re-read first: other processes write too), or
    with `replace` put it in place of what was there. A merged entry keeps the highest load
    average of the measurements in it: its figures are as trustworthy as its worst ones."""
    cache = read_cache()
    old = {} if replace else cache.get(key, {})
    load = [x for x in (old.get("loadavg"), entry.get("loadavg")) if isinstance(x, (int, float))]
    for k, v in entry.items():
        if isinstance(v, dict) and isinstance(old.get(k), dict):
            old[k] = {**old[k], **v}
        else:
            old[k] = v
    if load:
        old["loadavg"] = max(load)
    cache[key] = old
    write_cache(cache)


def key_str(key: tuple) -> str:
    return ",".join(str(k) for k in key)


def key_tuple(text: str) -> tuple:
    parts = text.split(",")
    return (parts[0], *(int(p) if p.lstrip("-").isdigit() else p for p in parts[1:]))


def compute_key(threads: int, nproc: int = 1) -> str:
    from myria.device import cpu_key

    return f"{cpu_key(threads)}|procs={nproc}"


def gloo_key(threads: int, nproc: int) -> str:
    from myria.device import cpu_key

    return f"{cpu_key(threads)}|gloo|procs={nproc}"


def eager_key(shape: LayerShape) -> str:
    """Cache key of the eager elementwise bandwidths of a model shape."""
    return ",".join(str(x) for x in (shape.arch, shape.micro_batch, shape.seq_len, shape.hidden,
                                     shape.heads, shape.kv_heads, shape.ffn, shape.vocab,
                                     shape.ce_chunk))


def load_profile(threads: int, nproc: int = 1, shape: LayerShape | None = None
                 ) -> CpuProfile | None:
    """The cached profile of this CPU at `threads` threads (None if never measured).

    With `shape`, the elementwise bandwidths measured on that model's own kernels (if cached)
    join the rates as ("bw", "eltwise") and ("bw", "head").
    """
    cache = read_cache()
    entry = cache.get(compute_key(threads, nproc))
    if not entry or not entry.get("elementwise_bw"):
        return None
    table = {key_tuple(k): float(v) for k, v in entry.get("rates", {}).items()}
    # rates timed inside the running model win over isolated calls of the same shape
    table.update({key_tuple(k): float(v) for k, v in entry.get("rates_in_situ", {}).items()})
    if shape is not None and eager_key(shape) in entry.get("eager_bw", {}):
        block, head = entry["eager_bw"][eager_key(shape)]
        table[("bw", "eltwise")], table[("bw", "head")] = float(block), float(head)
    rates = tuple(sorted(table.items()))
    gloo: tuple = ()
    fsdp: tuple = ()
    context: tuple = ()
    if nproc > 1:
        g = cache.get(gloo_key(threads, nproc), {})
        gloo = tuple(sorted((op, float(a), float(b)) for op, (a, b) in g.get("fits", {}).items()))
        fsdp = tuple(sorted((float(b), *(float(t) for t in ts))
                            for b, ts in g.get("fsdp", {}).items()))
        if shape is not None and eager_key(shape) in g.get("fsdp_context", {}):
            context = tuple(float(t) for t in g["fsdp_context"][eager_key(shape)])
    return CpuProfile(threads=threads, rates=rates, elementwise_bw=float(entry["elementwise_bw"]),
                      kernel_overhead_s=float(entry["kernel_overhead_s"]),
                      optimizer_s_per_param=float(entry["optimizer_s_per_param"]),
                      nproc=nproc, gloo=gloo, fsdp=fsdp, fsdp_context=context,
                      source=_source(entry, threads), clock=str(entry.get("clock", "")),
                      loadavg=float(entry.get("loadavg") or 0.0))


def _source(entry: dict, threads: int) -> str:
    """"measured WHEN (N threads, CLOCK, load average L)": when and how a profile was taken."""
    how = [f"{threads} threads"]
    if entry.get("clock"):
        how.append(f"timed on {entry['clock']}")
    if isinstance(entry.get("loadavg"), (int, float)):
        how.append(f"load average {entry['loadavg']:.1f}")
    return f"measured {entry.get('measured_at', '?')} ({', '.join(how)})"
