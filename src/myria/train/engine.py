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
from myria.layout import validate_degrees
from myria.models.transformer import build_model
from myria.observe import events
from myria.optim import build_optimizer
from myria.optim.schedules import build_scheduler
from myria.parallel import pipeline
from myria.parallel.mesh import dp_mesh, dp_rank_and_size, fsdp_mesh, loss_group, sub_rank, sub_size
from myria.parallel.parallelize import (
    apply_ac,
    apply_compile,
    apply_cp,
    apply_ddp,
    apply_float8,
    apply_fsdp,
    apply_tp,
)


def _grad_sync(model: nn.Module, enabled: bool):
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


def _local(x: torch.Tensor) -> torch.Tensor:
    """A plain tensor from a (replicated) DTensor loss."""
    return x.full_tensor() if hasattr(x, "full_tensor") else x


def check_layout(cfg: Config, layout: dict[str, int], device_type: str = "cpu") -> None:
    """Divisibility and support rules of the parallel layout, as clear errors."""
    m, p = cfg.model, cfg.parallel
    tp, cp, pp, dp, ep = layout["tp"], layout["cp"], layout["pp"], layout["dp"], layout["ep"]
    if cp > 1 and p.cp_impl == "torch" and (device_type != "cuda" or m.attention_window):
        raise ConfigError("parallel.cp_impl = 'torch' (torch's context_parallel) needs CUDA "
                          "and full causal attention in torch 2.13; use cp_impl = 'ring'")
    validate_degrees(m, tp, cp, p.sequence_parallel)   # shared with the simulator
    if tp > 1 and m.vocab_size % tp:
        raise ConfigError(f"model.vocab_size = {m.vocab_size} must be divisible by parallel.tp ="
                          f" {tp} (the embedding and head are split by vocabulary)")
    if ep > 1:
        if not m.experts:
            raise ConfigError(f"parallel.ep = {ep} needs a mixture-of-experts model "
                              "(model.experts > 0)")
        if dp % ep or m.experts % ep:
            raise ConfigError(f"parallel.ep = {ep} must divide the data-parallel ranks ({dp}) "
                              f"and model.experts = {m.experts}")
    if ep > 1 and cfg.training.data_parallel == "ddp":
        raise ConfigError("parallel.ep > 1 needs training.data_parallel = 'fsdp' or 'zero2' "
                          "(DDP would average different experts together)")
    if m.experts and (tp > 1 or pp > 1 or cp > 1):
        raise ConfigError("mixture-of-experts models run with data and expert parallelism "
                          "(tp = pp = cp = 1) in this version")
    if cfg.training.data_parallel == "ddp" and (tp > 1 or pp > 1 or cp > 1):
        raise ConfigError("training.data_parallel = 'ddp' works with pure data parallelism; use "
                          "'fsdp' or 'zero2' with tp, pp or cp")
    if tp > 1 and m.tie_embeddings:
        raise ConfigError("model.tie_embeddings is not supported with tensor parallelism")
    if pp > 1:
        accum = cfg.training.global_batch // (dp * cfg.training.micro_batch)
        pipeline.validate(m, pp, p.vpp, p.schedule, accum)
    if p.offload_tier != "none" or p.fast_memory_gb:
        from myria.train.offload import check_layout as check_offload
        check_offload(cfg, layout, device_type)


