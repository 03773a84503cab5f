"""`simulate`, `analyze` and `plan` agree where a user compares them: the flags a run file
refuses, a config's name, the layout label, the causal-MFU note, a zero failure rate, routing
and the fabric's limits, and the plan's help."""

from __future__ import annotations

import json
import re

import pytest

from myria.cli import main
from myria.sim.runspec import calibration_path

CAL = str(calibration_path())


def run(capsys, *args):
    code = main(list(args))
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.parametrize("cmd", ["simulate", "analyze"])
@pytest.mark.parametrize("flag", [["--gpu", "a100-sxm-80gb"], ["--nproc", "64"]])
def test_a_run_file_refuses_the_flags_of_a_training_config(capsys, cmd, flag):
    code, out, err = run(capsys, cmd, CAL, *flag)
    assert code == 2 and not out, out
    assert "--gpu and --nproc are for a training config" in err and "set [cluster]" in err, err


@pytest.mark.parametrize("cmd", ["simulate", "analyze"])
@pytest.mark.parametrize("n", ["0", "-8"])
def test_nproc_below_one_is_refused(capsys, cmd, n):
    code, out, err = run(capsys, cmd, "configs/llama3-8b.toml", "--nproc", n, "--json")
    assert code == 2 and not out, out
    assert f"--nproc {n}: give a positive number of processes" in err, err


def test_analyze_and_simulate_name_a_config_alike(capsys):
    code, out, err = run(capsys, "analyze", "configs/llama3-8b.toml", "--json")
    assert code == 0, err
    analyzed = json.loads(out)
    code, out, err = run(capsys, "simulate", "configs/llama3-8b.toml", "--json")
    assert code == 0, err
    simulated = json.loads(out.splitlines()[0])
    assert analyzed["name"] == simulated["name"] == "llama3-8b"
    assert analyzed["iteration_time_s"] == pytest.approx(simulated["iteration_time_s"])


RUN = """
name = "{name}"
[model]
arch = "llama"
layers = 4
hidden = 1024
heads = 16
seq_len = {seq}
[training]
global_batch = 16
zero_stage = 1
[parallel]
cp = {cp}
dp_shard = {shard}
[cluster]
gpu = "h100"
gpus = {gpus}
"""


def _run_file(tmp_path, name="r", seq=2048, cp=1, shard=0, gpus=16):
    p = tmp_path / f"{name}.toml"
    p.write_text(RUN.format(name=name, seq=seq, cp=cp, shard=shard, gpus=gpus))
    return str(p)


def test_simulate_notes_a_causal_runs_mfu_as_plan_does(capsys, tmp_path):
    long = _run_file(tmp_path, "long", seq=131072, cp=8)
    with open(long) as f:
        text = f.read()
    with open(long, "w") as f:   # a wider model: attention is most of a long sequence's work
        f.write(text.replace("hidden = 1024\nheads = 16", "hidden = 4096\nheads = 32"))
    code, out, err = run(capsys, "simulate", long, "--json")
    assert code == 0, err
    res = json.loads(out)
    assert res["mfu"] - res["mfu_causal"] > 0.05
    code, out, err = run(capsys, "simulate", long)
    assert code == 0, err
    assert (f"counting only those, long is {res['mfu_causal']:.1%} (mfu_causal in --json)"
            in out), out
    code, out, err = run(capsys, "simulate", _run_file(tmp_path, "short"))
    assert code == 0 and "counting only those" not in out, out


def test_no_failures_is_said_in_words(capsys, tmp_path):
    code, out, err = run(capsys, "simulate", _run_file(tmp_path), "--failures-per-gpu-hour", "0")
    assert code == 0, err
    assert "none (no failures)" in out and "0 steps" not in out, out
    assert "no failures assumed (--failures-per-gpu-hour 0)" in out
    code, out, err = run(capsys, "plan", "--arch", "llama", "--layers", "4", "--hidden", "1024",
                         "--heads", "16", "--seq-len", "2048", "--global-batch", "16", "--gpu",
                         "h100", "--gpus", "16", "--tp", "1", "--pp", "1", "--cp", "1", "--top",
                         "2", "--failures-per-gpu-hour", "0")
    assert code == 0, err
    assert "none (no failures)" in out and "0 steps" not in out and "inf h" not in out, out
    assert "no failures assumed (--failures-per-gpu-hour 0)" in out


def test_simulate_labels_a_layout_as_plan_does(capsys, tmp_path):
    code, out, err = run(capsys, "simulate", _run_file(tmp_path, shard=8))
    assert code == 0, err
    assert "tp1 pp1 dp16 hsdp8 mb1" in out, out


