"""The torch side of a layout: one DeviceMesh and every group and coordinate derived from it.

`ParallelDims.build(layout, device_type)` makes the run's one DeviceMesh (named dimensions pp,
dp_replicate, dp_shard, cp, tp; those of size 1 left out, so no process group is made for them)
and derives, once, what the engine, the data loader and the watchers need: this rank's
data-parallel index and count, its coordinate along every dimension, the sub-meshes FSDP, DDP
and expert parallelism work on, and the groups losses, data and pipeline stages travel in. The
last dimension varies fastest over consecutive ranks, so tp (then cp) groups are made of
neighbouring ranks: the ranks of one host under torchrun's numbering; with a
`placement.Cluster` the ranks take coordinates by topology instead.

A single process has no mesh: every degree is 1 and every group None.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from myria.layout import MESH_ORDER, Layout


def build_mesh(layout: Layout, device_type: str, fsdp: bool = False) -> DeviceMesh | None:
    """The mesh over the non-trivial dimensions of `layout` in `MESH_ORDER` (consecutive ranks
    fill tp first: `myria.parallel.placement` says what its groups cross), or None for a
    single process.
    With `fsdp` (the model is sharded with FSDP2, `Layout.shards_with_fsdp`) on ranks that are all
    tp, pp or ep (no data or context ranks), a dp_shard dimension of size 1 is kept: FSDP2
    applies its bf16 mixed precision over a mesh of the same root as the tensor-parallel one
    (meshes of different roots do not compose)."""
    dims = [(n, layout[n]) for n in MESH_ORDER if layout[n] > 1]
    if not dims:
        return None
    if fsdp and not any(n in ("dp_replicate", "dp_shard", "cp") for n, _ in dims):
        at = sum(MESH_ORDER.index(n) < MESH_ORDER.index("dp_shard") for n, _ in dims)
        dims.insert(at, ("dp_shard", 1))
    names = tuple(n for n, _ in dims)
    return init_device_mesh(device_type, tuple(s for _, s in dims), mesh_dim_names=names)


@dataclass
class ParallelDims:
    """A layout's mesh, this rank's coordinates and the groups derived from them."""

    layout: Layout
    mesh: DeviceMesh | None
    coord: dict[str, int] = field(default_factory=dict)   # index along every mesh dimension
    dp_rank: int = 0            # among the dp_replicate x dp_shard ranks
    dp_mesh: DeviceMesh | None = None     # (dp_replicate, dp_shard): DDP, data order
    fsdp_mesh: DeviceMesh | None = None   # (dp_replicate, dp_shard x cp): FSDP / HSDP
    loss_group: object = None   # dp x cp ranks: per-rank losses and gradients averaged here
    data_group: object = None   # cp x tp ranks: train on the same sequences (one reader)
    pp_group: object = None
    ep_mesh: DeviceMesh | None = None        # experts spread over these ranks (ep > 1)
    replica_mesh: DeviceMesh | None = None   # ranks holding copies of the same experts

    @classmethod
    def build(cls, layout: Layout, device_type: str, fsdp: bool = False) -> ParallelDims:
        """The mesh of `layout` (`fsdp`: see `build_mesh`) and all derived from it."""
        return cls.from_mesh(layout, build_mesh(layout, device_type, fsdp))

    @classmethod
    def from_mesh(cls, layout: Layout, mesh: DeviceMesh | None) -> ParallelDims:
        """Coordinates, sub-meshes and groups of an existing mesh of `layout`."""
        if mesh is None:
            return cls(layout, None, {d: 0 for d in MESH_ORDER})
        names = mesh.mesh_dim_names or ()
        coord = {d: (mesh[d].get_local_rank() if d in names else 0) for d in MESH_ORDER}
        dp_names = tuple(n for n in ("dp_replicate", "dp_shard") if n in names)
        dims = cls(layout, mesh, coord,
                   dp_rank=coord["dp_replicate"] * layout.dp_shard + coord["dp_shard"],
                   dp_mesh=mesh[dp_names] if dp_names else None,
                   loss_group=_flat_group(mesh, ("dp_replicate", "dp_shard", "cp"), names),
                   data_group=_flat_group(mesh, ("cp", "tp"), names),
                   pp_group=mesh["pp"].get_group() if "pp" in names else None)
        dims.fsdp_mesh = _fsdp_mesh(mesh, names)
        if layout.ep > 1:  # experts borrow the FSDP shard ranks (Megatron-LM, torchtitan)
            from myria.parallel.expert import expert_meshes
            dims.ep_mesh, dims.replica_mesh = expert_meshes(dims.fsdp_mesh, layout.ep)
        return dims

    # degrees, read from the layout
    @property
    def dp(self) -> int:
        return self.layout.dp

    @property
    def tp(self) -> int:
        return self.layout.tp

    @property
    def cp(self) -> int:
        return self.layout.cp

    @property
    def pp(self) -> int:
        return self.layout.pp

    @property
    def ep(self) -> int:
        return self.layout.ep

    @property
    def cp_rank(self) -> int:
        return self.coord["cp"]

    @property
    def pp_rank(self) -> int:
        return self.coord["pp"]

    @property
    def tp_rank(self) -> int:
        return self.coord["tp"]

    @property
    def ep_rank(self) -> int:
        return self.ep_mesh.get_local_rank() if self.ep_mesh is not None else 0

    def sub(self, name: str) -> DeviceMesh:
        """The 1-D sub-mesh of dimension `name` (which must be > 1)."""
        return self.mesh[name]


def single_rank_mesh(device_type: str) -> DeviceMesh:
    """A one-rank data-parallel mesh for a lone process, so that FSDP2 (and its bf16
    mixed-precision policy with fp32 gradient reduction, or its CPU offload) applies exactly as
    on N ranks; the process group of one is made here (an in-memory store) when none was
    started."""
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("nccl" if device_type == "cuda" else "gloo",
                                store=dist.HashStore(), rank=0, world_size=1)
    return init_device_mesh(device_type, (1,), mesh_dim_names=("dp_shard",))


def _fsdp_mesh(mesh: DeviceMesh, names) -> DeviceMesh | None:
    """The mesh FSDP shards over: data-parallel and context-parallel ranks together.

    Context-parallel ranks hold the same parameters (they split the sequence), so FSDP shards
    and reduces over dp_shard x cp, flattened; with dp_replicate it is a 2-D mesh (HSDP).
    """
    shard = [n for n in ("dp_shard", "cp") if n in names]
    if not shard and "dp_replicate" not in names:
        return None
    if len(shard) == 2:
        mesh[tuple(shard)]._flatten("dp_shard_cp")
        shard_name = "dp_shard_cp"
    else:
        shard_name = shard[0] if shard else None
    if "dp_replicate" in names:
        return mesh["dp_replicate"] if shard_name is None else mesh["dp_replicate", shard_name]
    return mesh[shard_name]


def _flat_group(mesh: DeviceMesh, dims: tuple[str, ...], names):
    """One process group over the present dimensions `dims` (flattened), or None."""
    present = tuple(n for n in dims if n in names)
    if not present:
        return None
    sub = mesh[present] if len(present) > 1 else mesh[present[0]]
    if sub.ndim > 1:
        sub = sub._flatten("_".join(present))
    return sub.get_group()
