"""The training loop: build, parallelise, initialise or resume, then step, log and checkpoint.

One process is one rank. The loop reads top to bottom: each step takes the global batch's slice
for this data-parallel rank, runs forward/backward over its microbatches (gradient sync only on
the last), clips, steps the optimizer and the schedule, logs, and checkpoints on the interval.

Robustness hooks (docs/robustness.md): a heartbeat thread reports the step and phase to the
supervisor; checkpoints are two-stage (`ckpt.save` snapshots to host memory and returns,
`ckpt.before_update` waits for an overlapped snapshot before the weights change); the
collective timeout drops from `init_timeout_s` to `timeout_s` once the first step is done; a
SIGTERM makes every rank save the current step and exit.
"""

from __future__ import annotations

import gc
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from myria import config as config_mod
from myria import rundir
from myria.config import Config
from myria.data import fingerprint
from myria.data.dataset import TokenDataset
from myria.data.mixture import MixtureDataset, open_dataset
from myria.errors import CheckpointError, ConfigError
from myria.faults import FaultInjector
from myria.fsutil import atomic_write
from myria.layout import Layout
from myria.models.flops import model_flops_per_token
from myria.observe import events, hang
from myria.parallel.data import make_loader, write_read_counts
from myria.parallel.dims import ParallelDims
from myria.resilience import goodput, peer
from myria.train import distributed, heartbeat, resume
from myria.train.checkpoint import CheckpointManager
from myria.train.engine import Engine
from myria.train.integrity import StepGuard
from myria.train.metrics import MetricsLogger, StepTimer, mfu
from myria.train.preemption import StopRequest

log = logging.getLogger("myria")


@dataclass
class TrainResult:
    """What a finished (or stopped) run reports."""

    last_step: int
    losses: list[float]
    stopped_early: bool


def check_vocab(cfg: Config, dataset: TokenDataset | MixtureDataset) -> None:
    if dataset.vocab_size > cfg.model.vocab_size:
        raise ConfigError(
            f"the tokenizer of {dataset.path} has {dataset.vocab_size} tokens but "
            f"model.vocab_size = {cfg.model.vocab_size}; set model.vocab_size >= "
            f"{dataset.vocab_size}")


def train(cfg: Config, run_dir: str | Path, stop_after: int | None = None) -> TrainResult:
    """Run (or resume) training as this process's rank; returns the losses of this session."""
    run_dir = Path(run_dir)
    events.listen_for_dumps(run_dir)  # before any thread starts (SIGUSR1 -> hang dump)
    hang.listen_for_stacks(run_dir)  # SIGUSR2 -> every thread's Python stack (faulthandler)
    if cfg.training.deterministic:  # before the first cuBLAS handle (GPU bitwise resume)
        import os
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    ledger = goodput.Ledger(run_dir)  # every second of this process, by category
    env = distributed.init(cfg.training.device, cfg.training.init_timeout_s)
    hb = goodput.follow(heartbeat.start(env.rank), ledger, env.rank)
    phase = "failed"
    try:
        result = _train(cfg, run_dir, env, stop_after, hb)
        phase = "stopped" if result.stopped_early else "done"
        return result
    except BaseException:
        rec = events.current()
        if rec.enabled:  # what this rank was doing when it failed (a collective timeout...)
            try:
                events.write_dump(run_dir, rec, "exception")
            except Exception:
                pass
        raise
    finally:
        hb.close(phase)
        events.uninstall()
        distributed.shutdown()


