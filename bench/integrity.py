"""Cost of the silent-data-corruption checks on the demo model (issues 10 and 27): at rest
(every rank's checksums of its parameters, optimizer state and gradients, every step) and in
compute (a partner recomputes one microbatch every `resilience.sdc_interval` steps), at the
default interval against both off, side by side in one invocation.

    .venv/bin/python bench/integrity.py [--steps 21] [--nproc 2] [--rounds 1] [--busy 0]

Trains the demo config (`configs/demo.toml`: the default FSDP layout, data/demo) with the
default `resilience.sdc_interval` ("on") and with `sdc_interval = 0` ("off"), alternating
on/off `--rounds` times so that a change of the machine's load hits both alike. From the event
files: the at-rest checksums' time per step (span `sdc_at_rest`), each compute check (span
`compute_check`, less the known-answer probe's one record per process, `probe_record`, shown
apart) and each replica check; from metrics.jsonl: the median and worst step time after the
warm-up; the checks of the checkpoints' copies (span `snapshot_expect`: the
expected checksums, on the training thread; `snapshot_verify`: the copy checked once copied and
once written, on the snapshot's threads) at the demo's own checkpoint interval, per checkpoint.
The cost of the checks is reported two ways: the spans as a fraction of the
median step (what the checks take), and the ratio of the runs' median step times (what a user
sees, within this machine's noise). `--busy N` runs N busy loops beside (a loaded host).
The straggler detector runs in the supervisor, off the training path: its time to score the run
is reported. Writes bench/results/integrity.json and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench" / "results" / "integrity.json"


def train(tag: str, steps: int, nproc: int, extra: list[str], data: str) -> dict:
    d = Path(tempfile.mkdtemp(prefix=f"myria-bench-integrity-{tag}-"))
    try:
        args = [sys.executable, "-m", "myria", "train", "--config", "configs/demo.toml",
                "--run-dir", str(d), f"--data.path={data}", f"--training.steps={steps}",
                "--logging.tensorboard=false",
                "--training.eval_interval=0", "--nproc", str(nproc), *extra]
        env = {k: v for k, v in os.environ.items() if k != "MYRIA_FAULT"}
        env["PYTHONPATH"] = str(ROOT / "src")
        subprocess.run(args, cwd=ROOT, env=env, check=True, capture_output=True, text=True)
        rows = [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()]
        times = [r["step_time_s"] for r in rows if "loss" in r and r["step"] >= 3]
        spans: dict[str, list[float]] = defaultdict(list)
        at_rest: dict[tuple, float] = defaultdict(float)   # (file, step) -> seconds
        checks: dict[tuple, float] = defaultdict(float)    # compute checks less the probe's
        for f in (d / "events").glob("*.jsonl"):
            for line in f.open():
                try:
                    e = json.loads(line)
                except ValueError:
                    continue
                if "t1" not in e:
                    continue
                s = (e["t1"] - e["t0"]) / 1e6
                if e.get("n") == "sdc_at_rest":
                    at_rest[(f.name, e.get("s"))] += s
                elif e.get("n") in ("compute_check", "replica_check", "gc", "snapshot_expect",
                                    "snapshot_verify"):
                    spans[e["n"]].append(s)
                    if e["n"] == "compute_check":
                        checks[(f.name, e.get("s"))] += s
                elif e.get("n") == "probe_record":   # inside a compute check, once per process
                    spans["probe_record"].append(s)
                    checks[(f.name, e.get("s"))] -= s
        t0 = time.perf_counter()
        from myria.observe.straggler import default_window, detect_dir

        detect_dir(d, window=default_window(steps))
        detect_s = time.perf_counter() - t0

        def med(v):
            return statistics.median(v) if v else None

        return {"median_step_s": statistics.median(times), "max_step_s": max(times),
                "steps": len(times), "at_rest_s_per_step": med(list(at_rest.values())),
                # the recurring cost: each check less the known-answer probe's one record
                "compute_check_s": med(list(checks.values())),
                "probe_record_s": med(spans["probe_record"]),
                "compute_checks": len(spans["compute_check"]),
                "replica_check_s": med(spans["replica_check"]),
                # per checkpoint, summed over its spans on one rank
                "snapshot_check_s": (sum(spans["snapshot_expect"]) + sum(
                    spans["snapshot_verify"])) / nproc if spans["snapshot_expect"] else None,
                "checkpoints": len(spans["snapshot_expect"]) // nproc,
                "gc_pause_s": med(spans["gc"]), "straggler_detect_s": round(detect_s, 4)}
    finally:
        shutil.rmtree(d, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=21)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--busy", type=int, default=0)
    ap.add_argument("--data", default="data/demo")
    a = ap.parse_args()
    if not (Path(a.data) / "index.json").exists() and not (ROOT / a.data / "index.json").exists():
        sys.exit(f"{a.data} is missing: myria prepare --corpus demo --out {a.data}")
    sys.path.insert(0, str(ROOT / "src"))
    from myria.config import ResilienceConfig

    default = ResilienceConfig().sdc_interval
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(a.busy)]
    load = os.getloadavg()[0]
    runs: dict[str, list[dict]] = {"on": [], "off": []}
    try:
        for i in range(a.rounds):
            for tag in (("on", "off") if i % 2 == 0 else ("off", "on")):
                interval = default if tag == "on" else 0
                runs[tag].append(train(tag, a.steps, a.nproc,
                                       [f"--resilience.sdc_interval={interval}"], a.data))
    finally:
        for p in busy:
            p.kill()
            p.wait()
    on_step = statistics.median(r["median_step_s"] for r in runs["on"])
    off_step = statistics.median(r["median_step_s"] for r in runs["off"])
    rest = statistics.median(r["at_rest_s_per_step"] for r in runs["on"])
    comp = statistics.median(r["compute_check_s"] for r in runs["on"])
    from myria import config as config_mod

    every = config_mod.load(ROOT / "configs" / "demo.toml").checkpoint.interval
    snap = [r["snapshot_check_s"] / max(1, r["checkpoints"]) for r in runs["on"]
            if r["snapshot_check_s"] is not None]
    snap_s = statistics.median(snap) if snap else 0.0
    res = {"command": "bench/integrity.py " + " ".join(sys.argv[1:]),
           "date": time.strftime("%Y-%m-%d %H:%M"),
           "machine": f"{os.cpu_count()} cores {platform.machine()}, load average at start "
                      f"{load:.1f}, {a.busy} busy loops beside",
           "sdc_interval": default, "runs": runs,
           "at_rest_fraction_of_step": rest / on_step,
           "compute_check_fraction_of_step": comp / default / on_step,
           "checkpoint_interval": every, "snapshot_check_s": snap_s,
           "snapshot_check_fraction_of_step": snap_s / every / on_step if every else 0.0,
           "checks_fraction_of_step": (rest + comp / default + (snap_s / every if every
                                                                 else 0.0)) / on_step,
           "step_time_ratio_on_off": on_step / off_step}
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(res, indent=1))
    print(f"| run (demo, {a.nproc} ranks, FSDP) | median step (s) | worst step (s) | at rest per "
          "step (s) | compute check (s) | checks |\n|---|---|---|---|---|---|")
    for tag, rs in runs.items():
        for r in rs:
            name = f"sdc_interval = {default} (default)" if tag == "on" else "sdc_interval = 0"
            print(f"| {name} | {r['median_step_s']:.3f} | {r['max_step_s']:.3f} | "
                  f"{r['at_rest_s_per_step'] or '-'} | {r['compute_check_s'] or '-'} | "
                  f"{r['compute_checks']} |")
    print(f"\nat rest {100 * res['at_rest_fraction_of_step']:.2f}% + compute "
          f"{100 * res['compute_check_fraction_of_step']:.2f}% (one check per {default} steps) + "
          f"checkpoint copies {100 * res['snapshot_check_fraction_of_step']:.3f}% (per "
          f"checkpoint {snap_s:.3f} s, one per {every} steps) = "
          f"{100 * res['checks_fraction_of_step']:.2f}% of a step by the spans; median step "
          f"on/off {res['step_time_ratio_on_off']:.4f}")


if __name__ == "__main__":
    main()
