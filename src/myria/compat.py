"""Which torch this process runs on, against the one myria is developed and CI-tested on.

The CPU pin is torch 2.13.0 (pyproject.toml). GPU hosts often carry an older CUDA build (the
lent H100/H200 image has 2.11): myria imports and trains there, since every torch API it uses
exists from 2.11 on (checked by importing every module and every `from torch... import` name,
and the private hooks it relies on: DeviceMesh._flatten, distributed_c10d._set_pg_timeout,
the pipelining schedules, FSDP2's prefetch and gradient-sync methods, context_parallel).
`NEEDS_NEWER` names the features known to need a newer torch than 2.11 (found by running the
test suite under 2.11); the trainer prints `torch_note()` once at start-up when the running
torch is not the tested one.
"""

from __future__ import annotations

TESTED = (2, 13)     # the CPU pin; CI runs on it
MINIMUM = (2, 11)    # the oldest torch whose APIs myria's features all find
# feature -> the oldest torch it is known to run on, where that is newer than MINIMUM. zbv: on
# torch 2.11 the V-shaped zero-bubble schedule's stage set-up fails (gloo "Pair is not
# connected" in its first batched p2p; tests/parallel/test_layouts.py [pp2-zbv]); 2.12 untried.
NEEDS_NEWER: dict[str, tuple[int, int]] = {"parallel.schedule = 'zbv'": (2, 13)}


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
