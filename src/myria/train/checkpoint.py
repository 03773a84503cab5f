"""Distributed checkpoints: DCP shards written to a temporary directory, committed by rename.

Layout under RUN_DIR/checkpoints/:

    step_00000040/          a committed checkpoint
        .metadata, *.distcp DCP files (model + optimizer, resharded on load)
        rng_rank00000.json   each rank's RNG states
        meta.json            step, scheduler, data position, layout, file sizes; written last
    step_00000060.tmp/       a save in progress (never read)
    latest                   name of the newest committed checkpoint

A save writes everything into `step_N.tmp`, then rank 0 writes meta.json, renames the directory
to `step_N` (atomic on POSIX) and replaces `latest` (write + rename). A failed save removes its
temporary directory and leaves older checkpoints untouched. Loading reads only tensors and JSON
(DCP's loader executes nothing from the checkpoint).
"""

from __future__ import annotations

import base64
import errno
import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from myria.errors import CheckpointError

log = logging.getLogger("myria")
PREFIX = "step_"


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass


def rng_state() -> dict[str, str]:
    states = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state()
    return {k: base64.b64encode(v.numpy().tobytes()).decode() for k, v in states.items()}


def set_rng_state(states: dict[str, str]) -> None:
    for k, v in states.items():
        t = torch.frombuffer(bytearray(base64.b64decode(v)), dtype=torch.uint8)
        if k == "cpu":
            torch.set_rng_state(t)
        elif k == "cuda" and torch.cuda.is_available():
            torch.cuda.set_rng_state(t)


def _world() -> tuple[int, int]:
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _all_ok(ok: bool) -> bool:
    if not dist.is_initialized():
        return ok
    t = torch.tensor([1 if ok else 0], dtype=torch.int32)
    if dist.get_backend() == "nccl":
        t = t.cuda()
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item())


