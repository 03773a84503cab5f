"""Expert parallelism: MoE experts sharded over an `ep` group, tokens exchanged by all-to-all.

The `dp` data-parallel ranks form groups of `ep` consecutive ranks; rank r of a group holds
experts [r*E/ep, (r+1)*E/ep) of every MoE layer; the ranks at its position in the other groups
are its *expert replicas*. Routing and router losses stay local; dispatch and combine are
differentiable `all_to_all_single`s. Expert weights keep their single-process names and global
shapes (DTensors sharded on dim 0 over the ep mesh), so `init_weights` and DCP checkpoints agree
under any layout. Expert gradients are scaled by 1/ep in the forward and must be averaged over
the replica group only, never over the ep group:

    ep_mesh, replica_mesh = expert_meshes(dp_mesh, ep)  # dp_mesh: the FSDP (or HSDP) mesh
    apply_expert_parallel(model, ep_mesh)               # on the meta model
    for block in model.layers.values():
        if isinstance(block.feed_forward, MoE):
            fully_shard(block.feed_forward.experts, mesh=replica_mesh)  # first: own FSDP group
        fully_shard(block, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)

Without FSDP `sync_gradients` averages. Clip with this module's `clip_grad_norm_`."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from myria.models.moe import Experts, MoE, expert_mlps
from myria.tensors import full_value, local_shard

EXPERT_WEIGHTS = ("w1", "w2", "w3", "w1_bias", "w2_bias")


class _AllToAll(torch.autograd.Function):
    """`all_to_all_single` along dim 0 with uneven splits; backward sends gradients back."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, out_splits: list[int], in_splits: list[int],
                group: dist.ProcessGroup) -> torch.Tensor:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out_splits, in_splits = ctx.splits
        g = grad.new_empty((sum(in_splits), *grad.shape[1:]))
        dist.all_to_all_single(g, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return g, None, None, None


def all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int],
               group: dist.ProcessGroup) -> torch.Tensor:
    """Differentiable all-to-all: send rows in_splits[j] to rank j, receive out_splits[j]."""
    return _AllToAll.apply(x, out_splits, in_splits, group)


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; multiplies the gradient by `scale`."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.scale, None


class ParallelExperts(Experts):
    """This rank's E/ep experts of one MoE layer; tokens travel to their expert's rank.

    Parameters are DTensors with the global shapes, `Shard(0)` over `ep_mesh`.
    """

    def __init__(self, base: Experts, ep_mesh: DeviceMesh):
        nn.Module.__init__(self)
        ep = ep_mesh.size()
        if ep_mesh.ndim != 1:
            raise ValueError(f"the expert-parallel mesh must be 1-D, got {ep_mesh.ndim}-D")
        if base.num_experts % ep:
            raise ValueError(f"model.experts = {base.num_experts} is not divisible by the "
                             f"expert-parallel degree ep = {ep}")
        self.num_experts, self.gated = base.num_experts, base.gated
        self.ep_mesh, self.ep, self.num_local = ep_mesh, ep, base.num_experts // ep
        for name in EXPERT_WEIGHTS:
            p = getattr(base, name)
            if p is None:
                setattr(self, name, None)
                continue
            if isinstance(p, DTensor):
                raise ValueError(f"experts.{name} is already a DTensor: apply expert "
                                 "parallelism before FSDP and only once")
            # Every rank holds the same full value (or meta): slice locally, no communication.
            dt = distribute_tensor(p.detach(), ep_mesh, [Shard(0)], src_data_rank=None)
            setattr(self, name, nn.Parameter(dt, requires_grad=p.requires_grad))

    def weights(self) -> tuple[torch.Tensor | None, ...]:
        """Local expert slices; their gradients scaled by 1/ep (see the module docstring)."""
        out = []
        for name in EXPERT_WEIGHTS:
            w = getattr(self, name)
            if w is not None:
                w = local_shard(w)
                w = _ScaleGrad.apply(w, 1.0 / self.ep)
            out.append(w)
        return tuple(out)

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x: this rank's kept assignments sorted by global expert; counts: [E] per expert."""
        group, ep, el = self.ep_mesh.get_group(), self.ep, self.num_local
        counts = counts.contiguous()
        recv = torch.empty_like(counts)
        dist.all_to_all_single(recv, counts, group=group)  # recv[s*el + j]: from s, expert j
        send_splits = counts.view(ep, el).sum(1).tolist()
        recv_by_src = recv.view(ep, el)
        recv_splits = recv_by_src.sum(1).tolist()
        xr = all_to_all(x, recv_splits, send_splits, group)
        per_expert = recv_by_src.sum(0)
        if el == 1:
            y = expert_mlps(xr, per_expert, *self.weights())
        else:
            # Received rows are grouped by source, then expert: regroup them by expert.
            local = torch.arange(el, device=recv.device).repeat(ep).repeat_interleave(recv)
            perm = torch.argsort(local, stable=True)
            inv = torch.empty_like(perm)
            inv[perm] = torch.arange(perm.numel(), device=perm.device)
            y = expert_mlps(xr[perm], per_expert, *self.weights())[inv]
        return all_to_all(y, send_splits, recv_splits, group)

    def extra_repr(self) -> str:
        return f"experts={self.num_experts}, local={self.num_local}, ep={self.ep}"


