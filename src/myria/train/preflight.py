"""What is refused before any process of a run starts, in one line each: the number of local
processes, the run directory, `--stop-after`, `--max-time`, the config and the data against the
checkpoint the run resumes, the parallel layout (`Layout.check`) and the offload tier's memory
budget.

`myria train` and `myria supervise` call these before they start workers; the engine of each
worker checks the layout again (`check_run`), as the one place a layout is accepted.
"""

from __future__ import annotations

import copy
import json
import os
import sys
from pathlib import Path

from myria import config as config_mod
from myria import rundir
from myria.config import Config, resume_rules
from myria.errors import DataError
from myria.layout import Layout


def check_run(cfg: Config, layout: Layout, device_type: str = "cpu",
              shrunk: bool = False) -> None:
    """Everything to refuse before a worker starts: the layout's rules (`Layout.check`) and
    the offload tier's memory budget."""
    from myria.offload.budget import check_budget

    layout.check(cfg, device_type, shrunk=shrunk)
    check_budget(cfg, layout, device_type)


def check_launch(cfg: Config, layout: Layout, device_type: str, run_dir: str | Path,
                 local_ranks: int) -> None:
    """What a launcher (`myria train`, `myria supervise`) checks of the layout before it
    starts this host's `local_ranks` workers: `check_run`, and room on disk for the nvme
    tier's files (`myria.offload.nvme.check_disk`; its warning printed)."""
    check_run(cfg, layout, device_type)
    if cfg.parallel.offload == "nvme":
        from myria.offload.nvme import check_disk

        if warning := check_disk(cfg, layout, run_dir, local_ranks, device_type):
            print(warning, file=sys.stderr)


# Local ranks per CPU core beyond which `--nproc` is refused: each would get under an eighth of
# a core, and the processes, threads and gloo connections would swamp the host.
RANKS_PER_CORE = 8


def device_without_torch(requested: str) -> str | None:
    """`training.device` resolved where it can be without importing torch (seconds on a loaded
    host): "cpu" when asked for, or when `auto` on a host without an NVIDIA device node, where
    CUDA cannot be available; None when only torch can tell."""
    if requested == "cpu" or (requested == "auto" and not any(Path("/dev").glob("nvidia[0-9]*"))):
        return "cpu"
    return None


def add_resume_arguments(p) -> None:
    """The options of `myria train` and `myria supervise` that say where a run resumes."""
    p.add_argument("--stop-after", type=int, default=None, metavar="N",
                   help="stop cleanly after step N with a committed checkpoint")
    p.add_argument("--resume-from", metavar="CKPT", default=None,
                   help="load this checkpoint (a directory, or a step of the run: 25 or "
                   "step_00000025, also one in checkpoints/quarantine/) instead of the newest "
                   "valid one; newer checkpoints are moved aside (a restart of the job resumes "
                   "from the newest, its own saves after it)")
    p.add_argument("--start-fresh", action="store_true",
                   help="when every checkpoint of the run is damaged, train from step 0 "
                   "instead of stopping (the damaged ones stay in checkpoints/quarantine/)")
    p.add_argument("--allow-data-change", action="store_true",
                   help="resume although the data differs from the fingerprint the "
                   "checkpoint recorded (another directory, one re-prepared since, another "
                   "mixture): train on it from there")


def resume_overrides(args) -> list[str]:
    """`add_resume_arguments`' options as the [checkpoint] overrides they stand for."""
    out = []
    if args.resume_from:
        path = checkpoint_arg(args.resume_from, getattr(args, "run_dir", None))
        out.append(f"--checkpoint.resume_from={path}")
    if args.start_fresh:
        out.append("--checkpoint.start_fresh=true")
    if args.allow_data_change:
        out.append("--checkpoint.allow_data_change=true")
    return out


