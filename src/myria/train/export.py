"""`myria export`: write a checkpoint as HF safetensors + config.json (LlamaForCausalLM).

    myria export --run-dir runs/demo --format hf --out exported/ [--step N]

Reads the DCP checkpoint in one process (DCP reassembles shards from any layout), renames the
parameters to Hugging Face's Llama names and writes `model.safetensors`, `config.json`,
`generation_config.json` and the tokenizer. Only the Llama architecture without the parallel
block or a sliding window maps onto LlamaForCausalLM; anything else is refused clearly.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch

from myria.errors import CheckpointError, ConfigError

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


def hf_config(m, eos_id: int | None = None) -> dict:
    """A transformers LlamaConfig dict for model config `m`."""
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": m.vocab_size, "hidden_size": m.hidden, "intermediate_size": m.ffn_dim,
        "num_hidden_layers": m.layers, "num_attention_heads": m.heads,
        "num_key_value_heads": m.n_kv_heads, "head_dim": m.head_dim,
        "max_position_embeddings": m.seq_len, "rms_norm_eps": m.norm_eps,
        "rope_theta": m.rope_theta, "hidden_act": "silu", "attention_bias": False,
        "mlp_bias": False, "tie_word_embeddings": m.tie_embeddings,
        "torch_dtype": "float32", "bos_token_id": eos_id, "eos_token_id": eos_id,
    }


def to_hf_state_dict(sd: dict[str, torch.Tensor], m) -> dict[str, torch.Tensor]:
    """Rename myria parameter names to LlamaForCausalLM's."""
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


def load_checkpoint_model(run_dir: Path, step: int | None):
    """Rebuild the model of a run's checkpoint in this process and load its weights."""
    import torch.distributed.checkpoint as dcp

    from myria import config as config_mod
    from myria.models.transformer import build_model
    from myria.train.checkpoint import CheckpointManager

    mgr = CheckpointManager(run_dir / "checkpoints")
    if step is None:
        path = mgr.latest_valid()
        if path is None:
            raise CheckpointError(f"no committed checkpoint under {run_dir / 'checkpoints'}")
    else:
        path = mgr.path_for(step)
        if not (path / "meta.json").exists():
            have = [int(p.name.split("_")[1]) for p in mgr.committed()]
            raise CheckpointError(f"no committed checkpoint for step {step} in {run_dir}; "
                                  f"available steps: {have or 'none'}")
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


def run(args) -> int:
    run_dir = Path(args.run_dir)
    if not run_dir.is_dir():
        raise CheckpointError(f"run directory {run_dir} does not exist")
    model, m, path = load_checkpoint_model(run_dir, args.step)
    check_exportable(m)
    from safetensors.torch import save_file

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    sd = to_hf_state_dict(model.state_dict(), m)
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    eos_id = None
    data_cfg = json.loads((path / "meta.json").read_text()).get("data_path")
    if data_cfg and (Path(data_cfg) / "tokenizer.json").exists():
        shutil.copy(Path(data_cfg) / "tokenizer.json", out / "tokenizer.json")
        try:
            eos_id = json.loads((Path(data_cfg) / "index.json").read_text()).get("eos_id")
        except (OSError, ValueError):
            eos_id = None
    (out / "config.json").write_text(json.dumps(hf_config(m, eos_id), indent=1))
    print(f"exported {path.name} ({sum(v.numel() for v in sd.values()):,} parameters) to {out} "
          "as LlamaForCausalLM safetensors")
    return 0
