"""`myria doctor --nproc 2` beside busy loops: a healthy but shared host must never read FAIL.

    PYTHONPATH=src .venv/bin/python bench/doctor_busy.py [--runs 20] [--busy 2]

Starts `--busy` busy loops (`while True: pass` processes), then runs `myria doctor --nproc 2
--json -` `--runs` times in a row with the default expectations, each with its own empty host
cache ($MYRIA_CACHE in a temporary directory: no pinned figure from a quieter moment helps).
Reported per run: PASS/FAIL, the warnings, the seconds it took and the load average. Writes
bench/results/doctor_busy.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench" / "results" / "doctor_busy.json"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--busy", type=int, default=2)
    a = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))   # the busy loops stop with it
    rows = []
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(a.busy)]
    try:
        with tempfile.TemporaryDirectory(prefix="myria-bench-doctor-") as d:
            for i in range(a.runs):
                env = dict(os.environ, MYRIA_CACHE=str(Path(d) / f"cache{i}"))
                env.pop("MYRIA_DOCTOR_FAULT", None)
                t0 = time.perf_counter()
                p = subprocess.run([sys.executable, "-m", "myria", "doctor", "--nproc", "2",
                                    "--json", "-"], cwd=ROOT, env=env, capture_output=True,
                                   text=True, timeout=600)
                dt = time.perf_counter() - t0
                try:
                    rep = json.loads(p.stdout)
                except ValueError:
                    rep = {"passed": False, "summary": (p.stderr or p.stdout)[-300:]}
                warns = [c["name"] for c in rep.get("checks", []) if c.get("status") == "warn"]
                fails = [f"{c['name']}: {c.get('reason', '')[:160]}" for c in
                         rep.get("checks", []) if c.get("status") == "fail"]
                row = {"run": i + 1, "passed": bool(rep.get("passed")), "status": p.returncode,
                       "fails": fails, "warnings": warns, "seconds": round(dt, 1),
                       "loadavg": round(os.getloadavg()[0], 1)}
                rows.append(row)
                print(f"run {i + 1:>2}: {'PASS' if row['passed'] else 'FAIL'} in {dt:.1f} s, "
                      f"load {row['loadavg']}; fails {fails or '-'}; warnings {warns or '-'}",
                      flush=True)
    finally:
        for p in busy:
            p.kill()
            p.wait()
    n_fail = sum(not r["passed"] for r in rows)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps({
        "command": f"bench/doctor_busy.py --runs {a.runs} --busy {a.busy}",
        "date": datetime.date.today().isoformat(), "machine": platform.processor() or
        platform.machine(), "cpus": os.cpu_count(), "fails": n_fail, "runs": rows}, indent=1))
    print(f"{n_fail} FAIL of {len(rows)} runs beside {a.busy} busy loops; wrote "
          f"{OUT.relative_to(ROOT)}")
    return 0 if n_fail == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