def checkpoint_arg(value: str, run_dir: str | None) -> Path:
    """`--resume-from VALUE` as a checkpoint directory: a path, a step number (N or its
    directory's name, step_0000000N) of the run's checkpoints/ or checkpoints/quarantine/.
    ConfigError, listing the run's checkpoints, when none of these is a checkpoint (one with
    meta.json): said before anything starts."""
    from myria.train.checkpoint.store import MANIFEST, QUARANTINE, CheckpointStore

    store = CheckpointStore(Path(run_dir or ".") / rundir.CHECKPOINTS)
    tries = [Path(value)]
    if run_dir:
        name = store.path_for(int(value)).name if value.isdigit() else value
        tries += [store.dir / name, store.dir / QUARANTINE / name]
    for t in tries:
        if (t / MANIFEST).is_file():
            return t.resolve()
    have = [str(q.relative_to(store.dir)) for q in store.committed() + store.quarantined()]
    why = f"is not a checkpoint directory (no {MANIFEST} in it)" if Path(value).is_dir() else \
        "names no checkpoint"
    raise config_mod.ConfigError(
        f"--resume-from {value} {why}; give a checkpoint directory or a step of the run's"
        + (f": {store.dir} holds {', '.join(have)}" if have else
           f" (none in {store.dir})" if run_dir else " (no --run-dir given)"))


def max_time_overrides(args) -> list[str]:
    """`--max-time` as the override it stands for (training.max_time_s); given with that
    override too, the two would silently compete: refused."""
    if args.max_time is None:
        return []
    if any(o.split("=", 1)[0] == "--training.max_time_s" for o in args.overrides):
        raise config_mod.ConfigError("--max-time and --training.max_time_s both set the "
                                     "wall-time limit: give one")
    return [f"--training.max_time_s={parse_duration(args.max_time)}"]


def check_data_overrides(overrides: list[str], cfg: Config) -> None:
    """`--data.path` typed while a mixture names the data (a `--data.sources` typed beside it,
    or the config's or the resumed run's `data.sources`): the mixture would win and the path
    be ignored without a word; refused. An empty `--data.sources=` with `--data.path` trains
    on the one path (it takes a config file's mixture away)."""
    typed = {}
    for o in overrides:
        key = o.split("=", 1)[0]
        if key in ("--data.path", "--data.sources"):
            typed[key] = config_mod.parse_override(o)[2]   # the last one typed applies
    if "--data.path" not in typed:
        return
    if str(typed.get("--data.sources") or "").strip():
        raise config_mod.ConfigError("--data.path and --data.sources both name the training "
                                     "data (a mixture of sources takes the place of the one "
                                     "path): give one (--data.sources= trains on the path)")
    if "--data.sources" not in typed and str(cfg.data.sources or "").strip():
        raise config_mod.ConfigError(f"--data.path {typed['--data.path']}: the run's data is "
                                     f"the mixture data.sources = {cfg.data.sources!r}, which "
                                     "takes the place of the one path; add --data.sources= "
                                     "to train on the path")


def check_before_torch(cfg: Config, local: int, world: int, launching: bool) -> None:
    """This host's process count (`local`, when it starts them) and the layout's rules over
    `world` ranks, judged before torch is imported when the device is known without it
    (`device_without_torch`); the same checks run again with the device torch reports."""
    device = device_without_torch(cfg.training.device)
    if device is None:
        return
    if launching:
        check_nproc(local, device)
    Layout.resolve(cfg.parallel, world or 1).check(cfg, device)


def check_validation(cfg: Config):
    """With evaluation on, the validation split, opened and checked: a split without one
    sample, or with a shard that does not match its sha256 in index.json, is refused now, not
    at the first evaluation, with how to train without it (None with evaluation off). The
    launchers ask it before processes start; each rank opens its split with it, so a run
    started by torchrun, which has no launcher's checks, is refused at its start too. (The
    validation split is a small share of the data, `--val-fraction`: checksumming it costs a
    fraction of what each rank's check of the training shards does.)"""
    if not cfg.training.eval_interval:
        return None
    from myria.data.mixture import open_dataset

    try:
        return open_dataset(cfg.data, cfg.model.seq_len, split="val", verify=True)
    except DataError as e:
        raise DataError(f"{e}; or train without validation: --training.eval_interval=0 (it is "
                        f"{cfg.training.eval_interval})") from None


