"""`myria export`: write a checkpoint as a Hugging Face model directory.

    myria export --run-dir runs/demo --format hf --out exported/ [--step N] [--force]
                 [--dtype bfloat16] [--max-shard-size 5GB]

Reads the DCP checkpoint in one process (DCP reassembles shards from any layout) one output
file at a time, so the process holds one shard's tensors, never the model: the model is built
on the meta device for its names and shapes only, and each file's tensors are read from the
checkpoint alone (a partial DCP load). It renames the parameters to the Llama family's names
(myria.interop.hf.hf_name) and writes

    model.safetensors        the weights (float32 by default, --dtype), or shards of at most
                             --max-shard-size with model.safetensors.index.json
    config.json              LlamaConfig (Qwen2Config for a model with q/k/v biases,
                             MistralConfig for a sliding window), its RoPE scaling, bos/eos/pad
                             token ids of the tokenizer
    generation_config.json   the same token ids (generation stops at the EOS), max_new_tokens
                             50; a run started from a model: that model's, kept with the run
    tokenizer.json           the tokenizer the checkpoint was trained with (kept in the run
                             directory, see myria.data.fingerprint: the data directory need
                             not exist any more)
    tokenizer_config.json    PreTrainedTokenizerFast with the tokenizer's bos/eos/pad (myria's
    special_tokens_map.json  own: eos and pad <|endoftext|>, no BOS, so batch padding works; a
                             pad-less one pads with its EOS) and left padding (what batched
                             generation needs); a model's tokenizer: its own
                             tokenizer_config.json (chat template, added tokens) with those
                             tokens

so that `AutoModelForCausalLM.from_pretrained(d)`, `AutoTokenizer.from_pretrained(d)` and
`pipeline("text-generation", model=d)` work with no further argument (tested with transformers
5). Only the Llama architecture without the parallel block or experts maps onto these;
anything else is refused clearly. An --out that exists and is not empty is
refused unless --force, which replaces the files above and leaves any others.

End to end: the checkpoint exported is one that verifies (its files' CRC-32, also with --step),
and each weight file is read back and compared tensor by tensor with what was loaded before it
replaces anything, so an export holds the checkpoint's bytes or is not written. Damaged and
incomplete checkpoints are quarantined as `myria train` does (docs/robustness.md); one deleted
while read by a run saving into the same directory is chosen again (`read_checkpoint`); an --out
this export created is removed when it fails.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

from myria import rundir
from myria.errors import CheckpointError, ConfigError

if TYPE_CHECKING:
    import torch

DTYPES = ("float32", "bfloat16", "float16")   # names of torch dtypes
MAX_SHARD_SIZE = "5GB"   # transformers 4's save_pretrained default
INDEX = "model.safetensors.index.json"
READ_TRIES = 3   # choices of a checkpoint, when a live run's retention deletes the chosen one


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
    p.add_argument("--dtype", default="float32", choices=DTYPES,
                   help="weights' type: float32 (the trained master weights, exact; default), "
                   "bfloat16 (half the size, as Hugging Face models are usually shared) or "
                   "float16")
    p.add_argument("--max-shard-size", default=MAX_SHARD_SIZE, metavar="SIZE",
                   help="largest safetensors file; a bigger model is split into "
                   "model-0000K-of-0000N.safetensors with model.safetensors.index.json, as "
                   f"save_pretrained does (e.g. 5GB, 500MB; default {MAX_SHARD_SIZE})")


def hf_config(m, specials, dtype: str = "float32") -> dict:
    """A transformers config dict for model config `m`: LlamaConfig; Qwen2Config for a model
    with query/key/value biases (Llama's attention_bias would add one to the output too);
    MistralConfig for one with a sliding window (`model.attention_window` keys per query is
    Mistral's `sliding_window`: the same logits, tests/interop)."""
    if m.qkv_bias:
        arch = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
                "use_sliding_window": False}
    elif m.attention_window:
        arch = {"architectures": ["MistralForCausalLM"], "model_type": "mistral",
                "sliding_window": m.attention_window, "head_dim": m.head_dim}
    else:
        arch = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                "attention_bias": False, "mlp_bias": False, "head_dim": m.head_dim}
    rope = {"linear": {"rope_type": "linear", "factor": m.rope_factor},
            "llama3": {"rope_type": "llama3", "factor": m.rope_factor,
                       "low_freq_factor": m.rope_low_freq_factor,
                       "high_freq_factor": m.rope_high_freq_factor,
                       "original_max_position_embeddings": m.rope_original_max_len},
            }.get(m.rope_scaling)
    return {
        **arch,
        "vocab_size": m.vocab_size, "hidden_size": m.hidden, "intermediate_size": m.ffn_dim,
        "num_hidden_layers": m.layers, "num_attention_heads": m.heads,
        "num_key_value_heads": m.n_kv_heads,
        "max_position_embeddings": max_positions(m),
        "rms_norm_eps": m.norm_eps,
        "rope_theta": m.rope_theta, **({"rope_scaling": rope} if rope else {}),
        "hidden_act": "silu", "tie_word_embeddings": m.tie_embeddings,
        "dtype": dtype, **token_ids(specials),
    }


