"""A run's data fingerprint: a re-prepared data directory is refused on resume (unless
--allow-data-change), and generate/export keep using the tokenizer the checkpoint was trained
with."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from myria.data import fingerprint as F
from myria.data import prepare as P
from myria.errors import DataError
from tests.conftest import TINY, run_cli


def _texts(root: Path, n: int) -> str:
    root.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        (root / f"t{i}.txt").write_text(" ".join(f"word{(i * 7 + j) % 61}" for j in range(400)))
    return str(root / "*.txt")


def test_fingerprint_is_the_identity_of_tokenizer_and_tokens(tmp_path: Path) -> None:
    src = _texts(tmp_path / "in", 4)
    kw = dict(vocab_size=300, val_fraction=0)
    P.prepare(tmp_path / "a", [src], **kw)
    P.prepare(tmp_path / "b", [src], **kw)
    a, b = F.fingerprint(tmp_path / "a"), F.fingerprint(tmp_path / "b")
    assert not F.differs(a, b) and a["path"] != b["path"]   # deterministic, not the path
    P.prepare(tmp_path / "a", [src], vocab_size=280, val_fraction=0, force=True)
    c = F.fingerprint(tmp_path / "a")
    assert c["tokenizer_sha256"] != a["tokenizer_sha256"] and c["data_sha256"] != a["data_sha256"]
    _texts(tmp_path / "in", 5)                               # more text, same tokenizer
    P.prepare(tmp_path / "b", [src], tokenizer=str(tmp_path / "b" / "tokenizer.json"),
              val_fraction=0, force=True)
    d = F.fingerprint(tmp_path / "b")
    assert d["tokenizer_sha256"] == b["tokenizer_sha256"] and d["data_sha256"] != b["data_sha256"]


def _ckpt(tmp_path: Path, meta: dict) -> Path:
    p = tmp_path / "run" / "checkpoints" / "step_00000002"
    p.mkdir(parents=True)
    (p / "meta.json").write_text(json.dumps(meta))
    return p


def test_checkpoint_tokenizer_never_uses_another(tmp_path: Path) -> None:
    src = _texts(tmp_path / "in", 3)
    P.prepare(tmp_path / "d", [src], vocab_size=300, val_fraction=0)
    fp = F.keep_tokenizer(tmp_path / "d", tmp_path / "run")
    kept = tmp_path / "run" / fp["tokenizer_file"]
    ck = _ckpt(tmp_path, {"data_path": str(tmp_path / "d"), F.META_KEY: fp})
    assert F.checkpoint_tokenizer(tmp_path / "run", ck) == (kept, None)
    P.prepare(tmp_path / "d", [src], vocab_size=280, val_fraction=0, force=True)
    path, note = F.checkpoint_tokenizer(tmp_path / "run", ck)
    assert path == kept and "another tokenizer" in note
    with pytest.raises(DataError, match="--tokenizer .* is not the tokenizer step_00000002"):
        F.checkpoint_tokenizer(tmp_path / "run", ck, tmp_path / "d" / "tokenizer.json")
    kept.unlink()                       # the kept copy lost and the data re-prepared: refuse
    with pytest.raises(DataError, match=f"tokenizer {fp['tokenizer_sha256'][:12]} but"):
        F.checkpoint_tokenizer(tmp_path / "run", ck)
    shutil.rmtree(tmp_path / "d")
    with pytest.raises(DataError, match="is not found.*--tokenizer PATH"):
        F.checkpoint_tokenizer(tmp_path / "run", ck)


def test_check_resume(tmp_path: Path) -> None:
    src = _texts(tmp_path / "in", 3)
    P.prepare(tmp_path / "d", [src], vocab_size=300, val_fraction=0)
    old = F.fingerprint(tmp_path / "d")
    ck = _ckpt(tmp_path, {F.META_KEY: old})
    F.check_resume(ck, F.fingerprint(tmp_path / "d"))            # unchanged: fine
    P.prepare(tmp_path / "d", [src], vocab_size=280, val_fraction=0, force=True)
    new = F.fingerprint(tmp_path / "d")
    with pytest.raises(DataError, match=f"{old['tokenizer_sha256'][:12]}.*"
                       f"{new['tokenizer_sha256'][:12]}.*--allow-data-change"):
        F.check_resume(ck, new)
    F.check_resume(ck, new, allow=True)
    (ck / "meta.json").write_text("{}")                           # an older checkpoint
    F.check_resume(ck, new)


@pytest.mark.slow
def test_resume_on_reprepared_data_is_refused(tmp_path: Path, tiny_data: Path) -> None:
    """The user's steps: train, re-prepare the data directory, resume; then generate."""
    import torch

    from myria.data.tokenizer import load_tokenizer
    from myria.models.decode import generate
    from myria.train.export import load_checkpoint_model

    data, run = tmp_path / "data", tmp_path / "run"
    shutil.copytree(tiny_data, data)
    train = ["train", "--run-dir", str(run), f"--data.path={data}", *TINY,
             "--checkpoint.interval=0"]
    run_cli(*train, "--training.steps=2")
    old_tok = load_tokenizer(data / "tokenizer.json")
    run_cli("prepare", "--corpus", "demo", "--max-docs", "20", "--vocab-size", "900", "--out",
            str(data), "--quiet", "--force")
    p = run_cli(*train, "--training.steps=3", check=False)
    assert p.returncode == 2 and "Traceback" not in p.stderr
    line = [x for x in p.stderr.splitlines() if "error" in x]
    assert len(line) == 1 and "step_00000002 was trained on data" in line[0]
    rec = F.recorded(run / "checkpoints" / "step_00000002")
    now = F.fingerprint(data)
    assert rec["tokenizer_sha256"][:12] in line[0] and now["tokenizer_sha256"][:12] in line[0]
    assert "--allow-data-change" in line[0]
    assert [c.name for c in (run / "checkpoints").glob("step_*")] == ["step_00000002"]
    # the refused data's tokenizer is not kept with the run: only the one it trained with
    kept = sorted(f.name for f in (run / "tokenizers").iterdir())
    assert kept == [f"tokenizer-{rec['tokenizer_sha256'][:16]}{x}.json" for x in (".config", "")]

    # generate decodes with the tokenizer it was trained with, not the data directory's new one
    p = run_cli("generate", "--run-dir", str(run), "--prompt", "The Congress",
                "--max-new-tokens", "8", "--temperature", "0")
    assert "another tokenizer" in p.stderr
    model, _, _ = load_checkpoint_model(run, None)
    ids = old_tok.encode("The Congress", add_special_tokens=False).ids
    with torch.no_grad():
        new = generate(model, ids, 8, temperature=0.0, eos=old_tok.token_to_id("<|endoftext|>"))
    assert p.stdout.splitlines()[0] == "The Congress" + old_tok.decode(new)

    p = run_cli(*train, "--training.steps=3", "--allow-data-change")
    assert "continuing on the new data as allowed" in p.stdout + p.stderr
    assert not F.differs(F.recorded(run / "checkpoints" / "step_00000003"), now)
