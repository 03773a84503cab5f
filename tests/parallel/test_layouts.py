"""Every parallel layout on 4 gloo ranks trains to the same losses as one process.

Runs `myria train` end to end (torch elastic launch, the real trainer and checkpoints) on a
4-layer model for 6 steps (4 of warm-up, 2 of decay) and compares each step's loss, and the
validation loss of steps 3 and 6 (pipelined layouts evaluate through their schedule; the
training after an evaluation goes on equal), with a single-process run of the same config,
global batch and seed: relative difference <= 1e-4. tp2 x pp2 is the layout the
checkpoint-moving test saves under.
"""

from __future__ import annotations

import json

import pytest

from tests.conftest import TINY, losses, train

pytestmark = pytest.mark.slow

BASE = [*TINY, "--model.layers=4", "--training.steps=6", "--checkpoint.interval=0",
        "--training.eval_interval=3"]
WINDOW = ["--model.parallel_block=true", "--model.attention_window=24"]
MOE = ["--model.experts=4", "--model.top_k=2"]

LAYOUTS = {
    "dp2xtp2": ["--parallel.tp=2"],
    "pp2-interleaved-vpp2": ["--parallel.pp=2", "--parallel.vpp=2",
                             "--parallel.schedule=interleaved-1f1b"],
    "pp4-1f1b": ["--parallel.pp=4", "--parallel.schedule=1f1b"],
    "pp2-zero-bubble": ["--parallel.pp=2", "--parallel.vpp=2", "--parallel.schedule=zero-bubble"],
    "pp2-zbv": ["--parallel.pp=2", "--parallel.vpp=2", "--parallel.schedule=zbv"],
    "cp2": ["--parallel.cp=2", "--parallel.dp_shard=1", "--parallel.tp=2"],
    "cp2xdp2": ["--parallel.cp=2"],
    "hsdp2x2": ["--parallel.dp_replicate=2", "--parallel.dp_shard=2"],
}
# with the parallel block and a sliding window
WINDOWED = {
    "tp2xcp2-window-parallel-block": ["--parallel.tp=2", "--parallel.cp=2", *WINDOW],
    "dp2xpp2-window-parallel-block-ac": ["--parallel.pp=2", *WINDOW,
                                         "--parallel.activation_checkpoint=full"],
}


def curves(run_dir):
    """{step: training loss} and {("val", step): validation loss} of a run."""
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {**losses(run_dir), **{("val", r["step"]): r["val_loss"] for r in rows
                                  if "val_loss" in r}}


def run(tmp, data, name, extra, nproc):
    train(tmp / name, data, *BASE, *extra, nproc=nproc)
    return curves(tmp / name)


@pytest.fixture(scope="module")
def refs(tmp_path_factory, tiny_data):
    tmp = tmp_path_factory.mktemp("refs")
    return {"plain": run(tmp, tiny_data, "ref", [], 1),
            "window": run(tmp, tiny_data, "ref-window", WINDOW, 1),
            "moe": run(tmp, tiny_data, "ref-moe", MOE, 1)}


def assert_close(got, ref, rel=1e-4):
    assert set(got) == set(ref) == {*range(1, 7), ("val", 3), ("val", 6)}, sorted(map(str, got))
    for s in ref:
        assert abs(got[s] - ref[s]) <= rel * abs(ref[s]), (s, got[s], ref[s])


# ranks that read token files: one per tp x cp group (MegaScale's redundant-loader removal)
READERS = {"dp2xtp2": {0, 2}, "cp2": {0}, "cp2xdp2": {0, 2}, "tp2xpp2": {0, 2},
           "hsdp2x2": {0, 1, 2, 3}}


def assert_readers(run_dir, want):
    reads = {r: json.loads((run_dir / "stats" / f"data_rank{r:05d}.json").read_text())
             ["samples_read"] for r in range(4)}
    assert {r for r, n in reads.items() if n > 0} == want, reads


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_matches_single_process(name, refs, tmp_path, tiny_data):
    assert_close(run(tmp_path, tiny_data, name, LAYOUTS[name], 4), refs["plain"])
    if name in READERS:
        assert_readers(tmp_path / name, READERS[name])


@pytest.mark.parametrize("name", list(WINDOWED))
def test_windowed_parallel_block_layout(name, refs, tmp_path, tiny_data):
    assert_close(run(tmp_path, tiny_data, name, WINDOWED[name], 4), refs["window"])


