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
    (["--gpus", "24"], "--gpus 24: no layout searched splits 24 GPUs for this model and "
     "global batch 512 (the data-parallel degree, GPUs / (tp x pp x cp), times the "
     "micro-batch must divide the global batch; unless --pp gives them, the stages tried "
     "divide the layers or are powers of two); 16 or 32 GPUs do"),
    (["--gpus", "8", "--mb", "3"], "with --mb 3 (the data-parallel degree"),
    # a degree the model cannot split by is named, not the GPU count
    (["--gpus", "64", "--tp", "3"], "--tp 3: parallel.tp = 3 must divide model.heads = 32 and "
     "the key/value heads = 8"),
    (["--gpus", "64", "--tp", "16,32"], "--tp 16,32: parallel.tp = 16 must divide"),
    (["--gpus", "64", "--pp", "64"], "--pp 64: more pipeline stages than model.layers = 32"),
    (["--gpus", "64", "--ep", "2"], "--ep 2: must divide the experts per layer (none: a dense "
     "model)"),
    (["--gpus", "64", "--top-k", "2"], "--top-k 2: experts per token of a dense model; give "
     "--experts N"),
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
    # what separates the tied first layouts names the settings that differ from #1's
    seps = [x.strip() for x in out.splitlines() if x.strip().startswith(("#2:", "#3:"))]
    assert seps and all(any(f"{k} " in x.split(": step")[0] for k in
                            ("layout", "micro-batch", "recompute", "ZeRO")) for x in seps), out


def test_plan_when_nothing_fits_exits_1_with_the_layout_closest_to_fitting(capsys, tmp_path):
    """A model no layout holds: exit 1 (a script sees it), the device's memory, the fastest
    layout if memory allowed and the one closest to fitting; --json says the same, and names
    no runnable layout (rank 0) while a plan that fits names its #1 (rank 1)."""
    big = ["plan", "--arch", "llama", "--layers", "126", "--hidden", "16384", "--heads", "128",
           "--kv-heads", "8", "--seq-len", "8192", "--global-batch", "64", "--gpu",
           "a100-sxm-40gb", "--gpus", "8", "--mb", "1", "--zero", "3", "--recompute", "full"]
    code, out, err = run(capsys, *big)
    assert code == 1, err
    assert "no layout fits in device memory (43 GB per GPU), even with offload" in out
    assert "closest to fitting: tp8" in out and "GB per GPU" in out, out
    # with memory to spare nothing would be offloaded; the state alone does not fit, so a
    # shorter sequence is not offered
    fastest = next(x for x in out.splitlines() if x.startswith("fastest layout if memory"))
    assert "offload" not in fastest and "shorter sequence" not in out, out
    code, out, err = run(capsys, *big, "--json")
    d = json.loads(out)
    assert code == 1 and d["ranked"] == [] and d["best_runnable_rank"] == 0
    assert d["leanest_unfitting"]["memory_gb_per_gpu"] > 43
    code, out, err = run(capsys, *PLAN, "--gpus", "64", "--top", "2", "--json")
    d = json.loads(out)
    assert code == 0 and d["best_runnable_rank"] == 1
    assert d["best_runnable"]["layout"] == d["ranked"][0]["layout"]
    # the schedule's PNG in a directory that does not exist: one line, before any search
    code, out, err = run(capsys, *PLAN, "--show-schedule", str(tmp_path / "no" / "s.png"),
                         "--pp", "4", "--microbatches", "8")
    assert code == 2 and err.strip() == (f"myria plan: error: --show-schedule "
                                         f"{tmp_path / 'no' / 's.png'}: its directory "
                                         f"{tmp_path / 'no'} does not exist"), err
    # a directory without config.json is not "not a file"
    code, out, err = run(capsys, "plan", str(tmp_path), "--gpu", "a100", "--gpus", "8")
    assert code == 2 and "a directory without config.json" in err, err


