"""Tokenizers: train myria's byte-level BPE, or use any Hugging Face tokenizer; encode documents.

A tokenizer is a plain HF `tokenizers.Tokenizer` (`tokenizer.json`). The one myria trains is a
BPE model with a ByteLevel pre-tokenizer and decoder, so every byte sequence round-trips, and one
special token, `<|endoftext|>`, the end of every document.

Any other tokenizer.json (a model's: Llama, Mistral, Qwen...) brings its special tokens in the
tokenizer_config.json beside it, as Hugging Face writes them (`bos_token`, `eos_token`,
`pad_token`; `Specials`). A document is encoded the way that model's tokenizer encodes a text
with its special tokens (its post-processor: Llama's adds the BOS in front, Qwen's adds none)
followed by the EOS, so the packed stream holds documents separated as the model saw them.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from myria.errors import DataError

EOS_TOKEN = "<|endoftext|>"
CHAT_TEMPLATE_FILE = "chat_template.jinja"   # where transformers saves a tokenizer's template

# The smallest useful vocabulary: the 256 byte symbols plus the EOS token.
MIN_VOCAB_SIZE = 257

# A text longer than this is encoded, and counted for tokenizer training, in pieces (`pieces`):
# `tokenizers` holds ~100 bytes per character of one input while it works on it (offsets, token
# strings, pre-tokenized words) and gives one input one thread, so a text file of 200 MB, one
# document, would need ~20 GB at once and one core.
PIECE_CHARS = 1 << 20
# Characters each side of a cut that `pieces` checks: far more than one pre-tokenized word.
_CUT_WINDOW = 256


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


def _batches(texts: Iterable[str], size: int = 256,
             chars: int = 4 * PIECE_CHARS) -> Iterator[list[str]]:
    """`texts` in lists of at most `size` texts or about `chars` characters."""
    batch: list[str] = []
    n = 0
    for t in texts:
        batch.append(t)
        n += len(t)
        if len(batch) == size or n >= chars:
            yield batch
            batch, n = [], 0
    if batch:
        yield batch


def _words(tok: Tokenizer, text: str) -> list[str]:
    """`text` as the tokenizer's normaliser and pre-tokenizer split it."""
    if tok.normalizer is not None:
        text = tok.normalizer.normalize_str(text)
    return [w for w, _ in tok.pre_tokenizer.pre_tokenize_str(text)]


def _cut_at(tok: Tokenizer, text: str, lo: int, hi: int) -> int | None:
    """A place in text[lo:hi] where the text can be cut without changing its words: after a line
    end, else before a space, between two non-space characters, where the words of the text
    around it are the words of its two sides (so no word spans it and nothing is added at the
    start of a text); None if there is none."""
    w = _CUT_WINDOW
    for sep, after in (("\n", 1), (" ", 0)):
        i = text.find(sep, lo, hi)
        tried = 0
        while i >= 0 and tried < 64:
            c, nxt = i + after, i + 1
            if 0 < i and nxt < len(text) and not text[i - 1].isspace() \
                    and not text[nxt].isspace():
                tried += 1
                a = max(0, c - w)
                if _words(tok, text[a:c + w]) == \
                        _words(tok, text[a:c]) + _words(tok, text[c:c + w]):
                    return c
            i = text.find(sep, i + 1, hi)
    return None


def pieces(tok: Tokenizer, text: str, size: int | None = None) -> list[str]:
    """`text` in pieces of `size` (default PIECE_CHARS) to 2 x `size` characters that
    the tokenizer encodes to the ids it gives the whole text, special tokens aside (`_cut_at`).
    A text is left whole when no place can be cut, when the tokenizer does not pre-tokenize (its
    model then sees the whole text), or when one of its added tokens holds a line end or a space
    (such a token could span a cut)."""
    size = size or PIECE_CHARS
    if len(text) <= size or tok.pre_tokenizer is None or any(
            "\n" in t.content or " " in t.content
            for t in tok.get_added_tokens_decoder().values()):
        return [text]
    out: list[str] = []
    start = 0
    while len(text) - start > 2 * size:
        c = _cut_at(tok, text, start + size, start + 2 * size)
        if c is None:
            break
        out.append(text[start:c])
        start = c
    out.append(text[start:])
    return out


