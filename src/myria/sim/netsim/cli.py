"""`myria simulate-network`: one collective (or a layout's groups) on a simulated fabric.

    myria simulate-network --topology megascale --gpus 12288 --collective all-reduce \\
        --bytes 1G --algorithm two-stage-ring --routing ecmp --qps-per-connection 4 --json

Without --layout the communicator is all --gpus GPUs in rank order (ring-p2p: each GPU sends to
the same local GPU of the next host, as neighbouring pipeline stages do); with --layout
"tp=8,pp=4,dp=64" --group dp every data-parallel group of that layout, placed by myria's rank
placement, runs the collective at once (--layout "ep=64,dp=4096" --group ep: the MoE
all-to-all of every expert-parallel group). --bytes is per rank (nccl-tests convention).

The defaults are NCCL's (2.30): --algorithm auto (NCCL_ALGO unset: ring or double binary tree,
whichever NCCL's kind of cost model finds faster), --channels auto (NCCL_MIN_NCHANNELS /
NCCL_MAX_NCHANNELS unset: one ring per NIC a host's members own, duplicated), --protocol auto
(NCCL_PROTO unset: Simple or LL128, whichever is faster), and
--qps-per-connection 1 (NCCL_IB_QPS_PER_CONNECTION). The ideal bus bandwidth is the aggregate of
those NICs. docs/network.md compares with published nccl-tests figures.

Routing defaults to adaptive and flows to NCCL's 1 queue pair per connection, over 2 channels
per NIC: 2 flows per NIC pair, as `myria plan` / `myria simulate` assume (routing = "adaptive",
flows_per_pair = 2 in a run file); --routing ecmp shows what hash collisions cost.
"""

from __future__ import annotations

import argparse
import difflib
import json
import re
import time
from pathlib import Path

import numpy as np