def max_positions(m) -> int:
    """The export's max_position_embeddings: the positions the model serves (an imported
    model's own, `model.max_positions`), at least the trained sequence and RoPE scaling's
    original length."""
    return max(m.seq_len, m.max_positions,
               m.rope_original_max_len if m.rope_scaling != "none" else 0)


def token_ids(specials) -> dict[str, int | None]:
    """bos/eos/pad token ids of the exported model: the tokenizer's own; the EOS where it has
    no pad (batched generation needs one); no BOS where it has none (a chat template that
    writes `bos_token` would otherwise start with a token the model never saw there)."""
    eos = specials.eos_id
    return {"bos_token_id": specials.bos_id, "eos_token_id": eos,
            "pad_token_id": eos if specials.pad_id is None else specials.pad_id}


def hf_tokenizer_files(m, specials, tok_cfg: dict | None = None,
                       generation: dict | None = None) -> dict[str, dict]:
    """generation_config.json, tokenizer_config.json and special_tokens_map.json for the
    tokenizer the run trained with (its special tokens, `myria.data.tokenizer.Specials`).

    A model's tokenizer keeps what its own tokenizer_config.json says (`tok_cfg`: its chat
    template, added tokens, class, padding side), and a run started from a model keeps that
    model's generation_config.json (`generation`: its stop tokens and sampling defaults);
    myria fills only what they leave out. Without them: PreTrainedTokenizerFast padding on the
    left (what batched generation needs), adding no special token (myria's own tokenizer has
    none to add), stopping at the EOS after at most 50 new tokens. A pad-less tokenizer pads
    with its EOS; a BOS-less one stays without a BOS."""
    eos = specials.eos_token
    special = {**({"bos_token": specials.bos_token} if specials.bos_token else {}),
               "eos_token": eos, "pad_token": specials.pad_token or eos}
    own = {} if specials.bos_token else {"add_bos_token": False, "add_eos_token": False}
    defaults = {"tokenizer_class": "PreTrainedTokenizerFast", "padding_side": "left", **own,
                "clean_up_tokenization_spaces": False}
    return {
        "generation_config.json": ({**token_ids(specials), **generation} if generation else
                                   {**token_ids(specials), "max_new_tokens": 50}),
        # the length the exported model serves, whatever sentinel the model's own file had
        "tokenizer_config.json": {**defaults, **(tok_cfg or {}),
                                  "model_max_length": max_positions(m), **special},
        "special_tokens_map.json": special,
    }


def kept_generation_config(run_dir: Path, specials) -> tuple[dict | None, str | None]:
    """The generation_config.json the run kept from the model it started from
    (`myria.interop.hf.keep_generation_config`), and a note when it is not passed on: its stop
    tokens must include the tokenizer's EOS, else they belong to another vocabulary."""
    f = run_dir / rundir.GENERATION_CONFIG
    try:
        gen = json.loads(f.read_text())
    except FileNotFoundError:
        return None, None
    except (OSError, ValueError) as e:
        return None, f"{f} is unreadable ({e}); wrote a generation_config.json of the tokens"
    stops = gen.get("eos_token_id") if isinstance(gen, dict) else None
    stops = stops if isinstance(stops, list) else [stops]
    if specials.eos_id not in stops:
        return None, (f"{f} (the starting model's) stops at token ids {stops}, not at the "
                      f"tokenizer's EOS {specials.eos_id}: wrote a generation_config.json of "
                      "the tokenizer's tokens instead")
    return gen, None


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


