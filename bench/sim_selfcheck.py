"""CPU self-check of the performance model: predict myria's own step time here, then measure it.

    .venv/bin/python bench/sim_selfcheck.py [--steps 10] [--warmup 3] [--only demo,pp2]

In one invocation: (1) measure this CPU's figures (`myria.sim.measure.cpu`: GEMM rates for every
shape the configurations run, SDPA, elementwise bandwidth, kernel overhead, optimizer, and gloo
collectives between 2 local processes), with the threads per process the trainer uses
(cores / processes), refreshing the cache; (2) predict each configuration's step time with
`myria.sim.perf.simulate_config` on those figures; (3) run `myria train` on it through the CLI
in a subprocess for a few steps and take the median `step_time_s` of RUN_DIR/metrics.jsonl after
the warm-up steps. Prints config | measured s | predicted s | error %, and writes
bench/results/sim_selfcheck.json and bench/RESULTS_selfcheck.md. The machine is shared: the
load average before and after every run is recorded next to its figures.
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
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT_JSON = ROOT / "bench" / "results" / "sim_selfcheck.json"
OUT_MD = ROOT / "bench" / "RESULTS_selfcheck.md"
DATE = time.strftime("%Y-%m-%d")
TOLERANCE = 0.15
QUIET = 0.3        # wait before each configuration until other processes use fewer cores
DISTURBED = 0.15   # a measurement or run during which others used more is repeated
RETRIES = 2


@dataclass
class Case:
    """One configuration of the self-check."""

    name: str
    what: str
    nproc: int
    overrides: list[str] = field(default_factory=list)
    config: str = "configs/demo.toml"


CASES = [
    Case("demo", "configs/demo.toml as `make demo` runs it: 2 processes, FSDP dp2", 2),
    Case("demo-1proc", "the demo on 1 process (2 threads, 4 microbatches)", 1),
    Case("small-dp2", "smaller model (hidden 256, 4 heads, 2 KV heads), 2 processes FSDP dp2", 2,
         ["--model.hidden=256", "--model.heads=4", "--model.kv_heads=2"]),
    Case("pp2", "demo on 2 processes, pp2 1F1B (4 layers, 4 microbatches of 4)", 2,
         ["--parallel.pp=2", "--parallel.schedule=1f1b"]),
]


def loadavg() -> float:
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return float("nan")


def cpu_jiffies() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine since boot (/proc/stat)."""
    try:
        f = [float(x) for x in Path("/proc/stat").read_text().split("\n")[0].split()[1:]]
    except (OSError, ValueError):
        return 0.0, 0.0
    hz = os.sysconf("SC_CLK_TCK")
    idle = f[3] + (f[4] if len(f) > 4 else 0.0)
    return (sum(f[:8]) - idle) / hz, sum(f[:8]) / hz


def children_cpu() -> float:
    """CPU seconds of this process and its waited-for children (and theirs)."""
    import resource

    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    s = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime + s.ru_utime + s.ru_stime


class OthersMeter:
    """Cores' worth of CPU that other processes used while a block of ours ran."""

    def __enter__(self) -> OthersMeter:
        self.busy0, _ = cpu_jiffies()
        self.own0 = children_cpu()
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        wall = time.perf_counter() - self.t0
        busy1, _ = cpu_jiffies()
        self.cores = max(0.0, (busy1 - self.busy0) - (children_cpu() - self.own0)) / wall


def others_busy(seconds: float = 2.0) -> float:
    """Cores' worth of CPU other processes use right now (sampled over `seconds`)."""
    b0, t0 = cpu_jiffies()
    time.sleep(seconds)
    b1, t1 = cpu_jiffies()
    return (b1 - b0) / seconds if t1 > t0 else float("nan")


def probe_gflops(threads: int, seconds: float = 0.5) -> float:
    """Median GFLOP/s of one fixed GEMM (1024 x 1408 x 512) at `threads`: the machine's speed
    now, recorded around each trial to show drift (not used by the prediction)."""
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        a, b = torch.randn(1024, 512), torch.randn(1408, 512)
        torch.mm(a, b.t())
        ts = []
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            t0 = time.perf_counter()
            torch.mm(a, b.t())
            ts.append(time.perf_counter() - t0)
        return round(2 * 1024 * 1408 * 512 / statistics.median(ts) / 1e9, 1)
    finally:
        torch.set_num_threads(old)


