"""A weighted mixture of prepared data directories (`data.sources`), and its order.

`data.sources = "data/web:0.7,data/code:0.3:2"` names prepared directories (`myria prepare`),
each with a weight and optionally an epoch limit (the most passes the run may make over it).
All sources must share one tokenizer.

The order is a pure function of (seed, step), like `myria.data.dataset`'s. Step t takes
C_k(t+1) - C_k(t) samples from source k, where C_k(t) is the largest-remainder apportionment of
t x G samples to the sources by their weights (ties to the earlier source): |C_k(t) - t G w_k| <
1 at every step, so each source's share is its weight to within one sample over any prefix of
the run; with G w_k >= 1 for every source (checked), C_k never decreases. Source k's n-th sample
is sample `perm_{k,e}[n mod N_k]`, epoch e = n // N_k, `perm_{k,e} = default_rng([seed, k + 1,
e]).permutation(N_k)`. A step's G samples are shuffled by `default_rng([seed, step])`;
data-parallel rank r takes the contiguous slice r of them, so the global batch never depends on
the number of ranks and a run resumed on another layout reads every token exactly once. Why a
closed form: docs/data.md, "Reasons behind the mixture module".
"""

from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np

from myria.data.dataset import TokenDataset
from myria.errors import ConfigError, DataError


@dataclass(frozen=True)
class Source:
    """One prepared directory of a mixture."""

    path: str
    weight: float
    epochs: int = 0          # at most this many passes over the source; 0 = no limit
    name: str = ""


def parse_sources(text: str) -> list[Source]:
    """`data.sources` ("PATH:WEIGHT[:EPOCHS],...") as Sources; ConfigError naming the entry."""
    out: list[Source] = []
    for entry in (e.strip() for e in text.split(",")):
        if not entry:
            continue
        parts = entry.rsplit(":", 2)
        # PATH:WEIGHT or PATH:WEIGHT:EPOCHS (a path may hold ':' only before those)
        if len(parts) == 3 and not _is_number(parts[1]):
            parts = [parts[0] + ":" + parts[1], parts[2]]
        if len(parts) < 2 or not parts[0]:
            raise ConfigError(f"data.sources entry {entry!r}: expected PATH:WEIGHT[:EPOCHS], "
                              "e.g. 'data/web:0.7,data/code:0.3:2'")
        path, weight = parts[0], parts[1]
        try:
            w = float(weight)
        except ValueError:
            raise ConfigError(f"data.sources entry {entry!r}: weight {weight!r} is not a "
                              "number") from None
        if not w > 0 or not np.isfinite(w):
            raise ConfigError(f"data.sources entry {entry!r}: weight {w} must be > 0 (to "
                              "leave a source out, remove its entry)")
        epochs = 0
        if len(parts) == 3:
            if not parts[2].isdigit():
                raise ConfigError(f"data.sources entry {entry!r}: epoch limit {parts[2]!r} must "
                                  "be a whole number >= 0 (0: no limit)")
            epochs = int(parts[2])
        out.append(Source(path, w, epochs, Path(path).name or path))
    if not out:
        raise ConfigError(f"data.sources = {text!r}: no source; expected PATH:WEIGHT[:EPOCHS],...")
    names = [s.name for s in out]
    dup = {n for n in names if names.count(n) > 1}
    if dup:
        raise ConfigError(f"data.sources names {sorted(dup)} more than once (sources are named "
                          "by their directory's name): use distinct directories")
    return out


def check_resume(old: str, new: str, step: int) -> None:
    """ConfigError when `data.sources` changes its mixture on resume from step `step`: other
    sources, order or weights. Each source's position is C_k(step) of the weights it runs with,
    counted from step 0 (the module docstring), so new weights would re-read some samples of a
    source and skip others. Paths (a moved directory of the same name) and epoch limits may
    change."""
    if not old or not new:
        return

    def mix(text: str) -> list[tuple[str, Fraction]]:
        src = parse_sources(text)
        return list(zip((s.name for s in src), _fractions([s.weight for s in src]),
                        strict=True))

    if mix(old) != mix(new):
        raise ConfigError(
            f"data.sources = {new!r}: the checkpoint of step {step} was trained on the mixture "
            f"{old!r}; a mixture cannot change its sources or weights on resume (each "
            "source's position is counted from step 0 with the weights it runs with: new "
            "weights would read some samples again and skip others). Keep the mixture, or "
            "train the new mixture in a new --run-dir from this one's weights (`myria export` "
            "then --model.init_from)")


def _is_number(text: str) -> bool:
    try:
        float(text)
        return True
    except ValueError:
        return False


def _fractions(weights: list[float]) -> list[Fraction]:
    total = sum(Fraction(str(w)) for w in weights)
    return [Fraction(str(w)) / total for w in weights]


def source_counts(step: int, global_batch: int, shares: list[Fraction]) -> np.ndarray:
    """C_k(step): samples taken from each source in steps [0, step) (largest remainder)."""
    n = step * global_batch
    exact = [n * s for s in shares]
    base = [int(x) for x in exact]          # floor (non-negative)
    rest = n - sum(base)
    order = sorted(range(len(shares)), key=lambda k: (-(exact[k] - base[k]), k))
    for k in order[:rest]:
        base[k] += 1
    return np.array(base, dtype=np.int64)


