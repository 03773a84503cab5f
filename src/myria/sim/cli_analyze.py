"""`myria analyze CONFIG`: the per-operator roofline table (the "memory wall" analysis).

CONFIG is a simulator run file (`[[run]]` tables or one run) or a myria training config (the
TOML `myria train` reads); the latter is priced as `myria simulate` prices it (`cli_simulate.
config_run_of`: the device is --gpu, the layout the config's [parallel] section over --nproc
processes, the run named by the file), and a run file refuses --gpu and --nproc as `simulate`
does (it sets [cluster] itself), a training config --run (it is one run).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from myria.errors import ConfigError
from myria.sim import runspec
from myria.sim.perf import simulate
from myria.sim.step_result import StepResult


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="run TOML (simulator schema) or myria training TOML")
    parser.add_argument("--run", default="", help="with several runs in the file: which one "
                        "(default: the first)")
    parser.add_argument("--gpu", default="", help="device for a training config "
                        "(a100-sxm-80gb, h100-sxm-80gb, h200, cpu; default: as `myria train "
                        "--dry-run` chooses: the local GPU, an H100 for a bf16 config, else "
                        "this CPU)")
    parser.add_argument("--nproc", type=int, default=None,
                        help="processes for a training config (default: the fewest its "
                        "[parallel] layout needs, dp_replicate x tp x pp x cp)")
    parser.add_argument("--sort", choices=("layer", "time"), default="layer",
                        help="row order: as executed in a layer, or by time")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")


def _load(args) -> StepResult:
    p = Path(args.config)
    from myria.config import read_text_file
    from myria.sim.cli_simulate import config_run_of, refuse_config_flags

    text = read_text_file(p)
    if runspec.is_run_file(text):
        refuse_config_flags(args, str(p))
        runs = runspec.loads(text, str(p))
        if args.run:
            match = [r for r in runs if r.name == args.run]
            if not match:
                raise ConfigError(f"--run {args.run!r}: no such run; runs: "
                                  f"{', '.join(r.name for r in runs)}")
            run = match[0]
        else:
            run = runs[0]
        return simulate(run, detail=True)
    run, hw = config_run_of(args, p)
    return simulate(run, hw=hw, detail=True)


HOST = "fwd+bwd"          # the phase column of a host-time row
GRAD_IN_FWD = "fwd (grad)"  # ... of a gradient GEMM run inside the forward


def _phase(row: dict) -> str:
    """A row's phase as the table shows it: where its time is spent, beyond fwd or bwd."""
    if row["kind"] == "host":
        return HOST
    if row["phase"] == "fwd" and row["name"].endswith((".dgrad", ".wgrad")):
        return GRAD_IN_FWD
    return row["phase"]


def run(args: argparse.Namespace) -> int:
    res = _load(args)
    rows = list(res.ops)
    if args.sort == "time":
        rows.sort(key=lambda r: -r["time_s"])
    if args.json:
        print(json.dumps({"name": res.name, "iteration_time_s": res.iteration_time_s,
                          "operators": rows, "breakdown": res.breakdown}))
        return 0
    from rich.table import Table

    from myria.sim.cli_plan import console

    con = console(120)
    peak = res.details["peak_tflops"]
    eff = res.details["efficiency"]
    tab = Table(title=f"{res.name}: operators of the critical pipeline stage, per iteration "
                f"and device")
    for col in ("operator", "phase", "kind", "GFLOP", "GB moved", "FLOP/byte", "bound",
                "time ms", "share"):
        tab.add_column(col, justify="left" if col in ("operator", "phase", "kind", "bound")
                       else "right")
    for r in rows:
        inten = r["intensity"]
        tab.add_row(r["name"], _phase(r) + (" x2" if r.get("recomputed") else ""), r["kind"],
                    f"{r['flops'] / 1e9:,.1f}",
                    f"{r['bytes'] / 1e9:,.2f}", "-" if inten == float("inf") or r["kind"] ==
                    "comm" else f"{inten:,.1f}", r["bound"], f"{r['time_s'] * 1e3:,.2f}",
                    f"{r['share']:.1%}")
    con.print(tab)
    comp = sum(r["share"] for r in rows if r["bound"] == "compute")
    mem = sum(r["share"] for r in rows if r["bound"] == "memory")
    net = sum(r["share"] for r in rows if r["kind"] == "comm")
    ridge = peak * 1e12 * eff["gemm"] / (res.details["memory_bw_gbs"] * 1e9 * eff["mem"])
    con.print(f"compute-bound operators {comp:.1%}, memory-bound {mem:.1%} of the "
              f"{res.iteration_time_s:.3f} s step; the layers' collectives (tensor, context, "
              f"expert parallel) {net:.1%} if nothing overlapped. Data-parallel traffic, the "
              "bubble and the optimizer are not operators of a layer: `myria simulate` has "
              "them, and what overlapping leaves exposed.")
    if any(r["kind"] == "host" for r in rows):
        con.print(f"{HOST}: the time between kernels (Python, autograd, module calls) of a "
                  "layer (host.block) and of the embedding and output head (host.head), forward "
                  "and backward together.")
    if any(_phase(r) == GRAD_IN_FWD for r in rows):
        con.print(f"{GRAD_IN_FWD}: the fused loss (myria.models.loss.fused_linear_cross_entropy) "
                  "computes the output layer's input and weight gradients chunk by chunk inside "
                  "the forward; its backward (cross_entropy.bwd) only scales them.")
    if any(r.get("recomputed") for r in rows):
        con.print("fwd x2: the forward and its recomputation in backward "
                  f"(training.recompute = {res.layout.get('recompute')!r}), both counted.")
    cpu = (" On a CPU both rates are those measured for torch's own kernels at the run's "
           "threads per process: the matmul peak, and the bandwidth elementwise operators "
           "reach, far below the memory's.") if res.layout.get("device") == "cpu" else ""
    con.print(f"ridge point {ridge:.0f} FLOP/byte ({peak:.3g} TFLOP/s x {eff['gemm']:.2f} over "
              f"{res.details['memory_bw_gbs']:.3g} GB/s x {eff['mem']:.2f}): operators below it "
              f"are memory-bound (GEMMs also lose efficiency on short dimensions).{cpu}")
    return 0
