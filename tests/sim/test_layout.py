"""One pipeline layout for trainer and simulator: schedule names, uneven stages, reliability."""

from __future__ import annotations

import json

import pytest

from myria.config import ModelConfig
from myria.errors import ConfigError
from myria.layout import rank_layers, stage_layers, validate_pipeline
from myria.sim import runspec
from myria.sim.perf import simulate

L405 = ModelConfig(arch="llama", layers=126, hidden=16384, heads=128, kv_heads=8,
                   ffn_hidden=53248, vocab_size=128256, seq_len=8192)


def _run(layers: int, pp: int, schedule: str = "1f1b", vpp: int = 1):
    return runspec.parse_run({
        "name": f"l{layers}-pp{pp}",
        "model": {"arch": "llama", "layers": layers, "hidden": 16384, "heads": 128,
                  "kv_heads": 8, "ffn_hidden": 53248, "vocab": 128256, "seq_len": 8192},
        "training": {"global_batch": 512, "recompute": "full", "zero_stage": 1},
        "parallel": {"tp": 8, "pp": pp, "vpp": vpp, "schedule": schedule,
                     "sequence_parallel": True},
        "cluster": {"gpu": "h100-sxm-80gb", "gpus": 8 * pp * 8},
        "kernels": {"flash_attention": True}, "overlap": {"pp": True, "dp": True}})


def test_126_layers_on_16_stages_as_llama3_split_them():
    st = stage_layers(L405, 16, 1)
    # Dubey et al. 2024 (Llama 3, section 3.3.2): one layer fewer on the first and last stage
    assert st == [7] + [8] * 14 + [7]
    # ZBV's V puts stages r and 15-r on rank r: rank 0 holds both ends
    assert rank_layers(L405, 8, 2, "zbv") == [14] + [16] * 7
    assert rank_layers(L405, 8, 2, "interleaved-1f1b") == [15] + [16] * 6 + [15]


def test_uneven_stages_priced_by_their_busiest_rank():
    uneven, even = simulate(_run(126, 16)), simulate(_run(128, 16))
    # 128 on 16: the last rank runs 8 layers and the output layer (~0.65 layer here), the
    # critical path; 126 split 7, 8 x 14, 7: the critical rank runs 8 layers, about 8 / 8.65
    # of the time
    ratio = uneven.iteration_time_s / even.iteration_time_s
    assert 0.90 < ratio < 0.96
    assert uneven.memory.stage in ("first", "mid") and uneven.fits
    assert not any("divisible" in w for w in uneven.warnings)


def test_zero_bubble_means_the_same_to_trainer_and_simulator():
    validate_pipeline(32, 4, 2, "zero-bubble")     # torch's interleaved zero-bubble
    zb = simulate(_run(128, 4, "zero-bubble", 2))
    il = simulate(_run(128, 4, "interleaved-1f1b", 2))
    assert zb.breakdown["pp_bubble"] < il.breakdown["pp_bubble"]
    for bad, needle in (((4, 2, "1f1b"), "needs an interleaved schedule"),
                        ((4, 1, "zbv"), "exactly two stages"), ((64, 1, "1f1b"), "cannot fill")):
        with pytest.raises(ConfigError, match=needle):
            validate_pipeline(32, *bad)
    with pytest.raises(ConfigError, match="multiple of parallel.pp"):
        validate_pipeline(32, 4, 2, "zero-bubble", microbatches=6)


def test_simulate_takes_the_failure_rate(capsys):
    from myria.cli import main

    name = "megatron-lm-2021-1008.0b"
    out = {}
    for rate in ("2e-6", "2e-5"):
        assert main(["simulate", "--json", "--run", name, "--failures-per-gpu-hour", rate]) == 0
        out[rate] = json.loads(capsys.readouterr().out)
    low, high = out["2e-6"], out["2e-5"]
    assert 0 < high["ettr"] < low["ettr"] < 1
    assert high["checkpoint_interval_steps"] < low["checkpoint_interval_steps"]
    # the failure rate prices reliability only, never the step
    assert high["iteration_time_s"] == low["iteration_time_s"]
    assert high["reliability"]["mtbf_s"] == pytest.approx(low["reliability"]["mtbf_s"] / 10)


def test_the_analytic_model_imports_no_trainer_code():
    import subprocess
    import sys

    code = ("import sys\n"
            "from myria.sim import cli_plan, cli_simulate, planner, runspec\n"
            "from myria.sim.perf import simulate\n"
            "simulate(runspec.load_calibration()[-1])\n"
            "bad = [m for m in sys.modules if m == 'torch' or m.startswith(('myria.train', "
            "'myria.parallel', 'myria.resilience', 'myria.sim.measure', "
            "'myria.models.transformer'))]\n"
            "assert not bad, bad\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_plan_cli_accepts_126_layers_on_16_stages(capsys):
    from myria.cli import main

    argv = ["plan", "--gpu", "h100-sxm-80gb", "--arch", "llama", "--layers", "126", "--hidden",
            "16384", "--heads", "128", "--kv-heads", "8", "--ffn-hidden", "53248", "--vocab",
            "128256", "--seq-len", "8192", "--global-batch", "2048", "--gpus", "16384",
            "--pp", "16", "--vpp", "1", "--tp", "8", "--cp", "1", "--recompute", "full,none",
            "--zero", "1",
            "--top", "2", "--json"]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert {"evaluated", "fitting", "seconds", "ranked"} <= set(out) and out["ranked"]
    for r in out["ranked"]:
        assert r["layout"]["stage_layers"] == [7] + [8] * 14 + [7]
        assert r["memory_gb_per_gpu"] <= 81559 * 2**20 / 1e9   # the H100's memory, as NVML says
        assert r["memory_peak_stage"] in ("first", "mid")
        assert r["mfu_low"] < r["mfu"] < r["mfu_high"] and 0 < r["ettr"] < 1


def test_one_layout_object_gives_the_trainers_mesh_groups():
    """Layout resolves, validates, and its ranks and groups are the DeviceMesh's (built through
    the same object, on torch's in-process fake backend for each of several ranks)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from myria import config
    from myria.layout import Layout
    from myria.parallel import placement
    from myria.parallel.dims import ParallelDims

    cfg = config.load(None, ["--parallel.tp=2", "--parallel.pp=2", "--model.layers=4",
                             "--parallel.dp_replicate=2"])
    lay = Layout.resolve(cfg.parallel, 16)
    assert isinstance(lay, Layout) and lay.world == 16 and lay["dp_shard"] == 2
    lay.check(cfg)
    grid = placement.grid(lay)
    coords = placement.coordinates(grid)
    for rank in (0, 5, 11):
        dist.init_process_group("fake", rank=rank, world_size=16, store=FakeStore())
        try:
            dims = ParallelDims.build(lay, "cpu")
            for dim in dims.mesh.mesh_dim_names:
                mine = next(g for g in placement.groups(grid, dim) if rank in g)
                assert dims.mesh[dim].mesh.tolist() == mine, dim
                assert dims.coord[dim] == coords[rank][dim], dim
            assert dims.dp_rank == coords[rank]["dp_replicate"] * 2 + coords[rank]["dp_shard"]
        finally:
            dist.destroy_process_group()
    with pytest.raises(ConfigError, match="world size 6 is not divisible"):
        Layout.resolve(cfg.parallel, 6)