def test_write_run_pins_dp_shard_only_for_hsdp(capsys, tmp_path):
    """The written file keeps dp_shard at 0 ("all of them") unless the layout is HSDP, so a
    variation on `gpus` stays a plain sharded run; an HSDP layout keeps its shard group."""
    from myria.sim.cli_plan import layout_label, plan_argv
    from myria.sim.planner import SearchSpace, plan, run_of

    out_file = tmp_path / "first.toml"
    argv = ["--arch", "llama", "--layers", "8", "--hidden", "1024", "--heads", "16", "--seq-len",
            "2048", "--global-batch", "64", "--gpu", "h100", "--gpus", "16", "--tp", "1", "--pp",
            "1", "--cp", "1", "--top", "1", "--json"]
    code, out, err = run(capsys, "plan", *argv, "--write-run", str(out_file))
    assert code == 0, err
    row = json.loads(out)["ranked"][0]["layout"]
    assert row["dp_shard"] == row["dp"] == 16
    text = out_file.read_text()
    assert re.search(r"^dp_shard = 0$", text, re.M), text
    out_file.write_text(text.replace("gpus = 16", "gpus = 8"))
    code, out, err = run(capsys, "simulate", str(out_file), "--json")
    assert code == 0, err
    lay = json.loads(out)["layout"]
    assert lay["dp"] == lay["dp_shard"] == 8

    base, _ = plan_argv(argv[:-1])
    res = plan(base, SearchSpace(tp=[1], pp=[1], cp=[1], micro_batch=[1], recompute=["none"],
                                 zero_stage=[1], hsdp=[True]), top=1)
    first = res.ranked[0]
    assert run_of(base, first).parallel.dp_shard == 8 and "hsdp8" in layout_label(first.layout)


PLAN = ["plan", "--arch", "llama", "--layers", "4", "--hidden", "1024", "--heads", "16",
        "--seq-len", "2048", "--global-batch", "64", "--gpu", "h100", "--tp", "1", "--pp", "1",
        "--cp", "1", "--mb", "1", "--recompute", "none", "--zero", "1", "--top", "1"]


def test_plan_routing_is_a_flag_and_an_assumption(capsys):
    def first(*flags):
        code, out, err = run(capsys, *PLAN, "--gpus", "64", "--json", *flags)
        assert code == 0, err
        data = json.loads(out)
        return data["assumptions"][1], data["ranked"][0]["iteration_time_s"]

    said, t = first()
    assert "adaptive routing (--routing) with 2 flows per pair" in said, said
    said, t_ecmp = first("--routing", "ecmp")
    assert "ecmp routing (--routing) with 2 flows per pair" in said, said
    assert t_ecmp > t


def test_the_fabric_says_where_its_formulas_leave_its_shape(capsys, tmp_path):
    from myria.sim.topology import Fabric

    big = Fabric(nodes=2048)
    assert big.n_leaves == 512 and big.max_leaves == 64
    assert "joins at most 64 leaves (256 servers, 2,048 GPUs); 2,048 servers need 512" in \
        big.notes()[0]
    assert Fabric(nodes=256).notes() == []
    assert "1,024 GPUs fit in one pod" in Fabric(kind="clos3", nodes=128,
                                                 oversubscription=4).notes()[0]
    assert Fabric(kind="clos3", nodes=1024, oversubscription=4).notes() == []
    assert Fabric(kind="clos3", nodes=128).notes() == []

    code, out, err = run(capsys, "simulate", _big_run(tmp_path))
    assert code == 0, err
    assert "note: a two-tier fat-tree of radix-64 switches joins at most 64 leaves" in out, out
    code, out, err = run(capsys, *PLAN, "--gpus", "64", "--topology", "clos3",
                         "--oversubscription", "4")
    assert code == 0, err
    assert ("note: oversubscription 4 applies between pods; 64 GPUs fit in one pod" in out), out


def _big_run(tmp_path):
    p = tmp_path / "big.toml"
    p.write_text(RUN.format(name="big", seq=2048, cp=1, shard=0, gpus=16384).replace(
        "global_batch = 16", "global_batch = 16384"))
    return str(p)


def test_plan_help_names_every_flag_and_the_separation_counts_what_it_shows(capsys):
    import argparse

    from myria.sim.cli_plan import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    helps = {a.dest: a.help for a in parser._actions}
    for dest in ("arch", "tp", "pp", "cp", "ep", "vpp", "schedule", "routing"):
        assert helps[dest], dest
    code, out, err = run(capsys, "plan", "--layers", "8", "--hidden", "1024", "--heads", "16",
                         "--seq-len", "2048", "--global-batch", "64", "--gpu", "h100-sxm-80gb",
                         "--gpus", "16", "--top", "3")
    assert code == 0, err
    assert "What separates the first 3:" in out and "first five" not in out, out


