"""Silent data corruption on every layout: state at rest, and computation (issue 27).

**At rest** (`StateLedger`). Each rank keeps an exact checksum of what it owns: its local
parameter shards, its optimizer state (exp_avg, exp_avg_sq, ...) and its reduced gradients.
The parameters and optimizer state are recorded right after the optimizer writes them (the end
of every step) and verified before they are used again: at the start of the next step (before
the forward gathers them), before the next update, and before every checkpoint. The gradients
are recorded when the reduction has written them and verified before clipping reads them. The
checksum is the wrapping 32-bit integer sum of each tensor's bits (64-bit for 8-byte types): any
single flipped bit changes it, and it reads memory once at full bandwidth (about 3 ms per 100 MB
on one core here). A mismatch names the rank (the one whose memory changed) and the tensor; it
needs no replica, so it covers plain FSDP shards, which have none. It runs on every step when
`resilience.sdc_interval` > 0: a flip between two checks would otherwise be absorbed by the next
update and never be seen again.

**In compute** (`ComputeCheck`). Every `resilience.sdc_interval` steps each data-parallel rank's
first microbatch of the step is recomputed by a partner rank of the same tensor-, context- and
pipeline-parallel coordinates (on the same gathered weights: the recomputation runs before the
update), and the checksums of the two computations' final hidden states (the final norm's
output, which every logit comes from, so a changed bit anywhere upstream shows) are compared bit
for bit. Every rank recomputes one partner's microbatch per check, so the cost is one extra
forward of one microbatch per rank per interval. The backward pass is not recomputed (it would
triple the cost): a fault in a backward GEMM is not seen here. The partner rotates: check c pairs
data-parallel rank i with rank i + 1 + (c mod (n - 1)), so over n - 1 checks every rank is
compared with every other. A mismatch is replayed: the owner recomputes its microbatch again
and (with three or more data-parallel ranks) a third rank computes it too. The owner is named
`transient` when its replay agrees with the partner (its step's computation was wrong once),
`persistent` when its replay repeats its own result and the third rank agrees with the partner;
the partner is named when the third rank agrees with the owner. With two ranks a repeated
disagreement names both as suspects. Pipeline parallelism is not checked in compute (a stage's
microbatch cannot be recomputed outside the schedule); its state is checked at rest.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def sums(tensors: list[torch.Tensor]) -> torch.Tensor:
    """One exact bit checksum per tensor (wrapping integer sums), as one int64 tensor."""
    out = []
    for t in tensors:
        t = t.detach().reshape(-1)
        if t.element_size() == 8:
            out.append(t.view(torch.int64).sum(dtype=torch.int64))
        else:
            width = {4: torch.int32, 2: torch.int16, 1: torch.int8}[t.element_size()]
            out.append(t.view(width).sum(dtype=torch.int32).to(torch.int64))
    if not out:
        return torch.zeros(0, dtype=torch.int64)
    return torch.stack(out)


def _world() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def ranks_with(flag: bool, device) -> list[int]:
    """Every rank learns which ranks raised `flag` (collective; one small all-gather)."""
    if not _world():
        return [0] if flag else []
    t = torch.tensor([int(flag)], dtype=torch.int64, device=device)
    table = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(table, t)
    return [r for r, f in enumerate(table) if int(f)]


class StateLedger:
    """Checksums of this rank's parameters, optimizer state and gradients (module docstring)."""

    def __init__(self, engine):
        self.engine = engine
        self._state: tuple[list[str], torch.Tensor] | None = None
        self._grads: tuple[list[str], torch.Tensor] | None = None

    def _owned(self) -> list[tuple[str, torch.Tensor]]:
        """(name, parameter) of what the optimizers update: the parameters this rank owns (the
        objects the optimizer holds; FSDP swaps the module's registered ones while gathered)."""
        names: dict[int, str] = {}
        for k, part in enumerate(self.engine.parts):
            for name, p in part.named_parameters():
                names[id(p)] = name if len(self.engine.parts) == 1 else f"{k}.{name}"
        out = []
        for i, opt in enumerate(self.engine.optimizers):
            for g in getattr(opt, "param_groups", []):
                for j, p in enumerate(g.get("params", [])):
                    if isinstance(p, torch.Tensor):
                        out.append((names.get(id(p), f"optimizer{i}.{j}"), p))
        if not out:   # an optimizer tier without torch parameter groups
            out = [(n, p) for n, p in
                   ((n, p) for k, part in enumerate(self.engine.parts)
                    for n, p in part.named_parameters())]
        return out

    # what this rank owns
    def params(self) -> list[tuple[str, torch.Tensor]]:
        return [(f"param {n}", _local(p)) for n, p in self._owned() if _local(p).numel()]

    def optim(self) -> list[tuple[str, torch.Tensor]]:
        out = []
        for n, p in self._owned():
            for opt in self.engine.optimizers:
                st = getattr(opt, "state", {}).get(p)
                if not isinstance(st, dict):
                    continue
                for key, v in st.items():
                    if isinstance(v, torch.Tensor) and _local(v).numel():
                        out.append((f"optimizer {n}.{key}", _local(v)))
        return out

    def grads(self) -> list[tuple[str, torch.Tensor]]:
        return [(f"grad {n}", _local(p.grad)) for n, p in self._owned()
                if p.grad is not None and _local(p.grad).numel()]

    @staticmethod
    def _take(items) -> tuple[list[str], torch.Tensor]:
        return [n for n, _ in items], sums([t for _, t in items])

    @staticmethod
    def _diff(before, items) -> list[str]:
        if before is None:
            return []
        names, now = StateLedger._take(items)
        old_names, old = before
        if names != old_names:     # state appeared (the optimizer's first step): compare common
            old_map = dict(zip(old_names, old.tolist()))
            return [n for n, v in zip(names, now.tolist()) if n in old_map and old_map[n] != v]
        if torch.equal(now, old):
            return []
        bad = (now != old).nonzero().reshape(-1).tolist()
        return [names[i] for i in bad]

    # record right after a write, verify before a use
    def record_state(self) -> None:
        self._state = self._take(self.params() + self.optim())

    def verify_state(self) -> list[str]:
        """The tensors whose bits changed since `record_state` (empty: intact)."""
        return self._diff(self._state, self.params() + self.optim())

    def record_grads(self) -> None:
        self._grads = self._take(self.grads())

    def verify_grads(self) -> list[str]:
        found = self._diff(self._grads, self.grads())
        self._grads = None
        return found


