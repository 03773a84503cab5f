"""Communication start-up benchmark: process-group init and every mesh group, world sizes 2, 4, 8.

For each world size the ranks are processes on this host (spawned, gloo, loopback only) that
rendezvous like torchrun's workers: the parent holds the TCPStore on 127.0.0.1 (a free port,
as torchrun's agent store) and each rank runs `myria.train.distributed.init` with the launcher's
environment (RANK, WORLD_SIZE, MASTER_ADDR/PORT, TORCHELASTIC_USE_AGENT_STORE). Then, for each
representative layout, in the same processes, it times

  mesh     `myria.parallel.dims.build_mesh` (init_device_mesh: one gloo group per mesh row)
  engine   what the engine asks of the mesh, `ParallelDims.from_mesh`: coordinates, the loss,
           data and pp groups, the FSDP and DDP sub-meshes (each derived once)
  first    the first 1-element all_reduce on every group this rank belongs to (gloo connects
           eagerly at group creation unless TORCH_GLOO_LAZY_INIT=1, so this is normally small)
  warm     the same all_reduces again, for comparison

and counts the `new_group` calls each rank made (every rank takes part in creating every group,
member or not) and the groups it belongs to. Each phase starts after an untimed barrier and is
reported for the slowest rank (max over ranks of that rank's own time). `init` is from the last
rank's arrival (after its imports) to the last rank's return, so process start-up skew is not
counted; `spawn` (launch to the last rank's arrival: Python and torch imports) is reported
beside it. The auxiliary world-sized gloo groups the trainer creates (StopRequest, the
checkpoint manager's background-save group) are timed as `aux`. Each world size is launched
--reps times per variant (fresh processes, repetitions outermost so that the shared cores'
load drifts over all variants alike); tables show medians over repetitions. `CPU` is the
slowest rank's process CPU time (all threads) over mesh + engine + first collectives: unlike
the wall times it does not grow when a rank waits for a core.

Variants (--variants): `current` is the code as it is (the `proposed` variant of the first
runs, one slice per dimension kept instead of re-slicing in every helper, is now the code:
`ParallelDims`); `lazy` is `current` with TORCH_GLOO_LAZY_INIT=1 (gloo connects on first use
instead of at group creation).

Usage:  .venv/bin/python bench/comm_startup.py [--worlds 2 4 8] [--reps 4] [--variants V ...]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]

LAYOUTS: dict[int, list[tuple[str, dict[str, int]]]] = {
    2: [("dp2", {"dp_shard": 2}), ("tp2", {"tp": 2}), ("pp2", {"pp": 2})],
    4: [("dp2 x tp2", {"dp_shard": 2, "tp": 2}), ("pp2 x tp2", {"pp": 2, "tp": 2}),
        ("hsdp 2x2", {"dp_replicate": 2, "dp_shard": 2}), ("cp2 x dp2", {"dp_shard": 2, "cp": 2})],
    8: [("pp2 x dp2 x tp2", {"pp": 2, "dp_shard": 2, "tp": 2}),
        ("dp_rep2 x dp_shard2 x tp2", {"dp_replicate": 2, "dp_shard": 2, "tp": 2}),
        ("pp2 x cp2 x tp2", {"pp": 2, "cp": 2, "tp": 2})],
}


def _engine_groups(layout: dict[str, int], mesh) -> list:
    """The groups the engine derives from the mesh (`ParallelDims.from_mesh`), plus the mesh's
    own per-dimension groups, in a rank-agreed order."""
    from myria.layout import Layout
    from myria.parallel.dims import ParallelDims

    if mesh is None:
        return []
    dims = ParallelDims.from_mesh(Layout(**layout), mesh)
    groups = {"loss": dims.loss_group, "data": dims.data_group, "pp": dims.pp_group}
    if dims.fsdp_mesh is not None:
        for i, g in enumerate(dims.fsdp_mesh.get_all_groups()):
            groups[f"fsdp{i}"] = g
    for name, g in zip(mesh.mesh_dim_names, mesh.get_all_groups()):
        groups[f"mesh_{name}"] = g
    # one entry per distinct group, ordered by key: every rank walks the same sequence
    seen, out = set(), []
    for key in sorted(groups):
        g = groups[key]
        if g is not None and id(g) not in seen:
            seen.add(id(g))
            out.append((key, g))
    return out


def _worker(rank: int, world: int, port: int, variant: str, layouts: list, out: str) -> None:
    os.environ.update({
        "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
        "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
        "TORCHELASTIC_USE_AGENT_STORE": "True", "GLOO_SOCKET_IFNAME": "lo"})
    if variant == "lazy":
        os.environ["TORCH_GLOO_LAZY_INIT"] = "1"
    torch.set_num_threads(1)
    from torch.distributed import device_mesh  # noqa: F401  (imported outside the timed phases)
    from torch.distributed.distributed_c10d import _world

    from myria.layout import Layout
    from myria.parallel.dims import build_mesh
    from myria.train import distributed
    now = time.perf_counter
    rec: dict = {"arrive": now()}
    distributed.init("cpu", init_timeout_s=120)
    rec["init_done"] = now()
    one = torch.ones(1)
    dist.all_reduce(one)
    rec["first_world_done"] = now()
    rec["layouts"] = []
    for name, layout in layouts:
        dist.barrier()
        n0 = _world.group_count
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            c0 = time.process_time()    # CPU of all this process's threads: not inflated
            t0 = now()                   # by waiting for a core, unlike the wall clock
            mesh = build_mesh(Layout(**layout), "cpu")
            t1 = now()
            groups = _engine_groups(layout, mesh)
            t2 = now()
        for _, g in groups:
            dist.all_reduce(one, group=g)
        t3 = now()
        c3 = time.process_time()
        for _, g in groups:
            dist.all_reduce(one, group=g)
        t4 = now()
        rec["layouts"].append({
            "name": name, "t": [t0, t1, t2, t3, t4], "cpu": c3 - c0,
            "new_group_calls": _world.group_count - n0,
            "member_groups": [[k, dist.get_process_group_ranks(g)] for k, g in groups],
            "warnings": sorted({str(w.message).strip() for w in caught})})
    dist.barrier()
    t0 = now()
    aux = [dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=120))
           for _ in range(2)]     # StopRequest's and CheckpointManager's groups
    t1 = now()
    for g in aux:
        dist.all_reduce(one, group=g)
    rec["aux"] = [t0, t1, now()]
    gathered: list = [None] * world
    dist.all_gather_object(gathered, rec)
    if rank == 0:
        Path(out).write_text(json.dumps(gathered))
    distributed.shutdown()


def launch(world: int, variant: str) -> dict:
    """One fresh job of `world` ranks; returns the per-rank timestamps and the launch time."""
    layouts = LAYOUTS[world]
    store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=120))
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "ranks.json")
        t_launch = time.perf_counter()
        mp.start_processes(_worker, args=(world, store.port, variant, layouts, out),
                           nprocs=world, join=True, start_method="spawn")
        ranks = json.loads(Path(out).read_text())
    del store
    return {"launch": t_launch, "ranks": ranks}


def phases(job: dict) -> dict:
    """Wall times (ms) of each phase across the ranks of one job."""
    r = job["ranks"]
    ms = 1e3
    arrive = [x["arrive"] for x in r]
    out = {
        "spawn": ms * (max(arrive) - job["launch"]),
        "init": ms * (max(x["init_done"] for x in r) - max(arrive)),
        "first_world": ms * (max(x["first_world_done"] for x in r)
                             - max(x["init_done"] for x in r)),
        "aux": ms * max(x["aux"][1] - x["aux"][0] for x in r),
        "aux_first": ms * max(x["aux"][2] - x["aux"][1] for x in r),
        "layouts": {},
    }
    for i, lay in enumerate(r[0]["layouts"]):
        ts = [x["layouts"][i]["t"] for x in r]

        def worst(a, b, ts=ts):     # the slowest rank's time for the phase
            return ms * max(t[b] - t[a] for t in ts)
        out["layouts"][lay["name"]] = {
            "mesh": worst(0, 1), "engine": worst(1, 2), "first": worst(2, 3),
            "warm": worst(3, 4), "total": worst(0, 3),
            "cpu": ms * max(x["layouts"][i]["cpu"] for x in r),
            "new_group_calls": max(x["layouts"][i]["new_group_calls"] for x in r),
            "member_groups": max(len(x["layouts"][i]["member_groups"]) for x in r),
            "groups_rank0": lay["member_groups"],
            "warnings": lay["warnings"],
        }
    return out


def median_of(runs: list[dict]) -> dict:
    """Median over repetitions of every number in `phases` output."""
    med = {k: statistics.median(run[k] for run in runs)
           for k in ("spawn", "init", "first_world", "aux", "aux_first")}
    med["layouts"] = {}
    for name, first in runs[0]["layouts"].items():
        d = {k: statistics.median(run["layouts"][name][k] for run in runs)
             for k in ("mesh", "engine", "first", "warm", "total", "cpu")}
        d.update({k: first[k] for k in ("new_group_calls", "member_groups", "groups_rank0",
                                        "warnings")})
        med["layouts"][name] = d
    return med


def tables(summary: dict) -> str:
    lines = ["| variant | world | spawn+import (ms) | init_process_group (ms) | first all_reduce "
             "on world (ms) | 2 aux world groups (ms) |", "|---|---|---|---|---|---|"]
    for variant, by_world in summary.items():
        for w, m in by_world.items():
            lines.append(f"| {variant} | {w} | {m['spawn']:.0f} | {m['init']:.1f} | "
                         f"{m['first_world']:.1f} | {m['aux']:.1f} (+{m['aux_first']:.1f} first) |")
    lines += ["", "| variant | world | layout | build_mesh (ms) | engine groups (ms) | first "
              "collective on each group (ms) | warm (ms) | mesh total (ms) | CPU (ms) | "
              "new_group calls | groups per rank |", "|" + "---|" * 11]
    for variant, by_world in summary.items():
        for w, m in by_world.items():
            for name, d in m["layouts"].items():
                lines.append(
                    f"| {variant} | {w} | {name} | {d['mesh']:.1f} | {d['engine']:.1f} | "
                    f"{d['first']:.1f} | {d['warm']:.1f} | {d['total']:.1f} | {d['cpu']:.1f} | "
                    f"{d['new_group_calls']} | {d['member_groups']} |")
    notes = {(w, name, msg) for variant, by_world in summary.items()
             for w, m in by_world.items() for name, d in m["layouts"].items()
             for msg in d["warnings"]}
    lines += [""] + [f"warning at world {w}, {name}: {msg}" for w, name, msg in sorted(notes)]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0] + " Launches fresh gloo jobs on 127.0.0.1 and "
        "times init, mesh groups, engine sub-meshes and first collectives.",
        formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4, 8], choices=sorted(LAYOUTS),
                    help="world sizes (processes on this host) [2 4 8]")
    ap.add_argument("--reps", type=int, default=4,
                    help="fresh launches per world size and variant [4]")
    ap.add_argument("--variants", nargs="+", default=["current", "lazy"],
                    choices=["current", "lazy"], help="what to run [both]")
    ap.add_argument("--json", default=str(ROOT / "bench/results/comm_startup.json"),
                    help="output file [bench/results/comm_startup.json]")
    a = ap.parse_args(argv)
    t_start = time.perf_counter()
    load_start = os.getloadavg()   # the 2 cores are shared: record how busy they were
    raw: dict = {v: {w: [] for w in a.worlds} for v in a.variants}
    # repetitions outermost and variants innermost, so that the load of the shared cores drifts
    # over all variants alike
    for rep in range(a.reps):
        for w in a.worlds:
            for variant in a.variants:
                run = phases(launch(w, variant))
                raw[variant][w].append(run)
                lay = " ".join(f"{n}={d['total']:.0f}" for n, d in run["layouts"].items())
                print(f"rep {rep} world {w} {variant}: init {run['init']:.0f} ms; mesh+engine+"
                      f"first: {lay} ms", flush=True)
    summary = {v: {w: median_of(raw[v][w]) for w in a.worlds} for v in a.variants}
    elapsed = time.perf_counter() - t_start
    print()
    print(tables(summary))
    print(f"\n{elapsed:.0f} s")
    path = Path(a.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({
        "command": " ".join([".venv/bin/python", f"bench/{Path(__file__).name}"]
                           + (argv or sys.argv[1:])),
        "torch": torch.__version__, "reps": a.reps, "elapsed_s": elapsed,
        "load_avg_start": load_start, "load_avg_end": os.getloadavg(),
        "date": datetime.date.today().isoformat(), "median": summary, "runs": raw}, indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