def _train(cfg: Config, run_dir: Path, env, stop_after: int | None,
           hb: heartbeat.Heartbeat) -> TrainResult:
    threads = distributed.set_cpu_threads(cfg.training.threads, env) if env.device.type == "cpu" \
        else None
    layout = Layout.resolve(cfg.parallel, env.world_size)
    dims = ParallelDims.build(layout, env.device.type)   # the mesh, groups, coordinates
    t, m = cfg.training, cfg.model

    # -- data ------------------------------------------------------------------------------
    dataset = open_dataset(cfg.data, m.seq_len, split="train")   # one directory or a mixture
    check_vocab(cfg, dataset)
    data_fp = fingerprint.keep_tokenizer(dataset.path, run_dir, env.is_main)  # in checkpoints
    if isinstance(dataset, MixtureDataset):
        dataset.check(t.global_batch, t.steps)
        data_fp = dataset.fingerprint(data_fp)

    # -- model, optimizer, schedule for this layout ------------------------------------------
    engine = Engine(cfg, dims, env.device, run_dir, eos_id=dataset.eos_id)
    rec = start_events(cfg, run_dir, env, dims, engine)

    # -- resume ----------------------------------------------------------------------------
    hb.phase("resume")
    faults = FaultInjector(run_dir, env.rank)
    r = cfg.resilience
    ckpt = CheckpointManager(run_dir / rundir.CHECKPOINTS, cfg.checkpoint.keep, faults,
                             async_save=r.async_checkpoint, overlap=r.snapshot_overlap,
                             timeout_s=t.init_timeout_s,
                             max_failures=cfg.checkpoint.max_failed_saves)
    start_step = 0
    latest = resume_point(ckpt, cfg, env.is_main)
    if latest is not None:
        fingerprint.check_resume(latest, data_fp, cfg.checkpoint.allow_data_change, env.is_main)
        changed = resume.changes(cfg, latest, run_dir)  # refuses fields that cannot change
        meta = ckpt.load(latest, engine)
        engine.load_scheduler_state(meta["scheduler"])
        start_step = meta["step"]
        if env.is_main:
            print(f"resumed from {latest} (step {start_step}, saved by {meta['world_size']} "
                  f"processes; rank 0 read {ckpt.bytes_read / 2**20:.1f} MiB)", flush=True)
        resume.apply(cfg, engine, run_dir, start_step, changed, env.is_main)
    if env.is_main and (cfg.checkpoint.resume_from or not cfg.checkpoint.resume):
        ckpt.abandon_after(start_step)  # a new timeline: newer checkpoints go aside
    hb.resumed(start_step)
    peers = peer.start(r.memory_snapshot_interval, engine, env.rank, env.world_size, run_dir)
    write_checkpoint_stats(run_dir, env.rank, ckpt, latest)
    stop = StopRequest(t.init_timeout_s)
    loader = make_loader(engine, dataset, cfg, start_step)  # one reader per tp x cp group

    # -- meters ----------------------------------------------------------------------------
    from myria.device import local_peak_tflops

    dtype = "float32" if (t.dtype == "auto" and env.device.type == "cpu") else t.dtype
    peak, peak_source = local_peak_tflops(env.device.type, dtype)
    span = None   # document masking: attention inside documents of the data's mean length
    if m.document_mask and not m.document_len:
        span = max(1, min(m.seq_len, round(dataset.mean_document_tokens)))
    flops_per_token = model_flops_per_token(m, seq_len=span)
    tokens_per_step = t.global_batch * m.seq_len
    metrics = MetricsLogger(run_dir, t.steps, start_step, env.is_main, cfg.logging.tensorboard,
                            cfg.logging.progress)
    if env.is_main:
        print(f"training {t.steps} steps from step {start_step} on {env.world_size} x "
              f"{env.device.type} (layout {layout.short()}, {threads or '-'} threads/rank); "
              f"peak {peak and round(peak, 3)} TFLOP/s ({peak_source})", flush=True)
        from myria.compat import torch_note
        if note := torch_note():  # another torch than the tested one: what it lacks
            print(note, flush=True)
    sync = torch.cuda.synchronize if env.device.type == "cuda" else None

    # -- the loop --------------------------------------------------------------------------
    losses: list[float] = []
    val = None
    step = start_step
    since_logged = 0.0  # step time since the last logged row (the supervisor's productive time)
    timer = StepTimer(sync)
    guard = StepGuard(cfg, engine, run_dir, env.rank, faults)
    if t.gc_interval:
        gc.disable()   # synchronised collection: every rank at the same steps (see below)
    try:
        while step < t.steps:
            rec.step = step + 1
            step_ev = rec.begin("step", "step")
            hb.phase("data")
            faults.at_step_start(step)
            train_this = guard.before(step)
            with rec.span("data_wait", "data"):
                batch = next(loader)
            apply = False
            loss_value = grad_norm = float("nan")
            if train_this:  # else: a batch skipped after a numerical-fault rollback
                hb.phase("forward-backward")
                loss_sum = engine.forward_backward(batch.inputs, batch.targets)
                guard.after_backward(step)
                hb.phase("grad-clip")
                with rec.span("grad_clip", "compute"):
                    grad_norm = engine.clip_grads(t.grad_clip)
                with rec.span("loss_mean", "compute"):
                    loss_value = engine.mean_over_dp(loss_sum)
                apply = guard.judge(step + 1, loss_sum, loss_value, grad_norm, batch)
            hb.phase("snapshot-wait")
            with rec.span("snapshot_wait", "ckpt"):
                ckpt.before_update()  # an overlapped snapshot must be copied before weights change
            hb.phase("optimizer")
            with rec.span("optimizer", "compute"):
                lr = engine.lr  # this step's (the schedule then moves on to the next step's)
                engine.step() if apply else engine.skip_step()
            step += 1
            if t.gc_interval and step % t.gc_interval == 0:
                with rec.span("gc", "check"):
                    gc.collect()  # every rank at the same step (automatic collection is off)
            guard.check_replicas(step)
            hb.phase("peer-snapshot")
            peers.after_step(step)  # this rank's state into its ring neighbour's memory

            hb.phase("metrics")
            rec.end(step_ev)
            losses.append(loss_value)
            dt = timer.lap()
            since_logged += dt
            hb.step_done(step, tokens_per_step / dt)
            if step == start_step + 1:
                distributed.set_timeout(t.timeout_s)  # warm: short collective timeouts
            if step % cfg.logging.interval == 0 or step == t.steps:
                tps = tokens_per_step / dt
                metrics.log(hb.ledger.row({
                    "step": step, "loss": loss_value, "lr": lr,
                    "grad_norm": grad_norm, "tokens_per_s": tps, "step_time_s": dt,
                    "data_wait_s": loader.pop_wait_time(),
                    "mfu": mfu(flops_per_token, tps, env.world_size, peak),
                    "time": time.time(), "interval_time_s": since_logged,
                    **({} if apply else {"skipped": True}),
                }))
                since_logged = 0.0
            if t.eval_interval and step % t.eval_interval == 0:
                hb.phase("eval")
                val = val or open_dataset(cfg.data, m.seq_len, split="val")
                metrics.log_eval(step, *evaluate_sources(engine, val, cfg))
            hb.phase("stop-check")
            preempted = stop.agreed()
            stopping = preempted or (stop_after is not None and step >= stop_after)
            interval = cfg.checkpoint.interval
            if step == t.steps or stopping or (interval and step % interval == 0):
                guard.check_replicas(step, force=True)  # never commit diverged replicas
                hb.phase("checkpoint")
                with rec.span("checkpoint_save", "ckpt"):
                    ckpt.save(step, engine, {
                        "scheduler": engine.scheduler_state(), "data": loader.state_dict(),
                        "layout": layout.as_dict(), "model": config_mod.dataclasses.asdict(m),
                        "data_path": str(Path(dataset.path).resolve()),
                        fingerprint.META_KEY: data_fp,
                        "config": cfg.to_dict(),  # what it was trained with (train/resume.py)
                    })
                timer.lap()  # checkpoint time is not step time
            if stopping and step < t.steps:
                hb.phase("checkpoint-flush")
                ckpt.require_saved(step)  # SaveError (exit 4) if it failed
                if env.is_main:
                    why = f" on {stop.signal_name}" if preempted else ""
                    print(f"stopped{why} after step {step} with a committed checkpoint",
                          flush=True)
                return TrainResult(step, losses, True)
        hb.phase("checkpoint-flush")
        ckpt.require_saved(step)  # never a success for work that was not saved
        return TrainResult(step, losses, False)
    finally:
        ckpt.close()  # never leave a save half-written behind a clean exit
        peers.close()
        engine.close()  # the nvme tier's trailing writes and threads
        stop.restore()
        write_checkpoint_stats(run_dir, env.rank, ckpt, latest)
        loader.close()
        write_read_counts(run_dir, env.rank, loader)
        metrics.close()
        if t.gc_interval:
            gc.enable()