from myria.errors import ConfigError
from myria.sim.netsim.congestion import simulate_congestion
from myria.sim.netsim.fabric import HOST_KEYS, PRESETS, TIER_KEYS, build, load_spec
from myria.sim.netsim.layout import GROUPS, layout_groups, parse_layout, world_of
from myria.sim.netsim.routing import ROUTINGS
from myria.sim.netsim.traffic import (
    COLLECTIVE_ALGORITHMS,
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
                        help=f"a preset ({', '.join(PRESETS)}; fat-tree and clos3 are myria "
                        "plan's fabrics of those names at their defaults: radix-64 400G "
                        "switches, 4 servers of 8 GPUs x 8 NICs per leaf, non-blocking; "
                        "fat-tree has 2 tiers, up to 2,048 GPUs, clos3 3 tiers, up to 65,536; "
                        "fat-tree-3tier-k32 is the k=32 three-tier fat-tree, 2 servers per ToR) "
                        "or a fabric TOML file with keys name, tiers (2 or 3), [host] "
                        f"{', '.join(HOST_KEYS)}, and [tor], [agg] (the spine when tiers = 2), "
                        f"[core] {', '.join(TIER_KEYS)}; annotated in docs/network.md, \"A "
                        "fabric description, annotated\"")
    parser.add_argument("--gpus", required=True, help="GPUs in the run (a multiple of the GPUs "
                        "per host; others are refused)")
    parser.add_argument("--collective", required=True, help=" | ".join(COLLECTIVES))
    parser.add_argument("--bytes", required=True, help="bytes per rank: 1e9, 256M, 1G, 4GiB")
    parser.add_argument("--algorithm", default="auto", help="auto, or one the collective has: "
                        + "; ".join(f"{k}: {', '.join(v)}" for k, v in
                                    COLLECTIVE_ALGORITHMS.items())
                        + " (default auto, as NCCL_ALGO unset: ring, or for all-reduce the "
                        "double binary tree when NCCL's kind of cost model, NICs, NVLink and "
                        "per-hop latencies, finds it faster; two-stage-ring is not NCCL's; "
                        "all-to-all sends every rank's share to every other rank at once)")
    parser.add_argument("--protocol", default="auto", help=" | ".join(PROTOCOLS)
                        + " (default auto, as NCCL_PROTO unset: the faster of Simple and LL128 "
                        "for the collective; a ring step's hop latency hides behind its "
                        "transfer when the transfer is longer)")
    parser.add_argument("--routing", default="adaptive", help=" | ".join(ROUTINGS)
                        + " (default adaptive, as myria plan / simulate assume (a run file's "
                        "routing): flows sprayed over all equal-cost uplinks, as InfiniBand "
                        "adaptive routing or a tuned RoCE fabric does; ecmp hashes each flow "
                        "onto one path, the collisions of a plain Ethernet fabric)")
    parser.add_argument("--channels", default="auto",
                        help="NCCL channels (rings / tree pairs) per communicator, as "
                        "NCCL_MIN_NCHANNELS = NCCL_MAX_NCHANNELS (default auto: NCCL 2.30's, "
                        "2 per NIC the members of a host own, e.g. 16 on 8-NIC hosts)")
    parser.add_argument("--qps-per-connection", default="1",
                        help="flows (queue pairs) per connection, NCCL_IB_QPS_PER_CONNECTION "
                        "(default 1, NCCL's; with --channels auto's 2 channels per NIC that is "
                        "2 flows per NIC pair, what plan's flows_per_pair = 2 stands for)")
    parser.add_argument("--polarized", action="store_true",
                        help="every switch tier uses the same ECMP hash function")
    parser.add_argument("--seed", default="0", help="salt of the ECMP hashes and source ports")
    parser.add_argument("--layout", default="",
                        help='a myria layout, e.g. "tp=8,pp=4,dp=48": simulate the groups of '
                        "--group of that layout, placed by myria's rank placement; ep=N "
                        "(expert parallelism) is carved out of dp as myria's trainer does: it "
                        "divides dp, does not multiply the ranks, and an ep group is N "
                        'consecutive members of a dp group ("ep=64,dp=4096": 4,096 GPUs, 64 '
                        "groups of 64)")
    parser.add_argument("--group", default=None, help=" | ".join(GROUPS)
                        + " (needs --layout; default dp)")
    parser.add_argument("--with", dest="also", action="append", default=[],
                        metavar="COLLECTIVE:GROUP:BYTES[:ALGORITHM]",
                        help="with --layout: another collective running at the same time over "
                        "that layout's GROUP groups (repeatable), e.g. all-to-all:ep:64M "
                        "(ALGORITHM: the collective's first by default: ring, pairwise, p2p); all "
                        "jobs are then simulated step by step, sharing the fabric (slower: keep "
                        "to a few hundred steps)")
    parser.add_argument("--congestion", action="store_true",
                        help="also run the fluid PFC/DCQCN model on the step's flows")
    parser.add_argument("--plot", default="", help="write a plot of the link utilisation "
                        "distribution here (format by suffix: .png, .pdf, .svg, ...)")
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


