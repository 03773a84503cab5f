"""What a run trained on: a data directory's fingerprint, and the tokenizer kept with the run.

A data directory's fingerprint is two sha256 digests, cheap whatever its size, and the same for
the same inputs, options and seed (prepare is deterministic):

    tokenizer_sha256   of the bytes of its tokenizer.json
    data_sha256        of the identity its index.json gives the tokens: dtype, vocab size, EOS id
                       and, per split, every shard's (file, tokens, sha256); the shards are not
                       read (opening a TokenDataset checks them against the index)

Every checkpoint records it (meta.json's `data_fingerprint`), and the run keeps its tokenizer
(RUN_DIR/tokenizers/tokenizer-<sha256[:16]>.json): a resume on other data is refused in one line
unless `checkpoint.allow_data_change`, and generate and export decode with the tokenizer the
checkpoint was trained with. docs/data.md, "The data fingerprint".
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any

from myria.errors import CheckpointError, DataError

log = logging.getLogger("myria")
KEPT_DIR = "tokenizers"  # under RUN_DIR
META_KEY = "data_fingerprint"


def _sha256_bytes(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


def short(fp: dict[str, Any] | None) -> str:
    """`tokenizer 1a2b3c4d5e6f, data 0f9e8d7c6b5a` (12 hex digits each)."""
    if not fp:
        return "none recorded"
    return f"tokenizer {fp['tokenizer_sha256'][:12]}, data {fp['data_sha256'][:12]}"


def fingerprint(data_dir: str | Path) -> dict[str, Any]:
    """The fingerprint of prepared data directory `data_dir` (see the module docstring)."""
    from myria.data.dataset import load_index, tokenizer_sha256

    d = Path(data_dir)
    index = load_index(d)
    tok_sha = tokenizer_sha256(d, index)
    identity = {"dtype": index.get("dtype"), "vocab_size": index.get("vocab_size"),
                "eos_id": index.get("eos_id"),
                "splits": {name: [[s["file"], s["tokens"], s["sha256"]] for s in sp["shards"]]
                           for name, sp in sorted(index.get("splits", {}).items())}}
    return {"tokenizer_sha256": tok_sha,
            "data_sha256": _sha256_bytes(json.dumps(identity, sort_keys=True).encode()),
            "path": str(d.resolve())}


def kept_tokenizer_path(run_dir: str | Path, tokenizer_sha256: str) -> Path:
    """Where the run keeps the tokenizer with this sha256."""
    return Path(run_dir) / KEPT_DIR / f"tokenizer-{tokenizer_sha256[:16]}.json"


def keep_tokenizer(data_dir: str | Path, run_dir: str | Path, write: bool = True
                   ) -> dict[str, Any]:
    """The fingerprint of `data_dir`; with `write` (rank 0), a copy of its tokenizer in the run
    directory (written once, atomically) for generate and export. Goes into every checkpoint."""
    fp = fingerprint(data_dir)
    dest = kept_tokenizer_path(run_dir, fp["tokenizer_sha256"])
    fp["tokenizer_file"] = str(dest.relative_to(run_dir))
    if write and not dest.is_file():
        from myria.data.dataset import load_index

        src = Path(data_dir) / load_index(data_dir).get("tokenizer", "tokenizer.json")
        data = src.read_bytes()
        if _sha256_bytes(data) != fp["tokenizer_sha256"]:  # changed under our feet
            raise DataError(f"{str(src)!r} changed while the run was starting; is `myria "
                            "prepare` writing into it?")
        from myria.data.tokenizer import config_file

        try:
            dest.parent.mkdir(parents=True, exist_ok=True)
            # its tokenizer_config.json (special tokens, chat template) first: the
            # tokenizer's file marks both
            if config_file(src).is_file():
                _replace(config_file(dest), config_file(src).read_bytes())
            _replace(dest, data)
        except OSError as e:
            raise CheckpointError(f"cannot keep the run's tokenizer in {dest.parent}: "
                                  f"{e.strerror or e}") from None
    return fp


def _replace(dest: Path, data: bytes) -> None:
    tmp = dest.with_name(dest.name + f".tmp{os.getpid()}")
    tmp.write_bytes(data)
    os.replace(tmp, dest)


def recorded(ckpt: str | Path) -> dict[str, Any] | None:
    """The fingerprint a checkpoint recorded (None for checkpoints written before it was)."""
    try:
        meta = json.loads((Path(ckpt) / "meta.json").read_text())
    except (OSError, ValueError):
        return None  # the checkpoint manager reports unreadable manifests itself
    fp = meta.get(META_KEY)
    return fp if isinstance(fp, dict) and "tokenizer_sha256" in fp else None


def differs(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return (a["tokenizer_sha256"], a["data_sha256"]) != (b["tokenizer_sha256"], b["data_sha256"])


def check_resume(ckpt: str | Path, current: dict[str, Any], allow: bool = False,
                 announce: bool = True) -> None:
    """Refuse (DataError) to resume checkpoint `ckpt` on data whose fingerprint differs from the
    one it recorded, unless `allow`, which logs the change instead."""
    rec = recorded(ckpt)
    if rec is None or not differs(rec, current):
        return
    what = "tokenizer and tokens" if rec["tokenizer_sha256"] != current["tokenizer_sha256"] \
        else "tokens (same tokenizer)"
    msg = (f"{Path(ckpt).name} was trained on data {rec.get('path', '?')} ({short(rec)}) but "
           f"data.path {current['path']} now has {short(current)}: its {what} changed (was it "
           "re-prepared?)")
    if not allow:
        raise DataError(msg + "; restore that data, point --data.path at it, or pass "
                        "--allow-data-change (to `myria train` or `myria supervise`) to "
                        "continue training on the new data")
    if announce:
        log.warning("%s; continuing on the new data as allowed (checkpoint.allow_data_change)",
                    msg)


def checkpoint_tokenizer(run_dir: str | Path, ckpt: str | Path, override: str | Path | None = None
                         ) -> tuple[Path, str | None]:
    """The tokenizer.json checkpoint `ckpt` of `run_dir` was trained with, and a note for the
    user (or None).

    In order: `override` (checked against the recorded fingerprint), the copy kept in the run
    directory, the recorded data directory's tokenizer if its sha256 matches (checkpoints
    written before tokenizers were kept record none: then it is used unchecked, with a note).
    A tokenizer that differs from the recorded one, or none found, is a one-line error.
    """
    ckpt = Path(ckpt)
    rec = recorded(ckpt)
    try:
        meta = json.loads((ckpt / "meta.json").read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{ckpt / 'meta.json'} is unreadable: {e}") from None
    want = rec["tokenizer_sha256"] if rec else None
    if override is not None:
        p = Path(override)
        if not p.is_file():
            raise DataError(f"--tokenizer {str(p)!r}: no such file")
        got = _sha256_bytes(p.read_bytes())
        if want and got != want:
            raise DataError(f"--tokenizer {str(p)!r} (sha256 {got[:12]}) is not the tokenizer "
                            f"{ckpt.name} was trained with (sha256 {want[:12]})")
        return p, None
    data_path = meta.get("data_path") or (rec or {}).get("path")
    data_tok = Path(data_path) / "tokenizer.json" if data_path else None
    in_data = data_tok is not None and data_tok.is_file()
    if want:
        kept = kept_tokenizer_path(run_dir, want)
        if kept.is_file() and _sha256_bytes(kept.read_bytes()) == want:
            note = None
            if in_data and _sha256_bytes(data_tok.read_bytes()) != want:
                note = (f"note: {data_path} has another tokenizer now; using the one "
                        f"{ckpt.name} was trained with ({kept})")
            return kept, note
        if in_data:
            got = _sha256_bytes(data_tok.read_bytes())
            if got == want:
                return data_tok, None
            raise DataError(f"{ckpt.name} was trained with tokenizer {want[:12]} but {data_tok} "
                            f"is tokenizer {got[:12]} and the run's copy {kept} is missing; pass "
                            "--tokenizer PATH (the original tokenizer.json)")
        raise DataError(f"the tokenizer of {ckpt.name} (sha256 {want[:12]}) is not found: "
                        f"neither {kept} nor {data_tok} exists; pass --tokenizer PATH")
    if in_data:
        return data_tok, (f"note: {ckpt.name} records no tokenizer fingerprint (written by an "
                          f"older myria); using {data_tok} unchecked")
    raise DataError(f"the tokenizer of {ckpt.name} is not found: it names data path "
                    f"{data_path!r}, which has no tokenizer.json; pass --tokenizer PATH")