def start_events(cfg: Config, run_dir: Path, env, dims: ParallelDims, engine: Engine):
    """Install and start this rank's event timer (RUN_DIR/events/), or a disabled one."""
    import torch.distributed as dist

    faults = FaultInjector(run_dir, env.rank)
    rec = events.install(run_dir, env.rank, env.world_size, cfg.observe.enabled,
                         slow=faults.slow(), flush_s=cfg.observe.flush_s)
    if env.is_main:   # also without events: `myria report` reads it (prediction, why no events)
        run_dir.mkdir(parents=True, exist_ok=True)
        atomic_write(run_dir / rundir.CONFIG, json.dumps(cfg.to_dict(), indent=1))
    if not rec.enabled:
        return rec
    if env.world_size > 1:
        rec.offset_us = events.measure_clock_offset(events.default_store(), env.rank,
                                                    env.world_size)
    groups, mesh = {}, dims.mesh
    for dim in (mesh.mesh_dim_names or ()) if mesh is not None else ():
        groups[dim] = dist.get_process_group_ranks(mesh[dim].get_group())
    for sub in (dims.fsdp_mesh, dims.dp_mesh):  # the groups FSDP and DDP reduce over
        if sub is not None and sub.ndim == 1:
            groups.setdefault("dp", dist.get_process_group_ranks(sub.get_group()))
    rec.set_mesh_groups(groups)
    if env.device.type == "cuda":
        rec.time_device()  # compute spans from CUDA events (not run on this CPU build's tests)
    coord = {"dp": dims.dp_rank, "pp": dims.pp_rank, "cp": dims.cp_rank, "tp": dims.tp_rank,
             "ep": dims.ep_rank}
    rec.start({"coord": coord, "layout": dims.layout.degrees(), "groups": groups,
               "schedule": dims.layout.schedule if dims.pp > 1 else None,
               "microbatches": engine.microbatches, "stages": engine.stage_ids})
    return rec


