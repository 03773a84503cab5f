"""The nvme tier of one rank (parallel.offload = nvme): one OffloadedAdamW per model part,
sharing the fast-memory budget, their files under OFFLOAD_DIR/rankNNNNN/partK.

It implements the optimizer-tier protocol (myria.offload.tier.OptimizerTier): the engine tells
it about the last backward, the clip and changed gradients (the update that runs during
backward needs to know), and asks it for the files a checkpoint links and for the parameters
kept on disk (`offload_params`).
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from myria import rundir
from myria.errors import CheckpointError, ConfigError, OffloadError
from myria.faults import FaultInjector
from myria.layout import Layout
from myria.models.init import canonical_name
from myria.offload.adamw import OffloadedAdamW
from myria.offload.budget import MemoryPlan, activation_bytes, plan_memory
from myria.offload.diskio import ALIGN, probe_direct
from myria.offload.params import ParamStreamer, file_tensor, placeholders, units_of
from myria.offload.procmem import keep_heap_small
from myria.optim import param_groups
from myria.tensors import local_shard

log = logging.getLogger("myria")

CKPT_PREFIX = "offload"      # checkpoint subdirectory of the linked state files


def has_offload_files(meta: dict) -> bool:
    """Whether a checkpoint (its meta.json) keeps optimizer state in offload files."""
    return any(name.startswith(CKPT_PREFIX + "/") for name in meta.get("files", {}))


def fill_in_memory(parts: list[nn.Module], read) -> None:
    """`read({name: parameter})` once with every parameter of the parts (tied ones once)."""
    named = {}
    for part in parts:
        named.update(part.named_parameters())
    with torch.no_grad():
        read(named)


def local_sizes(parts: list[nn.Module]) -> tuple[int, int, int]:
    """(parameters this rank holds, the largest transformer block's, the largest of the
    embeddings, the final norm with the output layer, and a block), local shards."""
    seen: set[int] = set()
    total = 0
    for part in parts:
        for p in part.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                total += local_shard(p).numel()
    layer = ends = 0
    count = lambda mods: sum(local_shard(p).numel() for m in mods if m is not None  # noqa: E731
                             for p in m.parameters())
    for part in parts:
        for block in getattr(part, "layers", {}).values():
            layer = max(layer, count([block]))
        ends = max(ends, count([getattr(part, "tok_embeddings", None),
                                getattr(part, "pos_embeddings", None)]),
                   count([getattr(part, "norm", None), getattr(part, "output", None)]))
    return total, layer, max(layer, ends)


def offload_root(cfg, run_dir: str | Path | None) -> Path:
    """The offload directory: parallel.offload_dir, or RUN_DIR/offload."""
    if cfg.parallel.offload_dir:
        return Path(cfg.parallel.offload_dir)
    if run_dir is None:
        raise ConfigError("parallel.offload = 'nvme' needs parallel.offload_dir (or a run "
                          "directory to put RUN_DIR/offload in)")
    return Path(run_dir) / rundir.OFFLOAD_DIR


def _existing(path: Path) -> Path:
    """`path`, or its nearest ancestor that exists (where its file system is)."""
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def check_disk(cfg, layout: Layout, run_dir: str | Path | None, local_ranks: int,
               device_type: str = "cpu") -> str | None:
    """Room for the nvme tier's files of this host's `local_ranks`, before any worker starts.

    Each rank keeps two generations at rest (the committed one and the one the next update
    writes; `myria.offload.generations`), and each kept checkpoint on the same file system
    holds one more (it hard-links a generation, which is then never rewritten). ConfigError
    when the two cannot fit (the run could not take a step); a warning to print when the
    checkpoints' would not (the run would stop with a full disk at a later step). Files of an
    earlier start in the directory count as free: they are removed or reused at start."""
    if cfg.parallel.offload != "nvme":
        return None
    from myria.offload.budget import plan_for_config

    root = offload_root(cfg, run_dir)
    gen = plan_for_config(cfg, layout, device_type).offloaded
    where = _existing(root)
    free = shutil.disk_usage(where).free
    for f in [*root.glob("rank*/part*/gen_*.bin"), *root.glob("rank*/part*/spare.bin")]:
        st = f.stat()
        if st.st_nlink == 1:   # one a checkpoint links keeps its blocks
            free += st.st_blocks * 512
    ckpt = _existing(rundir.checkpoints_dir(run_dir)) if run_dir is not None else None
    pinned = cfg.checkpoint.keep if ckpt is not None and \
        ckpt.stat().st_dev == where.stat().st_dev else 0
    need, most = 2 * gen * local_ranks, (2 + pinned) * gen * local_ranks
    gb = lambda x: f"{x / 1e9:.3g} GB"  # noqa: E731
    says = (f"the nvme tier's files need {gb(gen)} a generation per rank x {local_ranks} "
            f"rank(s) on this host: {gb(need)} at rest")
    if free < need:
        raise ConfigError(f"offload directory {root}: {says}, and its file system has "
                          f"{gb(free)} free; free space or set parallel.offload_dir to a "
                          "larger disk")
    if free < most:
        return (f"warning: offload directory {root}: {says}, {gb(most)} with the "
                f"{pinned} checkpoint(s) kept (checkpoint.keep) on the same file system, "
                f"which has {gb(free)} free: the run will stop with a full disk once they "
                "fill it")
    return None


class NvmeTier:
    """AdamW's state (and with offload_params the parameters) in files on a local disk."""

    reads_grads_in_backward = True   # the speculative update (OffloadedAdamW.before_last_backward)

    def __init__(self, cfg, run_dir: str | Path | None, rank: int):
        self.cfg, self.run_dir, self.rank = cfg, run_dir, rank
        self.optimizers: list[OffloadedAdamW] = []
        self.parts: list[nn.Module] = []
        self.plan: MemoryPlan | None = None
        self.directory = offload_root(cfg, run_dir) / f"rank{rank:05d}"
        keep_heap_small()   # a memory budget: freed tensors must leave the process

    def materialise(self, part: nn.Module, device: torch.device, seed: int) -> None:
        """Parameters kept on disk (offload_params) are materialised a unit at a time by
        their streamer (`build`); otherwise as in memory."""
        if not self.cfg.parallel.offload_params:
            part.to_empty(device=device)
            part.init_weights(seed)

    def build(self, parts: list[nn.Module], layout: Layout,
              device_type: str) -> list[OffloadedAdamW]:
        cfg, rank, run_dir = self.cfg, self.rank, self.run_dir
        par, o = cfg.parallel, cfg.optimizer
        root, directory = self.directory.parent, self.directory
        total, layer, unit = local_sizes(parts)
        itemsize = next(iter(parts[0].parameters())).element_size()
        plan = plan_memory(cfg, total, layer, itemsize,
                           activation_bytes(cfg, layout, device_type), unit)
        try:
            directory.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise OffloadError(f"parallel.offload_dir {str(root)!r} is not writable: "
                               f"{e.strerror or e}") from None
        if not os.access(directory, os.W_OK):
            raise OffloadError(f"parallel.offload_dir {str(root)!r} is not writable")
        direct = probe_direct(directory)
        faults = FaultInjector(run_dir, rank) if run_dir is not None else None
        stats = rundir.offload_stats_file(run_dir, rank) if run_dir is not None else None
        n = len(parts)
        chunk = max(ALIGN, plan.chunk_bytes // n // ALIGN * ALIGN)
        opts = []
        for i, part in enumerate(parts):
            sf = stats if stats is None or n == 1 else stats.with_name(f"{stats.stem}.part{i}.json")
            shapes = order = None
            if par.offload_params:  # the part is still on the meta device (materialise)
                true_shape = placeholders(part, torch.device("cpu"))
            groups = param_groups(part, o.weight_decay)
            if par.offload_params:
                flat = [p for g in groups for p in g["params"]]
                shapes = [true_shape[id(p)] for p in flat]
                # the files in forward order of the units, each unit's tensors together (its
                # norms too, which AdamW's groups put last): the next forward then follows
                # the update chunk by chunk instead of waiting for its last chunk
                where = {id(p): t for t, p in enumerate(flat)}
                order = [where[id(p)] for _, mods in units_of(part) for m in mods
                         for p in m.parameters()]
            kinds = {isinstance(p, DTensor) for g in groups for p in g["params"]}
            opt = OffloadedAdamW(
                groups, directory / f"part{i}", lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps,
                foreach=len(kinds) < 2, buffers=plan.buffers, chunk_bytes=chunk,
                direct=direct, offload_params=par.offload_params, faults=faults,
                stats_file=sf, budget=plan.budget, shapes=shapes, order=order)
            if par.offload_params:
                opt.streamer = ParamStreamer(part, opt, cfg.training.seed)
            opts.append(opt)
        self.optimizers, self.plan, self.parts = opts, plan, list(parts)
        return opts

    def fill_parameters(self, parts: list[nn.Module], read) -> None:
        """In memory as the memory tier does; on disk (offload_params) one unit at a time
        into generation 0, so no more than a unit is ever held."""
        if not self.cfg.parallel.offload_params:
            fill_in_memory(parts, read)
            return
        for part, opt in zip(parts, self.optimizers):
            opt.streamer.fill(part, read)

    # -- what the step tells the optimizers (the same methods, per part) ---------------------
    def before_last_backward(self) -> None:
        for opt in self.optimizers:
            opt.before_last_backward()

    def on_clip(self, scaled: bool) -> None:
        for opt in self.optimizers:
            opt.on_clip(scaled)

    def on_grads_changed(self) -> None:
        for opt in self.optimizers:
            opt.on_grads_changed()

    # -- checkpoints -------------------------------------------------------------------------
    def names(self, i: int) -> str:
        return f"{CKPT_PREFIX}/rank{self.rank:05d}.part{i}"

    def checkpoint_files(self) -> dict[str, Path]:
        files: dict[str, Path] = {}
        for i, opt in enumerate(self.optimizers):
            files.update(opt.checkpoint_files(self.names(i)))
        return files

    def checkpoint_checks(self) -> dict[str, Callable[[Path], str]]:
        checks: dict[str, Callable[[Path], str]] = {}
        for i, opt in enumerate(self.optimizers):
            checks.update(opt.checkpoint_checks(self.names(i)))
        return checks

    def check_checkpoint(self, path: Path, meta: dict) -> None:
        if not has_offload_files(meta):
            raise CheckpointError(f"checkpoint {path} keeps its optimizer state in memory "
                                  "shards (saved without parallel.offload = 'nvme'); resume it "
                                  "with the parallel.offload setting it was saved with")

    def load_files(self, ckpt: Path) -> None:
        for i, opt in enumerate(self.optimizers):
            opt.load_files(ckpt, self.names(i))

    def file_backed_state(self) -> dict[str, torch.Tensor]:
        """Under offload_params: {parameter name: its committed value, memory-mapped}."""
        out = {}
        for part, opt in zip(self.parts, self.optimizers):
            if opt.streamer is None:
                continue
            opt.flush()
            index = {id(p): t for t, p in enumerate(opt.tensors)}
            for name, p in part.named_parameters():
                out[canonical_name(name)] = file_tensor(opt, index[id(p)])
        return out

    def close(self) -> None:
        for opt in self.optimizers:
            try:
                opt.close()
            except Exception as e:  # never hide the error that stopped training
                log.error("offload: closing %s: %s", opt.dir, e)