def hf_tensors(m, sd: dict[str, torch.Tensor]) -> dict[str, tuple[str, torch.Size]]:
    """The exported tensors of model config `m` whose state dict is `sd` (meta tensors do):
    Llama-family name -> (myria's name, shape); a tied output layer is the embedding and is not
    written twice."""
    from myria.interop.hf import hf_name

    return {hf_name(k): (k, v.shape) for k, v in sd.items()
            if not (m.tie_embeddings and k == "output.weight")}


def shards(sizes: dict[str, torch.Tensor], max_shard_size):
    """huggingface_hub's split of tensors (meta tensors of the output dtype: sizes only) into
    files of at most `max_shard_size`, with the names and index save_pretrained writes and
    every loader reads; an empty `sizes` checks the size."""
    from huggingface_hub import split_torch_state_dict_into_shards

    try:
        return split_torch_state_dict_into_shards(
            sizes, filename_pattern="model{suffix}.safetensors", max_shard_size=max_shard_size)
    except ValueError as e:
        raise ConfigError(f"--max-shard-size {max_shard_size!r}: {e}") from None


def write_weights(out: Path, path: Path, m, dtype: str, max_shard_size) -> tuple[list[str], int]:
    """Checkpoint `path`'s weights of model config `m` as safetensors in `out`, in `dtype` (a
    name of `DTYPES`): one model.safetensors, or shards of at most `max_shard_size` and their
    index (`shards`). One file at a time: its tensors are read from the checkpoint alone,
    converted, written under a temporary name, read back bit for bit (`_check_written`) and
    renamed, and freed before the next. Weight files of an earlier export that this one does
    not write are removed, so the directory holds one model. The file names and the number of
    parameters written."""
    import torch
    from safetensors.torch import save_file

    from myria.models.transformer import build_model
    from myria.train.checkpoint.load import check_shapes

    meta_sd = build_model(m).state_dict()   # on the meta device: names and shapes only
    check_shapes(path, meta_sd)
    tensors = hf_tensors(m, meta_sd)
    to = getattr(torch, dtype)
    split = shards({h: torch.empty(shape, dtype=to, device="meta")
                    for h, (_, shape) in tensors.items()}, max_shard_size)
    saved = _saved_dtypes(path)
    umask = os.umask(0)
    os.umask(umask)
    for name, keys in split.filename_to_tensors.items():
        state = {"model": {tensors[h][0]: torch.empty(tensors[h][1], dtype=saved[tensors[h][0]])
                           for h in keys}}
        _load_alone(state, path)
        part = {h: state["model"].pop(tensors[h][0]).to(to).contiguous() for h in keys}
        tmp = out / f"{name}.tmp{os.getpid()}"
        save_file(part, str(tmp), metadata={"format": "pt"})
        try:
            _check_written(tmp, part)
        except CheckpointError:
            tmp.unlink(missing_ok=True)
            raise
        os.chmod(tmp, 0o666 & ~umask)  # safetensors writes 0600; the others follow the umask
        os.replace(tmp, out / name)
        del part, state
    names = list(split.filename_to_tensors)
    if split.is_sharded:
        _write(out / INDEX, (json.dumps({"metadata": split.metadata,
                                         "weight_map": split.tensor_to_filename}, indent=1)
                             + "\n").encode())
        names.append(INDEX)
    for old in [*out.glob("model-*-of-*.safetensors"), out / "model.safetensors",
                out / INDEX]:
        if old.name not in names:
            old.unlink(missing_ok=True)
    return names, sum(shape.numel() for _, shape in tensors.values())


def _saved_dtypes(path: Path) -> dict:
    """The dtype each model tensor has in checkpoint `path` (myria's names)."""
    import torch.distributed.checkpoint as dcp

    md = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    return {k[len("model."):]: v.properties.dtype for k, v in md.items()
            if k.startswith("model.") and hasattr(v, "size")}


