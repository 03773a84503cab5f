"""Pipeline schedule simulation against the closed forms, and the layout planner."""

from __future__ import annotations

import pytest

from myria.errors import ConfigError
from myria.sim import runspec
from myria.sim.planner import PROGRESS_EVERY, SearchSpace, candidates, plan
from myria.sim.schedule_plot import (
    bubble_fraction,
    draw,
    formula_bubble,
    simulate_schedule,
)


@pytest.mark.parametrize("sched, p, v, m", [
    ("gpipe", 4, 1, 8), ("1f1b", 4, 1, 8), ("1f1b", 8, 1, 32), ("interleaved-1f1b", 4, 2, 8),
    ("interleaved-1f1b", 8, 4, 16), ("zero-bubble", 4, 1, 8), ("zero-bubble", 6, 1, 12),
    ("zero-bubble", 4, 2, 8), ("zero-bubble", 8, 4, 16),
])
def test_simulated_bubble_matches_closed_form(sched, p, v, m):
    slots = simulate_schedule(sched, p, v, m)
    assert len([s for s in slots if s.kind == "F"]) == p * v * m
    assert bubble_fraction(slots, p) == pytest.approx(formula_bubble(sched, p, v, m), abs=1e-9)


def test_unequal_stages_replay_the_order():
    # stage 0: F 1, B 2; stage 1: F 0.5, B 1; 1F1B, 4 microbatches. By hand: stage 0 runs
    # F1 F2, waits for B1 until 2.5, then B1 F3 B2 F4 B3 B4 back to back, ending at 12.5; the
    # closed form for equal stages, (m - 1) s_max + sum of stage times, would say 13.5
    slots = simulate_schedule("1f1b", 2, 1, 4, t_f=[1.0, 0.5], t_b=[2.0, 1.0])
    assert max(s.end for s in slots) == pytest.approx(12.5)
    with pytest.raises(ConfigError, match="per-stage"):
        simulate_schedule("1f1b", 2, 1, 4, t_f=[1.0], t_b=[2.0, 1.0])


def test_schedule_errors_and_png(tmp_path):
    with pytest.raises(ConfigError, match="multiple"):
        simulate_schedule("interleaved-1f1b", 4, 2, 6)
    with pytest.raises(ConfigError, match="cannot be drawn"):
        simulate_schedule("zbv", 4, 2, 8)
    out = tmp_path / "s.png"
    frac = draw(simulate_schedule("1f1b", 4, 1, 8), 4, 1, 8, "1f1b", str(out))
    assert out.stat().st_size > 5000 and frac == pytest.approx(3 / 11)


def test_plan_ranks_fitting_layouts(calibration):
    base = next(r for r in calibration if r.name.endswith("145.6b"))
    seen = []
    res = plan(base, top=5, progress=lambda n, fit: seen.append((n, fit)))
    assert res.evaluated >= 10_000
    # the progress callback: every PROGRESS_EVERY candidates, counts that only grow, the last
    # call the search's own totals
    assert len(seen) >= res.evaluated // PROGRESS_EVERY and seen == sorted(seen)
    assert seen[0] == (PROGRESS_EVERY, seen[0][1]) and seen[-1] == (res.evaluated, res.fitting)
    assert 0 < res.fitting < res.evaluated
    assert all(r.fits for r in res.ranked)
    # GPT ties its embeddings, which myria's trainer runs under tp and pp too (one vocabulary-
    # sharded tensor; a copy on the last stage): the fast tp x pp layouts are runnable, so no
    # other layout is named as the trainer's best (priced-only marks: tests/sim/test_cli.py)
    assert all(r.extra["runnable"] and "not_runnable" not in r.extra for r in res.ranked)
    assert all(r.layout["tp"] > 1 and r.layout["pp"] > 1 for r in res.ranked)
    assert res.best_runnable is None and res.best_runnable_rank == 0
    # statistically tied layouts (within the band of the best) first, fastest first (to 0.1%),
    # then the most free memory; the rest by MFU
    ranked = res.ranked
    best = max(r.mfu for r in ranked)
    band = res.ranked[0].extra["mfu_high"] / res.ranked[0].mfu - 1
    tied = [r for r in ranked if r.extra["tied"]]
    assert tied and ranked[:len(tied)] == tied
    assert all(r.mfu >= best * (1 - band) for r in tied)
    rest = [r.mfu for r in ranked[len(tied):]]
    assert rest == sorted(rest, reverse=True)
    from myria.sim.planner import tie_order
    t_best = min(r.iteration_time_s for r in tied)
    keys = [tie_order(r, t_best) for r in tied]
    assert keys == sorted(keys)
    # the planner's best beats the published layout (which had no overlap or SP tricks
    # but does use recompute); at least it is not worse
    from myria.sim.perf import simulate
    assert max(r.mfu for r in res.ranked) >= simulate(base).mfu


