"""`myria train`: train (or resume) a model; `--nproc N` starts N local ranks itself.

    myria train --config configs/demo.toml --run-dir runs/demo --nproc 2 [--section.key=value]

Run again with the same run directory to resume from its newest checkpoint; raise
`--training.steps` to train further. `--stop-after N` stops cleanly after step N with a
committed checkpoint, as a preempted job would.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import time
from pathlib import Path

from myria import config as config_mod
from myria import rundir
from myria.config.model import pattern_note
from myria.device import SERVER_GPUS
from myria.errors import DataError, LaunchError
from myria.layout import Layout
from myria.observe import goodput
from myria.train.preflight import (
    add_resume_arguments,
    check_before_torch,
    check_data_and_model,
    check_data_overrides,
    check_launch,
    check_nproc,
    check_recorded_data,
    check_validation,
    data_passes,
    max_time_overrides,
    preflight,
    resume_overrides,
    run_config,
)

ACCEPTS_OVERRIDES = True


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="TOML run config (default: built-in defaults)")
    p.add_argument("--run-dir", help="where checkpoints, metrics.jsonl and TensorBoard go "
                   "(required unless --dry-run)")
    p.add_argument("--nproc", type=int, default=None,
                   help="start this many local processes (ranks) through torch elastic; "
                   "omit when launched by torchrun")
    p.add_argument("--max-time", metavar="DURATION", default=None,
                   help="wall-time limit of this job, as a scheduler writes it (Slurm's "
                   "[D-]HH:MM:SS or MM) or with a unit (90m, 2h, 3600s): stop cleanly with a "
                   "committed checkpoint before it passes (training.max_time_s)")
    p.add_argument("--nnodes", type=int, default=1,
                   help="hosts, for --dry-run's placement report (launch across hosts with "
                   "torchrun or `myria supervise`)")
    add_resume_arguments(p)
    p.add_argument("--dry-run", action="store_true",
                   help="print the resolved config, parameter count, FLOPs per token, "
                   "memory per rank and the predicted step, then exit; on a CPU the first dry "
                   "run of a model shape measures its kernels on this machine (tens of "
                   "seconds, in worker processes) and keeps the figures for the next (figures "
                   "timed while other jobs held the cores are said so, and measured again "
                   "the first time the host is quiet)")
    p.epilog = ("Any config field can be overridden as --section.key=value, e.g. "
                "--training.steps=100 --model.layers=8. `myria train --dry-run [--config "
                "FILE]` lists every field with its value and what it means. Start from a "
                "Hugging Face model with --model.init_from=MODEL_DIR (data prepared with "
                "`myria prepare --tokenizer MODEL_DIR`).")


def _nproc_for(args) -> int:
    from myria.train.launch import inside_launcher

    if inside_launcher():
        import os
        return int(os.environ.get("WORLD_SIZE", 1))
    return args.nproc or 1


def cluster_for(cfg: config_mod.Config, ranks_per_host: int):
    """The placement view of the machines from the config (host names, switches, NVLink)."""
    import os

    from myria.parallel.placement import Cluster

    names = [h for h in (cfg.parallel.hosts or os.environ.get("MYRIA_HOSTS", "")).split(",") if h]
    return Cluster(ranks_per_host=ranks_per_host, hosts_per_switch=cfg.parallel.hosts_per_switch,
                   fast_domain=cfg.parallel.fast_domain, host_names=names or None)


def dry_run(cfg: config_mod.Config, world: int, ranks_per_host: int | None = None) -> str:
    """The text `--dry-run` prints: config, sizes, FLOPs, memory per rank and the placement."""
    from myria.models.flops import model_flops_per_token, param_counts

    m, t = cfg.model, cfg.training
    pc = param_counts(m)
    n = pc.total(m.layers)
    lay = Layout.resolve(cfg.parallel, world)
    lines = [config_mod.describe(cfg),
             f"# world size {world}: layout " + ", ".join(f"{k}={v}"
                                                         for k, v in lay.degrees().items())
             + (f" (data parallel by {ENGINE_WORDS[t.data_parallel]})" if lay.dp > 1 else ""),
             f"# parameters: {n:,} ({n - pc.embedding - pc.head - pc.positional:,} without "
             "embeddings)",
             f"# model FLOPs per token (training; softmax attention layers charged for all "
             "the keys a query's band holds, as the MFU meter counts; other mixers for what "
             "they multiply): "
             f"{model_flops_per_token(m):,.0f}",
             f"# tokens per step: {t.global_batch * m.seq_len:,}; gradient accumulation: "
             f"{lay.microbatches(t.global_batch, t.micro_batch)} microbatches of {t.micro_batch}"]
    if cfg.parallel.offload != "none" or cfg.parallel.fast_memory_gb:
        from myria.offload.budget import plan_for_config
        lines.append("# " + plan_for_config(cfg, lay).describe())
    from myria.sim.memory import decode_state_bytes

    lines.append(f"# generation state per sequence of {m.seq_len} tokens (fp32): "
                 f"{decode_state_bytes(m, 1, m.seq_len, elem_bytes=4) / 2**20:,.2f} MiB")
    rph = ranks_per_host or world
    if (stand_in := rph > SERVER_GPUS and world % SERVER_GPUS == 0
            and planning_stand_in(cfg.training.dtype)):
        lines.append(f"# no GPU on this machine: the {rph} processes per host are priced and "
                     f"placed as servers of {SERVER_GPUS} {stand_in} (--nnodes "
                     f"{world // SERVER_GPUS} --nproc {SERVER_GPUS} says so explicitly)")
        rph = SERVER_GPUS
    try:
        spec, pred, prof = predicted(cfg, world, rph)
    except config_mod.ConfigError as e:  # e.g. measuring this CPU would need more cores
        spec = pred = prof = None
        lines.append(f"# no prediction: {e}")
    if pred is not None:
        lines += prediction_lines(cfg, world, rph, lay, spec, pred)
        from myria.sim.cpu_profile import busy_note

        if note := busy_note(prof, "myria train --dry-run"):
            lines.append(f"# ({note})")
        if m.arch in ("retnet", "griffin", "hybrid") or m.attention != "softmax":
            lines.append("# (this mixer's FLOPs are priced exactly, its activations by the "
                         "attention layer's formula: docs/architectures.md)")
    from myria.parallel.placement import describe

    lines.append(describe(lay, cluster_for(cfg, rph)))
    return "\n".join(lines)


def prediction_lines(cfg, world, ranks_per_host, lay, spec, pred) -> list[str]:
    """The dry-run's prediction: memory parts that add up, step, MFU, a better layout."""
    mem = pred.memory.gb()
    from myria.device import MEASURED

    source = spec.source.removeprefix(f"{MEASURED} (").removesuffix(")")   # not nested
    # a model whose state and activations take under a gigabyte a rank (a small test model)
    # in megabytes: its parts would all read 0.00 GB beside the allocator's reserve
    unit, scale = ("GB", 1.0) if mem["total"] - mem["reserved"] >= 1 else ("MB", 1e3)
    lines = [f"# predicted on {spec.name} ("
             + (f"{MEASURED}: " if source != spec.source else "") + f"{source}), recompute "
             f"{cfg.parallel.activation_checkpoint}, sequence parallel "
             f"{'on' if cfg.parallel.sequence_parallel and lay['tp'] > 1 else 'off'}: "
             "memory per rank " + " + ".join(f"{k} {scale * mem[k]:.2f}" for k in MEMORY_PARTS)
             + f" = {scale * mem['total']:.2f} {unit} "
             f"({'fits' if pred.fits else 'does NOT fit'} in "
             f"{mem['capacity']:.3g} GB); step {pred.iteration_time_s:.3g} s, MFU "
             f"{100 * pred.mfu:.1f}% (see `myria simulate`, `myria plan`)"]
    if mem["weights"] < 0.005 <= mem["optimizer"]:
        lines.append("# (weights 0: FSDP2 under mixed precision keeps no 16-bit copy; its fp32 "
                     "shards, the master weights, are counted in optimizer, and the layers it "
                     "gathers in temporary)")
    if cfg.parallel.offload == "nvme" and spec.name != "cpu":
        lines.append(f"# (a planning figure: the nvme tier runs on CPU in this version, not on "
                     f"{spec.name}; the offload line above is the budget of the run as it "
                     "trains here)")
    better = better_layout(cfg, world, ranks_per_host or world, spec, pred)
    if better:
        lines.append(better)
    return lines


