"""Token shards written by `myria prepare`, memory-mapped as fixed-length samples, and their order.

Samples
    The shards of a split are one concatenated token stream `tokens` (documents separated by
    EOS). Sample i is the window `tokens[i*seq_len : i*seq_len + seq_len + 1]`: inputs are its
    first seq_len tokens, targets the last seq_len (shifted by one). Consecutive samples share
    one token; windows cross document and shard boundaries. There are
    `(num_tokens - 1) // seq_len` samples; the remaining tail tokens are never used.

Order (the data-order rule; everything below is a pure function of its arguments)
    The global stream of sample indices is the concatenation, epoch after epoch, of one
    permutation per epoch: `np.random.default_rng([seed, epoch]).permutation(num_samples)`.
    Optimizer step t takes positions [t*G, (t+1)*G) of that stream, G = global batch size, so
    a step may end one epoch and begin the next; each sample appears exactly once per epoch.
    Data-parallel rank r of D takes the contiguous slice [r*G/D, (r+1)*G/D) of step t's global
    batch (and splits it into micro-batches in order). The global batch therefore depends
    only on (seed, step, G, num_samples), never on D: a run resumed at step t with a different
    number of data-parallel ranks trains on exactly the samples it would have seen otherwise.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import numpy as np

from myria.data.shards import sha256_file as _sha256
from myria.errors import ConfigError, DataError

INDEX_FILE = "index.json"
MANIFEST_FILE = "prepare.progress.json"   # an unfinished `myria prepare` (myria.data.prepare)
FORMAT = "myria-tokens"
FORMAT_VERSION = 1


def _prepare_hint(path: Path) -> str:
    return (f"create it with `myria prepare --out {path} --corpus demo` "
            "(or --input FILES for your own text, with --tokenizer MODEL_DIR for a Hugging Face "
            "model's tokenizer)")


def reprepare_hint(path: str | Path) -> str:
    """The command that rebuilds data directory `path` whatever it holds now (a plain rerun
    finds index.json and stops, or does nothing when the inputs are unchanged)."""
    return (f"prepare it again with `myria prepare --out {path} --force` and the inputs and "
            "options it was prepared from")


def load_index(path: str | Path) -> dict[str, Any]:
    """The parsed index.json of a data directory; DataError naming the path otherwise."""
    d = Path(path)
    if not d.is_dir():
        raise DataError(f"data directory {str(d)!r} does not exist; {_prepare_hint(d)}")
    p = d / INDEX_FILE
    if not p.is_file() and (d / MANIFEST_FILE).is_file():
        try:
            kept = f"{int(json.loads((d / MANIFEST_FILE).read_text()).get('kept', 0)):,}"
        except (OSError, ValueError, TypeError, AttributeError):
            kept = "some"
        raise DataError(f"{str(d)!r} holds an unfinished `myria prepare` ({kept} documents "
                        f"written, no {INDEX_FILE} yet): rerun `myria prepare --out {d}` with the "
                        "same inputs to finish it (it resumes where it stopped), or with --force "
                        "to start over")
    if not p.is_file():
        raise DataError(f"{str(p)!r} not found: {str(d)!r} is not a prepared data directory; "
                        f"{_prepare_hint(d)}")
    try:
        index = json.loads(p.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise DataError(f"{str(p)!r} is unreadable ({e}); {reprepare_hint(d)}") from None
    if not isinstance(index, dict) or index.get("format") != FORMAT:
        raise DataError(f"{str(p)!r} is not a myria token index (format {FORMAT!r})")
    if index.get("version") != FORMAT_VERSION:
        raise DataError(f"{str(p)!r} has format version {index.get('version')!r}; this myria "
                        f"reads version {FORMAT_VERSION}: {reprepare_hint(d)}")
    return index


@functools.lru_cache(maxsize=64)
def _file_sha256(path: str, mtime_ns: int, size: int) -> str:  # noqa: ARG001 (cache key)
    """sha256 of a file, once per process while its modification time and size stay: every
    split and mixture source of a run opens the same tokenizer (megabytes each time)."""
    return _sha256(Path(path))


def tokenizer_sha256(path: str | Path, index: dict[str, Any]) -> str:
    """The sha256 of data directory `path`'s tokenizer file. DataError when it is unreadable or
    is not the tokenizer index.json records: the shards' token ids would be read as other text.
    """
    d = Path(path)
    tok = d / index.get("tokenizer", "tokenizer.json")
    try:
        st = tok.stat()
        got = _file_sha256(str(tok), st.st_mtime_ns, st.st_size)
    except OSError as e:
        raise DataError(f"tokenizer {str(tok)!r} of {str(d)!r} is unreadable: "
                        f"{e.strerror or e}; {reprepare_hint(d)}") from None
    want = index.get("tokenizer_sha256")
    if want and got != want:
        raise DataError(f"{str(d)!r}: {tok.name} (sha256 {got[:12]}) is not the tokenizer its "
                        f"shards were prepared with (index.json: sha256 {str(want)[:12]}); put "
                        f"that tokenizer back, or {reprepare_hint(d)}")
    return got


class TokenDataset:
    """Fixed windows of `seq_len + 1` tokens over the memory-mapped shards of one split.

    Opening checks the tokenizer file and every shard's size against index.json and, with
    `verify`, each shard's sha256; a mismatch raises DataError naming the file.
    """

    def __init__(self, path: str | Path, seq_len: int, split: str = "train",
                 verify: bool = True) -> None:
        if seq_len < 1:
            raise ConfigError(f"seq_len = {seq_len}: must be >= 1")
        self.path = Path(path)
        self.seq_len = int(seq_len)
        self.split = split
        self.index = load_index(self.path)
        tokenizer_sha256(self.path, self.index)
        splits = self.index.get("splits", {})
        if split not in splits:
            raise DataError(f"{self.path / INDEX_FILE} has no split {split!r}; it has: "
                            f"{', '.join(splits) or 'none'}")
        self.vocab_size: int = int(self.index["vocab_size"])
        self.eos_id: int = int(self.index["eos_id"])
        self.dtype = np.dtype(self.index["dtype"])
        self.shards: list[dict[str, Any]] = list(splits[split]["shards"])
        self._maps: list[np.memmap] = []
        for s in self.shards:
            f = self.path / s["file"]
            if not f.is_file():
                raise DataError(f"shard {str(f)!r} listed in index.json is missing; "
                                f"{reprepare_hint(self.path)}")
            size, want = f.stat().st_size, int(s["tokens"]) * self.dtype.itemsize
            if size != want:
                raise DataError(f"shard {str(f)!r} has {size} bytes but index.json says "
                                f"{s['tokens']} {self.dtype.name} tokens ({want} bytes): it is "
                                f"truncated or from another run; {reprepare_hint(self.path)}")
            if verify:
                got = _sha256(f)
                if got != s["sha256"]:
                    raise DataError(f"shard {str(f)!r} is damaged: sha256 {got[:16]}... does "
                                    f"not match index.json ({s['sha256'][:16]}...); "
                                    f"{reprepare_hint(self.path)}")
            self._maps.append(np.memmap(f, dtype=self.dtype, mode="r", shape=(int(s["tokens"]),)))
        sizes = np.array([int(s["tokens"]) for s in self.shards], dtype=np.int64)
        self._ends = np.cumsum(sizes)
        self._starts = self._ends - sizes
        self.num_tokens: int = int(self._ends[-1]) if len(sizes) else 0
        self.num_samples: int = max(0, (self.num_tokens - 1) // self.seq_len)
        if self.num_tokens == 0 and split == "val":
            how = " (prepared with --val-fraction 0)" if not self.index.get("val_fraction") \
                else ""
            raise DataError(f"split 'val' of {str(self.path)!r} is empty{how}: there is no "
                            "text to evaluate on; prepare the data with a --val-fraction > 0 "
                            "(e.g. 0.01)")
        if self.num_samples == 0:
            raise DataError(f"split {split!r} of {str(self.path)!r} has {self.num_tokens} "
                            f"tokens, fewer than seq_len + 1 = {self.seq_len + 1}; prepare more "
                            "text or use a shorter sequence length")
        self.samples_read = 0  # samples returned by get/get_many (this process)

    @property
    def tokenizer_path(self) -> Path:
        return self.path / self.index.get("tokenizer", "tokenizer.json")

    @property
    def mean_document_tokens(self) -> float:
        """Mean tokens per document of this split (EOS included), from the index."""
        docs = int(self.index["splits"][self.split].get("documents", 0))
        return self.num_tokens / docs if docs else float(self.num_tokens)

    def __len__(self) -> int:
        return self.num_samples

    def batch_indices(self, step: int, global_batch: int, seed: int) -> np.ndarray:
        """Sample indices of optimizer step `step` (the order rule above)."""
        return global_batch_indices(step, global_batch, self.num_samples, seed)

    def __getitem__(self, i: int) -> np.ndarray:
        return self.get(i)

    def tokens(self, start: int, stop: int) -> np.ndarray:
        """Tokens [start, stop) of the split's concatenated stream as int64."""
        if not 0 <= start <= stop <= self.num_tokens:
            raise IndexError(f"token range [{start}, {stop}) outside [0, {self.num_tokens})")
        out = np.empty(stop - start, dtype=np.int64)
        k = int(np.searchsorted(self._ends, start, side="right"))
        pos = 0
        while pos < len(out):
            off = start + pos - int(self._starts[k])
            take = min(len(out) - pos, int(self._ends[k] - self._starts[k]) - off)
            out[pos: pos + take] = self._maps[k][off: off + take]
            pos += take
            k += 1
        return out

    def get(self, i: int) -> np.ndarray:
        """Sample i: int64 tokens [i*seq_len, i*seq_len + seq_len + 1)."""
        i = int(i)
        if not 0 <= i < self.num_samples:
            raise IndexError(f"sample {i} outside [0, {self.num_samples})")
        self.samples_read += 1
        return self.tokens(i * self.seq_len, i * self.seq_len + self.seq_len + 1)

    def get_many(self, indices: Any) -> np.ndarray:
        """Samples `indices` stacked: int64 [len(indices), seq_len + 1]."""
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        out = np.empty((len(idx), self.seq_len + 1), dtype=np.int64)
        for row, i in enumerate(idx):
            out[row] = self.get(int(i))
        return out

    def document_starts(self) -> np.ndarray:
        """Offsets in the split's token stream where documents begin (from the .docs.npy)."""
        parts = []
        for s, base in zip(self.shards, self._starts, strict=True):
            f = self.path / s.get("docs_file", s["file"][: -len(".bin")] + ".docs.npy")
            if not f.is_file():
                raise DataError(f"document offsets {str(f)!r} listed in index.json are missing")
            parts.append(np.load(f).astype(np.int64) + int(base))
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


