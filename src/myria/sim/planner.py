"""Layout search: enumerate tp/pp/dp/cp/ep/vpp/micro-batch/recompute/ZeRO, keep what fits, rank.

Every candidate is priced by the full step model (`perf.simulate`) and memory model. Constraints
follow Megatron-LM: tp divides the heads and stays inside a server unless allowed, the
interleaved schedule needs the microbatch count to be a multiple of pp and vpp to divide the
layers per stage, cp divides the sequence, ep divides the experts and the data-parallel ranks;
pp need not divide the layers (stages FLOP-balanced as the trainer splits them). A layout fits
when its predicted peak stays below the device's memory (`hardware.NVML_MEMORY_MIB`) less
`reserve_gb` (default 0); those that do not fit are counted but not ranked. Layouts whose MFU
lies within the model's uncertainty band (`band.uncertainty()`) of the best are tied and ordered
by `tie_order`; a prediction the model cannot vouch for is marked by `implausible` and not
first. Each ranked layout also gets the expected ETTR and its best checkpoint interval
(`reliability.expected_ettr`). The rules and why the reserve defaults to 0:
docs/performance_model.md, "Planning with headroom and honesty".
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from myria.errors import ConfigError
from myria.layout import Layout, stage_layers, validate_degrees, validate_pipeline
from myria.sim import perf
from myria.sim.hardware import build_hardware
from myria.sim.reliability import Reliability, run_ettr
from myria.sim.runspec import RunSpec
from myria.sim.step_result import StepResult

RESERVE_SHARE = 0.0  # default memory reserve beyond what the memory model prices (docstring)
PROGRESS_EVERY = 500  # candidates between two calls of `plan`'s progress callback


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _pow2_upto(n: int) -> list[int]:
    out, d = [], 1
    while d <= n:
        out.append(d)
        d *= 2
    return out


@dataclass
class SearchSpace:
    """Which values each dimension may take (None: derived from the model and cluster)."""

    tp: list[int] | None = None
    pp: list[int] | None = None
    cp: list[int] | None = None
    ep: list[int] | None = None
    vpp: list[int] | None = None
    micro_batch: list[int] | None = None
    recompute: list[str] = field(default_factory=lambda: ["none", "selective", "elementwise",
                                                          "full"])
    zero_stage: list[int] = field(default_factory=lambda: [0, 1, 2, 3])
    sequence_parallel: list[bool] = field(default_factory=lambda: [True, False])
    # ZeRO-3/FSDP variants: reshard after forward or keep gathered; HSDP (shard inside a server)
    reshard_after_forward: list[bool] = field(default_factory=lambda: [True, False])
    hsdp: list[bool] = field(default_factory=lambda: [False, True])
    max_tp_across_nodes: bool = False
    # (offload, offload_params): what is searched first, and what when nothing fits that way
    offload: list[tuple[str, bool]] = field(default_factory=lambda: [("none", False)])
    offload_fallback: list[tuple[str, bool]] = field(
        default_factory=lambda: [("cpu", False), ("nvme", False), ("nvme", True)])


@dataclass
class PlanResult:
    """Ranked layouts and search statistics."""

    ranked: list[StepResult]
    evaluated: int
    fitting: int
    seconds: float
    best_unfitting: StepResult | None = None   # the fastest that does not fit, when none fits
    leanest: StepResult | None = None   # the one closest to fitting, when none fits
    offloaded: bool = False      # nothing fitted without offload: these layouts offload
    best_runnable: StepResult | None = None  # when #1 is priced only: the trainer's best
    best_runnable_rank: int = 0                    # its place in the whole ranking (1-based)
    tied_total: int = 0     # layouts of the whole ranking tied with the best (not only shown)
    found: StepResult | None = None   # `find`'s first match in the whole ranking, annotated
    found_rank: int = 0               # its place (1-based); 0 when nothing matched


def candidates(base: RunSpec, space: SearchSpace):
    """Yield (parallel, training) field dicts of every layout in the search space.

    Degrees are generated (tp, cp, pp dividing the GPUs, dp what remains; ep, vpp,
    micro-batch, sequence parallelism, recomputation, ZeRO stage and offload from the space)
    and every combination is asked the layout's one check, `myria.layout.Layout.check` with
    `trainer=False` (the rules of a layout, without the limits of myria's own trainer). The
    outer loops skip early with the same helpers that check calls (`validate_degrees`,
    `Layout.microbatches`, `validate_pipeline`), so a refused degree is not enumerated further.
    """
    m, c = base.model, base.cluster
    gpus = c.gpus
    cfg = base.model_config()
    gb = base.training.global_batch
    tps = [t for t in space.tp or [t for t in _pow2_upto(min(gpus, 64)) if space.
           max_tp_across_nodes or t <= c.gpus_per_node] if _passes(validate_degrees, cfg, t, 1,
                                                                   False)]
    # ring attention is searched while each rank keeps >= 256 tokens; cp = 1 always
    cps = [x for x in space.cp or [x for x in _pow2_upto(16)
                                   if x == 1 or m.seq_len // x >= 256]
           if _passes(validate_degrees, cfg, 1, x, False)]
    eps = space.ep or ([x for x in _divisors(m.experts)] if m.experts else [1])
    mbs = space.micro_batch or _pow2_upto(16)
    check = _Checker(base)
    for tp in tps:
        for cp in cps:
            if gpus % (tp * cp) or not _passes(validate_degrees, cfg, tp, cp, False):
                continue
            rest = gpus // (tp * cp)
            pps = space.pp or sorted({x for x in _divisors(m.layers) + _pow2_upto(m.layers)
                                      if rest % x == 0})
            for pp in pps:
                if rest % pp:
                    continue
                dp = rest // pp
                # interleaving with uneven chunks too (the trainer's FLOP-balanced split of
                # pp x vpp stages, as Llama 3 ran 126 layers on 16 ranks)
                vpps = space.vpp or (list(range(1, 9)) if pp > 1 else [1])
                for ep in eps:
                    for mb in mbs:
                        try:
                            nmb = Layout(1, dp, tp, pp, cp).microbatches(gb, mb)
                        except ConfigError:
                            continue
                        for vpp in vpps:
                            sched = _schedule(base.parallel.schedule, vpp)
                            if not _passes(validate_pipeline, m.layers, pp, vpp, sched, nmb):
                                continue
                            for sp in (space.sequence_parallel if tp > 1 else [False]):
                                lay = Layout(1, dp, tp, pp, cp, ep, vpp, sched, sp)
                                yield from _variants(base, space, check, lay, mb)


PARALLEL_FIELDS = ("tp", "pp", "cp", "ep", "vpp", "schedule", "sequence_parallel", "dp_shard")
TRAINING_FIELDS = ("micro_batch", "recompute", "zero_stage", "reshard_after_forward", "offload",
                   "offload_params")


def run_of(base: RunSpec, res: StepResult) -> RunSpec:
    """The run a ranked layout is: `base` with the layout's parallel and training fields (the
    ones `candidates` sets), so that `perf.simulate` prices it as the plan did. dp and
    dp_shard stay 0 ("all of them") unless the layout is HSDP: the result reads `dp_shard =
    dp` when every rank shards, and pinning that number would turn the run into HSDP as soon
    as its GPU count is edited."""
    lay = res.layout
    par = {k: lay[k] for k in PARALLEL_FIELDS}
    if par["dp_shard"] >= lay["dp"]:
        par["dp_shard"] = 0
    return base.replace(parallel={"dp": 0, **par},
                        training={k: lay[k] for k in TRAINING_FIELDS})


def _variants(base: RunSpec, space: SearchSpace, check: _Checker, lay: Layout, mb: int):
    """The training-side variants of one layout (recomputation, ZeRO stage and sharding,
    offload) that pass the layout's check."""
    c = base.cluster
    ok = {(zero, off, offp) for zero in space.zero_stage for off, offp in space.offload
          if check(lay, mb, zero, off, offp)}
    if not ok:
        return
    dp, inner = lay.dp, lay.tp * lay.cp
    par = {"tp": lay.tp, "pp": lay.pp, "cp": lay.cp, "ep": lay.ep, "vpp": lay.vpp, "dp": 0,
           "schedule": lay.schedule, "sequence_parallel": lay.sequence_parallel}
    state = [(zero, rsh, shard, off, offp) for zero in space.zero_stage
             for rsh, shard in _sharding(zero, space, dp, inner, c.gpus_per_node)
             for off, offp in space.offload if (zero, off, offp) in ok]
    # FSDP keeping the parameters gathered for the step (Llama 3's) is ZeRO-2 in traffic and
    # memory unless it offloads (then the stage decides what leaves the device): searched
    # once, shown as ZeRO 2
    if c.gpu != "cpu":   # (myria's eager CPU runtime gathers per microbatch: priced apart)
        state = [v for v in state if not (v[0] >= 3 and not v[1] and v[3] == "none"
                                          and (2, v[3], v[4]) in ok)]
    for rec in space.recompute:
        # with FlashAttention, Korthikanti's selective recompute keeps what "none" keeps (no
        # score matrix) and costs time: dominated, not searched
        if rec == "selective" and base.kernels.flash_attention and len(space.recompute) > 1:
            continue
        for zero, rsh, shard, off, offp in state:
            yield ({**par, "dp_shard": shard},
                   {"micro_batch": mb, "recompute": rec, "zero_stage": zero,
                    "reshard_after_forward": rsh, "offload": off, "offload_params": offp})