# How training.data_parallel runs the dp ranks, in the dry run's words.
ENGINE_WORDS = {"fsdp": "FSDP2, each block resharded after use",
                "zero2": "FSDP2 keeping each block gathered for the whole step (ZeRO-1's traffic)",
                "ddp": "DDP, whole replicas"}
# The parts of a rank's predicted memory; they add up to the total (myria.sim.memory).
MEMORY_PARTS = ("weights", "gradients", "optimizer", "activations", "temporary", "reserved")
LOW_MFU_SHARE = 0.6  # warn when the config reaches less than this share of the planner's best


def better_layout(cfg: config_mod.Config, world: int, ranks_per_host: int, spec, pred
                  ) -> str | None:
    """A warning line when `myria plan` finds a layout far faster than the config's (or the
    config does not fit), on the same model, batch and cluster; None when the config is close
    to the best (or on a CPU, where the planner has no cluster to search)."""
    if spec.name == "cpu":
        return None
    from myria.sim.cli_plan import searching
    from myria.sim.perf import config_run, simulate_config
    from myria.sim.planner import implausible, plan, run_of

    base, _, _ = config_run(cfg, world, spec, ranks_per_host)
    try:
        with searching("comparing with the planner's best layout") as progress:
            res = plan(base, top=1, progress=progress)
    except config_mod.ConfigError:
        return None
    # the best layout this trainer runs (the planner also prices what only other frameworks do)
    b = res.ranked[0] if res.ranked and res.ranked[0].extra.get("runnable") else \
        res.best_runnable
    if b is None or (pred.fits and pred.mfu >= LOW_MFU_SHARE * b.mfu):
        return None
    # the figure quoted is this dry run's own for the settings it names (the planner's
    # layout as myria's trainer runs it), so that following the advice prints it
    import copy

    over = layout_overrides(cfg, run_of(base, b))
    fixed = simulate_config(config_mod.apply_overrides(copy.deepcopy(cfg), over), world, spec,
                            gpus_per_node=ranks_per_host)
    if pred.fits and pred.mfu >= LOW_MFU_SHARE * fixed.mfu:
        return None
    lead = (f"predicted MFU {100 * pred.mfu:.1f}% is far below the {100 * fixed.mfu:.1f}% "
            "this model reaches" if pred.fits else "this layout does not fit in memory; this "
            f"model reaches {100 * fixed.mfu:.1f}% MFU")
    doubt = implausible(fixed)   # e.g. no memory margin: the advice may not fit either
    return (f"# WARNING: {lead} on the same {world} x {spec.name} "
            f"with the layout `myria plan` ranks best for myria's trainer: {' '.join(over)} "
            f"({fixed.memory_gb_per_gpu:.0f} GB per GPU"
            + (f"; a guess: its {doubt}" if doubt else "") + ")."
            + (" The figure above is this layout's, not myria's best;" if pred.fits else "")
            + " run `myria plan` for the ranking.")


