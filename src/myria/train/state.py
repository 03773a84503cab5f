"""The state of one rank: what a checkpoint, a peer snapshot, an in-job rejoin and the
silent-corruption checks all walk.

A rank's state is `engine.state_dict()`, a nested dict {"model": {...}, "optim": {...}} whose
tensor leaves are DTensors (their local shard is this rank's part) or plain tensors, plus the
scheduler's state and the RNG states. `flatten` turns it into {key path: leaf} and `unflatten`
back; `flat_state`/`load_flat_state` are the same tree named by "/"-joined paths with the local
shards as leaves (a peer snapshot's form). `shard_key` and `unique_bytes` say what part of a
leaf this rank holds.
"""

from __future__ import annotations

import base64
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from myria.tensors import local_shard


def rank_and_world() -> tuple[int, int]:
    """(rank, world size) of the default process group; (0, 1) without one."""
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


# -- nested state <-> flat leaves ------------------------------------------------------------
def flatten(obj: Any, prefix: tuple = ()) -> dict[tuple, Any]:
    """{key path: leaf} of a nested dict (a leaf is anything that is not a dict)."""
    if isinstance(obj, dict):
        out: dict[tuple, Any] = {}
        for k, v in obj.items():
            out.update(flatten(v, prefix + (k,)))
        return out
    return {prefix: obj}


def unflatten(flat: dict[tuple, Any]) -> dict:
    """The nested dict of `flatten`'s {key path: leaf}."""
    root: dict = {}
    for path, v in flat.items():
        node = root
        for k in path[:-1]:
            node = node.setdefault(k, {})
        node[path[-1]] = v
    return root


# -- random number generators ----------------------------------------------------------------
def seed_rng(seed: int) -> None:
    """Seed this process's global CPU and CUDA generators from the run's seed, rank r from
    `seed + r` (ranks draw different streams). Nothing of a step draws from them (model init
    and data order use generators of their own), so this fixes what a checkpoint records of
    them (`rng_state`): the same config saves the same states."""
    torch.manual_seed(seed + rank_and_world()[0])


def rng_state() -> dict[str, str]:
    """This process's CPU (and CUDA) RNG states, as JSON-safe strings."""
    states = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state()
    return {k: base64.b64encode(v.numpy().tobytes()).decode() for k, v in states.items()}


def set_rng_state(states: dict[str, str]) -> None:
    """Restore what `rng_state` returned."""
    for k, v in states.items():
        t = torch.frombuffer(bytearray(base64.b64decode(v)), dtype=torch.uint8)
        if k == "cpu":
            torch.set_rng_state(t)
        elif k == "cuda" and torch.cuda.is_available():
            torch.cuda.set_rng_state(t)


# -- this rank's part of each leaf -----------------------------------------------------------
def shard_key(v: Any) -> tuple:
    """What identifies the data a rank holds for one state leaf: two ranks with equal keys for
    every leaf hold the same bytes (replicas)."""
    if not isinstance(v, torch.Tensor):
        return ()
    if isinstance(v, DTensor):
        coord = v.device_mesh.get_coordinate() or []
        shards = tuple(c for c, pl in zip(coord, v.placements) if pl.is_shard())
        return (tuple(v.shape), str(v.dtype), tuple(local_shard(v).shape), shards)
    return (tuple(v.shape), str(v.dtype))


def unique_bytes(v: torch.Tensor) -> int:
    """The bytes of tensor `v` that this rank alone holds: a DTensor's shard on the ranks at
    coordinate 0 of its replicated mesh dimensions; a plain tensor on rank 0 (summed over the
    ranks: the size of the state's tensors, or less where plain tensors differ by rank)."""
    local = local_shard(v)
    n = local.numel() * local.element_size()
    if isinstance(v, DTensor):
        coord = v.device_mesh.get_coordinate()
        if coord is None:
            return 0
        return n if all(c == 0 for c, pl in zip(coord, v.placements) if not pl.is_shard()) \
            else 0
    return n if rank_and_world()[0] == 0 else 0


# -- the flat form of a peer snapshot --------------------------------------------------------
def flat_state(engine) -> dict[str, Any]:
    """{"/"-joined key path: local shard (detached) or plain value} of the engine's state."""
    return {"/".join(map(str, k)): (local_shard(v).detach() if isinstance(v, torch.Tensor)
                                    else v)
            for k, v in flatten(engine.state_dict()).items()}


def load_flat_state(engine, state: dict[str, Any]) -> None:
    """Load `flat_state`'s form (with "_scheduler" and "_rng" where present) into `engine`:
    tensors into its own state's local shards, the optimizer's plain numbers, the scheduler and
    the RNG. Raises RuntimeError naming the first key or shape that does not match."""
    flat = flatten(engine.state_dict())
    for k, v in flat.items():
        name = "/".join(map(str, k))
        if name not in state:
            raise RuntimeError(f"the snapshot has no {name!r}: it was taken with another "
                               "model or layout")
        src = state[name]
        if isinstance(v, torch.Tensor):
            with torch.no_grad():
                dst = local_shard(v)
                if tuple(dst.shape) != tuple(src.shape) or dst.dtype != src.dtype:
                    raise RuntimeError(f"snapshot {name!r}: {tuple(src.shape)} {src.dtype}, "
                                       f"this rank holds {tuple(dst.shape)} {dst.dtype}")
                dst.copy_(src)
        elif isinstance(src, (int, float, bool)) and not isinstance(v, str):
            flat[k] = src
    engine.load_state_dict(unflatten(flat))
    if state.get("_scheduler") is not None:
        engine.load_scheduler_state(state["_scheduler"])
    if state.get("_rng") is not None:
        set_rng_state(state["_rng"])
