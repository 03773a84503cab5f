"""`myria simulate-network`: one collective (or a layout's groups) on a simulated fabric.

    myria simulate-network --topology megascale --gpus 12288 --collective all-reduce \\
        --bytes 1G --algorithm two-stage-ring --routing ecmp --qps-per-connection 4 --json

Without --layout the communicator is all --gpus GPUs in rank order (ring-p2p: each GPU sends to
the same local GPU of the next host, as neighbouring pipeline stages do); with --layout
"tp=8,pp=4,dp=64" --group dp every data-parallel group of that layout, placed by myria's rank
placement, runs the collective at once. --bytes is per rank (nccl-tests convention).

The defaults are NCCL's (2.30): --algorithm auto (NCCL_ALGO unset: ring or double binary tree,
whichever NCCL's kind of cost model finds faster), --channels auto (NCCL_MIN_NCHANNELS /
NCCL_MAX_NCHANNELS unset: one ring per NIC a host's members own, duplicated), --protocol auto
(NCCL_PROTO unset: Simple or LL128, whichever is faster), and
--qps-per-connection 1 (NCCL_IB_QPS_PER_CONNECTION). The ideal bus bandwidth is the aggregate of
those NICs. docs/network.md compares with published nccl-tests figures.
"""

from __future__ import annotations

import argparse
import difflib
import json
import re
import time

import numpy as np

from myria.errors import ConfigError
from myria.sim.netsim.congestion import simulate_congestion
from myria.sim.netsim.fabric import PRESETS, build, load_spec
from myria.sim.netsim.layout import layout_groups, parse_layout
from myria.sim.netsim.routing import ROUTINGS
from myria.sim.netsim.traffic import (
    ALGORITHMS,
    COLLECTIVES,
    MAXCHANNELS,
    PROTOCOLS,
    best_algorithm,
    collective,
    route_collective,
    simulate_collective,
    simulate_jobs,
)

MAX_FLOWS = 5_000_000
# argparse takes "-5G" for an option (its default matcher knows only plain negative numbers), so
# "--bytes -5G" would fail with "expected one argument"; this parser has no option that starts
# with "-<digit>", so such words are values, and parse_bytes says what is wrong with them
_NEGATIVE_VALUE = re.compile(r"^-[0-9.]")
_UNITS = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12, "ki": 2**10, "mi": 2**20,
          "gi": 2**30, "ti": 2**40}


def parse_bytes(text: str) -> float:
    """``1e9``, ``256M``, ``1G``, ``4GiB`` -> bytes."""
    m = re.fullmatch(r"\s*([+-]?[0-9.]+(?:e[+-]?\d+)?)\s*([kmgt]i?)?b?\s*", str(text).lower())
    if not m:
        raise ConfigError(f"--bytes {text!r}: expected a size such as 1e9, 256M, 1G or 4GiB")
    try:
        val = float(m.group(1)) * _UNITS[m.group(2) or ""]
    except ValueError:                                   # "1.2.3G"
        raise ConfigError(f"--bytes {text!r}: expected a size such as 1e9, 256M, 1G or "
                          "4GiB") from None
    if val <= 0:
        raise ConfigError(f"--bytes {text!r}: must be > 0")
    return val


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = __doc__
    parser._negative_number_matcher = _NEGATIVE_VALUE
    parser.add_argument("--topology", required=True,
                        help=f"a preset ({', '.join(PRESETS)}) or a fabric TOML file "
                        "(see myria/sim/netsim/fabric.py for the keys)")
    parser.add_argument("--gpus", required=True, help="GPUs in the run (a multiple of the GPUs "
                        "per host; others are refused)")
    parser.add_argument("--collective", required=True, help=" | ".join(COLLECTIVES))
    parser.add_argument("--bytes", required=True, help="bytes per rank: 1e9, 256M, 1G, 4GiB")
    parser.add_argument("--algorithm", default="auto", help=" | ".join(ALGORITHMS)
                        + " (default auto, as NCCL_ALGO unset: ring, or for all-reduce the "
                        "double binary tree when NCCL's kind of cost model, NICs, NVLink and "
                        "per-hop latencies, finds it faster; tree applies to all-reduce; "
                        "two-stage-ring is not NCCL's)")
    parser.add_argument("--protocol", default="auto", help=" | ".join(PROTOCOLS)
                        + " (default auto, as NCCL_PROTO unset: the faster of Simple and LL128 "
                        "for the collective; a ring step's hop latency hides behind its "
                        "transfer when the transfer is longer)")
    parser.add_argument("--routing", default="ecmp", help=" | ".join(ROUTINGS)
                        + " (default ecmp)")
    parser.add_argument("--channels", default="auto",
                        help="NCCL channels (rings / tree pairs) per communicator, as "
                        "NCCL_MIN_NCHANNELS = NCCL_MAX_NCHANNELS (default auto: NCCL 2.30's, "
                        "2 per NIC the members of a host own, e.g. 16 on 8-NIC hosts)")
    parser.add_argument("--qps-per-connection", default="1",
                        help="flows (queue pairs) per connection, NCCL_IB_QPS_PER_CONNECTION "
                        "(default 1, NCCL's)")
    parser.add_argument("--polarized", action="store_true",
                        help="every switch tier uses the same ECMP hash function")
    parser.add_argument("--seed", default="0", help="salt of the ECMP hashes and source ports")
    parser.add_argument("--layout", default="",
                        help='a myria layout, e.g. "tp=8,pp=4,dp=48": simulate the groups of '
                        "--group of that layout, placed by myria's rank placement")
    parser.add_argument("--group", default="dp", help="tp | cp | dp | dp_replicate | pp "
                        "(with --layout; default dp)")
    parser.add_argument("--with", dest="also", action="append", default=[],
                        metavar="COLLECTIVE:GROUP:BYTES[:ALGORITHM]",
                        help="with --layout: another collective running at the same time over "
                        "that layout's GROUP groups (repeatable), e.g. all-to-all:tp:64M; all "
                        "jobs are then simulated step by step, sharing the fabric (slower: keep "
                        "to a few hundred steps)")
    parser.add_argument("--congestion", action="store_true",
                        help="also run the fluid PFC/DCQCN model on the step's flows")
    parser.add_argument("--plot", default="", help="write a PNG of the link utilisation "
                        "distribution here")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def _int(text: str, flag: str, lo: int = 1) -> int:
    try:
        v = int(text)
    except ValueError:
        raise ConfigError(f"{flag} {text!r}: expected an integer") from None
    if v < lo:
        raise ConfigError(f"{flag} {v}: must be >= {lo}")
    return v


