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


def _mix_fp(text: str) -> dict:
    from myria.data import mixture

    return mixture.fingerprint(mixture.parse_sources(text))


def test_a_mixtures_fingerprint_is_its_order_not_its_typing(tmp_path: Path) -> None:
    """The same sources with the same shares read the same tokens in the same order: weights
    at another scale, another epoch limit and a moved directory give the same fingerprint
    (and resume silently); another order, other shares, or one data.path do not."""
    src = _texts(tmp_path / "in", 3)
    P.prepare(tmp_path / "a", [src], vocab_size=300, val_fraction=0)
    P.prepare(tmp_path / "b", [_texts(tmp_path / "in2", 2)],
              tokenizer=str(tmp_path / "a" / "tokenizer.json"), val_fraction=0)
    shutil.copytree(tmp_path / "b", tmp_path / "moved" / "b")
    a, b, moved = tmp_path / "a", tmp_path / "b", tmp_path / "moved" / "b"
    base = _mix_fp(f"{a}:0.5,{b}:0.5")
    for same in (f"{a}:1,{b}:1", f"{a}:2,{b}:2:9", f"{a}:0.5,{moved}:0.5:1"):
        assert not F.differs(base, _mix_fp(same)), same
    for other in (f"{b}:1,{a}:1", f"{a}:1,{b}:3", f"{a}:1"):
        assert F.differs(base, _mix_fp(other)), other
    assert F.differs(_mix_fp(f"{a}:1"), F.fingerprint(a))   # another order than one path
    ck = _ckpt(tmp_path, {F.META_KEY: base,
                          "config": {"data": {"sources": f"{a}:0.5,{b}:0.5"}}})
    F.check_resume(ck, _mix_fp(f"{a}:1,{b}:1:9"))


def test_resume_refusal_names_what_changed(tmp_path: Path) -> None:
    """Each refusal says what the evidence shows, with the key that names the data and a hint
    that gets it back: another directory (which still holds the recorded data), the same
    directory re-prepared (other tokens, or as many in shards of another size), one data.path
    against a mixture, and the source of a mixture that changed."""
    src = _texts(tmp_path / "in", 3)
    d, e = tmp_path / "d", tmp_path / "e"
    P.prepare(d, [src], vocab_size=300, val_fraction=0, shard_tokens=10**6)
    P.prepare(e, [_texts(tmp_path / "in2", 2)], tokenizer=str(d / "tokenizer.json"),
              val_fraction=0)

    def refusal(rec: dict, now: dict, sources: str = "") -> str:
        shutil.rmtree(tmp_path / "run", ignore_errors=True)
        ck = _ckpt(tmp_path, {F.META_KEY: rec, "config": {"data": {"sources": sources}}})
        with pytest.raises(DataError) as err:
            F.check_resume(ck, now)
        msg = str(err.value)
        assert "\n" not in msg and "was it re-prepared" not in msg, msg
        return msg

    old = F.fingerprint(d)
    msg = refusal(old, F.fingerprint(e))
    assert (f"trained on data.path {d.resolve()} " in msg and f"but data.path {e.resolve()} "
            in msg and f"{e.resolve()} is another directory than {d.resolve()}, holding other "
            "tokens of the same tokenizer" in msg
            and f"point data.path at {d.resolve()}, which still holds that data" in msg), msg
    msg = refusal(old, _mix_fp(f"{d}:1"))
    assert "but data.sources " in msg and "a mixture reads its samples in another order than " \
        "one data.path, even a mixture of one source" in msg and \
        f"give --data.sources= --data.path={d.resolve()} as the run did" in msg, msg
    msg = refusal(_mix_fp(f"{d}:1"), old, f"{d}:1")
    assert "trained on data.sources " in msg and "one data.path is read in another order " \
        "than the mixture" in msg and f"give --data.sources={d}:1 as" in msg, msg
    mixed = _mix_fp(f"{d}:1,{e}:3")
    P.prepare(d, [src], vocab_size=300, val_fraction=0, shard_tokens=97, force=True)
    assert F.fingerprint(d)["tokens"] == old["tokens"]
    msg = refusal(old, F.fingerprint(d))
    assert ("it was re-prepared since, now with as many tokens per split in shards of "
            "another size (--shard-tokens 97, was 1000000)" in msg and
            f"prepare {d.resolve()} again with --shard-tokens 1000000" in msg), msg
    msg = refusal(mixed, _mix_fp(f"{d}:1,{e}:3"), f"{d}:1,{e}:3")
    assert "source 'd': it was re-prepared since" in msg and "source 'e'" not in msg, msg
    _texts(tmp_path / "in", 4)                                     # more text
    P.prepare(d, [src], tokenizer=str(e / "tokenizer.json"), val_fraction=0, force=True)
    msg = refusal(old, F.fingerprint(d))
    assert "it was re-prepared since, now with other tokens of the same tokenizer (" in msg \
        and f"training tokens, were {old['tokens']['train']:,})" in msg, msg


def test_a_mixture_checkpoint_without_its_sources_listed_resumes_on_the_same_data(
        tmp_path: Path) -> None:
    """A mixture fingerprint that lists no sources digests them as typed (name, weight, epoch
    limit, data digest): the same sources' data resume, other data is refused."""
    import hashlib

    from myria.data.mixture import parse_sources

    src = _texts(tmp_path / "in", 3)
    d, e = tmp_path / "d", tmp_path / "e"
    P.prepare(d, [src], vocab_size=300, val_fraction=0)
    P.prepare(e, [_texts(tmp_path / "in2", 2)], tokenizer=str(d / "tokenizer.json"),
              val_fraction=0)
    typed = f"{d}:0.3,{e}:0.7:2"
    h = hashlib.sha256()
    for s in parse_sources(typed):
        h.update(json.dumps([s.name, s.weight, s.epochs,
                             F.fingerprint(s.path)["data_sha256"]]).encode())
    rec = {**F.fingerprint(d), "data_sha256": h.hexdigest(), "path": typed}
    ck = _ckpt(tmp_path, {F.META_KEY: rec, "config": {"data": {"sources": typed}}})
    F.check_resume(ck, _mix_fp(typed))
    P.prepare(e, [_texts(tmp_path / "in2", 3)], tokenizer=str(d / "tokenizer.json"),
              val_fraction=0, force=True)
    with pytest.raises(DataError, match="trained on data.sources .* a source holds other "
                       f"tokens than it did.*give --data.sources={typed} as the run did"):
        F.check_resume(ck, _mix_fp(typed))