def layout_overrides(cfg: config_mod.Config, run) -> list[str]:
    """The command-line settings that turn `cfg` into the layout of the planner's `run`: the
    parallel degrees always, the rest where they differ."""
    want = run.trainer_config()
    par = run.parallel
    out = [f"--parallel.{k}={getattr(par, k)}" for k in ("tp", "pp")]
    out += [f"--parallel.{k}={getattr(par, k)}" for k in ("cp", "ep", "vpp", "schedule")
            if getattr(par, k) != getattr(cfg.parallel, k)]
    for sec, key, value in (("training", "micro_batch", want.training.micro_batch),
                            ("training", "data_parallel", want.training.data_parallel),
                            ("parallel", "activation_checkpoint",
                             want.parallel.activation_checkpoint),
                            ("parallel", "sequence_parallel", par.sequence_parallel),
                            ("parallel", "offload", want.parallel.offload),
                            ("parallel", "offload_params", want.parallel.offload_params)):
        if value != getattr(getattr(cfg, sec), key) and not (
                key == "sequence_parallel" and par.tp == 1):
            out.append(f"--{sec}.{key}={str(value).lower() if isinstance(value, bool) else value}")
    return out


def planning_stand_in(dtype: str) -> str:
    """The GPU a prediction stands in with on a machine without one (`device.planning_device`:
    an H100 for a 16-bit config), or "" when it predicts for the local device."""
    from myria import device

    spec = device.planning_device(dtype)
    return "" if spec.name == "cpu" or device.cuda_device_spec() is not None else spec.name


