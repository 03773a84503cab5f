"""`myria export`: write a checkpoint as a Hugging Face model directory (LlamaForCausalLM).

    myria export --run-dir runs/demo --format hf --out exported/ [--step N] [--force]

Reads the DCP checkpoint in one process (DCP reassembles shards from any layout), renames the
parameters to Hugging Face's Llama names and writes

    model.safetensors        float32 weights
    config.json              LlamaConfig, bos/eos/pad token ids = <|endoftext|>
    generation_config.json   the same token ids, max_new_tokens 50 (as `myria generate`)
    tokenizer.json           the tokenizer the checkpoint was trained with (kept in the run
                             directory, see myria.data.fingerprint: the data directory need
                             not exist any more)
    tokenizer_config.json    PreTrainedTokenizerFast with bos/eos/pad = <|endoftext|> (so batch
    special_tokens_map.json  padding works) and left padding (what batched generation needs)

so that `AutoModelForCausalLM.from_pretrained(d)`, `AutoTokenizer.from_pretrained(d)` and
`pipeline("text-generation", model=d)` work with no further argument (tested with transformers
5). Only the Llama architecture without the parallel block or a sliding window maps onto
LlamaForCausalLM; anything else is refused clearly. An --out that exists and is not empty is
refused unless --force, which replaces the files above and leaves any others.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

from myria import rundir
from myria.errors import CheckpointError, ConfigError

if TYPE_CHECKING:
    import torch

FILES = ("model.safetensors", "config.json", "generation_config.json", "tokenizer.json",
         "tokenizer_config.json", "special_tokens_map.json")

_LAYER_MAP = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--run-dir", required=True, help="run directory holding checkpoints/")
    p.add_argument("--format", default="hf", choices=["hf"], help="output format")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: newest)")
    p.add_argument("--force", action="store_true",
                   help="write into an --out directory that is not empty (the exported files "
                   "are replaced, other files are left)")
    p.add_argument("--tokenizer", metavar="PATH", default=None,
                   help="tokenizer.json to export, for checkpoints that kept none (it must "
                   "match the fingerprint the checkpoint recorded, if any)")


def hf_config(m, eos_id: int) -> dict:
    """A transformers LlamaConfig dict for model config `m`."""
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": m.vocab_size, "hidden_size": m.hidden, "intermediate_size": m.ffn_dim,
        "num_hidden_layers": m.layers, "num_attention_heads": m.heads,
        "num_key_value_heads": m.n_kv_heads, "head_dim": m.head_dim,
        "max_position_embeddings": m.seq_len, "rms_norm_eps": m.norm_eps,
        "rope_theta": m.rope_theta, "hidden_act": "silu", "attention_bias": False,
        "mlp_bias": False, "tie_word_embeddings": m.tie_embeddings,
        "dtype": "float32", "bos_token_id": eos_id, "eos_token_id": eos_id,
        "pad_token_id": eos_id,
    }


def hf_tokenizer_files(m, eos_token: str, eos_id: int) -> dict[str, dict]:
    """generation_config.json, tokenizer_config.json and special_tokens_map.json."""
    special = {"bos_token": eos_token, "eos_token": eos_token, "pad_token": eos_token}
    return {
        "generation_config.json": {"bos_token_id": eos_id, "eos_token_id": eos_id,
                                   "pad_token_id": eos_id, "max_new_tokens": 50},
        "tokenizer_config.json": {"tokenizer_class": "PreTrainedTokenizerFast", **special,
                                  "model_max_length": m.seq_len, "padding_side": "left",
                                  "add_bos_token": False, "add_eos_token": False,
                                  "clean_up_tokenization_spaces": False},
        "special_tokens_map.json": special,
    }


def check_out(out: Path, force: bool) -> None:
    """ConfigError when --out is a file, or a non-empty directory without --force."""
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {str(out)!r} is a file; give a directory (it is created if "
                          "missing)")
    if out.is_dir() and not force:
        have = sorted(p.name for p in out.iterdir())
        if have:
            shown = ", ".join(have[:4]) + (", ..." if len(have) > 4 else "")
            raise ConfigError(f"--out {str(out)!r} is not empty ({shown}); choose a new "
                              "directory, or pass --force to replace the exported files in it")


def to_hf_state_dict(sd: dict[str, torch.Tensor], m) -> dict[str, torch.Tensor]:
    """Rename myria parameter names to LlamaForCausalLM's."""
    import torch

    out = {"model.embed_tokens.weight": sd["tok_embeddings.weight"],
           "model.norm.weight": sd["norm.weight"]}
    if not m.tie_embeddings:
        out["lm_head.weight"] = sd["output.weight"]
    for i in range(m.layers):
        for ours, theirs in _LAYER_MAP.items():
            out[f"model.layers.{i}.{theirs}"] = sd[f"layers.{i}.{ours}"]
    return {k: v.detach().to(torch.float32).contiguous() for k, v in out.items()}


