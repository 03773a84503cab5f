"""What a run trained on: a data directory's fingerprint, and the tokenizer kept with the run.

A data directory's fingerprint is two sha256 digests, cheap whatever its size, and the same for
the same inputs, options and seed (prepare is deterministic):

    tokenizer_sha256   of the bytes of its tokenizer.json
    data_sha256        of the identity its index.json gives the tokens: dtype, vocab size, EOS id
                       and, per split, every shard's (file, tokens, sha256); the shards are not
                       read (opening a TokenDataset checks them against the index)

with, to say what changed when they differ, the directory (`path`, resolved), the tokens of
each split and the shard size it was prepared with. A mixture's (`myria.data.mixture`) has one
such entry per source (`sources`) and digests the sources' data and shares in their order.

Every checkpoint records it (meta.json's `data_fingerprint`), and the run keeps its tokenizer
(RUN_DIR/tokenizers/tokenizer-<sha256[:16]>.json): a resume on other data is refused in one line
naming what changed unless `checkpoint.allow_data_change`, and generate and export decode with
the tokenizer the checkpoint was trained with. docs/data.md, "The data fingerprint".
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from fractions import Fraction
from pathlib import Path
from typing import Any

from myria.errors import CheckpointError, ConfigError, DataError

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
            "path": str(d.resolve()),
            "tokens": {name: sum(int(s["tokens"]) for s in sp["shards"])
                       for name, sp in sorted(index.get("splits", {}).items())},
            "shard_tokens": index.get("shard_tokens")}


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
    one it recorded, naming what changed (`change`), unless `allow`, which logs it instead."""
    rec = recorded(ckpt)
    if rec is None or not differs(rec, current):
        return
    typed = recorded_sources(ckpt)
    if typed and "sources" not in rec and _same_as_typed(rec, typed, current):
        return
    what, hint = change(rec, current, typed)
    msg = (f"{Path(ckpt).name} was trained on {_named(rec, typed)} ({short(rec)}) but "
           f"{_named(current)} has {short(current)}: {what}")
    if not allow:
        raise DataError(f"{msg}; {hint}, or pass --allow-data-change (to `myria train` or "
                        "`myria supervise`) to continue training on the new data")
    if announce:
        log.warning("%s; continuing on the new data as allowed (checkpoint.allow_data_change)",
                    msg)


def recorded_sources(ckpt: str | Path) -> str:
    """The data.sources checkpoint `ckpt` was trained with ("" for one data.path)."""
    try:
        data = json.loads((Path(ckpt) / "meta.json").read_text()).get("config", {}).get("data")
        return str(data.get("sources") or "") if isinstance(data, dict) else ""
    except (OSError, ValueError, AttributeError):
        return ""


def _is_mixture(fp: dict[str, Any], typed: str = "") -> bool:
    return "sources" in fp or bool(typed)


def _named(fp: dict[str, Any], typed: str = "") -> str:
    """`data.path DIR` or `data.sources DIR:SHARE,...` of a fingerprint."""
    return f"data.{'sources' if _is_mixture(fp, typed) else 'path'} {fp.get('path', '?')}"


def _same_as_typed(rec: dict[str, Any], typed: str, current: dict[str, Any]) -> bool:
    """A mixture fingerprint without `sources` digests each source's name, weight and epoch
    limit as typed in the checkpoint's data.sources (`typed`) with its data digest: the same
    data when that digest over the sources' data now matches and the shares are the same."""
    from myria.data.spec import parse_sources, shares_text

    now = {e["name"]: e for e in current.get("sources", [])}
    try:
        old = parse_sources(typed)
    except ConfigError:
        return False
    if [s.name for s in old] != list(now) or \
            shares_text(old) != [now[s.name]["share"] for s in old]:
        return False
    h = hashlib.sha256()
    for s in old:
        h.update(json.dumps([s.name, s.weight, s.epochs, now[s.name]["data_sha256"]]).encode())
    return h.hexdigest() == rec["data_sha256"]


