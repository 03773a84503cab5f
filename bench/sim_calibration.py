"""Calibration of the performance model on Narayanan et al. 2021 Table 1 (the only data used).

    .venv/bin/python bench/sim_calibration.py          # per-row error table, JSON result
    .venv/bin/python bench/sim_calibration.py --fit    # refit E_GEMM, show prior sensitivity

Prints, per run, the measured and predicted iteration time and their error, the measured and
predicted hardware TFLOP/s per GPU (the paper's convention, counting the recompute forward) and
the predicted breakdown; writes bench/results/sim_calibration.json. `--fit` searches the one
fitted constant (E_GEMM) for the lowest mean absolute error of iteration time, and shows how the
best error moves when the a-priori constants (GEMM_HALF_DIM, E_MEM, kernel overhead) change.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import sys
import time
from pathlib import Path

from myria.sim import runspec
from myria.sim.band import NOMINAL_COVERAGE, UNCERTAINTY, band_from
from myria.sim.calibration import fit_gemm, loo_errors, mae
from myria.sim.hardware import build_hardware
from myria.sim.operators import DEFAULT_EFFICIENCY
from myria.sim.perf import simulate

OUT = Path(__file__).resolve().parent / "results" / "sim_calibration.json"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--fit", action="store_true", help="refit E_GEMM and show sensitivity")
    ap.add_argument("--cv", action="store_true", help="leave-one-out cross-validation: the "
                    "held-out error of each row; writes the planner's uncertainty band")
    args = ap.parse_args(argv)
    runs = runspec.load_calibration()
    hws = [build_hardware(r.cluster, r.training.precision) for r in runs]
    eff = DEFAULT_EFFICIENCY
    out: dict = {"source": "Narayanan et al. 2021, Table 1 (src/myria/sim/data/"
                           "calibration_runs.toml)",
                 "command": " ".join(["bench/sim_calibration.py",
                                     *(sys.argv[1:] if argv is None else argv)]),
                 "machine": f"{platform.machine()} CPU, {platform.python_version()}",
                 "date": time.strftime("%Y-%m-%d"),
                 "constants": dataclasses.asdict(eff)}
    if args.fit:
        g, m = fit_gemm(runs, hws, eff)
        print(f"fitted E_GEMM = {g:.4f} (MAE {m:.2%}) with GEMM_HALF_DIM = {eff.half_dim:g}, "
              f"E_MEM = {eff.mem:g}, kernel overhead = {eff.kernel_overhead_s * 1e6:g} us")
        out["fit"] = {"gemm": g, "mae": m}
        print("\nsensitivity: refit E_GEMM when one prior changes")
        print(f"{'prior':<24}{'value':>10}{'E_GEMM':>10}{'MAE':>9}")
        sens = []
        for name, values in (("half_dim", (0.0, 16.0, 32.0, 64.0, 128.0)),
                             ("mem", (0.7, 0.8, 0.85, 0.9, 1.0)),
                             ("kernel_overhead_s", (0.0, 3e-6, 10e-6))):
            for v in values:
                e = dataclasses.replace(eff, **{name: v})
                g2, m2 = fit_gemm(runs, hws, e, step=0.005)
                sens.append({"prior": name, "value": v, "gemm": g2, "mae": m2})
                print(f"{name:<24}{v:>10g}{g2:>10.3f}{m2:>9.2%}")
        out["sensitivity"] = sens
        eff = dataclasses.replace(eff, gemm=g)
    print()
    hdr = (f"{'run':<26}{'layout':<20}{'meas s':>9}{'pred s':>9}{'error':>8}{'meas TF':>9}"
           f"{'pred TF':>9}{'MFU':>7}  largest predicted costs")
    print(hdr)
    print("-" * len(hdr))
    rows, errs = [], []
    for r, h in zip(runs, hws):
        res = simulate(r, hw=h, eff=eff)
        meas = r.measured["iteration_time_s"]
        err = res.iteration_time_s / meas - 1
        errs.append(err)
        lay = res.layout
        layout = f"tp{lay['tp']} pp{lay['pp']} dp{lay['dp']} v{lay['vpp']} m{lay['microbatches']}"
        t = res.iteration_time_s
        top = sorted(res.breakdown.items(), key=lambda kv: -kv[1])[:4]
        costs = ", ".join(f"{k} {v / t:.0%}" for k, v in top)
        print(f"{r.name:<26}{layout:<20}{meas:>9.2f}{t:>9.2f}{err:>+8.1%}"
              f"{r.measured['tflops_per_gpu']:>9.0f}{res.hardware_tflops_per_gpu:>9.1f}"
              f"{res.mfu_megatron:>7.1%}  {costs}")
        rows.append({"name": r.name, "layout": lay, "measured_iteration_time_s": meas,
                     "predicted_iteration_time_s": t, "error": err,
                     "measured_hardware_tflops_per_gpu": r.measured["tflops_per_gpu"],
                     "predicted_hardware_tflops_per_gpu": res.hardware_tflops_per_gpu,
                     "predicted_mfu_megatron": res.mfu_megatron,
                     "measured_mfu_megatron": r.measured.get("mfu"),
                     "breakdown_fraction": {k: v / t for k, v in res.breakdown.items()}})
    print("-" * len(hdr))
    if args.cv:
        loo = loo_errors(runs, hws, eff)
        band = band_from(loo)
        print("leave-one-out (E_GEMM refitted without the row): " + ", ".join(
            f"{r.name.split('-')[-1]} {e:+.1%}" for r, e in zip(runs, loo)))
        print(f"held-out MAE {mae(loo):.2%}, band {band:.2%} (jackknife+ quantile, nominal "
              f"coverage {NOMINAL_COVERAGE:.0%}) -> the planner's band; wrote {UNCERTAINTY}")
        UNCERTAINTY.write_text(json.dumps({
            "band": band, "held_out_mae": mae(loo), "held_out_errors": dict(
                zip([r.name for r in runs], loo)), "command": "bench/sim_calibration.py --cv",
            "date": time.strftime("%Y-%m-%d"),
            "nominal_coverage": NOMINAL_COVERAGE,
            "meaning": "ceil((n+1) x nominal_coverage)-th smallest |held-out iteration-time "
                       "error| over the calibration rows (leave-one-out refit of E_GEMM; "
                       "jackknife+ quantile, Barber et al. 2021)"}, indent=1) + "\n")
        out["cv"] = {"held_out_errors": loo, "held_out_mae": mae(loo), "band": band}
    print(f"mean absolute error {mae(errs):.2%}, max {max(abs(e) for e in errs):.2%}, "
          f"mean signed {sum(errs) / len(errs):+.2%} over {len(errs)} runs")
    out.update({"rows": rows, "mae": mae(errs), "max_abs_error": max(abs(e) for e in errs)})
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(out, indent=1))
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
