"""Self-check diagnostics of one host (`myria doctor`), also run by the supervisor before a restart.

Checks (each family is a module of `myria.resilience.checks`), each with a pass, warn, fail or
skip status and the reason (measured vs expected, with the evidence):

1. `gemm-correctness` (per local rank): random matmuls in the training dtype against a float64
   reference of the same (rounded) inputs, within the rounding bound.
2. `golden` (per local rank): integer GEMM, reduction and softmax with exact known answers.
3. `gemm-throughput` (per local rank): best TFLOP/s of repeated matmuls against the expected
   figure: on CPU this host's own measured peak (`myria.device.measured_figure`); on GPU the
   datasheet peak times an achievable fraction. Below `tolerance` (default 0.5) it is measured
   twice more, and then judged against the other local ranks first: a rank far below its peers
   fails; every rank as low (a busy host) is a warning, never a fault, on CPU.
4. `memory-bandwidth`: a large buffer copy (GB/s counting read + write) against this host's
   measured history (CPU; once per host, the ranks share the memory) or the datasheet HBM
   bandwidth times an achievable fraction (GPU, per rank); re-measured and judged as above.
5. `all-reduce`, `all-to-all` (optionally `all-gather`, `reduce-scatter`) among the `nproc`
   local ranks (gloo on CPU, NCCL on GPU): the data checked, the bus bandwidth (nccl-tests'
   formula, `myria.sim.measure.collective`) against the expected value (on CPU a modest floor).
6. `neighbor-all-reduce`: under a multi-host launch this host all-reduces one buffer with its
   neighbour (hosts paired in list order, the last three together when the count is odd; the
   list from `--peer-hosts`, `MYRIA_HOSTS` or Slurm's `SLURM_STEP_NODELIST`, the rendezvous on
   `--peer-port` plus the group's first index: docs/robustness.md). On one host: skipped.
7. `p2p-loopback`: a send/recv ring among the local ranks: payload integrity and hop latency.

A worker that crashes or hangs fails the `workers` check, naming the rank and its check (its
traceback in the check's details). The time limit counts time without progress from the
workers' start (`_collect`): that watchdog alone tells a hung rank from a slow one, so a rank
waiting for another (the rendezvous, the compute checks one rank at a time on a CPU) never
fails by a timeout of its own. The host passes when no check fails (warnings are evidence, not
faults). Local rendezvous binds
127.0.0.1 only. Test hook: MYRIA_DOCTOR_FAULT (`myria.resilience.checks.hooks`).

Python API (for the supervisor): `run_diagnostics(nproc, expected, timeout_s) -> HostReport`;
whether it runs them before a restart: myria.resilience.decision.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import ipaddress
import os
import platform
import queue as _queue
import socket
import sys
import time
import traceback
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from myria.device import measure_copy_bandwidth
from myria.errors import ConfigError, MyriaError
from myria.resilience.checks.collectives import (  # noqa: F401 - the doctor's public API
    collective_check,
    discover_hosts,
    expand_nodelist,
    neighbor_group,
)
from myria.resilience.checks.compute import (  # noqa: F401
    check_gemm_correctness,
    gemm_error_bound,
    measure_gemm_tflops,
)
from myria.resilience.checks.expected import (  # noqa: F401
    EXPECTED_KEYS,
    judge,
    remeasure,
    resolve_expected,
    throughput_check,
    validate_expected,
)
from myria.resilience.checks.golden import check_golden
from myria.resilience.checks.hooks import (
    FAULT_ENV,
    DoctorFault,
    find_fault,
    parse_faults,  # noqa: F401
)
from myria.resilience.checks.memory import MEMBW_BYTES
from myria.resilience.checks.report import (  # noqa: F401
    CHECKS,
    DEFAULT_TOLERANCE,
    Check,
    HostReport,
    fmt,
    label,
)

DEFAULT_PEER_PORT = 29571
DTYPES = ("float32", "bfloat16", "float16")


# ---------------------------------------------------------------------------------------------
# Worker processes

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


# A local rank's store and process-group timeout: longer than any check (the collector ends a
# rank that stops making progress, and `_exit_with_collector` one whose collector is gone).
_PEER_WAIT = _dt.timedelta(hours=6)


def _exit_with_collector(poll_s: float = 1.0) -> None:
    """End this worker when the process that started it (the collector) is gone."""
    import threading

    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        os._exit(1)

    threading.Thread(target=watch, name="myria-doctor-parent-watch", daemon=True).start()


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

    _put(q, "phase", rank, "golden")
    _put(q, "check", rank, check_golden(device, cfg["dtype"], rank=rank, faults=faults,
                                        seed=rank).to_dict())

    _put(q, "phase", rank, "gemm-throughput")
    slow = find_fault(faults, "slow-gemm", rank)

    def gemm() -> float:
        return measure_gemm_tflops(device, cfg["dtype"], n=_GEMM_N[dev], seconds=cfg["gemm_s"],
                                   reps=_GEMM_REPS[dev], slow=slow,
                                   expected_tflops=exp.get("gemm_tflops"))

    hook = f" (fault hook {slow.describe()} active)" if slow else ""
    c = throughput_check("gemm-throughput", rank, gemm(), exp.get("gemm_tflops"),
                         src.get("gemm_tflops", ""), tol, "TFLOP/s", hook,
                         {"n": _GEMM_N[dev], "dtype": cfg["dtype"],
                          "fault": slow.describe() if slow else None})
    _put(q, "check", rank, remeasure(c, gemm).to_dict())

    if dev == "cuda" or rank == 0:      # host memory is shared: measured once on CPU
        _put(q, "phase", rank, "memory-bandwidth")

        def membw() -> float:
            return measure_copy_bandwidth(device, MEMBW_BYTES[dev])

        c = throughput_check("memory-bandwidth", rank if dev == "cuda" else None, membw(),
                             exp.get("membw_gbs"), src.get("membw_gbs", ""), tol, "GB/s",
                             details={"bytes": MEMBW_BYTES[dev]})
        _put(q, "check", rank, remeasure(c, membw).to_dict())


def _worker(rank: int, cfg: dict[str, Any], q: Any) -> None:
    """One local rank: compute checks (taking turns on CPU), then collectives and the ring."""
    phase = "startup"
    try:
        import warnings

        warnings.filterwarnings("ignore")
        os.environ["GLOO_SOCKET_IFNAME"] = "lo"     # local ranks talk over loopback only
        import torch
        import torch.distributed as dist

        from myria.sim.measure import collective as cb

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
        _exit_with_collector()
        # The collector's no-progress watchdog tells a hung rank from a slow one; a rank waits
        # here (a peer still importing torch, its compute checks one rank at a time on a CPU)
        # as long as the collector lets it, so the store's and the group's own timeout never
        # decide.
        timeout = _PEER_WAIT
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
                    c = collective_check(name, res, exp.get(key), src.get(key, ""), tol)
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
                    status, reason = "fail", f"hop latency {fmt(p2p.latency_us)} us > " \
                        f"ceiling {fmt(lim)} us ({src.get('p2p_latency_max_us', '')})"
                else:
                    status = "pass"
                    reason = (f"ring of {n}: payload intact, hop latency "
                              f"{fmt(p2p.latency_us)} us <= {fmt(lim)} us, "
                              f"{fmt(p2p.bandwidth_gbs)} GB/s per link")
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

        from myria.sim.measure import collective as cb

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
        c = collective_check("neighbor-all-reduce", res, cfg["expected"].get(k),
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


def _neighbour_plan(peer_hosts: list[str] | None, host_index: int | None,
                    peer_port: int | None, host: str) -> tuple[Check | None, dict | None]:
    """The neighbour check of a multi-host launch: (None, its group's hosts, this host's
    position and the rendezvous port), or (the skipped check, None). A host index and peer
    port serve only a list of several hosts: with one (a generic `srun myria doctor
    --host-index $SLURM_NODEID` on one node) the skipped check notes them unused; a port
    outside 1-65535, or an index outside a list of several hosts, is refused."""
    if peer_port is not None and not _is_port(peer_port):
        raise ConfigError(f"peer port {peer_port!r}: not a port number (1-65535)")
    hosts, index, host_source = discover_hosts(peer_hosts)
    if len(hosts) >= 2 and host_index is not None:
        hosts, index, host_source = discover_hosts(peer_hosts, host_index)
    if len(hosts) < 2:
        unused = " and ".join(f"{f} {v}" for f, v in (("--host-index", host_index),
                                                      ("--peer-port", peer_port))
                              if v is not None)
        where = ("no --peer-hosts, MYRIA_HOSTS or Slurm step node list"
                 if host_source == "this host only" else f"the host list from {host_source}")
        return Check("neighbor-all-reduce", "skip", f"skipped: single host ({where}"
                     + (f"; {unused} not used" if unused else "") + ")"), None
    if index is None:
        return Check("neighbor-all-reduce", "skip",
                     f"skipped: this host ({host}) is not found in the host list from "
                     f"{host_source}; give --host-index or MYRIA_HOST_INDEX"), None
    members = neighbor_group(len(hosts), index)
    try:
        base = peer_port or int(os.environ.get("MYRIA_DOCTOR_PORT", DEFAULT_PEER_PORT))
    except ValueError:
        raise ConfigError(f"MYRIA_DOCTOR_PORT={os.environ['MYRIA_DOCTOR_PORT']!r} is not "
                          "a port number") from None
    if not _is_port(base + members[0]):
        raise ConfigError(f"peer port {base} + the group's first index {members[0]} = "
                          f"{base + members[0]}: not a port number (1-65535)")
    return None, dict(group_hosts=[hosts[i] for i in members], pos=members.index(index),
                      port=base + members[0])


def run_diagnostics(nproc: int = 2, expected: dict[str, float] | None = None,
                    timeout_s: float = 60, *, device: str = "auto", dtype: str | None = None,
                    collectives: Sequence[str] = ("all_reduce", "all_to_all"),
                    peer_hosts: Sequence[str] | None = None, host_index: int | None = None,
                    peer_port: int | None = None, refresh: bool = False,
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

    if not isinstance(nproc, int) or nproc < 1:   # answered before torch is imported
        raise ConfigError(f"nproc={nproc!r}: must be an integer >= 1 (local ranks)")
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
    from myria.sim.measure.collective import OPS

    bad = [op for op in collectives if op not in OPS]
    if bad:
        from myria.config import suggest

        raise ConfigError(f"unknown collective(s) {bad}{suggest(bad[0], OPS)}; known: "
                          f"{', '.join(OPS)}")
    overrides, tolerance = validate_expected(expected)
    fault_list = parse_faults(os.environ.get(FAULT_ENV) if faults is None else faults)
    host = socket.gethostname()

    skipped, neighbor_cfg = _neighbour_plan(peer_hosts, host_index, peer_port, host)
    checks: list[Check] = [skipped] if skipped else []
    group_hosts: list[str] = neighbor_cfg["group_hosts"] if neighbor_cfg else []

    threads = torch.get_num_threads()
    values, sources = resolve_expected(device, dtype, threads, overrides, refresh)
    backend = "nccl" if device == "cuda" else "gloo"
    if nproc == 1:
        for name in [op.replace("_", "-") for op in collectives] + ["p2p-loopback"]:
            checks.append(Check(name, "skip", "skipped: single local rank (--nproc 1)"))

    cfg: dict[str, Any] = dict(
        nproc=nproc, device=device, backend=backend, dtype=dtype, threads=threads,
        faults=[asdict(f) for f in fault_list], expected=values, sources=sources,
        tolerance=tolerance, collectives=list(collectives),
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
    # the time without progress counts from the workers' start (the expected figures measured
    # above are this process's own progress)
    deadline = time.time() + timeout_s
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
    checks.extend(judge(received))
    if device == "cpu" and not fault_list:
        _learn(checks, sources, dtype, threads)
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


def _is_port(n: Any) -> bool:
    return isinstance(n, int) and 1 <= n <= 65535


def _learn(checks: list[Check], sources: dict[str, str], dtype: str, threads: int) -> None:
    """Merge this run's CPU throughput measurements into the host's history: a figure measured
    higher now raises the expectation of later checks (a busy first measurement does not
    survive); a lower one is kept as a sample and never lowers it."""
    from myria.device import record_samples
    from myria.resilience.checks.expected import OWN_HISTORY

    names = {"gemm-throughput": ("gemm_tflops", f"{'fp32' if dtype == 'float32' else dtype}"
                                 "_matmul_tflops"),
             "memory-bandwidth": ("membw_gbs", "membw_gbs")}
    for check, (key, figure) in names.items():
        if not sources.get(key, "").startswith(OWN_HISTORY):
            continue
        values = [max((c.details or {}).get("samples") or [c.measured]) for c in checks
                  if c.name == check and c.measured is not None]
        if values:
            record_samples(figure, threads, values)


def _working(procs: dict[Any, Any], ranks: set, seen: dict[Any, float],
             min_cpu_s: float = 0.05) -> bool:
    """Whether a local rank used CPU time since the last look (Linux /proc; False where it
    cannot be read): a rank waiting in a collective or a deadlock uses none."""
    busy = False
    for k in ranks:
        pid = getattr(procs[k], "pid", None)
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        t = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        if k in seen and t - seen[k] >= min_cpu_s:
            busy = True
        if k not in seen or t - seen[k] >= min_cpu_s:
            seen[k] = t
    return busy


def _collect(procs: dict[Any, Any], q: Any, release: Any, nproc: int,
             deadline: float) -> list[Check]:
    """Read worker messages until every worker is done, failed, or the deadline passes. The
    deadline counts time without progress: each phase or check a local rank reports, and CPU
    time a local rank used, moves it on by its length (a busy host is slow, not hung), until a
    rank fails."""
    checks: list[Check] = []
    phase = {k: "startup" for k in procs}
    pending = set(procs)
    errors: dict[Any, str] = {}
    tracebacks: dict[Any, str] = {}     # a failed worker's, kept in its check's details
    local_deadline = deadline
    quiet_s = max(0.0, deadline - time.time())
    cpu: dict[Any, float] = {}
    while pending:
        now = time.time()
        local_pending = pending & set(range(nproc))
        if not errors and _working(procs, local_pending, cpu):
            # starting up (importing torch) or computing on a busy host: slow, not hung
            local_deadline = max(local_deadline, now + quiet_s)
            deadline = max(deadline, local_deadline)
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
        if kind in ("phase", "check") and who != "neighbor" and not errors:
            local_deadline = max(local_deadline, time.time() + quiet_s)
            deadline = max(deadline, local_deadline)
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
            tracebacks[who] = tb
            if who != "neighbor":
                # The other ranks are probably stuck in a collective with this one.
                local_deadline = min(local_deadline, time.time() + 5)
    for k in sorted(pending, key=str):
        errors.setdefault(k, f"did not finish in time: still in {phase[k]}")
    for k, msg in sorted(errors.items(), key=lambda kv: str(kv[0])):
        evidence = {"error": msg, **({"traceback": tracebacks[k]} if k in tracebacks else {})}
        if k == "neighbor" and phase[k].startswith("rendezvous"):
            # the neighbour never joined: evidence against it (gone, unreachable), not this host
            checks = [c for c in checks if c.name != "neighbor-all-reduce"]
            checks.append(Check("neighbor-all-reduce", "warn", f"neighbour check not run: the "
                                f"neighbour host(s) did not join ({msg}); not a fault of this "
                                "host", details={**evidence, "peer_unreachable": True}))
        elif k == "neighbor":
            checks = [c for c in checks if c.name != "neighbor-all-reduce"]
            checks.append(Check("neighbor-all-reduce", "fail", f"neighbour check: {msg}",
                                details=evidence))
        else:
            checks.append(Check("workers", "fail", f"local rank {k}: {msg}", k,
                                details={**evidence, "phase": phase[k]}))
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
    style = {"pass": "green", "fail": "bold red", "warn": "magenta", "skip": "yellow"}
    for c in report.checks:
        unit = f" {c.unit}" if c.unit and c.measured is not None else ""
        table.add_row(c.name, "all" if c.rank is None else str(c.rank),
                      Text(c.status.upper(), style=style[c.status]),
                      Text(fmt(c.measured) + unit), Text(fmt(c.expected)), Text(c.reason))
    console.print(table)
    if report.faults:
        console.print(Text(f"fault hook {FAULT_ENV} active: {', '.join(report.faults)}",
                           style="yellow"))
    verdict = Text("PASS", style="bold green") if report.passed else \
        Text("FAIL", style="bold red")
    console.print(Text.assemble(verdict, f" {report.host}: {report.counts}"))
    for c in report.failures + report.warnings:
        console.print(Text(f"  {label(c)} ({c.status}): {c.reason}"))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = (
        "expected figures (--expect KEY=VALUE):\n"
        + "\n".join(f"  {k:<30} {v}" for k, v in EXPECTED_KEYS.items())
        + f"\n\ntest hook: {FAULT_ENV}=slow-gemm|wrong-gemm[:rank=R][,...] injects a slow or "
        "wrong GEMM.\nexit status: 0 if the host passes, 1 if a check fails, 2 on bad usage."
    )
    parser.add_argument("--nproc", type=int, default=None,
                        help="local ranks (default: 2 on CPU, the GPU count on GPU)")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                        help="where the checks run: auto (the GPUs when there are, else the "
                        "CPU), cpu or cuda (default auto)")
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
                             "all_to_all, all_gather, reduce_scatter; all-reduce etc. too)")
    parser.add_argument("--timeout", type=float, default=60.0,
                        help="seconds without progress (no check or phase finished) before a "
                        "rank counts as hung and fails (default 60)")
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
    parser.add_argument("--refresh", "--rebaseline", dest="refresh", action="store_true",
                        help="measure this CPU's peak and memory bandwidth again (3 probes "
                             "each) and merge them into the cached history: a higher figure "
                             "raises it, a lower one (a busy host) never lowers it")


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

        if device == "cuda" and not torch.cuda.is_available():
            raise ConfigError("--device cuda: no CUDA device is available on this host")
        use_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
        nproc = torch.cuda.device_count() if use_cuda else 2
    peers = [h for h in args.peer_hosts.split(",")] if args.peer_hosts else None
    # all-reduce as simulate-network spells it, all_reduce as torch does
    collectives = [c.strip().replace("-", "_") for c in args.collectives.split(",") if c.strip()]
    report = run_diagnostics(nproc, expected, args.timeout, device=device, dtype=args.dtype,
                             collectives=collectives, peer_hosts=peers,
                             host_index=args.host_index, peer_port=args.peer_port,
                             refresh=args.refresh)
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