def change(rec: dict[str, Any], cur: dict[str, Any], typed: str = "") -> tuple[str, str]:
    """What differs between recorded fingerprint `rec` and `cur` (they differ), and how to get
    the recorded data back: (reason, hint). `typed`: the checkpoint's data.sources ("" for one
    data.path), for a mixture fingerprint that lists no sources."""
    was_mix, is_mix = _is_mixture(rec, typed), _is_mixture(cur)
    if was_mix and not is_mix:
        return ("one data.path is read in another order than the mixture the run read"), \
            f"give --data.sources={typed or rec.get('path', '?')} as the run did"
    if is_mix and not was_mix:
        return ("a mixture reads its samples in another order than one data.path, even a "
                "mixture of one source: the run would read some samples again and skip "
                "others"), f"give --data.sources= --data.path={rec.get('path', '?')} as the run did"
    same_tok = rec["tokenizer_sha256"] == cur["tokenizer_sha256"]
    if not is_mix:
        return _dir_change(rec, cur, same_tok), _dir_hint(rec, rec, cur, "data.path")
    old, new = rec.get("sources"), cur["sources"]
    if old is None:
        return ("a source holds other tokens than it did, or the sources or their shares "
                "changed"), f"restore that data or give --data.sources={typed} as the run did"
    if [(e["name"], e["share"]) for e in old] != [(e["name"], e["share"]) for e in new]:
        return (f"other sources or shares ({_shares(new)}; the run read {_shares(old)})",
                f"give --data.sources={typed or rec.get('path', '?')} as the run did")
    moved = [(o, n) for o, n in zip(old, new, strict=True)
             if o["data_sha256"] != n["data_sha256"] or not same_tok]
    return ("; ".join(f"source {n['name']!r}: {_dir_change(o, n, same_tok)}" for o, n in moved),
            _dir_hint(rec, moved[0][0], moved[0][1],
                      f"source {moved[0][0]['name']!r} of data.sources"))


def _shares(entries: list[dict[str, Any]]) -> str:
    return ", ".join(f"{e['name']} {float(Fraction(e['share'])):.3g}" for e in entries)


def _dir_change(rec: dict[str, Any], cur: dict[str, Any], same_tokenizer: bool) -> str:
    """What differs between two directories' fingerprints, said from the evidence: the same
    directory re-prepared, or another directory; with another tokenizer, as many tokens per
    split in shards of another size, or other tokens."""
    if not same_tokenizer:
        detail = "another tokenizer, and so other tokens"
    elif _other_shards(rec, cur):
        detail = (f"as many tokens per split in shards of another size (--shard-tokens "
                  f"{cur.get('shard_tokens')}, was {rec.get('shard_tokens')}), which the "
                  "shards' digests cannot compare")
    else:
        counts = (rec.get("tokens") or {}).get("train"), (cur.get("tokens") or {}).get("train")
        detail = "other tokens of the same tokenizer" + (
            f" ({counts[1]:,} training tokens, were {counts[0]:,})"
            if None not in counts and counts[0] != counts[1] else "")
    if rec.get("path") == cur.get("path"):
        return f"it was re-prepared since, now with {detail}"
    return f"{cur.get('path')} is another directory than {rec.get('path')}, holding {detail}"


def _other_shards(rec: dict[str, Any], cur: dict[str, Any]) -> bool:
    """As many tokens per split, prepared with another shard size."""
    return rec.get("tokens") is not None and rec.get("tokens") == cur.get("tokens") and \
        rec.get("shard_tokens") != cur.get("shard_tokens")


def _dir_hint(rec: dict[str, Any], entry: dict[str, Any], cur: dict[str, Any], what: str
              ) -> str:
    """How to get back the data of `entry` (`rec` itself, or one of its sources; `cur` what
    is there now): the directory it was read from, when that still holds it; its shard size,
    when that is what differs."""
    path = entry.get("path")
    try:
        now = fingerprint(path) if path else None
    except DataError:
        now = None
    if now is not None and (now["tokenizer_sha256"], now["data_sha256"]) == (
            rec["tokenizer_sha256"], entry["data_sha256"]):
        return f"point {what} at {path}, which still holds that data"
    if _other_shards(entry, cur) and cur.get("path") == path:
        return (f"prepare {path} again with --shard-tokens {entry['shard_tokens']} (and the "
                "inputs and options it was prepared from)")
    return f"restore that data (in {path})" if path else "restore that data"


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
