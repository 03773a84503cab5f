"""Network simulator speed: a 12,288-GPU all-reduce on MegaScale's fabric (target <= 60 s), and
simulator speed against flow count.

    PYTHONPATH=src .venv/bin/python bench/network_scale.py

Each case builds the fabric, generates the collective's flows, routes them and runs the
event-driven max-min simulation. A ring's steps are identical (same pairs, same bytes), so one
step per phase is simulated and multiplied: an exactness-preserving reduction (see
myria/sim/netsim/traffic.py). Writes bench/results/network_scale.json.
"""

from __future__ import annotations

import json
import platform
import sys
import time
from pathlib import Path

import numpy as np

from myria.sim.netsim.congestion import simulate_congestion
from myria.sim.netsim.fabric import build, load_spec
from myria.sim.netsim.layout import layout_groups
from myria.sim.netsim.traffic import collective, route_collective, simulate_collective

OUT = Path(__file__).resolve().parent / "results" / "network_scale.json"
GPUS = 12288
SIZE = 1e9


def case(name, spec, groups, kind, algo, routing, qps, size=SIZE):
    t0 = time.perf_counter()
    fab = build(spec, GPUS)
    coll = collective(kind, groups, size, algo, spec.gpus, spec.nics)
    out = simulate_collective(fab, coll, routing, qps)
    wall = time.perf_counter() - t0
    out.pop("_fabric_util")
    row = {"case": name, "collective": kind, "algorithm": algo, "routing": routing, "qps": qps,
           "groups": int(groups.shape[0]), "ranks": int(groups.shape[1]), "flows": out["flows"],
           "links": out["links"], "events": out["events"], "wall_s": wall,
           "flows_per_s": out["flows"] / wall, "completion_time_s": out["completion_time_s"],
           "busbw_gbs": out["busbw_gbs"], "ideal_busbw_gbs": out["ideal_busbw_gbs"],
           "fabric_efficiency": out["fabric_efficiency"],
           "max_link_utilization": out["max_link_utilization"]}
    print(f"{name:<46} {row['flows']:>10,} flows {wall:7.2f} s  {row['flows_per_s']:>10,.0f} "
          f"flows/s  busbw {row['busbw_gbs']:7.1f} / {row['ideal_busbw_gbs']:6.1f} GB/s  "
          f"fabric eff {row['fabric_efficiency']:.3f}", flush=True)
    return row


def main() -> int:
    spec = load_spec("megascale")
    world = np.arange(GPUS)[None, :]
    rows = []
    t_all = time.perf_counter()
    for algo in ("ring", "two-stage-ring", "tree"):
        for routing in ("ecmp", "adaptive", "rail"):
            rows.append(case(f"all-reduce {algo} {routing}", spec, world, "all-reduce", algo,
                             routing, 1))
    for qps in (2, 4, 8, 16):
        rows.append(case(f"all-reduce ring ecmp qps={qps}", spec, world, "all-reduce", "ring",
                         "ecmp", qps))
    # the data-parallel groups of a real layout (tp 8, pp 8, dp 192), placed by myria
    dp = layout_groups({"tp": 8, "pp": 8, "dp_shard": 192}, spec, "dp")
    for routing in ("ecmp", "adaptive"):
        for qps in (1, 4):
            rows.append(case(f"dp groups (tp8 pp8 dp192) ring {routing} qps={qps}", spec, dp,
                             "all-reduce", "ring", routing, qps))
    # expert all-to-all over groups of 32 GPUs (tp 8 x ep 32 inside dp): flow counts in the
    # millions
    ep = layout_groups({"tp": 8, "dp_shard": 1536}, spec, "dp")
    for width in (16, 32, 64):
        groups = ep.reshape(-1, width)
        rows.append(case(f"all-to-all groups of {width} ecmp", spec, groups, "all-to-all",
                         "pairwise", "ecmp", 1, 64e6))
    for routing in ("flowlet",):          # greedy least-loaded paths: a Python loop per flow
        rows.append(case(f"dp groups (tp8 pp8 dp192) ring {routing} qps=4", spec, dp,
                         "all-reduce", "ring", routing, 4))
    # cost of the exact shortcuts: the same steps through the event-driven loop
    from myria.sim.netsim.flows import simulate_flows
    fab = build(spec, GPUS)
    event_rows = []
    for name, groups, qps in (("dp ring step, ecmp", dp, 1), ("dp ring step, ecmp", dp, 4),
                              ("12,288-rank ring step, ecmp", world, 1)):
        coll = collective("all-reduce", groups, SIZE, "ring", spec.gpus, spec.nics)
        rp = route_collective(fab, coll, "ecmp", qps)[0]
        t0 = time.perf_counter()
        fast = simulate_flows(rp.a, rp.phase.nbytes, fab.capacity)
        t1 = time.perf_counter()
        slow = simulate_flows(rp.a, rp.phase.nbytes, fab.capacity, events=True)
        t2 = time.perf_counter()
        event_rows.append({"case": f"{name} qps={qps}", "flows": rp.a.shape[0],
                           "shortcut_s": t1 - t0, "event_loop_s": t2 - t1,
                           "events": slow.events, "same": bool(abs(
                               fast.completion_time_s / slow.completion_time_s - 1) < 1e-9)})
        print(f"{name} qps={qps}: {rp.a.shape[0]:,} flows, shortcut {t1 - t0:.3f} s, event "
              f"loop {t2 - t1:.2f} s ({slow.events} events), equal: {event_rows[-1]['same']}",
              flush=True)
    # the fluid PFC/DCQCN model on the ring's inter-host step
    coll = collective("all-reduce", dp, SIZE, "ring", spec.gpus, spec.nics)
    rp = route_collective(fab, coll, "ecmp", 1)[0]
    t0 = time.perf_counter()
    cong = simulate_congestion(fab, rp.a, rp.phase.nbytes).summary()
    cong["wall_s"] = time.perf_counter() - t0
    print(f"PFC/DCQCN fluid model, dp ring step, {rp.a.shape[0]:,} flows: {cong['wall_s']:.2f} s"
          f", {cong['completion_time_s'] / cong['max_min_time_s']:.3f} x the max-min time")
    total = time.perf_counter() - t_all
    res = {"machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
           "python": sys.version.split()[0], "date": time.strftime("%Y-%m-%d"),
           "fabric": spec.describe(), "gpus": GPUS, "bytes_per_rank": SIZE,
           "cases": rows, "event_loop": event_rows, "congestion": cong, "total_wall_s": total,
           "max_case_wall_s": max(r["wall_s"] for r in rows)}
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(res, indent=1))
    flows = np.array([r["flows"] for r in rows])
    walls = np.array([r["wall_s"] for r in rows])
    slope = np.polyfit(np.log(flows), np.log(walls), 1)[0]
    print(f"total {total:.1f} s; slowest case {res['max_case_wall_s']:.2f} s (target <= 60); "
          f"wall ~ flows^{slope:.2f}; wrote {OUT}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
