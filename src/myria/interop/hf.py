"""Start a run from a Hugging Face model directory (`model.init_from = DIR`).

The directory is what `save_pretrained` writes: config.json and the weights as safetensors (one
model.safetensors, or shards listed by model.safetensors.index.json). Supported: the Llama
family and the relatives that share its block (LlamaForCausalLM: Llama 2 and 3;
MistralForCausalLM; Qwen2ForCausalLM with its query/key/value biases), with grouped-query
attention, tied or untied embeddings and RoPE scaling (default, linear, llama3). Anything else
is refused in one line naming it, before any process starts. `model_fields` turns config.json
into the model section (the run's config keeps the training: seq_len, layout, optimizer).
`load_weights` fills the parallelised model parts at step 0 through torch.distributed.checkpoint's
Hugging Face reader: every rank reads only the slices its DTensor shards own (`get_slice`), so
no rank ever holds a whole copy of the model. `hf_name` (`LAYER_NAMES`, `TOP_NAMES`) is the one
map between myria's parameter names and the Llama family's; export uses it the other way
(myria.train.export).
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

from myria.config import Config, ModelConfig
from myria.errors import ConfigError

# HF architecture -> what it maps to. All are Llama's block; Qwen2 adds q/k/v biases.
ARCHITECTURES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral",
                 "Qwen2ForCausalLM": "qwen2"}

# per block: myria name -> Llama-family name under model.layers.N.
LAYER_NAMES = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "attention.wq.bias": "self_attn.q_proj.bias",
    "attention.wk.bias": "self_attn.k_proj.bias",
    "attention.wv.bias": "self_attn.v_proj.bias",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
TOP_NAMES = {"tok_embeddings.weight": "model.embed_tokens.weight",
             "norm.weight": "model.norm.weight", "output.weight": "lm_head.weight"}

# config.json keys whose non-default value changes the computation in a way myria's model does
# not have: (key, the value that is fine)
_REFUSED = (("attention_bias", False), ("mlp_bias", False), ("quantization_config", None),
            ("use_sliding_window", False), ("pretraining_tp", 1))


def hf_name(name: str) -> str:
    """The Llama-family name of myria parameter `name` (a plain model's name)."""
    if name in TOP_NAMES:
        return TOP_NAMES[name]
    _, index, rest = name.split(".", 2)
    return f"model.layers.{index}.{LAYER_NAMES[rest]}"


def _where(d: Path) -> str:
    return f"model.init_from = {str(d)!r}"


def read_config(d: str | Path) -> dict[str, Any]:
    """config.json of model directory `d`; ConfigError when it is not a model directory."""
    d = Path(d)
    if not d.is_dir():
        raise ConfigError(f"{_where(d)}: " + ("no such directory" if not d.exists() else
                          "not a directory (give the model directory holding config.json)"))
    f = d / "config.json"
    if not f.is_file():
        raise ConfigError(f"{_where(d)}: no config.json in it (a Hugging Face model directory "
                          "as save_pretrained writes it)")
    try:
        return json.loads(f.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{_where(d)}: config.json is not valid JSON ({e})") from None


def _rope(hf: dict, d: Path) -> dict[str, Any]:
    """The RoPE fields: transformers >= 5 writes rope_parameters, older ones rope_theta and
    rope_scaling."""
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    kind = params.get("rope_type", params.get("type", "default"))
    out: dict[str, Any] = {"rope_theta": float(theta)}
    if kind == "default":
        return {**out, "rope_scaling": "none"}
    if kind == "linear":
        return {**out, "rope_scaling": "linear", "rope_factor": float(params["factor"])}
    if kind == "llama3":
        return {**out, "rope_scaling": "llama3", "rope_factor": float(params["factor"]),
                "rope_low_freq_factor": float(params["low_freq_factor"]),
                "rope_high_freq_factor": float(params["high_freq_factor"]),
                "rope_original_max_len": int(params["original_max_position_embeddings"])}
    raise ConfigError(f"{_where(d)}: config.json's rope_type = {kind!r} is not supported; "
                      "supported: default, linear, llama3")


def keep_generation_config(d: str | Path, run_dir: str | Path) -> None:
    """Copy model directory `d`'s generation_config.json, when it has one, into the run
    directory (`rundir.GENERATION_CONFIG`): the model's stop tokens (often several: Llama 3
    Instruct's end of text, of a message and of a turn) and sampling defaults, which export passes
    on; the model directory need not exist when the run is exported."""
    from myria import rundir
    from myria.fsutil import atomic_write

    src = Path(d) / "generation_config.json"
    try:
        data = src.read_bytes()
        json.loads(data)
    except FileNotFoundError:
        return
    except (OSError, ValueError) as e:
        warnings.warn(f"{src} is not kept with the run (unreadable: {e}); export writes a "
                      "generation_config.json of the tokenizer's tokens", stacklevel=2)
        return
    atomic_write(Path(run_dir) / rundir.GENERATION_CONFIG, data)


def model_fields(d: str | Path) -> dict[str, Any]:
    """The model-section fields that model directory `d`'s config.json sets. ConfigError names
    the first thing that is not supported."""
    d = Path(d)
    hf = read_config(d)
    archs = hf.get("architectures")
    if not archs:   # a config.json saved without it: its model_type says the same
        by_type = {v: k for k, v in ARCHITECTURES.items()}
        if hf.get("model_type") not in by_type:
            raise ConfigError(f"{_where(d)}: config.json names no architecture and its "
                              f"model_type is {hf.get('model_type', 'missing')!r}; supported: "
                              f"{', '.join(ARCHITECTURES)} (model_type "
                              f"{', '.join(by_type)})")
        archs = [by_type[hf["model_type"]]]
    if len(archs) != 1 or archs[0] not in ARCHITECTURES:
        raise ConfigError(f"{_where(d)}: architecture {', '.join(map(str, archs))} is not "
                          f"supported; supported: {', '.join(ARCHITECTURES)}")
    kind = ARCHITECTURES[archs[0]]
    for key, fine in _REFUSED:
        if hf.get(key) is not None and hf[key] != fine:
            raise ConfigError(f"{_where(d)}: config.json's {key} = {hf[key]!r} is not supported "
                              f"(myria's {archs[0]} needs {fine!r})")
    if hf.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"{_where(d)}: config.json's hidden_act = {hf['hidden_act']!r} is "
                          "not supported (SwiGLU with silu only)")
    try:
        hidden, heads = int(hf["hidden_size"]), int(hf["num_attention_heads"])
        fields = {
            "arch": "llama", "vocab_size": int(hf["vocab_size"]), "hidden": hidden,
            "layers": int(hf["num_hidden_layers"]), "heads": heads,
            "kv_heads": int(hf.get("num_key_value_heads") or heads),
            "ffn_hidden": int(hf["intermediate_size"]),
            "norm_eps": float(hf.get("rms_norm_eps", 1e-6)),
            "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
            "qkv_bias": kind == "qwen2", **_rope(hf, d),
            "max_positions": int(hf.get("max_position_embeddings") or 0),
        }
    except KeyError as e:
        raise ConfigError(f"{_where(d)}: config.json lacks {e.args[0]!r}") from None
    head_dim = hf.get("head_dim")
    if head_dim is not None and int(head_dim) * heads != hidden:
        raise ConfigError(f"{_where(d)}: config.json's head_dim = {head_dim} is not "
                          f"hidden_size / num_attention_heads = {hidden // heads}; myria's "
                          "attention needs head_dim * heads = hidden")
    window = hf.get("sliding_window") if kind == "mistral" else None
    # kept even when not shorter than seq_len: it bounds generation and goes to the export
    fields["attention_window"] = int(window) if window else 0
    return fields


# The model fields config.json sets (`model_fields`); a checkpoint keeps them in its config.
IMPORTED_FIELDS = ("arch", "vocab_size", "hidden", "layers", "heads", "kv_heads", "ffn_hidden",
                   "norm_eps", "tie_embeddings", "qkv_bias", "rope_theta", "rope_scaling",
                   "rope_factor", "rope_low_freq_factor", "rope_high_freq_factor",
                   "rope_original_max_len", "attention_window", "max_positions")


def load_config(path: str | Path | None, overrides=(), weights: bool = True,
                resumed: dict | None = None) -> tuple[Config, str | None]:
    """The config a run trains with: the TOML at `path` (the defaults when None) and
    `overrides`, its model section set by `apply`; and `apply`'s description. plan, simulate
    and analyze load a training config here; train and supervise through
    `myria.train.preflight.run_config`, which finds the checkpoint a run resumes. `weights`
    False needs config.json only (planning before the weights are downloaded)."""
    from myria import config as config_mod

    cfg = config_mod.load(path, overrides)
    return cfg, apply(cfg, weights, resumed, overrides)


def apply(cfg: Config, weights: bool = True, resumed: dict | None = None,
          overrides=()) -> str | None:
    """Set `cfg.model` from `cfg.model.init_from`'s config.json (no-op without one) and check
    the result (the weight files too, with `weights`); a one-line description of the model for
    the user, or None.

    config.json's fields replace the config file's model section (which describes the model
    a run without a directory would build), but a command-line `overrides` entry that sets one
    of them to another value is refused: the user asked for a model the weights are not.

    `resumed` is the model section of the checkpoint the run resumes, if any. After step 0 the
    checkpoint holds the model, so a run that started from a directory resumes without it:
    when the config names no directory, or names the run's own and it is gone, the model
    fields are the checkpoint's."""
    from myria import config as config_mod

    m = cfg.model
    started = (resumed or {}).get("init_from")
    if started and (not m.init_from or (m.init_from == started
                                        and not Path(started).exists())):
        for k in IMPORTED_FIELDS:
            if k in resumed:
                setattr(m, k, resumed[k])
        m.init_from = started
        config_mod.validate(cfg)
        return (f"model from the checkpoint ({m.layers} layers, hidden {m.hidden}); the run "
                f"started from {started}, which resuming does not read")
    if not m.init_from:
        return None
    if resumed is not None and (not started or Path(started).resolve() !=
                                Path(m.init_from).resolve()):
        # the weights of a model folder are read at step 0 only
        raise ConfigError(
            f"model.init_from = {m.init_from} is not read: this run resumes its checkpoint, "
            + (f"which started from {started}" if started else "which started without one")
            + "; drop model.init_from to resume it, or start from that model in a new "
            "--run-dir")

    d = Path(m.init_from)
    fields = model_fields(d)
    typed = {key for section, key, _ in map(config_mod.parse_override, overrides)
             if section == "model"}
    for k, v in fields.items():
        if k in typed and getattr(m, k) != v:
            raise ConfigError(f"--model.{k}={getattr(m, k)!r} contradicts {_where(d)}, whose "
                              f"config.json sets {k} = {v!r}: the model's shape is its "
                              f"config.json's; drop --model.{k}")
        setattr(m, k, v)
    if m.attention != "softmax" or m.experts or m.parallel_block or m.document_positions:
        raise ConfigError(f"{_where(d)}: the imported model has softmax attention, a dense MLP, "
                          "the sequential block and continuous positions; unset "
                          "model.attention, model.experts, model.parallel_block and "
                          "model.document_positions")
    untied = ""
    if weights:
        weight_files(d)  # the weights are there, before any process starts
        if m.tie_embeddings and (diff := head_differs(d)) is not None:
            # transformers does not tie them either (it warns and keeps both tensors)
            m.tie_embeddings = False
            untied = (f"; its lm_head.weight differs from embed_tokens.weight (max |diff| "
                      f"{diff:.3g}) although config.json ties them: trained apart, as "
                      "transformers loads it")
    config_mod.validate(cfg)
    trained = read_config(d).get("max_position_embeddings")
    return (f"model from {d}: {fields['layers']} layers, hidden {fields['hidden']}, "
            f"{fields['heads']}/{fields['kv_heads']} heads, vocab {fields['vocab_size']}"
            + (", qkv bias" if fields["qkv_bias"] else "")
            + (", tied embeddings" if fields["tie_embeddings"] else "")
            + (f", rope {fields['rope_scaling']}" if fields["rope_scaling"] != "none" else "")
            + (f"; note: model.seq_len = {m.seq_len} is beyond its max_position_embeddings "
               f"({trained}), positions it was not trained at"
               if isinstance(trained, int) and m.seq_len > trained else "") + untied)


def weight_files(d: Path) -> list[Path]:
    """The safetensors files of model directory `d` (the index's shards, or model.safetensors)."""
    index = d / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError, AttributeError) as e:
            raise ConfigError(f"{_where(d)}: model.safetensors.index.json has no readable "
                              f"weight_map ({e})") from None
        missing = [n for n in names if not (d / n).is_file()]
        if missing:
            raise ConfigError(f"{_where(d)}: shard {missing[0]} listed by "
                              "model.safetensors.index.json is missing")
        for n in names:
            _check_complete(d, d / n)
        return [d / n for n in names]
    if (d / "model.safetensors").is_file():
        _check_complete(d, d / "model.safetensors")
        return [d / "model.safetensors"]
    raise ConfigError(f"{_where(d)}: no model.safetensors or model.safetensors.index.json "
                      "(only safetensors weights are read; convert .bin weights with "
                      "transformers' save_pretrained, which writes safetensors)")


