"""`myria simulate RUN.toml`: predict iteration time, MFU, memory and a breakdown of each run.

RUN.toml is a simulator run file (`[[run]]` tables or one run; `--schema` prints it) or a myria
training config (the TOML `myria train`, `plan` and `analyze` read): that is priced as `myria
analyze` does, on --gpu (default: as `myria train --dry-run` chooses) with the config's
[parallel] layout over --nproc processes.
"""

from __future__ import annotations

import argparse
import json

from myria.errors import ConfigError
from myria.sim import reliability, runspec
from myria.sim.hardware import build_hardware
from myria.sim.perf import simulate
from myria.sim.step_result import BREAKDOWN_LABELS, StepResult


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_file", nargs="?", help="run TOML ([[run]] tables or one run); "
                        "default: the packaged calibration runs")
    parser.add_argument("--json", action="store_true",
                        help="print one JSON object per run (one per line)")
    parser.add_argument("--run", action="append", default=[],
                        help="simulate only the run(s) with this name (repeatable)")
    parser.add_argument("--network", default="analytic", choices=("analytic", "flow"),
                        help="how the fabric prices collectives: analytic (formula) or flow "
                        "(myria's flow-level network simulator, cached per pattern)")
    parser.add_argument("--schema", action="store_true",
                        help="print the run schema with every default and exit")
    parser.add_argument("--gpu", default="", help="device for a training config "
                        "(a100-sxm-80gb, h100-sxm-80gb, h200, cpu; default: the local GPU, an "
                        "H100 for a bf16 config, else this CPU)")
    parser.add_argument("--nproc", type=int, default=None,
                        help="processes for a training config (default: the fewest its "
                        "[parallel] layout needs, dp_replicate x tp x pp x cp)")
    from myria.sim.cli_plan import at_least

    reliability.add_arguments(parser, at_least(1e-3, float), at_least(0.0, float))