@functools.lru_cache(maxsize=16)
def _source_permutation(seed: int, source: int, epoch: int, n: int) -> np.ndarray:
    p = np.random.default_rng([seed, source + 1, epoch]).permutation(n)
    p.flags.writeable = False
    return p


class MixtureDataset:
    """Several TokenDatasets (one split each) read as one, in the mixture's order."""

    def __init__(self, sources: list[Source], seq_len: int, split: str = "train",
                 verify: bool = True) -> None:
        self.sources = sources
        self.parts = [TokenDataset(s.path, seq_len, split=split, verify=verify) for s in sources]
        first = self.parts[0]
        for s, p in zip(sources[1:], self.parts[1:], strict=True):
            for key in ("tokenizer_sha256", "eos_id", "vocab_size"):
                if p.index.get(key) != first.index.get(key):
                    raise DataError(
                        f"data.sources: {s.path!r} was prepared with another tokenizer than "
                        f"{sources[0].path!r} ({key} {p.index.get(key)!r} vs "
                        f"{first.index.get(key)!r}); prepare every source with the same "
                        "tokenizer (`myria prepare --tokenizer FIRST/tokenizer.json`)")
        self.seq_len, self.split = first.seq_len, split
        self.index, self.vocab_size, self.eos_id = first.index, first.vocab_size, first.eos_id
        self.shares = _fractions([s.weight for s in sources])
        sizes = np.array([p.num_samples for p in self.parts], dtype=np.int64)
        self.sizes = sizes
        self.offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
        self.num_samples = int(sizes.sum())
        self.num_tokens = sum(p.num_tokens for p in self.parts)

    @property
    def path(self) -> Path:
        return self.parts[0].path

    @property
    def tokenizer_path(self) -> Path:
        return self.parts[0].tokenizer_path

    @property
    def samples_read(self) -> int:
        return sum(p.samples_read for p in self.parts)

    @property
    def mean_document_tokens(self) -> float:
        """Mean document length of the token stream the mixture reads (share-weighted)."""
        per_token = sum(float(s) / p.mean_document_tokens
                        for s, p in zip(self.shares, self.parts, strict=True))
        return 1.0 / per_token

    def __len__(self) -> int:
        return self.num_samples

    def fingerprint(self, first: dict) -> dict:
        """The mixture's data fingerprint (`myria.data.fingerprint`): the first source's, with
        the data digest over every source's digest, weight and epoch limit."""
        from myria.data.fingerprint import fingerprint

        h = hashlib.sha256()
        for s in self.sources:
            h.update(json.dumps([s.name, s.weight, s.epochs,
                                 fingerprint(s.path)["data_sha256"]]).encode())
        return {**first, "data_sha256": h.hexdigest(),
                "path": ",".join(f"{s.path}:{s.weight}" for s in self.sources)}

    def check(self, global_batch: int, steps: int) -> None:
        """DataError for a mixture the run cannot read as asked: a source whose share of a
        step is below one sample, or one the run would read beyond its epoch limit."""
        for s, share in zip(self.sources, self.shares, strict=True):
            if share * global_batch < 1:
                raise DataError(f"data.sources: {s.name!r} has a share of {float(share):.4f}, "
                                f"under one of the {global_batch} sequences of a step; raise "
                                "its weight or training.global_batch")
        need = source_counts(steps, global_batch, self.shares)
        for s, want, n in zip(self.sources, need, self.sizes, strict=True):
            if s.epochs and want > s.epochs * n:
                raise DataError(
                    f"data.sources: {steps} steps read {want:,} samples of {s.name!r}, more than "
                    f"its epoch limit {s.epochs} x {n:,} samples; lower its weight or "
                    "training.steps, or raise the limit")

    def batch_indices(self, step: int, global_batch: int, seed: int) -> np.ndarray:
        """The mixture's sample indices (offset by source) of optimizer step `step`."""
        lo = source_counts(step, global_batch, self.shares)
        hi = source_counts(step + 1, global_batch, self.shares)
        picks = []
        for k, (a, b, n) in enumerate(zip(lo, hi, self.sizes, strict=True)):
            c = np.arange(a, b, dtype=np.int64)
            epochs, offs = np.divmod(c, n)
            local = np.empty(len(c), dtype=np.int64)
            for e in np.unique(epochs):
                m = epochs == e
                local[m] = _source_permutation(seed, k, int(e), int(n))[offs[m]]
            picks.append(local + self.offsets[k])
        out = np.concatenate(picks)
        return out[np.random.default_rng([seed, step]).permutation(len(out))]

    def source_of(self, indices: Any) -> np.ndarray:
        """The source index of each global sample index."""
        return np.searchsorted(self.offsets, np.asarray(indices), side="right") - 1

    def get_many(self, indices: Any) -> np.ndarray:
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        out = np.empty((len(idx), self.seq_len + 1), dtype=np.int64)
        src = self.source_of(idx)
        for row, (i, k) in enumerate(zip(idx, src, strict=True)):
            out[row] = self.parts[k].get(int(i - self.offsets[k]))
        return out


def open_dataset(data_cfg, seq_len: int, split: str = "train", verify: bool = True):
    """The training data of `[data]`: one directory (`path`) or a mixture (`sources`)."""
    if getattr(data_cfg, "sources", ""):
        return MixtureDataset(parse_sources(data_cfg.sources), seq_len, split, verify)
    return TokenDataset(data_cfg.path, seq_len, split=split, verify=verify)