# ---------------------------------------------------------------------------------------------
# In compute


def dp_group(engine):
    """The process group of the ranks that differ only in their data-parallel coordinate (same
    tensor, context and pipeline coordinates), or None with one such rank."""
    dims = engine.dims
    if dims.dp_mesh is None or dims.dp <= 1:
        return None
    mesh = dims.dp_mesh
    if mesh.ndim > 1:
        mesh = mesh._flatten("sdc_dp")
    return mesh.get_group()


class ComputeCheck:
    """Partner recomputation of one microbatch per data-parallel rank (module docstring)."""

    def __init__(self, engine):
        self.engine = engine
        self.group = dp_group(engine) if engine.schedule is None else None
        self.ranks = dist.get_process_group_ranks(self.group) if self.group is not None else []
        self.count = 0
        self.captured: torch.Tensor | None = None
        self._hook = None

    @property
    def enabled(self) -> bool:
        return len(self.ranks) > 1

    def _watched(self):
        """The module whose output is compared: the final norm (the hidden states every token's
        logits come from: a changed bit anywhere upstream changes them), else the model."""
        base = getattr(self.engine.model, "module", self.engine.model)   # DDP wraps it
        return getattr(base, "norm", None) or self.engine.model

    # the step's first microbatch, as the training forward computed it
    def capture(self) -> None:
        """Record the checksum of the next forward's hidden states (the step's first
        microbatch)."""
        self.cancel()
        self.captured = None

        def hook(mod, args, out):
            self.captured = sums([_local(out)])[0]
            self.cancel()

        self._hook = self._watched().register_forward_hook(hook)

    def cancel(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

    @torch.no_grad()
    def recompute(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The checksum of microbatch (x, y)'s hidden states computed here, the way the
        training forward does (training mode, same kernels; no gradients kept). FSDP modules
        are resharded afterwards: one that keeps its parameters gathered after a forward (the
        root, zero2) would otherwise carry this step's weights into the next step's forward,
        past the update."""
        e = self.engine
        self.capture()
        doc = e._documents(x.unsqueeze(0))[0]
        kw = {} if doc is None else {"documents": doc}
        xs = e._shard_sequence(x)
        try:
            with e._ctx():
                if e.dims.tp > 1:
                    e.model(xs, **kw)
                else:
                    e.model(xs, e._shard_sequence(y), **kw)
        finally:
            self.cancel()
            _reshard(e.parts)
        out, self.captured = self.captured, None
        return out

    def check(self, inputs: torch.Tensor, targets: torch.Tensor) -> dict | None:
        """Compare; collective over the whole world (every rank calls it at the same steps).
        Returns None when all agree, else the verdict (the same on every rank)."""
        e = self.engine
        self.cancel()
        n = len(self.ranks)
        me = self.ranks.index(dist.get_rank())
        k = 1 + self.count % (n - 1)           # this check's partner offset
        self.count += 1
        x, y = inputs[0], targets[0]
        own = self.captured if self.captured is not None else self.recompute(x, y)
        self.captured = None
        xs = [torch.empty_like(x) for _ in range(n)]
        ys = [torch.empty_like(y) for _ in range(n)]
        dist.all_gather(xs, x, group=self.group)
        dist.all_gather(ys, y, group=self.group)
        j = (me - k) % n                       # the rank whose microbatch this one recomputes
        theirs = self.recompute(xs[j], ys[j])
        vals = self._gather_bits([own, theirs])            # [n, 2]
        # owner i: T = vals[i][0]; its checker (i + k) computed P = vals[(i + k) % n][1]
        bad = [i for i in range(n) if vals[i][0] != vals[(i + k) % n][1]]
        flag = torch.tensor([len(bad)], dtype=torch.int64, device=e.device)
        dist.all_reduce(flag)   # every rank of the world learns that some group disagreed
        if not int(flag):
            return None
        # replay: the owner again, and a third rank (offset k2) if there is one
        k2 = next((o for o in range(1, n) if o != k), None)
        again = self.recompute(x, y)
        third = self.recompute(xs[(me - k2) % n], ys[(me - k2) % n]) if k2 else again
        rep = self._gather_bits([again, third])
        verdicts: dict[str, dict] = {}
        for i in bad:
            owner, checker = self.ranks[i], self.ranks[(i + k) % n]
            t, p, r = vals[i][0], vals[(i + k) % n][1], rep[i][0]
            q = rep[(i + k2) % n][1] if k2 else None
            if r == p:
                v = {"rank": owner, "verdict": "transient"}
            elif r == t and q is not None and q == p:
                v = {"rank": owner, "verdict": "persistent"}
            elif r == t and q is not None and q == t:
                v = {"rank": checker, "verdict": "persistent"}
            elif r == t:
                v = {"rank": None, "suspects": [owner, checker],
                     "verdict": "persistent (two ranks disagree; no third to decide)"}
            else:
                v = {"rank": None, "suspects": [owner], "verdict": "inconsistent"}
            v.update(microbatch_of=owner, recomputed_by=checker,
                     third=self.ranks[(i + k2) % n] if k2 else None,
                     checksums={"own": t, "partner": p, "replay": r})
            verdicts[str(owner)] = v
        return {"group": self.ranks, "mismatches": verdicts}

    def _gather_bits(self, values: list[torch.Tensor]) -> list[list[int]]:
        """Each rank's checksums, for every rank of the group."""
        local = torch.stack([v.reshape(()) for v in values]).to(self.engine.device)
        table = [torch.empty_like(local) for _ in self.ranks]
        dist.all_gather(table, local, group=self.group)
        return [t.tolist() for t in table]



def _reshard(parts) -> None:
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
