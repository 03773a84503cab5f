"""Silent data corruption on every layout: state at rest, and computation.

`StateLedger` (at rest): each rank keeps an exact checksum (the wrapping 32-bit integer sum of
each tensor's bits, 64-bit for 8-byte types) of its local parameter shards and optimizer state,
recorded when the optimizer writes them and verified before the next update and before every
checkpoint (a change before the forward is found there, before any gradient computed from it is
applied, so a check at the step's start would add a read of the state and find nothing more), and of
its reduced gradients, recorded as the reduction writes each one (FSDP2 without a pipeline: the
rest of the backward is guarded; other layouts write gradients after the reduction too, and
record them once the backward is done) and verified before clipping. A mismatch
names the rank and the tensor; `retest` calls it `persistent` (the memory does not hold a
rewrite) or `transient`.

`ComputeCheck` (in compute): every `resilience.sdc_interval` steps each data-parallel rank's
first microbatch is recomputed, forward and backward, by a partner of the same tensor-,
context- and pipeline-parallel coordinates (partner of rank i at check c:
i + 1 + (c mod (n - 1))), and three checksums are compared bit for bit: the forward's result,
the input gradient (the data-gradient GEMMs) and the weight gradients of one transformer block,
which rotates from check to check (block c mod L of each model part: the weight-gradient GEMMs
of every block in turn, at the cost of one block's). A mismatch is replayed and names the owner
`transient` or `persistent`, or the partner (two ranks alone: myria.train.sdc_probe decides).
The rules and their reasons: docs/robustness.md, "Reasons behind ... SDC modules".
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from myria.tensors import local_data, local_shard
from myria.train.checksums import one_sum, storage_key, sums
from myria.train.sdc_probe import KnownAnswerProbe, decide, first_block, reshard


def stick(t: torch.Tensor, bit: int = 22) -> tuple:
    """The `bitflip ... sticky=yes` fault at rest: flip one bit of the first element of a
    tensor's local shard and keep it there (a cell stuck at its new value; `StateLedger.retest`
    finds it). Returns the stuck cell for `StateLedger.stuck`."""
    t = local_shard(t.detach())
    v = t.reshape(-1)[:1].view({4: torch.int32, 2: torch.int16, 8: torch.int64}[t.element_size()])
    v.bitwise_xor_(1 << bit)
    return (t, 0, bit, int(v.item() >> bit) & 1)


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
        self._keys: list[tuple] = []   # storage_key of each tensor of `_state`
        self._grads: tuple[list[str], torch.Tensor] | None = None
        self._early: dict[int, torch.Tensor] = {}   # id(param) -> its gradient's checksum
        self._grad_hooks: list = []                  # handles of `watch_grads`' hooks
        self._watched: tuple = ()                    # the owned ids they were chosen from
        self._hooked: set[int] = set()               # ids of the parameters they watch
        self.stuck: list[tuple] = []   # (tensor, index, bit, value): stuck cells (fault hook)
        self._owned_ids: tuple = ()    # the optimizers' parameters `_owned_names` names
        self._owned_names: list[str] = []

    def _owned(self) -> list[tuple[str, torch.Tensor]]:
        """(name, parameter) of what the optimizers update: the parameters this rank owns (the
        objects the optimizer holds; FSDP swaps the module's registered ones while gathered).
        The names are looked up again only when the optimizers hold other objects: walking
        the modules costs as much as summing a small model's state."""
        held = [(i, j, p) for i, opt in enumerate(self.engine.optimizers)
                for g in getattr(opt, "param_groups", [])
                for j, p in enumerate(g.get("params", [])) if isinstance(p, torch.Tensor)]
        ids = tuple(id(p) for _, _, p in held)
        if ids != self._owned_ids:
            names: dict[int, str] = {}
            for k, part in enumerate(self.engine.parts):
                for name, p in part.named_parameters():
                    names[id(p)] = name if len(self.engine.parts) == 1 else f"{k}.{name}"
            self._owned_names = [names.get(id(p), f"optimizer{i}.{j}") for i, j, p in held]
            # kept only when every parameter was found (not while FSDP has swapped some)
            self._owned_ids = ids if all(id(p) in names for _, _, p in held) else ()
        out = [(n, p) for n, (_, _, p) in zip(self._owned_names, held)]
        if not out:   # an optimizer tier without torch parameter groups
            out = [(n, p) for n, p in
                   ((n, p) for k, part in enumerate(self.engine.parts)
                    for n, p in part.named_parameters())]
        return out

    # what this rank owns (the local tensors themselves: `local_data`)
    def params(self) -> list[tuple[str, torch.Tensor]]:
        return [(f"param {n}", t) for n, t in ((n, local_data(p)) for n, p in self._owned())
                if t.numel()]

    def optim(self) -> list[tuple[str, torch.Tensor]]:
        out = []
        for n, p in self._owned():
            for opt in self.engine.optimizers:
                st = getattr(opt, "state", {}).get(p)
                if not isinstance(st, dict):
                    continue
                for key, v in st.items():
                    if isinstance(v, torch.Tensor) and (t := local_data(v)).numel():
                        out.append((f"optimizer {n}.{key}", t))
        return out

    def grads(self) -> list[tuple[str, torch.Tensor]]:
        return [(name, t) for name, _, t in self._grad_items()]

    def _grad_items(self) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
        """(name, parameter, local gradient) of each owned parameter with a gradient."""
        return [(f"grad {n}", p, t) for n, p, t in
                ((n, p, local_data(p.grad)) for n, p in self._owned() if p.grad is not None)
                if t.numel()]

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
        items = self.params() + self.optim()
        self._state = self._take(items)
        self._keys = [storage_key(t) for _, t in items]

    def recorded(self) -> dict[tuple, int]:
        """{storage_key: checksum} of the state as last recorded (what the optimizer wrote):
        what a copy of it (a checkpoint's snapshot, a peer snapshot) must hold."""
        if self._state is None:
            return {}
        return dict(zip(self._keys, self._state[1].tolist()))

    def verify_state(self) -> list[str]:
        """The tensors whose bits changed since `record_state` (empty: intact)."""
        return self._diff(self._state, self.params() + self.optim())

    def retest(self, names: list[str]) -> str:
        """Tell a transient change at rest from memory that keeps failing: write each changed
        tensor's complement over it and then its value back, checking every bit after each
        write (a march over those words: a cell stuck at 0 or 1 fails one of the two). Only on
        a mismatch; the tensor's value is left as it was found. Returns "transient" or
        "persistent (...)"."""
        found = dict(self.params() + self.optim() + self.grads())
        failed = []
        for name in names:
            t = found.get(name)
            if t is None or not t.is_contiguous():
                continue
            width = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.int8}[
                t.element_size()]
            w = t.detach().view(width)
            keep = w.clone()
            for want in (torch.bitwise_not(keep), keep):
                w.copy_(want)
                self._settle(t)
                if not torch.equal(w, want):
                    failed.append(name)
                    break
            w.copy_(keep)
        if failed:
            return f"persistent (memory of {failed[0]} does not hold a rewrite)"
        return "transient"

    def _settle(self, t: torch.Tensor) -> None:
        """After a write: the fault hook's stuck bits (a `bitflip ... sticky=yes` fault keeps
        its bit at the corrupted value, as a cell stuck at 0 or 1 would)."""
        for tensor, index, bit, value in self.stuck:
            if tensor.data_ptr() == t.data_ptr():
                v = tensor.detach().reshape(-1)[index:index + 1].view(
                    {4: torch.int32, 2: torch.int16, 8: torch.int64}[tensor.element_size()])
                mask = 1 << bit
                v.copy_((v & ~mask) | (mask if value else 0))

    def watch_grads(self) -> None:
        """Call at the start of each step: from here on, each gradient that FSDP2's reduction
        writes for the last time before clipping is checksummed as it is written (a hook run
        by the reduction, on its stream), so that `verify_grads` guards it through the rest of
        the backward. Only where that write is the last: FSDP2 without a pipeline (a pipeline
        stage divides its gradients after the reduction, a tied embedding's copies are summed
        after it), with the optimizer in memory (the NVMe tier consumes gradients inside the
        backward). Elsewhere, and for any gradient the hooks did not see this step,
        `record_grads` takes the checksum after the backward."""
        self._early = {}
        owned = self._owned()
        ids = tuple(id(p) for _, p in owned)
        if ids == self._watched:
            return
        for h in self._grad_hooks:
            h.remove()
        self._grad_hooks, self._watched, self._hooked = [], ids, set()
        if not self.watchable():
            return
        from torch.distributed.fsdp import FSDPModule

        by_fsdp = {id(p) for part in self.engine.parts if isinstance(part, FSDPModule)
                   for p in part.parameters()}
        hooked = [p for _, p in owned if id(p) in by_fsdp]
        self._grad_hooks = [p.register_post_accumulate_grad_hook(self._written) for p in hooked]
        self._hooked = {id(p) for p in hooked}

    def watchable(self) -> bool:
        """Whether this engine's layout lets gradients be recorded as reduced (`watch_grads`)."""
        e = self.engine
        return e.schedule is None and e.tied is None and not e.manual_dp and \
            not e.tier.reads_grads_in_backward

    def watches(self, p: torch.Tensor) -> bool:
        """Whether `p`'s gradient is recorded as the reduction writes it."""
        return id(p) in self._hooked

    def _written(self, p: torch.Tensor) -> None:
        t = local_data(p.grad)
        if t.numel():
            self._early[id(p)] = one_sum(t)

    def record_grads(self) -> None:
        """After the backward: the checksums the reduction's hooks took, and the others now."""
        items = self._grad_items()
        early, self._early = self._early, {}
        late = [t for _, p, t in items if id(p) not in early]
        now = iter(sums(late)) if late else iter(())
        vals = [(early[id(p)] if id(p) in early else next(now)).reshape(1) for _, p, _ in items]
        self._grads = ([n for n, _, _ in items],
                       torch.cat(vals) if vals else torch.zeros(0, dtype=torch.int64))

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