def resume_point(ckpt: CheckpointManager, cfg: Config, is_main: bool) -> Path | None:
    """The checkpoint this run starts from: the one asked for, the newest that verifies, or
    None (step 0). Damaged checkpoints are quarantined; when every one is damaged this raises a
    CheckpointError unless `checkpoint.start_fresh` allows starting from step 0."""
    c = cfg.checkpoint
    if c.resume_from:
        path = Path(c.resume_from)
        if not (path / "meta.json").is_file():
            raise CheckpointError(f"checkpoint.resume_from = {str(path)!r} is not a checkpoint "
                                  "directory (no meta.json in it)")
        reason = ckpt.verify(path)
        if reason is not None and is_main:
            log.warning("loading %s as asked although it does not verify: %s", path, reason)
        return path
    if not c.resume:
        return None
    return ckpt.choose_resume(allow_fresh=c.start_fresh)


def write_checkpoint_stats(run_dir: Path, rank: int, ckpt: CheckpointManager,
                           resumed_from: Path | None) -> None:
    """RUN_DIR/checkpoint_stats/rankNNNNN.json: bytes read to resume, each save's stall."""
    out = run_dir / "checkpoint_stats"
    stats = dict(ckpt.stats(), rank=rank, resumed_from=str(resumed_from or ""))
    try:
        out.mkdir(parents=True, exist_ok=True)
        atomic_write(out / f"rank{rank:05d}.json", json.dumps(stats, indent=1))
    except OSError as e:  # statistics: never the reason a run fails (a full disk, ...)
        log.warning("checkpoint statistics not written to %s: %s", out, e)


@torch.no_grad()
def evaluate(engine: Engine, val: TokenDataset, cfg: Config) -> float:
    """Mean loss over the first `data.eval_batches` global batches of the validation split."""
    dp_rank, dp_size, device = engine.dims.dp_rank, engine.dims.dp, engine.device
    g, mb = cfg.training.global_batch, cfg.training.micro_batch
    # Every rank must run the same number of forwards (FSDP gathers in each), so round down.
    n = min(val.num_samples, cfg.data.eval_batches * g) // (dp_size * mb) * (dp_size * mb)
    idx = list(range(n))[dp_rank::dp_size]
    total = torch.zeros((), device=device)
    count = torch.zeros((), device=device)
    for s in range(0, len(idx), mb):
        chunk = torch.as_tensor(val.get_many(idx[s:s + mb]), device=device)
        total += engine.eval_loss(chunk[:, :-1], chunk[:, 1:]) * len(chunk)
        count += len(chunk)
    return engine.mean_over_dp(total) / max(engine.mean_over_dp(count), 1.0)


def evaluate_sources(engine: Engine, val, cfg: Config) -> tuple[float, dict[str, float]]:
    """Validation loss, and per source for a mixture (the mixture's loss weights the sources'
    losses by their shares)."""
    if not isinstance(val, MixtureDataset):
        return evaluate(engine, val, cfg), {}
    per = {s.name: evaluate(engine, part, cfg) for s, part in zip(val.sources, val.parts,
                                                                  strict=True)}
    return sum(float(w) * per[s.name] for w, s in zip(val.shares, val.sources, strict=True)), per