def check_vocab_size(vocab_size: int, name: str = "vocab size") -> None:
    """DataError (naming the option `name`) for a size no byte-level BPE fits in."""
    if vocab_size < MIN_VOCAB_SIZE:
        raise DataError(f"{name} {vocab_size} is too small: a byte-level BPE needs at least "
                        f"{MIN_VOCAB_SIZE} (256 bytes + {EOS_TOKEN})")


def train_tokenizer(texts: Sequence[str] | Iterable[str], vocab_size: int,
                    min_frequency: int = 2, length: int | None = None) -> Tokenizer:
    """Train a byte-level BPE of at most `vocab_size` tokens (EOS included) on `texts`.

    The result may be smaller than `vocab_size` when the corpus has too few distinct merges.
    Training is deterministic for the same texts in the same order.
    """
    check_vocab_size(vocab_size)
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
    # pieces: the same words counted as in the whole texts, in bounded memory (cut with another
    # tokenizer: `tok` is not usable while it trains)
    cutter = new_tokenizer()
    tok.train_from_iterator(_batches(p for t in texts for p in pieces(cutter, t)),
                            trainer=trainer, length=length)
    return tok


def tokenizer_file(path: str | Path) -> Path:
    """The tokenizer.json a user named: the file itself, or the one in a model directory."""
    p = Path(path)
    return p / "tokenizer.json" if p.is_dir() else p


def load_tokenizer(path: str | Path) -> Tokenizer:
    """Load a `tokenizer.json` (or a model directory's), whole texts in and out (`whole`);
    DataError if missing or unreadable."""
    p = tokenizer_file(path)
    if not p.is_file():
        raise DataError(f"tokenizer file {str(p)!r} does not exist" + (
            f" ({str(Path(path))!r} is a directory without tokenizer.json)"
            if Path(path).is_dir() else ""))
    try:
        return whole(Tokenizer.from_file(str(p)))
    except Exception as e:  # tokenizers raises a bare Exception on bad JSON
        raise DataError(f"tokenizer file {str(p)!r} is not a valid tokenizer.json: {e}") from None


def whole(tok: Tokenizer) -> Tokenizer:
    """`tok` with the truncation and padding some tokenizer.json files carry turned off: a
    document is encoded whole (a fine-tuning tokenizer saved with truncation at 512 tokens
    would otherwise cut every document there)."""
    tok.no_truncation()
    tok.no_padding()
    return tok