def _base(part):
    return getattr(part, "module", part)   # DDP wraps the model


def rotating_block(part, check: int):
    """(name, module) of the transformer block whose weight gradients check number `check`
    recomputes in `part` (None: a part without blocks)."""
    layers = getattr(_base(part), "layers", None)
    if not layers:
        return None
    names = list(layers.keys())
    name = names[check % len(names)]
    return name, layers[name]


def on_weight_grads(block, fn, hooks: list, every: bool = False) -> None:
    """Call `fn(g)` with each weight gradient of `block` computed by the first backward after its
    next forward (each parameter's, once; what `fn` returns replaces it); `every`: after each
    forward whose parameters have no such call pending. The hooks go on the parameters the
    forward uses (FSDP's gathered ones), which carry the training's microbatch gradient before
    any accumulation or reduction; their handles are added to `hooks`."""
    pending: set = set()

    def pre(mod, args):
        for p in mod.parameters():
            if not p.requires_grad or id(p) in pending:
                continue
            box: list = []

            def hook(g, box=box, key=id(p)):
                box[0].remove()
                pending.discard(key)
                return fn(g)

            pending.add(id(p))
            box.append(p.register_hook(hook))
            hooks.append(box[0])

    box = []

    def once(mod, args):
        if not every:
            box[0].remove()
        pre(mod, args)

    box.append(block.register_forward_pre_hook(once))
    hooks.append(box[0])


