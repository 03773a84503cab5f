"""`model.init_from`: a Hugging Face model directory as a run's starting point (myria.interop.hf).

Logits equal transformers' on 1 process and under FSDP, TP, PP and CP; a run with lr = 0
exports the imported tensors bit for bit and the export loads into transformers with the same
logits; tied embeddings stay tied in training (one process, FSDP, TP, PP); the nvme tier with the
parameters on disk starts from the imported weights; unsupported models are refused in one
line."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from tests.conftest import TINY, run_cli
from tests.dist import finish, init, spawn
from tests.interop.conftest import hf_logits, make_hf_model

TOL = 1e-5


def imported(d: Path, *overrides: str):
    """A myria model (one process) started from HF directory `d`, and its config."""
    from myria import config as config_mod
    from myria.interop import hf
    from myria.models.transformer import build_model

    cfg = config_mod.load(None, [f"--model.init_from={d}", "--model.seq_len=64", *overrides])
    hf.apply(cfg)
    model = build_model(cfg.model, "cpu")
    model.init_weights(0)
    hf.load_weights([model], d, cfg.model)
    return model.eval(), cfg


def test_logits_equal_transformers_on_one_process(hf_models, device="cpu", record=None):
    """fp32: within TOL of transformers' logits (1e-4 on CUDA, where the attention kernels
    accumulate in another order). bf16 (both models cast whole): no further from transformers'
    fp32 logits than 1.5 x transformers' own bf16 error + 1e-3, and within 2% of the largest
    logit (bf16 is about 0.6% here). tests/gpu/test_hf_import_gpu.py runs this body on CUDA."""
    from myria.interop import hf

    tol = TOL if device == "cpu" else 1e-4
    tokens = torch.randint(0, 1024, (2, 64), generator=torch.Generator().manual_seed(0))
    tokens = tokens.to(device)
    for kind, d in hf_models.items():
        model, cfg = imported(d)
        assert set(hf.model_fields(d)) <= set(hf.IMPORTED_FIELDS)  # what resuming keeps
        assert (cfg.model.qkv_bias, cfg.model.tie_embeddings) == (kind == "qwen2",) * 2
        assert cfg.model.rope_scaling == ("llama3" if kind == "llama" else "none")
        model = model.to(device)
        with torch.no_grad():
            got = model(tokens)
            got16 = model.to(torch.bfloat16)(tokens).float()
        want = hf_logits(d, tokens)
        theirs16 = hf_logits(d, tokens, torch.bfloat16).float()
        err, err16 = (got - want).abs().max().item(), (got16 - want).abs().max().item()
        their_err16, scale = (theirs16 - want).abs().max().item(), want.abs().max().item()
        if record:
            record(f"{kind}_fp32_max_abs_diff", err)
            record(f"{kind}_bf16_err_ours_theirs_scale", [err16, their_err16, scale])
        assert err < tol, (kind, err)
        assert err16 <= 1.5 * their_err16 + 1e-3 and err16 < 0.02 * scale, \
            (kind, err16, their_err16, scale)


def test_a_sliding_window_exports_as_mistral_with_the_same_logits(hf_models):
    """An imported Mistral whose window (32) is shorter than the sequence (64) trains with
    model.attention_window = 32; the export's config (MistralForCausalLM, sliding_window 32)
    with the model's tensors under the export's names gives transformers the same logits. A
    window with RoPE scaling has no Hugging Face class to go to: refused in one line. The
    export serves the imported model's positions (config.json's max_position_embeddings)."""
    import dataclasses

    from transformers import AutoConfig, AutoModelForCausalLM

    from myria.data.tokenizer import Specials
    from myria.errors import ConfigError
    from myria.train.export import check_exportable, hf_config, hf_tensors, hf_tokenizer_files

    model, cfg = imported(hf_models["mistral"])
    assert cfg.model.attention_window == 32
    check_exportable(cfg.model)
    specials = Specials("</s>", 2, "<s>", 1)
    conf = hf_config(cfg.model, specials)
    assert conf["architectures"] == ["MistralForCausalLM"] and conf["sliding_window"] == 32
    # the positions it serves are the imported model's, not the 64 it trained at
    assert conf["max_position_embeddings"] == 256 == \
        hf_tokenizer_files(cfg.model, specials)["tokenizer_config.json"]["model_max_length"]
    kind = conf.pop("model_type")
    ref = AutoModelForCausalLM.from_config(AutoConfig.for_model(kind, **conf)).eval()
    sd = model.state_dict()
    ref.load_state_dict({n: sd[k] for n, (k, _) in hf_tensors(cfg.model, sd).items()})
    tokens = torch.randint(0, 1024, (2, 64), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        assert (ref(tokens).logits - model(tokens)).abs().max().item() < TOL
    with pytest.raises(ConfigError, match="no RoPE scaling"):
        check_exportable(dataclasses.replace(cfg.model, rope_scaling="linear"))
    # trained on sequences no longer than its window: full causal attention in training (the
    # same logits as transformers' on 16 tokens), and the export is still a Mistral with it
    short, cfg16 = imported(hf_models["mistral"], "--model.seq_len=16")
    assert cfg16.model.attention_window == 32
    assert hf_config(cfg16.model, specials)["sliding_window"] == 32
    with torch.no_grad():
        assert (short(tokens[:, :16]) - hf_logits(hf_models["mistral"], tokens[:, :16])
                ).abs().max().item() < TOL


def _layouts_worker(rank, world, port, out_dir):
    import torch.distributed as dist

    from myria.interop import hf
    from myria.layout import Layout
    from myria.parallel.dims import ParallelDims
    from myria.train.engine import Engine

    init(rank, world, port)
    d = Path(out_dir) / "llama"
    tokens = torch.load(Path(out_dir) / "tokens.pt")
    for name, extra in (("fsdp", []), ("tp", ["--parallel.tp=2", "--parallel.dp_shard=1"]),
                        ("pp", ["--parallel.pp=2", "--parallel.dp_shard=1",
                                "--parallel.schedule=gpipe"]),
                        ("cp", ["--parallel.cp=2", "--parallel.dp_shard=1"])):
        from myria import config as config_mod

        cfg = config_mod.load(None, [f"--model.init_from={d}", "--model.seq_len=64",
                                     "--training.global_batch=2", "--training.micro_batch=1",
                                     "--training.device=cpu", "--training.dtype=float32", *extra])
        hf.apply(cfg)
        dims = ParallelDims.build(Layout.resolve(cfg.parallel, world), "cpu")
        engine = Engine(cfg, dims, torch.device("cpu"))
        hf.load_weights(engine.parts, d, cfg.model)
        part = engine.parts[0].eval()
        with torch.no_grad():
            if name == "pp":  # stage 0 on rank 0 sends its hidden states to stage 1
                if rank == 0:
                    dist.send(part(tokens).contiguous(), 1)
                    logits = None
                else:
                    h = torch.empty(*tokens.shape, cfg.model.hidden)
                    dist.recv(h, 0)
                    logits = part(h)
            else:  # under cp each rank holds a head and a tail chunk of the sequence
                logits = part(engine._shard_sequence(tokens))
                if hasattr(logits, "full_tensor"):
                    logits = logits.full_tensor()
        if logits is not None and (name != "pp" or rank == 1):
            torch.save(logits, Path(out_dir) / f"{name}{rank}.pt")
        dist.barrier()
    finish()


@pytest.mark.slow
def test_logits_equal_transformers_under_fsdp_tp_pp_cp(tmp_path):
    from myria.parallel.context import unshard_sequence

    d = make_hf_model("llama", tmp_path / "llama")
    tokens = torch.randint(0, 1024, (2, 64), generator=torch.Generator().manual_seed(1))
    torch.save(tokens, tmp_path / "tokens.pt")
    spawn(_layouts_worker, 2, str(tmp_path))
    want = hf_logits(d, tokens)
    got = {f: torch.load(tmp_path / f"{f}.pt") for f in ("fsdp0", "fsdp1", "tp0", "tp1", "pp1")}
    got["cp"] = unshard_sequence([torch.load(tmp_path / f"cp{r}.pt") for r in (0, 1)])
    for f, logits in got.items():
        assert logits.shape == want.shape and (logits - want).abs().max().item() < TOL, f


def test_unsupported_model_refused_in_one_line(tmp_path, tiny_data):
    d = tmp_path / "neox"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"architectures": ["GPTNeoXForCausalLM"]}))
    p = run_cli("train", "--run-dir", str(tmp_path / "run"), f"--data.path={tiny_data}", *TINY,
                f"--model.init_from={d}", check=False)
    assert p.returncode != 0 and "Traceback" not in p.stderr
    err = p.stderr.strip().splitlines()
    assert len(err) == 1 and "GPTNeoXForCausalLM" in err[0] and "LlamaForCausalLM" in err[0]
    assert not (tmp_path / "run").exists()

    from myria import config as config_mod
    from myria.errors import ConfigError
    from myria.interop import hf

    src = make_hf_model("mistral", tmp_path / "m")
    good = json.loads((src / "config.json").read_text())
    for key, value, named in (("rope_parameters", {"rope_type": "yarn", "factor": 4.0}, "yarn"),
                              ("attention_bias", True, "attention_bias"),
                              ("hidden_act", "gelu", "hidden_act")):
        (src / "config.json").write_text(json.dumps({**good, key: value}))
        with pytest.raises(ConfigError, match=named):
            hf.apply(config_mod.load(None, [f"--model.init_from={src}"]))
    # no `architectures`: model_type says it; an unknown one is named as such
    (src / "config.json").write_text(json.dumps({k: v for k, v in good.items()
                                                 if k != "architectures"}))
    assert hf.model_fields(src)["attention_window"] == 32
    (src / "config.json").write_text(json.dumps({**good, "architectures": None,
                                                 "model_type": "gpt2"}))
    with pytest.raises(ConfigError, match="names no architecture and its model_type is 'gpt2'"):
        hf.model_fields(src)


def test_data_prepared_with_another_tokenizer_is_refused(tmp_path, hf_models, tiny_data):
    """The model's tokenizer.json against the data's: the same (or the model's tokens at the
    same ids) passes; two tokens swapped (another tokenizer) is refused in one line before
    anything starts, saying how to prepare the data."""
    from types import SimpleNamespace

    from myria import config as config_mod
    from myria.errors import ConfigError
    from myria.train.preflight import check_tokenizer

    d = tmp_path / "llama"
    shutil.copytree(hf_models["llama"], d)
    tok = json.loads((tiny_data / "tokenizer.json").read_text())
    (d / "tokenizer.json").write_text(json.dumps(tok))
    data = SimpleNamespace(path=tiny_data, tokenizer_path=tiny_data / "tokenizer.json",
                           vocab_size=len(tok["model"]["vocab"]))
    assert check_tokenizer(config_mod.load(None, [f"--model.init_from={d}"]), data) is None
    # the model's own tokenizer, with more tokens than its embedding has rows: the advice is
    # not to prepare again with the same tokenizer
    from myria.train.preflight import check_vocab

    small = config_mod.load(None, [f"--model.init_from={d}", "--model.vocab_size=1000"])
    with pytest.raises(ConfigError, match="does not agree with itself") as e:
        check_vocab(small, data)
    assert "myria prepare" not in str(e.value)
    vocab = tok["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[300:302]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (d / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(ConfigError, match=r"2 of the model's 1,024 tokens have another id"):
        check_tokenizer(config_mod.load(None, [f"--model.init_from={d}"]), data)
    p = run_cli("train", "--run-dir", str(tmp_path / "run"), f"--data.path={tiny_data}", *TINY,
                f"--model.init_from={d}", check=False)
    err = p.stderr.strip().splitlines()
    assert p.returncode != 0 and len(err) == 1, p.stderr
    assert f"myria prepare --tokenizer {d}" in err[0] and not (tmp_path / "run").exists()
    # a model folder without tokenizer.json: nothing to compare, and the user is told so
    (d / "tokenizer.json").unlink()
    note = check_tokenizer(config_mod.load(None, [f"--model.init_from={d}"]), data)
    assert note.startswith(f"note: {d} has no tokenizer.json") and "\n" not in note


def test_broken_weights_are_refused_before_any_process_starts(tmp_path, hf_models, tiny_data):
    """A safetensors file cut short (a partial download) is named from its header alone; a
    tensor missing from the files is refused by `myria train` in one line, before processes
    start and without a run directory."""
    from safetensors.torch import load_file, save_file

    from myria.errors import ConfigError
    from myria.interop import hf

    d = tmp_path / "cut"
    shutil.copytree(hf_models["mistral"], d)
    f = d / "model.safetensors"
    with open(f, "r+b") as fh:
        fh.truncate(f.stat().st_size - 100)
    with pytest.raises(ConfigError, match="model.safetensors is .* bytes where its header lists"):
        hf.weight_files(d)
    tensors = load_file(hf_models["mistral"] / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, f, metadata={"format": "pt"})
    p = run_cli("train", "--run-dir", str(tmp_path / "run"), f"--data.path={tiny_data}", *TINY,
                f"--model.init_from={d}", check=False)
    err = p.stderr.strip().splitlines()
    assert p.returncode != 0 and len(err) == 1, p.stderr
    assert "tensor model.layers.1.mlp.up_proj.weight is missing" in err[0]
    assert not (tmp_path / "run").exists()


def test_a_typed_model_field_must_agree_with_config_json(tmp_path, hf_models, tiny_data):
    """The model is config.json's: a config file's model section gives way to it, a
    `--model.X` typed on the command line that says otherwise is refused in one line, one that
    agrees passes; a tokenizer larger than the model's vocabulary is refused naming the model,
    and a sequence past its max_position_embeddings is said."""
    from myria.errors import ConfigError
    from myria.interop import hf

    d = hf_models["mistral"]
    (tmp_path / "run.toml").write_text(f"[model]\ninit_from = {str(d)!r}\nlayers = 12\n")
    cfg, line = hf.load_config(tmp_path / "run.toml", ["--model.seq_len=64"])
    assert cfg.model.layers == 2 and "note" not in line
    cfg, _ = hf.load_config(tmp_path / "run.toml", ["--model.layers=2", "--model.hidden=64"])
    assert cfg.model.layers == 2
    with pytest.raises(ConfigError, match=r"--model.layers=12 contradicts .* layers = 2"):
        hf.load_config(None, [f"--model.init_from={d}", "--model.layers=12"])
    _, line = hf.load_config(None, [f"--model.init_from={d}", "--model.seq_len=512"])
    assert "model.seq_len = 512 is beyond its max_position_embeddings (256)" in line

    small = tmp_path / "small"
    small.mkdir()
    for f in d.iterdir():
        (small / f.name).symlink_to(f)
    (small / "config.json").unlink()
    (small / "config.json").write_text(json.dumps(
        {**json.loads((d / "config.json").read_text()), "vocab_size": 512}))
    for model, typed, said in ((d, "--model.ffn_hidden=256", "--model.ffn_hidden=256 contradicts"),
                               (small, "--model.vocab_size=512",
                                f"the model in {small} has 512 (its config.json's vocab_size)")):
        p = run_cli("train", "--run-dir", str(tmp_path / "run"), f"--data.path={tiny_data}",
                    *TINY, f"--model.init_from={model}", typed, check=False)
        err = p.stderr.strip().splitlines()
        assert p.returncode == 2 and len(err) == 1 and said in err[0], p.stderr
        assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_plan_and_simulate_take_the_model_from_init_from(tmp_path, hf_models):
    """`myria plan` and `myria simulate` of a training config naming `model.init_from` price
    the model its config.json describes (as the same model written out by hand), and need no
    weights for it; `myria plan DIR` plans the directory's model with the run typed."""
    d = tmp_path / "config-only"
    d.mkdir()
    (d / "config.json").write_bytes((hf_models["qwen2"] / "config.json").read_bytes())
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    (tmp_path / "a" / "run.toml").write_text(f"[model]\ninit_from = {str(d)!r}\n")
    (tmp_path / "b" / "run.toml").write_text(
        "[model]\nvocab_size = 1024\nhidden = 64\nlayers = 2\nheads = 4\nkv_heads = 2\n"
        "ffn_hidden = 128\ntie_embeddings = true\nqkv_bias = true\n")
    got = {}
    for which in ("a", "b"):
        f = str(tmp_path / which / "run.toml")
        plan = run_cli("plan", f, "--gpu", "H100", "--gpus", "8", "--json").stdout
        got[which] = ({k: v for k, v in json.loads(plan).items() if k != "seconds"},
                      run_cli("simulate", f, "--gpu", "H100", "--nproc", "2", "--json").stdout)
    assert got["a"] == got["b"]
    assert run_cli("plan", str(tmp_path / "a" / "run.toml"), "--gpu", "H100", "--gpus", "8"
                   ).stdout.startswith("model llama ")
    assert ": 2 x 64, 4 heads (2 key/value), MLP 128, vocabulary 1,024, seq " in run_cli(
        "plan", str(tmp_path / "a" / "run.toml"), "--gpu", "H100", "--gpus", "8").stdout
    # the directory itself (or its config.json) with the run typed: the same model, planned
    # on the public stack's defaults (a training config is planned as myria's trainer runs it)
    from myria.config import Config

    run = ["--seq-len", str(Config().model.seq_len), "--global-batch",
           str(Config().training.global_batch)]
    plans = [json.loads(run_cli("plan", str(given), "--gpu", "H100", "--gpus", "8", *run,
                                "--json").stdout) for given in (d, d / "config.json")]
    assert [{k: v for k, v in p.items() if k != "seconds"} for p in plans[1:]] == \
        [{k: v for k, v in plans[0].items() if k != "seconds"}]
    for row in plans[0]["ranked"] + [plans[0]["best_runnable"]]:
        assert row["name"] == "config-only"
    trainer = got["a"][0]
    assert {r["layout"]["zero_stage"] for r in trainer["ranked"]} <= {0, 2, 3}
    assert 1 in {r["layout"]["zero_stage"] for r in plans[0]["ranked"]}
    typed = run_cli("plan", str(d), "--gpu", "H100", "--gpus", "8", *run).stdout
    assert typed.splitlines()[0] == run_cli(   # the same model line
        "plan", str(tmp_path / "a" / "run.toml"), "--gpu", "H100", "--gpus", "8"
    ).stdout.splitlines()[0]
    p = run_cli("plan", str(d), "--gpu", "H100", "--gpus", "8", check=False)
    assert p.returncode == 2 and "--seq-len (a model directory gives the model" in p.stderr


