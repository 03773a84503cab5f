"""What the known-answer probe (myria.train.sdc_probe) costs on the demo config, against the
demo's step: one record (`KnownAnswerProbe.keep`, at the first compute check where every group
agreed) and one rerun (`changed`, on a persistent two-rank disagreement).

    OMP_NUM_THREADS=1 .venv/bin/python bench/sdc_probe_cost.py [--repeats 7] [--steps 10]
        [--data data/demo] [--out bench/results/sdc_probe_cost.json]

Trains `configs/demo.toml` (FSDP, 2 processes under torch.distributed.run) with
`resilience.sdc_interval = 4`, each worker `python -m myria train` with the probe's two calls
timed in place: at the probe's first record (step 4's compute check) every rank records it again
`--repeats` times and reruns it `--repeats` times, each call after a barrier (both are
collective), and checks that every rerun equals the record. The step: the median `step_time_s`
of metrics.jsonl over the steps after the first two, the check steps (every 4th: the compute
check and these repeats) left out. Writes bench/results/sdc_probe_cost.json.
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
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench" / "results" / "sdc_probe_cost.json"
INTERVAL = 4


def worker(out: Path, repeats: int, argv: list[str]) -> int:
    """A rank of the job: `myria train` with the probe's record timed (see the docstring)."""
    import torch.distributed as dist

    from myria.cli import main
    from myria.train import sdc_probe

    keep = sdc_probe.KnownAnswerProbe.keep

    def timed(fn):
        dist.barrier()
        t0 = time.perf_counter()
        r = fn()
        return time.perf_counter() - t0, r

    def keep_timed(self, args):
        first = self.record is None
        keep(self, args)
        if not first or self.record is None:
            return
        record, runs, reruns, codes = self.record, [], [], []
        for _ in range(repeats):
            self.record = None
            runs.append(timed(lambda: keep(self, args))[0])
        self.record = record
        for _ in range(repeats):
            s, code = timed(self.changed)
            reruns.append(s)
            codes.append(code)
        (out / f"rank{dist.get_rank()}.json").write_text(json.dumps(
            {"record_s": runs, "rerun_s": reruns, "rerun_codes": codes,
             "same": sdc_probe.SAME}))

    sdc_probe.KnownAnswerProbe.keep = keep_timed
    return main(argv)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--data", default="data/demo")
    ap.add_argument("--out", default=str(OUT))
    ap.add_argument("--worker", default="", help=argparse.SUPPRESS)
    a, rest = ap.parse_known_args()
    if a.worker:
        raise SystemExit(worker(Path(a.worker), a.repeats, rest[1:] if rest[:1] == ["--"]
                                else rest))
    tmp = Path(tempfile.mkdtemp(prefix="myria-probe-cost-"))
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    env.pop("MYRIA_FAULT", None)
    load0 = os.getloadavg()
    try:
        run = tmp / "run"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", "2", str(Path(__file__).resolve()), "--worker", str(tmp),
               "--repeats", str(a.repeats), "--", "train", "--config", "configs/demo.toml",
               f"--data.path={a.data}", f"--training.steps={a.steps}",
               f"--resilience.sdc_interval={INTERVAL}", "--training.eval_interval=0",
               "--logging.tensorboard=false", "--checkpoint.interval=0", "--run-dir", str(run)]
        p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                           timeout=1800)
        if p.returncode:
            raise SystemExit(f"the run failed ({p.returncode}): {p.stderr[-1500:]}")
        ranks = [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(2)]
        rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
        steps = [r["step_time_s"] for r in rows if "step_time_s" in r and r["step"] > 2
                 and r["step"] % INTERVAL]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    # a collective call lasts as long as its slowest rank: the per-call maximum over ranks
    record = [max(x) for x in zip(*(r["record_s"] for r in ranks))]
    rerun = [max(x) for x in zip(*(r["rerun_s"] for r in ranks))]
    step = statistics.median(steps)
    res = {"command": "bench/sdc_probe_cost.py " + " ".join(sys.argv[1:]),
           "date": time.strftime("%Y-%m-%d %H:%M"), "host": platform.node(),
           "load_start": load0, "load_end": os.getloadavg(),
           "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
           "record_s": record, "rerun_s": rerun, "step_s": steps,
           "record_median_s": statistics.median(record), "record_best_s": min(record),
           "rerun_median_s": statistics.median(rerun), "rerun_best_s": min(rerun),
           "step_median_s": step,
           "record_share_of_step": statistics.median(record) / step,
           "rerun_share_of_step": statistics.median(rerun) / step,
           "reruns_equal_record": all(c == r["same"] for r in ranks for c in r["rerun_codes"])}
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1))
    print(json.dumps({k: v for k, v in res.items() if k not in ("record_s", "rerun_s",
                                                                "step_s")}, indent=1))


if __name__ == "__main__":
    main()