def wait_quiet(max_busy: float, timeout: float) -> dict:
    """Wait (up to `timeout` s) until other processes use less than `max_busy` cores."""
    t0 = time.perf_counter()
    busy = others_busy()
    while busy > max_busy and time.perf_counter() - t0 < timeout:
        time.sleep(10)
        busy = others_busy()
    return {"waited_s": round(time.perf_counter() - t0, 1), "others_cores": round(busy, 2)}


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def load_config(case: Case):
    from myria import config as config_mod

    return config_mod.load(str(ROOT / case.config), case.overrides)


def measure_case(case: Case) -> dict:
    """Re-measure every figure `case` needs now, as it will run: `nproc` processes at once."""
    from myria.device import cpu_device_spec
    from myria.sim.measure import cpu, profile_summary
    from myria.sim.perf import config_run, run_shape

    cfg = load_config(case)
    threads = cfg.training.threads or cpu.default_threads(case.nproc)
    t0 = time.perf_counter()
    la0 = loadavg()
    peak = cpu_device_spec(threads=threads, refresh=True).peak_fp32_tflops
    run, _, _ = config_run(cfg, case.nproc, cpu_device_spec(threads=threads))
    shape = run_shape(run)
    attempts = []
    for _ in range(RETRIES + 1):
        with OthersMeter() as others:
            prof = cpu.profile_for(shape, threads, case.nproc, pp=run.parallel.pp, refresh=True)
        attempts.append(round(others.cores, 2))
        if others.cores <= DISTURBED:
            break
        wait_quiet(QUIET, 60)
    return {"threads": threads, "peak_tflops": peak, "seconds": round(time.perf_counter() - t0, 1),
            "loadavg_before": la0, "loadavg_after": loadavg(),
            "others_cores_during_measurement": attempts,
            "profile": asdict(profile_summary.summarize(prof, shape, run.parallel.pp))}


def predict(case: Case) -> dict:
    """The simulator's prediction of `case` from the cached (just measured) figures."""
    from myria.device import cpu_device_spec
    from myria.sim.cpu_profile import default_threads
    from myria.sim.perf import simulate_config

    cfg = load_config(case)
    threads = cfg.training.threads or default_threads(case.nproc)
    res = simulate_config(cfg, case.nproc, cpu_device_spec(threads=threads))
    t = res.iteration_time_s
    return {"step_s": t, "mfu": res.mfu, "threads": threads, "layout": res.layout,
            "breakdown_s": {k: round(v, 4) for k, v in res.breakdown.items() if v},
            "stage_time_s": res.details.get("stage_time_s"),
            "bubble_fraction": res.details.get("bubble_fraction")}


def train(case: Case, steps: int, warmup: int, data: Path) -> dict:
    """`train_once`, repeated (up to RETRIES times) when other processes disturbed the run."""
    others = []
    for _ in range(RETRIES + 1):
        res = train_once(case, steps, warmup, data)
        others.append(res["others_cores_during_run"])
        if res["others_cores_during_run"] <= DISTURBED:
            break
        wait_quiet(QUIET, 60)
    res["others_cores_per_attempt"] = others
    return res


