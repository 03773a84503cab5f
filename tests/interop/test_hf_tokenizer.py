"""`myria prepare --tokenizer DIR`: a model's own tokenizer (here Llama-3-style, built locally:
no `<|endoftext|>`, BOS added by its post-processor, EOS `<|end_of_text|>`) prepares, trains,
generates and exports; the export's tokenizer is the one trained with, with the model's chat
template and generation settings, and transformers' generation stops at its EOS."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from tests.conftest import TINY, run_cli
from tests.interop.conftest import make_hf_model

BOS, EOS, EOT = "<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"
# Llama 3 Instruct's template, shortened: a header per message, each message ended by EOT
TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}"
            "<|end_header_id|>\n\n{{ m['content'] }}<|eot_id|>{% endfor %}")


def llama3_style_tokenizer(d: Path) -> tuple[int, int]:
    """A byte-level BPE trained on this repository's README, with Llama 3's special tokens
    after the vocabulary and its template (BOS in front), saved as tokenizer.json and
    tokenizer_config.json in `d`; (bos id, eos id)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    text = (Path(__file__).resolve().parents[2] / "README.md").read_text().splitlines()
    tok.train_from_iterator(text, trainers.BpeTrainer(
        vocab_size=600, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    tok.add_special_tokens([BOS, EOS, EOT])
    bos, eos = tok.token_to_id(BOS), tok.token_to_id(EOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos)])
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": BOS, "eos_token": EOS, "tokenizer_class": "PreTrainedTokenizerFast",
         "model_max_length": int(1e30)}))   # transformers' "no limit" sentinel
    return bos, eos


def test_model_tokenizer_prepares_trains_generates_exports(tmp_path):
    from transformers import (
        AutoModelForCausalLM,
        AutoTokenizer,
        LogitsProcessor,
        LogitsProcessorList,
    )

    model_dir = make_hf_model("llama", tmp_path / "llama3")
    bos, eos = llama3_style_tokenizer(model_dir)
    # as transformers saves an instruct model: the template in its own file, several stops
    (model_dir / "chat_template.jinja").write_text(TEMPLATE)
    eot = eos + 1
    (model_dir / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": bos, "eos_token_id": [eos, eot], "do_sample": True,
         "temperature": 0.6, "top_p": 0.9}))
    data, run, out = tmp_path / "data", tmp_path / "run", tmp_path / "hf"
    run_cli("prepare", "--corpus", "demo", "--max-docs", "6", "--tokenizer", str(model_dir),
            "--out", str(data), "--quiet")
    index = json.loads((data / "index.json").read_text())
    assert (index["eos_id"], index["eos_token"], index["bos_id"]) == (eos, EOS, bos)
    shard = index["splits"]["train"]["shards"][0]
    ids = np.fromfile(data / shard["file"], dtype=index["dtype"])
    starts = np.load(data / shard["docs_file"])
    assert (ids[starts] == bos).all() and (ids[starts[1:] - 1] == eos).all() and ids[-1] == eos

    run_cli("train", "--run-dir", str(run), f"--data.path={data}", *TINY,
            f"--model.init_from={model_dir}", "--training.steps=3")
    p = run_cli("generate", "--run-dir", str(run), "--prompt", "The state of the",
                "--temperature", "0", "--max-new-tokens", "5")
    assert p.stdout.startswith("The state of the")
    e = run_cli("export", "--run-dir", str(run), "--out", str(out))
    assert "Warning" not in p.stderr + e.stderr   # nothing but what myria says
    assert (out / "tokenizer.json").read_bytes() == (model_dir / "tokenizer.json").read_bytes()
    g = run_cli("generate", "--run-dir", str(out), "--prompt", "a", check=False)
    assert g.returncode != 0 and "is a Hugging Face model directory" in g.stderr, g.stderr
    tok = AutoTokenizer.from_pretrained(out)
    assert (tok.eos_token, tok.bos_token) == (EOS, BOS)
    assert tok("hello").input_ids[0] == bos  # the template came along
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert chat == f"{BOS}<|start_header_id|>user<|end_header_id|>\n\nhi{EOT}"
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert hf.config.bos_token_id == bos
    # the tokenizer's length is the one the export serves, not the source file's sentinel
    assert tok.model_max_length == hf.config.max_position_embeddings == 256
    gen = hf.generation_config
    assert (gen.eos_token_id, gen.temperature, gen.top_p) == ([eos, eot], 0.6, 0.9)

    class EosAtThird(LogitsProcessor):  # the model says EOS as its third new token
        def __call__(self, input_ids, scores):
            if input_ids.shape[1] == 4 + 2:
                scores[:] = -float("inf")
                scores[:, eos] = 0.0
            return scores

    prompt = torch.tensor([tok("The state of the Union").input_ids[:4]])
    with torch.no_grad():
        got = hf.generate(prompt, max_new_tokens=20, do_sample=False,
                          logits_processor=LogitsProcessorList([EosAtThird()]))
    assert got.shape[1] == 4 + 3 and got[0, -1].item() == eos


def test_a_tokenizer_without_its_config_names_what_is_missing(tmp_path):
    """A tokenizer.json alone whose vocabulary has no <|endoftext|>: the error says there is no
    tokenizer_config.json beside it (not that the file lacks an eos_token)."""
    import pytest

    from myria.data.tokenizer import read_specials
    from myria.errors import DataError

    llama3_style_tokenizer(tmp_path)
    (tmp_path / "tokenizer_config.json").unlink()
    with pytest.raises(DataError, match="no tokenizer_config.json beside it and no "
                                        "<\\|endoftext\\|> in its vocabulary"):
        read_specials(tmp_path / "tokenizer.json")