def predicted(cfg: config_mod.Config, world: int, ranks_per_host: int):
    """The planner's prediction of this run: on the local GPU model, an H100 for bf16
    configs when there is none, or this CPU (measured peak) for fp32 ones; (device, step
    result, the CPU profile it was priced from or None)."""
    from myria import device
    from myria.sim.measure.cpu import measured_profile
    from myria.sim.perf import simulate_config

    spec = device.planning_device(cfg.training.dtype)
    gpn = ranks_per_host if spec.name != "cpu" else world
    prof = measured_profile(cfg, world, spec, gpus_per_node=gpn)
    return spec, simulate_config(cfg, world, spec, gpus_per_node=gpn, cpu_profile=prof), prof


def run(args) -> int:
    args.overrides += resume_overrides(args) + max_time_overrides(args)
    # the wall-time limit's origin for the processes it starts: when the user's command
    # started (Python's start-up and this module's imports count against the limit)
    job_start = min(time.time(), goodput.process_start_time())
    # Everything judged from the arguments, the config and the files comes before torch is
    # imported (seconds on a loaded host): a mistake or a finished run answers at once.
    cfg, imported = run_config(args.config, args.overrides, args.run_dir)
    check_data_overrides(args.overrides, cfg)
    if imported:  # the model's own config.json (or, resuming, the checkpoint) sets the model
        _say(imported)
    if note := pattern_note(cfg.model):
        _say(note)
    if args.nproc is not None and args.nproc < 1:
        check_nproc(args.nproc, "cpu")
    world = _nproc_for(args)
    if args.dry_run and args.nproc is None and args.nnodes == 1:
        world = Layout.fewest_processes(cfg.parallel)
        if world > 1:
            _say(f"note: --nproc not given: the dry run is of the fewest processes the layout "
                 f"needs, {world} (--nproc N, --nnodes M for another scale)")
    if args.dry_run:
        from myria.data.mixture import check_mixture_config, open_dataset
        from myria.train.distributed import device_type
        Layout.resolve(cfg.parallel, world * args.nnodes).check(
            cfg, device_type(cfg.training.device))
        # the data's directories need not exist on a planning machine: what can be judged
        if note := check_mixture_config(cfg.data, cfg.training.global_batch,
                                        cfg.training.steps):
            print(note, file=sys.stderr)
        try:   # and, where they exist, how many times the steps read them
            data = open_dataset(cfg.data, cfg.model.seq_len, verify=False)
        except DataError:
            data = None
        for line in data_passes(cfg, data) if data is not None else ():
            print(line, file=sys.stderr)
        print(dry_run(cfg, world * args.nnodes, ranks_per_host=world))
        return 0
    from myria.train.launch import (
        JOB_START_ENV,
        Stopped,
        inside_launcher,
        launch_local,
        own_run_dir,
    )

    if not args.run_dir:
        raise config_mod.ConfigError("--run-dir is required (where checkpoints and metrics go)")
    launching = args.nproc and not inside_launcher()
    if not inside_launcher():
        # Check what we can before starting processes (or, for one process, before taking the
        # run directory), so bad input fails once and clearly and leaves no run directory behind.
        from myria.data.mixture import open_dataset

        check_before_torch(cfg, args.nproc, args.nproc, bool(launching))
        check_recorded_data(cfg, args.run_dir)
        data = open_dataset(cfg.data, cfg.model.seq_len, verify=False)
        check_validation(cfg)
        if Path(args.run_dir).exists() and (done := preflight(cfg, args.run_dir,
                                                              args.stop_after)):
            _say(done)
            return 0
        from myria import faults

        for line in faults.unreachable(os.environ.get("MYRIA_FAULT"), cfg.training.steps,
                                       world * args.nnodes, args.run_dir):
            print(line, file=sys.stderr)
        from myria.train.distributed import device_type

        if launching:
            check_nproc(args.nproc, device_type(cfg.training.device))
        check_data_and_model(cfg, data, args.run_dir)
        check_launch(cfg, Layout.resolve(cfg.parallel, args.nproc or 1),
                     device_type(cfg.training.device), args.run_dir, args.nproc or 1)
    done = preflight(cfg, args.run_dir, args.stop_after)
    if done:
        _say(done)
        return 0
    own_run_dir(args.run_dir)  # a second job on it is refused; workers stop with the launcher
    if launching:
        os.environ.setdefault(JOB_START_ENV, str(job_start))
        try:
            launch_local(args.nproc, ["train", *_without_nproc(args.argv)], "myria.cli:worker")
        except Stopped as e:
            if not (Path(args.run_dir) / rundir.METRICS).exists():   # stopped while starting
                print(f"myria train: {e} before the first step; nothing was trained",
                      file=sys.stderr)
                return e.exit_code
            _summary(Path(args.run_dir))
            if done := _finished(cfg, Path(args.run_dir), args.stop_after, job_start):
                print(f"myria train: {e} {done}", file=sys.stderr)
                return 0
            print(f"myria train: {e}; {_resumes_from(Path(args.run_dir))}", file=sys.stderr)
            return e.exit_code
        except LaunchError as e:
            if getattr(e, "killed", False):   # not the run's own error: the same command
                e.args = (f"{e}; {_resumes_from(Path(args.run_dir))}",)   # goes on
            raise
        _summary(Path(args.run_dir))
        return 0
    from myria.train.trainer import train

    res = train(cfg, args.run_dir, args.stop_after)
    if not inside_launcher():
        _summary(Path(args.run_dir))
        if res.signal:   # as under a launcher (launch.Stopped): the shell's status for it
            import signal

            name = signal.Signals(res.signal).name
            if done := _finished(cfg, Path(args.run_dir), args.stop_after, job_start):
                print(f"myria train: stopped by {name} {done}", file=sys.stderr)
                return 0
            print(f"myria train: stopped by {name}; {_resumes_from(Path(args.run_dir))}",
                  file=sys.stderr)
            return 128 + res.signal
    return 0


