"""No false alarm from the silent-data-corruption checks: N clean runs on a loaded host.

    .venv/bin/python bench/sdc_clean.py [--runs 20] [--busy 2]
                                        [--layouts fsdp,ddp,hsdp,tp2dp2,pp2dp2]

Each run is `myria train` of the test suite's tiny model for 12 steps with
`resilience.sdc_interval = 1` (the at-rest checksums, the partner recomputation of a microbatch's
forward and backward and the replica check on every step: the most chances to raise a false
alarm), cycling through the layouts (the pipeline's compute check included),
with `--busy` busy loops beside. A run passes when it exits 0 and events.jsonl holds no `sdc`
line. Writes bench/results/sdc_clean.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.sdc_matrix import LAYOUTS, TINY, cli  # noqa: E402

OUT = ROOT / "bench" / "results" / "sdc_clean.json"


def write(rows: list[dict], a) -> dict:
    res = {"command": "bench/sdc_clean.py " + " ".join(sys.argv[1:]),
           "date": time.strftime("%Y-%m-%d %H:%M"), "busy_loops": a.busy, "runs": rows,
           "clean": sum(r["exit"] == 0 and r["sdc"] == 0 for r in rows),
           "false_alarms": sum(r["sdc"] > 0 for r in rows)}
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(res, indent=1))
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--busy", type=int, default=2)
    ap.add_argument("--layouts", default="fsdp,ddp,hsdp,tp2dp2,pp2dp2")
    ap.add_argument("--data", default="")
    a = ap.parse_args()
    sys.path.insert(0, str(ROOT / "src"))
    from myria import detections

    tmp = Path(tempfile.mkdtemp(prefix="myria-sdc-clean-"))
    data = a.data or str(tmp / "data")
    if not a.data:
        cli("prepare", "--corpus", "demo", "--max-docs", "20", "--vocab-size", "1024",
            "--out", data, "--quiet").check_returncode()
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(a.busy)]
    layouts = a.layouts.split(",")
    rows = []
    try:
        for i in range(a.runs):
            lay = layouts[i % len(layouts)]
            nproc, extra, _ = LAYOUTS[lay]
            run = tmp / f"run{i}"
            load = os.getloadavg()[0]
            t0 = time.time()
            p = cli("train", "--run-dir", str(run), "--nproc", str(nproc), f"--data.path={data}",
                    *TINY, *extra, "--training.steps=12", "--checkpoint.interval=6",
                    "--resilience.sdc_interval=1")
            sdc = detections.read(run, "sdc")
            rows.append({"run": i, "layout": lay, "exit": p.returncode, "sdc": len(sdc),
                         "load": round(load, 1), "wall_s": round(time.time() - t0, 1),
                         **({"stderr": p.stderr[-300:]} if p.returncode else {})})
            print(json.dumps(rows[-1]), flush=True)
            shutil.rmtree(run, ignore_errors=True)
            write(rows, a)   # after every run: a stopped series still leaves its result
    finally:
        for b in busy:
            b.kill()
            b.wait()
        shutil.rmtree(tmp, ignore_errors=True)
    res = write(rows, a)
    ok = res["clean"]
    print(f"\n{ok} of {len(rows)} clean runs without an sdc line and exit 0 "
          f"({res['false_alarms']} false alarms), {a.busy} busy loops beside, load average "
          f"{min(r['load'] for r in rows)}-{max(r['load'] for r in rows)}")


if __name__ == "__main__":
    main()