def test_search_space_respects_constraints(calibration):
    base = calibration[4]
    # 40 layers on 16 ranks: uneven stages, and interleaved too (2 chunks of 1-2 layers)
    b18 = calibration[3]
    vpps = {par["vpp"] for par, _ in candidates(b18, SearchSpace(pp=[16], tp=[8], cp=[1]))}
    assert vpps == {1, 2} and b18.model.layers % 16
    for par, tr in candidates(base, SearchSpace(recompute=["full"], zero_stage=[0])):
        assert base.model.heads % par["tp"] == 0 and par["pp"] <= base.model.layers
        assert par["pp"] * par["vpp"] <= base.model.layers  # every chunk holds a layer
        dp = base.cluster.gpus // (par["tp"] * par["pp"] * par["cp"])
        m = base.training.global_batch // (dp * tr["micro_batch"])
        assert m * dp * tr["micro_batch"] == base.training.global_batch
        if par["vpp"] > 1:
            assert m % par["pp"] == 0 and par["schedule"] == "interleaved-1f1b"


def test_planner_asks_the_layouts_one_check(monkeypatch):
    # a small MoE on 16 GPUs: every degree combination the planner generates is exactly one
    # that Layout.check(trainer=False) accepts, and a rule added there reaches the planner
    import itertools

    from myria.layout import Layout

    (moe,) = runspec.loads("""
[model]
arch = "llama"
layers = 6
hidden = 256
heads = 8
kv_heads = 4
experts = 4
seq_len = 1024
[training]
global_batch = 16
[cluster]
gpu = "h100-sxm-80gb"
gpus = 16
""")
    space = SearchSpace(recompute=["none"], zero_stage=[1], hsdp=[False])

    def degrees(par, tr):
        return (par["tp"], par["cp"], par["pp"], par["ep"], par["vpp"], tr["micro_batch"],
                par["sequence_parallel"])

    got = {degrees(p, t) for p, t in candidates(moe, space)}
    want = set()
    cfg = moe.trainer_config()
    for tp, cp, pp, ep, vpp, mb, sp in itertools.product(
            (1, 2, 4, 8), (1, 2, 4), (1, 2, 3, 4, 6, 8), (1, 2, 4), range(1, 9), (1, 2, 4, 8, 16),
            (False, True)):
        if 16 % (tp * cp * pp) or (sp and tp == 1) or (pp == 1 and vpp > 1):
            continue
        cfg.training.micro_batch = mb
        lay = Layout(1, 16 // (tp * cp * pp), tp, pp, cp, ep, vpp,
                     "interleaved-1f1b" if vpp > 1 else "1f1b", sp)
        try:
            lay.check(cfg, trainer=False)
        except ConfigError:
            continue
        want.add((tp, cp, pp, ep, vpp, mb, sp))
    assert got == want and any(d[3] == 4 for d in got) and any(d[4] > 1 for d in got)
    real = Layout.check

    def no_ep4(self, cfg, device_type="cpu", trainer=True):
        if self.ep == 4:
            raise ConfigError("test: ep 4 refused")
        return real(self, cfg, device_type, trainer)

    monkeypatch.setattr(Layout, "check", no_ep4)
    assert {degrees(p, t) for p, t in candidates(moe, space)} == {d for d in want if d[3] != 4}


