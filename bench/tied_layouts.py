"""A tied model (model.tie_embeddings) under every kind of layout that shares or splits its
embedding: losses of each against one process, and whether the two ends are equal at the end.

Under TP the embedding and the head are one vocabulary-sharded tensor; under PP the first and
last stage each hold a copy whose gradients are summed every step (myria.parallel.pipeline.
TiedEmbedding). Each layout trains a 4-layer tiny model (1024 vocab, hidden 64) 3 steps at
lr 1e-2 on the demo corpus, `myria train` end to end on CPU (gloo).

    PYTHONPATH=src .venv/bin/python bench/tied_layouts.py

writes bench/results/tied-layouts.json.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

BASE = ["--model.vocab_size=1024", "--model.layers=4", "--model.hidden=64", "--model.heads=4",
        "--model.kv_heads=2", "--model.seq_len=64", "--training.global_batch=8",
        "--training.micro_batch=1", "--optimizer.warmup_steps=0", "--optimizer.lr=1e-2",
        "--logging.tensorboard=false", "--training.steps=3", "--model.tie_embeddings=true"]
LAYOUTS = {
    "one process": [],
    "tp2": ["--nproc", "2", "--parallel.tp=2", "--parallel.dp_shard=1"],
    "tp2 without SP": ["--nproc", "2", "--parallel.tp=2", "--parallel.dp_shard=1",
                       "--parallel.sequence_parallel=false", "--parallel.loss_parallel=false"],
    "tp2 x dp2 (FSDP)": ["--nproc", "4", "--parallel.tp=2"],
    "pp2 (1f1b)": ["--nproc", "2", "--parallel.pp=2", "--parallel.dp_shard=1"],
    "pp2 zbv (both ends on rank 0)": ["--nproc", "2", "--parallel.pp=2", "--parallel.vpp=2",
                                      "--parallel.schedule=zbv", "--parallel.dp_shard=1"],
    "pp4 (1f1b)": ["--nproc", "4", "--parallel.pp=4", "--parallel.dp_shard=1",
                   "--parallel.schedule=1f1b"],
    "tp2 x pp2": ["--nproc", "4", "--parallel.tp=2", "--parallel.pp=2",
                  "--parallel.dp_shard=1"],
}


def cli(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "myria", *args], check=True, cwd=ROOT,
                   capture_output=True, text=True)


def main() -> None:
    import torch
    from tests.conftest import losses
    from tests.interop.test_hf_import import _checkpoint_tensors

    tmp = Path(tempfile.mkdtemp(prefix="myria-tied-"))
    data = tmp / "data"
    cli("prepare", "--corpus", "demo", "--max-docs", "20", "--vocab-size", "1024", "--out",
        str(data), "--quiet")
    rows, ref = [], None
    for name, extra in LAYOUTS.items():
        run = tmp / name.replace(" ", "_")
        t0 = time.time()
        cli("train", "--run-dir", str(run), f"--data.path={data}", *BASE, *extra)
        got = losses(run)
        ref = ref or got
        emb, head = _checkpoint_tensors(run, "tok_embeddings.weight", "output.weight")
        rows.append({"layout": name, "losses": [got[s] for s in sorted(got)],
                     "max_rel_diff": max(abs(got[s] - ref[s]) / ref[s] for s in ref),
                     "ends_equal": bool(torch.equal(emb, head)),
                     "wall_s": round(time.time() - t0, 1)})
        r = rows[-1]
        print(f"| {name} | {' '.join(f'{x:.6f}' for x in r['losses'])} | "
              f"{r['max_rel_diff']:.1e} | {r['ends_equal']} |", flush=True)
    out = ROOT / "bench" / "results" / "tied-layouts.json"
    out.write_text(json.dumps({"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                               "args": BASE, "rows": rows}, indent=1))
    print("->", out)


if __name__ == "__main__":
    main()
