"""The analyze, simulate and plan subcommands, run in-process through myria.cli.main."""

from __future__ import annotations

import json

import pytest

from myria.cli import main
from myria.device import DeviceSpec
from myria.sim.runspec import calibration_path

CAL = str(calibration_path())


def test_simulate_json(capsys):
    assert main(["simulate", CAL, "--json"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 10
    objs = [json.loads(x) for x in lines]
    for o in objs:
        for key in ("name", "iteration_time_s", "mfu", "tokens_per_s", "tflops_per_gpu",
                    "memory_gb_per_gpu", "fits", "breakdown", "hardware_tflops_per_gpu"):
            assert key in o
        assert abs(o["error"]) < 0.1
    assert sum(abs(o["error"]) for o in objs) / len(objs) <= 0.05


def test_simulate_table_and_selection(capsys):
    assert main(["simulate", "--run", "megatron-lm-2021-1.7b"]) == 0
    out = capsys.readouterr().out
    assert "megatron-lm-2021-1.7b" in out and "mean absolute error" in out
    assert main(["simulate", CAL, "--run", "megatron-lm-2021-1.7"]) == 2
    assert "did you mean" in capsys.readouterr().err
    assert main(["simulate", "--schema"]) == 0
    assert "[cluster]" in capsys.readouterr().out


def test_simulate_bad_file(tmp_path, capsys):
    bad = tmp_path / "bad.toml"
    bad.write_text("[model]\nlayers = 2\nhidden = 64\nheads = 4\nwindow = 3\n"
                   "[training]\nglobal_batch = 8\n[cluster]\ngpu = 'h100'\ngpus = 8\n")
    assert main(["simulate", str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "model.window" in err and "attention_window" in err
    assert main(["simulate", str(tmp_path / "missing.toml")]) == 2


def test_analyze_run_file(capsys):
    assert main(["analyze", CAL, "--run", "megatron-lm-2021-18.4b", "--sort", "time"]) == 0
    out = capsys.readouterr().out
    assert "qkv" in out and "softmax" in out and "memory-bound" in out
    assert main(["analyze", CAL, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["operators"]
    kinds = {r["bound"] for r in rows}
    assert {"compute", "memory"} <= kinds
    assert sum(r["share"] for r in rows) < 1.0


def test_analyze_training_config(tmp_path, capsys):
    cfg = tmp_path / "train.toml"
    cfg.write_text("[model]\narch = 'llama'\nlayers = 4\nhidden = 256\nheads = 8\n"
                   "seq_len = 256\n[training]\nglobal_batch = 16\nmicro_batch = 4\n")
    assert main(["analyze", str(cfg), "--gpu", "h100-sxm-80gb", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["operators"]
    assert any(r["name"] == "swiglu" for r in rows)
    assert not any(r["recomputed"] for r in rows)
    # full recomputation: each layer forward operator runs twice, the table says so and the
    # FLOPs are twice the ones without it; backward operators are not repeated
    cfg.write_text(cfg.read_text() + "[parallel]\nactivation_checkpoint = 'full'\n")
    assert main(["analyze", str(cfg), "--gpu", "h100-sxm-80gb", "--json"]) == 0
    full = json.loads(capsys.readouterr().out)["operators"]
    for a, b in zip(rows, full, strict=True):
        twice = a["phase"] == "fwd" and a["name"] not in ("embedding", "final_norm", "logits",
                                                          "loss") and b["recomputed"]
        assert b["flops"] == pytest.approx(a["flops"] * (2 if twice else 1)), (a, b)
    assert {r["phase"] for r in full if r["recomputed"]} == {"fwd"}
    assert main(["analyze", str(cfg), "--gpu", "h100-sxm-80gb"]) == 0
    out = capsys.readouterr().out
    assert " fwd x2 " in out and "fwd x2: the forward and its recomputation in backward " \
        "(training.recompute = 'full')" in out, out
    # --run names a run of a run file: a training config is one run, so it is refused
    for cmd in ("analyze", "simulate", "plan"):
        assert main([cmd, str(cfg), "--run", "nosuch", *(["--gpus", "8"] * (cmd == "plan"))]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "--run picks a run of a simulator run file" in err, err


def test_plan_command(capsys, tmp_path):
    args = ["plan", "--layers", "32", "--hidden", "4096", "--heads", "32", "--seq-len", "2048",
            "--global-batch", "512", "--gpu", "a100-sxm-80gb", "--gpus", "64", "--top", "3"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "layouts evaluated" in out and "best layouts" in out
    assert main(args + ["--json", "--zero", "1"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["ranked"] and all(r["layout"]["zero_stage"] == 1 for r in data["ranked"])
    assert {"evaluated", "fitting", "seconds", "ranked"} <= set(data)
    for r in data["ranked"]:
        assert r["mfu_low"] < r["mfu"] < r["mfu_high"] and 0 < r["ettr"] <= 1
        assert r["band_nominal_coverage"] == 0.9 and 0 < r["band_held_out_mae"] < r["band"]
        assert r["checkpoint_interval_steps"] >= 1 and sum(r["layout"]["stage_layers"]) == 32
    assert main(["plan", "--layers", "32"]) == 2
    assert "needs" in capsys.readouterr().err


def test_plan_show_schedule(tmp_path, capsys):
    png = tmp_path / "sched.png"
    assert main(["plan", "--show-schedule", str(png), "--pp", "4", "--vpp", "2",
                 "--microbatches", "8"]) == 0
    out = capsys.readouterr().out
    assert png.stat().st_size > 5000 and "bubble 15.8%" in out
    assert main(["plan", "--show-schedule", str(png), "--pp", "4", "--vpp", "2",
                 "--microbatches", "6"]) == 2


def test_simulate_config_on_a_described_cpu():
    from myria.config import Config
    from myria.sim.perf import simulate_config

    cfg = Config()
    cpu = DeviceSpec("cpu", 0.2, 0.2, 16.0, 20.0, 0.0, source="measured (test)")
    one = simulate_config(cfg, 1, cpu)
    two = simulate_config(cfg, 2, cpu)
    assert one.iteration_time_s > 0 and one.layout["device"] == "cpu"
    assert two.layout["dp"] == 2
    # half the microbatches per process, plus gradient traffic
    assert two.iteration_time_s < one.iteration_time_s
    cfg.parallel.pp = 2
    cfg.model.layers = 4
    pipe = simulate_config(cfg, 2, cpu)
    assert pipe.layout["pp"] == 2 and pipe.breakdown["pp_bubble"] > 0


@pytest.mark.parametrize("argv", [["simulate", "--help"], ["plan", "--help"],
                                  ["analyze", "--help"]])
def test_help(argv, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 0


PLAN = ["plan", "--gpu", "h100-sxm-80gb", "--arch", "llama", "--layers", "32", "--hidden",
        "4096", "--heads", "32", "--global-batch", "512", "--gpus", "64", "--top", "1"]
BAD_PLAN_FLAGS = [
    ["--tp", "0"], ["--tp", "abc"], ["--pp", "-2"], ["--cp", "0"], ["--ep", "0"], ["--vpp", "0"],
    ["--mb", "0"], ["--gpus", "0"], ["--gpus", "-8"], ["--layers", "0"], ["--hidden", "0"],
    ["--heads", "0"], ["--kv-heads", "0"], ["--ffn-hidden", "0"], ["--vocab", "0"],
    ["--experts", "-1"], ["--top-k", "0"], ["--seq-len", "0"], ["--global-batch", "0"],
    ["--gpus-per-node", "0"], ["--nic-gbps", "0"], ["--oversubscription", "0.5"],
    ["--topology", "ring"], ["--gpu", "tpu-v9"], ["--zero", "4"], ["--recompute", "some"],
    ["--overlap", "xx"], ["--top", "0"], ["--hidden", "100", "--heads", "7"],
    ["--heads", "32", "--kv-heads", "5"], ["--arch", "rnn"], ["--microbatches", "0"],
    ["--kernels", "fa4"], ["--kernels", "fa3", "--gpu", "a100-sxm-80gb"], ["--kernels", "fa1"],
    ["--rank-jitter", "-0.1"], ["--jitter-tail", "2,1"], ["--jitter-tail", "0.1"],
]


def test_plan_says_each_assumption_and_each_flag_moves_the_price(capsys):
    """The header names every assumption that can change a rank with its flag; the defaults
    are the public stack's (fa3 on Hopper, tp/pp/dp overlap), and each flag reprices."""
    pinned = [*PLAN, "--tp", "8", "--pp", "2", "--vpp", "1", "--cp", "1", "--mb", "1",
              "--recompute", "none", "--zero", "1", "--json"]

    def first(*flags):
        assert main([*pinned, *flags]) == 0
        data = json.loads(capsys.readouterr().out)
        return data["assumptions"], data["ranked"][0]["iteration_time_s"]

    said, t = first()
    assert "attention fa3 (--kernels" in said[0] and "overlap tp,pp,dp (--overlap" in said[0]
    assert "(--oversubscription)" in said[1]
    said2, t_fa2 = first("--kernels", "fa2")
    assert "attention fa2" in said2[0]
    assert t < t_fa2 < first("--kernels", "unfused")[1]
    assert t < first("--overlap", "pp,dp")[1]
    assert "(--rank-jitter; assumed, not fitted)" in said[1] and "(--jitter-tail)" in said[1]
    assert first("--rank-jitter", "0")[1] < t < first("--jitter-tail", "0.01,3")[1]
    # the memory kept free changes which layouts fit: it is said, with its flag
    said3, _ = first("--reserve-gb", "2.5")
    assert "with 2.5 GB more kept free (--reserve-gb)" in said3[2]
    assert "reduce-scattered after every microbatch" in said3[2]
    assert main(PLAN) == 0
    out = capsys.readouterr().out
    assert out.count("assumed:") == 3


@pytest.mark.parametrize("bad", BAD_PLAN_FLAGS, ids=" ".join)
def test_every_bad_plan_flag_gets_one_clear_line(bad, capsys):
    from myria.cli import main

    try:
        code = main([*PLAN, *bad])
    except SystemExit as e:  # argparse's own errors
        code = e.code
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2, (bad, err)
    assert err and err[-1].startswith("myria plan: error:"), err
    assert bad[0].lstrip("-").split("-")[0] in err[-1] or "model." in err[-1], err[-1]
    assert not any("Traceback" in x for x in err)


def test_plan_and_simulate_refuse_non_utf8_files(tmp_path, capsys):
    from myria.cli import main

    f = tmp_path / "run.toml"
    f.write_bytes(b"[run]\nname = \"caf\xe9\"\n")
    for cmd in (["plan", str(f)], ["simulate", str(f)], ["analyze", str(f)]):
        assert main(cmd) == 2
        err = capsys.readouterr().err
        assert "not UTF-8" in err and "Traceback" not in err, err


def test_analyze_never_asks_for_more_than_the_machine_has(capsys):
    import os

    from myria.cli import main

    assert main(["analyze", "configs/llama3-8b.toml", "--nproc", "64", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["iteration_time_s"] > 0  # priced analytically on the default accelerator
    n = (os.cpu_count() or 1) * 4
    assert main(["analyze", "configs/llama3-8b.toml", "--nproc", str(n), "--gpu", "cpu"]) == 2
    err = capsys.readouterr().err
    assert f"needs {n} cores" in err and "--gpu" in err and "Traceback" not in err


def test_measuring_a_model_too_large_for_this_host_is_refused():
    from myria import config as mconfig
    from myria.errors import ConfigError
    from myria.sim.hardware import device_spec
    from myria.sim.measure.cpu import check_measurable
    from myria.sim.perf import config_run, run_shape

    cfg = mconfig.load("configs/llama3-8b.toml")
    run, _, _ = config_run(cfg, 8, device_spec("h100-sxm-80gb"))
    with pytest.raises(ConfigError, match="pass --gpu"):
        check_measurable(run_shape(run), 1)


def test_plan_marks_priced_not_runnable_layouts_and_never_puts_one_first(capsys):
    """13B on one A100: nothing fits without offload, so the planner prices ZeRO-Offload with
    ZeRO 0-2 and NVMe offload too (`Layout.check(trainer=False)`). Those myria's trainer
    refuses (ZeRO 0/1 is DDP, which FSDP2's CPU offload cannot serve; NVMe offload runs on CPU
    only) are marked with the trainer's own reason, and the first pick is one it runs, although
    a priced-only ZeRO-0 layout ties with it and is simpler."""
    args = ["plan", "--arch", "llama", "--layers", "40", "--hidden", "5120", "--heads", "40",
            "--ffn-hidden", "13824", "--vocab", "32000", "--seq-len", "2048",
            "--global-batch", "8", "--gpu", "a100-sxm-80gb", "--gpus", "1", "--top", "8"]
    assert main(args + ["--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    ranked = data["ranked"]
    assert data["offloaded"] and ranked[0]["runnable"] and "not_runnable" not in ranked[0]
    priced = [r for r in ranked if not r["runnable"]]
    assert priced and all(r["not_runnable"].startswith("priced, not runnable by myria: ")
                          for r in priced)
    assert any(r["layout"]["zero_stage"] < ranked[0]["layout"]["zero_stage"] and r["tied"]
               and r["layout"]["offload"] == "cpu" and "CPUOffloadPolicy" in r["not_runnable"]
               for r in priced)
    assert any(r["layout"]["offload"] == "nvme" and "runs on CPU" in r["not_runnable"]
               for r in priced)
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "2=†" in out and "1=†" not in out and "† #2: priced, not runnable by myria" in out
    # the tie's order says why a tied layout (a faster one, even) is not first
    assert "nor one myria's trainer does not run (†) when one it runs is tied" in \
        " ".join(out.split()), out


def test_simulate_a_training_config_names_every_cost(monkeypatch, capsys):
    """`myria simulate configs/demo.toml` on this CPU: the table's largest costs include the
    measured host time when it is large (here the profile says 50 ms per block)."""
    import dataclasses

    from myria import device
    from myria.sim.measure import cpu

    from .test_cpu import HERE, synthetic_profile

    prof = synthetic_profile(nproc=1)
    prof = dataclasses.replace(prof, gloo=(), rates=tuple(sorted(
        prof.rates + ((("host", "block"), 0.05), (("host", "head"), 0.05)))))
    monkeypatch.setattr(device, "planning_device", lambda dtype: HERE)
    monkeypatch.setattr(cpu, "measured_profile", lambda *a, **k: prof)
    assert main(["simulate", "configs/demo.toml"]) == 0
    out = capsys.readouterr().out
    assert "host (Python, launches)" in out and "demo" in out
