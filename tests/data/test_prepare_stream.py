"""`myria prepare` on corpora read as streams: input formats, kill and resume, dedup, bad inputs.

The corpora are tiny; `sample_mb` is set below their size so the streaming path (tokenizer on a
sample, hashed validation split, worker processes) is the one exercised. Bounded memory on a
large corpus is shown by bench/prepare_stream.py, not here.
"""

from __future__ import annotations

import contextlib
import gzip
import io
import json
import random
from pathlib import Path

import pytest

from myria.data import prepare as P
from tests.conftest import run_cli

WORDS = ("the of and to in that is was he for it with as his on be at by had not are but from "
         "or have an they which one you were her all she there would their we him been has when "
         "who will more no if out so said what up its about into than them can only other new "
         "some could time these two may then do first any my now such like our over man").split()


def docs(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 120))).capitalize() + "."
            for _ in range(n)]


def write_jsonl(path: Path, texts: list[str], field: str = "text") -> Path:
    data = "".join(json.dumps({"id": i, field: t}) + "\n" for i, t in enumerate(texts)).encode()
    if path.name.endswith(".gz"):
        data = gzip.compress(data, mtime=0)
    elif path.name.endswith(".zst"):
        import zstandard

        data = zstandard.ZstdCompressor().compress(data)
    path.write_bytes(data)
    return path


