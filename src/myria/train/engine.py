"""The model as the training loop sees it, whatever the parallel layout.

`Engine` builds the model on the meta device, splits it into pipeline stages (pp > 1), applies
tensor/sequence, context, expert and data parallelism to each part in that order, materialises
and initialises the parts, and owns their optimizers and schedules. The loop calls
`forward_backward` on a batch, `clip_grads`, `step`, and for checkpoints `state_dict` /
`load_state_dict`, whose keys are the plain model's parameter names whatever the layout, so a
checkpoint saved under one layout loads under any other.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from myria.config import Config
from myria.errors import ConfigError
from myria.layout import Layout
from myria.models.transformer import build_model
from myria.observe import events
from myria.offload.tier import optimizer_tier
from myria.optim.schedules import build_scheduler
from myria.parallel import pipeline
from myria.parallel.dims import ParallelDims, single_rank_mesh
from myria.parallel.parallelize import apply_ddp, parallelize
from myria.tensors import full_value, local_shard
from myria.train.preflight import check_run
from myria.train.state import seed_rng


def grad_sync(model: nn.Module, enabled: bool):
    """Gradient synchronisation on or off, for gradient accumulation (FSDP2 or DDP)."""
    if hasattr(model, "set_requires_gradient_sync"):  # FSDP2
        model.set_requires_gradient_sync(enabled)
        return contextlib.nullcontext()
    if not enabled and isinstance(model, nn.parallel.DistributedDataParallel):
        return model.no_sync()
    return contextlib.nullcontext()


def _time_stages(schedule) -> None:
    """Record each pipeline stage's forward and backward of every microbatch in the event
    timer: torch's pipelining exposes no hooks, so the stage objects' per-chunk methods are
    wrapped (forward_one_chunk, backward_one_chunk, backward_weight_one_chunk)."""
    stages = getattr(schedule, "_stages", None) or [getattr(schedule, "_stage", None)]
    for st in stages:
        if st is None:
            continue
        for meth, name in (("forward_one_chunk", "forward"), ("backward_one_chunk", "backward"),
                           ("backward_weight_one_chunk", "backward_weight")):
            fn = getattr(st, meth, None)
            if fn is None:
                continue

            def timed(*a, _fn=fn, _name=name, _stage=st.stage_index, **kw):
                mb = a[0] if a else kw.get("fwd_chunk_id", kw.get("bwd_chunk_id"))
                with events.current().compute(_name, mb=mb, stage=_stage):
                    return _fn(*a, **kw)

            setattr(st, meth, timed)


class Engine:
    """Model parts, optimizers and schedules of this rank, built for the run's layout."""

    def __init__(self, cfg: Config, dims: ParallelDims | None, device: torch.device,
                 run_dir=None, eos_id: int | None = None, shrunk: bool = False):
        self.cfg, self.device = cfg, device
        seed_rng(cfg.training.seed)
        self.eos_id = eos_id  # the document separator, for model.document_mask
        # the layout's mesh, groups and this rank's coordinates (one process: no mesh)
        self.dims = dims = dims or ParallelDims.build(Layout.resolve(cfg.parallel, 1),
                                                      device.type)
        lay, t = dims.layout, cfg.training
        check_run(cfg, lay, device.type, shrunk)   # the one place a layout is accepted
        # where the optimizer state (and parameters kept off the device) live: myria.offload
        self.tier = optimizer_tier(cfg, run_dir, dist.get_rank() if dist.is_initialized() else 0)
        lay.microbatches(t.global_batch, t.micro_batch, shrunk)   # refuses what does not divide
        self.share = lay.share(t.global_batch, t.micro_batch, dims.dp_rank)
        self.microbatches = len(self.share.microbatches)
        fsdp = lay.shards_with_fsdp(cfg, device.type)
        if fsdp and dims.fsdp_mesh is None:  # one process in bf16 or with host offload
            dims.fsdp_mesh = single_rank_mesh(device.type)

        model = build_model(cfg.model, "meta")
        if lay.pp > 1:
            parts, self.stage_ids = pipeline.build_stages(model, cfg.model, dims.pp_rank,
                                                          lay.pp, lay.vpp, lay.schedule)
        else:
            parts, self.stage_ids = [model], [0]
        # torch 2.13's zero-bubble schedules compute weight gradients after FSDP2 has reduced
        # them (our parity test sees the difference): there, data-parallel gradients are
        # all-reduced once after the schedule instead, without sharding.
        self.manual_dp = lay.manual_reduce(t.data_parallel)
        for part in parts:
            parallelize(part, dims, cfg, device, fsdp=fsdp)
            self.tier.materialise(part, device, t.seed)
        if dims.fsdp_mesh is not None and t.data_parallel == "ddp":
            parts = [apply_ddp(parts[0], dims.dp_mesh, device)]
            self._settle_ddp_buckets(parts[0], cfg.model.seq_len)
        self.parts: list[nn.Module] = parts
        self.model = parts[0]
        self.optimizers = self.tier.build(parts, lay, device.type)
        self.schedulers = [build_scheduler(o, cfg.optimizer, t.steps) for o in self.optimizers]
        self.schedule = None
        # a tied embedding under pipelining: copies on the first and last stage (pipeline.py)
        self.tied = pipeline.TiedEmbedding(parts, self.stage_ids, lay.stages, dims) \
            if lay.pp > 1 and cfg.model.tie_embeddings else None
        if lay.pp > 1:
            self.schedule = pipeline.build_schedule(
                parts, self.stage_ids, lay.stages, lay.schedule, self.microbatches,
                self._loss_fn, device, dims.pp_group)
            _time_stages(self.schedule)
        self.has_first = 0 in self.stage_ids
        self.has_last = (lay.stages - 1) in self.stage_ids

    def _settle_ddp_buckets(self, ddp: nn.Module, seq_len: int) -> None:
        """One throw-away forward and backward so that DDP rebuilds its gradient buckets now.

        DDP reduces the first iteration after its construction in buckets of parameter order
        and every later one in buckets of gradient-ready order; the sum of an element then
        happens in a different order (gloo's and NCCL's ring chunks follow the buffer layout),
        so a run resumed at step N would differ in the last bits from one that trained through
        step N. With the rebuild done here, every real step of every run uses the same buckets.
        The gradients are dropped and the random-number state is put back."""
        cpu_rng = torch.get_rng_state()
        cuda_rng = torch.cuda.get_rng_state_all() if self.device.type == "cuda" else None
        x = torch.zeros(1, seq_len, dtype=torch.long, device=self.device)
        with self._ctx():
            loss = ddp(x, x) if self.dims.tp == 1 else self._loss_fn(ddp(x), x)
        loss.backward()
        ddp.zero_grad(set_to_none=True)
        torch.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)

    # -- one step ----------------------------------------------------------------------------
    def _loss_fn(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())

    def _ctx(self):
        stack = contextlib.ExitStack()
        if self.dims.tp > 1 and self.cfg.parallel.loss_parallel:
            from torch.distributed.tensor.parallel import loss_parallel
            stack.enter_context(loss_parallel())
        if self.dims.cp > 1 and self.cfg.parallel.cp_impl == "torch":
            # GPU only: torch's ring SDPA on sequences we already sharded
            from torch.distributed.tensor.experimental import context_parallel
            stack.enter_context(context_parallel(self.dims.sub("cp"), buffers=[],
                                                 buffer_seq_dims=[]))
        return stack

    def _shard_sequence(self, x: torch.Tensor) -> torch.Tensor:
        if self.dims.cp == 1:
            return x
        from myria.parallel.context import shard_sequence
        return shard_sequence(x, self.dims.cp_rank, self.dims.cp, dim=-1)

    def _documents(self, inputs: torch.Tensor):
        """Per microbatch, the model's `documents` argument (model.document_mask): document ids
        of the whole sequence and this rank's positions; None without document masking."""
        if not self.cfg.model.document_mask:
            return [None] * inputs.shape[0]
        if self.eos_id is None:
            raise ConfigError("model.document_mask needs the data's EOS token id (the engine "
                              "was built without one)")
        from myria.models.attention import document_segments
        ids, pos = document_segments(inputs, self.eos_id)
        pos = self._shard_sequence(pos) if self.cfg.model.document_positions else None
        return [(ids[i], None if pos is None else pos[i]) for i in range(inputs.shape[0])]

    def forward_backward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Run all microbatches (inputs: [accum, micro, seq]); return this rank's mean loss."""
        docs = self._documents(inputs)
        inputs, targets = self._shard_sequence(inputs), self._shard_sequence(targets)
        if self.schedule is not None:
            return self._pipelined(inputs, targets)
        accum = inputs.shape[0]
        div = self.divisor
        loss_sum = torch.zeros((), device=self.device)
        rec = events.current()
        # zero2 keeps each block gathered from forward to backward: across the microbatches
        # too (resharded after the last one's backward), so a step gathers each unit once
        keep = self.cfg.training.data_parallel == "zero2" and hasattr(
            self.model, "set_reshard_after_backward")
        for i in range(accum):
            kw = {} if docs[i] is None else {"documents": docs[i]}
            if keep:
                self.model.set_reshard_after_backward(i == accum - 1)
            with grad_sync(self.model, i == accum - 1), self._ctx():
                with rec.compute("forward", mb=i, stage=0):
                    if self.dims.tp > 1:  # vocabulary-sharded logits, loss on the shards
                        loss = self._loss_fn(self.model(inputs[i], **kw), targets[i]) / div
                    else:  # fused, chunked output projection + cross-entropy
                        loss = self.model(inputs[i], targets[i], **kw) / div
                if i == accum - 1:
                    self.tier.before_last_backward()
                with rec.compute("backward", mb=i, stage=0):
                    loss.backward()
            loss_sum += full_value(loss.detach())
        return loss_sum

    @property
    def divisor(self) -> float:
        """What each of this rank's microbatch losses is divided by (`Layout.share`; the
        training step and the silent-corruption check's recomputation both use it)."""
        return self.share.loss_divisor

    def _pipelined(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = inputs.reshape(-1, inputs.shape[-1])
        y = targets.reshape(-1, targets.shape[-1])
        losses = self._run_schedule(self.schedule.step, x, y)
        if self.tied is not None:
            self.tied.sum_grads()
        if self.manual_dp:
            self._all_reduce_grads()
        loss = torch.stack([full_value(lo.detach()) for lo in losses]).mean() if losses else \
            torch.zeros((), device=self.device)
        dist.all_reduce(loss, group=self.dims.pp_group)  # only the last stage's is non-zero
        return loss

    def _run_schedule(self, run, x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
        """One call of the schedule's `step` or `eval`: the first stage feeds the inputs, the
        last the targets; returns the last stage's per-microbatch losses (empty elsewhere)."""
        losses: list[torch.Tensor] = []
        with self._ctx():
            if self.has_first:
                run(x, target=y if self.has_last else None, losses=losses)
            elif self.has_last:
                run(target=y, losses=losses)
            else:
                run()
        return losses

    def _all_reduce_grads(self) -> None:
        """Average gradients over the data- and context-parallel ranks, one flat buffer."""
        grads = [p.grad for m in self.parts for p in m.parameters() if p.grad is not None]
        local = [local_shard(g) for g in grads]
        flat = torch.cat([g.reshape(-1) for g in local])
        dist.all_reduce(flat, group=self.dims.loss_group)
        flat /= dist.get_world_size(self.dims.loss_group)
        offset = 0
        for g in local:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()

    def clip_grads(self, max_norm: float) -> float:
        """Clip the global gradient norm across all parts and pipeline ranks; return it."""
        from myria.parallel import expert  # norms of gradients that live on several meshes

        params = [p for m in self.parts for p in m.parameters() if p.grad is not None]
        copy = self.tied.copy if self.tied is not None else None  # counted once, on stage 0
        norm = expert.grad_norm([p for p in params if p is not copy], foreach=True)
        norm = full_value(norm)
        if self.dims.pp > 1:
            sq = norm.pow(2)
            dist.all_reduce(sq, group=self.dims.pp_group)
            norm = sq.sqrt()
        value = float(norm)   # the clip's one wait for the device
        scaled = expert.clip_coef(max_norm, value) < 1.0
        self.tier.on_clip(scaled)   # before the gradients change
        if scaled:
            expert.clip_grads_with_norm_(params, max_norm, value)
        return value

    def gradients_changed(self) -> None:
        """Gradients were changed after backward (a fault injected into one)."""
        self.tier.on_grads_changed()

    def step(self) -> None:
        for opt, sched in zip(self.optimizers, self.schedulers):
            opt.step()
            opt.zero_grad(set_to_none=True)
            sched.step()

    def skip_step(self) -> None:
        """No update for this batch (a numerical fault): its gradients are dropped and the
        learning-rate schedule goes on, so the schedule stays a function of the step."""
        for opt, sched in zip(self.optimizers, self.schedulers):
            opt.zero_grad(set_to_none=True)
            sched.step()

    @property
    def lr(self) -> float:
        return self.schedulers[0].get_last_lr()[0]

    def mean_over_dp(self, value: torch.Tensor) -> float:
        """Average a per-rank scalar over the data- and context-parallel ranks."""
        group = self.dims.loss_group
        if group is not None:
            value = value.clone()
            dist.all_reduce(value, op=dist.ReduceOp.SUM, group=group)
            value /= dist.get_world_size(group)
        return float(value)

    @property
    def eval_rows(self) -> int:
        """Samples of one evaluation forward: a microbatch, or under pipelining the schedule's
        whole batch (its microbatches, each of micro_batch samples)."""
        mb = self.cfg.training.micro_batch
        return mb if self.schedule is None else mb * self.microbatches

    @torch.no_grad()
    def eval_sum(self, samples: torch.Tensor, real: int) -> torch.Tensor:
        """The sum, over the first `real` of `samples` ([eval_rows or fewer, seq_len + 1]; the
        rest padding), of each sample's share of its forward's mean loss: a forward's mean
        loss times its real samples. Without gradients; every pipeline rank returns it."""
        if self.schedule is None:
            loss = self.eval_loss(samples[:, :-1], samples[:, 1:])
            return loss * real if real else torch.zeros((), device=self.device)
        return self._eval_pipelined(samples, real)

    def _eval_pipelined(self, samples: torch.Tensor, real: int) -> torch.Tensor:
        """`eval_sum` through the schedule's forward-only pass (torch's `eval`, the stages'
        training path without backward). A microbatch partly padding ignores its padded rows'
        targets (cross-entropy's ignore_index), so its loss is its real samples' mean, as one
        forward of those samples alone gives; one wholly padding keeps real targets (a mean
        over no token is NaN) and weighs nothing."""
        mb, n = self.cfg.training.micro_batch, self.microbatches
        rows = samples.shape[0]
        if rows < mb * n:   # the schedule splits exactly its batch: pad with the first row
            samples = torch.cat([samples, samples[:1].expand(mb * n - rows, -1)])
        inputs, targets = samples[:, :-1], samples[:, 1:].clone()
        weights = [min(max(real - m * mb, 0), mb) for m in range(n)]
        for m, k in enumerate(weights):
            if 0 < k < mb:
                targets[m * mb + k:(m + 1) * mb] = -100   # F.cross_entropy's ignore_index
        x, y = self._shard_sequence(inputs), self._shard_sequence(targets)
        for part in self.parts:
            part.eval()
        try:
            with events.current().paused():   # not the step's forwards (_time_stages)
                losses = self._run_schedule(self.schedule.eval, x, y)
        finally:
            for part in self.parts:
                part.train()
        total = torch.zeros((), device=self.device)
        for lo, k in zip(losses, weights, strict=False):
            if k:
                total += full_value(lo) * k
        dist.all_reduce(total, group=self.dims.pp_group)  # only the last stage's is non-zero
        return total

    @torch.no_grad()
    def eval_loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean loss of one microbatch without gradients (not pipelined: `eval_sum` is)."""
        if self.schedule is not None:
            raise ValueError("eval_loss runs one microbatch without a pipeline; under "
                             "pipelining evaluate with eval_sum")
        doc = self._documents(inputs.unsqueeze(0))[0]
        kw = {} if doc is None else {"documents": doc}
        inputs, targets = self._shard_sequence(inputs), self._shard_sequence(targets)
        self.model.eval()
        try:
            with self._ctx():
                if self.dims.tp > 1:
                    loss = self._loss_fn(self.model(inputs, **kw), targets)
                else:
                    loss = self.model(inputs, targets, **kw)
            return full_value(loss)
        finally:
            self.model.train()

    # -- checkpoint state --------------------------------------------------------------------
    _OPTS = StateDictOptions(flatten_optimizer_state_dict=True)

    def state_dict(self) -> dict:
        """{"model": {name: tensor}, "optim": {flat name: tensor}} keyed by plain names."""
        model_sd, optim_sd = {}, {}
        for part, opt in zip(self.parts, self.optimizers):
            model_sd.update(get_model_state_dict(part, options=self._OPTS))
            optim_sd.update(get_optimizer_state_dict(part, opt, options=self._OPTS))
        model_sd.update(self.tier.file_backed_state())  # parameters kept in files, mapped
        if self.tied is not None:
            optim_sd = self.tied.optim_to_checkpoint(optim_sd)
        return {"model": model_sd, "optim": optim_sd}

    def load_state_dict(self, state: dict) -> None:
        optim_sd = state["optim"]
        if self.tied is not None:
            optim_sd = self.tied.optim_from_checkpoint(optim_sd)
        for part, opt in zip(self.parts, self.optimizers):
            set_model_state_dict(part, state["model"], options=StateDictOptions(strict=False))
            set_optimizer_state_dict(part, opt, optim_sd, options=self._OPTS)

    def fill_parameters(self, read) -> None:
        """Replace the initial parameter values before the first step (the offload tier's
        `fill_parameters`: `read({name: parameter})` fills them in place)."""
        self.tier.fill_parameters(self.parts, read)

    # state kept in files (the nvme tier): linked into checkpoints (myria.train.checkpoint)
    def checkpoint_files(self) -> dict:
        return self.tier.checkpoint_files()

    def checkpoint_checks(self) -> dict:
        return self.tier.checkpoint_checks()

    def check_checkpoint(self, path, meta: dict) -> None:
        self.tier.check_checkpoint(path, meta)

    def file_backed_keys(self) -> list[str]:
        """Model keys a checkpoint restores through `load_checkpoint_files`, not DCP."""
        return list(self.tier.file_backed_state())

    def load_checkpoint_files(self, path) -> None:
        self.tier.load_files(path)

    def close(self) -> None:
        self.tier.close()

    def scheduler_state(self) -> dict:
        return self.schedulers[0].state_dict()

    def load_scheduler_state(self, state: dict) -> None:
        for s in self.schedulers:
            s.load_state_dict(state)
