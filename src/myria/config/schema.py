"""One field of a config schema: its default, one-line description, choices and lower bound.

Shared by the training config's sections and the simulator's run files, so both give the same
errors and the same `--help` text.
"""

from __future__ import annotations

from dataclasses import field
from typing import Any


def schema_field(default: Any, help: str, choices: tuple | None = None,
                 min: float | None = None, parse: Any = None):
    """A config field with its description, allowed choices and lower bound (the schema of
    both the training config and the simulator's run files); `parse(where, value)` turns a
    value of another TOML type into the field's (e.g. a list of tables into text)."""
    meta = {"help": help, "choices": choices, "min": min, "parse": parse}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)
