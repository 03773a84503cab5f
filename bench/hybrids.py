"""Dense attention vs Gated DeltaNet and Mamba-2 hybrids at equal parameters and tokens.

Part 1, training (`myria train`, one process, the demo corpus: all of its 249 documents,
tokenized here with a 1024-token BPE so that the output layer does not dominate this small
model's time on a CPU): a dense Llama-style
model, a Gated DeltaNet hybrid (DDDA: three Gated DeltaNet layers to one attention layer) and a
Mamba-2 hybrid (MMMA), the MLP width of each hybrid chosen so that its parameter count equals
the dense model's (within 0.5%); the same steps, batches and schedule. Reported: validation
loss at the end, the median tokens/s after warm-up, the training model FLOPs per token.

Part 2, generation at long context (in this process, batch 1, fp32): the context grows in
1024-token prefill pieces (`myria.models.decode.forward_cached`, the cached forward of `myria
generate`; one piece's attention mask is 1024 x context, never context x context) and at 1k,
4k and 16k tokens the time per generated token (one token at a time against the cache/state)
and the bytes generation holds are measured, split into the attention layers' keys and values
(grow with the context) and the recurrent layers' state (constant).

Part 3 (--layouts): the hybrid DMAR trains under each parallel layout (4 gloo ranks) to the
losses of one process; the largest relative difference per layout.

    PYTHONPATH=src .venv/bin/python bench/hybrids.py              # parts 1 and 2
    PYTHONPATH=src .venv/bin/python bench/hybrids.py --layouts    # part 3 only

Writes bench/results/hybrids.json (hybrids-layouts.json) and bench/results/hybrids.png, and
prints the markdown tables of bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(HERE))
from architectures import _cli  # noqa: E402  (the same `myria` runner as the other bench)

SIZE = {"vocab_size": 1024, "layers": 4, "hidden": 128, "heads": 4, "chunk_size": 64}
MODELS = {
    "dense": {"arch": "llama"},
    "gated-deltanet hybrid (DDDA)": {"arch": "hybrid", "block_pattern": "DDDA"},
    "mamba-2 hybrid (MMMA)": {"arch": "hybrid", "block_pattern": "MMMA"},
}
CONTEXTS = (1024, 4096, 16384)
# one thread per process: on a shared, oversubscribed CPU, every small kernel of a 2-thread
# process waits for its second thread to be scheduled (the recurrent mixers run many)
THREADS = 1


def model_config(name: str, seq_len: int):
    """The ModelConfig of `name`, its MLP width matched to the dense model's parameters."""
    from myria.config import ModelConfig
    from myria.models.flops import param_counts

    dense = ModelConfig(**SIZE, seq_len=seq_len)
    cfg = ModelConfig(**SIZE, seq_len=seq_len, **MODELS[name])
    if name == "dense":
        return cfg
    target = param_counts(dense).total(dense.layers)
    per_unit = 3 * cfg.hidden * cfg.layers            # SwiGLU: 3 matrices of hidden x ffn
    base = param_counts(ModelConfig(**{**cfg.__dict__, "ffn_hidden": 8})).total(cfg.layers)
    ffn = 8 + round((target - base) / per_unit / 8) * 8
    return ModelConfig(**{**cfg.__dict__, "ffn_hidden": ffn})


def _overrides(cfg) -> list[str]:
    keys = ("arch", "block_pattern", "vocab_size", "layers", "hidden", "heads", "chunk_size",
            "ffn_hidden", "seq_len")
    return [f"--model.{k}={getattr(cfg, k)}" for k in keys]


def train_part(tmp: Path, seq_len: int, batch: int, steps: int) -> list[dict]:
    from myria.models.flops import model_flops_per_token, param_counts

    data = tmp / "demo1k"
    _cli("prepare", "--corpus", "demo", "--vocab-size", str(SIZE["vocab_size"]),
         "--out", str(data), "--quiet")
    rows = []
    for name in MODELS:
        cfg = model_config(name, seq_len)
        run = tmp / name.split()[0]
        _cli("train", "--run-dir", str(run), f"--data.path={data}", *_overrides(cfg),
             f"--training.steps={steps}", f"--training.global_batch={batch}",
             f"--training.micro_batch={batch}", f"--training.eval_interval={steps}",
             "--data.eval_batches=8", "--optimizer.warmup_steps=4", "--optimizer.lr=3e-3",
             "--checkpoint.interval=0", "--logging.tensorboard=false",
             "--logging.progress=false", f"--training.threads={THREADS}")
        m = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
        tps = [r["tokens_per_s"] for r in m if "tokens_per_s" in r][3:]
        loss = [r["loss"] for r in m if "loss" in r]
        rows.append({"model": name, "params": param_counts(cfg).total(cfg.layers),
                     "ffn_hidden": cfg.ffn_dim, "seq_len": seq_len, "steps": steps,
                     "tokens": steps * batch * seq_len,
                     "val_loss": [r["val_loss"] for r in m if "val_loss" in r][-1],
                     "loss_curve": loss, "tokens_per_s": statistics.median(tps),
                     "model_flops_per_token": model_flops_per_token(cfg)})
        print(f"train {name:30s} params {rows[-1]['params']:,}: val loss "
              f"{rows[-1]['val_loss']:.3f}, {rows[-1]['tokens_per_s']:,.0f} tok/s", flush=True)
    return rows