def encode_limits(tok_path: str | Path) -> str | None:
    """What `whole` turns off in a tokenizer.json, in words; None when it has neither."""
    try:
        cfg = json.loads(tokenizer_file(tok_path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    said = []
    if isinstance(cfg.get("truncation"), dict):
        said.append(f"truncation at {cfg['truncation'].get('max_length')} tokens")
    if isinstance(cfg.get("padding"), dict):
        said.append("padding")
    return " and ".join(said) or None


@dataclass(frozen=True)
class Specials:
    """A tokenizer's special tokens: the document end (eos) always; beginning and padding
    when the tokenizer has them."""

    eos_token: str
    eos_id: int
    bos_token: str | None = None
    bos_id: int | None = None
    pad_token: str | None = None
    pad_id: int | None = None

    def config(self) -> dict[str, Any]:
        """tokenizer_config.json's special-token fields (what `read_specials` reads back)."""
        return {k: v for k, v in asdict(self).items() if k.endswith("_token") and v is not None}


def config_file(tok_path: str | Path) -> Path:
    """Where the tokenizer_config.json of a tokenizer file lives: beside tokenizer.json, or
    `NAME.config.json` beside any other name (the copies a run keeps)."""
    p = tokenizer_file(tok_path)
    return p.parent / "tokenizer_config.json" if p.name == "tokenizer.json" else \
        p.with_name(p.stem + ".config.json")


def read_config(tok_path: str | Path) -> dict[str, Any]:
    """The tokenizer_config.json of the tokenizer at `tok_path` (`config_file`; {} without
    one), with the chat template of a `chat_template.jinja` beside a tokenizer.json folded in as
    its `chat_template` field (transformers saves it as that file, and reads either): what a
    model's tokenizer carries beyond its vocabulary, kept through prepare, the run and export."""
    cfg_path = config_file(tok_path)
    cfg: dict[str, Any] = {}
    if cfg_path.is_file():
        try:
            cfg = json.loads(cfg_path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise DataError(f"{str(cfg_path)!r} is not valid JSON: {e}") from None
        if not isinstance(cfg, dict):
            raise DataError(f"{str(cfg_path)!r} is not a JSON object")
    template = cfg_path.parent / CHAT_TEMPLATE_FILE
    if cfg_path.name == "tokenizer_config.json" and template.is_file():
        try:
            cfg["chat_template"] = template.read_text()
        except UnicodeDecodeError as e:
            raise DataError(f"{str(template)!r} is not UTF-8 text: {e}") from None
    return cfg


def _token(value: Any) -> str | None:
    """A special token of tokenizer_config.json: a string, or {"content": ...} (older files)."""
    return value.get("content") if isinstance(value, dict) else value


def read_specials(tok_path: str | Path, tok: Tokenizer | None = None) -> Specials:
    """The special tokens of the tokenizer at `tok_path` from its tokenizer_config.json
    (`config_file`); without one, myria's `<|endoftext|>` as the EOS. DataError when the EOS is
    unknown or a named token is not in the vocabulary."""
    tok = tok or load_tokenizer(tok_path)
    cfg_path = config_file(tok_path)
    cfg = read_config(tok_path)
    names = {k: _token(cfg.get(f"{k}_token")) for k in ("eos", "bos", "pad")}
    if names["eos"] is None:
        if tok.token_to_id(EOS_TOKEN) is None:
            where = (f"no eos_token in {str(cfg_path)!r}" if cfg_path.is_file() else
                     f"no {cfg_path.name} beside it")
            raise DataError(f"tokenizer {str(tokenizer_file(tok_path))!r}: no end-of-document "
                            f"token known ({where} and no {EOS_TOKEN} in its vocabulary); "
                            "give the model directory with its tokenizer_config.json, or "
                            "write one naming eos_token")
        names["eos"] = EOS_TOKEN
    ids = {}
    for k, name in names.items():
        ids[k] = None if name is None else tok.token_to_id(name)
        if name is not None and ids[k] is None:
            raise DataError(f"{str(cfg_path)!r}: {k}_token {name!r} is not in the vocabulary "
                            f"of {str(tokenizer_file(tok_path))!r}")
    return Specials(names["eos"], int(ids["eos"]), names["bos"], ids["bos"], names["pad"],
                    ids["pad"])


def eos_id(tok: Tokenizer) -> int:
    """Id of myria's `<|endoftext|>` document separator."""
    i = tok.token_to_id(EOS_TOKEN)
    if i is None:
        raise DataError(f"tokenizer has no {EOS_TOKEN} token")
    return int(i)


def _encode_batch(tok: Tokenizer, texts: list[str], specials: bool) -> list[Any]:
    return tok.encode_batch_fast(texts, add_special_tokens=specials) \
        if hasattr(tok, "encode_batch_fast") else \
        tok.encode_batch(texts, add_special_tokens=specials)


def _specials_around(tok: Tokenizer) -> tuple[list[int], list[int]] | None:
    """The ids the post-processor puts before and after a text's own; None when it puts them
    elsewhere than at the two ends."""
    plain = tok.encode("a", add_special_tokens=False).ids
    full = tok.encode("a", add_special_tokens=True).ids
    for i in range(len(full) - len(plain) + 1):
        if full[i:i + len(plain)] == plain:
            return full[:i], full[i + len(plain):]
    return None


def _encode(tok: Tokenizer, texts: Sequence[str],
            eos: int) -> list[tuple[Sequence[int], int]]:
    """Each text's ids as the tokenizer encodes a whole text (its post-processor's special
    tokens included, e.g. a leading BOS), and 1 where the EOS must still follow (0 where the
    post-processor put it at the end already). A long text is encoded in `pieces`, a few
    million characters at a time, with the special tokens put around the whole."""
    cut = [pieces(tok, t) for t in texts]
    around = _specials_around(tok) if any(len(p) > 1 for p in cut) else None
    ids: list[Sequence[int] | None] = [None] * len(texts)
    one = [i for i, p in enumerate(cut) if len(p) == 1 or around is None]
    for i, e in zip(one, _encode_batch(tok, [texts[i] for i in one], True), strict=True):
        ids[i] = e.ids
    for i, p in enumerate(cut):
        if ids[i] is None and around is not None:
            parts = [np.asarray(around[0], dtype=np.uint32)]
            for group in _batches(p):
                parts += [np.asarray(e.ids, dtype=np.uint32)
                          for e in _encode_batch(tok, group, False)]
            parts.append(np.asarray(around[1], dtype=np.uint32))
            ids[i] = np.concatenate(parts)
    if tok.post_processor is None:
        return [(x, 1) for x in ids]
    return [(x, 0 if len(x) and x[-1] == eos else 1) for x in ids]


def encode_documents(tok: Tokenizer, texts: Sequence[str], dtype: np.dtype | type = np.uint32,
                     eos: int | None = None) -> list[np.ndarray]:
    """Token ids of each text followed by the EOS (`eos`, default `<|endoftext|>`), one array
    per text (multi-threaded encode)."""
    eos = eos_id(tok) if eos is None else eos
    out = []
    for ids, add in _encode(tok, texts, eos):
        a = np.empty(len(ids) + add, dtype=dtype)
        a[:len(ids)] = ids
        a[len(ids):] = eos
        out.append(a)
    return out


def decode(tok: Tokenizer, ids: Iterable[int]) -> str:
    """Text of token ids (special tokens included, so document boundaries stay visible)."""
    return tok.decode([int(i) for i in ids], skip_special_tokens=False)


def encode_packed(tok: Tokenizer, texts: Sequence[str], dtype: np.dtype | type = np.uint32,
                  eos: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Token ids of all `texts`, each followed by the EOS (`eos`, default `<|endoftext|>`),
    concatenated; and each text's length in tokens (EOS included)."""
    eos = eos_id(tok) if eos is None else eos
    docs = _encode(tok, texts, eos)
    lengths = np.fromiter((len(ids) + add for ids, add in docs), dtype=np.int64,
                          count=len(docs))
    out = np.empty(int(lengths.sum()), dtype=dtype)
    pos = 0
    for (ids, add), n in zip(docs, lengths.tolist(), strict=True):
        out[pos:pos + n - add] = ids
        out[pos + n - add:pos + n] = eos
        pos += n
    return out, lengths


# Encoding in worker processes (`myria prepare --workers N`): each loads the tokenizer once and
# encodes with one thread, so N processes use N cores without oversubscription.
_WORKER: dict[str, Any] = {}


def init_worker(tok_json: str, dtype: str, eos: int | None = None) -> None:
    os.environ["RAYON_NUM_THREADS"] = "1"
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _WORKER["tok"] = whole(Tokenizer.from_str(tok_json))
    _WORKER["dtype"] = np.dtype(dtype)
    _WORKER["eos"] = eos


def worker_encode(texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    return encode_packed(_WORKER["tok"], texts, _WORKER["dtype"], _WORKER["eos"])