def _watched(part):
    """The module whose output is the forward's result: the final norm (the hidden states every
    token's logits come from: a changed bit anywhere upstream changes them), else the part (a
    pipeline stage without the head: the activations it sends on)."""
    return getattr(_base(part), "norm", None) or part


class _Capture:
    """Hooks that take the checksums of one microbatch's forward and backward, as training (or a
    recomputation) runs it: the forward's = the watched module's output; the backward's = the
    gradient of the first block's input (every block's backward data-gradient GEMMs, the head's
    and the loss's lead to it); the weight gradients' = the sum of the checksums of block
    `wblock`'s parameter gradients (training: taken by hooks; a recomputation keeps the
    parameters in `wparams` and asks autograd for their gradients). Under a pipeline it also
    keeps the stage's input and the gradient it received for its output (what a partner needs
    to recompute it), and with `keep_args` the first block's arguments (the known-answer probe's
    input). Each hook acts on its first call only: the step's first microbatch."""

    def __init__(self, part, keep_io: bool, wblock=None, recompute: bool = False,
                 keep_args: bool = False):
        self.fwd: torch.Tensor | None = None
        self.bwd: torch.Tensor | None = None
        self.wsum: torch.Tensor | None = None
        self.wparams: list[torch.Tensor] = []
        self.inp: torch.Tensor | None = None
        self.gout: torch.Tensor | None = None
        self.h: torch.Tensor | None = None
        self.keep_args = keep_args
        self.args: tuple | None = None
        self.hooks: list = []
        self._on(_watched(part), "fwd", self._fwd)
        if (blk := first_block(part)) is not None:
            self._on(blk, "pre", self._pre)
        if keep_io:
            self._on(part, "pre", self._inp)
            self._on(part, "fwd", self._out)
        if wblock is not None and recompute:
            self._on(wblock, "pre", lambda args: self.wparams.extend(
                p for p in wblock.parameters() if p.requires_grad))
        elif wblock is not None:
            on_weight_grads(wblock, self._wgrad, self.hooks)

    def _wgrad(self, g):
        self.add_weight_grads([g])

    def add_weight_grads(self, grads) -> None:
        gs = [local_shard(g) for g in grads if g is not None]
        if gs:
            s = sums(gs).to(gs[0].device).sum()
            self.wsum = s if self.wsum is None else self.wsum + s

    def _on(self, mod, kind, fn):
        box = []

        def once(m, args, *out):
            box[0].remove()
            return fn(args, *out)

        h = mod.register_forward_pre_hook(once) if kind == "pre" else \
            mod.register_forward_hook(once)
        box.append(h)
        self.hooks.append(h)

    def _fwd(self, args, out):
        self.fwd = sums([local_shard(out)])[0]

    def _pre(self, args):
        if self.keep_args:
            self.args = tuple(a.detach().clone() if isinstance(a, torch.Tensor) else a
                              for a in args)
        h = args[0] if args else None
        if isinstance(h, torch.Tensor) and h.requires_grad:
            self.h = h

            def grad(g):
                self.bwd = sums([local_shard(g)])[0]

            h.register_hook(grad)

    def _inp(self, args):
        self.inp = args[0].detach().clone()

    def _out(self, args, out):
        if isinstance(out, torch.Tensor) and out.requires_grad:
            def grad(g):
                self.gout = g.detach().clone()

            out.register_hook(grad)

    def cancel(self):
        for h in self.hooks:
            h.remove()
        self.hooks = []

    def result(self) -> torch.Tensor | None:
        if self.fwd is None or self.bwd is None:
            return None
        w = self.wsum if self.wsum is not None else torch.zeros_like(self.bwd)
        return torch.stack([self.fwd.reshape(()), self.bwd.reshape(()),
                            w.reshape(()).to(self.bwd.device)])


