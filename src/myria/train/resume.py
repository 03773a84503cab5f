"""A resumed run's config against its checkpoint's: refuse, apply and record the changes.

Before the checkpoint is loaded, `changes` compares the config with the one the checkpoint was
trained with (kept in its meta.json) and refuses, in one line, fields that cannot change
(`myria.config.resume_rules.FROZEN_ON_RESUME`). After loading, `apply` makes the new optimizer
settings the ones that train (the loaded optimizer and scheduler state carry the old ones),
prints the changes in one line, appends them to RUN_DIR/config_changes.jsonl with the step they
take effect, and rewrites config.json with the config that trains. See docs/resume.md.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from myria import rundir
from myria.config import Config
from myria.config.resume_rules import resume_changes
from myria.fsutil import atomic_write


def previous_config(ckpt_dir: Path, run_dir: Path) -> tuple[dict, int]:
    """(config dict the checkpoint was trained with, its step). Checkpoints written before the
    config was kept in them fall back on RUN_DIR/config.json, with the model of the checkpoint."""
    meta = json.loads((Path(ckpt_dir) / "meta.json").read_text())
    prev = meta.get("config")
    if not isinstance(prev, dict):
        try:
            prev = json.loads((Path(run_dir) / rundir.CONFIG).read_text())
        except (OSError, ValueError):
            prev = {}
        if isinstance(meta.get("model"), dict):
            prev = {**prev, "model": meta["model"]}
    return prev, int(meta.get("step", 0))


def changes(cfg: Config, ckpt_dir: Path, run_dir: Path) -> list[tuple[str, Any, Any]]:
    """The changed fields of `cfg` against checkpoint `ckpt_dir`'s; ConfigError for a field
    that cannot change. Sets optimizer.decay_steps to keep the checkpoint's lr schedule."""
    prev, step = previous_config(ckpt_dir, run_dir)
    return resume_changes(prev, cfg, step)


def record(run_dir: Path, step: int, found: list[tuple[str, Any, Any]]) -> None:
    """Append the changes `found` from step `step` on to RUN_DIR/config_changes.jsonl, one row
    per change: a restart that resumes the same checkpoint again (a fault before the next
    save) applies the same changes, already recorded."""
    path = Path(run_dir) / rundir.CONFIG_CHANGES
    known = {json.dumps([r.get("step"), r.get("field"), r.get("old"), r.get("new")])
             for r in rundir.read_jsonl(path)}
    now = time.time()
    with open(path, "a") as f:
        for name, old, new in found:
            if json.dumps([step, name, old, new]) not in known:
                f.write(json.dumps({"step": step, "field": name, "old": old, "new": new,
                                    "time": now}) + "\n")


def apply(cfg: Config, engine, run_dir: Path, step: int, found: list[tuple[str, Any, Any]],
          is_main: bool) -> None:
    """After loading the checkpoint of `step`: train with `cfg`'s optimizer settings, and (rank
    0) say and record what changed."""
    from myria.optim.schedules import apply_config

    before = engine.lr  # what the checkpoint's schedule would have used next
    lr = apply_config(engine.optimizers, engine.schedulers, cfg.optimizer, cfg.training.steps)
    if not is_main:
        return
    o, t = cfg.optimizer, cfg.training
    if found:
        print(f"changed on resume, from step {step + 1}: " + ", ".join(
            f"{name} {old!r} -> {new!r}" for name, old, new in found), flush=True)
        record(run_dir, step + 1, found)
    if abs(lr - before) > 1e-3 * max(abs(before), 1e-30):
        print(f"lr of step {step + 1}: {lr:.3g} (the checkpoint's schedule had {before:.3g})",
              flush=True)
    if o.schedule != "constant" and o.decay_steps and t.steps > o.decay_steps > 0 \
            and step < t.steps:
        start = max(step, o.decay_steps) + 1
        print(f"lr schedule: the {o.schedule} decay reaches its minimum at step "
              f"{o.decay_steps} (optimizer.decay_steps, the horizon this run decayed over); "
              f"steps {start}-{t.steps} train at that minimum lr "
              f"{o.lr * o.min_lr_ratio:.3g} (--optimizer.decay_steps={t.steps} stretches the "
              "decay over the whole run instead; docs/resume.md)", flush=True)
    write_config(cfg, Path(run_dir))


def write_config(cfg: Config, run_dir: Path) -> None:
    """RUN_DIR/config.json: the config the run trains with (at its start, or once a resume
    has loaded its checkpoint: a refused resume leaves the one its checkpoints trained with)."""
    atomic_write(Path(run_dir) / rundir.CONFIG, json.dumps(cfg.to_dict(), indent=1))
