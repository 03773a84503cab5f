"""Errors a user can cause: each names the field or file, the value seen and what is valid."""

from __future__ import annotations


class MyriaError(Exception):
    """Base of every error caused by user input; the CLI prints it without a traceback."""

    exit_code = 2


class ConfigError(MyriaError):
    """A config field is unknown, of the wrong type, out of range or inconsistent."""


class DataError(MyriaError):
    """A data path, shard, index or tokenizer is missing or damaged."""


class CheckpointError(MyriaError):
    """A checkpoint is missing, damaged or does not match the model."""


class OffloadError(MyriaError):
    """The offload directory is full, unwritable, or its files do not match the run."""


class LaunchError(MyriaError):
    """Workers could not be started or failed."""

    exit_code = 1


def first_line(text: object, width: int = 200) -> str:
    """The first line of `text` for a one-line message, cut at a word with " ..." past `width`
    characters (an error of torch or gloo can be many lines, or one very long one)."""
    import textwrap

    lines = str(text).strip().splitlines()
    return textwrap.shorten(lines[0], width, placeholder=" ...") if lines else ""