class ComputeCheck:
    """Partner recomputation of one microbatch per data-parallel rank, forward and backward
    (module docstring)."""

    def __init__(self, engine):
        self.engine = engine
        self.pp = engine.schedule is not None
        self.group = dp_group(engine)
        self.ranks = dist.get_process_group_ranks(self.group) if self.group is not None else []
        self.count = 0
        self.wcheck = 0     # the check whose rotating block the captures watch
        self.captures: list[_Capture] = []
        self.probe = KnownAnswerProbe(engine)   # decides between two ranks (sdc_probe)

    @property
    def enabled(self) -> bool:
        return len(self.ranks) > 1

    # the step's first microbatch, as the training forward and backward computed it
    def capture(self) -> None:
        """Take the checksums of this step's first microbatch (forward and backward) as
        training computes them; under a pipeline also each stage's input and output
        gradient."""
        self.cancel()
        self.wcheck = self.count
        self.captures = [_Capture(part, self.pp, self._wblock(part),
                                  keep_args=self.probe.wanted) for part in self.engine.parts]

    def _wblock(self, part):
        b = rotating_block(part, self.wcheck)
        return b[1] if b is not None else None

    def cancel(self) -> None:
        for c in self.captures:
            c.cancel()

    def _last(self, k: int) -> bool:
        e = self.engine
        return e.stage_ids[k] == e.dims.layout.stages - 1

    def _items(self, inputs: torch.Tensor, targets: torch.Tensor) -> list[torch.Tensor] | None:
        """What a partner needs to recompute this rank's first microbatch: the tokens and
        targets; under a pipeline, per stage, its input and (the last stage) its targets or
        (any other) the gradient it received. None: not captured (every rank alike)."""
        if not self.pp:
            return [inputs[0], targets[0]]
        out = []
        for k, c in enumerate(self.captures):
            if c.inp is None or (not self._last(k) and c.gout is None):
                return None
            out += [c.inp, self.engine._shard_sequence(targets[0]) if self._last(k) else c.gout]
        return out

    def recompute(self, items: list[torch.Tensor]) -> torch.Tensor:
        """The checksums [forward, backward] (per part under a pipeline) of the microbatch in
        `items` computed here, the way training does (training mode, same kernels, the same
        loss scaling; the backward computes the input gradients only and leaves the parameters'
        gradients alone, without any gradient reduction). FSDP modules are resharded afterwards:
        one that keeps its parameters gathered after a forward (the root, zero2) would
        otherwise carry this step's weights into the next step's forward, past the update."""
        from myria.train.engine import grad_sync

        e = self.engine
        outs = []
        try:
            with torch.enable_grad():
                if not self.pp:
                    outs.append(self._recompute_model(items[0], items[1]))
                else:
                    for k, part in enumerate(e.parts):
                        inp, other = items[2 * k], items[2 * k + 1]
                        cap = _Capture(part, False, self._wblock(part), recompute=True)
                        try:
                            with grad_sync(part, False), e._ctx():
                                x = inp.detach()
                                if x.is_floating_point():
                                    x.requires_grad_(True)
                                out = part(x)
                                if self._last(k):
                                    loss, gout = e._loss_fn(out, other), None
                                else:
                                    loss, gout = out, other
                                if cap.h is not None:
                                    gs = torch.autograd.grad(loss, [cap.h, *cap.wparams],
                                                             grad_outputs=gout,
                                                             allow_unused=True)
                                    cap.add_weight_grads(gs[1:])
                        finally:
                            cap.cancel()
                        outs.append(self._result(cap))
        finally:
            for part in e.parts:
                if hasattr(part, "set_requires_gradient_sync"):
                    part.set_requires_gradient_sync(True)
            reshard(e.parts)
        return torch.cat(outs)

    def _recompute_model(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        from myria.train.engine import grad_sync

        e = self.engine
        doc = e._documents(x.unsqueeze(0))[0]
        kw = {} if doc is None else {"documents": doc}
        accum = e.divisor   # what training divides each microbatch's loss by
        cap = _Capture(e.model, False, self._wblock(e.model), recompute=True)
        try:
            with grad_sync(e.model, False), e._ctx():
                xs, ys = e._shard_sequence(x), e._shard_sequence(y)
                if e.dims.tp > 1:
                    loss = e._loss_fn(e.model(xs, **kw), ys) / accum
                else:
                    loss = e.model(xs, ys, **kw) / accum
                if cap.h is not None:
                    gs = torch.autograd.grad(loss, [cap.h, *cap.wparams], allow_unused=True)
                    cap.add_weight_grads(gs[1:])
        finally:
            cap.cancel()
        return self._result(cap)

    @staticmethod
    def _result(cap: _Capture) -> torch.Tensor:
        zero = torch.zeros((), dtype=torch.int64)
        return torch.stack([(v if v is not None else zero).reshape(()).cpu()
                            for v in (cap.fwd, cap.bwd, cap.wsum)])

    def _own(self) -> torch.Tensor | None:
        res = [c.result() for c in self.captures]
        if not res or any(r is None for r in res):
            return None
        return torch.cat([r.reshape(-1).cpu() for r in res])

    def check(self, inputs: torch.Tensor, targets: torch.Tensor) -> dict | None:
        """Compare; collective over the whole world (every rank calls it at the same steps).
        Returns None when all agree (or, under a pipeline, when the step's first microbatch was
        not captured), else the verdicts of this rank's group (the same on each of its ranks)
        and `transient`: whether every group's verdict is (the same on every rank)."""
        e = self.engine
        self.cancel()
        n = len(self.ranks)
        me = self.ranks.index(dist.get_rank())
        k = 1 + self.count % (n - 1)           # this check's partner offset
        self.count += 1
        mine = self._items(inputs, targets)
        ready = ranks_with(mine is None, e.device)
        if ready:   # a pipeline step whose first microbatch was not captured: nothing to check
            self.captures = []
            return None
        own = self._own()
        args = [c.args for c in self.captures]   # the probe's input, where it wants one
        self.captures = []
        if own is None:
            own = self.recompute(mine)
        gathered = []
        for t in mine:
            t = t.contiguous()
            parts = [torch.empty_like(t) for _ in range(n)]
            dist.all_gather(parts, t, group=self.group)
            gathered.append(parts)

        def of(i):   # the items of group rank i
            return [g[i] for g in gathered]

        j = (me - k) % n                       # the rank whose microbatch this one recomputes
        theirs = self.recompute(of(j))
        vals = self._gather_bits([own, theirs])            # [n][2][values]
        # owner i: T = vals[i][0]; its checker (i + k) computed P = vals[(i + k) % n][1]
        bad = [i for i in range(n) if vals[i][0] != vals[(i + k) % n][1]]
        flag = torch.tensor([len(bad)], dtype=torch.int64, device=e.device)
        dist.all_reduce(flag)   # every rank of the world learns that some group disagreed
        if not int(flag):
            self.probe.keep(args)   # the known answer, at the first check where all agreed
            return None
        # which pass this rank's own microbatch differs in first (3 forward, 2 input gradient,
        # 1 weight gradients only, 0 none),
        # for every rank of the world, with its data- and pipeline-parallel coordinates
        mine_bad = vals[me][0] != vals[(me + k) % n][1]
        first = next((x for x, (a, b) in enumerate(zip(vals[me][0], vals[(me + k) % n][1]))
                      if a != b), None) if mine_bad else None
        code = 0 if first is None else 3 - first % 3
        world = self._world_codes(code)
        # replay: the owner again, and a third rank (offset k2) if there is one
        k2 = next((o for o in range(1, n) if o != k), None)
        again = self.recompute(mine)
        third = self.recompute(of((me - k2) % n)) if k2 else again
        rep = self._gather_bits([again, third])
        probes = self._probe(bad, vals, rep, k, k2)
        names = []
        for s, part in zip(e.stage_ids, e.parts):
            b = rotating_block(part, self.wcheck)
            ws = f"weight gradients (block {b[0]})" if b is not None else "weight gradients"
            names += [f"stage {s} {w}" if self.pp else w for w in ("forward", "backward", ws)]
        verdicts: dict[str, dict] = {}
        affected: dict[str, dict] = {}
        for i in bad:
            owner, checker = self.ranks[i], self.ranks[(i + k) % n]
            # The tensor/context-parallel peers of a rank compute its microbatch with it: a
            # wrong result on one reaches the others through their collectives. A rank whose
            # peer differs in an earlier pass (its forward, this one only in its backward) is
            # affected through that peer, not named itself.
            peers = [r for r, (dpr, ppr, c) in enumerate(world) if r != owner and
                     (dpr, ppr) == tuple(world[owner][:2])]
            origin = [r for r in peers if world[r][2] > world[owner][2]]
            if origin:
                affected[str(owner)] = {"through": origin}
                continue
            t, p, r = vals[i][0], vals[(i + k) % n][1], rep[i][0]
            q = rep[(i + k2) % n][1] if k2 else None
            if r == p:
                v = {"rank": owner, "verdict": "transient"}
            elif r == t and q is not None and q == p:
                v = {"rank": owner, "verdict": "persistent"}
            elif r == t and q is not None and q == t:
                v = {"rank": checker, "verdict": "persistent"}
            elif r == t:   # each reproduces its own answer: the known-answer probe decides
                v = decide(owner, checker, None if probes is None else
                           (probes[owner][2], probes[checker][2]))
                # a tensor-parallel peer whose probe changed earlier in the computation: the
                # named rank only received its wrong partial result
                early = [] if v["rank"] is None else [
                    x for x, (dpr, ppr, c) in enumerate(probes) if x != v["rank"] and
                    (dpr, ppr) == tuple(probes[v["rank"]][:2]) and 0 <= c < probes[v["rank"]][2]]
                if early:
                    affected[str(owner)] = {"through": early, "probe": v["probe"]}
                    continue
            else:
                v = {"rank": None, "suspects": [owner], "verdict": "inconsistent"}
            later = [r for r in peers if 0 < world[r][2] < world[owner][2]]
            if later:
                v["peers_affected"] = later
            v.update(microbatch_of=owner, recomputed_by=checker,
                     third=self.ranks[(i + k2) % n] if k2 else None,
                     differs=[nm for nm, a, b in zip(names, t, p) if a != b],
                     checksums={"own": t, "partner": p, "replay": r})
            verdicts[str(owner)] = v
        # whether any group's verdict is other than transient (every rank of the world alike:
        # a group whose mismatches all came through another group's rank has none)
        lasting = ranks_with(any(v["verdict"] != "transient" for v in verdicts.values()),
                             e.device)
        return {"group": self.ranks, "mismatches": verdicts, "affected": affected,
                "transient": not lasting}

    def _probe(self, bad, vals, rep, k, k2) -> list[list[int]] | None:
        """[data-parallel rank, pipeline rank, known-answer probe state (sdc_probe.changed)]
        of every rank of the world, the probe run on all of them when some group has a
        persistent disagreement its replays cannot decide; None when none has."""
        n = len(self.ranks)
        open_ = [i for i in bad if rep[i][0] == vals[i][0] and not (
            k2 and rep[(i + k2) % n][1] in (vals[i][0], vals[(i + k) % n][1]))]
        if not ranks_with(bool(open_), self.engine.device):
            return None
        return self._world_codes(self.probe.changed())

    def _world_codes(self, code: int) -> list[list[int]]:
        """[data-parallel rank, pipeline rank, code] of every rank of the world."""
        d = self.engine.dims
        local = torch.tensor([d.dp_rank, d.pp_rank, code], dtype=torch.int64,
                             device=self.engine.device)
        table = [torch.empty_like(local) for _ in range(dist.get_world_size())]
        dist.all_gather(table, local)
        return [t.tolist() for t in table]

    def _gather_bits(self, values: list[torch.Tensor]) -> list[list[list[int]]]:
        """Each rank's checksum vectors, for every rank of the group."""
        local = torch.stack([v.reshape(-1) for v in values]).to(self.engine.device)
        table = [torch.empty_like(local) for _ in self.ranks]
        dist.all_gather(table, local, group=self.group)
        return [t.tolist() for t in table]