def test_plan_writes_its_ranking_as_csv(capsys, tmp_path):
    """--csv: the rows the plan ranks, with the figures its JSON gives (for a spreadsheet);
    a file in a directory that does not exist is refused before the search."""
    import csv

    args = ["plan", "configs/llama3-8b.toml", "--gpu", "h100", "--gpus", "64", "--top", "4"]
    code, out, _ = run(capsys, *args, "--json", "--csv", str(tmp_path / "plan.csv"))
    assert code == 0
    ranked = json.loads(out)["ranked"]
    rows = list(csv.DictReader((tmp_path / "plan.csv").open()))
    assert [int(r["rank"]) for r in rows] == list(range(1, len(ranked) + 1)) and len(rows) == 4
    for row, r in zip(rows, ranked, strict=True):
        assert float(row["mfu"]) == pytest.approx(r["mfu"], rel=1e-5)
        assert float(row["iteration_time_s"]) == pytest.approx(r["iteration_time_s"], rel=1e-5)
        assert float(row["dp_comm_exposed_s"]) == pytest.approx(
            r["breakdown"]["dp_comm_exposed"], rel=1e-5, abs=1e-9)
    code, out, err = run(capsys, *args, "--csv", str(tmp_path / "no" / "plan.csv"))
    assert code == 2 and "its directory" in err and not out, err


def test_plan_of_a_training_config_prices_its_layout_as_its_dry_run(capsys):
    """`myria plan CONFIG` prices a myria training config as myria's trainer runs it (its own
    modules, gradients reduce-scattered once per step, nothing decomposed), as the config's
    dry run does: the config's own layout gets the dry run's step time, MFU and memory, and
    the header says so."""
    from myria import config as mconfig
    from myria import device
    from myria.sim.perf import simulate_config

    # one search answers both: --find's place is in the whole ranking, whatever --top shows
    code, out, err = run(capsys, "plan", "configs/llama3-8b.toml", "--gpu", "h100", "--gpus",
                         "64", "--top", "100000", "--json", "--find",
                         "tp=2,pp=1,cp=1,zero=2,mb=1,recompute=none")
    assert code == 0, err
    res = json.loads(out)
    found, ranked = res["found"], res["ranked"]
    dry = simulate_config(mconfig.load("configs/llama3-8b.toml"), 64, device.lookup("h100"))
    assert found["iteration_time_s"] == pytest.approx(dry.iteration_time_s, rel=1e-9)
    assert found["mfu"] == pytest.approx(dry.mfu, rel=1e-9)
    assert found["memory_gb_per_gpu"] == pytest.approx(dry.memory.total / 1e9, rel=1e-6)
    code, out, err = run(capsys, "plan", "configs/llama3-8b.toml", "--gpu", "h100", "--gpus",
                         "64", "--top", "1")
    assert code == 0 and "default for a training config: none, as myria's trainer runs it" \
        in out, out
    assert "attention fa2 " in out and "elementwise kernels unfused" in out and \
        "overlap none" in out, out
    # only what the trainer has is searched: ZeRO 0, 2, 3 and its three recomputations
    assert {r["layout"]["zero_stage"] for r in ranked} == {0, 2, 3}
    assert {r["layout"]["recompute"] for r in ranked} <= {"none", "elementwise", "full"}
    # a flag still wins: --overlap prices the decomposed overlap, and the header says it
    code, out, err = run(capsys, "plan", "configs/llama3-8b.toml", "--gpu", "h100", "--gpus",
                         "64", "--top", "1", "--overlap", "tp,pp,dp")
    assert "overlap tp,pp,dp (--overlap; default for a training config: none" in out, out


def test_find_refuses_a_degree_the_model_cannot_split_as_the_search_flag_does(capsys):
    """--find tp=3 on 16 heads is refused with the reason --tp 3 gives, not answered with
    "no layout with those values fits"."""
    small = ["plan", "--layers", "8", "--hidden", "1024", "--heads", "16", "--seq-len", "2048",
             "--global-batch", "64", "--gpu", "h100", "--gpus", "16"]
    code, out, err = run(capsys, *small, "--find", "tp=3")
    assert code == 2 and not out and "--find tp=3: parallel.tp = 3 must divide" in err, err
    code, out, err = run(capsys, *small, "--find", "pp=9")
    assert code == 2 and "--find pp=9: more pipeline stages than model.layers = 8" in err, err


def test_plan_with_another_arch_than_its_file_says_so(capsys, tmp_path):
    """`--arch` over a training config of another architecture prices a model of that
    architecture at the file's sizes, and says so on stderr."""
    cfg = tmp_path / "hybrid.toml"
    cfg.write_text('[model]\narch = "hybrid"\nblock_pattern = "DMAR"\nlayers = 8\nhidden = 512\n'
                   'heads = 8\nkv_heads = 4\nvocab_size = 8192\nseq_len = 1024\n')
    code, out, err = run(capsys, "plan", str(cfg), "--arch", "llama", "--gpu", "h100",
                         "--gpus", "8", "--top", "1")
    assert code == 0 and out.startswith("model llama"), err
    assert "--arch llama replaces hybrid's architecture 'hybrid'" in err
    code, out, err = run(capsys, "plan", str(cfg), "--gpu", "h100", "--gpus", "8", "--top", "1")
    assert code == 0 and "replaces" not in err