def train_once(case: Case, steps: int, warmup: int, data: Path) -> dict:
    """Run `myria train` for `steps` steps; median step_time_s after `warmup` steps."""
    # in memory when possible: the final checkpoint's write-back would otherwise keep the disk
    # threads busy into the next measurement
    shm = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
    run_dir = Path(tempfile.mkdtemp(prefix=f"selfcheck-{case.name}-", dir=shm))
    cmd = [sys.executable, "-m", "myria", "train", "--config", str(ROOT / case.config),
           "--run-dir", str(run_dir), "--nproc", str(case.nproc),
           f"--training.steps={steps}", "--checkpoint.interval=0",
           "--logging.tensorboard=false", "--logging.progress=false",
           f"--data.path={data}", *case.overrides]
    env = dict(os.environ)
    env.pop("MYRIA_FAULT", None)
    la0 = loadavg()
    busy0, _ = cpu_jiffies()
    own0 = children_cpu()
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=1800)
    wall = time.perf_counter() - t0
    busy1, _ = cpu_jiffies()
    others = max(0.0, (busy1 - busy0) - (children_cpu() - own0)) / wall
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {p.returncode}\n{p.stderr[-3000:]}")
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    times = [r["step_time_s"] for r in rows if "step_time_s" in r]
    shutil.rmtree(run_dir, ignore_errors=True)
    kept = times[warmup:]
    return {"step_s": statistics.median(kept), "min_s": min(kept), "max_s": max(kept),
            "steps_timed": len(kept), "all_step_s": [round(t, 4) for t in times],
            "mfu": statistics.median([r["mfu"] for r in rows[warmup:] if r.get("mfu")] or [0]),
            "wall_s": round(wall, 1), "loadavg_before": la0, "loadavg_after": loadavg(),
            "others_cores_during_run": round(others, 2),
            "command": "myria train --config " + case.config + f" --nproc {case.nproc} "
                       + " ".join([f"--training.steps={steps}", "--checkpoint.interval=0",
                                   *case.overrides])}


def ensure_data() -> Path:
    data = ROOT / "data" / "demo"
    if not (data / "index.json").exists():
        subprocess.run([sys.executable, "-m", "myria", "prepare", "--corpus", "demo", "--out",
                        str(data), "--quiet"], check=True, cwd=ROOT)
    return data


