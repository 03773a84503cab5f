"""The one DeviceMesh of a run: named dimensions pp, dp_replicate, dp_shard, cp, tp.

Dimensions of size 1 are left out (no process groups are created for them). The last dimension
varies fastest over consecutive ranks, so tp (then cp) groups are made of neighbouring ranks —
the ranks of one host under torchrun's default placement.
"""

from __future__ import annotations

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from myria.layout import MESH_ORDER as ORDER


def build_mesh(layout: dict[str, int], device_type: str, cluster=None) -> DeviceMesh | None:
    """A mesh over the non-trivial dimensions of `layout`, or None for a single process.

    With a `placement.Cluster`, ranks take coordinates by topology (see placement.py);
    without one, consecutive ranks fill tp first (torchrun's host-by-host numbering).
    """
    dims = [(n, layout.get(n, 1)) for n in ORDER if layout.get(n, 1) > 1]
    if not dims:
        return None
    names = tuple(n for n, _ in dims)
    if cluster is None:
        mesh = init_device_mesh(device_type, tuple(s for _, s in dims), mesh_dim_names=names)
    else:
        import torch

        from myria.parallel.placement import place

        grid = place(layout, cluster).reshape([s for _, s in dims])
        mesh = DeviceMesh(device_type, torch.as_tensor(grid), mesh_dim_names=names)
    return mesh


def dp_mesh(mesh: DeviceMesh | None) -> DeviceMesh | None:
    """The data-parallel sub-mesh: 2-D (replicate, shard) for HSDP, else 1-D, or None."""
    if mesh is None:
        return None
    names = mesh.mesh_dim_names or ()
    dp_names = tuple(n for n in ("dp_replicate", "dp_shard") if n in names)
    if not dp_names:
        return None
    return mesh[dp_names]


def dp_rank_and_size(mesh: DeviceMesh | None) -> tuple[int, int]:
    """This rank's index among the data-parallel ranks, and their number."""
    sub = dp_mesh(mesh)
    if sub is None:
        return 0, 1
    if sub.ndim == 1:
        return sub.get_local_rank(), sub.size()
    r, s = sub.get_local_rank(0), sub.get_local_rank(1)
    return r * sub.size(1) + s, sub.size()


def sub_size(mesh: DeviceMesh | None, name: str) -> int:
    """Size of dimension `name` of the mesh (1 when absent)."""
    if mesh is None or name not in (mesh.mesh_dim_names or ()):
        return 1
    return mesh[name].size()


def sub_rank(mesh: DeviceMesh | None, name: str) -> int:
    """This rank's coordinate along dimension `name` (0 when absent)."""
    if mesh is None or name not in (mesh.mesh_dim_names or ()):
        return 0
    return mesh[name].get_local_rank()


def fsdp_mesh(mesh: DeviceMesh | None) -> DeviceMesh | None:
    """The mesh FSDP shards over: data-parallel ranks and context-parallel ranks together.

    Context-parallel ranks hold the same parameters (they split the sequence), so FSDP shards
    and reduces over dp_shard x cp, flattened; with dp_replicate it is a 2-D mesh (HSDP).
    """
    if mesh is None:
        return None
    names = mesh.mesh_dim_names or ()
    shard = [n for n in ("dp_shard", "cp") if n in names]
    if not shard and "dp_replicate" not in names:
        return None
    if len(shard) == 2:
        mesh[tuple(shard)]._flatten("dp_shard_cp")
        shard_name = "dp_shard_cp"
    else:
        shard_name = shard[0] if shard else None
    if "dp_replicate" in names:
        if shard_name is None:
            return mesh["dp_replicate"]
        return mesh["dp_replicate", shard_name]
    return mesh[shard_name]


def loss_group(mesh: DeviceMesh | None):
    """Process group over which per-rank losses are averaged (dp x cp ranks), or None."""
    names = (mesh.mesh_dim_names or ()) if mesh is not None else ()
    dims = tuple(n for n in ("dp_replicate", "dp_shard", "cp") if n in names)
    if not dims:
        return None
    sub = mesh[dims] if len(dims) > 1 else mesh[dims[0]]
    if sub.ndim > 1:
        sub = sub._flatten("_".join(dims))
    return sub.get_group()


def single_rank_mesh(device_type: str) -> DeviceMesh:
    """A one-rank data-parallel mesh for a lone process, so that FSDP2 (and its bf16
    mixed-precision policy with fp32 gradient reduction) applies exactly as on N ranks; the
    process group of one is made here (an in-memory store) when none was started."""
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("nccl" if device_type == "cuda" else "gloo",
                                store=dist.HashStore(), rank=0, world_size=1)
    return init_device_mesh(device_type, (1,), mesh_dim_names=("dp_shard",))