@pytest.mark.parametrize("extra", [["--parallel.ep=2"], ["--parallel.ep=2",
                                   "--parallel.dp_replicate=2", "--parallel.dp_shard=2"]],
                         ids=["ep2xdp4", "ep2-hsdp2x2"])
def test_expert_parallel_moe(extra, refs, tmp_path, tiny_data):
    assert_close(run(tmp_path, tiny_data, "moe", [*MOE, *extra], 4), refs["moe"])


def test_checkpoint_moves_between_layouts(refs, tmp_path, tiny_data):
    """Saved under tp2 x pp2, resumed under dp4: the steps of both layouts match the
    uninterrupted one-process run."""
    d = tmp_path / "moved"
    train(d, tiny_data, *BASE, "--parallel.tp=2", "--parallel.pp=2", "--stop-after", "3",
          nproc=4)
    assert_readers(d, READERS["tp2xpp2"])
    train(d, tiny_data, *BASE, nproc=4)
    assert_close(curves(d), refs["plain"])


def test_pipeline_run_resumes_from_its_own_checkpoint(refs, tmp_path, tiny_data):
    """Saved and resumed under pp2: each stage holds part of the model, the checkpoint all of it
    (the shape check once refused the other stage's keys)."""
    d = tmp_path / "pp"
    train(d, tiny_data, *BASE, "--parallel.pp=2", "--stop-after", "3", nproc=2)
    train(d, tiny_data, *BASE, "--parallel.pp=2", nproc=2)
    assert_close(curves(d), refs["plain"])


def test_bf16_on_ranks_without_data_parallelism(tmp_path, tiny_data):
    """bf16 where every rank is a tp or pp rank (FSDP2's mixed precision then runs over a
    one-rank data-parallel mesh of the run's own mesh) trains as bf16 does on one process,
    within bf16's rounding of the reductions' order."""
    bf16 = ["--training.dtype=bfloat16"]
    ref = run(tmp_path, tiny_data, "ref-bf16", bf16, 1)
    assert_close(run(tmp_path, tiny_data, "tp2xpp2-bf16",
                     [*bf16, "--parallel.tp=2", "--parallel.pp=2"], 4), ref, rel=1e-3)


def _gathers_worker(rank, world, port, out_dir):
    """All-gathers FSDP2 issues in one step of 3 microbatches per rank, per engine."""
    from pathlib import Path

    import torch
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group as group

    from myria import config as config_mod
    from myria.layout import Layout
    from myria.parallel.dims import ParallelDims
    from myria.train.engine import Engine
    from tests.dist import finish, init

    init(rank, world, port)
    real, counts = group.foreach_all_gather, {}

    def counted(*a, **kw):
        counts[name] = counts.get(name, 0) + 1
        return real(*a, **kw)

    group.foreach_all_gather = counted
    x = torch.randint(0, 64, (3, 1, 16), generator=torch.Generator().manual_seed(rank))
    for name in ("zero2", "fsdp"):
        cfg = config_mod.load(None, ["--model.layers=2", "--model.hidden=32", "--model.heads=2",
                                     "--model.vocab_size=64", "--model.seq_len=16",
                                     "--training.global_batch=6", "--training.micro_batch=1",
                                     "--training.device=cpu", "--training.dtype=float32",
                                     f"--training.data_parallel={name}"])
        engine = Engine(cfg, ParallelDims.build(Layout.resolve(cfg.parallel, world), "cpu"),
                        torch.device("cpu"))
        counts[name] = 0
        engine.forward_backward(x, x)
    (Path(out_dir) / f"gathers{rank}.json").write_text(json.dumps(counts))
    finish()


def test_zero2_gathers_each_unit_once_per_step(tmp_path):
    """zero2 keeps the gathered blocks across a step's microbatches (one all-gather per FSDP
    unit per step: 2 blocks and the root); fsdp gathers each block for every microbatch's
    forward and backward (the root stays gathered after forward: once per microbatch)."""
    from tests.dist import spawn

    spawn(_gathers_worker, 2, str(tmp_path))
    for rank in (0, 1):
        counts = json.loads((tmp_path / f"gathers{rank}.json").read_text())
        assert counts == {"zero2": 3, "fsdp": 3 * (2 * 2 + 1)}, counts
