"""A check's outcome and a host's report.

Statuses: `pass`; `fail` (a fault this host is to be blamed for: a wrong result, a crash, a
figure far below its peers' or below a configured or datasheet figure); `warn` (below its own
measured history with nothing to compare it with, or with every peer just as low: a busy host,
reported with the evidence, never acted on); `skip` (not applicable here).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from myria import rundir
from myria.fsutil import atomic_write

DEFAULT_TOLERANCE = 0.5
# Check names in report order.
CHECKS = ("gemm-correctness", "golden", "gemm-throughput", "memory-bandwidth", "all-reduce",
          "all-to-all", "all-gather", "reduce-scatter", "p2p-loopback", "neighbor-all-reduce",
          "workers")
# Checks whose failure is a figure below its expectation (the data were right).
PERFORMANCE_CHECKS = ("gemm-throughput", "memory-bandwidth")


@dataclass
class Check:
    """One check's outcome; `rank` is the local rank, or None for a host-wide check."""

    name: str
    status: str                    # "pass" | "warn" | "fail" | "skip"
    reason: str
    rank: int | None = None
    measured: float | None = None
    expected: float | None = None
    unit: str = ""
    details: dict[str, Any] = field(default_factory=dict)

    @property
    def failed(self) -> bool:
        return self.status == "fail"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class HostReport:
    """All checks of one host; the host passes when no check failed."""

    host: str
    nproc: int
    device: str
    backend: str
    dtype: str
    checks: list[Check]
    expected: dict[str, float | None] = field(default_factory=dict)
    expected_sources: dict[str, str] = field(default_factory=dict)
    tolerance: float = DEFAULT_TOLERANCE
    faults: list[str] = field(default_factory=list)
    neighbors: list[str] = field(default_factory=list)
    started_at: str = ""
    duration_s: float = 0.0
    versions: dict[str, str] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return bool(self.checks) and not any(c.failed for c in self.checks)

    @property
    def failures(self) -> list[Check]:
        return [c for c in self.checks if c.failed]

    @property
    def warnings(self) -> list[Check]:
        return [c for c in self.checks if c.status == "warn"]

    @property
    def counts(self) -> str:
        n_pass = sum(c.status == "pass" for c in self.checks)
        n_skip = sum(c.status == "skip" for c in self.checks)
        warn = f"{len(self.warnings)} warned, " if self.warnings else ""
        return (f"{n_pass} passed, {warn}{len(self.failures)} failed, {n_skip} skipped "
                f"in {self.duration_s:.1f} s")

    @property
    def performance_only(self) -> bool:
        """Every failure is a throughput figure (no wrong result, no crashed or hung rank)."""
        return all(c.name in PERFORMANCE_CHECKS or
                   (c.details or {}).get("correct") is True for c in self.failures)

    @property
    def summary(self) -> str:
        """One line: host, PASS/FAIL, counts, and the failed checks with their reasons."""
        head = f"{self.host}: {'PASS' if self.passed else 'FAIL'} ({self.counts})"
        if not self.checks:
            return head + ": no check ran"
        shown = self.failures + self.warnings
        if not shown:
            return head
        return head + ": " + "; ".join(f"{label(c)} ({c.status}): {c.reason}" for c in shown)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["passed"] = self.passed
        d["summary"] = self.summary
        return d

    def to_json(self, indent: int | None = 1) -> str:
        return json.dumps(rundir.json_safe(self.to_dict()), indent=indent)

    def write_json(self, path: str | Path) -> Path:
        """Write the report atomically (temporary file + rename); returns the path."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, self.to_json() + "\n", durable=False)
        return path

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> HostReport:
        d = dict(d)
        d.pop("passed", None)
        d.pop("summary", None)
        d["checks"] = [Check(**c) for c in d.get("checks", [])]
        return cls(**d)


def label(c: Check) -> str:
    return c.name if c.rank is None else f"{c.name}[rank {c.rank}]"


def pct(frac: float) -> str:
    return f"{frac:.1%}" if frac < 1 else f"{frac:.0%}"


def fmt(x: float | None) -> str:
    if x is None:
        return "-"
    if x == 0 or not math.isfinite(x):
        return str(x)
    if abs(x) >= 1000:
        return f"{x:.0f}"
    return f"{x:.4g}" if abs(x) >= 1 else f"{x:.3g}"


