"""Token shards of `myria prepare`, written as it goes and resumable.

`ShardWriter` streams documents into `{split}_{k:05d}.bin` shards; a shard is written to
`NAME.tmp` and renamed when full, with its `.docs.npy`. `state()` describes the committed shards
and the open one (its name, token count and document starts) for the progress manifest;
`restore(state)` reopens that shard cut back to the recorded length, so a resumed prepare writes
exactly the bytes an uninterrupted one would.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any

import numpy as np

from myria.errors import DataError
from myria.fsutil import atomic_write

SHARD_RE = re.compile(r"^(train|val)_\d{5}(\.bin|\.docs\.npy)$")


def sha256_file(path: str | Path, chunk: int = 1 << 22) -> str:
    """Hex sha256 of a file, read in chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while b := fh.read(chunk):
            h.update(b)
    return h.hexdigest()


def write_json(path: Path, obj: Any, indent: int | None = 2) -> None:
    """index.json and the progress manifest: JSON with a final newline, written atomically."""
    atomic_write(path, json.dumps(obj, indent=indent) + "\n")


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
        self._fh = open(self._tmp, "wb")  # noqa: SIM115 - closed in _close
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

    # --------------------------------------------------------------- resume

    def sync(self) -> None:
        """Make the open shard's bytes durable (before a manifest records them)."""
        if self._fh is not None:
            self._fh.flush()
            os.fsync(self._fh.fileno())

    def state(self) -> dict[str, Any]:
        partial = None if self._fh is None else {
            "file": self._name, "tokens": self._n, "starts": list(self._starts)}
        return {"shards": list(self.shards), "partial": partial}

    def restore(self, st: dict[str, Any]) -> None:
        """Continue from a manifest's `state()`: the open shard is cut back to its recorded
        length (bytes written after the manifest are discarded) and its hash recomputed."""
        self.shards = [dict(s) for s in st["shards"]]
        p = st.get("partial")
        if not p:
            return
        self._name, self._n, self._starts = p["file"], int(p["tokens"]), list(p["starts"])
        self._tmp = self.out_dir / (self._name + ".tmp")
        final = self.out_dir / self._name
        if not self._tmp.exists() and final.exists():  # committed after the manifest was written
            os.replace(final, self._tmp)
        size = self._n * self.dtype.itemsize
        if not self._tmp.exists() or self._tmp.stat().st_size < size:
            raise DataError(f"cannot resume in {str(self.out_dir)!r}: the partial shard "
                            f"{self._name} is missing or shorter than its progress manifest "
                            "says; pass --force to start over")
        with open(self._tmp, "r+b") as fh:
            fh.truncate(size)
        self._hash = hashlib.sha256()
        with open(self._tmp, "rb") as fh:
            while b := fh.read(1 << 22):
                self._hash.update(b)
        self._fh = open(self._tmp, "ab")  # noqa: SIM115 - closed in _close


def clean_for_resume(out_dir: Path, states: list[dict[str, Any]]) -> None:
    """Remove what a killed prepare wrote after its last manifest: shards not recorded there and
    temporary files, except the open shards `ShardWriter.restore` continues."""
    keep = {s[k] for st in states for s in st["shards"] for k in ("file", "docs_file")}
    for st in states:
        if st.get("partial"):
            keep |= {st["partial"]["file"], st["partial"]["file"] + ".tmp"}
    for p in out_dir.iterdir():
        if (SHARD_RE.match(p.name) or p.name.endswith(".tmp")) and p.name not in keep:
            p.unlink()
