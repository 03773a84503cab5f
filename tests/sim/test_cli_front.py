"""The front doors of `plan` and `simulate` as a user meets them: training TOMLs, GPU counts
that cannot work, tables written to a pipe."""

from __future__ import annotations

import json

import pytest

from myria.cli import main


def run(capsys, *args):
    code = main(list(args))
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.parametrize("config,extra", [("configs/llama3-8b.toml", []),
                                          ("configs/demo.toml", ["--gpu", "h100-sxm-80gb"])])
def test_simulate_accepts_a_training_config(capsys, config, extra):
    """`simulate` reads the training TOMLs that `plan` and `analyze` read."""
    code, out, err = run(capsys, "simulate", config, "--json", *extra)
    assert code == 0, err
    res = json.loads(out.splitlines()[0])
    assert res["name"] == config.split("/")[-1][:-5]
    assert 0 < res["mfu"] < 1 and res["iteration_time_s"] > 0
    code, _, err = run(capsys, "analyze", config, "--json", *extra)
    assert code == 0, err


PLAN = ["plan", "configs/llama3-8b.toml", "--gpu", "h100-sxm-80gb"]


@pytest.mark.parametrize("gpus,needle", [
    (["--gpus", "12", "--gpus-per-node", "8"], "--gpus 12: a cluster of several servers has "
     "whole servers of --gpus-per-node 8 GPUs; use 8 or 16"),
    (["--gpus", "10000000000"], "--gpus 10000000000: more than this model and batch can "
     "occupy: at most 2,097,152 GPUs"),
    (["--gpus", "24"], "--gpus 24: no layout splits 24 GPUs for this model and global batch "
     "512 (the data-parallel degree, GPUs / (tp x pp x cp), must divide the global batch, pp "
     "the layers); 16 or 32 GPUs do"),
])
def test_plan_blames_the_gpu_count(capsys, gpus, needle):
    code, out, err = run(capsys, *PLAN, *gpus)
    assert code == 2 and needle in err and len(err.strip().splitlines()) == 1, err
    assert "global_batch is divisible" not in err


def test_plan_table_is_whole_when_piped(capsys):
    """Output that is not a terminal (pytest captures it like a pipe) gets every column whole."""
    code, out, err = run(capsys, "plan", "--layers", "8", "--hidden", "1024", "--heads", "16",
                         "--seq-len", "2048", "--global-batch", "64", "--gpu", "h100-sxm-80gb",
                         "--gpus", "16", "--top", "3")
    assert code == 0, err
    header = next(x for x in out.splitlines() if "layout" in x and "recompute" in x)
    for col in ("MFU (band)", "ckpt every", "compute", "bubble", "other"):
        assert col in header, header
    assert "…" not in out