class Engine:
    """Model parts, optimizers and schedules of this rank, built for the run's layout."""

    def __init__(self, cfg: Config, mesh, device: torch.device, run_dir=None):
        self.cfg, self.mesh, self.device = cfg, mesh, device
        t, p = cfg.training, cfg.parallel
        self.dp_rank, self.dp_size = dp_rank_and_size(mesh)
        self.tp, self.cp, self.pp = (sub_size(mesh, n) for n in ("tp", "cp", "pp"))
        self.ep = p.ep
        layout = {"tp": self.tp, "cp": self.cp, "pp": self.pp, "dp": self.dp_size, "ep": self.ep}
        check_layout(cfg, layout, device.type)
        if p.offload_tier == "nvme":  # a memory budget: freed tensors must leave the process
            from myria.train.offload import keep_heap_small

            keep_heap_small()
        self.cp_rank, self.pp_rank = sub_rank(mesh, "cp"), sub_rank(mesh, "pp")
        self.loss_group = loss_group(mesh)
        # ranks that train on the same sequences: one of them reads, the others receive
        inner = tuple(n for n in ("cp", "tp") if sub_size(mesh, n) > 1)
        self.data_group = None
        if inner:
            sub = mesh[inner] if len(inner) > 1 else mesh[inner[0]]
            self.data_group = (sub._flatten("cp_tp") if sub.ndim > 1 else sub).get_group()
        self.pp_group = mesh["pp"].get_group() if self.pp > 1 else None
        self.loss_parallel = self.tp > 1 and p.loss_parallel
        self.torch_cp = self.cp > 1 and p.cp_impl == "torch"
        self.accum = t.global_batch // (self.dp_size * t.micro_batch)

        model = build_model(cfg.model, "meta")
        if self.pp > 1:
            parts, self.stage_ids = pipeline.build_stages(model, cfg.model, self.pp_rank,
                                                          self.pp, p.vpp, p.schedule)
        else:
            parts, self.stage_ids = [model], [0]
        fmesh = fsdp_mesh(mesh)
        if mesh is None and t.data_parallel != "ddp" and p.offload_tier != "nvme":
            from myria.parallel.mesh import single_rank_mesh
            from myria.parallel.parallelize import mixed_precision
            # one process in bf16, or on a GPU with host offload: FSDP2 on one rank, so that
            # its mixed-precision and CPU-offload policies apply as on N ranks
            if mixed_precision(cfg, device.type) is not None or p.offload_tier == "cpu":
                fmesh = single_rank_mesh(device.type)
        use_fsdp = fmesh is not None and t.data_parallel != "ddp"
        self.ep_mesh = self.replica_mesh = None
        if self.ep > 1:  # experts borrow data-parallel ranks (Megatron-LM, torchtitan)
            from myria.parallel.expert import expert_meshes
            self.ep_mesh, self.replica_mesh = expert_meshes(fmesh, self.ep)
        # torch 2.13's zero-bubble schedules compute weight gradients after FSDP2 has reduced
        # them (our parity test sees the difference): there, data-parallel gradients are
        # all-reduced once after the schedule instead, without sharding.
        self.manual_dp = use_fsdp and self.pp > 1 and p.schedule in ("zero-bubble", "zbv")
        use_fsdp = use_fsdp and not self.manual_dp
        for part in parts:
            apply_float8(part, cfg, device, self.tp)  # training.float8 (torchao), else nothing
            if self.tp > 1:
                apply_tp(part, mesh["tp"], p.sequence_parallel, p.loss_parallel)
            if self.cp > 1:
                apply_cp(part, mesh["cp"].get_group(), self.cp_rank, self.cp, cfg.model.seq_len,
                         device, ring=not self.torch_cp)
            if self.ep > 1:
                from myria.parallel.expert import apply_expert_parallel
                apply_expert_parallel(part, self.ep_mesh)
            apply_ac(part, p.activation_checkpoint)
            if p.compile:
                apply_compile(part)
            if use_fsdp:
                apply_fsdp(part, fmesh, cfg, device.type, reshard_root=self.pp > 1,
                           expert_mesh=self.replica_mesh)
            if not p.offload_params:  # else materialised layer by layer (offload_params.py)
                part.to_empty(device=device)
                part.init_weights(t.seed)
        if fmesh is not None and t.data_parallel == "ddp":
            parts = [apply_ddp(parts[0], dp_mesh(mesh), device)]
            self._settle_ddp_buckets(parts[0], cfg.model.seq_len)
        self.parts: list[nn.Module] = parts
        self.model = parts[0]
        self.offload = None  # the nvme tier (parallel.offload = nvme): myria.train.offload
        if p.offload_tier == "nvme":
            from myria.train.offload import Offload
            self.offload = Offload.build(cfg, parts, layout, run_dir,
                                         dist.get_rank() if dist.is_initialized() else 0)
        self.optimizers = self.offload.optimizers if self.offload else \
            [build_optimizer(part, cfg.optimizer) for part in parts]
        self.schedulers = [build_scheduler(o, cfg.optimizer, t.steps) for o in self.optimizers]
        self.schedule = None
        if self.pp > 1:
            self.schedule = pipeline.build_schedule(
                parts, self.stage_ids, self.pp * p.vpp, p.schedule, self.accum, self._loss_fn,
                device, self.pp_group)
        n_stages = self.pp * p.vpp
        if self.schedule is not None:
            _time_stages(self.schedule)
        self.has_first = 0 in self.stage_ids
        self.has_last = (n_stages - 1) in self.stage_ids

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
            loss = ddp(x, x) if self.tp == 1 else self._loss_fn(ddp(x), x)
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
        if self.loss_parallel:
            from torch.distributed.tensor.parallel import loss_parallel
            stack.enter_context(loss_parallel())
        if self.torch_cp:  # GPU only: torch's ring SDPA on sequences we already sharded
            from torch.distributed.tensor.experimental import context_parallel
            stack.enter_context(context_parallel(self.mesh["cp"], buffers=[],
                                                 buffer_seq_dims=[]))
        return stack

    def _shard_sequence(self, x: torch.Tensor) -> torch.Tensor:
        if self.cp == 1:
            return x
        from myria.parallel.context import shard_sequence
        return shard_sequence(x, self.cp_rank, self.cp, dim=-1)

    def forward_backward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Run all microbatches (inputs: [accum, micro, seq]); return this rank's mean loss."""
        inputs, targets = self._shard_sequence(inputs), self._shard_sequence(targets)
        if self.schedule is not None:
            return self._pipelined(inputs, targets)
        accum = inputs.shape[0]
        loss_sum = torch.zeros((), device=self.device)
        rec = events.current()
        for i in range(accum):
            with _grad_sync(self.model, i == accum - 1), self._ctx():
                with rec.compute("forward", mb=i, stage=0):
                    if self.tp > 1:  # vocabulary-sharded logits, loss computed on the shards
                        loss = self._loss_fn(self.model(inputs[i]), targets[i]) / accum
                    else:  # fused, chunked output projection + cross-entropy
                        loss = self.model(inputs[i], targets[i]) / accum
                if i == accum - 1:
                    self._tell_optimizers("last_backward")
                with rec.compute("backward", mb=i, stage=0):
                    loss.backward()
            loss_sum += _local(loss.detach())
        return loss_sum

    def _pipelined(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = inputs.reshape(-1, inputs.shape[-1])
        y = targets.reshape(-1, targets.shape[-1])
        losses: list[torch.Tensor] = []
        with self._ctx():
            if self.has_first:
                self.schedule.step(x, target=y if self.has_last else None, losses=losses)
            elif self.has_last:
                self.schedule.step(target=y, losses=losses)
            else:
                self.schedule.step()
        if self.manual_dp:
            self._all_reduce_grads()
        loss = torch.stack([_local(lo.detach()) for lo in losses]).mean() if losses else \
            torch.zeros((), device=self.device)
        dist.all_reduce(loss, group=self.pp_group)  # only the last stage's is non-zero
        return loss

    def _all_reduce_grads(self) -> None:
        """Average gradients over the data- and context-parallel ranks, one flat buffer."""
        grads = [p.grad for m in self.parts for p in m.parameters() if p.grad is not None]
        local = [g.to_local() if hasattr(g, "to_local") else g for g in grads]
        flat = torch.cat([g.reshape(-1) for g in local])
        dist.all_reduce(flat, group=self.loss_group)
        flat /= dist.get_world_size(self.loss_group)
        offset = 0
        for g in local:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()

    def clip_grads(self, max_norm: float) -> float:
        """Clip the global gradient norm across all parts and pipeline ranks; return it."""
        from myria.parallel import expert  # norms of gradients that live on several meshes

        params = [p for m in self.parts for p in m.parameters() if p.grad is not None]
        norm = expert.grad_norm(params, foreach=True)
        if hasattr(norm, "full_tensor"):
            norm = norm.full_tensor()
        if self.pp > 1:
            sq = norm.pow(2)
            dist.all_reduce(sq, group=self.pp_group)
            norm = sq.sqrt()
        scaled = expert.clip_coef(max_norm, norm) < 1.0
        self._tell_optimizers("clipping", scaled)   # before the gradients change
        if scaled:
            expert.clip_grads_with_norm_(params, max_norm, norm)
        return float(norm)

    def gradients_changed(self) -> None:
        """Gradients were changed after backward (a fault injected into one)."""
        self._tell_optimizers("gradients_changed")

    def _tell_optimizers(self, event: str, *args) -> None:
        """Optimizers that act on the gradients before step() (the nvme tier's update during
        backward: myria.train.offload) hear what happens to them; others have no such method."""
        for opt in self.optimizers:
            if (fn := getattr(opt, event, None)) is not None:
                fn(*args)

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
        if self.loss_group is not None:
            value = value.clone()
            dist.all_reduce(value, op=dist.ReduceOp.SUM, group=self.loss_group)
            value /= dist.get_world_size(self.loss_group)
        return float(value)

    @torch.no_grad()
    def eval_loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean loss of one microbatch without gradients (not pipelined: pp must be 1)."""
        if self.schedule is not None:
            raise ConfigError("evaluation under pipeline parallelism is not supported yet; "
                              "set training.eval_interval = 0")
        inputs, targets = self._shard_sequence(inputs), self._shard_sequence(targets)
        self.model.eval()
        try:
            with self._ctx():
                if self.tp > 1:
                    loss = self._loss_fn(self.model(inputs), targets)
                else:
                    loss = self.model(inputs, targets)
            return _local(loss)
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
        if self.offload:  # parameters kept on disk (offload_params): mapped from the files
            model_sd.update(self.offload.file_backed_state())
        return {"model": model_sd, "optim": optim_sd}

    def load_state_dict(self, state: dict) -> None:
        for part, opt in zip(self.parts, self.optimizers):
            set_model_state_dict(part, state["model"], options=StateDictOptions(strict=False))
            set_optimizer_state_dict(part, opt, state["optim"], options=self._OPTS)

    # offloaded optimizer state: files linked into checkpoints (myria.train.checkpoint)
    def checkpoint_files(self) -> dict:
        return self.offload.checkpoint_files() if self.offload else {}

    def check_checkpoint(self, path, meta: dict) -> None:
        from myria.train.offload import check_checkpoint
        check_checkpoint(path, meta, self.offload is not None)

    def file_backed_keys(self) -> list[str]:
        """Model keys a checkpoint restores through `load_checkpoint_files`, not DCP."""
        return list(self.offload.file_backed_state()) if self.offload else []

    def load_checkpoint_files(self, path) -> None:
        if self.offload:
            self.offload.load_files(path)

    def close(self) -> None:
        if self.offload:
            self.offload.close()

    def scheduler_state(self) -> dict:
        return self.schedulers[0].state_dict()

    def load_scheduler_state(self, state: dict) -> None:
        for s in self.schedulers:
            s.load_state_dict(state)