def _tensors(d: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(d.glob("*.safetensors")):
        out.update(load_file(f))
    return out


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_lr0_run_exports_the_imported_model(tmp_path, hf_models, tiny_data, kind):
    """train (lr = 0) -> export: the same tensors bit for bit, transformers loads the export
    with the same logits, importing the export gives the same tensors again, and `myria
    generate` greedy equals transformers' greedy on the original."""
    from transformers import AutoModelForCausalLM

    from myria.data.tokenizer import decode, eos_id, load_tokenizer
    from myria.train.export import load_checkpoint_model

    d, run, out = hf_models[kind], tmp_path / "run", tmp_path / "hf"
    p = run_cli("train", "--run-dir", str(run), f"--data.path={tiny_data}", *TINY,
                f"--model.init_from={d}", "--optimizer.lr=0", "--training.steps=2")
    assert f"model from {d}: 2 layers" in p.stdout
    run_cli("export", "--run-dir", str(run), "--out", str(out))
    orig, exported = _tensors(d), _tensors(out)
    assert orig.keys() == exported.keys()
    assert all(torch.equal(orig[k], exported[k]) for k in orig)
    tokens = torch.randint(0, 1024, (1, 48), generator=torch.Generator().manual_seed(2))
    assert torch.equal(hf_logits(out, tokens), hf_logits(d, tokens))
    again, _ = imported(out)
    model, _, _ = load_checkpoint_model(run, None)
    assert all(torch.equal(a, b) for a, b in zip(again.state_dict().values(),
                                                   model.state_dict().values(), strict=True))

    text = "My fellow citizens, the state of the Union"
    p = run_cli("generate", "--run-dir", str(run), "--prompt", text, "--temperature", "0",
                "--max-new-tokens", "30")
    tok = load_tokenizer(tiny_data / "tokenizer.json")
    prompt = tok.encode(text).ids
    ref = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = ref.generate(torch.tensor([prompt]), max_new_tokens=30, do_sample=False,
                              eos_token_id=eos_id(tok), pad_token_id=0)[0, len(prompt):]
    assert p.stdout.split("\n[step_")[0] == text + decode(tok, theirs.tolist())


def _checkpoint_tensors(run: Path, *names: str) -> list[torch.Tensor]:
    """Tensors `names` of a run's newest checkpoint as saved, each read into its own tensor
    (a tied model would share one)."""
    import torch.distributed.checkpoint as dcp

    from myria.train.export import load_checkpoint_model

    model, _, path = load_checkpoint_model(run, None)
    sd = {n: torch.empty_like(model.state_dict()[n]) for n in names}
    dcp.load({"model": sd}, checkpoint_id=str(path),
             planner=dcp.DefaultLoadPlanner(allow_partial_load=True))
    return [sd[n] for n in names]


def _assert_tied_and_exported(run: Path, out: Path, start: torch.Tensor | None) -> None:
    """The run's checkpoint holds one embedding (the output layer equal to it), moved from
    `start`, and transformers' logits of the export equal myria's of the checkpoint."""
    from myria.train.export import load_checkpoint_model

    emb, head = _checkpoint_tensors(run, "tok_embeddings.weight", "output.weight")
    assert torch.equal(emb, head), "the output layer drifted from the tied embedding"
    assert start is None or not torch.equal(emb, start), "the embedding did not train"
    run_cli("export", "--run-dir", str(run), "--out", str(out))
    model, _, _ = load_checkpoint_model(run, None)
    tokens = torch.randint(0, 1024, (1, 48), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ours = model.eval()(tokens)
    assert (hf_logits(out, tokens) - ours).abs().max().item() < TOL


@pytest.fixture(scope="module")
def tied_run(tmp_path_factory, hf_models, tiny_data) -> tuple[Path, Path]:
    """(run, model directory): one process trained 2 steps (lr > 0) from a copy of the Qwen2
    directory (tied embeddings)."""
    root = tmp_path_factory.mktemp("tied")
    d, run = root / "qwen2", root / "run"
    shutil.copytree(hf_models["qwen2"], d)
    run_cli("train", "--run-dir", str(run), f"--data.path={tiny_data}", *TINY,
            f"--model.init_from={d}", *TIED_TRAINING)
    return run, d


def test_a_tied_config_with_its_own_head_is_trained_apart(tmp_path, hf_models):
    """config.json ties the embeddings but the weights hold an lm_head.weight of other values:
    transformers keeps the two apart, and so does the import (said in its description), with
    transformers' logits; the same file with the head equal to the embedding stays tied."""
    from safetensors.torch import load_file, save_file

    from myria import config as config_mod
    from myria.interop import hf

    d = tmp_path / "tied_in_name"
    shutil.copytree(hf_models["llama"], d)
    conf = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**conf, "tie_word_embeddings": True}))
    tokens = torch.randint(0, 1024, (2, 64), generator=torch.Generator().manual_seed(5))
    model, cfg = imported(d)
    assert cfg.model.tie_embeddings is False
    with torch.no_grad():
        assert (model(tokens) - hf_logits(d, tokens)).abs().max().item() < TOL
    said = hf.apply(config_mod.load(None, [f"--model.init_from={d}"]))
    assert "lm_head.weight differs from embed_tokens.weight" in said and "apart" in said
    files = {f: load_file(f) for f in hf.weight_files(d)}
    emb = next(t["model.embed_tokens.weight"] for t in files.values()
               if "model.embed_tokens.weight" in t)
    for f, t in files.items():
        if "lm_head.weight" in t:
            save_file({**t, "lm_head.weight": emb.clone()}, f, metadata={"format": "pt"})
    assert imported(d)[1].model.tie_embeddings is True