def _algorithm(val: str, kind: str, flag: str) -> str:
    """``val`` if ``kind`` has that algorithm (or it is auto); else one line naming those it
    has."""
    valid = ("auto", *COLLECTIVE_ALGORITHMS[kind])
    if val not in valid:
        close = difflib.get_close_matches(val, valid, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigError(f"{flag} {val!r}: {kind} has {', '.join(valid)}{hint}")
    return val


def _size(nbytes: float) -> str:
    """Bytes in B, KB, MB, GB or TB (powers of 1000, as --bytes reads K, M, G)."""
    for unit, f in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if nbytes >= f:
            return f"{nbytes / f:.4g} {unit}"
    return f"{nbytes:.4g} B"


def _time(t: float) -> str:
    """Seconds in s, ms or µs."""
    if t >= 1:
        return f"{t:.3f} s"
    if t >= 1e-3:
        return f"{t * 1e3:.3f} ms"
    return f"{t * 1e6:.3f} µs"


def _rate(gbs: float) -> str:
    """GB/s in GB/s, or MB/s / KB/s below 1 GB/s."""
    for unit, f in (("GB/s", 1.0), ("MB/s", 1e-3), ("KB/s", 1e-6)):
        if gbs >= f:
            return f"{gbs / f:.1f} {unit}"
    return f"{gbs * 1e9:.1f} B/s"


def _check_plot(path: str) -> None:
    """Refuse, before simulating, a --plot path matplotlib could not write."""
    p = Path(path)
    parent = p.parent
    if not parent.is_dir():
        raise ConfigError(f"--plot {path!r}: its directory {str(parent)!r} does not exist")
    try:
        from matplotlib.backend_bases import FigureCanvasBase
    except ImportError:
        raise ConfigError("--plot needs matplotlib (pip install matplotlib)") from None
    formats = sorted(FigureCanvasBase.get_supported_filetypes())
    if p.suffix.lower().lstrip(".") not in formats:
        raise ConfigError(f"--plot {path!r}: the suffix names the format, one of "
                          f"{', '.join('.' + f for f in formats)}")


def groups_for(args, spec, gpus: int, kind: str) -> np.ndarray:
    if args.layout:
        layout = parse_layout(args.layout)
        world = world_of(layout)
        if world != gpus:
            raise ConfigError(f"--layout {args.layout!r} has {world} ranks, --gpus is {gpus}")
        return layout_groups(layout, spec, args.group or "dp")
    if kind == "ring-p2p":
        g = min(spec.gpus, gpus)
        return np.arange(gpus).reshape(-1, g).T.copy()
    return np.arange(gpus)[None, :]


def run(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    kind = _choice(args.collective, "--collective", COLLECTIVES)
    algo = _algorithm(args.algorithm, kind, "--algorithm")
    if args.group is not None and not args.layout:
        raise ConfigError("--group needs --layout (its groups say who talks to whom)")
    if args.also and not args.layout:
        raise ConfigError("--with needs --layout (its groups say who talks to whom)")
    if args.plot:
        _check_plot(args.plot)
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
    if groups.shape[1] < 2:
        raise ConfigError(f"--collective {kind}: its groups have one rank each (with --gpus "
                          f"{gpus} on servers of {spec.gpus}: "
                          + ("one rank per server" if kind == "ring-p2p" else "--layout/--group")
                          + "), so nothing is sent; give more servers or a layout")
    also = _with_jobs(args, spec, fab, routing, qps) if args.also else []
    if algo == "auto":
        coll = best_algorithm(fab, kind, groups, size, spec.gpus, spec.nics, channels, proto)
    else:
        coll = collective(kind, groups, size, algo, spec.gpus, spec.nics, channels)
    n_flows = qps * sum(len(p.src) for p in coll.phases)
    if n_flows > MAX_FLOWS:
        raise ConfigError(f"{kind} over {groups.shape[1]} ranks makes {n_flows:,} flows (limit "
                          f"{MAX_FLOWS:,}): use --layout/--group for smaller groups")
    jobs = [(coll, routing, qps), *also] if also else []
    steps = sum(p.steps for c, _, _ in jobs for p in c.phases)
    if steps > 2_000:
        raise ConfigError(f"--with: {steps:,} collective steps to simulate one by one (limit "
                          "2,000): use smaller groups or the two-stage ring")
    out = simulate_collective(fab, coll, routing, qps, seed, args.polarized, protocol=proto)
    if args.also:
        out["jobs"] = _jobs(fab, jobs, seed)
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
    chose = len(COLLECTIVE_ALGORITHMS[kind]) > 1 and algo == "auto"
    ran = coll.algorithm + (" (auto)" if chose else "") + f", {out['protocol']}" \
        + (" (auto)" if proto == "auto" else "")
    # channels are rings / tree pairs: all-to-all and ring-p2p have none
    chans = f", {coll.channels} channel(s)" if kind not in ("all-to-all", "ring-p2p") else ""
    print(f"{kind} ({ran}) of {_size(size)} per rank over {out['groups']} group(s) of "
          f"{out['ranks']} ranks{chans}; {routing} routing, {qps} flow(s) (QPs) per "
          "connection")
    if algo not in ("auto", coll.algorithm):
        print(f"  note: --algorithm {algo} runs as a {coll.algorithm} here: the tree and the "
              "two-stage ring need several servers in a group (the two-stage ring several GPUs "
              "of a server too)")
    ideal = out["ideal_busbw_gbs"]
    print(f"  completion {_time(out['completion_time_s'])}; bus bandwidth "
          f"{_rate(out['busbw_gbs'])} of an ideal {_rate(ideal)} "
          f"({out['busbw_gbs'] / ideal if ideal else 0.0:.1%}); fabric efficiency "
          f"{out['fabric_efficiency']:.1%} (bandwidth only, latency excluded)")
    p = out["fabric_link_utilization_p50_p90_p99_max"]
    # adaptive routing spreads every flow over all uplinks (pooled links): no flow sits on
    # one switch link, so the count of flows per link says nothing there
    most = ("every flow spread over all its equal-cost uplinks (adaptive)"
            if routing == "adaptive" else
            f"most flows on one switch link: {out['max_flows_on_a_fabric_link']}")
    print(f"  switch-link utilisation p50 {p[0]:.1%}  p90 {p[1]:.1%}  p99 {p[2]:.1%}  max "
          f"{p[3]:.1%}; {most}")
    print("  most congested links: " + ", ".join(
        f"{d['link']} {d['utilization']:.0%}" for d in out["most_congested_links"]))
    for j in out.get("jobs", []):
        print(f"  together: {j['collective']} ({j['algorithm']}) {_time(j['completion_time_s'])}"
              f", {j['slowdown']:.2f} x its time alone")
    if "congestion" in out:
        c = out["congestion"]
        print(f"  PFC/DCQCN fluid model: step {_time(c['completion_time_s'])} vs "
              f"{_time(c['max_min_time_s'])} max-min; links paused "
              f"{c['paused_links']}, victim flows {c['victim_flows']}")
    print(f"  {out['flows']:,} flows on {out['links']:,} links ({len(util):,} of them switch "
          f"links that carried traffic), {out['wall_s']:.2f} s")
    return 0


def _with_jobs(args, spec, fab, routing: str, qps: int) -> list[tuple]:
    """The --with collectives, (collective, routing, qps) each, checked before anything is
    simulated."""
    layout = parse_layout(args.layout)
    jobs = []
    for text in args.also:
        parts = text.split(":")
        if len(parts) not in (3, 4):
            raise ConfigError(f"--with {text!r}: expected COLLECTIVE:GROUP:BYTES[:ALGORITHM]")
        kind = _choice(parts[0], "--with collective", COLLECTIVES)
        # default: the collective's first algorithm (ring, or all-to-all's pairwise exchange)
        algo = _algorithm(parts[3] if len(parts) == 4 else COLLECTIVE_ALGORITHMS[kind][0],
                          kind, f"--with {text!r}: algorithm")
        groups = layout_groups(layout, spec, parts[1], flag=f"--with {text!r}: group")
        nbytes = parse_bytes(parts[2])
        if algo == "auto":
            coll = best_algorithm(fab, kind, groups, nbytes, spec.gpus, spec.nics)
        else:
            coll = collective(kind, groups, nbytes, algo, spec.gpus, spec.nics)
        jobs.append((coll, routing, qps))
    return jobs


def _jobs(fab, jobs: list[tuple], seed: int) -> list[dict]:
    """The main collective and the --with ones, at once (traffic.simulate_jobs)."""
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
    ax.set_xlabel("utilisation over the collective (%)")
    ax.set_ylabel(f"switch links that carried traffic ({len(util):,})")
    ax.set_title(f"{out['collective']} {out['algorithm']} of {_size(out['bytes'])} on "
                 f"{out['gpus']:,} GPUs, {out['topology']}, {out['routing']}, "
                 f"{out['qps_per_connection']} QP(s)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
