"""Byte-level BPE tokenizer: train one with HF `tokenizers`, load it, encode documents with EOS.

The tokenizer is a plain HF `tokenizers.Tokenizer` (saved as `tokenizer.json`): a BPE model with
a ByteLevel pre-tokenizer and decoder, so every byte sequence round-trips, and one special token,
`<|endoftext|>`, which `myria prepare` appends after every document as the separator.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from myria.errors import DataError

EOS_TOKEN = "<|endoftext|>"

# The smallest useful vocabulary: the 256 byte symbols plus the EOS token.
MIN_VOCAB_SIZE = 257


def set_threads(workers: int) -> None:
    """Limit the threads `tokenizers` uses (training and encode_batch); 0 leaves its default.

    Must run before the first parallel call of `tokenizers` in this process (its thread pool
    reads RAYON_NUM_THREADS once).
    """
    if workers > 0:
        os.environ["RAYON_NUM_THREADS"] = str(workers)
        os.environ["TOKENIZERS_PARALLELISM"] = "false" if workers == 1 else "true"


def new_tokenizer() -> Tokenizer:
    """An untrained byte-level BPE tokenizer."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    return tok


def _batches(texts: Iterable[str], size: int = 256) -> Iterator[list[str]]:
    batch: list[str] = []
    for t in texts:
        batch.append(t)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def train_tokenizer(texts: Sequence[str] | Iterable[str], vocab_size: int,
                    min_frequency: int = 2, length: int | None = None) -> Tokenizer:
    """Train a byte-level BPE of at most `vocab_size` tokens (EOS included) on `texts`.

    The result may be smaller than `vocab_size` when the corpus has too few distinct merges.
    Training is deterministic for the same texts in the same order.
    """
    if vocab_size < MIN_VOCAB_SIZE:
        raise DataError(f"vocab size {vocab_size} is too small: a byte-level BPE needs at least "
                        f"{MIN_VOCAB_SIZE} (256 bytes + {EOS_TOKEN})")
    tok = new_tokenizer()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    if length is None and isinstance(texts, Sequence):
        length = len(texts)
    tok.train_from_iterator(_batches(texts), trainer=trainer, length=length)
    return tok


def load_tokenizer(path: str | Path) -> Tokenizer:
    """Load a `tokenizer.json`; DataError if it is missing, unreadable or lacks the EOS token."""
    p = Path(path)
    if not p.is_file():
        raise DataError(f"tokenizer file {str(p)!r} does not exist")
    try:
        tok = Tokenizer.from_file(str(p))
    except Exception as e:  # tokenizers raises a bare Exception on bad JSON
        raise DataError(f"tokenizer file {str(p)!r} is not a valid tokenizer.json: {e}") from None
    if tok.token_to_id(EOS_TOKEN) is None:
        raise DataError(f"tokenizer {str(p)!r} has no {EOS_TOKEN} token; myria separates "
                        f"documents with it (add it as a special token or let `myria prepare` "
                        "train a tokenizer)")
    return tok


def eos_id(tok: Tokenizer) -> int:
    """Id of the `<|endoftext|>` document separator."""
    i = tok.token_to_id(EOS_TOKEN)
    if i is None:
        raise DataError(f"tokenizer has no {EOS_TOKEN} token")
    return int(i)


def encode_documents(tok: Tokenizer, texts: Sequence[str], dtype: np.dtype | type = np.uint32
                     ) -> list[np.ndarray]:
    """Token ids of each text followed by EOS, one array per text (multi-threaded encode)."""
    eos = eos_id(tok)
    encs = tok.encode_batch_fast(list(texts), add_special_tokens=False) \
        if hasattr(tok, "encode_batch_fast") else \
        tok.encode_batch(list(texts), add_special_tokens=False)
    out = []
    for e in encs:
        ids = np.empty(len(e.ids) + 1, dtype=dtype)
        ids[:-1] = e.ids
        ids[-1] = eos
        out.append(ids)
    return out


def decode(tok: Tokenizer, ids: Iterable[int]) -> str:
    """Text of token ids (special tokens included, so document boundaries stay visible)."""
    return tok.decode([int(i) for i in ids], skip_special_tokens=False)


def encode_packed(tok: Tokenizer, texts: Sequence[str], dtype: np.dtype | type = np.uint32
                  ) -> tuple[np.ndarray, np.ndarray]:
    """Token ids of all `texts`, each followed by EOS, concatenated; and each text's length in
    tokens (EOS included)."""
    eos = eos_id(tok)
    encs = tok.encode_batch_fast(list(texts), add_special_tokens=False) \
        if hasattr(tok, "encode_batch_fast") else \
        tok.encode_batch(list(texts), add_special_tokens=False)
    lengths = np.fromiter((len(e.ids) + 1 for e in encs), dtype=np.int64, count=len(encs))
    out = np.empty(int(lengths.sum()), dtype=dtype)
    pos = 0
    for e, n in zip(encs, lengths.tolist(), strict=True):
        out[pos:pos + n - 1] = e.ids
        out[pos + n - 1] = eos
        pos += n
    return out, lengths


# Encoding in worker processes (`myria prepare --workers N`): each loads the tokenizer once and
# encodes with one thread, so N processes use N cores without oversubscription.
_WORKER: dict[str, Any] = {}


def init_worker(tok_json: str, dtype: str) -> None:
    os.environ["RAYON_NUM_THREADS"] = "1"
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _WORKER["tok"] = Tokenizer.from_str(tok_json)
    _WORKER["dtype"] = np.dtype(dtype)


def worker_encode(texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    return encode_packed(_WORKER["tok"], texts, _WORKER["dtype"])