def _say(line: str) -> None:
    """Print once per job: here, unless this is a worker whose launcher already said it."""
    from myria.train.launch import QUIET_ENV, inside_launcher

    if not inside_launcher() or (os.environ.get("RANK", "0") == "0"
                                 and os.environ.get(QUIET_ENV) != "1"):
        print(line, flush=True)


def _without_nproc(argv: list[str]) -> list[str]:
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--nproc":
            skip = True
        elif not a.startswith("--nproc="):
            out.append(a)
    return out


def _finished(cfg: config_mod.Config, run_dir: Path, stop_after: int | None,
              since: float) -> str:
    """How a run stopped by a signal had finished all the same (the newest checkpoint this job
    committed, at or after `since`, is at training.steps or at --stop-after), or "". A
    checkpoint committed before the job counts for nothing: a job that resumes an older one
    (--resume-from, checkpoint.resume = false) sets the newer ones aside only after its load.
    A finished run exits 0: a scheduler that requeues on a signal's status would start it again
    for nothing."""
    from myria.train.checkpoint.store import MANIFEST, CheckpointStore, step_of

    def ours(p: Path) -> bool:
        try:
            return (p / MANIFEST).stat().st_mtime >= since
        except OSError:
            return False

    committed = [p for p in CheckpointStore(rundir.checkpoints_dir(run_dir)).committed()
                 if ours(p)]
    step = step_of(committed[-1].name) if committed else 0
    if step and step >= cfg.training.steps:
        return (f"after its last step: trained to step {step} of training.steps = "
                f"{cfg.training.steps}, {committed[-1].name} committed")
    if step and stop_after is not None and step >= stop_after:
        return (f"after step {step} of --stop-after {stop_after}: {committed[-1].name} "
                "committed")
    return ""