def check_exportable(m) -> None:
    if m.arch != "llama" or m.attention != "softmax" or m.parallel_block or m.experts:
        raise ConfigError(
            "HF export maps onto LlamaForCausalLM (MistralForCausalLM with a sliding window), "
            "which needs model.arch = 'llama' with softmax attention, without parallel_block or "
            f"experts (got arch={m.arch!r}, attention={m.attention!r}, "
            f"parallel_block={m.parallel_block}, experts={m.experts})")
    if m.attention_window and (m.qkv_bias or m.rope_scaling != "none"):
        raise ConfigError(
            f"HF export of a sliding window (model.attention_window = {m.attention_window}) "
            "maps onto MistralForCausalLM, which has no query/key/value biases and no RoPE "
            f"scaling (got qkv_bias={m.qkv_bias}, rope_scaling={m.rope_scaling!r})")


def _export_hint(d: Path) -> str:
    """A hint when `d` is a Hugging Face model directory (an export) rather than a run."""
    try:
        is_hf = "architectures" in json.loads((Path(d) / "config.json").read_text())
    except (OSError, ValueError, TypeError):
        return ""
    return (f"; {d} is a Hugging Face model directory (an export?), not a run directory: "
            "load it with transformers' AutoModelForCausalLM, or train from it with "
            f"--model.init_from={d}") if is_hf else ""


def _quarantine_note(mgr) -> str:
    """What a refusal for want of a committed checkpoint adds when some are quarantined."""
    if not (q := mgr.quarantined()):
        return ""
    return (f"; quarantined in {q[0].parent}: {mgr.quarantine_reasons(q)}. export and generate "
            "read only committed checkpoints: `myria train --resume-from PATH` loads a "
            "quarantined one anyway, and the checkpoints it saves can be read")


def checkpoint_path(run_dir: Path, step: int | None) -> Path:
    """The committed checkpoint of `step` (default: the newest that verifies) of a run."""
    from myria.train.checkpoint.store import CheckpointStore

    mgr = CheckpointStore(rundir.checkpoints_dir(run_dir))
    if step is None:
        path = mgr.latest_valid()
        if path is None:
            raise CheckpointError("no committed checkpoint under "
                                  f"{rundir.checkpoints_dir(run_dir)}" + _export_hint(run_dir)
                                  + _quarantine_note(mgr))
    else:
        path = mgr.path_for(step)
        if not (path / "meta.json").exists():
            have = [int(p.name.split("_")[1]) for p in mgr.committed()]
            raise CheckpointError(f"no committed checkpoint for step {step} in {run_dir}; "
                                  f"available steps: {have or 'none'}" + _quarantine_note(mgr))
        if (why := mgr.verify(path)) is not None:   # what is exported is what was saved
            raise CheckpointError(f"checkpoint {path} does not verify ({why}): nothing "
                                  "exported; export another step (--step) or the newest that "
                                  "verifies (no --step)")
    return path


def read_checkpoint(run_dir: Path, step: int | None, read):
    """`read(path)` of the checkpoint `checkpoint_path` chooses. A run saving into the same
    directory deletes older checkpoints (retention, checkpoint.keep), also the chosen one while
    it is read: then the choice is made again, READ_TRIES times in all, else CheckpointError.
    A failure while the checkpoint is still complete is raised as it is."""
    from myria.train.checkpoint.store import verify_dir

    gone = []
    for _ in range(READ_TRIES):
        path = checkpoint_path(run_dir, step)
        try:
            return read(path)
        except BaseException as e:   # DCP's CheckpointException is a BaseException
            if isinstance(e, (KeyboardInterrupt, SystemExit)) or \
                    verify_dir(path, checksums=False)[0] is None:
                raise
            gone.append(path.name)
    raise CheckpointError(f"the checkpoint chosen was deleted while it was read, {READ_TRIES} "
                          f"times ({', '.join(gone)}): a run saving into "
                          f"{rundir.checkpoints_dir(run_dir)} deletes older ones "
                          "(checkpoint.keep); try again, or once it has stopped")


