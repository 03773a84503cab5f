"""The layout's one check against what the engine builds, over layouts of up to 16 ranks.

Every combination of the degrees (dp_replicate, dp_shard, tp, pp, cp, ep), pipeline
interleaving and schedule, dense and mixture-of-experts models and the data-parallel engine is
checked by `Layout.check` (cheap); refusals must be one line naming a field. A sample of the
accepted layouts, one per combination of non-trivial dimensions, is then built by the engine on
torch's in-process fake process group as the last rank (the one holding the last pipeline stage
and the last expert shard): what the check accepts must build. Refusals that the engine's own
construction also meets (the review's expert case, where the old check let through what the
runtime refused; a zbv with three chunks; a sequence context parallelism cannot split) fail
there too with the check bypassed. Other refusals (a dense model with ep > 1, vpp with a
single-stage schedule) construct and would fail at the first step: the check is what stops them.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from myria import config
from myria.errors import ConfigError
from myria.layout import Layout

MODEL = ["--model.vocab_size=64", "--model.layers=4", "--model.hidden=32", "--model.heads=4",
         "--model.kv_heads=2", "--model.seq_len=32", "--training.micro_batch=1"]
PIPES = [(1, "1f1b"), (2, "interleaved-1f1b"), (2, "zbv")]


def _cases():
    for dr, ds, tp, pp, cp, ep, (vpp, sched), moe, ddp in itertools.product(
            (1, 2), (1, 2, 4), (1, 2), (1, 2), (1, 2), (1, 2, 4), PIPES, (False, True),
            (False, True)):
        world = dr * ds * tp * pp * cp
        if world > 16 or (pp == 1 and vpp > 1):
            continue
        over = [*MODEL, f"--parallel.dp_replicate={dr}", f"--parallel.dp_shard={ds}",
                f"--parallel.tp={tp}", f"--parallel.pp={pp}", f"--parallel.cp={cp}",
                f"--parallel.ep={ep}", f"--parallel.vpp={vpp}", f"--parallel.schedule={sched}",
                f"--training.global_batch={4 * dr * ds}"]
        if moe:
            over += ["--model.experts=4", "--model.top_k=2"]
        if ddp:
            over += ["--training.data_parallel=ddp"]
        yield over, world


def _verdict(over, world):
    cfg = config.load(None, over)
    lay = Layout.resolve(cfg.parallel, world)
    try:
        lay.check(cfg)
        return cfg, lay, None
    except ConfigError as e:
        return cfg, lay, str(e)


CASES = [(*_verdict(o, w), w) for o, w in _cases()]


def test_refusals_are_one_line_naming_a_field():
    refused = [msg for _, _, msg, _ in CASES if msg]
    assert len(refused) > 100 and len(refused) < len(CASES)
    for msg in refused:
        assert "\n" not in msg and any(k in msg for k in ("parallel.", "model.", "training.",
                                                            "mixture-of-experts")), msg


def _build(cfg, lay: Layout, world: int, monkeypatch, bypass: bool = False):
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from myria.parallel.dims import ParallelDims
    from myria.train import engine as engine_mod

    if bypass:
        monkeypatch.setattr(engine_mod, "check_run", lambda *a, **k: None)  # engine's name
    # DDP's bucket-settling backward needs real collectives (fake ones return no tensor)
    monkeypatch.setattr(engine_mod.Engine, "_settle_ddp_buckets", lambda *a, **k: None)
    dist.init_process_group("fake", rank=world - 1, world_size=world, store=FakeStore())
    try:
        return engine_mod.Engine(cfg, ParallelDims.build(lay, "cpu"), torch.device("cpu"))
    finally:
        dist.destroy_process_group()


def _signature(lay: Layout, cfg) -> tuple:
    return (tuple(d for d in ("dp_replicate", "dp_shard", "tp", "pp", "cp", "ep")
                  if lay[d] > 1), lay.schedule, bool(cfg.model.experts),
            cfg.training.data_parallel)


@pytest.mark.slow
def test_what_the_check_accepts_the_engine_builds(monkeypatch):
    seen, built = set(), 0
    for cfg, lay, msg, world in CASES:
        if msg is not None or _signature(lay, cfg) in seen:
            continue
        seen.add(_signature(lay, cfg))
        _build(cfg, lay, world, monkeypatch)
        built += 1
    assert built >= 30


@pytest.mark.slow
@pytest.mark.parametrize("over,world,needle", [
    # the review's case: the old check tested dp % ep, the runtime needs dp_shard % ep
    (["--model.experts=4", "--model.top_k=2", "--parallel.ep=4", "--parallel.dp_replicate=2",
      "--parallel.dp_shard=2"], 4, "parallel.dp_shard = 2"),
    (["--parallel.pp=2", "--parallel.dp_shard=1", "--parallel.vpp=3", "--parallel.schedule=zbv",
      "--model.layers=6"], 2, "exactly two stages per rank"),
    (["--parallel.cp=2", "--parallel.dp_shard=1", "--model.seq_len=30"], 2,
     "divisible by 2 x parallel.cp"),
])
def test_structural_refusals_fail_in_the_engine_too(over, world, needle, monkeypatch):
    cfg = config.load(None, [*MODEL, *over])
    lay = Layout.resolve(cfg.parallel, world)
    with pytest.raises(ConfigError, match=needle):
        lay.check(cfg)
    with pytest.raises(Exception):  # noqa: B017 (any failure: the engine cannot build it)
        _build(cfg, lay, world, monkeypatch, bypass=True)


def test_every_problem_of_a_tensor_parallel_degree_in_one_refusal():
    """tp = 3 on a model it cannot split three ways: one refusal names every setting at fault
    (the MLP width's own field even when derived, the way out of sequence parallelism, the
    vocabulary), so a user fixes them in one go."""
    cfg = config.load(None, ["--model.vocab_size=8192", "--model.hidden=96", "--model.heads=6",
                             "--model.kv_heads=3", "--model.seq_len=64", "--parallel.tp=3",
                             "--parallel.dp_shard=1"])
    with pytest.raises(ConfigError) as e:
        Layout.resolve(cfg.parallel, 3).check(cfg)
    msg = str(e.value)
    for needle in ("model.ffn_hidden", "parallel.sequence_parallel = false",
                   "model.vocab_size = 8192"):
        assert needle in msg, msg


def test_bf16_only_where_fsdp2_applies_its_policy():
    """myria computes in bf16 through FSDP2's mixed-precision policy only: a layout that does
    not shard with FSDP2 (DDP; a zero-bubble schedule with data parallelism; the nvme tier on
    one rank) refuses an explicit bf16 instead of training in fp32 under a bf16 label, and
    `auto` on CUDA resolves to fp32 there, with the reason in the start line."""
    from myria.train.trainer import layout_words

    def cfg(*extra):
        return config.load(None, [*MODEL, "--training.global_batch=4", *extra])

    ddp = cfg("--training.dtype=bfloat16", "--training.data_parallel=ddp")
    lay = Layout.resolve(ddp.parallel, 2)
    assert not lay.computes_in_bf16(ddp, "cpu")
    with pytest.raises(ConfigError, match=r"training.dtype = 'bfloat16' with training."
                                          r"data_parallel = 'ddp' .*train in fp32"):
        lay.check(ddp, "cpu")
    auto = cfg("--training.data_parallel=ddp")
    lay.check(auto, "cuda")
    assert not lay.computes_in_bf16(auto, "cuda")
    assert "fp32 (training.data_parallel = 'ddp'" in layout_words(auto, lay, "cuda")
    zb = cfg("--training.dtype=bfloat16", "--parallel.pp=2", "--parallel.schedule=zbv",
             "--parallel.vpp=2")
    with pytest.raises(ConfigError, match="parallel.schedule = 'zbv' with data parallelism"):
        Layout.resolve(zb.parallel, 4).check(zb, "cpu")
    # the nvme tier on one rank (a CPU feature here; a GPU config's dry run with it is a plan)
    # is not refused: its start line says fp32 and why
    nvme = cfg("--training.dtype=bfloat16", "--parallel.offload=nvme")
    lay = Layout.resolve(nvme.parallel, 1)
    lay.check(nvme, "cpu")
    assert "fp32 (parallel.offload = 'nvme' on one data-parallel" in layout_words(nvme, lay,
                                                                                  "cpu")
    for world, extra in ((2, ()), (1, ()), (4, ("--parallel.pp=2",))):   # FSDP2 applies it
        c = cfg("--training.dtype=bfloat16", *extra)
        lay = Layout.resolve(c.parallel, world)
        lay.check(c, "cpu")
        assert lay.computes_in_bf16(c, "cpu") and "bf16" in layout_words(c, lay, "cpu")
