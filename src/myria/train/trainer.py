"""The training loop: `Run.build` sets a rank's run up, `train_step` is one optimizer step, and
`_train` is the loop around them (step, log, stop check, checkpoint).

One process is one rank. `Run.build` opens the data, builds and parallelises the model for the
layout, starts the event timer, resumes from the newest checkpoint that verifies, and makes the
loader, meters and the step guard. `train_step` reads in one sitting: this data-parallel rank's
batch, forward/backward over its microbatches (gradient sync only on the last), clip, the
optimizer and the schedule. The loop then logs, asks the checkpoint manager whether to save
(`CheckpointManager.should_save`: the interval, the last step, a stop) and stops when asked.

Robustness hooks (docs/robustness.md): inside a step, one seam, `run.watch`
(myria.train.watchers: heartbeat phases, timer spans, fault injection, the integrity guard, the
snapshots' waits); between steps, `hb.phase(...)` marks the loop's phases; checkpoints are
two-stage (`ckpt.save` snapshots to host memory and returns, the watchers wait for an overlapped
snapshot before the weights change); the collective timeout drops from `init_timeout_s` to
`timeout_s` once the first step is done; a SIGTERM makes every rank save the current step and
exit. With in-job recovery (myria.train.rejoin) a failed step does not end the process: `train`
joins the next attempt and builds the run again from the peers' memory.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import gc
import json
import logging
import os
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from myria import config as config_mod
from myria import rundir
from myria.compat import torch_note
from myria.config import Config
from myria.data import fingerprint
from myria.data.dataset import TokenDataset
from myria.data.mixture import MixtureDataset, open_dataset
from myria.device import local_peak_tflops
from myria.errors import CheckpointError, DataError
from myria.faults import FaultInjector
from myria.fsutil import atomic_write
from myria.layout import Layout, wants_bf16
from myria.models.flops import model_flops_per_token
from myria.models.loss import record_row_losses
from myria.observe import events, goodput, hang, tracking
from myria.parallel.data import make_loader, write_read_counts
from myria.parallel.dims import ParallelDims
from myria.train import distributed, heartbeat, peer, rejoin, resume
from myria.train.checkpoint.pipeline import CheckpointManager
from myria.train.engine import Engine
from myria.train.integrity import StepGuard
from myria.train.launch import JOB_START_ENV
from myria.train.metrics import MetricsLogger, StepTimer, mfu
from myria.train.preemption import StopRequest
from myria.train.preflight import check_mixture, check_validation, check_vocab
from myria.train.profiling import Profiler
from myria.train.watchers import Judged, StepWatchers

log = logging.getLogger("myria")


@dataclass
class TrainResult:
    """What a finished (or stopped) run reports."""

    last_step: int
    losses: list[float]
    stopped_early: bool
    signal: int = 0   # the stop signal this process received and stopped on (0: none)


def quiet_torch_notes() -> None:
    """Silence two notes torch prints on every rank that a user cannot act on: DTensor's
    "could not be optimized" when a redistribution's collectives cannot be merged (a
    performance note on its internals, several lines per rank under tp x dp), and DeviceMesh's
    notice that slicing a flattened dimension from the root mesh will be deprecated (the
    trainer's context-parallel groups do; torch 2.13 still supports it)."""
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", message="Slicing a flattened dim from root mesh")


def train(cfg: Config, run_dir: str | Path, stop_after: int | None = None) -> TrainResult:
    """Run (or resume) training as this process's rank; returns the losses of this session."""
    run_dir = Path(run_dir)
    quiet_torch_notes()
    events.listen_for_dumps(run_dir)  # before any thread starts (SIGUSR1 -> hang dump)
    hang.listen_for_stacks(run_dir)  # STACK_SIGNAL -> every thread's stack (faulthandler)
    if cfg.training.deterministic:  # before the first cuBLAS handle (GPU bitwise resume)
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    ledger = goodput.Ledger(run_dir)  # every second of this process, by category
    injob = rejoin.InJob.create(cfg, run_dir)  # None unless resilience.recovery = in-job
    if injob is not None:
        injob.adjust_ledger(ledger)
    env = distributed.init(cfg.training.device, cfg.training.init_timeout_s,
                           injob.pg_store() if injob else None)
    hb = heartbeat.start(env.rank, ledger)
    ledger.ready(env.rank)
    phase = "failed"
    try:
        while True:
            try:
                result = _train(cfg, run_dir, env, stop_after, hb, injob)
                break
            except Exception as e:
                # in-job recovery: a peer was lost; this process stays and joins the next
                # attempt (myria.train.rejoin), else the error ends it
                if injob is None or not injob.recover(e, hb):
                    raise
                events.uninstall()
                env = distributed.init(cfg.training.device, cfg.training.init_timeout_s,
                                       injob.pg_store())
                hb.ledger.mark("pg_ready")
        phase = "stopped" if result.stopped_early else "done"
        return result
    except BaseException:
        rec = events.current()
        if rec.enabled:  # what this rank was doing when it failed (a collective timeout...)
            try:
                with rundir.fence_guard(run_dir):  # a fenced-off worker writes nothing
                    events.write_dump(run_dir, rec, "exception")
            except Exception:
                pass
        raise
    finally:
        hb.close(phase)
        events.uninstall()
        distributed.shutdown()


def _train(cfg: Config, run_dir: Path, env, stop_after: int | None,
           hb: heartbeat.Heartbeat, injob: rejoin.InJob | None = None) -> TrainResult:
    """Set the run up, then step until the last step, a stop or `stop_after`."""
    run = Run.build(cfg, run_dir, env, hb, injob)
    t = cfg.training
    losses: list[float] = []
    step = run.start_step
    if t.gc_interval:
        gc.disable()   # synchronised collection: every rank at the same steps (train_step)
    if stop_after is not None and env.is_main and step < t.steps:
        print(f"stopping after step {stop_after} (--stop-after): {stop_after - step} steps of "
              f"training.steps = {t.steps}" if stop_after < t.steps else
              f"note: --stop-after {stop_after} is at or past training.steps = {t.steps}: the "
              "run ends there (raise --training.steps to train further)", flush=True)
    try:
        if step < t.steps and run.stopped_before_training():
            if env.is_main:
                print(f"stopped on {run.stop.signal_name} before step {step + 1}: nothing "
                      "trained, nothing new to save", flush=True)
            return TrainResult(step, losses, True, run.stop.signum)
        while step < t.steps:
            run.profiler.before(step + 1)
            done = train_step(run, step)
            step += 1
            run.profiler.after(step)
            losses.append(done.loss)
            run.after_step(step, done)   # heartbeat, metrics row, evaluation
            hb.phase("stop-check")
            run.stop_before_time_limit(step)
            preempted = run.stop.agreed()
            stopping = preempted or (stop_after is not None and step >= stop_after)
            if run.ckpt.should_save(step, last=step == t.steps, stopping=stopping):
                run.save(step)
            if stopping and step < t.steps:
                hb.phase("checkpoint-flush")
                run.ckpt.require_saved(step)  # SaveError (exit 4) if it failed
                if env.is_main:
                    why = f" on {run.stop.signal_name}" if preempted else ""
                    print(f"stopped{why} after step {step} with a committed checkpoint",
                          flush=True)
                return TrainResult(step, losses, True, run.stop.signum)
            if injob is not None and injob.shrunk and step < t.steps and injob.grow_due():
                raise rejoin.Regroup(f"a spare is ready: the run grows back to "
                                     f"{injob.full_world} ranks after step {step}")
        hb.phase("checkpoint-flush")
        run.ckpt.require_saved(step)  # never a success for work that was not saved
        return TrainResult(step, losses, False)
    except Exception as e:
        if injob is not None:  # before the close: no thread of the run waits on a lost peer
            injob.keep(run, orderly=isinstance(e, rejoin.Regroup))
        raise
    finally:
        with rundir.fence_guard(run_dir):  # a fenced-off worker writes nothing
            run.close()
        if t.gc_interval:
            gc.enable()


@functools.cache
def _process_start(pid: int) -> float:
    """When process `pid` (this one) started: a forked worker's fork, not its forkserver's
    start, so read at the first call, not at this module's import."""
    return goodput.process_start_time()


# The stop before the wall-time limit (Run.stop_before_time_limit): a save's time varies with
# the load of the host and its disk, and a commit past the limit loses every step since the last
# checkpoint, so the measured save counts double; before any save a fixed allowance covers the
# first save's fixed costs (the plan, the metadata, the files' fsync), which dominate a small
# state. Both cost at most a few steps of a job whose limit is hours.
LIMIT_SAVE_MARGIN = 2.0
UNMEASURED_SAVE_S = 2.0


@dataclass
class StepDone:
    """What one optimizer step reports to the loop."""

    loss: float
    grad_norm: float
    lr: float
    applied: bool   # False: skipped (a numerical fault) or rolled back
    by_source: dict[str, float] | None = None   # a mixture's training loss per source


def train_step(run: Run, step: int) -> StepDone:
    """Step `step` + 1: this rank's batch, forward/backward over its microbatches, clip, the
    optimizer. `run.watch` is everything else that happens around them, at fixed points
    (myria.train.watchers: heartbeat phases, timer spans, faults, the guard, snapshots)."""
    engine, watch, t = run.engine, run.watch, run.cfg.training
    loss = grad_norm = float("nan")
    by_source = judged = None
    with watch.step(step) as train_this:
        with watch.phase("data"):
            batch = next(run.loader)
        if train_this:  # else: a batch skipped after a numerical-fault rollback
            per_source = per_source_due(run, step + 1)
            with watch.backward(), \
                    record_row_losses() if per_source else contextlib.nullcontext() as rows:
                loss_sum = engine.forward_backward(batch.inputs, batch.targets)
            with watch.phase("grad-clip"):
                grad_norm = engine.clip_grads(t.grad_clip)
            with watch.span("loss_mean", "compute"):
                loss = engine.mean_over_dp(loss_sum)
                by_source = source_losses(run, batch, rows) if per_source else None
            judged = Judged(loss_sum, loss, grad_norm, batch)
        with watch.update(judged) as apply:
            lr = engine.lr  # this step's (the schedule then moves on to the next step's)
            engine.step() if apply else engine.skip_step()
    return StepDone(loss, grad_norm, lr, apply, by_source)


def per_source_due(run: Run, step: int) -> bool:
    """Whether step `step` measures a mixture's training loss per source: on the steps that
    log a metrics row, where the loss is the fused one (tensor and pipeline parallelism compute
    it otherwise), the same answer on every rank."""
    t = run.cfg.training
    return (isinstance(run.dataset, MixtureDataset) and run.engine.dims.tp == 1
            and run.engine.dims.pp == 1
            and (step % run.cfg.logging.interval == 0 or step == t.steps))


def source_losses(run: Run, batch, rows: list[torch.Tensor]) -> dict[str, float]:
    """Mean training loss per source of this step's global batch: every rank's per-token losses
    (its samples, its share of each sequence under context parallelism) summed by source."""
    ds, engine = run.dataset, run.engine
    k = len(ds.sources)
    sums = torch.zeros(2 * k, dtype=torch.float64)
    n = len(batch.indices)
    if rows and n:
        per_sample = torch.cat(rows).double().reshape(n, -1)
        src = torch.as_tensor(ds.source_of(batch.indices))
        sums[:k].index_add_(0, src, per_sample.sum(1))
        sums[k:].index_add_(0, src, torch.full((n,), float(per_sample.shape[1]),
                                                 dtype=torch.float64))
    sums = sums.to(engine.device)
    if engine.dims.loss_group is not None:
        dist.all_reduce(sums, group=engine.dims.loss_group)
    sums = sums.cpu()
    return {s.name: float(sums[i] / sums[k + i]) for i, s in enumerate(ds.sources)
            if sums[k + i] > 0}


@dataclass
class Run:
    """One rank's run, set up by `Run.build`: everything the loop and `train_step` use."""

    cfg: Config
    run_dir: Path
    env: Any
    hb: heartbeat.Heartbeat
    layout: Layout
    dataset: TokenDataset | MixtureDataset
    data_fp: dict
    engine: Engine
    rec: events.Recorder
    faults: FaultInjector
    ckpt: CheckpointManager
    resumed_from: Path | None
    start_step: int
    stop: StopRequest
    loader: Any
    metrics: MetricsLogger
    guard: StepGuard
    watch: StepWatchers
    timer: StepTimer
    flops_per_token: float
    peak: float | None
    since_logged: float = 0.0  # step time since the last logged row (productive time)
    val: Any = None            # the validation split (None with evaluation off)
    peers: Any = None          # resilience.peer: this rank's state held by its neighbour
    profiler: Any = None       # train.profiling: the [profiling] window
    # the wall-time limit's estimate of the next step (the slowest of the last steps) and of
    # the checkpoint after it
    recent_steps_s: collections.deque = field(
        default_factory=lambda: collections.deque(maxlen=8))
    longest_save_s: float = 0.0

    @classmethod
    def build(cls, cfg: Config, run_dir: Path, env, hb: heartbeat.Heartbeat,
              injob: rejoin.InJob | None = None) -> Run:
        """Data, model and optimizer for this layout, event timer, checkpoints and resume (from
        peer memory in an in-job recovery, `injob`), the loader from the resumed step, meters
        and the step guard."""
        t, m = cfg.training, cfg.model
        threads = distributed.set_cpu_threads(t.threads, env) if env.device.type == "cpu" \
            else None
        layout = Layout.resolve(cfg.parallel, env.world_size)
        dims = ParallelDims.build(layout, env.device.type,   # the mesh, groups, coordinates
                                  fsdp=layout.shards_with_fsdp(cfg, env.device.type))

        # -- data ----------------------------------------------------------------------------
        dataset = open_dataset(cfg.data, m.seq_len, split="train")   # a directory or a mixture
        check_vocab(cfg, dataset)
        # the tokenizer is kept with the run once the resume accepts this data (below)
        data_fp = fingerprint.keep_tokenizer(dataset.path, run_dir, write=False)
        check_mixture(cfg, dataset)
        if isinstance(dataset, MixtureDataset):
            data_fp = dataset.fingerprint(data_fp)
        val = check_validation(cfg)   # opened and checked before the first step

        # -- model, optimizer, schedule for this layout ----------------------------------------
        engine = Engine(cfg, dims, env.device, run_dir, eos_id=dataset.eos_id,
                        shrunk=injob is not None and injob.shrunk)
        faults = FaultInjector(run_dir, env.rank)
        rec = start_events(cfg, run_dir, env, dims, engine, faults)

        # -- resume --------------------------------------------------------------------------
        hb.phase("resume")
        r = cfg.resilience
        ckpt = CheckpointManager(rundir.checkpoints_dir(run_dir), cfg.checkpoint.keep, faults,
                                 async_save=r.async_checkpoint, overlap=r.snapshot_overlap,
                                 timeout_s=t.init_timeout_s,
                                 max_failures=cfg.checkpoint.max_failed_saves,
                                 interval=cfg.checkpoint.interval)
        # in-job: no rollback past the last clean check before a fault found after a commit
        held = injob.restore(engine, env, ckpt.drop_suspect()) if injob is not None else None
        if held is None:
            start_step, latest = resume_run(cfg, run_dir, env, engine, ckpt, data_fp)
        else:
            start_step, latest = held, None
        if env.is_main:
            fingerprint.keep_tokenizer(dataset.path, run_dir)
        hb.resumed(start_step)
        peers = peer.start(peer.interval_of(r), engine, env.rank, env.world_size, run_dir)
        write_checkpoint_stats(run_dir, env.rank, ckpt, latest)
        stop = StopRequest(t.init_timeout_s)
        if t.max_time_s:   # every rank names it, the one that judged it reached or not
            stop.limit_name = f"the wall-time limit (training.max_time_s = {t.max_time_s:g})"
        loader = make_loader(engine, dataset, cfg, start_step)  # one reader per tp x cp group

        # -- meters --------------------------------------------------------------------------
        dtype = "bfloat16" if layout.computes_in_bf16(cfg, env.device.type) else "float32"
        peak, peak_source = local_peak_tflops(env.device.type, dtype)
        span = None   # document masking: attention inside documents of the data's mean length
        if m.document_mask and not m.document_len:
            span = max(1, min(m.seq_len, round(dataset.mean_document_tokens)))
        metrics = MetricsLogger(run_dir, t.steps, start_step, env.is_main,
                                cfg.logging.tensorboard, cfg.logging.progress,
                                tracking.start(cfg.logging, run_dir, cfg.to_dict(), env.is_main))
        if env.is_main:
            left = t.steps - start_step
            todo = f"{t.steps} steps" if not start_step else \
                f"to step {t.steps} from step {start_step} ({left} step{'s' * (left != 1)})"
            print(f"training {todo} on {env.world_size} x "
                  f"{env.device.type} (layout {layout_words(cfg, layout, env.device.type)}, "
                  f"{threads or '-'} threads/rank); "
                  f"peak {peak and round(peak, 3)} TFLOP/s ({peak_source})", flush=True)
            if m.document_mask:  # it changes the loss and the FLOPs: said where the run starts
                print(f"document masking: attention stays inside each document (mean "
                      f"{m.document_len or span} tokens"
                      f"{' as configured' if m.document_len else ' of the data'}; positions "
                      f"{'restart per document' if m.document_positions else 'run on'})",
                      flush=True)
            if isinstance(dataset, MixtureDataset) and len(dataset.schedule.starts) > 1:
                print("data mixture: " + "; ".join(
                    (f"from step {st + 1}: " if st else "") + ", ".join(
                        f"{src.name} {float(w):.3g}" for src, w in
                        zip(dataset.sources, sh, strict=True))
                    for st, sh in zip(dataset.schedule.starts, dataset.schedule.shares,
                                      strict=True)), flush=True)
            if note := torch_note():  # another torch than the tested one: what it lacks
                print(note, flush=True)
        sync = torch.cuda.synchronize if env.device.type == "cuda" else None
        guard = StepGuard(cfg, engine, run_dir, env.rank, faults, start_step)
        # copies of the state (checkpoints, peer snapshots) must hold what the ledger recorded
        ckpt.recorded = peers.recorded = guard.recorded
        guard.peers = peers
        watch = StepWatchers(hb, rec, faults, guard, ckpt, peers, t.gc_interval)
        return cls(cfg, run_dir, env, hb, layout, dataset, data_fp, engine, rec, faults, ckpt,
                   latest, start_step, stop, loader, metrics, guard, watch, StepTimer(sync),
                   model_flops_per_token(m, seq_len=span), peak, peers=peers,
                   profiler=Profiler(cfg.profiling, run_dir, env.rank, env.device.type),
                   val=val)

    def after_step(self, step: int, done: StepDone) -> None:
        """After step `step`: the heartbeat's progress, the metrics row on the logging
        interval, the evaluation on its interval."""
        cfg, t = self.cfg, self.cfg.training
        self.hb.phase("metrics")
        dt = self.timer.lap()
        self.recent_steps_s.append(dt)
        self.since_logged += dt
        tps = t.global_batch * cfg.model.seq_len / dt
        self.hb.step_done(step, tps)
        if step == self.start_step + 1:
            distributed.set_timeout(t.timeout_s)  # warm: short collective timeouts
        if step % cfg.logging.interval == 0 or step == t.steps:
            self.metrics.log(self.hb.ledger.row({
                "step": step, "loss": done.loss, "lr": done.lr,
                "grad_norm": done.grad_norm, "tokens_per_s": tps, "step_time_s": dt,
                "data_wait_s": self.loader.pop_wait_time(),
                "mfu": mfu(self.flops_per_token, tps, self.env.world_size, self.peak),
                "time": time.time(), "interval_time_s": self.since_logged,
                **({} if done.applied else {"skipped": True}),
                **self.per_source(step, done),
            }))
            self.since_logged = 0.0
        # every eval_interval steps, and the last step: a run shorter than the interval, or
        # not a multiple of it, still ends with its validation loss
        if t.eval_interval and (step % t.eval_interval == 0 or step == t.steps):
            self.hb.phase("eval")
            losses = evaluate_sources(self.engine, self.val, cfg)
            # the eval's row carries the ledger's seconds since the last row (the eval, and
            # the steps and their data waits in between when rows are further apart), so the
            # last eval of a run is booked too, not left after the last row
            self.metrics.log_eval(step, *losses, ledger=self.hb.ledger.row(
                {"time": time.time(), "data_wait_s": self.loader.pop_wait_time()}))

    def per_source(self, step: int, done: StepDone) -> dict[str, Any]:
        """A mixture's figures per source for the metrics row of step `step`: samples and
        tokens read from each source since step 0 (the mixture's order: within one sample of
        the weights, phase by phase), the epochs they make, and this step's training loss per
        source."""
        ds = self.dataset
        if not isinstance(ds, MixtureDataset):
            return {}
        counts = ds.schedule.counts(step, self.cfg.training.global_batch)
        names = [s.name for s in ds.sources]
        out: dict[str, Any] = {
            "samples_by_source": dict(zip(names, map(int, counts), strict=True)),
            "tokens_by_source": {n: int(c) * ds.seq_len for n, c in zip(names, counts,
                                                                        strict=True)},
            "epochs_by_source": {n: round(float(e), 4) for n, e in zip(
                names, ds.epochs(step, self.cfg.training.global_batch), strict=True)}}
        if done.by_source:
            out["loss_by_source"] = done.by_source
        return out

    def stopped_before_training(self) -> bool:
        """Whether the ranks agree to stop before their first step (collective): a stop
        signal during the start-up, or a job's wall-time limit it used up (a late restart, a
        slow start), which the check after each step would only see once a step had run past
        it."""
        limit = self.cfg.training.max_time_s
        start = float(os.environ.get(JOB_START_ENV) or _process_start(os.getpid()))
        if limit and time.time() >= start + limit:
            self.stop.request_limit()
        return self.stop.agreed()

    def stop_before_time_limit(self, step: int) -> None:
        """Ask the ranks to stop (agreed with a preemption's stop) when the job's wall-time
        limit (`training.max_time_s`, counted from MYRIA_JOB_START, else this process's start)
        could pass during the next step and the checkpoint after it: the slowest of the last
        steps, then `LIMIT_SAVE_MARGIN` times the longest save measured so far until committed
        (the stop waits for the commit), or `UNMEASURED_SAVE_S` (at least that margin times a
        step) while no save has been measured. The estimate errs early: a stop too late loses
        the steps since the last checkpoint, one too early a few steps."""
        limit = self.cfg.training.max_time_s
        if not limit or step >= self.cfg.training.steps or self.stop.requested:
            return
        start = float(os.environ.get(JOB_START_ENV) or _process_start(os.getpid()))
        committed = max((r.stall_s + r.persist_s for r in self.ckpt.history if r.ok),
                        default=0.0)
        step_s = max(self.recent_steps_s, default=0.0)
        measured = max(self.longest_save_s, committed)
        save_s = LIMIT_SAVE_MARGIN * measured if measured else \
            max(UNMEASURED_SAVE_S, LIMIT_SAVE_MARGIN * step_s)
        if time.time() + step_s + save_s >= start + limit:
            self.stop.request_limit()

    def save(self, step: int) -> None:
        """Checkpoint step `step` (two-stage: this returns once the snapshot is taken)."""
        self.guard.check_replicas(step, force=True)  # never commit diverged replicas
        t0 = time.perf_counter()
        self._save(step)
        self.longest_save_s = max(self.longest_save_s, time.perf_counter() - t0)

    def _save(self, step: int) -> None:
        with self.hb.phase("checkpoint"):
            self.ckpt.save(step, self.engine, {
                "scheduler": self.engine.scheduler_state(), "data": self.loader.state_dict(),
                "layout": self.layout.as_dict(),
                "model": config_mod.dataclasses.asdict(self.cfg.model),
                "data_path": str(Path(self.dataset.path).resolve()),
                fingerprint.META_KEY: self.data_fp,
                "config": self.cfg.to_dict(),  # what it was trained with (train/resume.py)
            })
        self.timer.lap()  # checkpoint time is not step time

    def close(self) -> None:
        """Finish the run's saves, writers and threads (also after a failure)."""
        self.ckpt.close()  # never leave a save half-written behind a clean exit
        self.peers.close()
        self.engine.close()  # the nvme tier's trailing writes and threads
        self.stop.restore()
        write_checkpoint_stats(self.run_dir, self.env.rank, self.ckpt, self.resumed_from)
        self.loader.close()
        write_read_counts(self.run_dir, self.env.rank, self.loader)
        self.metrics.close()


def resume_run(cfg: Config, run_dir: Path, env, engine: Engine, ckpt: CheckpointManager,
               data_fp: dict) -> tuple[int, Path | None]:
    """Load the checkpoint this run starts from (if any) into `engine`: (its step, its path)."""
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
    elif cfg.model.init_from:
        init_from_hf(cfg, engine, env.is_main)
        if env.is_main:
            from myria.interop import hf
            hf.keep_generation_config(cfg.model.init_from, run_dir)
    if latest is None and env.is_main:   # (a resume's config is written by resume.apply)
        resume.write_config(cfg, run_dir)
    if env.is_main and (asked_checkpoint(cfg) or not cfg.checkpoint.resume):
        # a new timeline: newer checkpoints go aside
        ckpt.abandon_after(start_step, "" if asked_checkpoint(cfg) else
                           "a fresh start of the run directory (checkpoint.resume = false)")
    return start_step, latest


def init_from_hf(cfg: Config, engine: Engine, is_main: bool) -> None:
    """Step 0 of a run that starts from a Hugging Face model: its weights replace the
    initialisation, each rank reading only its own slices (myria.interop.hf)."""
    from myria.interop import hf

    t0 = time.perf_counter()
    read = hf.reader(cfg.model.init_from, cfg.model)
    held = 0

    def count(named: dict) -> None:
        nonlocal held
        held += read(named)

    engine.fill_parameters(count)
    if is_main:
        print(f"loaded the weights of {cfg.model.init_from} in {time.perf_counter() - t0:.1f} s "
              f"(rank 0 holds {held / 2**20:.1f} MiB of them)", flush=True)


def layout_words(cfg: Config, layout: Layout, device_type: str) -> str:
    """The run's layout as its start line says it: the degrees, then what runs them (the
    data-parallel engine, the pipeline schedule, precision, recomputation, offload)."""
    t, p = cfg.training, cfg.parallel
    short = layout.short()
    words = [short.replace("dp_shard", "dp") if t.data_parallel == "ddp" else short]
    if layout.dp > 1:
        words.append({"fsdp": "FSDP", "zero2": "ZeRO-2", "ddp": "DDP"}[t.data_parallel])
    if layout.pp > 1:
        words.append(layout.schedule + (f" x{layout.vpp} chunks" if layout.vpp > 1 else ""))
    words.append(("float8 blocks, " if t.float8 else "")
                 + ("bf16" if layout.computes_in_bf16(cfg, device_type) else "fp32"
                    + (f" ({layout.no_bf16_reason(cfg)})" if wants_bf16(cfg, device_type)
                       else "")))
    if p.activation_checkpoint != "none":
        words.append(f"recompute {p.activation_checkpoint}")
    if p.offload != "none":
        words.append(f"optimizer state on {p.offload}"
                     + (" with the parameters" if p.offload_params else "")
                     + (f" in {p.offload_dir or 'RUN_DIR/offload'}" if p.offload == "nvme"
                        else ""))
    return ", ".join(words)


def start_events(cfg: Config, run_dir: Path, env, dims: ParallelDims, engine: Engine,
                 faults: FaultInjector) -> events.Recorder:
    """Install and start this rank's event timer (RUN_DIR/events/), or a disabled one."""
    rec = events.install(run_dir, env.rank, env.world_size, cfg.observe.enabled,
                         slow=faults.slow(), flush_s=cfg.observe.flush_s)
    # also without events: `myria report` reads it (prediction, why no events); one already
    # there stays until this run's config trains (`resume_run`, `resume.write_config`)
    if env.is_main and not (run_dir / rundir.CONFIG).exists():
        run_dir.mkdir(parents=True, exist_ok=True)
        resume.write_config(cfg, run_dir)
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
    rec.start({"attempt": rundir.job_attempt(), "coord": coord,
               "layout": dims.layout.degrees(), "groups": groups,
               "schedule": dims.layout.schedule if dims.pp > 1 else None,
               "microbatches": engine.microbatches, "stages": engine.stage_ids})
    return rec


def asked_checkpoint(cfg: Config) -> bool:
    """Whether this start loads `checkpoint.resume_from`: the job's first attempt does; its
    restarts (the same command, the same option) resume from the newest checkpoint that
    verifies, which is that one or a save after it, else every restart would go back to it
    and set the saves since aside."""
    return bool(cfg.checkpoint.resume_from) and rundir.job_attempt() == 0


def resume_point(ckpt: CheckpointManager, cfg: Config, is_main: bool) -> Path | None:
    """The checkpoint this run starts from: the one asked for, the newest that verifies, or
    None (step 0). Damaged checkpoints are quarantined; when every one is damaged this raises a
    CheckpointError unless `checkpoint.start_fresh` allows starting from step 0."""
    c = cfg.checkpoint
    if asked_checkpoint(cfg):
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
    chosen = ckpt.choose_resume(allow_fresh=c.start_fresh)
    if chosen is not None and c.start_fresh and is_main:
        print(f"note: --start-fresh applies only when every checkpoint is damaged; "
              f"{chosen.name} verifies and the run resumes from it (--checkpoint.resume=false "
              "trains this run directory from step 0)", flush=True)
    return chosen


def write_checkpoint_stats(run_dir: Path, rank: int, ckpt: CheckpointManager,
                           resumed_from: Path | None) -> None:
    """RUN_DIR/checkpoint_stats/rankNNNNN.json: bytes read to resume, each save's stall."""
    out = rundir.checkpoint_stats_file(run_dir, rank)
    stats = dict(ckpt.stats(), rank=rank, resumed_from=str(resumed_from or ""))
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(out, json.dumps(stats, indent=1))
    except OSError as e:  # statistics: never the reason a run fails (a full disk, ...)
        log.warning("checkpoint statistics not written to %s: %s", out, e)


@torch.no_grad()
def evaluate(engine: Engine, val: TokenDataset, cfg: Config) -> float:
    """Mean loss over the first `data.eval_batches` global batches of the validation split, or
    over the whole split when it is smaller: every sample there is counted once, whatever the
    number of data-parallel ranks."""
    dp_rank, dp_size, device = engine.dims.dp_rank, engine.dims.dp, engine.device
    n = min(val.num_samples, cfg.data.eval_batches * cfg.training.global_batch)
    if n < 1:
        raise DataError(f"the validation split of {cfg.data.path or cfg.data.sources!r} has no "
                        "sample to evaluate")
    idx = list(range(n))[dp_rank::dp_size]
    # Every rank runs the same number of forwards (FSDP gathers in each, expert parallelism
    # exchanges tokens, a pipeline passes activations): a rank whose share ran out runs
    # sample 0 and does not count it.
    rows = engine.eval_rows
    forwards = -(-len(range(0, n, dp_size)) // rows)  # ceil(ceil(n / dp) / rows)
    total = torch.zeros((), device=device)
    count = torch.zeros((), device=device)
    for f in range(forwards):
        part = idx[f * rows:(f + 1) * rows]
        chunk = torch.as_tensor(val.get_many(part or [0]), device=device)
        total += engine.eval_sum(chunk, len(part))
        count += len(part)
    return engine.mean_over_dp(total) / engine.mean_over_dp(count)


def evaluate_sources(engine: Engine, val, cfg: Config) -> tuple[float, dict[str, float]]:
    """Validation loss, and per source for a mixture (the mixture's loss weights the sources'
    losses by their shares)."""
    if not isinstance(val, MixtureDataset):
        return evaluate(engine, val, cfg), {}
    per = {s.name: evaluate(engine, part, cfg) for s, part in zip(val.sources, val.parts,
                                                                  strict=True)}
    return sum(float(w) * per[s.name] for w, s in zip(val.shares, val.sources, strict=True)), per