def _select(runs: list[runspec.RunSpec], names: list[str]) -> list[runspec.RunSpec]:
    if not names:
        return runs
    by = {r.name: r for r in runs}
    out = []
    for n in names:
        if n not in by:
            import difflib
            close = difflib.get_close_matches(n, list(by), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(f"--run {n!r}: no such run{hint}; runs: {', '.join(by)}")
        out.append(by[n])
    return out


def measured_error(run: runspec.RunSpec, res: StepResult) -> float | None:
    """Relative error of the predicted iteration time against `measured`, when present."""
    t = run.measured.get("iteration_time_s") if run.measured else None
    if isinstance(t, (int, float)) and t > 0:
        return res.iteration_time_s / t - 1
    return None


def _print_table(pairs: list[tuple[runspec.RunSpec, StepResult]], hws: list) -> None:
    """The table, then the notes: the band, what MFU counts, a causal run's MFU
    (`cli_plan.causal_note`), ETTR, each fabric's `note:` lines (`cli_plan.fabric_notes`)."""
    from rich.table import Table

    from myria.sim.cli_plan import causal_note, console, fabric_notes, layout_label

    con = console(190)
    tab = Table(title="myria simulate: predicted iteration", show_lines=False)
    for col in ("run", "layout", "iter s", "meas s", "err", "MFU", "TFLOP/s", "hw TFLOP/s",
                "tok/s", "mem GB", "fits", "ETTR", "ckpt every", "largest costs"):
        tab.add_column(col, justify="left" if col in ("run", "layout", "largest costs")
                       else "right", no_wrap=col != "largest costs")
    errs = []
    for run, res in pairs:
        layout = f"{layout_label(res.layout)} mb{res.layout['micro_batch']}"
        err = measured_error(run, res)
        if err is not None:
            errs.append(abs(err))
        t = res.iteration_time_s
        top = sorted(res.breakdown.items(), key=lambda kv: -kv[1])[:3]
        costs = ", ".join(f"{BREAKDOWN_LABELS[k]} {v / t:.0%}" for k, v in top if v > 0)
        meas = run.measured.get("iteration_time_s", "") if run.measured else ""
        tab.add_row(run.name, layout, f"{t:.3f}", f"{meas}" if meas else "-",
                    f"{err:+.1%}" if err is not None else "-", f"{res.mfu:.1%}",
                    _tflops(res.tflops_per_gpu), _tflops(res.hardware_tflops_per_gpu),
                    f"{res.tokens_per_s:,.0f}", f"{res.memory_gb_per_gpu:.1f}",
                    "yes" if res.fits else "NO", f"{res.extra['ettr']:.3f}",
                    reliability.interval_text(res.extra["checkpoint_interval_steps"]), costs)
    con.print(tab)
    if errs:
        con.print(f"mean absolute error of iteration time over {len(errs)} measured run(s): "
                  f"{sum(errs) / len(errs):.2%}")
    from myria.sim.band import describe

    con.print(describe(tuple(sorted({res.layout["device"] for _, res in pairs}))))
    con.print("TFLOP/s and MFU count model FLOPs as myria's live meter does (every matmul, 3x "
              "its forward); --json adds mfu_megatron (Narayanan et al. 2021's formula, as "
              "published tables use it) and mfu_causal; both charge attention for every key; "
              "hw TFLOP/s counts what runs (causal attention under FlashAttention, and "
              "recomputation).")
    for run, res in pairs:
        note = causal_note(res, run.model.seq_len, run.name)
        if note:
            con.print(note)
    if all(reliability.no_failures(res.extra["reliability"]) for _, res in pairs):
        con.print(f"ETTR: {reliability.NO_FAILURES}.")
    else:
        con.print("ETTR: expected share of wall time in kept steps under failures "
                  "(--failures-per-gpu-hour), checkpointing at the Young/Daly interval shown.")
    for line in dict.fromkeys(x for hw in hws for x in fabric_notes(hw)):
        con.print(line)
    for run, res in pairs:
        for w in res.warnings:
            con.print(f"[yellow]warning[/yellow] {run.name}: {w}")


def refuse_config_flags(args: argparse.Namespace, path: str) -> None:
    """--gpu and --nproc describe a training config's cluster; a run file sets its own
    ([cluster]): refuse them there rather than ignore them (`simulate` and `analyze`)."""
    if args.gpu or args.nproc is not None:
        raise ConfigError(f"--gpu and --nproc are for a training config; {path} is a "
                          "simulator run file (set [cluster] in it)")


def config_name(path) -> str:
    """The name a training config's run goes by in tables and JSON: its file's stem."""
    from pathlib import Path

    return Path(path).stem


def config_run_of(args: argparse.Namespace, path) -> tuple[runspec.RunSpec, object]:
    """(run, hardware) of a myria training config on --gpu and --nproc, as `myria simulate`
    and `myria analyze` price it: the config's [parallel] layout over --nproc processes
    (default: the fewest it needs), named by `config_name`; --run (a run file's) is refused."""
    from myria.device import planning_device
    from myria.interop import hf
    from myria.layout import Layout
    from myria.sim.hardware import device_spec
    from myria.sim.measure.cpu import measured_profile
    from myria.sim.perf import config_run

    if getattr(args, "run", None):
        raise ConfigError(f"--run picks a run of a simulator run file; {path} is a training "
                          "config, one run (named by its file)")
    cfg, _ = hf.load_config(path, weights=False)
    if args.nproc is not None and args.nproc < 1:
        raise ConfigError(f"--nproc {args.nproc}: give a positive number of processes")
    par = cfg.parallel
    nproc = args.nproc or Layout.fewest_processes(par)
    Layout.resolve(par, nproc).check(cfg, trainer=False)   # the layout's rules, before pricing
    spec = device_spec(args.gpu) if args.gpu else planning_device(cfg.training.dtype)
    run, spec, _ = config_run(cfg, nproc, spec)
    run.name = config_name(path)
    prof = measured_profile(cfg, nproc, spec)
    return run, build_hardware(run.cluster, run.training.precision, spec=spec, cpu=prof)


def run(args: argparse.Namespace) -> int:
    if args.schema:
        print(runspec.describe())
        return 0
    path = args.run_file or str(runspec.calibration_path())
    from myria.config import read_text_file

    if runspec.is_run_file(read_text_file(path, "run file")):
        refuse_config_flags(args, path)
        runs = [(r, build_hardware(r.cluster, r.training.precision))
                for r in _select(runspec.load(path), args.run)]
    else:
        runs = [config_run_of(args, path)]
    if args.network != "analytic":
        from myria.sim.netsim.api import with_network_model

        runs = [(r, with_network_model(hw, args.network)) for r, hw in runs]
    pairs = [(r, simulate(r, hw=hw)) for r, hw in runs]
    rel = reliability.from_args(args)
    for (r, res), (_, hw) in zip(pairs, runs, strict=True):
        e = reliability.run_ettr(res, r, hw, rel)
        res.extra.update(ettr=e.ettr, checkpoint_interval_steps=e.interval_steps,
                         reliability=e.to_json())
    if args.json:
        for r, res in pairs:
            obj = res.to_json()
            err = measured_error(r, res)
            if err is not None:
                obj["measured_iteration_time_s"] = r.measured["iteration_time_s"]
                obj["error"] = err
            print(json.dumps(obj))
        return 0
    _print_table(pairs, [hw for _, hw in runs])
    return 0


def _tflops(x: float) -> str:
    """TFLOP/s for a table: whole numbers for accelerators, 3 digits for a CPU's fractions."""
    return f"{x:.0f}" if x >= 10 else f"{x:.3g}"