def generation_part(new_tokens: int) -> list[dict]:
    import torch

    from myria.models.decode import KVCache, forward_cached, rope_for
    from myria.models.transformer import build_model

    torch.set_num_threads(THREADS)
    rows = []
    for name in MODELS:
        cfg = model_config(name, 256)
        model = build_model(cfg, "cpu")
        model.init_weights(0)
        model.eval()
        cache, rope = KVCache(), rope_for(model, CONTEXTS[-1] + 4 * new_tokens)
        x = torch.randint(1, cfg.vocab_size, (1, CONTEXTS[-1]),
                          generator=torch.Generator().manual_seed(0))
        t_prefill, done = 0.0, 0
        for ctx in CONTEXTS:
            while len(cache) < ctx:
                piece = x[:, done:done + min(1024, ctx - len(cache))]
                t0 = time.perf_counter()
                forward_cached(model, piece, cache, rope)
                t_prefill += time.perf_counter() - t0
                done += piece.shape[1]
            at = len(cache)
            kv = sum(t.numel() * t.element_size() for t in [*cache.k.values(),
                                                            *cache.v.values()])
            state = cache.nbytes()
            t0 = time.perf_counter()
            tok = x[:, :1]
            for _ in range(new_tokens):
                tok = forward_cached(model, tok, cache, rope)[:, -1:].argmax(-1)
            per_token = (time.perf_counter() - t0) / new_tokens
            rows.append({"model": name, "context": at, "prefill_s_total": t_prefill,
                         "ms_per_token": per_token * 1e3, "state_bytes": state,
                         "kv_bytes": kv, "recurrent_bytes": state - kv})
            print(f"generate {name:30s} ctx {at:6d}: {per_token * 1e3:6.1f} ms/token, state "
                  f"{state / 2**20:7.2f} MiB (recurrent {(state - kv) / 2**20:.3f}), prefill "
                  f"so far {t_prefill:.1f} s", flush=True)
    return rows


LAYOUTS = {
    "fsdp dp4": [],
    "tp2 (dp2)": ["--parallel.tp=2"],
    "pp2 (dp2)": ["--parallel.pp=2"],
    "tp2 x pp2": ["--parallel.tp=2", "--parallel.pp=2"],
    "tp2 x pp2, gpipe": ["--parallel.tp=2", "--parallel.pp=2", "--parallel.schedule=gpipe"],
    "hsdp 2x2": ["--parallel.dp_replicate=2", "--parallel.dp_shard=2"],
}
LAYOUT_MODEL = ["--model.vocab_size=1024", "--model.layers=4", "--model.hidden=64",
                "--model.heads=4", "--model.kv_heads=2", "--model.seq_len=64",
                "--model.arch=hybrid", "--model.block_pattern=DMAR", "--model.chunk_size=16",
                "--model.ssm_state=16", "--training.global_batch=8", "--training.micro_batch=2",
                "--optimizer.warmup_steps=4", "--training.steps=10", "--checkpoint.interval=0",
                "--logging.tensorboard=false", "--logging.progress=false", "--training.threads=1"]


def layouts_part(tmp: Path) -> dict:
    data = tmp / "tiny"
    _cli("prepare", "--corpus", "demo", "--max-docs", "20", "--vocab-size", "1024",
         "--out", str(data), "--quiet")

    def losses(run):
        rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
        return {r["step"]: r["loss"] for r in rows if "loss" in r}

    _cli("train", "--run-dir", str(tmp / "ref"), f"--data.path={data}", *LAYOUT_MODEL)
    ref = losses(tmp / "ref")
    out = {"reference_losses": ref, "layouts": {}}
    for i, (name, extra) in enumerate(LAYOUTS.items()):
        run = tmp / f"layout{i}"
        _cli("train", "--run-dir", str(run), f"--data.path={data}", *LAYOUT_MODEL, *extra,
             "--nproc", "4")
        got = losses(run)
        worst = max(abs(got[s] - ref[s]) / ref[s] for s in ref)
        out["layouts"][name] = {"args": extra, "max_rel_diff": worst,
                                "steps": len(got), "pass": worst <= 1e-4 and got.keys() ==
                                ref.keys()}
        print(f"layout {name:18s}: max relative loss difference {worst:.2e}", flush=True)
    return out