class CheckpointManager:
    """Saves, lists, prunes and loads the checkpoints of one run directory."""

    def __init__(self, directory: str | Path, keep: int = 3, faults=None):
        self.dir = Path(directory)
        self.keep = keep
        self.faults = faults

    # -- listing ---------------------------------------------------------------------------
    def committed(self) -> list[Path]:
        """Committed checkpoints, oldest first (temporary directories excluded)."""
        if not self.dir.is_dir():
            return []
        out = [p for p in self.dir.iterdir()
               if p.is_dir() and p.name.startswith(PREFIX) and not p.name.endswith(".tmp")
               and (p / "meta.json").exists()]
        return sorted(out, key=lambda p: int(p.name[len(PREFIX):]))

    def path_for(self, step: int) -> Path:
        return self.dir / f"{PREFIX}{step:08d}"

    def verify(self, path: Path) -> str | None:
        """None when `path` is complete and undamaged, else the reason."""
        try:
            meta = json.loads((path / "meta.json").read_text())
        except (OSError, ValueError) as e:
            return f"meta.json unreadable ({e})"
        for name, size in meta.get("files", {}).items():
            f = path / name
            if not f.exists():
                return f"{name} is missing"
            if f.stat().st_size != size:
                return f"{name} has {f.stat().st_size} bytes, expected {size}"
        return None

    def latest_valid(self) -> Path | None:
        """The newest checkpoint that verifies; damaged ones are skipped with a warning."""
        for p in reversed(self.committed()):
            reason = self.verify(p)
            if reason is None:
                return p
            log.warning("skipping checkpoint %s: %s", p, reason)
        return None

    # -- saving ----------------------------------------------------------------------------
    def save(self, step: int, target, extra: dict[str, Any]) -> bool:
        """Save and commit `target.state_dict()` as the checkpoint of `step` (collective).

        `target` is anything with `state_dict()` returning {"model": {...}, "optim": {...}}
        (the Engine); `extra` is JSON-serialisable state stored in meta.json. Returns False if
        the save failed (the previous checkpoint is then untouched).
        """
        rank, world = _world()
        final = self.path_for(step)
        tmp = final.with_name(final.name + ".tmp")
        ok = True
        err: Exception | None = None
        try:
            if self.faults is not None and (f := self.faults.due("diskfull", step)):
                self.faults.mark(f)
                raise OSError(errno.ENOSPC, "No space left on device (injected fault)")
            dcp.save(target.state_dict(), checkpoint_id=str(tmp))
            _atomic_write(tmp / f"rng_rank{rank:05d}.json", json.dumps(rng_state()))
        except Exception as e:  # a failed save must not end training
            ok, err = False, e
        ok = _all_ok(ok)
        if ok and rank == 0:
            try:
                files = {p.name: p.stat().st_size for p in tmp.iterdir() if p.is_file()}
                meta = dict(extra, step=step, world_size=world, files=files)
                _atomic_write(tmp / "meta.json", json.dumps(meta, indent=1))
                _fsync_dir(tmp)
                if final.exists():
                    shutil.rmtree(final)
                os.replace(tmp, final)
                _fsync_dir(self.dir)
                _atomic_write(self.dir / "latest", final.name + "\n")
                self._prune()
            except Exception as e:
                ok, err = False, e
        if not ok:
            if rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            if err is not None:
                log.error("checkpoint of step %d failed on rank %d: %s; the previous checkpoint"
                          " is kept and training continues", step, rank, err)
            return False
        if rank == 0 and self.faults is not None and (
                f := self.faults.due("corrupt-checkpoint", step)):
            self.faults.mark(f)
            self._corrupt(final)
        return True

    def _corrupt(self, path: Path) -> None:
        victim = max((p for p in path.iterdir() if p.suffix == ".distcp"),
                     key=lambda p: p.stat().st_size)
        with open(victim, "r+b") as fh:
            fh.truncate(max(0, victim.stat().st_size // 2))
        log.warning("injected fault: truncated %s", victim)

    def _prune(self) -> None:
        ckpts = self.committed()
        for p in ckpts[:-self.keep]:
            shutil.rmtree(p, ignore_errors=True)
        for p in self.dir.glob(f"{PREFIX}*.tmp"):
            shutil.rmtree(p, ignore_errors=True)

    # -- loading ---------------------------------------------------------------------------
    def check_shapes(self, path: Path, model_sd: dict[str, torch.Tensor]) -> None:
        """Raise CheckpointError listing keys whose presence or shape differ from the model."""
        md = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
        saved = {k[len("model."):]: tuple(v.size) for k, v in md.items()
                 if k.startswith("model.") and hasattr(v, "size")}
        want = {k: tuple(v.shape) for k, v in model_sd.items()}
        problems = []
        for k in sorted(set(saved) | set(want)):
            if k not in saved:
                problems.append(f"{k}: not in checkpoint (model has {list(want[k])})")
            elif k not in want:
                problems.append(f"{k}: in checkpoint {list(saved[k])} but not in the model")
            elif saved[k] != want[k]:
                problems.append(f"{k}: checkpoint {list(saved[k])} vs model {list(want[k])}")
        if problems:
            shown = "\n  ".join(problems[:20])
            more = f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else ""
            raise CheckpointError(
                f"checkpoint {path} does not match the model ({len(problems)} keys differ):\n  "
                f"{shown}{more}\nUse a new --run-dir for a different model; nothing was "
                "overwritten.")

    def load(self, path: Path, target) -> dict[str, Any]:
        """Load `target` (state_dict/load_state_dict) and RNG from `path`; return its meta."""
        rank, world = _world()
        meta = json.loads((path / "meta.json").read_text())
        state = target.state_dict()
        self.check_shapes(path, state["model"])
        try:
            dcp.load(state, checkpoint_id=str(path))
        except Exception as e:
            raise CheckpointError(f"checkpoint {path} could not be read: {e}") from None
        target.load_state_dict(state)
        rng_file = path / f"rng_rank{rank:05d}.json"
        if meta.get("world_size") == world and rng_file.exists():
            set_rng_state(json.loads(rng_file.read_text()))
        return meta