def _choice(val: str, flag: str, valid: tuple) -> str:
    if val not in valid:
        close = difflib.get_close_matches(val, valid, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigError(f"{flag} {val!r}: valid are {', '.join(valid)}{hint}")
    return val


def groups_for(args, spec, gpus: int, kind: str) -> np.ndarray:
    if args.layout:
        layout = parse_layout(args.layout)
        world = int(np.prod(list(layout.values())))
        if world != gpus:
            raise ConfigError(f"--layout {args.layout!r} has {world} ranks, --gpus is {gpus}")
        return layout_groups(layout, spec, args.group)
    if kind == "ring-p2p":
        g = min(spec.gpus, gpus)
        return np.arange(gpus).reshape(-1, g).T.copy()
    return np.arange(gpus)[None, :]


def run(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    kind = _choice(args.collective, "--collective", COLLECTIVES)
    algo = _choice(args.algorithm, "--algorithm", ALGORITHMS)
    routing = _choice(args.routing, "--routing", ROUTINGS)
    proto = _choice(args.protocol, "--protocol", PROTOCOLS)
    qps = _int(args.qps_per_connection, "--qps-per-connection")
    channels = None if args.channels == "auto" else _int(args.channels, "--channels")
    if channels is not None and channels > MAXCHANNELS:
        raise ConfigError(f"--channels {channels}: NCCL has at most {MAXCHANNELS}")
    gpus = _int(args.gpus, "--gpus")
    seed = _int(args.seed, "--seed", 0)
    size = parse_bytes(args.bytes)
    spec = load_spec(args.topology)
    fab = build(spec, gpus)
    groups = groups_for(args, spec, gpus, kind)
    if algo == "auto":
        coll = best_algorithm(fab, kind, groups, size, spec.gpus, spec.nics, channels, proto)
    else:
        coll = collective(kind, groups, size, algo, spec.gpus, spec.nics, channels)
    n_flows = qps * sum(len(p.src) for p in coll.phases)
    if n_flows > MAX_FLOWS:
        raise ConfigError(f"{kind} over {groups.shape[1]} ranks makes {n_flows:,} flows (limit "
                          f"{MAX_FLOWS:,}): use --layout/--group for smaller groups")
    out = simulate_collective(fab, coll, routing, qps, seed, args.polarized, protocol=proto)
    if args.also:
        out["jobs"] = _jobs(args, spec, fab, coll, routing, qps, seed)
    if args.congestion:

        rp = max(route_collective(fab, coll, routing, qps, seed, args.polarized),
                 key=lambda r: r.phase.steps * r.phase.nbytes.sum())
        out["congestion"] = simulate_congestion(fab, rp.a, rp.phase.nbytes).summary()
    out.update(topology=spec.name, gpus=gpus, routing=routing, qps_per_connection=qps,
               requested_algorithm=algo,
               groups=int(groups.shape[0]), wall_s=time.perf_counter() - t0)
    util = out.pop("_fabric_util")
    if args.plot:
        _plot(out, util, args.plot)
    if args.json:
        print(json.dumps({k: (float(v) if isinstance(v, np.floating) else v)
                          for k, v in out.items()}))
        return 0
    print(spec.describe())
    ran = coll.algorithm + (" (auto)" if algo == "auto" else "") + f", {out['protocol']}" \
        + (" (auto)" if proto == "auto" else "")
    print(f"{kind} ({ran}) of {size / 1e9:g} GB per rank over {out['groups']} group(s) of "
          f"{out['ranks']} ranks, {coll.channels} channel(s), {routing} routing, {qps} QP(s) "
          "per connection")
    print(f"  completion {out['completion_time_s'] * 1e3:.3f} ms; bus bandwidth "
          f"{out['busbw_gbs']:.1f} GB/s of an ideal {out['ideal_busbw_gbs']:.1f} "
          f"({out['busbw_gbs'] / out['ideal_busbw_gbs']:.1%}); fabric efficiency "
          f"{out['fabric_efficiency']:.1%} (bandwidth only, latency excluded)")
    p = out["fabric_link_utilization_p50_p90_p99_max"]
    print(f"  switch-link utilisation p50 {p[0]:.1%}  p90 {p[1]:.1%}  p99 {p[2]:.1%}  max "
          f"{p[3]:.1%}; most flows on one switch link: {out['max_flows_on_a_fabric_link']}")
    print("  most congested links: " + ", ".join(
        f"{d['link']} {d['utilization']:.0%}" for d in out["most_congested_links"]))
    for j in out.get("jobs", []):
        print(f"  together: {j['collective']} ({j['algorithm']}) {j['completion_time_s'] * 1e3:.3f}"
              f" ms, {j['slowdown']:.2f} x its time alone")
    if "congestion" in out:
        c = out["congestion"]
        print(f"  PFC/DCQCN fluid model: step {c['completion_time_s'] * 1e3:.3f} ms vs "
              f"{c['max_min_time_s'] * 1e3:.3f} ms max-min; links paused "
              f"{c['paused_links']}, victim flows {c['victim_flows']}")
    print(f"  {out['flows']:,} flows on {out['links']:,} links, {out['wall_s']:.2f} s")
    return 0


def _jobs(args, spec, fab, coll, routing: str, qps: int, seed: int) -> list[dict]:
    """The main collective and the --with ones, at once (traffic.simulate_jobs)."""
    if not args.layout:
        raise ConfigError("--with needs --layout (its groups say who talks to whom)")
    layout = parse_layout(args.layout)
    jobs = [(coll, routing, qps)]
    for text in args.also:
        parts = text.split(":")
        if len(parts) not in (3, 4):
            raise ConfigError(f"--with {text!r}: expected COLLECTIVE:GROUP:BYTES[:ALGORITHM]")
        kind = _choice(parts[0], "--with collective", COLLECTIVES)
        algo = _choice(parts[3] if len(parts) == 4 else "ring", "--with algorithm", ALGORITHMS)
        groups = layout_groups(layout, spec, parts[1])
        make = best_algorithm if algo == "auto" else collective
        extra = (fab,) if algo == "auto" else ()
        nbytes = parse_bytes(parts[2])
        jobs.append((make(*extra, kind, groups, nbytes, *(() if extra else (algo,)), spec.gpus,
                          spec.nics), routing, qps))
    steps = sum(p.steps for c, _, _ in jobs for p in c.phases)
    if steps > 2_000:
        raise ConfigError(f"--with: {steps:,} collective steps to simulate one by one (limit "
                          "2,000): use smaller groups or the two-stage ring")
    res = simulate_jobs(fab, jobs, seed)
    alone = [simulate_collective(fab, c, r, q, seed + 31 * j)["completion_time_s"]
             for j, (c, r, q) in enumerate(jobs)]
    for r, t in zip(res, alone):
        r["alone_s"] = float(t)
        r["slowdown"] = float(r["completion_time_s"] / t) if t else 1.0
    return res


def _plot(out: dict, util: np.ndarray, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    if len(util):
        ax.hist(util * 100, bins=40)
    ax.set_xlabel("switch-link utilisation over the collective (%)")
    ax.set_ylabel("links")
    ax.set_title(f"{out['collective']} {out['algorithm']} on {out['topology']}, "
                 f"{out['routing']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