def test_plan_reports_when_nothing_fits():
    (huge,) = runspec.loads("""
[model]
layers = 96
hidden = 12288
heads = 96
[training]
global_batch = 8
[cluster]
gpu = "a100-sxm-80gb"
gpus = 8
""")
    seen = []
    res = plan(huge, SearchSpace(recompute=["none"], zero_stage=[0]),
               progress=lambda n, fit: seen.append((n, fit)))
    assert res.ranked == [] and res.best_unfitting is not None
    # the offloaded second search counts on from the first
    assert seen[-1] == (res.evaluated, 0) and [n for n, _ in seen] == sorted(n for n, _ in seen)
    # why: without ZeRO the model state alone (bf16 weights, fp32 gradients, Adam's fp32 copy
    # and moments: >= 16 bytes per parameter of the 12 L h^2 in the blocks, over 8 GPUs at
    # most) is beyond the device's memory, whatever the layout
    b = res.best_unfitting
    gb = b.memory.gb()
    state = gb["weights"] + gb["gradients"] + gb["optimizer"]
    assert not b.fits and state >= 16 * 12 * 96 * 12288 ** 2 / 8 / 1e9 > gb["capacity"], gb
    assert b.memory_gb_per_gpu == pytest.approx(gb["total"]) and gb["total"] > state


def test_plan_accepts_uneven_stages_and_keeps_a_memory_reserve():
    from myria.sim import runspec
    base = runspec.parse_run({
        "name": "405b-like", "model": {"arch": "llama", "layers": 126, "hidden": 16384,
                                       "heads": 128, "kv_heads": 8, "ffn_hidden": 53248,
                                       "vocab": 128256, "seq_len": 8192},
        "training": {"global_batch": 2048}, "cluster": {"gpu": "h100-sxm-80gb", "gpus": 16384},
        "kernels": {"flash_attention": True}, "overlap": {"pp": True, "dp": True}},
        check=False)
    res = plan(base, SearchSpace(pp=[16], recompute=["none", "full"], zero_stage=[1]), top=3)
    assert res.ranked
    for r in res.ranked:
        st = r.layout["stage_layers"]
        assert len(st) == 16 * r.layout["vpp"] and sum(st) == 126
        assert st[0] <= max(st) and st[-1] < max(st)  # the output layer's stage holds fewer
        assert r.memory.total <= r.memory.capacity  # no reserve beyond the model's own
        assert r.memory.capacity == 81559 * 2**20   # an "80 GB" H100 as NVML reports it
        x = r.extra
        assert x["mfu_low"] < r.mfu < x["mfu_high"] and 0 < x["ettr"] <= 1
        assert x["checkpoint_interval_steps"] >= 1
    tight = plan(base, SearchSpace(pp=[16], recompute=["none", "full"], zero_stage=[1]), top=3,
                 reserve_gb=40)
    assert tight.ranked and all(r.memory.total <= r.memory.capacity - 40e9
                                for r in tight.ranked)


def test_young_daly_interval_maximises_ettr():
    from myria.sim.reliability import Reliability, ettr_at, expected_ettr
    e = expected_ettr(10.0, 16384, 8, 20e9, 16384 * 5e9, 50.0)
    lam = Reliability().failures_per_gpu_hour * 16384 / 3600
    assert e.interval_s == pytest.approx((2 * e.stall_s / lam) ** 0.5, rel=0.05)
    for f in (0.5, 0.8, 1.25, 2.0):  # shorter or longer intervals do no better
        assert ettr_at(e.interval_s * f, e.stall_s, e.write_s, e.recovery_s, lam) <= e.ettr
    worse = expected_ettr(10.0, 16384, 8, 20e9, 16384 * 5e9, 50.0,
                          Reliability(failures_per_gpu_hour=1e-4))
    assert 0 < worse.ettr < e.ettr < 1 and worse.interval_steps < e.interval_steps
    none = expected_ettr(10.0, 8, 8, 1e9, 8e9, 50.0, Reliability(failures_per_gpu_hour=0))
    assert none.ettr == 1.0


# -- public layouts of well-known large runs (layout, hardware and batch only) ---------------
def _experts():
    from myria.sim.runspec import load

    return {r.name: r for r in load(runspec.calibration_path().with_name(
        "expert_layouts.toml"))}


