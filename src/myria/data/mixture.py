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

Phases (`data.phases`, "STEP:NAME=WEIGHT,...;..."): after S_j steps (from the step logged as
S_j + 1) the same sources run with other weights. C_k(t) = C_k(S_j) + the apportionment of
(t - S_j) x G by phase j's weights, for the last phase with S_j <= t: each source continues
where it stood, and within a phase each count is within one sample of its share of the phase's
samples. What was read before S_j does not depend on phase j, so a phase may be added on resume
from the next step on (`resolve_resume`: a resume whose data.sources has the same sources with
other weights is that).
"""

from __future__ import annotations

import bisect
import functools
import hashlib
import json
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np

from myria.data.dataset import TokenDataset
from myria.data.spec import Source, fractions_of, parse_sources, shares_text
from myria.errors import ConfigError, DataError


@dataclass(frozen=True)
class Schedule:
    """The shares of a mixture's sources from step 0 and from each phase's start on (steps
    counted as `batch_indices` counts them: a phase that starts at t is first read by the step
    logged as t + 1, after t steps)."""

    starts: tuple[int, ...]                    # 0, then each phase's start, increasing
    shares: tuple[tuple[Fraction, ...], ...]   # per start: each source's share

    def at(self, step: int) -> tuple[Fraction, ...]:
        """The shares step `step` reads with."""
        return self.shares[bisect.bisect_right(self.starts, step) - 1]

    def counts(self, step: int, global_batch: int) -> np.ndarray:
        """C_k(step): samples taken from each source in steps [0, step) (module docstring)."""
        done = np.zeros(len(self.shares[0]), dtype=np.int64)
        for j, (start, shares) in enumerate(zip(self.starts, self.shares, strict=True)):
            end = self.starts[j + 1] if j + 1 < len(self.starts) else None
            if end is not None and end <= step:
                done += source_counts(end - start, global_batch, list(shares))
            else:
                return done + source_counts(max(0, step - start), global_batch, list(shares))
        return done

    def before(self, step: int) -> list:
        """What steps [0, step) read by: each start before `step` (and 0) with its shares."""
        return [(st, sh) for st, sh in zip(self.starts, self.shares, strict=True)
                if st < step or st == 0]


def parse_phases(text: str, names: list[str]) -> list[tuple[int, dict[str, float]]]:
    """`data.phases` ("STEP:NAME=WEIGHT,...;...") as (first step, {source name: weight}), for
    a mixture of sources `names`. STEP is the first step of the phase as the logs count steps
    (from 1; the phase starts after STEP - 1 steps); each phase names every source once with a
    weight > 0; the steps increase from 2. ConfigError naming the phase."""
    out: list[tuple[int, dict[str, float]]] = []
    for entry in (e.strip() for e in text.split(";")):
        if not entry:
            continue
        step, sep, rest = entry.partition(":")
        where = f"data.phases entry {entry!r}"
        if not sep or not step.strip().isdigit():
            raise ConfigError(f"{where}: expected STEP:NAME=WEIGHT,... (e.g. "
                              f"'9001:{names[0]}=0.5,...'), STEP a whole number")
        weights: dict[str, float] = {}
        for item in (i.strip() for i in rest.split(",") if i.strip()):
            name, eq, w = item.rpartition("=")
            try:
                value = float(w)
            except ValueError:
                value = float("nan")
            if not eq or not value > 0 or not np.isfinite(value):
                raise ConfigError(f"{where}: {item!r} is not NAME=WEIGHT with a finite weight "
                                  "> 0")
            if name not in names or name in weights:
                raise ConfigError(f"{where}: {name!r} " + (
                    "is named twice" if name in weights else
                    f"is not a source of data.sources (its sources: {', '.join(names)})"))
            weights[name] = value
        if sorted(weights) != sorted(names):
            raise ConfigError(f"{where}: gives no weight to "
                              f"{', '.join(n for n in names if n not in weights)}; a phase "
                              "weighs every source of data.sources (a source cannot be "
                              "left out: its position would stop counting)")
        out.append((int(step), weights))
    steps = [st for st, _ in out]
    if any(b <= a for a, b in zip([1, *steps], steps)):
        raise ConfigError(f"data.phases = {text!r}: each phase's first step must be 2 or "
                          "later, and later than the phase before it (steps count from 1; "
                          "data.sources' own weights apply from step 1)")
    return out


def check_shares(sources: list[Source], sched: Schedule, global_batch: int) -> None:
    """DataError for a source whose share of a step is under one sample, in data.sources or
    a phase (its count could then stand still for a step and jump the next)."""
    for start, shares in zip(sched.starts, sched.shares, strict=True):
        for s, share in zip(sources, shares, strict=True):
            if share * global_batch < 1:
                where = "data.sources" if not start else f"data.phases (from step {start + 1})"
                raise DataError(f"{where}: {s.name!r} has a share of {float(share):.4f}, "
                                f"under one of the {global_batch} sequences of a step; "
                                "raise its weight or training.global_batch")


def check_mixture_config(data_cfg, global_batch: int, steps: int) -> str | None:
    """What of `[data]`'s mixture can be judged without its directories (a dry run on a
    planning machine): the phases' sources and steps and every share of a step; a note when
    a phase starts after training.steps (it applies only if the run is trained further)."""
    if not data_cfg.sources:
        return None
    src = parse_sources(data_cfg.sources)
    sched = schedule(src, data_cfg.phases)
    check_shares(src, sched, global_batch)
    late = [st + 1 for st in sched.starts[1:] if st >= steps]
    return (f"note: data.phases from step {', '.join(map(str, late))} start(s) after "
            f"training.steps = {steps}: applied only if the run is trained further") \
        if late else None


def format_phases(phases: list[tuple[int, dict[str, float]]]) -> str:
    """`parse_phases`' inverse."""
    return ";".join(f"{st}:" + ",".join(f"{n}={w!r}" for n, w in ws.items())
                    for st, ws in phases)