def _check_written(path: Path, sd: dict[str, torch.Tensor]) -> None:
    """The file `path` holds `sd` bit for bit (read back one tensor at a time, checksummed),
    else CheckpointError: an export is only as good as the bytes that reached the disk."""
    from safetensors import safe_open

    from myria.train import checksums

    names = sorted(sd)
    with safe_open(str(path), framework="pt") as f:
        if sorted(f.keys()) != names:
            raise CheckpointError(f"the exported {path.name} read back holds other tensors")
        want = checksums.sums([sd[k] for k in names]).tolist()
        for k, w in zip(names, want):
            if checksums.differing([w], [f.get_tensor(k)]):
                raise CheckpointError(f"the exported weights read back from {path} differ "
                                      f"from the checkpoint's ({k}): nothing exported")


def _load_alone(state: dict, path: Path) -> None:
    """DCP's load of the tensors in `state` (a subset of the checkpoint's) in this process."""
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        # one process reading the checkpoint is the intent here; torch warns of it on every
        # load without a process group, which export and generate would print each time
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        dcp.load(state, checkpoint_id=str(path), no_dist=True,
                 planner=dcp.DefaultLoadPlanner(allow_partial_load=True))


def checkpoint_model_config(path: Path):
    """The model config checkpoint `path` was saved with (its meta.json)."""
    from myria import config as config_mod

    meta = json.loads((path / "meta.json").read_text())
    return config_mod.from_dict({"model": meta["model"]}).model


def load_checkpoint_model(run_dir: Path, step: int | None, path: Path | None = None):
    """Rebuild the model of a run's checkpoint (`path`, or found by `step`) in this process and
    load its weights."""
    from myria.models.transformer import build_model
    from myria.train.checkpoint.load import check_shapes

    path = path or checkpoint_path(run_dir, step)
    m = checkpoint_model_config(path)
    model = build_model(m, "cpu")
    model.init_weights(0, buffers_only=True)
    sd = {k: v for k, v in model.state_dict().items()}
    check_shapes(path, sd)
    state = {"model": sd}
    _load_alone(state, path)
    model.load_state_dict(state["model"])
    return model, m, path


def _write(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def run(args) -> int:
    from myria.data import fingerprint
    from myria.data.tokenizer import read_config, read_specials

    run_dir = Path(args.run_dir)
    if not run_dir.is_dir():
        raise CheckpointError(f"run directory {run_dir} does not exist" if not run_dir.exists()
                              else f"--run-dir {run_dir} is a file, not a run directory")
    out = Path(args.out)
    check_out(out, args.force)
    shards({}, args.max_shard_size)

    def export(path: Path):
        tok_path, note = fingerprint.checkpoint_tokenizer(run_dir, path, args.tokenizer)
        specials = read_specials(tok_path)
        m = checkpoint_model_config(path)
        check_exportable(m)
        try:
            out.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ConfigError(f"--out {str(out)!r}: cannot create it ({e.strerror})") from None
        weights, n_params = write_weights(out, path, m, args.dtype, args.max_shard_size)
        _write(out / "tokenizer.json", tok_path.read_bytes())
        return path, tok_path, note, specials, m, weights, n_params

    created = not out.exists()
    try:
        path, tok_path, note, specials, m, weights, n_params = read_checkpoint(
            run_dir, args.step, export)
    except BaseException:
        if created:   # all in it is this export's: an --out this export made is not left
            shutil.rmtree(out, ignore_errors=True)
        raise
    generation, gen_note = kept_generation_config(run_dir, specials)
    files = {"config.json": hf_config(m, specials, args.dtype),
             **hf_tokenizer_files(m, specials, read_config(tok_path), generation)}
    for name, obj in files.items():
        _write(out / name, (json.dumps(obj, indent=1) + "\n").encode())
    for said in (note, gen_note):
        if said:
            print(said)
    parts = f" in {len(weights) - 1} shards" if INDEX in weights else ""
    print(f"exported {path.name} ({n_params:,} parameters) to {out} "
          f"as {files['config.json']['architectures'][0]} {args.dtype} safetensors{parts} "
          f"with its tokenizer (eos id {specials.eos_id}: {specials.eos_token})")
    return 0
