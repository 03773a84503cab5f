"""`data.sources` as typed: its entries (`Source`) and each source's exact share of the
mixture. The data fingerprint (`myria.data.fingerprint`) and the mixture's order
(`myria.data.mixture`) both read them."""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

import numpy as np

from myria.errors import ConfigError


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
        if len(parts) == 3 and not is_number(parts[1]):
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
        if not np.isfinite(w):
            raise ConfigError(f"data.sources entry {entry!r}: weight {weight} must be a finite "
                              "number > 0")
        if not w > 0:
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


def is_number(text: str) -> bool:
    """Whether `text` reads as a float."""
    try:
        float(text)
        return True
    except ValueError:
        return False


def fractions_of(weights: list[float]) -> list[Fraction]:
    """Each weight's share of their sum, exactly (from each weight's decimal text)."""
    total = sum(Fraction(str(w)) for w in weights)
    return [Fraction(str(w)) / total for w in weights]


def shares_text(sources: list[Source]) -> list[str]:
    """The sources' shares of data.sources as exact fractions ("3/10"): the same for the same
    weights at any scale."""
    return [str(f) for f in fractions_of([s.weight for s in sources])]
