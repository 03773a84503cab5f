"""Two caches filled apart in time under different load pin per-core peaks within 5%.

    PYTHONPATH=src .venv/bin/python bench/peak_load.py [--pairs 4] [--busy 2] [--gap 60]

Each pair fills one empty cache ($MYRIA_CACHE in a temporary directory) beside `--busy` busy
loops (`while True: pass` processes) and another `--gap` seconds later without them, each with
`myria.device.cpu_core_peak` as `myria train` calls it on first use. Reported per pair: both
pinned figures, their rounds, the host's load average at each and the ratio. Writes
bench/results/peak_load.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench" / "results" / "peak_load.json"
CODE = ("import json, os; from myria import device; f = device.cpu_core_peak(); "
        "e = device._load_figures()[device.cpu_key(1)][device.CORE_PEAK]; "
        "print(json.dumps({'value': f.value, 'rounds': e.get('rounds'), "
        "'loadavg': os.getloadavg()[0]}))")


def fill(cache: Path) -> dict:
    env = dict(os.environ, MYRIA_CACHE=str(cache))
    p = subprocess.run([sys.executable, "-c", CODE], env=env, check=True, capture_output=True,
                       text=True)
    return json.loads(p.stdout.splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pairs", type=int, default=4)
    ap.add_argument("--busy", type=int, default=2)
    ap.add_argument("--gap", type=float, default=60.0)
    a = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="myria-bench-peak-") as d:
        for i in range(a.pairs):
            busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
                    for _ in range(a.busy)]
            try:
                time.sleep(1.0)
                loaded = fill(Path(d) / f"loaded{i}")
            finally:
                for p in busy:
                    p.kill()
                    p.wait()
            time.sleep(a.gap)
            quiet = fill(Path(d) / f"quiet{i}")
            ratio = loaded["value"] / quiet["value"]
            rows.append({"loaded": loaded, "quiet": quiet, "ratio": round(ratio, 4)})
            print(f"pair {i + 1}: beside {a.busy} busy loops {loaded['value'] * 1e3:.1f} "
                  f"GFLOP/s (load {loaded['loadavg']:.1f}, {len(loaded['rounds'])} rounds), "
                  f"{a.gap:g} s later {quiet['value'] * 1e3:.1f} (load {quiet['loadavg']:.1f}, "
                  f"{len(quiet['rounds'])} rounds): ratio {ratio:.3f}", flush=True)
    worst = max(abs(r["ratio"] - 1) for r in rows)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps({
        "command": f"bench/peak_load.py --pairs {a.pairs} --busy {a.busy} --gap {a.gap:g}",
        "date": datetime.date.today().isoformat(), "machine": platform.processor() or
        platform.machine(), "cpus": os.cpu_count(), "worst_difference": round(worst, 4),
        "pairs": rows}, indent=1))
    print(f"worst difference {100 * worst:.1f}% (target: within 5%); wrote "
          f"{OUT.relative_to(ROOT)}")
    return 0 if worst <= 0.05 else 1


if __name__ == "__main__":
    sys.exit(main())