def _resumes_from(run_dir: Path) -> str:
    """Where the same command would resume: the newest committed checkpoint, said as such."""
    from myria.train.checkpoint.store import CheckpointStore

    committed = CheckpointStore(rundir.checkpoints_dir(run_dir)).committed()
    newest = committed[-1].name if committed else ""
    return (f"the same command resumes from {newest}, the newest committed checkpoint" if newest
            else "no checkpoint was committed: the same command starts from step 0")


def _recorded(run_dir: Path) -> dict:
    """The run's config.json as written at its start ({} if unreadable)."""
    import json

    try:
        cfg = json.loads((run_dir / rundir.CONFIG).read_text())
    except (OSError, ValueError):
        return {}
    return cfg if isinstance(cfg, dict) else {}


def _prompt_for(run_dir: Path) -> str:
    """The example prompt of the summary's `myria generate` line: the demo corpus's opening
    words for a run on it, else a neutral start."""
    import json

    try:
        path = _recorded(run_dir)["data"]["path"]
        source = json.loads((Path(path) / "index.json").read_text()).get("source", "")
    except (OSError, ValueError, KeyError, TypeError):
        return "The"
    return "My fellow citizens" if str(source).startswith("sotu") else "The"


def _loss(row: dict, key: str = "loss") -> str:
    """A loss of a metrics.jsonl row: non-finite ones are written as null (NaN) or "inf"."""
    x = row.get(key)
    if isinstance(x, (int, float)):
        return f"{x:.3f}"
    return ("nan" if x is None else str(x)) + (" (step skipped)" if row.get("skipped") else "")


def _summary(run_dir: Path) -> None:
    path = run_dir / rundir.METRICS
    if not path.exists():
        raise DataError(f"no metrics were written to {path}")
    rows = rundir.read_jsonl(path)  # a line cut by a crash is skipped
    train_rows = [r for r in rows if "loss" in r]
    if not train_rows:
        return
    last = train_rows[-1]
    # over the last steps: tokens over time (each step's rate weighted by its time; a mean of
    # the rates would let one fast step count as much as a slow one)
    recent = [r for r in train_rows[-10:] if r.get("step_time_s")]
    secs = sum(r["step_time_s"] for r in recent)
    tps = sum(r["tokens_per_s"] * r["step_time_s"] for r in recent) / secs if secs else 0.0
    timed = [r for r in recent if r.get("mfu") is not None]
    mfus = [sum(r["mfu"] * r["step_time_s"] for r in timed)
            / sum(r["step_time_s"] for r in timed)] if timed else []
    val = [r for r in rows if "val_loss" in r]
    val_text = "" if not val else f", val loss {_loss(val[-1], 'val_loss')}" + (
        f" (step {val[-1]['step']})" if val[-1]["step"] != last["step"] else "")
    print(f"\nrun {run_dir}: step {last['step']}, loss {_loss(train_rows[0])} -> "
          f"{_loss(last)}" + val_text
          + f", {tps:,.0f} tokens/s" + (f", MFU {100 * mfus[0]:.1f}%"
                                         if mfus else ", MFU n/a"))
    from myria import detections

    if detections.read(run_dir):   # what the checks found: a corruption trained on, a skip
        from myria.observe.report import detections_line

        print(f"  {detections_line(run_dir)}")
    print(f"  metrics:     {path}\n" + (f"  tensorboard: {run_dir / rundir.TENSORBOARD}\n"
                                           if (run_dir / rundir.TENSORBOARD).is_dir() else "")
          + f"  checkpoints: {rundir.checkpoints_dir(run_dir)}")
    from myria.observe import tracking

    for line in tracking.summary_lines(run_dir, _recorded(run_dir).get("logging") or {}):
        print(f"  {line}")
    d = shlex.quote(str(run_dir))
    print(f"next:\n  myria report {d}          # timeline, heat maps, loss and MFU curves -> "
          f"{run_dir / 'report' / 'index.html'}\n"
          f"  myria generate --run-dir {d} --prompt \"{_prompt_for(run_dir)}\" --temperature 0\n"
          f"  myria export --run-dir {d} --format hf --out {shlex.quote(str(run_dir) + '-hf')}"
          "   # Hugging Face safetensors")
