"""The one DeviceMesh of a run: named dimensions pp, dp_replicate, dp_shard, cp, tp.

Dimensions of size 1 are left out (no process groups are created for them). The last dimension
varies fastest over consecutive ranks, so tp (then cp) groups are made of neighbouring ranks —
the ranks of one host under torchrun's default placement.
"""

from __future__ import annotations

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

ORDER = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


def build_mesh(layout: dict[str, int], device_type: str) -> DeviceMesh | None:
    """A mesh over the non-trivial dimensions of `layout`, or None for a single process."""
    dims = [(n, layout.get(n, 1)) for n in ORDER if layout.get(n, 1) > 1]
    if not dims:
        return None
    names = tuple(n for n, _ in dims)
    mesh = init_device_mesh(device_type, tuple(s for _, s in dims), mesh_dim_names=names)
    dp_names = tuple(n for n in ("dp_replicate", "dp_shard") if n in names)
    if len(dp_names) == 2:
        mesh[dp_names]._flatten("dp")
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
