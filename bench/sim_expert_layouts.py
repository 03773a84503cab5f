"""Where `myria plan`, as a planning engineer types it, ranks the public layouts of well-known
large runs.

    PYTHONPATH=src .venv/bin/python bench/sim_expert_layouts.py [NAME ...]

Each run of src/myria/sim/data/expert_commands.toml is the command line of `myria plan` with the
model, batch and cluster only (every other assumption the command's defaults, printed in its
header), priced by the command's own function (`cli_plan.plan_argv`) with the whole ranking
kept; then the published degrees (tp, pp, cp, dp): their best ranks, MFU, memory and whether
they are tied with the first pick, and the first five with what separates them. Writes
bench/results/sim_expert_layouts.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

from myria.sim.cli_plan import assumptions, expert_commands, plan_argv

OUT = Path(__file__).resolve().parent / "results" / "sim_expert_layouts.json"
KEYS = ("tp", "pp", "cp", "dp", "vpp", "micro_batch", "recompute", "zero_stage",
        "reshard_after_forward", "sequence_parallel")


def row_of(i: int, x) -> dict:
    bd = x.breakdown
    return {"rank": i, "mfu": x.mfu, "iteration_time_s": x.iteration_time_s,
            "memory_gb": x.memory.total / 1e9,
            "free_gb": (x.memory.capacity - x.memory.total) / 1e9,
            "tied": x.extra["tied"], "implausible": x.extra.get("implausible", ""),
            "breakdown_share": {k: v / x.iteration_time_s for k, v in bd.items() if v > 0},
            **{k: x.layout[k] for k in KEYS}}


def main(argv: list[str]) -> int:
    runs = {r["name"]: r for r in expert_commands()}
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    ap.add_argument("names", nargs="*", metavar="NAME",
                    help=f"runs to rank (default all): {', '.join(runs)}")
    names = ap.parse_args(argv).names or list(runs)
    if unknown := [n for n in names if n not in runs]:
        ap.error(f"unknown run(s) {', '.join(unknown)}; known: {', '.join(runs)}")
    rows = []
    for name in names:
        r = runs[name]
        t0 = time.perf_counter()
        base, res = plan_argv(r["argv"], top=10 ** 6)
        pub = r["published"]
        same = [(i + 1, x) for i, x in enumerate(res.ranked)
                if (x.layout["tp"], x.layout["pp"], x.layout["cp"], x.layout["dp"])
                == (pub["tp"], pub["pp"], pub["cp"], pub["dp"])
                and (x.layout["vpp"] > 1) == pub["interleaved"]]
        row = {"run": name, "command": "myria plan " + " ".join(r["argv"]),
               "assumptions": assumptions(base), "evaluated": res.evaluated,
               "fitting": res.fitting, "seconds": time.perf_counter() - t0,
               "best_mfu": max(x.mfu for x in res.ranked),
               "tied": sum(1 for x in res.ranked if x.extra["tied"]),
               "band": res.ranked[0].extra["band"],
               "first_five": [row_of(i + 1, x) for i, x in enumerate(res.ranked[:5])],
               "published": [row_of(i, x) for i, x in same[:5]]}
        rows.append(row)
        best = row["published"][0] if row["published"] else None
        f = row["first_five"][0]
        print(f"{name}: {res.evaluated:,} layouts, {res.fitting:,} fit, {row['tied']:,} tied; "
              f"first tp{f['tp']} pp{f['pp']} cp{f['cp']} dp{f['dp']} v{f['vpp']} "
              f"mb{f['micro_batch']} {f['recompute']} ZeRO {f['zero_stage']} MFU {f['mfu']:.3f} "
              f"{f['memory_gb']:.1f} GB; published degrees "
              + (f"rank {best['rank']} (vpp {best['vpp']}, {best['recompute']}, ZeRO "
                 f"{best['zero_stage']}, MFU {best['mfu']:.3f}, tied {best['tied']})" if best
                 else "not ranked"), flush=True)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    if OUT.exists():   # a subset replaces its own runs' rows and keeps the others
        ranked = {r["run"] for r in rows}
        kept = [r for r in json.loads(OUT.read_text()).get("rows", []) if r["run"] not in ranked]
        rows = sorted(kept + rows, key=lambda r: list(runs).index(r["run"])
                      if r["run"] in runs else len(runs))
    OUT.write_text(json.dumps({"command": "bench/sim_expert_layouts.py", "machine":
                               f"{platform.machine()} CPU (2 cores, shared)",
                               "date": time.strftime("%Y-%m-%d"), "rows": rows}, indent=1))
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
