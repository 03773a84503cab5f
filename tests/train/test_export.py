"""HF export: a directory that transformers' Auto classes and pipeline use as they are, with the
tokenizer the checkpoint was trained with (even when the data directory moved), the same logits
as ours, and one-line refusals of what cannot be exported or written."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from tests.conftest import TINY, run_cli

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tiny_data):
    """A 3-step run on a private copy of the data, which is then moved away."""
    root = tmp_path_factory.mktemp("exp")
    data, run = root / "data", root / "run"
    shutil.copytree(tiny_data, data)
    run_cli("train", "--run-dir", str(run), f"--data.path={data}", *TINY,
            "--training.steps=3", "--checkpoint.interval=0")
    data.rename(root / "moved")   # export must not depend on the data directory
    return run


@pytest.fixture(scope="module")
def exported(tmp_path_factory, trained):
    out = tmp_path_factory.mktemp("hf") / "hf"
    p = run_cli("export", "--run-dir", str(trained), "--format", "hf", "--out", str(out))
    assert "LlamaForCausalLM" in p.stdout and "eos id 0" in p.stdout
    os.environ["HF_HUB_OFFLINE"] = "1"
    return out


def test_hf_logits_match(trained, exported):
    assert json.loads((exported / "config.json").read_text())["num_key_value_heads"] == 2
    hf = transformers.LlamaForCausalLM.from_pretrained(str(exported), local_files_only=True,
                                                       dtype=torch.float32).eval()
    from myria.train.export import load_checkpoint_model

    ours, cfg, _ = load_checkpoint_model(trained, None)
    x = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len))
    with torch.no_grad():
        a = ours(x)
        b = hf(x).logits
    assert (a - b).abs().max().item() <= 1e-4


def test_auto_classes_and_pipeline_need_no_argument(trained, exported):
    d = str(exported)
    kept = next((trained / "tokenizers").glob("tokenizer-*.json"))
    assert (exported / "tokenizer.json").read_bytes() == kept.read_bytes()
    cfg = json.loads((exported / "config.json").read_text())
    gen = json.loads((exported / "generation_config.json").read_text())
    assert cfg["eos_token_id"] == cfg["pad_token_id"] == gen["eos_token_id"] == 0
    # myria's tokenizer has no BOS: none is made up (a template's bos_token would be wrong)
    assert cfg["bos_token_id"] is None and gen["bos_token_id"] is None
    modes = {f.name: f.stat().st_mode & 0o777 for f in exported.iterdir()}
    assert len(set(modes.values())) == 1, modes   # model.safetensors as readable as the rest
    tok = transformers.AutoTokenizer.from_pretrained(d)
    assert tok.eos_token == tok.pad_token == "<|endoftext|>" and tok.eos_token_id == 0
    assert tok.bos_token is None
    batch = tok(["The Congress", "My fellow citizens of the United States"], padding=True,
                return_tensors="pt")
    lengths = batch["attention_mask"].sum(1).tolist()
    assert lengths[0] < lengths[1] == batch["input_ids"].shape[1]
    assert batch["input_ids"][0, 0] == tok.pad_token_id          # left padding
    assert tok.decode(tok("Fellow-citizens, 1789")["input_ids"]) == "Fellow-citizens, 1789"
    model = transformers.AutoModelForCausalLM.from_pretrained(d)
    assert type(model).__name__ == "LlamaForCausalLM"
    out = model.generate(**batch, max_new_tokens=4, do_sample=False)
    assert out.shape == (2, batch["input_ids"].shape[1] + 4)
    pipe = transformers.pipeline("text-generation", model=d)
    texts = pipe(["The Congress", "My fellow citizens"], max_new_tokens=5, do_sample=False,
                 batch_size=2)
    assert texts[0][0]["generated_text"].startswith("The Congress")
    assert texts[1][0]["generated_text"].startswith("My fellow citizens")
    # greedy through the pipeline continues the prompt as `myria generate` does
    mine = run_cli("generate", "--run-dir", str(trained), "--prompt", "The Congress",
                   "--max-new-tokens", "5", "--temperature", "0")
    assert mine.stdout.splitlines()[0] == texts[0][0]["generated_text"]


def test_out_that_exists(tmp_path, trained, exported):
    f = tmp_path / "file"
    f.write_text("x")
    p = run_cli("export", "--run-dir", str(trained), "--out", str(f), check=False)
    assert p.returncode == 2 and "is a file" in p.stderr and "Traceback" not in p.stderr
    assert f.read_text() == "x"
    d = tmp_path / "d"
    shutil.copytree(exported, d)
    (d / "config.json").write_text("{}")
    (d / "mine.txt").write_text("keep")
    p = run_cli("export", "--run-dir", str(trained), "--out", str(d), check=False)
    assert p.returncode == 2 and "not empty" in p.stderr and "--force" in p.stderr
    assert p.stderr.count("\n") == 1 and (d / "config.json").read_text() == "{}"
    run_cli("export", "--run-dir", str(trained), "--out", str(d), "--force")
    assert (d / "config.json").read_bytes() == (exported / "config.json").read_bytes()
    assert (d / "mine.txt").read_text() == "keep"


def test_bfloat16_in_shards_loads_everywhere(tmp_path, trained, exported, tiny_data):
    """--dtype bfloat16 --max-shard-size: the fp32 export's tensors rounded to bf16, in shards
    with save_pretrained's index, which transformers and `model.init_from` both load; a later
    export into the same directory leaves one model in it; a size that is not one is refused
    before anything is written."""
    from safetensors.torch import load_file

    out = tmp_path / "bf16"
    p = run_cli("export", "--run-dir", str(trained), "--out", str(out), "--dtype", "bfloat16",
                "--max-shard-size", "100KB")
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and f"in {len(files)} shards" in p.stdout and "bfloat16" in p.stdout
    got = {k: v for f in files for k, v in load_file(out / f).items()}
    want = load_file(exported / "model.safetensors")
    assert got.keys() == want.keys() and all(
        torch.equal(got[k], want[k].to(torch.bfloat16)) for k in want)
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert hf.dtype == torch.bfloat16
    ref = transformers.AutoModelForCausalLM.from_pretrained(exported).eval()
    x = torch.randint(0, 1024, (1, 16))
    with torch.no_grad():
        err = (hf(x).logits.float() - ref(x).logits).abs().max().item()
    assert err < 0.05, err   # bf16's 8-bit mantissa over two small layers
    # imported (lr 0) and exported again: the same bf16 tensors
    run_cli("train", "--run-dir", str(tmp_path / "again"), f"--data.path={tiny_data}", *TINY,
            f"--model.init_from={out}", "--training.steps=1", "--optimizer.lr=0")
    run_cli("export", "--run-dir", str(tmp_path / "again"), "--out", str(tmp_path / "back"),
            "--dtype", "bfloat16")
    back = load_file(tmp_path / "back" / "model.safetensors")
    assert all(torch.equal(back[k], got[k]) for k in got)

    run_cli("export", "--run-dir", str(trained), "--out", str(out), "--force")
    assert sorted(f.name for f in out.glob("model*")) == ["model.safetensors"]
    p = run_cli("export", "--run-dir", str(trained), "--out", str(tmp_path / "no"),
                "--max-shard-size", "5gigs", check=False)
    assert p.returncode == 2 and "--max-shard-size '5gigs'" in p.stderr
    assert not (tmp_path / "no").exists()


def test_export_reads_the_checkpoint_one_file_at_a_time(tmp_path, trained, monkeypatch):
    """The process never holds the model: each checkpoint read is one output file's tensors
    (so its memory is one shard's, whatever the model's size), and together they are all."""
    from safetensors.torch import load_file

    from myria.train import export

    reads = []
    real = export._load_alone
    monkeypatch.setattr(export, "_load_alone",
                        lambda state, path: (reads.append(set(state["model"])),
                                             real(state, path)))
    path = export.checkpoint_path(trained, None)
    m = export.checkpoint_model_config(path)
    names, n = export.write_weights(tmp_path, path, m, "bfloat16", "40KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(reads) == len(files) > 2 and names == [*files, "model.safetensors.index.json"]
    every = set().union(*reads)
    assert sum(map(len, reads)) == len(every) == len(index["weight_map"])
    assert max(map(len, reads)) < len(every) / 2
    assert n == sum(t.numel() for f in files for t in load_file(tmp_path / f).values())


def test_export_of_a_damaged_checkpoint_is_refused_in_one_line(tmp_path, trained):
    """--step names a checkpoint whose bytes no longer match their checksums: nothing is
    exported (the newest that verifies is what the default picks)."""
    run = tmp_path / "run"
    shutil.copytree(trained, run)
    ckpt = run / "checkpoints" / "step_00000003"
    victim = max(ckpt.glob("*.distcp"), key=lambda q: q.stat().st_size)
    raw = bytearray(victim.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    victim.write_bytes(bytes(raw))
    p = run_cli("export", "--run-dir", str(run), "--step", "3", "--out", str(tmp_path / "hf"),
                check=False)
    assert p.returncode != 0 and p.stderr.count("\n") == 1, p.stderr
    assert "does not verify" in p.stderr and "fails its checksum" in p.stderr, p.stderr
    assert not (tmp_path / "hf" / "model.safetensors").exists()


def test_export_chooses_again_when_a_live_run_deletes_its_checkpoint(tmp_path, trained,
                                                                     monkeypatch):
    """A run saving into the same directory prunes the checkpoint chosen before it is read:
    the newest is chosen again; deleted every time, one CheckpointError after READ_TRIES
    choices, and an --out the export made is not left behind. With every checkpoint
    quarantined, the refusal names them and what can load one."""
    import argparse

    from myria.errors import CheckpointError
    from myria.train import export

    run = tmp_path / "run"
    shutil.copytree(trained, run)
    ck = run / "checkpoints"
    for s in (1, 2, 4):
        shutil.copytree(ck / "step_00000003", ck / f"step_{s:08d}")
    deletions = [1]
    real = export.checkpoint_path

    def chosen_then_pruned(run_dir, step):
        path = real(run_dir, step)
        if deletions:
            shutil.rmtree(path)
            deletions.pop()
        return path

    monkeypatch.setattr(export, "checkpoint_path", chosen_then_pruned)

    def args(out):
        return argparse.Namespace(run_dir=str(run), out=str(out), step=None, force=False,
                                  tokenizer=None, dtype="float32", max_shard_size="5GB")

    export.run(args(tmp_path / "a"))
    assert (tmp_path / "a" / "model.safetensors").exists()
    deletions[:] = [1] * 3
    with pytest.raises(CheckpointError, match="deleted while it was read, 3 times"):
        export.run(args(tmp_path / "b"))
    assert not (tmp_path / "b").exists()
    assert [p.name for p in ck.glob("step_*")] == []
    from myria.train.checkpoint.store import CheckpointStore

    shutil.copytree(trained / "checkpoints" / "step_00000003", ck / "step_00000003")
    CheckpointStore(ck).quarantine(ck / "step_00000003", "fails its checksum")
    with pytest.raises(CheckpointError, match=r"quarantined in .*step_00000003 \(fails its "
                       r"checksum\).*train --resume-from PATH"):
        export.run(args(tmp_path / "c"))


def test_export_refuses_what_llama_cannot_hold(tmp_path, tiny_data):
    run_cli("train", "--run-dir", str(tmp_path / "r"), f"--data.path={tiny_data}", *TINY,
            "--training.steps=1", "--model.parallel_block=true")
    p = run_cli("export", "--run-dir", str(tmp_path / "r"), "--out", str(tmp_path / "o"),
                check=False)
    assert p.returncode == 2 and "parallel_block" in p.stderr and "Traceback" not in p.stderr
    p = run_cli("export", "--run-dir", str(tmp_path / "nope"), "--out", str(tmp_path / "o"),
                check=False)
    assert p.returncode == 2 and "does not exist" in p.stderr
