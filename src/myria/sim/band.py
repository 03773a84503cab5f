"""The model's uncertainty band: its half-width and nominal coverage, as the calibration stored
them (data/uncertainty.json, written by `bench/sim_calibration.py --cv` through
`myria.sim.calibration`), and the rule that turns leave-one-out residuals into a band.

A leaf of the simulator (no other myria import), read by the step model and the planner.
"""

from __future__ import annotations

import json
import math
from functools import lru_cache
from pathlib import Path

UNCERTAINTY = Path(__file__).resolve().parent / "data" / "uncertainty.json"
DEFAULT_BAND = 0.10  # used only when data/uncertainty.json is missing
NOMINAL_COVERAGE = 0.90  # the share of runs the band is meant to cover


def band_from(errs: list[float], coverage: float = NOMINAL_COVERAGE) -> float:
    """The half-width of the uncertainty band from leave-one-out residuals: the
    ceil((n + 1) x coverage)-th smallest |held-out error| (the jackknife+ / conformal
    quantile, Barber, Candes, Ramdas & Tibshirani 2021, "Predictive inference with the
    jackknife+"), so that a new run exchangeable with the calibration rows falls inside with
    probability >= `coverage` (>= 2 x coverage - 1 in the worst case of the jackknife+ theorem).
    The plain 90th percentile of n = 10 residuals (the first edition) covers only about
    9/11 = 82% of a new exchangeable run. With fewer than 1 / (1 - coverage) - 1 rows the
    largest residual is the best a finite band can do."""
    a = sorted(abs(e) for e in errs)
    if not a:
        return DEFAULT_BAND
    k = min(len(a), math.ceil((len(a) + 1) * coverage))
    return a[k - 1]


@lru_cache(maxsize=1)
def band_coverage() -> float:
    """The nominal coverage of the stored band (data/uncertainty.json)."""
    try:
        return float(json.loads(UNCERTAINTY.read_text()).get("nominal_coverage",
                                                             NOMINAL_COVERAGE))
    except (OSError, ValueError):
        return NOMINAL_COVERAGE


@lru_cache(maxsize=1)
def uncertainty() -> float:
    """Relative uncertainty of a predicted iteration time (and so of MFU), from the stored
    leave-one-out cross-validation of the calibration."""
    try:
        return float(json.loads(UNCERTAINTY.read_text())["band"])
    except (OSError, ValueError, KeyError):
        return DEFAULT_BAND


@lru_cache(maxsize=1)
def held_out_mae() -> float | None:
    """Mean |leave-one-out iteration-time error| over the calibration rows, as stored with
    the band (None when data/uncertainty.json is missing)."""
    try:
        return float(json.loads(UNCERTAINTY.read_text())["held_out_mae"])
    except (OSError, ValueError, KeyError):
        return None


@lru_cache(maxsize=1)
def calibration_devices() -> dict[str, int]:
    """Device -> number of calibration runs on it (data/calibration_runs.toml)."""
    import tomllib

    try:
        runs = tomllib.loads((UNCERTAINTY.parent / "calibration_runs.toml").read_text())["run"]
    except (OSError, ValueError, KeyError):
        return {}
    out: dict[str, int] = {}
    for r in runs:
        gpu = str(r.get("cluster", {}).get("gpu", "?"))
        out[gpu] = out.get(gpu, 0) + 1
    return out


def describe(devices: tuple[str, ...] = ()) -> str:
    """One line for the CLI: the band, its nominal coverage, the held-out error, what the
    calibration ran on, and whether `devices` (canonical names) are outside it."""
    mae = held_out_mae()
    cal = calibration_devices()
    on = ", ".join(f"{n} on {d}" for d, n in cal.items())
    outside = sorted(set(devices) - set(cal)) if cal else []
    return (f"model uncertainty: +/-{uncertainty():.1%} on iteration time and MFU at "
            f"{band_coverage():.0%} nominal coverage (jackknife+ quantile of the leave-one-out "
            f"errors on the calibration runs{f': {on}' if on else ''}" +
            (f"; leave-one-out mean absolute error {mae:.2%})" if mae is not None else ")") +
            (f"; {', '.join(outside)} {'is' if len(outside) == 1 else 'are'} outside them: "
             "the band is a floor there, not a measured width" if outside else ""))

