"""Peak memory of a rank while it imports a Hugging Face model (`model.init_from`).

A random Llama (transformers, `save_pretrained`, fp32 safetensors) is imported by 2 processes
under FSDP (gloo, CPU): each builds the parallelised model (its shard allocated), resets its
peak resident set (`/proc/self/clear_refs` 5), runs `myria.interop.hf.load_weights`, and reports
the peak resident set over the import (VmHWM, file pages read through safetensors' mmap
included) against its resident set before it, its shard's bytes and the largest tensor's bytes.
The claim: peak during the import <= resident before (shard included) + one tensor.

    PYTHONPATH=src .venv/bin/python bench/interop_import_memory.py

writes bench/results/interop-import-memory.json.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SHAPE = dict(vocab_size=32000, hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
             num_attention_heads=8, num_key_value_heads=4, tie_word_embeddings=False)


def _kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def _worker(rank, world, port, out_dir):
    import torch
    from tests.dist import finish, init

    from myria import config as config_mod
    from myria.interop import hf
    from myria.layout import Layout
    from myria.parallel.dims import ParallelDims
    from myria.train.engine import Engine

    init(rank, world, port)
    d = Path(out_dir) / "llama"
    cfg = config_mod.load(None, [f"--model.init_from={d}", "--model.seq_len=128",
                                 "--training.device=cpu", "--training.dtype=float32"])
    hf.apply(cfg)
    engine = Engine(cfg, ParallelDims.build(Layout.resolve(cfg.parallel, world), "cpu"),
                    torch.device("cpu"))
    shard = sum(p.to_local().nbytes for part in engine.parts for p in part.parameters())
    largest = max(p.numel() * 4 for p in engine.parts[0].parameters())
    import gc
    gc.collect()
    before = _kib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    hf.load_weights(engine.parts, d, cfg.model)
    peak = _kib("VmHWM")
    (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps({
        "rank": rank, "rss_before": before, "peak_during_import": peak,
        "increase": peak - before, "shard_bytes": shard, "largest_tensor_bytes": largest}))
    finish()


def main() -> None:
    import platform
    import time

    import torch
    from tests.dist import spawn
    from transformers import LlamaConfig, LlamaForCausalLM

    with tempfile.TemporaryDirectory(prefix="interop-mem-") as tmp:
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(**SHAPE))
        model.save_pretrained(Path(tmp) / "llama", max_shard_size="100MB")
        total = sum(f.stat().st_size for f in (Path(tmp) / "llama").glob("*.safetensors"))
        del model
        spawn(_worker, 2, tmp)
        ranks = [json.loads((Path(tmp) / f"rank{r}.json").read_text()) for r in range(2)]
    out = {"when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "machine": f"{platform.node()} {os.cpu_count()} cores", "model": SHAPE,
           "safetensors_bytes": total, "layout": "FSDP, 2 ranks (gloo, CPU)", "ranks": ranks,
           "holds": all(r["increase"] <= r["largest_tensor_bytes"] for r in ranks)}
    dest = ROOT / "bench" / "results" / "interop-import-memory.json"
    dest.write_text(json.dumps(out, indent=1) + "\n")
    MiB = 2 ** 20
    for r in ranks:
        print(f"rank {r['rank']}: before {r['rss_before'] / MiB:.1f} MiB (shard "
              f"{r['shard_bytes'] / MiB:.1f}), peak {r['peak_during_import'] / MiB:.1f} MiB, "
              f"+{r['increase'] / MiB:.1f} MiB vs largest tensor "
              f"{r['largest_tensor_bytes'] / MiB:.1f} MiB; whole model {total / MiB:.1f} MiB")
    print(f"holds: {out['holds']} -> {dest}")


if __name__ == "__main__":
    main()