TIED_TRAINING = ("--optimizer.lr=1e-2", "--optimizer.warmup_steps=0", "--training.steps=2")


@pytest.mark.parametrize("source", ["imported", "myria"])
def test_tied_embeddings_stay_tied_in_training(tmp_path, hf_models, tiny_data, source, request):
    """One process, lr > 0: an imported tied model (Qwen2) and a tied model of myria's own keep
    one embedding matrix through training, and the export is the model that trained."""
    if source == "imported":
        run, _ = request.getfixturevalue("tied_run")
        start = _tensors(hf_models["qwen2"])["model.embed_tokens.weight"]
    else:
        run, start = tmp_path / "run", None
        run_cli("train", "--run-dir", str(run), f"--data.path={tiny_data}", *TINY,
                "--model.tie_embeddings=true", *TIED_TRAINING)
    _assert_tied_and_exported(run, tmp_path / "hf", start)


def test_resume_needs_no_model_directory(tmp_path, tied_run, tiny_data, hf_models):
    """After step 0 the checkpoint holds the model: a run started from a directory resumes
    with the directory gone and the config naming none, its model the checkpoint's. Another
    model folder named on resume is refused in one line (it would not be read)."""
    from tests.conftest import losses

    run = tmp_path / "run"
    shutil.copytree(tied_run[0], run)
    shutil.rmtree(tied_run[1])
    p = run_cli("train", "--run-dir", str(run), f"--data.path={tiny_data}", *TINY,
                *TIED_TRAINING[:-1], "--training.steps=3")
    assert (f"model from the checkpoint (2 layers, hidden 64); the run started from "
            f"{tied_run[1]}, which resuming does not read") in p.stdout
    assert "resumed from" in p.stdout and sorted(losses(run)) == [1, 2, 3]
    other = hf_models["mistral"]
    p = run_cli("train", "--run-dir", str(run), f"--data.path={tiny_data}", *TINY,
                *TIED_TRAINING[:-1], "--training.steps=4", f"--model.init_from={other}",
                check=False)
    err = p.stderr.strip().splitlines()
    assert p.returncode != 0 and len(err) == 1, p.stderr
    assert f"model.init_from = {other} is not read: this run resumes its checkpoint, which " \
        f"started from {tied_run[1]}" in err[0]