def test_a_gpu_alias_gets_its_devices_attention_kernel(capsys):
    """`--gpu h100` is the H100 SXM in every respect: FlashAttention-3 assumed and accepted."""
    base = ["plan", "--layers", "8", "--hidden", "1024", "--heads", "16", "--seq-len", "2048",
            "--global-batch", "64", "--gpus", "16", "--top", "1"]
    code, out, err = run(capsys, *base, "--gpu", "h100")
    assert code == 0 and "assumed: attention fa3" in out, (out, err)
    code, out, err = run(capsys, *base, "--gpu", "h100", "--kernels", "fa3")
    assert code == 0, err
    # the band was measured on A100 runs only: said for an H100 plan, not for an A100 one
    assert "calibration runs: 10 on a100-sxm-80gb" in out
    assert "h100-sxm-80gb is outside them: the band is a floor there" in out
    code, out, err = run(capsys, *base, "--gpu", "a100")
    assert code == 0 and "outside them" not in out, out


def test_when_every_layout_is_implausible_the_plan_says_so(capsys):
    """70B on 4 A100: every layout that fits has a memory margin under the model's own error;
    #1 is not called "not first", and one line says all are marked and ranked by MFU."""
    code, out, err = run(capsys, "plan", "--arch", "llama", "--layers", "80", "--hidden", "8192",
                         "--heads", "64", "--kv-heads", "8", "--ffn-hidden", "28672",
                         "--seq-len", "4096", "--global-batch", "64", "--gpu", "a100",
                         "--gpus", "4", "--top", "2", "--mb", "1", "--zero", "3")
    assert code == 0, err
    assert "! #1: memory margin" in out and "! #1: not first" not in out, out
    assert "every layout that fits is marked ! (a prediction the model cannot vouch for)" in out


def test_plan_writes_its_first_layout_as_a_run_simulate_prices_the_same(capsys, tmp_path):
    """`--write-run` holds every assumption of the plan (kernels, overlap, fabric): `simulate`
    of that file gives the plan's row, where a run file with the layout alone would not."""
    out_file = tmp_path / "first.toml"
    code, out, err = run(capsys, "plan", "--arch", "llama", "--layers", "8", "--hidden", "1024",
                         "--heads", "16", "--seq-len", "2048", "--global-batch", "64", "--gpu",
                         "h100", "--gpus", "16", "--top", "1", "--json", "--write-run",
                         str(out_file))
    assert code == 0, err
    row = json.loads(out)["ranked"][0]
    assert "wrote #1 (tp" in err and f"to {out_file}" in err, err
    code, out, err = run(capsys, "simulate", str(out_file), "--json")
    assert code == 0, err
    again = json.loads(out.splitlines()[0])
    assert again["iteration_time_s"] == pytest.approx(row["iteration_time_s"], rel=1e-9)
    assert again["memory_gb_per_gpu"] == pytest.approx(row["memory_gb_per_gpu"], rel=1e-9)
    assert again["layout"] == {k: v for k, v in row["layout"].items() if k != "stage_layers"}


def test_a_file_of_several_runs_names_the_one_planned(capsys):
    path = "src/myria/sim/data/expert_layouts.toml"
    fixed = ["--tp", "8", "--pp", "16", "--cp", "1", "--vpp", "1", "--mb", "1", "--zero", "1",
             "--recompute", "none", "--top", "1"]
    code, out, err = run(capsys, "plan", path, *fixed)
    assert code == 0, err
    assert err.strip() == (f"note: planning 'llama3-405b', the first of the 3 runs in {path} "
                           "(--run NAME plans another: megascale-175b, megatron-lm-gpt3-175b)")
    assert out.startswith("model llama 405.9B: 126 x 16384, 128 heads (8 key/value), MLP "
                          "53248, vocabulary 128,256, seq 8192"), out
    code, out, err = run(capsys, "plan", path, "--run", "nope", *fixed)
    assert code == 2 and "--run 'nope': no such run" in err and "megascale-175b" in err, err


