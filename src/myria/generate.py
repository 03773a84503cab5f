"""`myria generate`: text from a checkpoint, on one process, with a KV cache.

    myria generate --run-dir runs/demo --prompt "My fellow citizens" --max-new-tokens 60

Loads the newest checkpoint that verifies (or `--step N`), encodes the prompt with the tokenizer
the checkpoint was trained with (the copy kept in the run directory, so the data directory may
have moved or been re-prepared since; see myria.data.fingerprint), and decodes token by token: one
forward over the prompt fills the cache of keys and values of every layer, then each new token
is one forward of one position against the cache (memory grows by one key and value per layer
per token; no attention over the whole sequence again). RetNet, Griffin's recurrent blocks,
Gated DeltaNet, Mamba-2 and linear attention carry a recurrent state instead, and local
attention (a window, block-sparse) keeps only the keys a later query can see: constant memory
per token. `--temperature 0` is greedy and deterministic (for the Llama architecture it equals
`transformers`' greedy `generate` on the exported model, token for token: tested); above 0 it
samples from softmax(logits / T), over the `--top-k` most likely tokens when given, with a
generator seeded by `--seed`. Generation stops at the end-of-text token or after `--max-new-tokens`.

The cached forward (myria.models.decode: each recurrent mixer's `forward_recurrent`, the
attention over the cache) reuses the model's own modules; this module judges the arguments,
the run directory and the tokenizer before it imports torch.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

from myria.errors import ConfigError


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--run-dir", required=True, help="run directory holding checkpoints/")
    p.add_argument("--prompt", required=True, help="text to continue")
    p.add_argument("--max-new-tokens", type=int, default=50, help="tokens to generate (50)")
    p.add_argument("--temperature", type=float, default=0.8,
                   help="sampling temperature; 0 = greedy, deterministic (0.8)")
    p.add_argument("--top-k", type=int, default=0,
                   help="sample among the K most likely tokens only; 0 = all (0)")
    p.add_argument("--seed", type=int, default=0, help="seed of the sampler (0)")
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: newest)")
    p.add_argument("--tokenizer", metavar="PATH", default=None,
                   help="tokenizer.json to use, for checkpoints that kept none (it must match "
                   "the fingerprint the checkpoint recorded, if any)")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                   help="where to decode: auto (cuda if available, else cpu), cpu or cuda")


def run(args) -> int:
    from myria.data import fingerprint
    from myria.data.tokenizer import decode, load_tokenizer, read_specials
    from myria.errors import CheckpointError
    from myria.train.export import read_checkpoint

    if args.max_new_tokens < 1:
        raise ConfigError(f"--max-new-tokens {args.max_new_tokens}: must be at least 1")
    if not math.isfinite(args.temperature) or args.temperature < 0:
        raise ConfigError(f"--temperature {args.temperature}: must be a finite number, 0 "
                          "(greedy) or more")
    if args.top_k < 0:
        raise ConfigError(f"--top-k {args.top_k}: must be 0 (all tokens) or more")
    run_dir = Path(args.run_dir)
    if not run_dir.is_dir():
        raise CheckpointError(f"run directory {run_dir} does not exist" if not run_dir.exists()
                              else f"--run-dir {run_dir} is a file, not a run directory")

    def load(path: Path):
        tok_file, note = fingerprint.checkpoint_tokenizer(run_dir, path, args.tokenizer)
        tok = load_tokenizer(tok_file)
        eos = read_specials(tok_file, tok).eos_id
        # torch after the arguments and the tokenizer are judged: seconds on a loaded host
        from myria.train.export import load_checkpoint_model

        return (tok, eos, note, *load_checkpoint_model(run_dir, args.step, path))

    tok, eos, note, model, m, path = read_checkpoint(run_dir, args.step, load)
    if note:
        print(note, file=sys.stderr)
    import torch

    from myria.models.decode import generate

    use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    if use_cuda and not torch.cuda.is_available():
        raise ConfigError("--device cuda but no CUDA device is available; use auto or cpu")
    model.to("cuda" if use_cuda else "cpu")
    # as training saw a document's start: with the tokenizer's own leading tokens (a BOS)
    ids = tok.encode(args.prompt, add_special_tokens=True).ids
    if tok.post_processor is not None and ids and ids[-1] == eos:
        ids = ids[:-1]
    if not ids:
        raise ConfigError(f"--prompt {args.prompt!r} encodes to no tokens (the tokenizer adds "
                          "none of its own): give some text to continue")
    if (reach := len(ids) + args.max_new_tokens) > m.seq_len and m.arch != "gpt":
        print(f"note: the prompt ({len(ids)} tokens) and --max-new-tokens "
              f"{args.max_new_tokens} reach position {reach}, past the {m.seq_len} tokens the "
              "model trained on (model.seq_len): its positions beyond are untrained",
              file=sys.stderr)
    t0 = time.perf_counter()
    new = generate(model, ids, args.max_new_tokens, args.temperature, args.top_k, args.seed,
                   eos)
    dt = time.perf_counter() - t0
    print(args.prompt + decode(tok, new))
    print(f"[{path.name}: {len(new)} tokens in {dt:.2f} s, {len(new) / dt:.1f} tokens/s, "
          f"{'greedy' if args.temperature == 0 else f'temperature {args.temperature}'}]",
          flush=True)
    return 0