def check_exportable(m) -> None:
    if (m.arch != "llama" or m.attention != "softmax" or m.parallel_block or m.attention_window
            or m.experts):
        raise ConfigError(
            "HF export maps onto LlamaForCausalLM, which needs model.arch = 'llama' with softmax "
            "attention, without parallel_block, attention_window or experts (got "
            f"arch={m.arch!r}, attention={m.attention!r}, "
            f"parallel_block={m.parallel_block}, attention_window={m.attention_window}, "
            f"experts={m.experts})")


def checkpoint_path(run_dir: Path, step: int | None) -> Path:
    """The committed checkpoint of `step` (default: the newest that verifies) of a run."""
    from myria.train.checkpoint import CheckpointManager

    mgr = CheckpointManager(rundir.checkpoints_dir(run_dir))
    if step is None:
        path = mgr.latest_valid()
        if path is None:
            raise CheckpointError("no committed checkpoint under "
                                  f"{rundir.checkpoints_dir(run_dir)}")
    else:
        path = mgr.path_for(step)
        if not (path / "meta.json").exists():
            have = [int(p.name.split("_")[1]) for p in mgr.committed()]
            raise CheckpointError(f"no committed checkpoint for step {step} in {run_dir}; "
                                  f"available steps: {have or 'none'}")
    return path


def load_checkpoint_model(run_dir: Path, step: int | None, path: Path | None = None):
    """Rebuild the model of a run's checkpoint (`path`, or found by `step`) in this process and
    load its weights."""
    import torch.distributed.checkpoint as dcp

    from myria import config as config_mod
    from myria.models.transformer import build_model
    from myria.train.checkpoint import CheckpointManager

    path = path or checkpoint_path(run_dir, step)
    mgr = CheckpointManager(rundir.checkpoints_dir(run_dir))
    meta = json.loads((path / "meta.json").read_text())
    m = config_mod.from_dict({"model": meta["model"]}).model
    model = build_model(m, "cpu")
    model.init_weights(0, buffers_only=True)
    sd = {k: v for k, v in model.state_dict().items()}
    mgr.check_shapes(path, sd)
    state = {"model": sd}
    dcp.load(state, checkpoint_id=str(path), planner=dcp.DefaultLoadPlanner(
        allow_partial_load=True))
    model.load_state_dict(state["model"])
    return model, m, path


def _write(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def run(args) -> int:
    from myria.data import fingerprint
    from myria.data.tokenizer import EOS_TOKEN, eos_id, load_tokenizer

    run_dir = Path(args.run_dir)
    if not run_dir.is_dir():
        raise CheckpointError(f"run directory {run_dir} does not exist" if not run_dir.exists()
                              else f"--run-dir {run_dir} is a file, not a run directory")
    out = Path(args.out)
    check_out(out, args.force)
    path = checkpoint_path(run_dir, args.step)
    tok_path, note = fingerprint.checkpoint_tokenizer(run_dir, path, args.tokenizer)
    eos = eos_id(load_tokenizer(tok_path))
    model, m, path = load_checkpoint_model(run_dir, args.step, path)
    check_exportable(m)
    from safetensors.torch import save_file

    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"--out {str(out)!r}: cannot create it ({e.strerror})") from None
    sd = to_hf_state_dict(model.state_dict(), m)
    tmp = out / f"model.safetensors.tmp{os.getpid()}"
    save_file(sd, str(tmp), metadata={"format": "pt"})
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)  # safetensors writes 0600; the other files follow the umask
    os.replace(tmp, out / "model.safetensors")
    _write(out / "tokenizer.json", tok_path.read_bytes())
    files = {"config.json": hf_config(m, eos), **hf_tokenizer_files(m, EOS_TOKEN, eos)}
    for name, obj in files.items():
        _write(out / name, (json.dumps(obj, indent=1) + "\n").encode())
    if note:
        print(note)
    print(f"exported {path.name} ({sum(v.numel() for v in sd.values()):,} parameters) to {out} "
          f"as LlamaForCausalLM safetensors with its tokenizer (eos id {eos})")
    return 0