def _as_mesh(ep: DeviceMesh | dist.ProcessGroup, device_type: str) -> DeviceMesh:
    if isinstance(ep, DeviceMesh):
        return ep
    return DeviceMesh.from_group(ep, device_type)


def apply_expert_parallel(model: nn.Module, ep: DeviceMesh | dist.ProcessGroup,
                          device_type: str = "cpu") -> int:
    """Shard the experts of every MoE layer of `model` over `ep`; returns the layers changed.

    `ep` is a 1-D DeviceMesh (preferred: a sub-mesh of the run's mesh, see `expert_meshes`, so
    FSDP2 can compose with it) or a process group (wrapped as a mesh of `device_type`). Works
    on a meta model (then `to_empty` + `init_weights`) or an initialised one (each rank keeps
    its slice). Parameter names are unchanged. Call it before FSDP.
    """
    mesh = _as_mesh(ep, device_type)
    n = 0
    for module in model.modules():
        if isinstance(module, MoE) and not isinstance(module.experts, ParallelExperts):
            module.experts = ParallelExperts(module.experts, mesh)
            n += 1
    return n


def expert_meshes(dp_mesh: DeviceMesh, ep: int) -> tuple[DeviceMesh, DeviceMesh]:
    """(ep mesh, expert-replica mesh) carved out of the data-parallel mesh.

    `dp_mesh` is 1-D (``dp_shard``) or 2-D HSDP (``dp_replicate``, ``dp_shard``); the shard
    dimension is split as (dp_shard // ep, ep) with ep fastest, so ep groups are consecutive
    ranks. The replica mesh has the dimensions the experts are data-parallel over: 1-D
    ``dp_shard_mod_ep`` or 2-D (``dp_replicate``, ``dp_shard_mod_ep``) for HSDP. Both are
    sub-meshes of the same root as `dp_mesh`, as FSDP2 requires for DTensor parameters.
    """
    names = dp_mesh.mesh_dim_names
    if names is None:
        raise ValueError("the data-parallel mesh needs named dimensions")
    shard = names[-1]
    size = dp_mesh.size(dp_mesh.ndim - 1)
    if ep < 1 or size % ep:
        raise ValueError(f"expert-parallel degree ep = {ep} must divide the data-parallel "
                         f"sharding degree {shard} = {size}")
    mod_name, ep_name = f"{shard}_mod_ep", "ep"
    # by index, not name: torch 2.11's _unflatten refuses a dimension name that exists
    split = dp_mesh._unflatten(dp_mesh.ndim - 1, (size // ep, ep), (mod_name, ep_name))
    replica = split[(*names[:-1], mod_name)] if dp_mesh.ndim > 1 else split[mod_name]
    return split[ep_name], replica


def is_expert_parameter(name: str) -> bool:
    """Whether the parameter named `name` is an expert weight (dim 0 indexes experts)."""
    parts = name.split(".")
    return len(parts) >= 2 and parts[-2] == "experts" and parts[-1] in EXPERT_WEIGHTS


def _group_size(group: dist.ProcessGroup | None) -> int:
    return 1 if group is None else dist.get_world_size(group)


@torch.no_grad()
def sync_gradients(model: nn.Module, dp_group: dist.ProcessGroup | None,
                   replica_group: dist.ProcessGroup | None) -> None:
    """Without FSDP/DDP: average dense gradients over dp, expert gradients over their replicas.

    Expert gradients already are the mean over their ep group (see the module docstring), so
    averaging over the replica group (dp/ep ranks; None or size 1: nothing to do) gives the
    mean over all dp ranks.
    """
    dp, rep = _group_size(dp_group), _group_size(replica_group)
    for name, p in model.named_parameters():
        if p.grad is None:
            continue
        expert = isinstance(p, DTensor) and is_expert_parameter(name)
        g = local_shard(p.grad)
        n, group = (rep, replica_group) if expert else (dp, dp_group)
        if n > 1:
            dist.all_reduce(g, op=dist.ReduceOp.SUM, group=group)
            g.div_(n)


def _norm_key(t: torch.Tensor):
    if isinstance(t, DTensor):
        return (id(t.device_mesh), tuple(t.placements))
    return None


def _by_mesh(tensors) -> list[list[torch.Tensor]]:
    groups: dict = {}
    for t in tensors:
        groups.setdefault(_norm_key(t), []).append(t)
    return list(groups.values())


@torch.no_grad()
def grad_norm(parameters, foreach: bool | None = None) -> torch.Tensor:
    """Global L2 norm of the gradients, as a plain tensor, whatever meshes they live on.

    Plain tensors and DTensors of each (mesh, placements) are normed separately (a DTensor's
    norm is that of the full tensor), then combined. `torch.nn.utils.get_total_norm` instead
    stacks DTensor norms of different meshes, which fails ("must have the same mesh").
    """
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return torch.zeros(())
    norms = []
    for group in _by_mesh(grads):
        n = torch.nn.utils.get_total_norm(group, 2.0, foreach=foreach)
        norms.append(full_value(n))
    device = norms[0].device
    return torch.linalg.vector_norm(torch.stack([n.to(device) for n in norms]))


@torch.no_grad()
def clip_coef(max_norm: float, total_norm: torch.Tensor | float) -> float:
    """The factor clipping scales gradients by (1.0: they stay as they are), torch's rule."""
    if not 0 < max_norm < float("inf"):
        return 1.0
    coef = max_norm / (float(total_norm) + 1e-6)
    return coef if coef < 1.0 else 1.0


def clip_grads_with_norm_(parameters, max_norm: float, total_norm: torch.Tensor | float) -> None:
    """Scale gradients by max_norm / total_norm when that is < 1, one foreach per mesh.

    `torch.nn.utils.clip_grads_with_norm_` fails on gradients of different meshes.
    """
    coef = clip_coef(max_norm, total_norm)
    if coef < 1.0:
        for group in _by_mesh([p.grad for p in parameters if p.grad is not None]):
            torch._foreach_mul_(group, coef)


@torch.no_grad()
def clip_grad_norm_(parameters, max_norm: float, foreach: bool | None = None) -> torch.Tensor:
    """`torch.nn.utils.clip_grad_norm_` for gradients living on different meshes.

    Returns the total norm before clipping (a plain tensor); `max_norm` <= 0 only measures.
    """
    params = [p for p in parameters if p.grad is not None]
    total = grad_norm(params, foreach)
    clip_grads_with_norm_(params, max_norm, total)
    return total