def schedule(sources: list[Source], phases_text: str = "") -> Schedule:
    """The Schedule of `data.sources` and `data.phases`."""
    names = [s.name for s in sources]
    phases = parse_phases(phases_text, names) if phases_text else []
    return Schedule((0, *(first - 1 for first, _ in phases)),
                    (tuple(fractions_of([s.weight for s in sources])),
                     *(tuple(fractions_of([ws[n] for n in names])) for _, ws in phases)))


def _read_before(sources_text: str, phases_text: str, step: int) -> list:
    """The sources' names and what steps [0, step) read by (`Schedule.before`)."""
    src = parse_sources(sources_text)
    return [[s.name for s in src], schedule(src, phases_text).before(step)]


def resolve_resume(old_sources: str, old_phases: str, new_sources: str, new_phases: str,
                   step: int) -> tuple[str, str, str | None]:
    """The data.sources and data.phases a run resuming after `step` steps reads with, and a
    line to say when they differ from what was typed: a resume that gives the same sources
    (by name) other weights and no phases of its own goes on with them from step `step` + 1,
    as a phase after the checkpoint's (the steps before keep the weights they were read with);
    anything else is taken as typed (and `check_resume` judges it)."""
    if not old_sources or not new_sources or new_phases:
        return new_sources, new_phases, None
    try:
        old, new = parse_sources(old_sources), parse_sources(new_sources)
        old_sch = schedule(old, old_phases)
    except ConfigError:
        return new_sources, new_phases, None   # check_resume says what is wrong
    if [s.name for s in old] != [s.name for s in new]:
        return new_sources, new_phases, None   # other sources: check_resume refuses them
    old_list = parse_phases(old_phases, [s.name for s in old]) if old_phases else []
    kept = [(first, ws) for first, ws in old_list if first <= step]
    later = [first for first, _ in old_list if first > step]
    dropped = (f"; the run's phase(s) from step {', '.join(map(str, later))} on are not in "
               "this config and are dropped (give data.phases to keep them)") if later else ""
    as_typed = f"data.sources: as typed from step {step + 1} on{dropped}" if later else None
    if _read_before(old_sources, old_phases, step) == _read_before(new_sources, "", step):
        return new_sources, new_phases, as_typed   # the same weights all along
    # the old sources' weights from step 1, with the new paths and epoch limits
    base = ",".join(f"{n.path}:{o.weight!r}" + (f":{n.epochs}" if n.epochs else "")
                    for o, n in zip(old, new, strict=True))
    new_shares = tuple(fractions_of([s.weight for s in new]))
    if old_sch.at(step) == new_shares:   # the phase in effect goes on
        return base, format_phases(kept), as_typed
    phases = format_phases([*kept, (step + 1, {s.name: s.weight for s in new})])
    return base, phases, (
        f"data.sources: the mixture's weights change from step {step + 1} on ("
        + ", ".join(f"{s.name} {float(w):.3g}" for s, w in zip(new, new_shares, strict=True))
        + f"), as a new phase: steps 1-{step} keep the weights they were read with "
        f"(data.phases = {phases!r})" + dropped)


def check_resume(old: str, new: str, step: int, old_phases: str = "",
                 new_phases: str = "") -> None:
    """ConfigError when the mixture changes what the `step` steps done read, on resume: other
    sources or order, other weights, or another phase starting by step `step` (each source's
    position is C_k(step), counted from step 0: module docstring). Phases from step `step` + 1
    on, paths (a moved directory of the same name) and epoch limits may change."""
    if not old or not new:
        return
    if _read_before(old, old_phases, step) != _read_before(new, new_phases, step):
        said = f"data.sources = {new!r}" + (f", data.phases = {new_phases!r}" if new_phases
                                              else "")
        hint = ""
        try:   # the phases that keep what was read and add the typed ones after it
            names = [s.name for s in parse_sources(old)]
            if [s.name for s in parse_sources(new)] == names and (old_phases or new_phases):
                both = ([p for p in parse_phases(old_phases, names) if p[0] <= step]
                        if old_phases else []) + \
                    ([p for p in parse_phases(new_phases, names) if p[0] > step]
                     if new_phases else [])
                if both:
                    hint = (f" (with data.sources = {old!r}: --data.phases="
                            f"'{format_phases(both)}')")
        except ConfigError:
            pass
        raise ConfigError(
            f"{said}: the checkpoint of step {step} was trained on the mixture {old!r}"
            + (f" with data.phases = {old_phases!r}" if old_phases else "")
            + "; on resume a mixture keeps its sources, and the weights of the steps already "
            "read (each source's position is counted from step 1: other weights for steps "
            f"1-{step} would read some samples again and skip others). New weights apply "
            "from the next step: give the same sources with new weights and no data.phases, "
            f"or the run's phases up to step {step} and yours from step {step + 1} on"
            + hint)