def test_expert_layouts_fit_without_full_recompute_where_unused():
    import dataclasses

    from myria.sim.perf import simulate

    runs = _experts()
    for name, rec in (("llama3-405b", "none"), ("megascale-175b", "selective"),
                      ("megatron-lm-gpt3-175b", "full")):
        r = runs[name]
        run = dataclasses.replace(r, training=dataclasses.replace(r.training, recompute=rec))
        res = simulate(run)
        assert res.fits and res.memory.total <= res.memory.capacity, (name, res.memory)
    # Llama 3 "without activation checkpointing": 16 microbatches on 16 ranks run every
    # forward first, so the second rank holds all 16 of its 8 layers' activations (Megatron's
    # warm-up of 2(p-2) + (v-1)p + 1 chunks exceeds them), near the device's 85.5 GB
    res = simulate(runs["llama3-405b"])
    assert res.memory.stage == "mid" and 0.9 < res.memory.total / res.memory.capacity < 1
    # Llama 3's FSDP without resharding keeps the stage's bf16 weights whole, shards the rest
    res = simulate(runs["llama3-405b"].replace(training={"recompute": "elementwise"}))
    n = res.memory.params_per_device
    assert res.memory.weights == pytest.approx(2 * n) and res.memory.optimizer < 12 * n / 100


def _plan_expert(name: str, extra: tuple = ()):
    """`myria plan` as typed for a well-known run (data/expert_commands.toml), the whole
    ranking, and the layouts with the published degrees."""
    from myria.sim.cli_plan import expert_commands, plan_argv

    cmd = {r["name"]: r for r in expert_commands()}[name]
    _, res = plan_argv(cmd["argv"] + list(extra), top=10 ** 6)
    p = cmd["published"]
    same = [x for x in res.ranked if (x.layout["tp"], x.layout["pp"], x.layout["cp"],
                                      x.layout["dp"]) == (p["tp"], p["pp"], p["cp"], p["dp"])]
    return res, same


def _assert_in_tie_band(res, same):
    inter = [x for x in same if x.layout["vpp"] > 1]
    assert inter, "the published layout is not generated with interleaving"
    best = max(x.mfu for x in res.ranked)
    band = res.ranked[0].extra["band"]
    top = max(inter, key=lambda x: x.mfu)
    assert top.mfu >= best * (1 - band) and top.extra["tied"]
    # the first pick is plausible: its free memory exceeds the memory model's error
    first = res.ranked[0]
    assert not first.extra.get("implausible")
    from myria.sim.planner import MEMORY_ERROR
    assert first.memory.capacity - first.memory.total >= MEMORY_ERROR * first.memory.total


def test_megatron_gpt3_layout_ranks_in_the_tie_band():
    res, same = _plan_expert("megatron-lm-gpt3-175b", ("--mb", "1,2"))
    _assert_in_tie_band(res, same)


@pytest.mark.slow
def test_megascale_layout_ranks_in_the_tie_band():
    res, same = _plan_expert("megascale-175b")
    _assert_in_tie_band(res, same)


@pytest.mark.slow
def test_llama3_layout_is_generated_interleaved_uneven_fits_and_ranks_in_the_tie_band():
    # 126 layers on 16 ranks interleaved (uneven chunks), with no recomputation, as published
    res, same = _plan_expert("llama3-405b")
    _assert_in_tie_band(res, same)
    inter = [x for x in same if x.layout["vpp"] > 1 and x.layout["recompute"] == "none"]
    assert inter and all(sum(x.layout["stage_layers"]) == 126 for x in inter[:5])
    assert any(len(set(x.layout["stage_layers"])) > 1 for x in inter)
    # FSDP keeping the parameters gathered (Llama 3's) is priced as ZeRO 2 and shown as it
    assert any(x.extra["tied"] and x.layout["zero_stage"] == 2 for x in inter)
    assert not any(x.layout["zero_stage"] == 3 and not x.layout["reshard_after_forward"]
                   and x.layout["offload"] == "none" for x in same)