def check_mixture(cfg: Config, dataset) -> None:
    """A mixture the run cannot read as asked (a share under one sample per step, a source
    read past its epoch limit): refused before processes start, and by each rank again."""
    from myria.data.mixture import MixtureDataset

    if isinstance(dataset, MixtureDataset):
        dataset.check(cfg.training.global_batch, cfg.training.steps)


def data_passes(cfg: Config, dataset) -> list[str]:
    """Lines to print when training.steps read a directory (`data.path`, or a source of
    `data.sources`) more than once: a note of how many times, or a warning when one step
    reads more samples of it than it has (the same samples repeated within the step)."""
    from myria.data.mixture import MixtureDataset

    t = cfg.training
    if isinstance(dataset, MixtureDataset):
        parts = [(f"source {s.name!r} ({s.path})", int(n), float(e),
                  max(float(sh[k]) for sh in dataset.schedule.shares) * t.global_batch)
                 for k, (s, n, e) in enumerate(zip(dataset.sources, dataset.sizes,
                                                   dataset.epochs(t.steps, t.global_batch),
                                                   strict=True))]
    else:
        parts = [(f"data.path {dataset.path}", dataset.num_samples,
                  t.steps * t.global_batch / dataset.num_samples, float(t.global_batch))]
    out, again = [], []
    for what, n, epochs, per_step in parts:
        if per_step > n:
            out.append(f"warning: {what} has {n:,} training sample{'s' * (n != 1)} of "
                       f"model.seq_len = {cfg.model.seq_len}, fewer than the {per_step:.3g} a "
                       f"step reads of it: each step repeats them (about {per_step / n:.3g} "
                       f"times; {epochs:.3g} passes in training.steps = {t.steps}); prepare "
                       "more text, or lower training.global_batch or model.seq_len")
        elif epochs > 1:
            again.append(f"{what} {epochs:.3g} times")
    if again:
        out.insert(0, f"note: training.steps = {t.steps} read {', '.join(again)} over (each "
                   "sample once per pass)")
    return out