def fingerprint(sources: list[Source]) -> dict[str, Any]:
    """The data fingerprint (`myria.data.fingerprint`) of a mixture: the tokenizer's digest (one
    for every source), and the data digest over each source's data digest and share of
    data.sources in their order (what fixes the tokens each step reads, with the seed, the
    global batch and data.phases, which the config's resume rules compare); not the weights as
    typed, the paths or the epoch limits, which do not change the order. `sources` lists each
    source's name, share and directory fingerprint; `path` shows them as DIR:SHARE,..."""
    from myria.data import fingerprint as fp

    dirs = [fp.fingerprint(s.path) for s in sources]
    entries = [{"name": s.name, "share": share,
                **{k: d[k] for k in ("path", "data_sha256", "tokens", "shard_tokens")}}
               for s, share, d in zip(sources, shares_text(sources), dirs, strict=True)]
    digest = hashlib.sha256(json.dumps([[e["share"], e["data_sha256"]]
                                        for e in entries]).encode()).hexdigest()
    return {"tokenizer_sha256": dirs[0]["tokenizer_sha256"], "data_sha256": digest,
            "path": ",".join(f"{e['path']}:{float(Fraction(e['share'])):.4g}" for e in entries),
            "sources": entries}


def data_fingerprint(data_cfg) -> dict[str, Any]:
    """The data fingerprint of `[data]`: one directory's (`path`) or a mixture's (`sources`)."""
    if getattr(data_cfg, "sources", ""):
        return fingerprint(parse_sources(data_cfg.sources))
    from myria.data.fingerprint import fingerprint as dir_fingerprint

    return dir_fingerprint(data_cfg.path)


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
                 verify: bool = True, phases: str = "") -> None:
        self.sources = sources
        self.schedule = schedule(sources, phases)
        self.parts = [TokenDataset(s.path, seq_len, split=split, verify=verify) for s in sources]
        first = self.parts[0]
        for s, p in zip(sources[1:], self.parts[1:], strict=True):
            for key in ("tokenizer_sha256", "eos_id", "vocab_size"):
                if p.index.get(key) != first.index.get(key):
                    a, b = (str(x.index.get(key))[:12] if key == "tokenizer_sha256" else
                            repr(x.index.get(key)) for x in (p, first))
                    raise DataError(
                        f"data.sources: {s.path!r} was prepared with another tokenizer than "
                        f"{sources[0].path!r} ({key} {a} vs {b}); prepare every source with "
                        "the same tokenizer (`myria prepare --tokenizer FIRST/tokenizer.json`)")
        self.seq_len, self.split = first.seq_len, split
        self.index, self.vocab_size, self.eos_id = first.index, first.vocab_size, first.eos_id
        self.shares = list(self.schedule.shares[0])   # data.sources' own (validation's)
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
        """The mixture's data fingerprint (module `fingerprint`), with what `first` (the first
        source's, as `keep_tokenizer` gives it) adds to a directory's: the kept tokenizer."""
        return {**fingerprint(self.sources),
                **({"tokenizer_file": first["tokenizer_file"]} if "tokenizer_file" in first
                   else {})}

    def epochs(self, step: int, global_batch: int) -> np.ndarray:
        """The passes steps [0, step) make over each source (samples read / samples)."""
        return self.schedule.counts(step, global_batch) / self.sizes

    def check(self, global_batch: int, steps: int) -> None:
        """DataError for a mixture the run cannot read as asked: a source whose share of a
        step is below one sample, or one the run would read beyond its epoch limit."""
        check_shares(self.sources, self.schedule, global_batch)
        need = self.schedule.counts(steps, global_batch)
        for s, want, n in zip(self.sources, need, self.sizes, strict=True):
            if s.epochs and want > s.epochs * n:
                raise DataError(
                    f"data.sources: {steps} steps read {want:,} samples of {s.name!r}, more than "
                    f"its epoch limit {s.epochs} x {n:,} samples; lower its weight or "
                    "training.steps, or raise the limit")

    def batch_indices(self, step: int, global_batch: int, seed: int) -> np.ndarray:
        """The mixture's sample indices (offset by source) of optimizer step `step`."""
        lo = self.schedule.counts(step, global_batch)
        hi = self.schedule.counts(step + 1, global_batch)
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
        return MixtureDataset(parse_sources(data_cfg.sources), seq_len, split, verify,
                              getattr(data_cfg, "phases", ""))
    return TokenDataset(data_cfg.path, seq_len, split=split, verify=verify)
