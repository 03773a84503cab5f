"""The bad-input sweep a new user tries, from the command line: each case must end in one line
(no traceback) and a non-zero exit status.

    PYTHONPATH=src .venv/bin/python bench/bad_inputs.py

Sets up a tiny prepared corpus and a 2-step run in a temporary directory, runs every case as
`python -m myria ...` in its own process, and writes bench/results/bad_inputs.json plus a table
(status, traceback lines, output lines, seconds, whether torch was imported before the answer, the
last line). The suite keeps one case per behaviour
(tests/test_config.py, tests/parallel/test_layout_errors.py, tests/data/test_prepare.py,
tests/train/test_train.py, ...); this script is the whole matrix.
"""

from __future__ import annotations

import datetime
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench" / "results" / "bad_inputs.json"
TINY = ["--model.vocab_size=1024", "--model.layers=2", "--model.hidden=64", "--model.heads=4",
        "--model.kv_heads=2", "--model.seq_len=64", "--training.global_batch=8",
        "--training.micro_batch=2", "--logging.tensorboard=false", "--training.steps=2"]


def myria(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "myria", *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=timeout)


def cases(t: Path, data: Path, run: Path) -> list[list[str]]:
    f = t / "afile"
    return [
        ["prepare", "--input", str(t / "nope.txt"), "--out", str(t / "o1")],
        ["prepare", "--input", str(t / "bin.dat"), "--out", str(t / "o2")],
        ["prepare", "--input", str(t / "latin1.txt"), "--out", str(t / "o3")],
        ["prepare", "--input", str(t / "empty.txt"), "--out", str(t / "o4")],
        ["prepare", "--corpus", "demo", "--max-docs", "3", "--out", str(data)],
        ["prepare", "--corpus", "demo", "--vocab-size", "-5", "--out", str(t / "o5")],
        ["train", "--config", str(t / "nope.toml"), "--run-dir", str(t / "r")],
        ["train", "--config", str(t / "latin1.txt"), "--run-dir", str(t / "r")],
        ["train", "--run-dir", str(t / "r"), f"--data.path={t / 'nodata'}", *TINY],
        ["train", "--run-dir", str(t / "r"), f"--data.path={data}", "--training.steps=abc"],
        ["train", "--run-dir", str(t / "r"), f"--data.path={data}", "--model.hidden=-64"],
        ["train", "--run-dir", str(t / "r"), f"--data.path={data}", "--training.global_batch=-4"],
        ["train", "--run-dir", str(t / "r"), f"--data.path={data}", "--modle.hidden=3"],
        ["train", "--run-dir", str(t / "r"), f"--data.path={data}", "--nproc", "3",
         "--parallel.tp=2", *TINY],
        ["train", "--run-dir", str(t / "r"), f"--data.path={data}", "--nproc", "4",
         "--model.experts=4", "--model.top_k=2", "--parallel.ep=4", "--parallel.dp_replicate=2",
         "--parallel.dp_shard=2", *TINY],
        ["train", "--run-dir", str(f), f"--data.path={data}", "--nproc", "1", *TINY],
        ["train", "--run-dir", str(t / "r"), f"--data.path={data}", "--nproc", "-1", *TINY],
        ["train", "--run-dir", str(t / "r"), f"--data.path={data}", "--nproc", "100000", *TINY],
        ["train", "--run-dir", str(t / "r"), f"--data.path={data}", "--stop-after", "-3", *TINY],
        ["supervise", "--run-dir", str(f), f"--data.path={data}", "--nproc", "1", *TINY],
        ["supervise", "--run-dir", str(t / "r"), f"--data.path={data}", "--nproc", "-1", *TINY],
        ["export", "--run-dir", str(t / "nope"), "--format", "hf", "--out", str(t / "e1")],
        ["export", "--run-dir", str(run), "--format", "hf", "--out", str(f)],
        ["generate", "--run-dir", str(t / "nope"), "--prompt", "hi"],
        ["plan", "configs/llama3-8b.toml", "--gpu", "h100-sxm-80gb", "--gpus", "12",
         "--gpus-per-node", "8"],
        ["plan", "configs/llama3-8b.toml", "--gpu", "h100-sxm-80gb", "--gpus", "10000000000"],
        ["plan", "configs/llama3-8b.toml", "--gpu", "nosuchgpu", "--gpus", "64"],
        ["simulate-network", "--topology", "fat-tree", "--gpus", "7", "--collective",
         "all-reduce", "--bytes", "1G"],
        ["simulate-network", "--topology", "fat-tree", "--gpus", "64", "--collective",
         "all-reduce", "--bytes", "-5G"],
        ["simulate", str(t / "nope.toml")],
        ["report", str(t / "nope")],
        ["doctor", "--nproc", "-2"],
    ]


def _imported(args: list[str]) -> str:
    """The top-level modules the case imported before it answered (`python -X importtime`)."""
    p = subprocess.run([sys.executable, "-X", "importtime", "-m", "myria", *args],
                       capture_output=True, text=True, cwd=ROOT, timeout=300)
    return " ".join(line.rsplit("|", 1)[-1].strip() for line in p.stderr.splitlines()
                    if line.startswith("import time:"))


def main() -> int:
    rows = []
    with tempfile.TemporaryDirectory() as d:
        t = Path(d)
        (t / "bin.dat").write_bytes(b"\x7fELF\x02\x01\x01\x00\x00\x00binary\x00\x00")
        (t / "latin1.txt").write_bytes("café naïve\n".encode("latin-1"))
        (t / "empty.txt").write_text("")
        (t / "afile").write_text("x\n")
        data, run = t / "data", t / "run"
        myria("prepare", "--corpus", "demo", "--max-docs", "20", "--vocab-size", "1024",
              "--out", str(data), "--quiet").check_returncode()
        myria("train", "--run-dir", str(run), f"--data.path={data}", *TINY).check_returncode()
        for args in cases(t, data, run):
            t0 = time.perf_counter()
            p = myria(*args)
            seconds = time.perf_counter() - t0
            out = (p.stdout + p.stderr).strip().splitlines()
            row = {"args": " ".join(a.replace(d, "TMP") for a in args), "status": p.returncode,
                   "tracebacks": sum("Traceback" in x for x in out), "lines": len(out),
                   "seconds": round(seconds, 2), "torch": "torch" in _imported(args),
                   "last": (out[-1] if out else "").replace(d, "TMP")[:200]}
            rows.append(row)
            print(f"{row['status']:>3} tb={row['tracebacks']} lines={row['lines']:<3} "
                  f"{seconds:5.1f} s{' (torch)' if row['torch'] else ''} {row['args']}\n"
                  f"    {row['last']}", flush=True)
    ok = all(r["status"] not in (0, 1) and r["tracebacks"] == 0 and r["lines"] == 1
             for r in rows)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps({"command": "bench/bad_inputs.py", "date":
                               datetime.date.today().isoformat(), "all_one_line": ok,
                               "cases": rows}, indent=1))
    print(f"{sum(r['lines'] == 1 and r['tracebacks'] == 0 for r in rows)} of {len(rows)} cases "
          f"one line, no traceback; {sum(not r['torch'] for r in rows)} answered without "
          f"importing torch; wrote {OUT.relative_to(ROOT)}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