def check_vocab(cfg: Config, dataset) -> str | None:
    """Refuse a model whose vocabulary is smaller than the tokenizer of its data; a note (the
    line to print) when it is much larger: rows of the embedding no token ever trains."""
    if dataset.vocab_size > cfg.model.vocab_size and cfg.model.init_from:
        own = Path(cfg.model.init_from) / "tokenizer.json"
        same = own.is_file() and json.loads(own.read_text()) == json.loads(
            Path(dataset.tokenizer_path).read_text())
        raise config_mod.ConfigError(
            f"the tokenizer of {dataset.path} has {dataset.vocab_size} tokens but the model in "
            f"{cfg.model.init_from} has {cfg.model.vocab_size} (its config.json's vocab_size); "
            + ("the data was prepared with the model's own tokenizer.json, so the model folder "
               "does not agree with itself: its embedding has fewer rows than its tokenizer "
               "has tokens (a tokenizer with added tokens whose embedding was not resized?)"
               if same else "prepare the data with the model's own tokenizer: myria prepare "
               f"--tokenizer {cfg.model.init_from} ..."))
    if dataset.vocab_size > cfg.model.vocab_size:
        raise config_mod.ConfigError(
            f"the tokenizer of {dataset.path} has {dataset.vocab_size} tokens but "
            f"model.vocab_size = {cfg.model.vocab_size}; set model.vocab_size >= "
            f"{dataset.vocab_size}")
    padded = -(-dataset.vocab_size // 64) * 64   # a multiple of 64, as GEMMs like it
    if not cfg.model.init_from and cfg.model.vocab_size > max(2 * dataset.vocab_size,
                                                              padded + 1024):
        return (f"note: model.vocab_size = {cfg.model.vocab_size:,} for a tokenizer of "
                f"{dataset.vocab_size:,} tokens ({dataset.path}): "
                f"{cfg.model.vocab_size - dataset.vocab_size:,} embedding rows no token trains; "
                f"--model.vocab_size={padded} fits it")
    return None


def check_tokenizer(cfg: Config, dataset) -> str | None:
    """Refuse data prepared with another tokenizer than the model `model.init_from` starts
    from: every token of the model's tokenizer.json must have the same id in the data's (one
    with tokens added after the model's is refused by `check_vocab` when they pass its
    vocabulary). Data tokenized otherwise trains and exports without an error while the model
    reads other tokens than it learnt; the natural slip is a `myria prepare` without
    `--tokenizer`. A model folder without tokenizer.json cannot be compared: a note (the line
    to print) says so."""
    model_tok = Path(cfg.model.init_from or "") / "tokenizer.json"
    if not cfg.model.init_from:
        return None
    if not model_tok.is_file():
        return (f"note: {cfg.model.init_from} has no tokenizer.json: the data's tokenizer "
                f"({dataset.tokenizer_path}) cannot be checked against the one the model "
                "learnt; prepare with `myria prepare --tokenizer` the model's own to be sure")
    from myria.data.tokenizer import load_tokenizer

    want = load_tokenizer(model_tok).get_vocab(with_added_tokens=True)
    have = load_tokenizer(dataset.tokenizer_path).get_vocab(with_added_tokens=True)
    wrong = sum(1 for t, i in want.items() if have.get(t) != i)
    if wrong:
        raise config_mod.ConfigError(
            f"the data in {dataset.path} was prepared with another tokenizer than the model in "
            f"{cfg.model.init_from}: {wrong:,} of the model's {len(want):,} tokens have another "
            f"id or none in the data's ({dataset.tokenizer_path}), so the model would read "
            "other tokens than it learnt; prepare the data with the model's own tokenizer: "
            f"myria prepare --tokenizer {cfg.model.init_from} ...")
    return None


def check_init_weights(cfg: Config, run_dir: str | Path) -> None:
    """The tensors of the `model.init_from` folder against the model (one missing, of another
    shape, one with no place in it), refused in one line before processes start; a start that
    resumes a checkpoint reads none of them."""
    if not cfg.model.init_from or newest_checkpoint(cfg, Path(run_dir)) is not None:
        return
    from myria.interop import hf

    hf.check_weights(Path(cfg.model.init_from), cfg.model)


def check_data_and_model(cfg: Config, dataset, run_dir: str | Path) -> None:
    """What a launcher (`myria train`, `myria supervise`) checks of the data against the model
    before any process starts; prints `check_vocab`'s note, if any."""
    if note := check_vocab(cfg, dataset):
        print(note, flush=True)
    from myria.data.mixture import check_mixture_config

    if note := check_mixture_config(cfg.data, cfg.training.global_batch, cfg.training.steps):
        print(note, flush=True)
    check_mixture(cfg, dataset)
    for line in data_passes(cfg, dataset):
        print(line, file=sys.stderr if line.startswith("warning") else sys.stdout, flush=True)
    if note := check_tokenizer(cfg, dataset):
        print(note, flush=True)
    check_init_weights(cfg, run_dir)


def check_nproc(nproc: int, device: str, flag: str = "--nproc") -> None:
    """One line for a number of local processes this host cannot run (before any starts)."""
    if nproc < 1:
        raise config_mod.ConfigError(f"{flag} {nproc}: must be at least 1 (processes on this "
                                     "host)")
    if device == "cuda":
        import torch
        if nproc > (n := torch.cuda.device_count()):
            raise config_mod.ConfigError(f"{flag} {nproc}: this host has {n} GPU(s); start at "
                                         f"most {n} processes per host (one per GPU)")
    elif nproc > (n := RANKS_PER_CORE * (os.cpu_count() or 1)):
        raise config_mod.ConfigError(f"{flag} {nproc}: this host has {os.cpu_count()} CPU "
                                     f"cores; at most {n} processes ({RANKS_PER_CORE} per core)")


def check_run_dir(run_dir: str | Path, flag: str = "--run-dir") -> None:
    """One line when the run directory cannot be one (a file, under a file, not writable);
    creates it otherwise."""
    p = Path(run_dir)
    if p.exists() and not p.is_dir():
        raise config_mod.ConfigError(f"{flag} {str(p)!r} is a file, not a directory; name a new "
                                     "directory or an existing run's")
    try:
        p.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise config_mod.ConfigError(f"{flag} {str(p)!r} cannot be created: {e.strerror}"
                                     + (f" ({e.filename})" if e.filename and
                                        str(e.filename) != str(p) else "")) from None


def newest_checkpoint(cfg: config_mod.Config, run_dir: Path) -> Path | None:
    """The checkpoint a start would most likely resume (resume_from, or `latest`), unverified;
    None for a fresh start. The trainer decides for good (it verifies checksums)."""
    c = cfg.checkpoint
    if c.resume_from:
        return Path(c.resume_from) if (Path(c.resume_from) / "meta.json").is_file() else None
    if not c.resume:
        return None
    try:
        name = (run_dir / rundir.CHECKPOINTS / "latest").read_text().strip()
    except OSError:
        return None
    path = run_dir / rundir.CHECKPOINTS / name
    return path if name and (path / "meta.json").is_file() else None


def run_config(path: str | Path | None, overrides, run_dir: str | Path | None
               ) -> tuple[Config, str | None]:
    """The config `myria train` and `myria supervise` run with (`hf.load_config`), given the
    checkpoint the run resumes: its model section (a run started from a Hugging Face
    directory resumes from its checkpoint without it) and its data mixture (new weights of the
    same sources go on as a phase from the step resumed: `mixture.resolve_resume`). Also the
    lines that say so (an imported model, a new phase), or None."""
    from myria.data import mixture
    from myria.interop import hf
    from myria.train import resume

    cfg = config_mod.load(path, overrides)
    prev, step = {}, 0
    if run_dir and (ckpt := newest_checkpoint(cfg, Path(run_dir))) is not None:
        try:
            prev, step = resume.previous_config(ckpt, Path(run_dir))
        except (OSError, ValueError):
            pass  # unreadable: the trainer quarantines it and says so
    resumed = prev.get("model")
    said = [hf.apply(cfg, resumed=resumed if isinstance(resumed, dict) else None,
                     overrides=overrides)]
    data = prev.get("data") if isinstance(prev.get("data"), dict) else {}
    d = cfg.data
    d.sources, d.phases, phase = mixture.resolve_resume(
        str(data.get("sources") or ""), str(data.get("phases") or ""), d.sources, d.phases,
        step)
    if prev and step >= cfg.training.steps:
        phase = None   # nothing to train (`preflight` says so): no weights change
    return cfg, "\n".join(x for x in (*said, phase) if x) or None


def check_recorded_data(cfg: Config, run_dir: str | Path | None) -> None:
    """A directory of `[data]` that does not exist, where the checkpoint the run resumes was
    trained on one of that name elsewhere (a relative path read from another working
    directory, a moved directory): DataError naming the recorded one, not how to prepare new
    data, which the fingerprint would refuse (`myria.data.fingerprint`)."""
    from myria.data import fingerprint
    from myria.data.mixture import parse_sources

    ckpt = newest_checkpoint(cfg, Path(run_dir)) if run_dir else None
    rec = fingerprint.recorded(ckpt) if ckpt is not None else None
    if rec is None:
        return
    if cfg.data.sources:
        typed = [(s.path, f"source {s.name!r} of data.sources as ")
                 for s in parse_sources(cfg.data.sources)]
        held = {Path(e["path"]).name: e["path"] for e in rec.get("sources", [])}
    else:
        typed = [(cfg.data.path, "--data.path=")]
        mixture = "sources" in rec or fingerprint.recorded_sources(ckpt)
        held = {} if mixture else {"": rec["path"]}
    for path, key in typed:
        was = held.get(Path(path).name, held.get(""))
        if Path(path).is_dir() or not was or Path(was) == Path(path).absolute():
            continue
        fix = f"which exists: give {key}{was}" if Path(was).is_dir() else \
            "which does not exist either: restore it there"
        where = "" if Path(path).is_absolute() else f" (relative to {os.getcwd()})"
        raise DataError(f"data directory {path!r} does not exist{where}; {ckpt.name} was "
                        f"trained on {was}, {fix}")


def preflight(cfg: config_mod.Config, run_dir: str | Path, stop_after: int | None) -> str | None:
    """What can be checked before processes start: the run directory, `--stop-after` and the
    config against the checkpoint the run resumes (fields that cannot change are refused), and,
    when it trains further, the data against the fingerprint that checkpoint recorded.
    Returns a line to print instead of training when the run already reached training.steps."""
    run_dir = Path(run_dir)
    new = not run_dir.exists()
    check_run_dir(run_dir)
    try:
        return _preflight(cfg, run_dir, stop_after)
    except config_mod.ConfigError:
        if new and not any(run_dir.iterdir()):   # a refused start leaves no run directory
            run_dir.rmdir()
        raise


def _preflight(cfg: config_mod.Config, run_dir: Path, stop_after: int | None) -> str | None:
    from myria.train import resume

    if stop_after is not None and stop_after < 1:
        raise config_mod.ConfigError(f"--stop-after {stop_after}: must be a step >= 1 (the run "
                                     "stops cleanly after that step)")
    ckpt = newest_checkpoint(cfg, run_dir)
    if ckpt is None:
        return None
    try:
        prev, step = resume.previous_config(ckpt, run_dir)
    except (OSError, ValueError):
        return None  # unreadable: the trainer quarantines it and says so
    resume_rules.resume_changes(prev, copy.deepcopy(cfg), step)
    from myria.data import mixture

    data = prev.get("data") or {}
    mixture.check_resume(str(data.get("sources") or ""), cfg.data.sources, step,
                         str(data.get("phases") or ""), cfg.data.phases)
    if step < cfg.training.steps and (stop_after is None or stop_after > step):
        from myria.data import fingerprint  # the trainer checks again the checkpoint it loads

        fingerprint.check_resume(ckpt, mixture.data_fingerprint(cfg.data),
                                 cfg.checkpoint.allow_data_change, announce=False)
        return None
    from myria.train.checkpoint.store import verify_dir

    if not cfg.checkpoint.resume_from and verify_dir(ckpt)[0] is not None:
        return None  # damaged: the trainer quarantines it, says so and resumes an older one
    if step >= cfg.training.steps:
        return (f"{run_dir}: already trained to step {step} of training.steps = "
                f"{cfg.training.steps}; nothing to do (raise --training.steps to train further, "
                "docs/resume.md)")
    if stop_after is not None and stop_after <= step:
        raise config_mod.ConfigError(f"--stop-after {stop_after}: the run resumes at step "
                                     f"{step} ({ckpt}); give a later step")
    return None


def parse_duration(text: str, flag: str = "--max-time") -> float:
    """Seconds of a duration: Slurm's forms (MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS)
    or a number with a unit s, m, h or d."""
    t = text.strip().lower()
    try:
        if t and t[-1] in "smhd" and t[:-1].replace(".", "", 1).isdigit():
            value = float(t[:-1]) * {"s": 1, "m": 60, "h": 3600, "d": 86400}[t[-1]]
        else:
            days, dash, rest = t.rpartition("-")
            if dash and not days:
                raise ValueError
            parts = [float(x) for x in rest.split(":")]
            if days:   # D-HH[:MM[:SS]]
                parts += [0.0] * (3 - len(parts))
                h, m, sec = parts
            else:      # MM, MM:SS or HH:MM:SS
                h, m, sec = ([0.0] * (3 - len(parts)) + parts) if len(parts) > 1 else \
                    (0.0, parts[0], 0.0)
            if len(parts) > 3 or not all(x >= 0 for x in parts):
                raise ValueError
            value = float(days or 0) * 86400 + h * 3600 + m * 60 + sec
    except ValueError:
        value = -1.0
    if not value > 0:
        raise config_mod.ConfigError(f"{flag} {text!r}: expected a duration > 0 such as "
                                     "'1:30:00', '90' (minutes, as Slurm), '90m' or '2h'")
    return value
