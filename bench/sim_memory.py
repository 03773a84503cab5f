"""The memory model against measured peaks of myria's own model on this CPU.

    PYTHONPATH=src .venv/bin/python bench/sim_memory.py

For each configuration (architecture x recomputation x shape, single process, fp32), one
microbatch's forward and backward of `myria.models.transformer.Transformer` with recomputation
applied as the trainer applies it (`parallel.parallelize.apply_ac`) runs under torch's profiler
with profile_memory=True, after a first microbatch (so the gradients exist, as under gradient
accumulation). The measured peak is the high-water mark of live tensor bytes above what was
live before the microbatch (weights and gradients); the model's is the activations plus the
temporaries of `myria.sim.memory.memory` for the same run (no fragmentation on a CPU: torch has
no caching allocator there). Writes bench/results/sim_memory.json.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.sim.test_memory import _measured_peak, _modelled_peak  # noqa: E402

from myria.config import ModelConfig  # noqa: E402

OUT = ROOT / "bench" / "results" / "sim_memory.json"
SHAPES = ((64, 128, 4, 2), (128, 256, 2, 3), (256, 512, 2, 3))


def main() -> int:
    rows = []
    print(f"{'arch':<6}{'recompute':<11}{'h':>5}{'s':>5}{'b':>3}{'L':>3}{'measured MB':>13}"
          f"{'model MB':>10}{'error':>8}")
    for arch in ("llama", "gpt"):
        for rec in ("none", "selective", "full"):
            for h, s, b, L in SHAPES:
                cfg = ModelConfig(arch=arch, vocab_size=512, layers=L, hidden=h, heads=4,
                                  kv_heads=2 if arch == "llama" else 0, seq_len=s)
                meas = _measured_peak(cfg, rec, b)
                mod = _modelled_peak(cfg, rec, b)
                err = mod / meas - 1
                rows.append({"arch": arch, "recompute": rec, "hidden": h, "seq_len": s,
                             "micro_batch": b, "layers": L, "measured_bytes": meas,
                             "model_bytes": mod, "error": err})
                print(f"{arch:<6}{rec:<11}{h:>5}{s:>5}{b:>3}{L:>3}{meas / 1e6:>13.2f}"
                      f"{mod / 1e6:>10.2f}{err:>+8.1%}")
    worst = max(abs(r["error"]) for r in rows)
    mean = sum(abs(r["error"]) for r in rows) / len(rows)
    print(f"{len(rows)} configurations: mean |error| {mean:.1%}, max {worst:.1%}")
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps({"command": "bench/sim_memory.py", "date": time.strftime(
        "%Y-%m-%d"), "measure": "torch.profiler profile_memory=True: peak live tensor bytes "
        "above the microbatch's start", "rows": rows, "mean_abs_error": mean,
        "max_abs_error": worst}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