def files_of(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


def cli(*args: str) -> tuple[int, str, str]:
    """`myria prepare ARGS` in this process: rc, stdout, stderr."""
    from myria.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(["prepare", "--quiet", *args])
    return rc, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def texts() -> list[str]:
    return docs(300)


def test_every_input_format_gives_the_same_tokens(texts: list[str], tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    half = len(texts) // 2
    inputs = {
        "jsonl": [write_jsonl(tmp_path / "a.jsonl", texts[:half]),
                  write_jsonl(tmp_path / "b.jsonl", texts[half:])],
        "gz+zst": [write_jsonl(tmp_path / "a.jsonl.gz", texts[:half]),
                   write_jsonl(tmp_path / "b.jsonl.zst", texts[half:])],
    }
    pq.write_table(pa.table({"body": texts[:half]}), tmp_path / "a.parquet", row_group_size=37)
    pq.write_table(pa.table({"body": texts[half:]}), tmp_path / "b.parquet")
    inputs["parquet"] = [tmp_path / "a.parquet", tmp_path / "b.parquet"]
    import datasets

    datasets.Dataset.from_dict({"body": texts}).save_to_disk(str(tmp_path / "hf"))
    inputs["datasets"] = [tmp_path / "hf"]
    common = dict(vocab_size=300, val_fraction=0.1, shard_tokens=2000, workers=1, sample_mb=0.01)
    results = {}
    for name, files in inputs.items():
        field = "body" if name in ("parquet", "datasets") else "text"
        index = P.prepare(tmp_path / f"out-{name}", inputs=[str(f) for f in files],
                          jsonl_field=field, **common)
        assert index["total_documents"] == len(texts), name
        assert "first" in index["tokenizer_source"]  # trained on a sample, not everything
        results[name] = {k: v for k, v in files_of(tmp_path / f"out-{name}").items()
                         if k != "index.json"}
    assert len(results["jsonl"]) > 4  # several shards and both splits
    for name in inputs:
        assert results[name] == results["jsonl"], name


def _uninterrupted(src: Path, out: Path, **kw) -> dict:
    return P.prepare(out, inputs=[str(src)], vocab_size=300, val_fraction=0.05,
                     shard_tokens=1500, sample_mb=0.005, **kw)


def test_killed_prepare_resumes_to_identical_bytes(texts: list[str], tmp_path: Path) -> None:
    src = write_jsonl(tmp_path / "c.jsonl.zst", texts)
    # Uninterrupted, encoded by 2 worker processes; the resumed run below uses 1: same bytes.
    ref = _uninterrupted(src, tmp_path / "ref", workers=2)
    assert len(ref["splits"]["train"]["shards"]) >= 6
    args = ["prepare", "--quiet", "--input", str(src), "--out", str(tmp_path / "o"),
            "--vocab-size", "300", "--val-fraction", "0.05", "--shard-tokens", "1500",
            "--sample-mb", "0.005", "--workers", "1"]
    p = run_cli(*args, env={P.EXIT_ENV: "3"}, check=False)  # dies before its 3rd checkpoint
    assert p.returncode == 75, p.stderr
    out = tmp_path / "o"
    man = json.loads((out / P.MANIFEST_FILE).read_text())
    assert not (out / "index.json").exists() and len(man["splits"]["train"]["shards"]) == 2
    assert (out / "train_00002.bin").exists()  # written after the manifest: not trusted
    # nor does a training run trust the unfinished directory: one line saying what it is
    from myria.cli import main

    with contextlib.redirect_stderr(io.StringIO()) as err:
        rc = main(["train", "--run-dir", str(tmp_path / "run"), "--nproc", "1",
                   f"--data.path={out}"])
    assert rc == 2 and err.getvalue().count("\n") == 1, err.getvalue()
    assert (f"'{out}' holds an unfinished `myria prepare` ({man['kept']:,} documents written"
            in err.getvalue())
    assert not (tmp_path / "run").exists()
    # other options: refused while the unfinished prepare is there
    rc, _, err = cli(*args[2:-6], "--shard-tokens", "999", "--sample-mb", "0.005",
                     "--val-fraction", "0.05", "--workers", "1")
    assert rc == 2 and err.count("\n") == 1 and "unfinished prepare" in err
    p = run_cli(*args)
    assert "resumed after" in p.stdout
    assert not (out / P.MANIFEST_FILE).exists()
    assert files_of(out) == files_of(tmp_path / "ref")


def test_dedup_drops_exact_duplicates(texts: list[str], tmp_path: Path) -> None:
    a = write_jsonl(tmp_path / "a.jsonl", texts[:40] + texts[:10])
    b = write_jsonl(tmp_path / "b.jsonl.gz", texts[5:15] + texts[40:50])
    rc, out, _ = cli("--input", str(a), "--input", str(b), "--dedup", "--vocab-size", "280",
                     "--val-fraction", "0", "--workers", "1", "--out", str(tmp_path / "d"))
    index = json.loads((tmp_path / "d" / "index.json").read_text())
    assert rc == 0 and "20 exact duplicate document(s) dropped" in out
    assert index["dedup"] == {"duplicates_dropped": 20} and index["total_documents"] == 50
    assert [s["documents"] for s in index["sources"]] == [40, 10]
    index = P.prepare(tmp_path / "e", inputs=[str(a), str(b)], vocab_size=280, val_fraction=0,
                      workers=1)
    assert index["total_documents"] == 70 and index["dedup"] is None


def test_bad_inputs_one_line_and_no_index(texts: list[str], tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    gz = write_jsonl(tmp_path / "t.jsonl.gz", texts[:100])
    gz.write_bytes(gz.read_bytes()[: gz.stat().st_size // 2])
    zst = write_jsonl(tmp_path / "t.jsonl.zst", texts[:100])
    zst.write_bytes(zst.read_bytes()[: zst.stat().st_size // 2])
    pq.write_table(pa.table({"body": texts[:5]}), tmp_path / "t.parquet")
    (tmp_path / "blank.jsonl").write_text('{"text": "  "}\n\n')
    cases = {
        "gz": ([str(gz)], "truncated or corrupt gzip"),
        "zst": ([str(zst)], "truncated or corrupt zstd"),
        "zst-late": ([str(zst)], "truncated or corrupt zstd"),  # past the tokenizer sample
        "parquet": ([str(tmp_path / "t.parquet")], "no column 'text' (columns: body)"),
        "missing": ([str(tmp_path / "nope.jsonl")], "no such file"),
        "empty": ([str(tmp_path / "blank.jsonl")], "empty corpus"),
    }
    for name, (inputs, msg) in cases.items():
        out = tmp_path / f"o-{name}"
        extra = ["--sample-mb", "0.001"] if name == "zst-late" else []
        rc, _, err = cli(*[a for i in inputs for a in ("--input", i)], *extra, "--workers", "1",
                         "--vocab-size", "280", "--out", str(out))
        assert rc == 2 and err.count("\n") == 1 and msg in err, (name, err)
        assert not (out / "index.json").exists(), name