def plot(res: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    for r in res["train"]:
        axes[0].plot(range(1, len(r["loss_curve"]) + 1), r["loss_curve"],
                     label=f"{r['model']}: val {r['val_loss']:.3f}")
    for name in MODELS:
        g = [x for x in res["generate"] if x["model"] == name]
        c = [x["context"] for x in g]
        axes[1].plot(c, [x["state_bytes"] / 2**20 for x in g], "o-", label=name)
        axes[2].plot(c, [x["ms_per_token"] for x in g], "o-", label=name)
    axes[0].set_xlabel("step")
    axes[0].set_title("training loss (equal parameters and tokens)", fontsize=10)
    axes[1].set_title("generation state per sequence (MiB, fp32)", fontsize=10)
    axes[2].set_title("time per generated token (ms; shared CPU)", fontsize=10)
    for ax in axes[1:]:
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context (tokens)")
    axes[1].set_yscale("log")
    for ax in axes:
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def tables(res: dict) -> str:
    lines = ["| model | parameters | MLP width | val loss | tokens/s | training FLOPs/token |",
             "|---|---|---|---|---|---|"]
    for r in res["train"]:
        lines.append(f"| {r['model']} | {r['params']:,} | {r['ffn_hidden']} | "
                     f"{r['val_loss']:.3f} | {r['tokens_per_s']:,.0f} | "
                     f"{r['model_flops_per_token'] / 1e6:.2f} M |")
    lines += ["", "| model | context | prefill up to here, s | ms per new token | state MiB "
              "| of which attention KV | recurrent state |", "|---|---|---|---|---|---|---|"]
    for r in res["generate"]:
        lines.append(f"| {r['model']} | {r['context']:,} | {r['prefill_s_total']:.1f} | "
                     f"{r['ms_per_token']:.1f} | {r['state_bytes'] / 2**20:.2f} | "
                     f"{r['kv_bytes'] / 2**20:.2f} | {r['recurrent_bytes'] / 2**20:.3f} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=40, help="training steps per model (40)")
    ap.add_argument("--seq-len", type=int, default=256, help="training sequence length (256)")
    ap.add_argument("--batch", type=int, default=4, help="sequences per step (4)")
    ap.add_argument("--new-tokens", type=int, default=8,
                    help="tokens generated at each context (8)")
    ap.add_argument("--skip-train", action="store_true", help="part 2 only")
    ap.add_argument("--layouts", action="store_true", help="part 3 only: the parallel layouts")
    ap.add_argument("--replot", action="store_true", help="redraw from bench/results")
    a = ap.parse_args()
    import torch

    (HERE / "results").mkdir(exist_ok=True)
    machine = f"{os.cpu_count()}-core {platform.machine()} CPU, torch {torch.__version__}"
    if a.layouts:
        with tempfile.TemporaryDirectory() as tmp:
            res = layouts_part(Path(tmp))
        res |= {"command": "PYTHONPATH=src .venv/bin/python bench/hybrids.py --layouts",
                "machine": machine, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
        (HERE / "results" / "hybrids-layouts.json").write_text(json.dumps(res, indent=1))
        return
    if a.replot:
        res = json.loads((HERE / "results" / "hybrids.json").read_text())
    else:
        load = [os.getloadavg()[0]]
        train = []
        if not a.skip_train:
            with tempfile.TemporaryDirectory() as tmp:
                train = train_part(Path(tmp), a.seq_len, a.batch, a.steps)
        gen = generation_part(a.new_tokens)
        load.append(os.getloadavg()[0])
        res = {"command": "PYTHONPATH=src .venv/bin/python bench/hybrids.py",
               "machine": machine, "load_average": load,
               "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
               "settings": {**SIZE, "seq_len": a.seq_len, "batch": a.batch,
                            "steps": a.steps, "new_tokens": a.new_tokens},
               "train": train, "generate": gen}
        (HERE / "results" / "hybrids.json").write_text(json.dumps(res, indent=1))
    plot(res, HERE / "results" / "hybrids.png")
    print(tables(res))


if __name__ == "__main__":
    main()
