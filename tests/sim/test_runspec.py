"""Run-schema parsing: defaults, the calibration file, clear errors for bad fields."""

from __future__ import annotations

import pytest

from myria.errors import ConfigError
from myria.sim import runspec

MINIMAL = """
[model]
layers = 2
hidden = 64
heads = 4
[training]
global_batch = 8
[cluster]
gpu = "a100-sxm-80gb"
gpus = 8
"""


def test_calibration_file_parses(calibration):
    assert len(calibration) == 10
    r = calibration[0]
    assert r.name == "megatron-lm-2021-1.7b"
    assert r.parallel.tp == 1 and r.dp == 32 and r.microbatches == 16
    assert r.training.recompute == "full" and r.kernels.fused_ops
    assert r.measured["iteration_time_s"] == 3.53   # kept for the bench, ignored by the model
    assert r.dropout == 0.1 and r.model_config().tie_embeddings   # gpt defaults


def test_single_run_without_wrapper_takes_defaults():
    (r,) = runspec.loads(MINIMAL)
    assert r.name == "run1"
    assert r.model.arch == "gpt" and r.model.seq_len == 2048 and r.model_config().vocab_size == \
        51200
    assert r.training.micro_batch == 1 and r.training.recompute == "none"
    assert r.training.zero_stage == 0 and r.training.precision == "bf16"
    assert r.parallel.tp == r.parallel.pp == r.parallel.cp == r.parallel.vpp == 1
    assert r.parallel.schedule == "1f1b" and not r.parallel.sequence_parallel
    assert not (r.overlap.tp or r.overlap.pp or r.overlap.dp)
    assert not r.kernels.flash_attention and r.kernels.fused_ops
    assert r.cluster.gpus_per_node == 8 and r.cluster.topology == "fat-tree"
    assert r.dp == 8 and r.microbatches == 1
    llama = runspec.loads(MINIMAL.replace("layers = 2", 'layers = 2\narch = "llama"'))[0]
    assert llama.model_config().vocab_size == 32000 and llama.dropout == 0.0
    assert not llama.model_config().tie_embeddings


def test_measured_section_is_free_form():
    (r,) = runspec.loads(MINIMAL + "[measured]\nanything = 1\nmfu = 0.4\n")
    assert r.measured["mfu"] == 0.4


@pytest.mark.parametrize("text, needle", [
    (MINIMAL.replace("heads = 4", "heads = 4\nhiden = 3"), "did you mean 'hidden'"),
    (MINIMAL + "[parallel]\nschedul = '1f1b'\n", "did you mean 'schedule'"),
    (MINIMAL + "[paralel]\ntp = 2\n", "did you mean 'parallel'"),
    (MINIMAL + "[parallel]\nschedule = 'interleaved'\n", "interleaved-1f1b"),
    (MINIMAL.replace("global_batch = 8", "global_batch = 8\nrecompute = 'partial'"),
     "none, selective, elementwise, full"),
    (MINIMAL.replace("layers = 2", "layers = 'two'"), "expected an integer"),
    (MINIMAL.replace("gpus = 8", "gpus = 8\nnic_gbps = -1"), ">= 0"),
    (MINIMAL.replace("heads = 4", ""), "model.heads is required"),
    (MINIMAL + "[parallel]\ntp = 3\n", "does not divide cluster.gpus"),
    (MINIMAL.replace("global_batch = 8", "global_batch = 6"), "divisible by data-parallel ranks"),
    (MINIMAL.replace("layers = 2", "layers = 8") + "[parallel]\npp = 2\nvpp = 2\n",
     "needs an interleaved schedule"),
    (MINIMAL + "[parallel]\nep = 2\n", "needs a mixture-of-experts model"),
    (MINIMAL.replace("gpu = \"a100-sxm-80gb\"", "gpu = 'a100-sxm-80'"), "did you mean"),
    ("[[run]]\nname = 'x'\n", "section [model] is required"),
    ("this is not toml", "not valid TOML"),
])
def test_bad_fields_give_one_clear_error(text, needle):
    with pytest.raises(ConfigError) as err:
        runs = runspec.loads(text)
        from myria.sim.perf import simulate
        simulate(runs[0])
    assert needle in str(err.value)
    assert "\n" not in str(err.value)


def test_describe_lists_every_field():
    text = runspec.describe()
    for sec in runspec.SECTIONS:
        assert f"[{sec}]" in text
    assert "flash_attention" in text and "(required)" in text


def test_trainer_config_carries_what_the_trainers_verdict_reads():
    """The planner's "priced, not runnable by myria" verdict is `Layout.check(trainer=True)` on
    `RunSpec.trainer_config()`: the optimizer reaches it (myria's NVMe tier runs AdamW only)."""

    (run,) = runspec.loads("[model]\narch = 'llama'\nlayers = 4\nhidden = 256\nheads = 4\n"
                           "[training]\nglobal_batch = 4\noffload = 'nvme'\noptimizer = 'lamb'\n"
                           "[cluster]\ngpu = 'a100-sxm-80gb'\ngpus = 1\n")
    assert run.trainer_config().optimizer.name == "lamb"
    with pytest.raises(ConfigError, match="supports optimizer.name = 'adamw', not 'lamb'"):
        run.layout().check(run.trainer_config(), "cpu", trainer=True)
    adam = run.replace(training={"optimizer": "adam"})
    assert adam.trainer_config().optimizer.name == "adamw"
    adam.layout().check(adam.trainer_config(), "cpu", trainer=True)


def test_zero1_with_tensor_or_pipeline_parallelism_is_runnable():
    """ZeRO-1 runs on the trainer's sharded engine, so a ZeRO-1 layout with tp or pp is one the
    trainer runs (DDP, which shards nothing, runs pure data parallelism only)."""
    (run,) = runspec.loads("[model]\narch = 'llama'\nlayers = 4\nhidden = 256\nheads = 4\n"
                           "[training]\nglobal_batch = 8\nzero_stage = 1\n"
                           "[parallel]\ntp = 2\npp = 2\n"
                           "[cluster]\ngpu = 'h100-sxm-80gb'\ngpus = 8\n")
    assert run.trainer_config().training.data_parallel == "zero2"
    run.layout().check(run.trainer_config(), "cuda", trainer=True)
    ddp = run.replace(training={"zero_stage": 0})
    with pytest.raises(ConfigError, match="'ddp' works with pure data parallelism"):
        ddp.layout().check(ddp.trainer_config(), "cuda", trainer=True)


def test_recomputation_names_between_trainer_and_simulator():
    """myria's "selective" keeps matmul outputs and recomputes the elementwise operators: the
    simulator's "elementwise", both ways; the attention-core "selective" is not myria's (the
    planner marks it not runnable rather than advising a setting the trainer reads otherwise)."""
    from myria import config as C
    from myria.device import planning_device
    from myria.sim.hardware import build_hardware
    from myria.sim.perf import config_run
    from myria.sim.planner import trainer_verdict

    cfg = C.load("configs/llama3-8b.toml", ["parallel.activation_checkpoint=selective"])
    run, _, _ = config_run(cfg, 8, planning_device("bfloat16"))
    assert run.training.recompute == "elementwise"
    assert run.trainer_config().parallel.activation_checkpoint == "selective"
    hw = build_hardware(run.cluster, run.training.precision)
    assert trainer_verdict(run, hw) == ""
    core = run.replace(training={"recompute": "selective"})
    assert "is not one of myria's" in trainer_verdict(core, hw)