def test_a_tight_or_overhidden_prediction_is_marked_and_not_first(llama):
    """Inside the tie band the faster layout goes first, then the one with more free memory;
    a layout whose free memory is under the memory model's own error is marked and goes
    after every plausible tied layout, however fast."""
    from myria.sim.perf import simulate
    from myria.sim.planner import MEMORY_ERROR, rank_with_ties

    fast = simulate(llama)
    need = fast.memory.total / 1e9
    tight = simulate(llama.replace(cluster={"memory_gb": need * (1 + MEMORY_ERROR / 2)}))
    roomy = simulate(llama.replace(parallel={"vpp": 1, "schedule": "1f1b"}))
    assert tight.fits and roomy.iteration_time_s > tight.iteration_time_s
    ranked = rank_with_ties([tight, roomy], band=0.2)
    assert ranked == [roomy, tight] and all(r.extra["tied"] for r in ranked)
    assert "memory margin" in tight.extra["implausible"] and "implausible" not in roomy.extra
    # two plausible ties: the faster first
    assert rank_with_ties([roomy, fast], band=0.2)[0] is fast


def test_the_search_shows_its_progress_on_a_terminal_and_a_long_one_on_a_pipe():
    """`myria plan` (and a dry run's comparison with the best layout) search for tens of
    seconds on a large cluster: a terminal shows the count so far; a pipe gets nothing from a
    short search and a line every PIPE_EVERY_S from a long one."""
    import io

    from rich.console import Console

    from myria.sim.cli_plan import searching

    for terminal in (True, False):
        out = io.StringIO()
        con = Console(file=out, force_terminal=terminal, width=120)
        with searching("searching layouts", con) as progress:
            progress(12_500, 3_021)
        text = out.getvalue()
        if terminal:
            assert "searching layouts: 12,500 layouts priced, 3,021 fit in memory" in text, text
        else:
            assert text == ""
    # a long search on a pipe: one plain line every PIPE_EVERY_S, none before
    from myria.sim.cli_plan import PIPE_EVERY_S

    now = [0.0]
    out = io.StringIO()
    with searching("searching layouts", Console(file=out, force_terminal=False, width=80),
                   clock=lambda: now[0]) as progress:
        for n in range(1, 6):
            now[0] = n * PIPE_EVERY_S / 2
            progress(n * 1000, n * 10)
    lines = out.getvalue().splitlines()
    assert lines == [f"searching layouts: {n * 1000:,} layouts priced, {n * 10} fit in memory "
                     f"({n * PIPE_EVERY_S / 2:.0f} s)" for n in (2, 4)], lines


def test_short_sequences_are_searched_without_context_parallelism():
    """Ring attention is searched only while a rank keeps >= 256 tokens; a sequence shorter
    than that still has its layouts without it (cp = 1)."""
    base = runspec.parse_run({
        "name": "short", "model": {"arch": "llama", "layers": 4, "hidden": 256, "heads": 4,
                                   "seq_len": 128},
        "training": {"global_batch": 64}, "cluster": {"gpu": "h100-sxm-80gb", "gpus": 8}},
        check=False)
    layouts = list(candidates(base, SearchSpace()))
    assert layouts and {par["cp"] for par, _ in layouts} == {1}


def test_layouts_priced_alike_are_searched_once():
    """FSDP keeping the parameters gathered is ZeRO 2 in the model (time and memory) and
    appears as it; every ZeRO stage is still searched, on one data-parallel rank too (ZeRO 3
    keeps no 16-bit copy under mixed precision, and only some stages run with tp in myria)."""
    def run(gpus):
        return runspec.parse_run({
            "name": "small", "model": {"arch": "llama", "layers": 4, "hidden": 256, "heads": 4,
                                       "seq_len": 512},
            "training": {"global_batch": 8}, "cluster": {"gpu": "h100-sxm-80gb", "gpus": gpus}},
            check=False)

    for gpus in (1, 8):
        got = [t for _, t in candidates(run(gpus), SearchSpace()) if t["offload"] == "none"]
        assert {t["zero_stage"] for t in got} == {0, 1, 2, 3}
        assert all(t["reshard_after_forward"] for t in got if t["zero_stage"] == 3)
    kept = run(8).replace(parallel={"tp": 1, "pp": 1, "cp": 1},
                          training={"zero_stage": 3, "reshard_after_forward": False})
    as_two = kept.replace(training={"zero_stage": 2, "reshard_after_forward": True})
    from myria.sim.perf import simulate

    a, b = simulate(kept), simulate(as_two)
    assert (a.iteration_time_s, a.memory.total) == pytest.approx((b.iteration_time_s,
                                                                  b.memory.total))