def write_markdown(result: dict) -> None:
    m = result["machine"]
    lines = [
        "## Performance model (issue 5): CPU self-check",
        "",
        f"Command: `{result['command']}`; result: `bench/results/sim_selfcheck.json`. "
        f"Machine: {m['cpu']}, {m['cores']} cores shared with other engineers' jobs, "
        f"torch {m['torch']}, Python {m['python']}; date {DATE}.",
        "",
        "The simulator predicts each step from figures measured on this CPU just before "
        "(`myria.sim.measure.cpu`, threads per process = cores / processes, as the trainer "
        "sets them); "
        "then `myria train` runs the configuration through the CLI and the median "
        f"`step_time_s` after {result['warmup']} warm-up steps is the measured figure. "
        "The machine is shared: before each configuration the bench waits (up to "
        f"{result['max_wait']:.0f} s) until other processes use under {result['quiet_below']} "
        "of a core; the load average (1 min) before/after each run and the cores other "
        "processes used during it (/proc/stat minus the run's own CPU time) are shown; a "
        f"measurement or run during which they used more than {DISTURBED} of a core is "
        f"repeated (up to {RETRIES} times).",
        "",
        f"Each configuration ran {result['repeats']} times (rounds over all configurations, "
        "each trial: measure, predict, train). Each trial's error pairs a prediction with "
        "its own run; \"error\" is the median of those trial errors; measured and predicted "
        "seconds are the medians over the trials.",
        "",
        "| config | processes x threads | layout | measured s | predicted s | error | "
        "trial errors | trials within 15% | measured s per trial | measured MFU | "
        "predicted MFU | others' cores during runs |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["cases"]:
        last = r["trials"][-1]
        lay = last["prediction"]["layout"]
        lay_s = f"dp{lay['dp']} pp{lay['pp']} m{lay['microbatches']}"
        if lay["dp"] > 1:
            lay_s += f" zero{lay['zero_stage']}"
        mfu_m = statistics.median(t["measured"]["mfu"] for t in r["trials"])
        mfu_p = statistics.median(t["prediction"]["mfu"] for t in r["trials"])
        lines.append(
            f"| {r['name']} | {r['nproc']} x {last['prediction']['threads']} | {lay_s} | "
            f"{r['measured_s']:.3f} | {r['predicted_s']:.3f} | {100 * r['error']:+.1f}% | "
            + " ".join(f"{100 * e:+.1f}%" for e in r["trial_errors"]) + " | "
            + f"{r['trials_within_tolerance']}/{len(r['trial_errors'])} | "
            + " ".join(f"{t['measured']['step_s']:.2f}" for t in r["trials"])
            + f" | {100 * mfu_m:.1f}% | {100 * mfu_p:.1f}% | "
            + " ".join(f"{t['measured']['others_cores_during_run']:.2f}" for t in r["trials"])
            + " |")
    errs = [abs(r["error"]) for r in result["cases"]]
    lines += ["", f"Mean absolute error {100 * sum(errs) / len(errs):.1f}%, max "
              f"{100 * max(errs):.1f}% (target: each within {100 * TOLERANCE:.0f}%)."]
    lines += ["", "Machine speed around each trial (a fixed 1024 x 1408 x 512 GEMM at the "
              "configuration's threads, GFLOP/s: before measuring, before training, after "
              "training; not used by the prediction):", ""]
    for r in result["cases"]:
        lines.append(f"- {r['name']}: " + "; ".join(
            " / ".join(f"{x:.0f}" for x in t["measured"].get("probe_gflops", []))
            for t in r["trials"]))
    lines += ["", "What was measured on this CPU just before the last trial of each "
              "configuration (medians of repeated calls, mean over the concurrent processes):",
              ""]
    for r in result["cases"]:
        f = r["trials"][-1]["figures"]
        p = f["profile"]
        g, a = p["gemm_gflops"], p["attn_gflops"]
        eb = p["eager_bw_gbs"]
        line = (f"- {r['name']} ({r['nproc']} x {f['threads']} threads): fp32 matmul peak "
                f"{1000 * f['peak_tflops']:.0f} GFLOP/s; GEMMs "
                f"{min(g.values()):.0f}-{max(g.values()):.0f} GFLOP/s over {len(g)} "
                "shape/layout keys; SDPA " + ", ".join(f"{k.split(',')[0][5:]} {v:.0f}"
                                                        for k, v in a.items())
                + f" GFLOP/s; eager elementwise {eb.get('eltwise', 0):.1f} GB/s in blocks, "
                f"{eb.get('head', 0):.1f} GB/s at the ends, {p['elementwise_gbs']:.1f} GB/s "
                f"on 16 MiB tensors; kernel overhead {p['kernel_overhead_us']:.1f} us; clip + "
                f"AdamW {p['optimizer_ns_per_param']:.1f} ns/parameter")
        if p["gloo"]:
            line += "; gloo " + ", ".join(
                f"{op} {v['alpha_us']:.0f} us + {v['bw_gbs']:.2f} GB/s"
                for op, v in p["gloo"].items())
        if p.get("fsdp_context_ms"):
            line += "; FSDP2 around the model's own block and ends " + ", ".join(
                f"{k} {v:.1f} ms" for k, v in p["fsdp_context_ms"].items())
        elif p.get("fsdp_ms"):
            line += "; FSDP2 per unit (block / root per microbatch, reduce per step) " + \
                ", ".join(f"{k} {v['block']:.1f} / {v['root']:.1f} / {v['reduce']:.1f} ms"
                          for k, v in p["fsdp_ms"].items())
        lines.append(line + f" (measured in {f['seconds']} s)")
    lines += ["", "Predicted breakdown of the last trial (seconds per step):", ""]
    for r in result["cases"]:
        bd = ", ".join(f"{k} {v:.3f}"
                       for k, v in r["trials"][-1]["prediction"]["breakdown_s"].items())
        lines.append(f"- {r['name']}: {bd}")
    if result.get("notes"):
        lines += ["", *result["notes"]]
    OUT_MD.write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=8, help="training steps per configuration")
    ap.add_argument("--repeats", type=int, default=3,
                    help="rounds over the configurations (each: measure, predict, train); the "
                    "table shows the medians")
    ap.add_argument("--warmup", type=int, default=3, help="steps left out of the median")
    ap.add_argument("--only", default="", help="comma-separated case names")
    ap.add_argument("--no-write", action="store_true", help="print only")
    ap.add_argument("--quiet-below", type=float, default=QUIET,
                    help="before each configuration wait until other processes use fewer "
                    "cores than this (sampled over 2 s)")
    ap.add_argument("--max-wait", type=float, default=120.0,
                    help="seconds to wait for quiet before each configuration")
    args = ap.parse_args(argv)
    cases = [c for c in CASES if not args.only or c.name in args.only.split(",")]
    import torch

    t_start = time.perf_counter()
    data = ensure_data()
    trials: dict[str, list] = {c.name: [] for c in cases}
    for rnd in range(args.repeats):
        for c in cases:
            quiet = wait_quiet(args.quiet_below, args.max_wait)
            print(f"[{rnd + 1}/{args.repeats}] {c.name}: measuring this CPU as {c.nproc} "
                  f"process(es) (load average {loadavg()}; other processes "
                  f"{quiet['others_cores']} cores after waiting {quiet['waited_s']} s) ...",
                  flush=True)
            threads = load_config(c).training.threads or os.cpu_count() // c.nproc or 1
            probe = [probe_gflops(threads)]
            figures = measure_case(c)
            figures["quiet"] = quiet
            pred = predict(c)
            print(f"  {figures['seconds']} s; predicted {pred['step_s']:.3f} s/step; training "
                  f"{args.steps} steps ...", flush=True)
            probe.append(probe_gflops(threads))
            meas = train(c, args.steps, args.warmup, data)
            probe.append(probe_gflops(threads))
            meas["probe_gflops"] = probe
            err = pred["step_s"] / meas["step_s"] - 1
            trials[c.name].append({"figures": figures, "measured": meas, "prediction": pred,
                                   "error": err})
            print(f"  measured {meas['step_s']:.3f} s, predicted {pred['step_s']:.3f} s "
                  f"({100 * err:+.1f}%), load {meas['loadavg_before']}->"
                  f"{meas['loadavg_after']}, other processes used "
                  f"{meas['others_cores_during_run']} cores; probe GEMM {probe} GFLOP/s "
                  "(before measuring, before and after training)", flush=True)
    results = []
    for c in cases:
        ts = trials[c.name]
        meas = statistics.median(t["measured"]["step_s"] for t in ts)
        pred = statistics.median(t["prediction"]["step_s"] for t in ts)
        # each prediction is paired with its own run (same minute of this machine); the
        # headline is the median of those errors, not the error between the two medians
        trial_errors = [t["error"] for t in ts]
        err = statistics.median(trial_errors)
        results.append({"name": c.name, "what": c.what, "nproc": c.nproc,
                        "overrides": c.overrides, "measured_s": meas, "predicted_s": pred,
                        "error": err, "error_of_medians": pred / meas - 1,
                        "within_tolerance": abs(err) <= TOLERANCE,
                        "trials_within_tolerance": sum(abs(e) <= TOLERANCE
                                                       for e in trial_errors),
                        "trial_errors": trial_errors, "trials": ts})
    print()
    print(f"{'config':12s} | {'measured s':>10s} | {'predicted s':>11s} | {'error %':>7s} | "
          "trials")
    print("-" * 70)
    for r in results:
        print(f"{r['name']:12s} | {r['measured_s']:10.3f} | {r['predicted_s']:11.3f} | "
              f"{100 * r['error']:+7.1f} | "
              + " ".join(f"{100 * e:+.1f}" for e in r["trial_errors"]))
    errs = [abs(r["error"]) for r in results]
    print(f"mean absolute error {100 * sum(errs) / len(errs):.1f}%, max {100 * max(errs):.1f}%"
          f"; total {time.perf_counter() - t_start:.0f} s")
    result = {
        "command": ".venv/bin/python bench/sim_selfcheck.py" + "".join(
            f" {a}" for a in (argv if argv is not None else sys.argv[1:])),
        "date": DATE,
        "machine": {"cpu": cpu_model(), "cores": os.cpu_count(), "torch": torch.__version__,
                    "python": platform.python_version(), "platform": platform.platform()},
        "steps": args.steps, "warmup": args.warmup, "repeats": args.repeats,
        "tolerance": TOLERANCE,
        "quiet_below": args.quiet_below, "max_wait": args.max_wait,
        "cases": results,
        "mean_abs_error": sum(errs) / len(errs), "max_abs_error": max(errs),
        "seconds": round(time.perf_counter() - t_start, 1),
    }
    if not args.no_write:
        OUT_JSON.parent.mkdir(parents=True, exist_ok=True)
        OUT_JSON.write_text(json.dumps(result, indent=1))
        write_markdown(result)
        print(f"wrote {OUT_JSON.relative_to(ROOT)} and {OUT_MD.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