class _Checker:
    """`Layout.check(cfg, trainer=False)`, where cfg is the base run's training config
    (`RunSpec.trainer_config`) with one candidate's micro-batch, ZeRO stage and offload (built
    once per such combination)."""

    def __init__(self, base: RunSpec):
        self.base = base
        self.cfgs: dict[tuple, object] = {}

    def __call__(self, lay: Layout, mb: int, zero: int, off: str, offp: bool) -> bool:
        key = (mb, zero, off, offp)
        cfg = self.cfgs.get(key)
        if cfg is None:
            run = dataclasses.replace(self.base, training=dataclasses.replace(
                self.base.training, micro_batch=mb, zero_stage=zero, offload=off,
                offload_params=offp))
            cfg = self.cfgs[key] = run.trainer_config()
        return _passes(lay.check, cfg, trainer=False)


def _schedule(asked: str, vpp: int) -> str:
    """The schedule a candidate runs: the base run's zero-bubble (any vpp) or GPipe (vpp 1)
    as asked, else 1F1B, interleaved when vpp > 1."""
    if asked == "zero-bubble" or (asked == "gpipe" and vpp == 1):
        return asked
    return "interleaved-1f1b" if vpp > 1 else "1f1b"


def _passes(rule, *args, **kw) -> bool:
    """Whether a rule of `myria.layout` (a function raising ConfigError) accepts `args`."""
    try:
        rule(*args, **kw)
    except ConfigError:
        return False
    return True


