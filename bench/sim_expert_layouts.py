"""Where the planner ranks the public layouts of well-known large runs (issue 24).

    PYTHONPATH=src .venv/bin/python bench/sim_expert_layouts.py [NAME ...]

For each run of src/myria/sim/data/expert_layouts.toml (layout, hardware and batch only; no
throughput or MFU of the papers is read): every fitting layout of the default search space
ranked (`plan(run, top=10**6)`), then the published degrees (tp, pp, cp, dp): their best
ranks, MFU, memory and whether they are tied with the first pick. Writes
bench/results/sim_expert_layouts.json.
"""

from __future__ import annotations

import json
import platform
import sys
import time
from pathlib import Path

from myria.sim.planner import plan
from myria.sim.runspec import calibration_path, load

OUT = Path(__file__).resolve().parent / "results" / "sim_expert_layouts.json"
KEYS = ("tp", "pp", "cp", "dp", "vpp", "micro_batch", "recompute", "zero_stage",
        "reshard_after_forward")


def main(argv: list[str]) -> int:
    runs = {r.name: r for r in load(calibration_path().with_name("expert_layouts.toml"))}
    rows = []
    for name in argv or list(runs):
        r = runs[name]
        t0 = time.perf_counter()
        res = plan(r, top=10 ** 6)
        p = r.parallel
        same = [(i + 1, x) for i, x in enumerate(res.ranked)
                if (x.layout["tp"], x.layout["pp"], x.layout["cp"], x.layout["dp"])
                == (p.tp, p.pp, p.cp, r.dp)]
        row = {"run": name, "evaluated": res.evaluated, "fitting": res.fitting,
               "seconds": time.perf_counter() - t0,
               "best_mfu": max(x.mfu for x in res.ranked),
               "tied": sum(1 for x in res.ranked if x.extra["tied"]),
               "band": res.ranked[0].extra["band"],
               "first": {k: res.ranked[0].layout[k] for k in KEYS},
               "published": [{"rank": i, "mfu": x.mfu, "memory_gb": x.memory.total / 1e9,
                              "tied": x.extra["tied"], **{k: x.layout[k] for k in KEYS}}
                             for i, x in same[:5]]}
        rows.append(row)
        best = row["published"][0] if row["published"] else None
        print(f"{name}: {res.evaluated:,} layouts, {res.fitting:,} fit; published degrees "
              + (f"rank {best['rank']} (vpp {best['vpp']}, {best['recompute']}, ZeRO "
                 f"{best['zero_stage']}, MFU {best['mfu']:.3f}, tied {best['tied']})" if best
                 else "not ranked") + f"; best MFU {row['best_mfu']:.3f}", flush=True)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps({"command": "bench/sim_expert_layouts.py", "machine":
                               f"{platform.machine()} CPU (2 cores, shared)",
                               "date": time.strftime("%Y-%m-%d"), "rows": rows}, indent=1))
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
