"""The checkpoints of one run directory on disk, without torch: their layout, manifests,
verification, commit, quarantine and retention.

Layout under RUN_DIR/checkpoints/:

    step_00000040/          a committed checkpoint
        .metadata, *.distcp DCP files (model + optimizer, resharded on load)
        rng_rank00000.json   each rank's RNG states
        offload/rank00000.part0.bin, .json  the nvme tier's optimizer state (parallel.offload =
                             nvme), hard-linked from the offload directory, not copied
        meta.json            the manifest, written last: step, scheduler, data position, layout,
                             every file's size and CRC-32
    step_00000060.<pid>-<id>@<host>.tmp/  a save in progress (never read), named after the
                             manager that writes it (rank 0's process), so that no other
                             writer (a new attempt, an abandoned save) ever touches it
    latest                   name of the newest checkpoint that verifies
    quarantine/step_00000120/  a checkpoint found damaged, moved aside with QUARANTINED.json
                             (the reason and when); never loaded, counted or deleted by myria
    suspect.json             checkpoints newer than the last clean compute check, before a fault
                             was found (`mark_suspect`): quarantined at the next resume

A checkpoint becomes visible only by the atomic rename of its temporary directory after its
manifest is written and fsynced (`commit`). Retention is by validity: after each commit the
newest `keep` checkpoints that verify are kept (a damaged one met on the way is quarantined,
not counted), and older ones are deleted only once `keep` newer verified ones exist, so the
newest loadable checkpoint is never deleted. A checkpoint this process wrote (its files
checksummed as written) or verified counts as verified after a size check; any other is
checksummed once.

The supervisor, `myria export`, preflight and `myria train`'s nothing-to-do check read
checkpoints through this module without importing torch; the save and load pipeline
(`myria.train.checkpoint.pipeline.CheckpointManager`) is a `CheckpointStore` too.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import time
from pathlib import Path

from myria.fsutil import atomic_write, file_crc32, fsync_dir, pid_alive

log = logging.getLogger("myria")
PREFIX = "step_"
QUARANTINE = "quarantine"
LATEST = "latest"
MANIFEST = "meta.json"
SUSPECT = "suspect.json"   # in checkpoints/: newer than a clean check, before a fault found
FRESH_START = "fresh_start.json"  # in quarantine/: damaged checkpoints a fresh start accepted
MANIFEST_VERSION = 2


def step_of(name: str) -> int:
    """The step of a checkpoint directory's name (step_00000200 -> 200); 0 for another name."""
    digits = name[len(PREFIX):]
    return int(digits) if name.startswith(PREFIX) and digits.isdigit() else 0


def verify_dir(path: Path, checksums: bool = True, part: tuple[int, int] = (0, 1)
               ) -> tuple[str | None, int]:
    """(None when `path` is complete and undamaged, else the reason; bytes checksummed).

    Sizes are always checked; with `checksums`, the CRC-32 of the files with index
    `i % part[1] == part[0]` (so that ranks can share the reading)."""
    read = 0
    try:
        meta = json.loads((path / MANIFEST).read_text())
    except (OSError, ValueError) as e:
        return f"meta.json unreadable ({e})", read
    for name, size in meta.get("files", {}).items():
        f = path / name
        if not f.exists():
            return f"{name} is missing", read
        if f.stat().st_size != size:
            return f"{name} has {f.stat().st_size} bytes, expected {size}", read
    sums = meta.get("checksums", {})
    if checksums:
        for i, name in enumerate(sorted(sums)):
            if i % part[1] != part[0]:
                continue
            crc, n = file_crc32(path / name)
            read += n
            if crc != sums[name]:
                return f"{name} fails its checksum (CRC-32 {crc}, manifest {sums[name]})", read
    return None, read


def free_bytes(path: Path) -> int | None:
    """Bytes an unprivileged writer may still use on the filesystem of `path` (or its parent)."""
    for p in (path, *path.parents):
        try:
            st = os.statvfs(p)
        except OSError:
            continue
        return st.f_bavail * st.f_frsize
    return None


def size_text(n: int | None) -> str:
    """`n` bytes in MiB or GiB, for messages."""
    if n is None:
        return "? MiB"
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def checkpoint_bytes(path: Path) -> int | None:
    """The bytes of a committed checkpoint, from its manifest."""
    try:
        return sum(json.loads((path / MANIFEST).read_text()).get("files", {}).values())
    except (OSError, ValueError, TypeError):
        return None


