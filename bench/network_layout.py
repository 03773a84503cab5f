"""Does flow-level network pricing change the recommended layout? `myria plan`'s search run twice,
the fabric priced by the analytic formula and by the flow-level simulator (myria.sim.netsim).

    PYTHONPATH=src .venv/bin/python bench/network_layout.py [--case NAME]

Writes bench/results/network_layout.json. The planner is not edited: its hardware is built with
`netsim.api.with_network_model`, which only swaps how the fabric prices patterns.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from myria.sim import planner, runspec
from myria.sim.hardware import build_hardware
from myria.sim.netsim.api import with_network_model

OUT = Path(__file__).resolve().parent / "results" / "network_layout.json"

BASE = """
name = "{name}"
[model]
arch = "llama"
layers = {layers}
hidden = {hidden}
heads = {heads}
kv_heads = 8
ffn_hidden = {ffn}
vocab = 128256
seq_len = 8192
[training]
global_batch = {batch}
micro_batch = 1
[parallel]
tp = 8
pp = 4
[kernels]
flash_attention = true
[overlap]
pp = true
dp = true
[cluster]
gpu = "h100-sxm-80gb"
gpus = {gpus}
topology = "{topology}"
oversubscription = {os}
routing = "{routing}"
flows_per_pair = {fpp}
"""

CASES = {
    "llama8b-2048-fat-tree-ecmp1": dict(layers=32, hidden=4096, heads=32, ffn=14336, batch=512,
                                        gpus=2048, topology="fat-tree", os=1.0,
                                        routing="ecmp", fpp=1),
    "llama70b-1024-clos3-7-ecmp2": dict(layers=80, hidden=8192, heads=64, ffn=28672, batch=512,
                                        gpus=1024, topology="clos3", os=7.0, routing="ecmp",
                                        fpp=2),
    "llama70b-2048-fat-tree-ecmp1": dict(layers=80, hidden=8192, heads=64, ffn=28672,
                                         batch=1024, gpus=2048, topology="fat-tree", os=2.0,
                                         routing="ecmp", fpp=1),
}


def layout(r) -> str:
    lay = r.layout
    return (f"tp{lay['tp']} pp{lay['pp']} dp{lay['dp']}" + (f" v{lay['vpp']}" if lay['vpp'] > 1
                                                            else "") + f" mb{lay['micro_batch']}")


def run_case(name: str, params: dict) -> dict:
    base = runspec.loads(BASE.format(name=name, **params))[0]
    space = planner.SearchSpace(recompute=["selective"], zero_stage=[1],
                                sequence_parallel=[True], hsdp=[False],
                                reshard_after_forward=[True])
    out = {}
    for model in ("analytic", "flow"):
        orig = planner.build_hardware
        planner.build_hardware = lambda c, p, _m=model: with_network_model(build_hardware(c, p), _m)
        t0 = time.perf_counter()
        try:
            res = planner.plan(base, space, top=5)
        finally:
            planner.build_hardware = orig
        out[model] = {"seconds": time.perf_counter() - t0,
                      "top": [{"layout": layout(r), "iteration_time_s": r.iteration_time_s,
                               "mfu": r.mfu, "dp_comm_exposed_s":
                               r.breakdown.get("dp_comm_exposed", 0.0),
                               "pp_p2p_exposed_s": r.breakdown.get("pp_p2p_exposed", 0.0)}
                              for r in res.ranked]}
    a, f = out["analytic"]["top"][0], out["flow"]["top"][0]
    out["changed"] = a["layout"] != f["layout"]
    print(f"{name}: analytic -> {a['layout']} ({a['mfu']:.1%}), flow -> {f['layout']} "
          f"({f['mfu']:.1%}){'  CHANGED' if out['changed'] else ''}", flush=True)
    for model in ("analytic", "flow"):
        for r in out[model]["top"]:
            print(f"   {model:8} {r['layout']:<22} {r['iteration_time_s']:.3f} s  MFU "
                  f"{r['mfu']:.1%}  dp exposed {r['dp_comm_exposed_s']:.3f} s  pp exposed "
                  f"{r['pp_p2p_exposed_s']:.3f} s")
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--case", action="append", default=[])
    args = ap.parse_args()
    names = args.case or list(CASES)
    res = {n: run_case(n, CASES[n]) for n in names}
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "cases": res}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
