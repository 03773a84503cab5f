"""Loading a checkpoint into a rank's state (collective).

Ranks whose shards are identical (data-parallel replicas under DDP or HSDP) form a group; the
group's first rank reads the shard from storage and broadcasts it to the others (MegaScale
§4.5.3). The model's keys and shapes are checked against the checkpoint's first, so a different
model fails with one message listing the keys that differ. Nothing in the checkpoint is
executed (DCP reads tensors with `weights_only=True`; the rest is JSON).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from myria.errors import CheckpointError
from myria.tensors import local_shard
from myria.train.checkpoint.store import MANIFEST, describe_error
from myria.train.distributed import collective_device
from myria.train.state import flatten, rank_and_world, set_rng_state, shard_key


class _CountingReader(dcp.FileSystemReader):
    """A DCP reader that counts the bytes it reads from storage."""

    def __init__(self, path: str | os.PathLike) -> None:
        super().__init__(path)
        self.bytes_read = 0

    def _slice_file(self, file, sinfo):
        self.bytes_read += int(sinfo.length)
        return super()._slice_file(file, sinfo)


def load_state(path: Path, target) -> tuple[dict[str, Any], int]:
    """Load `target` (state_dict/load_state_dict) and RNG from `path` (collective); return its
    meta and the bytes this rank read from storage.

    Ranks whose shards are identical form a group; the group's first rank reads the shard
    from storage and broadcasts it to the rest.
    """
    rank, world = rank_and_world()
    meta = json.loads((path / MANIFEST).read_text())
    if hasattr(target, "check_checkpoint"):  # optimizer state in files or in shards
        target.check_checkpoint(path, meta)
    state = target.state_dict()
    whole = None
    if world > 1:  # pipeline stages hold parts of the model: compare with their union
        parts: list = [None] * world
        dist.all_gather_object(parts, sorted(state["model"]))
        whole = set().union(*map(set, parts))
    check_shapes(path, state["model"], whole)
    for key in getattr(target, "file_backed_keys", list)():  # restored with the files
        state["model"].pop(key)
    groups = read_groups(state)
    mine = next(g for g in groups if rank in g)
    reader = _CountingReader(str(path))
    try:
        if all(len(g) == 1 for g in groups):
            dcp.load(state, storage_reader=reader, no_dist=not dist.is_initialized())
        else:
            readers = sorted(g[0] for g in groups)
            readers_pg = dist.new_group(readers, backend=None)
            bcast_pgs = {tuple(g): dist.new_group(g) for g in groups if len(g) > 1}
            if rank == mine[0]:
                dcp.load(state, storage_reader=reader, process_group=readers_pg)
            if len(mine) > 1:
                _broadcast_state(state, mine[0], bcast_pgs[tuple(mine)])
    except CheckpointError:
        raise
    except BaseException as e:   # DCP's CheckpointException is a BaseException
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        raise unreadable(path, e) from None
    target.load_state_dict(state)
    if hasattr(target, "load_checkpoint_files"):
        target.load_checkpoint_files(path)
    rng_file = path / f"rng_rank{rank:05d}.json"
    if meta.get("world_size") == world and rng_file.exists():
        set_rng_state(json.loads(rng_file.read_text()))
    return meta, reader.bytes_read


def unreadable(path: Path, e: BaseException) -> CheckpointError:
    """The one-line error of a checkpoint whose files fail to read."""
    return CheckpointError(f"checkpoint {path} could not be read ({describe_error(e)}): a "
                           "damaged file; resume another checkpoint (--resume-from STEP), or "
                           "train from step 0 (--start-fresh)")


def check_shapes(path: Path, model_sd: dict[str, torch.Tensor],
                 whole_model: set[str] | None = None) -> None:
    """Raise CheckpointError listing keys whose presence or shape differ from the model, or
    saying that the checkpoint's metadata (.metadata) cannot be read.

    `whole_model`: the keys of the whole model when this rank holds part of it (a pipeline
    stage): a checkpoint key is extra only if no rank's part has it."""
    try:
        md = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    except Exception as e:   # a garbage .metadata fails to unpickle with any error
        raise unreadable(path, e) from None
    saved = {k[len("model."):]: tuple(v.size) for k, v in md.items()
             if k.startswith("model.") and hasattr(v, "size")}
    want = {k: tuple(v.shape) for k, v in model_sd.items()}
    whole = set(want) if whole_model is None else whole_model
    problems = []
    for k in sorted(set(saved) | set(want)):
        if k not in saved:
            problems.append(f"{k}: not in checkpoint (model has {list(want[k])})")
        elif k not in want and k in whole:
            continue  # another pipeline stage's
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


def read_groups(state: dict) -> list[list[int]]:
    """Ranks grouped by identical state shards (collective; [[0]] for one process)."""
    rank, world = rank_and_world()
    if world == 1:
        return [[0]]
    flat = flatten(state)
    h = hashlib.sha256(repr(sorted((repr(k), shard_key(v)) for k, v in flat.items()))
                       .encode()).hexdigest()
    keys: list[str | None] = [None] * world
    dist.all_gather_object(keys, h)
    groups: dict[str, list[int]] = {}
    for r, k in enumerate(keys):
        groups.setdefault(k, []).append(r)
    return sorted(groups.values())


def _broadcast_state(state: dict, src: int, group) -> None:
    """Send the reader's state to its replicas, tensors in place, other leaves by pickle."""
    flat = flatten(state)
    others = {k: v for k, v in flat.items() if not isinstance(v, torch.Tensor)}
    device = collective_device(group)   # an optimizer's step counts stay on the host
    for key in sorted(flat, key=repr):
        v = flat[key]
        if not isinstance(v, torch.Tensor):
            continue
        local = local_shard(v).detach()
        buf = local if local.is_contiguous() and local.device == device else \
            local.contiguous().to(device)
        dist.broadcast(buf, src=src, group=group)
        if buf is not local:
            local.copy_(buf)
    if others:
        box = [others]
        dist.broadcast_object_list(box, src=src, group=group)
        for k, v in box[0].items():
            node = state
            for part in k[:-1]:
                node = node[part]
            node[k[-1]] = v