@pytest.mark.slow
def test_training_continues_from_an_imported_model(tmp_path, hf_models, tiny_data):
    """Two ranks (FSDP) train a Qwen2 model (tied embeddings, q/k/v biases) onwards: the loss
    falls from its start, the embedding stays tied and the export is the model that trained."""
    from tests.conftest import losses

    run, d = tmp_path / "run", hf_models["qwen2"]
    run_cli("train", "--run-dir", str(run), f"--data.path={tiny_data}", *TINY, "--nproc", "2",
            f"--model.init_from={d}", "--training.steps=12", "--optimizer.lr=1e-2")
    got = losses(run)
    assert got[12] < got[1] - 0.5, got
    _assert_tied_and_exported(run, tmp_path / "hf", _tensors(d)["model.embed_tokens.weight"])


def test_import_with_parameters_on_disk(tmp_path, tiny_data):
    """parallel.offload = 'nvme' with the parameters in its files: the files' first generation
    is written from the imported weights (a unit at a time) and the first steps' losses equal
    the same import trained in memory. The model's weights are large enough (std 0.2) that
    its first loss is far from a fresh initialisation's log(vocab)."""
    from tests.conftest import losses

    d = make_hf_model("llama", tmp_path / "llama", initializer_range=0.2)
    got = {}
    for name, extra in (("memory", ()), ("disk", ("--parallel.offload=nvme",
                                                  "--parallel.offload_params=true"))):
        run = tmp_path / name
        run_cli("train", "--run-dir", str(run), f"--data.path={tiny_data}", *TINY,
                f"--model.init_from={d}", "--training.steps=2",
                "--parallel.activation_checkpoint=full", *extra)
        got[name] = losses(run)
    assert got["disk"] == got["memory"] and got["memory"][1] > 7.5, got


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["tp2", "pp2"])
def test_tied_model_trains_under_tp_and_pp(tmp_path, hf_models, tiny_data, tied_run, layout):
    """A tied model (the imported Qwen2) trains under tensor parallelism (embedding and head
    one tensor, both sharded on the vocabulary) and pipeline parallelism (a copy on the first
    and the last stage, their gradients summed each step) to the losses of one process; the
    two ends stay equal and the export holds the embedding only. The pipeline's checkpoint
    resumes on one process as the one-process run's own does."""
    from tests.conftest import losses

    run, out = tmp_path / "run", tmp_path / "hf"
    degree = "--parallel.tp=2" if layout == "tp2" else "--parallel.pp=2"
    run_cli("train", "--run-dir", str(run), f"--data.path={tiny_data}", *TINY, "--nproc", "2",
            f"--model.init_from={hf_models['qwen2']}", *TIED_TRAINING, degree,
            "--parallel.dp_shard=1")
    got, ref = losses(run), losses(tied_run[0])
    assert sorted(got) == sorted(ref) == [1, 2]
    assert all(abs(got[s] - ref[s]) <= 1e-4 * abs(ref[s]) for s in ref), (got, ref)
    _assert_tied_and_exported(run, out, _tensors(hf_models["qwen2"])["model.embed_tokens.weight"])
    assert "lm_head.weight" not in _tensors(out)
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is True
    if layout == "pp2":
        ref_run = tmp_path / "ref"
        shutil.copytree(tied_run[0], ref_run)
        for r in (run, ref_run):
            run_cli("train", "--run-dir", str(r), f"--data.path={tiny_data}", *TINY,
                    *TIED_TRAINING[:-1], "--training.steps=3")
        assert abs(losses(run)[3] - losses(ref_run)[3]) <= 1e-4 * losses(ref_run)[3]
