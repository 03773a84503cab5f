"""What a resumed run may change: the config of a checkpoint against the config that resumes it.

Fields whose change would not match the checkpoint's weights, data position or optimizer state
are refused in one line; every other field is applied from the resumed step on (recorded by
`myria.train.resume`). The lr decay horizon is kept once the decay has begun.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from myria.config import SECTIONS, Config
from myria.errors import ConfigError

# Fields a resumed run cannot change, with the reason (the checkpoint's weights, the data
# position or the optimizer state depend on them). Every other field is applied from the
# resumed step on and recorded (RUN_DIR/config_changes.jsonl).
FROZEN_ON_RESUME: dict[str, str] = {
    **{f"model.{k}": "the checkpoint's weights have that shape" for k in (
        "arch", "vocab_size", "layers", "hidden", "heads", "kv_heads", "ffn_hidden", "experts",
        "tie_embeddings", "parallel_block", "block_pattern", "qkv_bias", "ssm_state",
        "ssm_expand")},
    **{f"model.{k}": "the checkpoint's weights were trained as that mixer" for k in (
        "attention", "feature_map")},
    "model.init_std": "it only initialises the weights at step 0",
    "model.seq_len": "the data position of the checkpoint is counted in sequences of that length",
    "training.seed": "the data order (and the initialisation) is a function of the seed",
    "training.global_batch": "the data position of the checkpoint is counted in global batches",
    "optimizer.name": "the checkpoint's optimizer state is that optimizer's",
}
# Shape fields whose 0 means "derived": compared by the size they resolve to (ffn_hidden 0 is
# the architecture's width, kv_heads 0 one per head), so writing the derived value out resumes.
RESOLVED = {"model.ffn_hidden": lambda m: m.ffn_dim, "model.kv_heads": lambda m: m.n_kv_heads}
# Fields that choose what one session does, not part of the run's history.
SESSION_FIELDS = ("checkpoint.resume", "checkpoint.resume_from", "checkpoint.start_fresh")


def decay_horizon(optimizer: dict, training: dict) -> int:
    """The step where the lr decay reaches its minimum: decay_steps, or training.steps if 0."""
    return int(optimizer.get("decay_steps") or training.get("steps") or 0)


def decay_start(schedule: str, warmup: int, horizon: int, fraction: float) -> int:
    """The first step whose lr is below the peak: the end of warm-up, or for wsd the end of its
    stable phase (the last `fraction` of the horizon decays)."""
    if schedule != "wsd":
        return warmup
    return max(warmup, horizon - round(fraction * horizon))


def resume_changes(previous: dict, cfg: Config, step: int) -> list[tuple[str, Any, Any]]:
    """The fields of `cfg` that differ from `previous` (the config dict a checkpoint of step
    `step` was trained with; sections it lacks are not compared), as (field, old, new).

    Raises one ConfigError naming every field that cannot change on resume. A run whose decay
    had begun keeps the lr decay horizon it was trained with when training.steps changes
    (optimizer.decay_steps is set to it unless given), so the lr goes on where it was instead
    of jumping; during warm-up (and wsd's stable phase) a new horizon changes nothing that
    already happened.
    """
    prev_opt, prev_train = previous.get("optimizer", {}), previous.get("training", {})
    old = decay_horizon(prev_opt, prev_train)
    o = cfg.optimizer
    begun = decay_start(o.schedule, o.warmup_steps, old, o.decay_fraction)
    if not cfg.optimizer.decay_steps and old and step > begun:
        cfg.optimizer.decay_steps = old  # keep the schedule the checkpoint was trained on
    changes, refused = [], []
    try:   # the checkpoint's model, for the sizes RESOLVED fields stand for
        from myria.config import from_dict

        prev_model = from_dict({"model": previous["model"]}).model
    except (KeyError, TypeError, ConfigError):
        prev_model = None
    from myria.config.model import inert_settings

    # a setting the resumed model does not use (another architecture's pattern) is no change
    # to name: the change that matters (model.arch) is named on its own
    inert = {f"model.{k}" for keys, _ in inert_settings(cfg.model) for k in keys}
    for section, cls in SECTIONS.items():
        before = previous.get(section)
        if not isinstance(before, dict):
            continue
        now = getattr(cfg, section)
        for f in dataclasses.fields(cls):
            name = f"{section}.{f.name}"
            if name in SESSION_FIELDS or name in inert or f.name not in before:
                continue
            old, new = before[f.name], getattr(now, f.name)
            if name == "optimizer.decay_steps":  # 0 means training.steps: compare horizons
                old = decay_horizon(prev_opt, prev_train)
                new = new or cfg.training.steps
            if old == new or (isinstance(new, tuple) and list(new) == old):
                continue
            if name in RESOLVED and prev_model is not None and \
                    RESOLVED[name](prev_model) == RESOLVED[name](cfg.model):
                continue   # the same size, written out or left derived
            if name in FROZEN_ON_RESUME:
                size = f", i.e. {RESOLVED[name](prev_model)}" if name in RESOLVED and \
                    prev_model is not None and not old else ""
                refused.append(f"{name} = {new!r} (the checkpoint has {old!r}{size}: "
                               f"{FROZEN_ON_RESUME[name]})")
            else:
                changes.append((name, old, new))
    if refused:
        way_out = (f"resume from a checkpoint of this model instead of --resume-from "
                   f"{cfg.checkpoint.resume_from}, or leave --resume-from out to train from "
                   "step 0" if cfg.checkpoint.resume_from else
                   "use a new --run-dir, or --checkpoint.resume=false to train this run "
                   "directory from step 0")
        raise ConfigError(f"cannot change on resume from step {step}: " + "; ".join(refused)
                          + f". To train it, {way_out}")
    return changes