# ----------------------------------------------------------------------------- order


@functools.lru_cache(maxsize=3)
def _permutation(seed: int, epoch: int, num_samples: int) -> np.ndarray:
    p = np.random.default_rng([seed, epoch]).permutation(num_samples)
    p.flags.writeable = False
    return p


def epoch_permutation(epoch: int, num_samples: int, seed: int) -> np.ndarray:
    """The order of all samples in `epoch`: `default_rng([seed, epoch]).permutation(n)`."""
    if seed < 0 or epoch < 0:
        raise ConfigError(f"seed ({seed}) and epoch ({epoch}) must be >= 0")
    return _permutation(int(seed), int(epoch), int(num_samples))


def global_batch_indices(step: int, global_batch: int, num_samples: int, seed: int
                         ) -> np.ndarray:
    """Sample indices of optimizer step `step`: positions [step*G, (step+1)*G) of the stream."""
    if num_samples < 1 or global_batch < 1 or step < 0:
        raise ConfigError(f"global_batch_indices: need step >= 0 (got {step}), global_batch "
                          f">= 1 (got {global_batch}) and num_samples >= 1 (got {num_samples})")
    pos = np.arange(step * global_batch, (step + 1) * global_batch, dtype=np.int64)
    epochs, offs = np.divmod(pos, num_samples)
    out = np.empty(global_batch, dtype=np.int64)
    for e in np.unique(epochs):
        m = epochs == e
        out[m] = epoch_permutation(int(e), num_samples, seed)[offs[m]]
    return out


def rank_batch_indices(step: int, global_batch: int, num_samples: int, seed: int,
                       dp_rank: int, dp_size: int) -> np.ndarray:
    """Data-parallel rank `dp_rank`'s contiguous slice [r*G/D, (r+1)*G/D) of step's batch."""
    if dp_size < 1 or not 0 <= dp_rank < dp_size:
        raise ConfigError(f"dp_rank = {dp_rank} must be in [0, dp_size = {dp_size})")
    if global_batch % dp_size:
        raise ConfigError(f"global batch {global_batch} is not divisible by the {dp_size} "
                          "data-parallel ranks")
    per = global_batch // dp_size
    g = global_batch_indices(step, global_batch, num_samples, seed)
    return g[dp_rank * per: (dp_rank + 1) * per]