def mark_suspect(directory: Path, after: int, found_at: int, reason: str) -> None:
    """A fault found at step `found_at` may have been in the state since the last clean check
    at step `after`: the checkpoints newer than `after` are quarantined at the next resume
    (`CheckpointStore.quarantine_suspect`), whose rollback then goes to the newest verified
    clean one (rank 0)."""
    directory.mkdir(parents=True, exist_ok=True)
    atomic_write(directory / SUSPECT, json.dumps(
        {"after": after, "found_at": found_at, "reason": reason, "time": time.time()}))


class CheckpointStore:
    """Lists, verifies, commits, quarantines and prunes the checkpoints of one directory."""

    def __init__(self, directory: str | Path, keep: int = 3, faults=None,
                 timeout_s: float = 600.0):
        self.dir = Path(directory)
        self.keep = keep
        self.faults = faults
        self.timeout_s = timeout_s     # a save older than this on another host is abandoned
        self.verify_bytes = 0          # read by this process to verify checksums
        self._verified: set[str] = set()  # names this process wrote or checksummed
        # the name of this writer's temporary directories (the save pipeline agrees on rank 0's)
        self.token = f"{os.getpid()}-{os.urandom(4).hex()}@{socket.gethostname()}"

    def tmp_for(self, step: int) -> Path:
        """The temporary directory of this manager's save of `step`."""
        return self.dir / f"{PREFIX}{step:08d}.{self.token}.tmp"

    def remove_stale_tmp(self) -> list[Path]:
        """Remove the temporary directories of saves whose writer is gone (rank 0): a process
        of this host that no longer exists, or on another host one older than the save timeout
        (its collectives have failed by then). Another live writer's are left alone."""
        host, removed = socket.gethostname(), []
        for p in self.dir.glob(f"{PREFIX}*.tmp"):
            owner = p.name[:-len(".tmp")].partition(".")[2]
            pid, _, where = owner.partition("@")
            pid = pid.partition("-")[0]
            if where == host and pid.isdigit():
                stale = not pid_alive(int(pid))
            else:   # another host's, or a name without an owner
                try:
                    stale = time.time() - p.stat().st_mtime > self.timeout_s
                except OSError:
                    continue
            if stale:
                shutil.rmtree(p, ignore_errors=True)
                removed.append(p)
        return removed

    # -- listing ---------------------------------------------------------------------------
    def committed(self) -> list[Path]:
        """Committed checkpoints, oldest first (temporary directories excluded)."""
        out = [p for p in self._step_dirs() if (p / MANIFEST).exists()]
        return sorted(out, key=lambda p: step_of(p.name))

    def _step_dirs(self) -> list[Path]:
        """Every step_N directory here, with its manifest or not (temporary ones excluded)."""
        if not self.dir.is_dir():
            return []
        return [p for p in self.dir.iterdir()
                if p.is_dir() and p.name.startswith(PREFIX) and p.name[len(PREFIX):].isdigit()]

    def path_for(self, step: int) -> Path:
        return self.dir / f"{PREFIX}{step:08d}"

    def verify(self, path: Path, checksums: bool = True, part: tuple[int, int] = (0, 1)
               ) -> str | None:
        """None when `path` is complete and undamaged, else the reason.

        Sizes are always checked; with `checksums`, the CRC-32 of the files with index
        `i % part[1] == part[0]` (so that ranks can share the reading).
        """
        reason, read = verify_dir(path, checksums, part)
        self.verify_bytes += read
        return reason

    def latest_valid(self) -> Path | None:
        """The newest checkpoint that verifies (one process); damaged and incomplete ones
        (`quarantine_incomplete`) are quarantined, and then `latest` is pointed at the one
        returned (it names only one that verified). One that vanishes while verified (a live
        run's retention deleted it) is skipped."""
        moved = bool(self.quarantine_incomplete())
        chosen = None
        for p in reversed(self.committed()):
            reason = self.verify(p)
            if reason is None:
                self._verified.add(p.name)
                chosen = p
                break
            try:
                self.quarantine(p, reason)
            except FileNotFoundError:
                continue   # gone meanwhile: deleted by a live run's retention
            moved = True
        if moved:
            self.set_latest()
        return chosen

    def quarantine_suspect(self) -> int | None:
        """Quarantine the checkpoints `mark_suspect` named and forget the mark (rank 0): the
        step not to roll back past (None: no mark)."""
        f = self.dir / SUSPECT
        try:
            mark = json.loads(f.read_text())
        except (OSError, ValueError):
            return None
        after = int(mark["after"])
        for p in self.committed():
            if step_of(p.name) > after:
                self.quarantine(p, f"copied after the last clean check (step {after}) "
                                f"and before the fault found at step "
                                f"{mark['found_at']}: {mark['reason']}", accepted=True)
        self.set_latest()
        f.unlink()
        return after

    def abandon_after(self, step: int, why: str = "") -> None:
        """Move checkpoints newer than `step` aside (rank 0): an explicit older resume point
        (or a fresh start: `why` says which) starts a new timeline, and `latest`/retention
        must not jump back to the old one."""
        why = why or f"newer than the explicitly chosen resume point (step {step})"
        for p in self.committed():
            if step_of(p.name) > step:
                self.quarantine(p, f"{why}; kept aside, not damaged", accepted=True)
        self.set_latest()

    # -- quarantine and `latest` -------------------------------------------------------------
    def quarantine_incomplete(self) -> list[Path]:
        """Move aside the step directories without a manifest (rank 0); the moved ones. A save
        is written in a temporary directory and renamed only once complete, so a step directory
        without meta.json lost it afterwards (by hand, or the file system): it is neither loaded
        nor written over, but kept, as a damaged one."""
        moved = []
        for p in sorted(self._step_dirs()):
            if not (p / MANIFEST).exists():
                try:
                    moved.append(self.quarantine(p, f"its {MANIFEST} is missing, removed "
                                                 "after the commit"))
                except FileNotFoundError:
                    continue   # gone meanwhile: deleted by a live run's retention
        return moved

    def quarantine(self, path: Path, reason: str, accepted: bool = False) -> Path:
        """Move a checkpoint aside to quarantine/ with its reason (rank 0 only)."""
        qdir = self.dir / QUARANTINE
        qdir.mkdir(parents=True, exist_ok=True)
        dest = qdir / path.name
        n = 1
        while dest.exists():
            dest, n = qdir / f"{path.name}.{n}", n + 1
        os.replace(path, dest)
        fsync_dir(self.dir)
        atomic_write(dest / "QUARANTINED.json", json.dumps(
            {"reason": reason, "time": time.time(), "from": str(path),
             "accepted": accepted}, indent=1))
        self._verified.discard(path.name)
        if accepted:
            log.warning("moved checkpoint %s aside to %s: %s", path.name, dest, reason)
        else:
            log.warning("checkpoint %s is damaged (%s): moved to %s; it will not be loaded, "
                        "counted or deleted", path.name, reason, dest)
            self.detected(step_of(path.name), {"checkpoint": path.name, "reason": reason},
                          "quarantined")
        return dest

    def detected(self, step: int, evidence: dict, action: str) -> None:
        """A damaged checkpoint or a failed save, in the run's detections (rank 0): what the
        supervisor's summary counts a checkpoint fault's hook as caught by."""
        from myria import detections

        try:
            detections.record(self.dir.parent, "checkpoint", None, socket.gethostname(), step,
                              evidence, action)
        except OSError:
            pass   # a full disk may be why: the log line above says it all the same

    def quarantined(self) -> list[Path]:
        """Checkpoints moved aside, oldest first."""
        qdir = self.dir / QUARANTINE
        if not qdir.is_dir():
            return []
        return sorted((p for p in qdir.iterdir() if p.is_dir() and p.name.startswith(PREFIX)),
                      key=lambda p: p.name)

    def unaccepted_quarantine(self) -> list[Path]:
        """Damaged checkpoints that no fresh start has accepted yet."""
        accepted = set()
        f = self.dir / QUARANTINE / FRESH_START
        if f.exists():
            try:
                accepted = set(json.loads(f.read_text()).get("accepted", []))
            except (OSError, ValueError):
                pass
        out = []
        for p in self.quarantined():
            try:
                info = json.loads((p / "QUARANTINED.json").read_text())
            except (OSError, ValueError):
                info = {}
            if not info.get("accepted") and p.name not in accepted:
                out.append(p)
        return out

    def accept_fresh_start(self, damaged: list[Path]) -> None:
        f = self.dir / QUARANTINE / FRESH_START
        names = sorted({p.name for p in damaged} | set(
            json.loads(f.read_text()).get("accepted", []) if f.exists() else []))
        atomic_write(f, json.dumps({"accepted": names, "time": time.time()}, indent=1))
        log.warning("starting from step 0 as asked (checkpoint.start_fresh): the damaged "
                    "checkpoints %s stay in %s", ", ".join(p.name for p in damaged),
                    self.dir / QUARANTINE)

    @staticmethod
    def quarantine_reasons(paths: list[Path]) -> str:
        """'step_N (reason); ...' of quarantined checkpoints, from their QUARANTINED.json."""
        lines = []
        for p in paths:
            try:
                why = json.loads((p / "QUARANTINED.json").read_text())["reason"]
            except (OSError, ValueError, KeyError):
                why = "damaged"
            lines.append(f"{p.name} ({why})")
        return "; ".join(lines)

    def all_damaged_message(self, damaged: list[Path]) -> str:
        return (f"no checkpoint in {self.dir} can be loaded: every one is damaged and was moved "
                f"to {self.dir / QUARANTINE}: " + self.quarantine_reasons(damaged) + ". To go "
                "on, load one "
                "anyway with --resume-from PATH (or --checkpoint.resume_from=PATH), or train "
                "from step 0 with --start-fresh (--checkpoint.start_fresh=true)")

    def set_latest(self) -> None:
        """Point `latest` at the newest committed checkpoint, or remove it (rank 0)."""
        ckpts = self.committed()
        f = self.dir / LATEST
        if ckpts:
            if not f.exists() or f.read_text().strip() != ckpts[-1].name:
                atomic_write(f, ckpts[-1].name + "\n")
        elif f.exists():
            f.unlink()

    def commit(self, tmp: Path, final: Path, meta: dict, step: int) -> None:
        """Write the manifest `meta` into the temporary directory `tmp`, rename it to `final`,
        point `latest` at it and prune (rank 0, once every rank's files are written)."""
        atomic_write(tmp / MANIFEST, json.dumps(meta, indent=1))
        fsync_dir(tmp)
        if self.faults is not None and (f := self.faults.due("corrupt-checkpoint", step)):
            # after its checksums are in the manifest, before it becomes visible: a process
            # killed after the commit can no longer leave it undamaged
            self.faults.mark(f)
            self._corrupt(tmp)
        from myria.rundir import fence_guard

        with fence_guard(self.dir.parent):  # a worker of a superseded round commits nothing
            old = None
            if final.exists() and not (final / MANIFEST).exists():
                self.quarantine(final, f"its {MANIFEST} is missing, removed after the commit")
            if final.exists():  # a step saved again after resuming from an older checkpoint
                old = final.with_name(final.name + f".old{os.getpid()}")
                os.replace(final, old)
            os.replace(tmp, final)
            fsync_dir(self.dir)
            self._verified.add(final.name)  # every file was checksummed as it was written
            atomic_write(self.dir / LATEST, final.name + "\n")
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        self.prune()

    def _corrupt(self, path: Path) -> None:
        """Flip bytes in the middle of the largest shard (silent corruption, same size)."""
        victim = max((q for q in path.iterdir() if q.suffix == ".distcp"),
                     key=lambda q: q.stat().st_size)
        with open(victim, "r+b") as fh:
            fh.seek(victim.stat().st_size // 2)
            b = fh.read(16)
            fh.seek(victim.stat().st_size // 2)
            fh.write(bytes(x ^ 0xFF for x in b))
            fh.flush()
            os.fsync(fh.fileno())
        log.warning("injected fault: corrupted %s (16 bytes flipped)", victim)

    def prune(self) -> None:
        """Keep the newest `keep` checkpoints that verify; quarantine damaged ones (rank 0)."""
        valid = 0
        for p in reversed(self.committed()):
            if valid >= self.keep:
                shutil.rmtree(p, ignore_errors=True)
                continue
            reason = self.verify(p, checksums=p.name not in self._verified)
            if reason is not None:
                self.quarantine(p, reason)
                continue
            self._verified.add(p.name)
            valid += 1
        self.set_latest()


def describe_error(e: BaseException) -> str:
    """One line for an exception; DCP's CheckpointException gives its first rank's cause."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        cause = next(iter(failures.values()))
        if isinstance(cause, tuple):
            cause = cause[0]
        if isinstance(cause, BaseException):
            e = cause
    return f"{type(e).__name__}: " + " ".join(str(e).split())   # messages span lines too