def test_a_nic_rate_in_bits_per_second_is_refused(capsys):
    """--nic-gbps 400e9 (bits per second typed for Gbit/s): a unit slip, not a fabric."""
    with pytest.raises(SystemExit) as e:
        main([*PLAN, "--gpus", "64", "--nic-gbps", "400e9"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "argument --nic-gbps: '400e9' Gbit/s is faster than any NIC " \
        "(at most 10,000): give the line rate in Gbit/s, e.g. 400 for a 400G NIC" in err, err


@pytest.mark.parametrize("model,named", [
    ('arch = "retnet"\nkv_heads = 0', "retnet 126M"),
    ('arch = "griffin"\nattention_window = 512', "layers 'RRA', window 512"),
    ('attention = "linear"', "linear attention"),
])
def test_plan_takes_every_mixer_and_names_it(capsys, tmp_path, model, named):
    """`myria plan` searches the layouts of the mixers the dry run prices, and its header
    names the mixer (a linear-attention model is not a softmax one)."""
    cfg = tmp_path / "m.toml"
    cfg.write_text(f'[model]\nlayers = 8\nhidden = 1024\nheads = 16\nseq_len = 2048\n{model}\n'
                   '[training]\nglobal_batch = 64\ndtype = "bfloat16"\n')
    code, out, err = run(capsys, "plan", str(cfg), "--gpu", "h100-sxm-80gb", "--gpus", "8",
                         "--top", "1")
    assert code == 0, err
    header = next(x for x in out.splitlines() if x.startswith("model "))
    assert named in header, header


def test_plan_finds_where_a_layout_stands(capsys, tmp_path):
    """--find names a layout's place in the whole ranking (not only the rows shown), the same
    place as in a ranking printed long enough to hold it, and whether it is tied with #1."""
    cfg = tmp_path / "m.toml"
    cfg.write_text('[model]\nlayers = 8\nhidden = 1024\nheads = 16\nseq_len = 2048\n'
                   '[training]\nglobal_batch = 64\ndtype = "bfloat16"\n')
    args = ["plan", str(cfg), "--gpu", "h100-sxm-80gb", "--gpus", "8"]
    code, out, err = run(capsys, *args, "--top", "1", "--find", "tp=2,zero=3")
    assert code == 0, err
    line = next(x for x in out.splitlines() if x.startswith("--find tp=2,zero=3: #"))
    rank = int(line.split("#")[1].split(" ")[0])
    assert rank > 1 and ("; tied with #1" in line) != ("; not tied" in line), line
    code, out, err = run(capsys, *args, "--top", str(rank), "--json")
    ranked = json.loads(out)["ranked"]
    assert (ranked[-1]["layout"]["tp"], ranked[-1]["layout"]["zero_stage"]) == (2, 3)
    assert all((r["layout"]["tp"], r["layout"]["zero_stage"]) != (2, 3) for r in ranked[:-1])
    with pytest.raises(SystemExit):
        main([*args, "--find", "tpp=2"])
    assert "did you mean 'tp'" in capsys.readouterr().err


@pytest.mark.parametrize("argv,needle", [
    (["plan", "--gpus", "0"], "myria plan: error: argument --gpus: '0': must be >= 1"),
    (["plan", "--tpp", "2"], "unrecognized arguments: --tpp (did you mean '--tp'?)"),
])
def test_bad_flags_say_one_line(capsys, argv, needle):
    """A bad flag value or a mistyped flag: one line (no usage block above it) that says what
    is wrong, the closest flag, and where the help is."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and "usage:" not in err, err
    assert needle in err and "(see `myria plan --help`)" in err, err


def test_plan_shows_expert_traffic_in_its_own_column(capsys):
    """Expert parallelism's all-to-all is a column of its own when a layout shown has it, not
    part of "other"; a plan without it has no such column."""
    moe = ["plan", "--arch", "llama", "--layers", "16", "--hidden", "2048", "--heads", "16",
           "--kv-heads", "8", "--seq-len", "4096", "--global-batch", "256", "--gpu",
           "h100-sxm-80gb", "--gpus", "64", "--top", "2", "--tp", "1", "--pp", "1"]
    code, out, err = run(capsys, *moe, "--experts", "8", "--top-k", "2", "--ep", "8")
    assert code == 0, err
    head = next(x for x in out.splitlines() if "┃ layout" in x)
    assert "┃ DP ┃ EP ┃ other ┃" in head, head
    code, out, err = run(capsys, *moe)
    head = next(x for x in out.splitlines() if "┃ layout" in x)
    assert "┃ DP ┃ other ┃" in head, head
