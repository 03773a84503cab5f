"""The known-answer probe: which of two disagreeing data-parallel ranks computes wrongly.

A compute check (`myria.train.sdc.ComputeCheck`) whose group has only two ranks cannot tell,
by replaying, the rank that computes wrongly from its partner when the fault persists: each
reproduces its own answer. The probe is a fixed computation through the modules and kernels
training uses: the first transformer block of each model part, given the input training gave
it at a check, its parameters replaced for the probe's duration by a fixed pattern (a function
of their local shapes alone), forward and backward (input and weight gradients). At the first
check of a process where every group agreed, each rank records the checksums of its answer;
when two ranks later disagree persistently, both run it again, and the one whose answer no
longer equals its own record is the one whose computation changed. Collective over the world
(the block's forward gathers FSDP shards and reduces tensor-parallel partial sums), so it runs
only at those two moments; the record is one block input and three checksums per part.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from myria.tensors import local_shard
from myria.train.checksums import sums

SEED = 1000003          # of the parameters' fixed pattern
SAME, UNRECORDED = -1, -2   # `changed`'s answers besides the first differing checksum's index


def words(code: int) -> str:
    return {SAME: "equals its record", UNRECORDED: "no record"}.get(
        code, "differs from its record")


def first_block(part):
    """The first transformer block of a model part (None: a part without blocks)."""
    layers = getattr(getattr(part, "module", part), "layers", None)   # DDP wraps the model
    return next(iter(layers.values()), None) if layers else None


def reshard(parts) -> None:
    """Free every FSDP2 module's gathered parameters (a forward without a backward leaves those
    with reshard_after_forward=False gathered)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:   # pragma: no cover - older torch
        return
    for part in parts:
        for m in part.modules():
            if isinstance(m, FSDPModule):
                m.reshard()


def pattern(t: torch.Tensor, seed: int) -> torch.Tensor:
    """A fixed value of `t`'s shape and type: normal values scaled by the fan-in (a matrix) or
    about 1 (a vector: a norm's weight), drawn from `seed` alone."""
    g = torch.Generator().manual_seed(SEED + seed)
    v = torch.randn(tuple(t.shape), generator=g)
    v = v / max(1, t.shape[-1]) ** 0.5 if t.dim() > 1 else 1 + 0.1 * v
    return v.to(device=t.device, dtype=t.dtype)


class KnownAnswerProbe:
    """Records and reruns the probe (module docstring)."""

    def __init__(self, engine):
        self.engine = engine
        # parameters streamed from disk (offload_params) are not held in place to swap
        self.usable = not getattr(engine.cfg.parallel, "offload_params", False)
        self.record: list[tuple | None] | None = None   # per part: (block args, checksums)

    @property
    def wanted(self) -> bool:
        """Whether the next agreed check should hand its block inputs to `keep`."""
        return self.usable and self.record is None

    def keep(self, args: list | None) -> None:
        """At a check where every group agreed (collective; every rank calls it there): record
        the probe's answer once per process. `args`: per part, the first block's positional
        arguments as training called it at this check (None: not captured, or no block)."""
        if not self.wanted:
            return
        parts = self.engine.parts
        ok = args is not None and all(a is not None or first_block(p) is None
                                      for p, a in zip(parts, args))
        flag = torch.tensor([int(not ok)], dtype=torch.int64, device=self.engine.device)
        if dist.is_initialized():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if int(flag):   # some rank has no input to probe with: no record (every rank alike)
            return
        from myria.observe import events

        with events.current().span("probe_record", "check"):   # once per process
            self.record = [(a, self.run(p, a)) if a is not None else None
                           for p, a in zip(parts, args)]

    def changed(self) -> int:
        """This rank's answer now against its record (collective: every rank of the world
        calls it together): SAME, UNRECORDED, or the index of the first checksum that differs
        (in the order `run` takes them, parts in order): how early in the computation it
        changed, which tells a rank that computes wrongly from a tensor-parallel peer that
        only received its wrong partial sum."""
        if self.record is None:
            return UNRECORDED
        now = torch.cat([self.run(p, rec[0]) for p, rec in zip(self.engine.parts, self.record)
                         if rec is not None] or [torch.zeros(0, dtype=torch.int64)])
        was = torch.cat([rec[1] for rec in self.record if rec is not None]
                        or [torch.zeros(0, dtype=torch.int64)])
        if now.shape != was.shape:
            return 0
        bad = (now != was).nonzero().reshape(-1)
        return int(bad[0]) if bad.numel() else SAME

    def run(self, part, args: tuple) -> torch.Tensor:
        """The checksums of the probe through the first block of `part`: each linear layer's
        output in the order the forward calls them (a local GEMM's result comes before any
        tensor-parallel reduction of it), the block's output, its input gradient and the sum
        of its weight gradients' checksums. The block's parameters hold their own values again
        afterwards, and no gradient of training is touched (autograd.grad, gradient sync
        off)."""
        from myria.train.engine import grad_sync

        blk = first_block(part)
        params = [p for p in blk.parameters() if p.is_floating_point()]
        with torch.no_grad():
            held = [local_shard(p).clone() for p in params]
            for i, p in enumerate(params):
                local_shard(p).copy_(pattern(local_shard(p), i))
        used: list[torch.Tensor] = []   # the parameters the forward uses (FSDP's gathered)
        hooks = [blk.register_forward_pre_hook(
            lambda m, a: used.extend(q for q in m.parameters() if q.requires_grad))]
        seen: list[torch.Tensor] = []
        hooks += [m.register_forward_hook(lambda m, a, o: seen.append(
            sums([local_shard(o.detach())]).cpu().reshape(1)))
            for m in blk.modules() if isinstance(m, torch.nn.Linear)]
        try:
            with torch.enable_grad(), grad_sync(part, False), self.engine._ctx():
                x = args[0].detach().clone().requires_grad_(True)
                out = blk(x, *args[1:])
                out = out[0] if isinstance(out, tuple) else out
                gs = torch.autograd.grad(out, [x, *used], grad_outputs=torch.ones_like(out),
                                         allow_unused=True)
            w = [local_shard(g) for g in gs[1:] if g is not None]
            return torch.cat([*seen, sums([local_shard(out.detach())]).cpu().reshape(1),
                              sums([local_shard(gs[0])]).cpu().reshape(1),
                              sums(w).cpu().sum().reshape(1)])
        finally:
            for h in hooks:
                h.remove()
            if hasattr(part, "set_requires_gradient_sync"):
                part.set_requires_gradient_sync(True)
            reshard([part])
            with torch.no_grad():
                for p, v in zip(params, held):
                    local_shard(p).copy_(v)


def decide(owner: int, checker: int, probed: tuple[int, int] | None) -> dict:
    """The verdict on two ranks that disagree persistently with no third to decide: the one
    whose probe changed while the other's did not, else both as suspects."""
    v = {"rank": None, "suspects": [owner, checker],
         "verdict": "persistent (two ranks disagree; no third to decide)"}
    if probed is None:
        return v
    po, pc = probed
    v["probe"] = {str(owner): words(po), str(checker): words(pc)}
    if SAME in (po, pc) and max(po, pc) >= 0:
        named = owner if po >= 0 else checker
        v.update(rank=named, verdict="persistent (its known-answer probe changed since its "
                                     "group last agreed)")
        del v["suspects"]
    return v
