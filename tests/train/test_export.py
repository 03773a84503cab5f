"""HF export: transformers' LlamaForCausalLM loads the files and gives the same logits."""

from __future__ import annotations

import json
import os

import pytest
import torch

from tests.conftest import TINY, run_cli

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tiny_data):
    d = tmp_path_factory.mktemp("exp")
    run_cli("train", "--run-dir", str(d), f"--data.path={tiny_data}", *TINY,
            "--training.steps=3", "--checkpoint.interval=0")
    return d


def test_hf_logits_match(tmp_path, trained):
    out = tmp_path / "hf"
    p = run_cli("export", "--run-dir", str(trained), "--format", "hf", "--out", str(out))
    assert "LlamaForCausalLM" in p.stdout
    assert json.loads((out / "config.json").read_text())["num_key_value_heads"] == 2
    assert (out / "tokenizer.json").exists()
    os.environ["HF_HUB_OFFLINE"] = "1"
    hf = transformers.LlamaForCausalLM.from_pretrained(str(out), local_files_only=True,
                                                       torch_dtype=torch.float32).eval()
    from myria.train.export import load_checkpoint_model

    ours, cfg, _ = load_checkpoint_model(trained, None)
    x = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len))
    with torch.no_grad():
        a = ours(x)
        b = hf(x).logits
    assert (a - b).abs().max().item() <= 1e-4


def test_export_refuses_what_llama_cannot_hold(tmp_path, tiny_data):
    run_cli("train", "--run-dir", str(tmp_path / "r"), f"--data.path={tiny_data}", *TINY,
            "--training.steps=1", "--model.parallel_block=true")
    p = run_cli("export", "--run-dir", str(tmp_path / "r"), "--out", str(tmp_path / "o"),
                check=False)
    assert p.returncode == 2 and "parallel_block" in p.stderr and "Traceback" not in p.stderr
    p = run_cli("export", "--run-dir", str(tmp_path / "nope"), "--out", str(tmp_path / "o"),
                check=False)
    assert p.returncode == 2 and "does not exist" in p.stderr
