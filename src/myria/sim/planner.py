"""Layout search: enumerate tp/pp/dp/cp/ep/vpp/micro-batch/recompute/ZeRO, keep what fits, rank.

Every candidate is priced by the full step model (`perf.simulate`) and memory model; those that
do not fit in device memory are counted but not ranked. Constraints follow Megatron-LM: tp
divides the heads and stays inside a server unless allowed, pp divides the layers (and vpp the
layers per stage), the interleaved schedule needs the microbatch count to be a multiple of pp,
cp divides the sequence, ep divides the experts and the data-parallel ranks.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

from myria.errors import ConfigError
from myria.sim import perf
from myria.sim.hardware import build_hardware
from myria.sim.runspec import RunSpec


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
    recompute: list[str] = field(default_factory=lambda: ["none", "selective", "full"])
    zero_stage: list[int] = field(default_factory=lambda: [0, 1, 2, 3])
    sequence_parallel: list[bool] = field(default_factory=lambda: [True, False])
    max_tp_across_nodes: bool = False


@dataclass
class PlanResult:
    """Ranked layouts and search statistics."""

    ranked: list[perf.StepResult]
    evaluated: int
    fitting: int
    seconds: float
    best_unfitting: perf.StepResult | None = None


def candidates(base: RunSpec, space: SearchSpace):
    """Yield (parallel, training) field dicts of every layout in the search space."""
    m, c = base.model, base.cluster
    gpus = c.gpus
    tps = space.tp or [t for t in _pow2_upto(min(gpus, 64)) if m.heads % t == 0
                       and (space.max_tp_across_nodes or t <= c.gpus_per_node)]
    cps = space.cp or [x for x in _pow2_upto(16) if m.seq_len % x == 0 and m.seq_len // x >= 256]
    eps = space.ep or ([x for x in _divisors(m.experts)] if m.experts else [1])
    mbs = space.micro_batch or _pow2_upto(16)
    for tp in tps:
        for cp in cps:
            if gpus % (tp * cp):
                continue
            rest = gpus // (tp * cp)
            pps = space.pp or [x for x in _divisors(m.layers) if rest % x == 0]
            for pp in pps:
                if rest % pp or pp > m.layers:
                    continue
                dp = rest // pp
                if base.training.global_batch % dp:
                    continue
                per = m.layers // pp if m.layers % pp == 0 else 0
                vpps = space.vpp or ([x for x in (1, 2, 3, 4, 6, 8) if per and per % x == 0]
                                     if pp > 1 else [1])
                for ep in eps:
                    if (dp * cp) % ep or (m.experts and m.experts % ep):
                        continue
                    for mb in mbs:
                        if base.training.global_batch % (dp * mb):
                            continue
                        nmb = base.training.global_batch // (dp * mb)
                        for vpp in vpps:
                            if vpp > 1 and nmb % pp:
                                continue
                            sched = "interleaved-1f1b" if vpp > 1 else \
                                ("1f1b" if base.parallel.schedule not in ("gpipe",
                                                                          "zero-bubble")
                                 else base.parallel.schedule)
                            for sp in (space.sequence_parallel if tp > 1 else [False]):
                                for rec in space.recompute:
                                    for zero in space.zero_stage:
                                        yield ({"tp": tp, "pp": pp, "cp": cp, "ep": ep,
                                                "vpp": vpp, "dp": 0, "schedule": sched,
                                                "sequence_parallel": sp},
                                               {"micro_batch": mb, "recompute": rec,
                                                "zero_stage": zero})


def plan(base: RunSpec, space: SearchSpace | None = None, top: int = 10,
         limit: int | None = None) -> PlanResult:
    """Search layouts for `base` (model, batch, cluster, kernels, overlap) and rank by MFU."""
    space = space or SearchSpace()
    hw = build_hardware(base.cluster, base.training.precision)
    t0 = time.perf_counter()
    ok: list[perf.StepResult] = []
    best_bad: perf.StepResult | None = None
    n = 0
    for par, tr in candidates(base, space):
        run = dataclasses.replace(base, parallel=dataclasses.replace(base.parallel, **par),
                                  training=dataclasses.replace(base.training, **tr))
        res = perf.simulate(run, hw=hw)
        n += 1
        if res.fits:
            ok.append(res)
        elif best_bad is None or res.mfu > best_bad.mfu:
            best_bad = res
        if limit and n >= limit:
            break
    if not n:
        raise ConfigError("no layout matches the model, batch and GPU count: check that "
                          "training.global_batch is divisible by some data-parallel degree")
    ok.sort(key=lambda r: -r.mfu)
    return PlanResult(ok[:top], n, len(ok), time.perf_counter() - t0, best_bad)
