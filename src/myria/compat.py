"""Which torch this process runs on, against the one myria is developed and CI-tested on.

The CPU pin is torch 2.13.0 (pyproject.toml). GPU hosts often carry an older CUDA build (the
lent H100/H200 image has 2.11): myria imports and trains there, since every torch API it uses
exists from 2.11 on (checked by importing every module and every `from torch... import` name,
and the private hooks it relies on: DeviceMesh._flatten, distributed_c10d._set_pg_timeout,
the pipelining schedules, FSDP2's prefetch and gradient-sync methods, context_parallel).
`NEEDS_NEWER` names the features that need a newer torch than the running one; the trainer
prints `torch_note()` once at start-up when it has something to say.
"""

from __future__ import annotations

TESTED = (2, 13)     # the CPU pin; CI runs on it
MINIMUM = (2, 11)    # the oldest torch whose APIs myria's features all find
# feature -> the oldest torch it runs on, where that is newer than MINIMUM (none known today:
# fill in when a feature starts using an API newer than 2.11)
NEEDS_NEWER: dict[str, tuple[int, int]] = {}


def torch_version() -> tuple[int, int]:
    import torch

    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return int(major), int(minor)


def torch_note() -> str | None:
    """One line about the running torch when it is not the tested one, else None."""
    import torch

    v = torch_version()
    if v == TESTED:
        return None
    if v < MINIMUM:
        return (f"torch {torch.__version__}: myria needs torch >= {MINIMUM[0]}.{MINIMUM[1]} "
                f"(CI-tested on {TESTED[0]}.{TESTED[1]}); expect import or run-time errors")
    newer = [f"{name} (>= {a}.{b})" for name, (a, b) in NEEDS_NEWER.items() if v < (a, b)]
    return (f"torch {torch.__version__}: myria is CI-tested on {TESTED[0]}.{TESTED[1]}; "
            + (f"needs newer for: {', '.join(newer)}" if newer else
               "all its features' APIs are present on this version (docs/gpu.md)"))
