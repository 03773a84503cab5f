"""The MYRIA_DOCTOR_FAULT test hook (inert unless set): comma-separated faults, each
`kind[:rank=R][:fraction=F]`:

- `slow-gemm`  every timed GEMM sleeps so that it runs at `fraction` (default 0.25) of the
  expected throughput or of its own speed, whichever is lower: the throughput check fails;
- `wrong-gemm` every GEMM result gets one element perturbed: the correctness check fails.

Without `rank=` the fault applies to every local rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from myria.errors import ConfigError
from myria.faults import items

FAULT_ENV = "MYRIA_DOCTOR_FAULT"
# the same hook for one host only: a file in the host's own /dev/shm holding a spec (an
# emulated host's, written by `myria cluster fail-diagnostics`)
HOST_FAULT_FILE = "/dev/shm/myria-doctor-fault"


def host_fault() -> str:
    """The spec in this host's HOST_FAULT_FILE, or ""."""
    try:
        with open(HOST_FAULT_FILE) as fh:
            return fh.read().strip()
    except OSError:
        return ""
FAULT_KINDS = ("slow-gemm", "wrong-gemm")


@dataclass(frozen=True)
class DoctorFault:
    """One injected fault of the MYRIA_DOCTOR_FAULT test hook."""

    kind: str
    rank: int | None = None
    fraction: float = 0.25

    def applies(self, rank: int | None) -> bool:
        return self.rank is None or rank is None or self.rank == rank

    def describe(self) -> str:
        s = self.kind
        if self.rank is not None:
            s += f":rank={self.rank}"
        if self.kind == "slow-gemm" and self.fraction != 0.25:
            s += f":fraction={self.fraction:g}"
        return s


def parse_faults(text: str | None) -> list[DoctorFault]:
    """Parse MYRIA_DOCTOR_FAULT, e.g. `slow-gemm`, `wrong-gemm:rank=1,slow-gemm:rank=0`."""
    faults: list[DoctorFault] = []
    for item, kind, params in items(text, FAULT_KINDS, lambda item, kind: ConfigError(
            f"{FAULT_ENV}: unknown fault {kind!r} in {item!r}; known: {', '.join(FAULT_KINDS)}")):
        rank: int | None = None
        fraction = 0.25
        for p in params:
            key, _, value = p.partition("=")
            try:
                if key == "rank":
                    rank = int(value)
                    if rank < 0:
                        raise ValueError
                elif key == "fraction" and kind == "slow-gemm":
                    fraction = float(value)
                    if not 0 < fraction < 1:
                        raise ValueError
                else:
                    raise KeyError(key)
            except KeyError:
                raise ConfigError(f"{FAULT_ENV}: unknown parameter {key!r} in {item!r}; "
                                  "valid: rank=R" + (", fraction=F (0..1)"
                                                     if kind == "slow-gemm" else "")) from None
            except ValueError:
                raise ConfigError(f"{FAULT_ENV}: bad value {p!r} in {item!r} (rank: an integer "
                                  ">= 0, fraction: between 0 and 1)") from None
        faults.append(DoctorFault(kind, rank, fraction))
    return faults


def find_fault(faults: Sequence[DoctorFault], kind: str, rank: int | None) -> DoctorFault | None:
    for f in faults:
        if f.kind == kind and f.applies(rank):
            return f
    return None


