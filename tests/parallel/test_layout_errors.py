"""Layouts that cannot run get one clear error naming the field and what would be valid."""

import pytest

from myria import config
from myria.errors import ConfigError
from myria.layout import Layout
from myria.train.preflight import check_run


@pytest.mark.parametrize("overrides,world,needle", [
    (["--parallel.tp=3", "--model.heads=8"], 3, "parallel.tp = 3 must divide model.heads"),
    (["--parallel.cp=4", "--model.seq_len=100"], 4, "divisible by 2 x parallel.cp = 8"),
    (["--parallel.ep=2"], 2, "needs a mixture-of-experts model"),
    (["--parallel.ep=4", "--model.experts=4", "--training.global_batch=2",
      "--training.micro_batch=1"], 2, "must divide the data-parallel sharding degree "
     "parallel.dp_shard = 2"),
    (["--parallel.ep=4", "--model.experts=4", "--parallel.dp_replicate=2",
      "--parallel.dp_shard=2", "--model.top_k=2"], 4, "parallel.dp_shard = 2"),
    (["--parallel.tp=2", "--training.data_parallel=ddp"], 4, "pure data parallelism"),
    (["--parallel.cp=2", "--parallel.cp_impl=torch"], 2, "needs CUDA"),
    (["--parallel.pp=2", "--parallel.vpp=2", "--parallel.schedule=1f1b"], 2, "vpp"),
    (["--parallel.pp=2", "--parallel.vpp=3", "--parallel.schedule=zbv",
      "--model.layers=6"], 2, "exactly two stages per rank"),
    (["--parallel.pp=4", "--model.layers=2"], 4, "cannot fill pp x vpp = 4"),
    (["--parallel.pp=2", "--parallel.vpp=2", "--parallel.schedule=interleaved-1f1b",
      "--training.global_batch=3", "--training.micro_batch=1", "--model.layers=4"], 2,
     "multiple of parallel.pp = 2"),
])
def test_layout_errors(overrides, world, needle):
    with pytest.raises(ConfigError, match=None) as e:
        cfg = config.load(None, overrides)
        check_run(cfg, Layout.resolve(cfg.parallel, world))
    assert needle in str(e.value)


def test_valid_layouts_pass():
    for o, w in [(["--parallel.tp=2", "--parallel.pp=2"], 8), (["--parallel.cp=2"], 4),
                 (["--model.experts=4", "--parallel.ep=2"], 4)]:
        cfg = config.load(None, [*o, "--model.layers=4"])
        check_run(cfg, Layout.resolve(cfg.parallel, w))


def test_fewest_processes_hold_the_expert_degree():
    """The fewest processes a layout runs on (dry run and simulate without --nproc): the
    model-parallel degrees times the shard ranks, at least ep of them (experts are spread
    over the FSDP shard ranks); an explicit dp_shard is kept."""
    from myria import config
    from myria.layout import Layout

    moe = config.load(None, ["--model.experts=4", "--model.top_k=2", "--parallel.ep=2",
                             "--parallel.tp=2"])
    n = Layout.fewest_processes(moe.parallel)
    assert n == 4
    Layout.resolve(moe.parallel, n).check(moe, trainer=False)
    dense = config.load(None, ["--parallel.tp=2", "--parallel.dp_shard=3"])
    assert Layout.fewest_processes(dense.parallel) == 6