def head_differs(d: Path, rows: int = 4096) -> float | None:
    """The largest difference between `d`'s lm_head.weight and its embedding, None when it has
    no lm_head.weight or the two are equal (read `rows` rows at a time)."""
    from safetensors import safe_open

    where = {}
    for f in weight_files(d):
        with safe_open(str(f), framework="pt") as h:
            where.update({k: f for k in h.keys() if k in (TOP_NAMES["output.weight"],
                                                          TOP_NAMES["tok_embeddings.weight"])})
    if len(where) < 2:
        return None
    head, emb = TOP_NAMES["output.weight"], TOP_NAMES["tok_embeddings.weight"]
    with safe_open(str(where[head]), framework="pt") as hh, \
            safe_open(str(where[emb]), framework="pt") as he:
        a, b = hh.get_slice(head), he.get_slice(emb)
        n = a.get_shape()[0]
        if list(a.get_shape()) != list(b.get_shape()):
            return float("inf")
        worst = max(((a[i:i + rows].float() - b[i:i + rows].float()).abs().max().item()
                     for i in range(0, n, rows)), default=0.0)
    return worst or None


def _check_complete(d: Path, f: Path) -> None:
    """ConfigError naming safetensors file `f` when its header is unreadable or the file is
    shorter than the tensors its header lists (a partial download or copy): checked from the
    header alone, before any process starts, where a worker would fail on its first read. The
    format: an 8-byte little-endian header length, the JSON header (each tensor's
    data_offsets within the data that follows), then the data."""
    size = f.stat().st_size
    try:
        with open(f, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            if not 2 <= n <= size - 8:
                raise ValueError(f"header length {n}")
            header = json.loads(fh.read(n))
        end = max((int(v["data_offsets"][1]) for k, v in header.items()
                   if k != "__metadata__"), default=0)
    except (OSError, ValueError, KeyError, TypeError, IndexError) as e:
        raise ConfigError(f"{_where(d)}: {f.name} is not a readable safetensors file "
                          f"({e.__class__.__name__}: {e})") from None
    if size < 8 + n + end:
        raise ConfigError(f"{_where(d)}: {f.name} is {size:,} bytes where its header lists "
                          f"{8 + n + end:,}: the file is cut short (a partial download or "
                          "copy?)")


def _shapes(d: Path) -> dict[str, tuple[tuple[int, ...], str]]:
    """{tensor name: (shape, file name)} from the safetensors headers (no tensor is read)."""
    from safetensors import safe_open

    out = {}
    for f in weight_files(d):
        with safe_open(str(f), framework="pt") as h:
            for k in h.keys():
                out[k] = (tuple(h.get_slice(k).get_shape()), f.name)
    return out


def plain_name(name: str) -> str:
    """A parameter's name in the plain model, without wrapper levels (checkpointing, compile,
    DDP)."""
    from myria.models.init import canonical_name

    return canonical_name(name).removeprefix("module.")


def check_weights(d: Path, m: ModelConfig) -> None:
    """ConfigError when a tensor the model needs is missing from `d` or has another shape, or
    `d` holds a tensor the model has no place for."""
    from myria.models.transformer import build_model

    have = _shapes(d)
    want = {hf_name(n): tuple(p.shape) for n, p in build_model(m, "meta").named_parameters()}
    for name, shape in want.items():
        if name not in have:
            raise ConfigError(f"{_where(d)}: tensor {name} is missing from the safetensors files")
        if have[name][0] != shape:
            raise ConfigError(f"{_where(d)}: tensor {name} in {have[name][1]} has shape "
                              f"{list(have[name][0])}; config.json makes it {list(shape)}")
    extra = sorted(k for k in have if k not in want and not k.endswith("rotary_emb.inv_freq")
                   and not (k == "lm_head.weight" and m.tie_embeddings))
    if extra:
        raise ConfigError(f"{_where(d)}: tensor {extra[0]} in {have[extra[0]][1]} has no place "
                          f"in the model config.json describes ({len(extra)} such tensors)")


def load_weights(parts: list, d: str | Path, m: ModelConfig) -> int:
    """Fill the parameters of this rank's model parts (plain, FSDP2/TP DTensors, pipeline
    stages) from model directory `d`; every rank of the job calls it. Returns the bytes of
    parameters this rank now holds."""
    named = {}
    for part in parts:
        named.update(part.named_parameters())
    return reader(d, m)(named)


def reader(d: str | Path, m: ModelConfig):
    """After checking `d`'s tensors against `m`: a function that fills the parameters
    `{name: parameter}` it is given (names as named_parameters gives them, wrappers
    included; all of a rank's, or a part of them) from `d`, reading only the slices their
    local shards own, and returns their local bytes. The offload tier calls it once per unit
    when it keeps the parameters in files (Engine.fill_parameters)."""
    d = Path(d)
    check_weights(d, m)

    def read(named: dict) -> int:
        import torch
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import HuggingFaceStorageReader

        from myria.tensors import local_shard

        # Tied embeddings: HF keeps the embedding only, and so does the model
        # (Transformer.to_empty keeps the output layer on the embedding's tensor, which
        # named_parameters lists once). A pipeline's last stage holds a copy of its own
        # (parallel.pipeline.TiedEmbedding), read from the embedding; when the same rank
        # holds the first stage too (ZBV), the copy takes the embedding's values.
        state, held, copy = {}, 0, None
        plain = {plain_name(n): p for n, p in named.items()}
        for name, p in plain.items():
            if m.tie_embeddings and name == "output.weight":
                emb = plain.get("tok_embeddings.weight")
                if emb is not None:
                    copy = (p, emb)
                    continue
                name = "tok_embeddings.weight"
            state[hf_name(name)] = p
            held += local_shard(p).nbytes
        with torch.no_grad(), warnings.catch_warnings():
            warnings.filterwarnings("ignore", "torch.distributed is disabled")
            dcp.load(state, storage_reader=HuggingFaceStorageReader(str(d)),
                     no_dist=not dist.is_initialized())
            if copy is not None:
                local_shard(copy[0]).copy_(local_shard(copy[1]))
        return held

    return read