def _sharding(zero: int, space: SearchSpace, dp: int, inner: int, gpus_per_node: int):
    """(reshard_after_forward, dp_shard) variants of a ZeRO stage: FSDP (stage 3) with and
    without resharding after forward; HSDP with one shard group per server when the
    data-parallel ranks span several servers."""
    reshards = space.reshard_after_forward if zero >= 3 else [True]
    node_shard = max(1, gpus_per_node // inner)
    shards = [0]
    if zero >= 1 and True in space.hsdp and 1 < node_shard < dp and dp % node_shard == 0:
        shards = [0, node_shard] if False in space.hsdp else [node_shard]
    for rsh in reshards:
        for shard in shards:
            yield rsh, shard


def _with(obj, **changes):
    """`dataclasses.replace` for the run's plain dataclasses (no __post_init__, not frozen;
    the candidates' values are the layout check's), without its per-call field walk."""
    out = object.__new__(type(obj))
    out.__dict__.update(obj.__dict__, **changes)
    return out


def plan(base: RunSpec, space: SearchSpace | None = None, top: int = 10,
         limit: int | None = None, reserve_gb: float | None = None,
         reliability: Reliability | None = None,
         progress: Callable[[int, int], None] | None = None,
         find: dict | None = None) -> PlanResult:
    """Search layouts for `base` (model, batch, cluster, kernels, overlap) and rank them.

    A layout fits when its peak memory is below capacity minus `reserve_gb` (default 0).
    Ranked by MFU, then statistically tied layouts (within the model's uncertainty band of the
    best) first in `tie_order`; each gets `extra` fields: mfu_low, mfu_high, ettr,
    checkpoint_interval_steps, tied, implausible (when it is). When no layout fits, the search
    runs again with the optimizer state (and parameters) offloaded, `space.offload_fallback`,
    and the result says so (`offloaded`). Each ranked layout carries the trainer's verdict
    (`extra.runnable`, and `extra.not_runnable` with the reason: `trainer_verdict`), and among
    layouts tied with the best the first place goes to one myria's trainer runs
    (`runnable_first`); when the first is priced only, `best_runnable` names the trainer's
    best and its place. `progress(evaluated, fitting)`, when given, is called every
    `PROGRESS_EVERY` candidates and once when the search ends (a large cluster's search takes
    tens of seconds: the command line shows it). `find` ({layout field: value}, e.g. {"tp":
    8, "pp": 16}) names a layout whose place in the whole ranking the result gives (`found`).
    """
    from myria.sim.band import uncertainty

    space = space or SearchSpace()
    hw = build_hardware(base.cluster, base.training.precision)
    reserve = (RESERVE_SHARE * hw.memory_bytes) if reserve_gb is None else reserve_gb * 1e9
    if reserve < 0 or reserve >= hw.memory_bytes:
        raise ConfigError(f"memory reserve {reserve / 1e9:g} GB: must be >= 0 and below the "
                          f"device's {hw.memory_bytes / 1e9:g} GB")
    limit_bytes = hw.memory_bytes - reserve
    t0 = time.perf_counter()
    ok: list[StepResult] = []
    runs: dict[int, RunSpec] = {}     # id(result) -> its run, for the trainer's verdict
    unfit: list[RunSpec] = []
    lean: tuple[float, RunSpec] | None = None   # the layout closest to fitting, and how close
    n = 0
    for par, tr in candidates(base, space):
        run = _with(base, parallel=_with(base.parallel, **par),
                    training=_with(base.training, **tr))
        # memory first: a layout that does not fit is timed only when none fits
        mem = perf.step_memory(run, hw)
        n += 1
        if mem.fits and mem.host_fits and mem.total <= limit_bytes:
            res = perf.simulate(run, hw=hw, mem=mem)
            ok.append(res)
            runs[id(res)] = run
        else:
            unfit.append(run)
            # how far it is from fitting: the larger of its device and offload overcommits
            over = max(mem.total / limit_bytes, 0.0 if run.training.offload == "none" else
                       mem.host_bytes_per_node / perf.host_capacity(hw, run.training.offload))
            if lean is None or over < lean[0]:
                lean = (over, run)
        if progress is not None and n % PROGRESS_EVERY == 0:
            progress(n, len(ok))
        if limit and n >= limit:
            break
    if progress is not None:
        progress(n, len(ok))
    best_bad = None if ok else max((perf.simulate(r, hw=hw) for r in unfit),
                                   key=lambda r: r.mfu, default=None)
    leanest = None if ok or lean is None else perf.simulate(lean[1], hw=hw)
    if not n:
        raise ConfigError("no layout matches the model, batch and GPU count: check that "
                          "training.global_batch is divisible by some data-parallel degree")
    offloaded = False
    if not ok and space.offload_fallback and space.offload != space.offload_fallback:
        again = dataclasses.replace(space, offload=space.offload_fallback, offload_fallback=[])
        res = plan(base, again, top, limit, reserve_gb, reliability,
                   None if progress is None else lambda k, fit: progress(n + k, fit), find)
        res.evaluated += n
        res.seconds = time.perf_counter() - t0
        res.offloaded = bool(res.ranked)
        # "fastest if memory allowed" is a layout without offload (with enough memory, nothing
        # would be offloaded)
        res.best_unfitting = best_bad or res.best_unfitting
        if not res.ranked and res.leanest is None:
            res.leanest = leanest
        return res
    ok.sort(key=lambda r: -r.mfu)
    band = uncertainty()
    whole = runnable_first(rank_with_ties(ok, band), runs, hw)
    ranked = whole[:top]
    for r in ranked:
        annotate(r, base, hw, band, reliability)
        mark_runnable(r, runs[id(r)], hw)
    out = PlanResult(ranked, n, len(ok), time.perf_counter() - t0, best_bad, leanest,
                     offloaded)
    if ranked and not ranked[0].extra["runnable"]:
        out.best_runnable_rank, out.best_runnable = best_runnable(whole, runs, hw)
        if out.best_runnable is not None:
            annotate(out.best_runnable, base, hw, band, reliability)
    out.tied_total = sum(1 for r in whole if r.extra.get("tied"))
    if find:
        out.found_rank, out.found = next(((i, r) for i, r in enumerate(whole, 1) if all(
            r.layout.get(k) == v for k, v in find.items())), (0, None))
        if out.found is not None:
            annotate(out.found, base, hw, band, reliability)
            mark_runnable(out.found, runs[id(out.found)], hw)
    return out


NOT_RUNNABLE = "priced, not runnable by myria"


def trainer_verdict(run: RunSpec, hw) -> str:
    """Why myria's trainer refuses `run` ("" if it runs it): the layout's one check,
    `Layout.check(..., trainer=True)`, on the device type of the cluster. The planner searches
    with `trainer=False` (layouts other frameworks run, ZeRO-Offload with ZeRO 0-2, parameters
    on NVMe over several GPUs), so a priced layout may be one the trainer refuses."""
    from myria.sim.runspec import TRAINER_RECOMPUTE

    if run.training.recompute not in TRAINER_RECOMPUTE:
        return (f"recompute = {run.training.recompute!r} (the attention core) is not one of "
                "myria's; its selective recomputes the elementwise operators ('elementwise')")
    device = "cpu" if hw.cpu is not None or hw.device == "cpu" else "cuda"
    try:
        run.layout().check(run.trainer_config(), device, trainer=True)
    except ConfigError as e:
        return str(e)
    return ""


def mark_runnable(r: StepResult, run: RunSpec, hw) -> None:
    """`extra.runnable` (and `extra.not_runnable`: the note and the trainer's reason)."""
    if "runnable" not in r.extra:
        why = trainer_verdict(run, hw)
        r.extra["runnable"] = not why
        if why:
            r.extra["not_runnable"] = f"{NOT_RUNNABLE}: {why}"


def runnable_first(ranked: list[StepResult], runs: dict[int, RunSpec], hw
                   ) -> list[StepResult]:
    """`ranked` with a layout myria's trainer runs first when one is statistically tied with
    the best (the tie band at the head of `rank_with_ties`): among ties the planner prefers
    what it can run. A faster layout only other frameworks run is not hidden below a slower
    runnable one (a cluster planner compares frameworks too): it stays first, marked, and
    `best_runnable` names the trainer's best. Unchanged when no tied layout is runnable."""
    for i, r in enumerate(ranked):
        if not r.extra.get("tied") and i:
            break
        mark_runnable(r, runs[id(r)], hw)
        if r.extra["runnable"]:
            return [r] + ranked[:i] + ranked[i + 1:] if i else ranked
    return ranked


def best_runnable(ranked: list[StepResult], runs: dict[int, RunSpec], hw
                  ) -> tuple[int, StepResult | None]:
    """(1-based place, result) of the best-ranked layout myria's trainer runs (each verdict
    is one `Layout.check`, ~0.15 ms); (0, None) when none is."""
    for i, r in enumerate(ranked, 1):
        mark_runnable(r, runs[id(r)], hw)
        if r.extra["runnable"]:
            return i, r
    return 0, None


# The memory model's own error on device memory, as a share of its prediction: the largest
# error of bench/sim_memory_layouts.py (myria's Engine on two processes, 8.5%; the 18 single
# configurations of bench/sim_memory.py stay within 4.4%). A first pick whose free memory is
# smaller than this may not fit at all.
MEMORY_ERROR = 0.085


def margin_bytes(r: StepResult) -> float:
    """Device memory left free by the prediction (capacity less the predicted peak)."""
    return r.memory.capacity - r.memory.total


def implausible(r: StepResult) -> str:
    """Why a layout's prediction cannot be trusted as a first pick ("" when it can): its memory
    margin is under the memory model's own error, or the communication it hides exceeds the
    compute it hides behind."""
    if margin_bytes(r) < MEMORY_ERROR * r.memory.total:
        return (f"memory margin {margin_bytes(r) / 1e9:.1f} GB is under the memory model's "
                f"error ({MEMORY_ERROR:.1%} of {r.memory.total / 1e9:.1f} GB)")
    hidden = r.details.get("comm_hidden_s", 0.0)
    compute = r.details.get("compute_s", 0.0)
    if compute and hidden > compute:
        return (f"hides {hidden:.2f} s of communication behind {compute:.2f} s of compute")
    return ""


def tie_order(r: StepResult, t_best: float) -> tuple:
    """Order inside the tie band: a plausible prediction first (`implausible`), then the
    predicted step time (to 0.1% of the best: closer is noise), then the larger memory margin;
    offloaded layouts after those that keep their state on the device."""
    off = {"none": 0, "cpu": 1, "nvme": 2}[r.layout.get("offload", "none")] + \
        bool(r.layout.get("offload_params"))
    return (bool(r.extra.get("implausible")), off,
            round(r.iteration_time_s / t_best / 1e-3), -margin_bytes(r))


def rank_with_ties(results: list[StepResult], band: float) -> list[StepResult]:
    """Results sorted by MFU, with those within `band` of the best MFU (statistically tied
    with it) moved to the front in `tie_order`; an implausible prediction (`implausible`) is
    marked (`extra.implausible`) and never first while a plausible one is tied."""
    if not results:
        return []
    best = max(r.mfu for r in results)
    tied = [r for r in results if r.mfu >= best * (1 - band)]
    rest = [r for r in results if r.mfu < best * (1 - band)]
    t_best = min(r.iteration_time_s for r in tied)
    for r in tied:
        r.extra["tied"] = True
        why = implausible(r)
        if why:
            r.extra["implausible"] = why
    tied.sort(key=lambda r: tie_order(r, t_best))
    return tied + sorted(rest, key=lambda r: -r.mfu)


def annotate(r: StepResult, base: RunSpec, hw, band: float,
             reliability: Reliability | None = None) -> None:
    """Add the uncertainty band, the expected ETTR and checkpoint interval, stage layers."""
    lay = r.layout
    lay["stage_layers"] = stage_layers(base.model_config(), lay["pp"], lay["vpp"])
    e = run_ettr(r, base, hw, reliability)
    from myria.sim.band import band_coverage

    r.extra.update(mfu_low=r.mfu / (1 + band), mfu_high=r.mfu / (1 - band), band=band,
                   band_nominal_coverage=band_coverage(),
                   iteration_time_low_s=r.iteration_time_s * (1 - band),
                   iteration_time_high_s=r.iteration_time_s * (1 + band), ettr=e.ettr,
                   checkpoint_interval_steps=e.interval_steps, reliability=e.to_json())
    r.extra.setdefault("tied", False)
