"""Planner speed: layouts evaluated per second by `myria plan` (target >= 10,000 in <= 10 s).

    .venv/bin/python bench/plan_speed.py [CASE ...] [--dump FILE | --check FILE]

Runs the full search (tp, pp, cp, ep, vpp, micro-batch, sequence parallelism, recomputation,
ZeRO stage; every candidate priced by the memory model, each that fits by the step model too)
for three models, each with cold caches (`perf.clear_caches`), and writes
bench/results/sim_plan_speed.json. Wall seconds are the target's measure; the process's CPU
seconds and the load average are recorded beside them, because on a shared host the wall time
counts the other processes' turns too. `--dump FILE` writes each case's first 50 layouts as the
planner ranks them (every figure of `StepResult.to_json` and the memory in bytes) and `--check
FILE` compares a run with such a file: a change meant to make the planner faster must leave
them equal, float for float.
"""

from __future__ import annotations

import json
import platform
import sys
import time
import tomllib
from pathlib import Path

from myria.sim import perf, runspec
from myria.sim.planner import plan

OUT = Path(__file__).resolve().parent / "results" / "sim_plan_speed.json"

CASES = {
    "gpt3-175b-1024xA100": """
[model]
arch = "gpt"
layers = 96
hidden = 12288
heads = 96
seq_len = 2048
[training]
global_batch = 1536
[kernels]
flash_attention = true
[overlap]
pp = true
dp = true
[cluster]
gpu = "a100-sxm-80gb"
gpus = 1024
""",
    "llama70b-512xH100-8k": """
[model]
arch = "llama"
layers = 80
hidden = 8192
heads = 64
kv_heads = 8
ffn_hidden = 28672
vocab = 128256
seq_len = 8192
[training]
global_batch = 512
[kernels]
flash_attention = true
[overlap]
pp = true
dp = true
[cluster]
gpu = "h100-sxm-80gb"
gpus = 512
""",
    "moe-8x7b-256xH100": """
[model]
arch = "llama"
layers = 32
hidden = 4096
heads = 32
kv_heads = 8
ffn_hidden = 14336
experts = 8
top_k = 2
seq_len = 4096
[training]
global_batch = 1024
[kernels]
flash_attention = true
[overlap]
dp = true
[cluster]
gpu = "h100-sxm-80gb"
gpus = 256
""",
}


TOP = 50   # layouts per case that --dump and --check compare


def ranking(res) -> dict:
    """A PlanResult as JSON, floats exact: counts and the ranked layouts (to_json, memory in
    bytes); what --dump writes and --check compares."""
    import dataclasses

    def one(r):
        return None if r is None else {**r.to_json(), "memory": dataclasses.asdict(r.memory)}

    return json.loads(json.dumps({
        "evaluated": res.evaluated, "fitting": res.fitting, "offloaded": res.offloaded,
        "ranked": [one(r) for r in res.ranked], "best_unfitting": one(res.best_unfitting),
        "best_runnable": one(res.best_runnable), "best_runnable_rank": res.best_runnable_rank},
        default=repr))


def main(argv: list[str]) -> int:
    import os

    dump = check = None
    if "--dump" in argv or "--check" in argv:
        i = argv.index("--dump") if "--dump" in argv else argv.index("--check")
        dump, check = (argv[i + 1], None) if argv[i] == "--dump" else (None, argv[i + 1])
        argv = argv[:i] + argv[i + 2:]
    names, rankings = argv, {}
    rows = []
    print(f"{'case':<24}{'layouts':>10}{'fit':>8}{'seconds':>9}{'layouts/s':>11}  best layout "
          "(MFU)")
    for name, text in CASES.items():
        if names and name not in names:
            continue
        base = runspec.parse_run(tomllib.loads(text) | {"name": name}, check=False)
        perf.clear_caches()
        t0, c0 = time.perf_counter(), time.process_time()
        res = plan(base, top=TOP if dump or check else 3)
        dt, cpu = time.perf_counter() - t0, time.process_time() - c0
        if dump or check:
            rankings[name] = ranking(res)
        best = res.ranked[0] if res.ranked else None
        lay = best.layout if best else {}
        desc = (f"tp{lay['tp']} pp{lay['pp']} dp{lay['dp']} cp{lay['cp']} ep{lay['ep']} "
                f"v{lay['vpp']} mb{lay['micro_batch']} {lay['recompute']} z{lay['zero_stage']}"
                f" ({best.mfu:.1%})") if best else "none fits"
        print(f"{name:<24}{res.evaluated:>10,}{res.fitting:>8,}{dt:>9.2f}"
              f"{res.evaluated / dt:>11,.0f}  {desc}")
        rows.append({"case": name, "evaluated": res.evaluated, "fitting": res.fitting,
                     "seconds": dt, "cpu_seconds": cpu, "load_average": os.getloadavg()[0],
                     "per_second": res.evaluated / dt, "best": lay,
                     "best_mfu": best.mfu if best else None})
    for r in rows:
        r["seconds_per_10000"] = 10_000 * r["seconds"] / r["evaluated"]
        r["cpu_seconds_per_10000"] = 10_000 * r["cpu_seconds"] / r["evaluated"]
    big = [r for r in rows if r["evaluated"] >= 10_000]
    ok = all(r["seconds_per_10000"] <= 10 for r in big)
    print("seconds per 10,000 layouts: " + ", ".join(
        f"{r['case']} {r['seconds_per_10000']:.2f} (CPU {r['cpu_seconds_per_10000']:.2f}, load "
        f"{r['load_average']:.1f})" for r in rows)
          + f"; target <= 10 s: {'met' if ok and big else 'NOT met'}")
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps({"command": "bench/plan_speed.py", "machine":
                               f"{platform.machine()} CPU (2 cores, shared)",
                               "date": time.strftime("%Y-%m-%d"), "rows": rows}, indent=1))
    print(f"wrote {OUT}")
    if dump:
        Path(dump).write_text(json.dumps(rankings))
        print(f"wrote the first {TOP} layouts of each case to {dump}")
    if check:
        want = json.loads(Path(check).read_text())
        same = [n for n in rankings if rankings[n] == want.get(n)]
        print(f"rankings equal to {check}: {len(same)} of {len(rankings)} cases "
              f"({', '.join(n for n in rankings if n not in same) or 'none'} differ)")
        if len(same) < len(rankings):
            return 1
    return 0 if ok and big else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
