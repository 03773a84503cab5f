"""Data mixtures (`data.sources`): shares, the order as a function of the step, bad inputs."""

from __future__ import annotations

import json
import shutil
from collections import Counter

import numpy as np
import pytest
import torch

from myria.config import DataConfig
from myria.data import prepare as P
from myria.data.loader import BatchLoader
from myria.data.mixture import MixtureDataset, parse_sources, source_counts
from myria.errors import ConfigError, DataError
from tests.conftest import TINY, run_cli


@pytest.fixture(scope="module")
def two_sources(tiny_data, tmp_path_factory):
    """Two directories with the tiny corpus's tokenizer: a copy of it and a 4-document one."""
    root = tmp_path_factory.mktemp("mix")
    web = root / "web"
    shutil.copytree(tiny_data, web)
    code = root / "code"
    run_cli("prepare", "--corpus", "demo", "--max-docs", "4", "--tokenizer",
            str(tiny_data / "tokenizer.json"), "--out", str(code), "--quiet")
    return web, code


def _mixture(web, code, weights=(0.3, 0.7), seq_len=64, epochs=""):
    return MixtureDataset(parse_sources(f"{web}:{weights[0]},{code}:{weights[1]}{epochs}"),
                          seq_len)


def _config_mixture(web, code, seq_len=16):
    """The mixture as `myria train` opens it: `[data] sources` through open_dataset."""
    from myria.data.mixture import open_dataset

    return open_dataset(DataConfig(sources=f"{web}:0.3,{code}:0.7"), seq_len)


def _read(mix, steps, dp, start, g=16, micro=2, seed=3):
    """What `dp` ranks' loaders (as make_loader builds them, resumed at `start`) read over
    `steps` steps: per step, each sample's (index, tokens) from the batches' inputs/targets."""
    out = []
    loaders = [BatchLoader(mix, g, micro, r, dp, seed, start_step=start, prefetch=0)
               for r in range(dp)]
    for _ in range(steps):
        for ld in loaders:
            b = next(ld)
            rows = torch.cat([b.inputs.reshape(-1, mix.seq_len),
                              b.targets.reshape(-1, mix.seq_len)[:, -1:]], dim=1)
            out += [(int(i), tuple(r.tolist())) for i, r in zip(b.indices, rows, strict=True)]
    return out


def test_shares_follow_weights_over_500_steps(two_sources):
    mix = _config_mixture(*two_sources)
    read = _read(mix, 500, 2, 0)
    src = mix.source_of([i for i, _ in read])
    tokens = np.bincount(src, weights=[len(t) for _, t in read], minlength=2)
    share = tokens / tokens.sum()
    assert len(read) == 500 * 16
    assert abs(share[0] - 0.3) < 0.005 and abs(share[1] - 0.7) < 0.005, share
    # every prefix of the run is within one sample of its weight, per source
    for t in (1, 3, 17, 250):
        c = source_counts(t, 16, mix.shares)
        assert c.sum() == t * 16 and np.all(np.abs(c - t * 16 * np.array([0.3, 0.7])) < 1)


def test_each_sample_once_per_epoch_and_resume_on_another_layout(two_sources):
    """Stop at step 200 of a 2-rank run, resume on 4 ranks: the tokens read are those of the
    uninterrupted run, each as often (no sample lost or read twice by the change), and a
    source repeats a sample only after it has read all of them (the 4-document source wraps
    within 500 steps; the other does not: each of its samples read at most once)."""
    mix = _config_mixture(*two_sources)
    whole = _read(mix, 500, 2, 0)
    resumed = _read(mix, 200, 2, 0) + _read(mix, 300, 4, 200)
    # each step's global batch is the same sequence of samples whatever the ranks, so the
    # tokens read (rank slices in rank order) are the uninterrupted run's, each as often
    assert len(resumed) == len(whole) == 500 * 16 and resumed == whole
    g = 16
    for t in (37, 200, 500):     # after any step, every sample of a source read n or n+1 times
        seen = Counter(i for i, _ in whole[:t * g])
        for k in range(2):
            n = int(mix.sizes[k])
            reads = [seen[int(mix.offsets[k]) + i] for i in range(n)]
            assert max(reads) - min(reads) <= 1
    assert mix.sizes[0] >= 0.3 * 500 * g and 0.7 * 500 * g > mix.sizes[1]   # as said above
    assert max(Counter(i for i, _ in whole if i < int(mix.sizes[0])).values()) == 1


def test_bad_sources_one_line(two_sources, tmp_path):
    web, code = two_sources
    with pytest.raises(ConfigError, match="must be > 0"):
        parse_sources(f"{web}:0,{code}:1")
    with pytest.raises(ConfigError, match="weight inf must be a finite number > 0"):
        parse_sources(f"{web}:1,{code}:inf")
    with pytest.raises(ConfigError, match="not a number"):
        parse_sources(f"{web}:x")
    with pytest.raises(DataError, match="does not exist"):
        MixtureDataset(parse_sources(f"{tmp_path / 'nope'}:1,{code}:1"), 64)
    with pytest.raises(DataError, match="epoch limit"):
        _mixture(web, code, epochs=":1").check(16, 5000)
    with pytest.raises(DataError, match="under one of the 16"):
        _mixture(web, code, weights=(0.01, 0.99)).check(16, 10)


def test_bad_mixtures_through_the_cli_one_line_and_no_run_dir(two_sources, tmp_path, capsys):
    """`myria train --data.sources=...` as a user types it: a missing source, a weight <= 0 and
    sources prepared with different tokenizers each end in one line naming the source, before
    any process starts or the run directory exists: with `--nproc` and without it (one
    process, the default)."""
    from myria.cli import main

    web, code = two_sources
    other = tmp_path / "other"
    run_cli("prepare", "--corpus", "demo", "--max-docs", "3", "--vocab-size", "300",
            "--out", str(other), "--quiet")
    cases = {f"{tmp_path / 'nope'}:0.3,{code}:0.7": f"data directory '{tmp_path / 'nope'}' "
             "does not exist",
             f"{web}:0,{code}:1": f"entry '{web}:0': weight 0.0 must be > 0",
             f"{web}:1,{code}:-0.5": f"entry '{code}:-0.5': weight -0.5 must be > 0",
             f"{web}:0.3,{other}:0.7": f"'{other}' was prepared with another tokenizer than "
             f"'{web}' (tokenizer_sha256 {P.sha256_file(other / 'tokenizer.json')[:12]} vs "
             f"{P.sha256_file(web / 'tokenizer.json')[:12]}); prepare every source",
             # read as asked: refused before processes start, not by the ranks
             f"{web}:1,{code}:0.01": "'code' has a share of 0.0099, under one of the 8 "
             "sequences of a step",
             f"{web}:1,{code}:1:1": "steps read 4,000 samples of 'code', more than its epoch "
             "limit 1 x"}
    run = tmp_path / "run"
    for i, (sources, msg) in enumerate(cases.items()):
        capsys.readouterr()
        nproc = ["--nproc", "1"] if i % 2 else []
        rc = main(["train", "--run-dir", str(run), *nproc, *TINY,
                   f"--data.sources={sources}", "--training.steps=2" if i < 4 else
                   "--training.steps=1000"])
        err = capsys.readouterr().err
        assert rc == 2 and err.count("\n") == 1 and msg in err, (sources, err)
        assert not run.exists(), sources


def test_single_path_order_unchanged(tiny_data):
    """A single `path` keeps the one-directory order (old runs resume the same)."""
    from myria.data.dataset import TokenDataset, rank_batch_indices
    from myria.data.mixture import open_dataset

    ds = open_dataset(DataConfig(path=str(tiny_data)), 64)
    assert isinstance(ds, TokenDataset)
    ld = BatchLoader(ds, 8, 2, 1, 2, 5, prefetch=0)
    assert list(ld.indices(9)) == list(rank_batch_indices(9, 8, ds.num_samples, 5, 1, 2))


@pytest.mark.slow
def test_train_on_a_mixture_reports_training_and_validation_per_source_down_to_the_report(
        two_sources, tmp_path):
    web, code = two_sources
    run = tmp_path / "run"
    # 2 ranks x micro-batch 16: one evaluation batch (32) is larger than code's held-out split
    # (31 samples), which is evaluated whole, never reported as a loss of 0
    p = run_cli("train", "--run-dir", str(run), "--nproc", "2", *TINY,
                "--training.global_batch=32", "--training.micro_batch=16",
                f"--data.sources={web}:0.3,{code}:0.7", "--training.steps=4",
                "--training.eval_interval=2", "--data.eval_batches=1", "--checkpoint.interval=0",
                "--logging.tensorboard=true")
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if "val_loss" in r]
    assert [r["step"] for r in evals] == [2, 4]
    by = evals[-1]["val_loss_by_source"]
    assert set(by) == {"web", "code"}
    assert 1.0 < by["code"] < 20 and 1.0 < by["web"] < 20, by
    assert evals[-1]["val_loss"] == pytest.approx(0.3 * by["web"] + 0.7 * by["code"])
    # each eval's time is booked on its own row, the run's last eval too (no row follows it)
    assert all(r["goodput"].get("eval", 0) > 0 for r in evals), evals
    # training figures per source: samples and tokens within one sample of the weights, and
    # the losses per source that make up the step's loss
    train = [r for r in rows if "loss" in r]
    assert [r["step"] for r in train] == [1, 2, 3, 4]
    prev = {"web": 0, "code": 0}
    for r in train:
        n = r["samples_by_source"]
        assert sum(n.values()) == 32 * r["step"]
        assert all(abs(n[k] - w * 32 * r["step"]) < 1 for k, w in (("web", .3), ("code", .7)))
        assert r["tokens_by_source"] == {k: v * 64 for k, v in n.items()}
        step_n = {k: n[k] - prev[k] for k in n}
        mixed = sum(r["loss_by_source"][k] * step_n[k] for k in n) / 32
        assert mixed == pytest.approx(r["loss"], abs=1e-4), r
        prev = n
        assert f"loss {r['loss']:.4f} (web {r['loss_by_source']['web']:.4f}, code " in p.stdout
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tags = EventAccumulator(str(run / "tensorboard")).Reload().Tags()["scalars"]
    assert {"train/loss_by_source/web", "train/tokens_by_source/code", "train/loss"} <= set(tags)
    assert not {"train/time", "train/goodput_since", "train/attempt"} & set(tags), tags
    # `myria report`: the per-source curve, table and line, with metrics.jsonl's numbers
    p = run_cli("report", str(run), "--no-prediction")
    last = train[-1]
    assert (f"training by source to step 4: web {last['samples_by_source']['web']:,} samples = "
            f"{last['samples_by_source']['web'] / 128:.4f} (weight 0.3), loss "
            f"{last['loss_by_source']['web']:.4f}") in p.stdout, p.stdout
    assert "<table id=\"train-by-source\">" in (run / "report" / "index.html").read_text()
    line = (f"validation loss at step 4: {evals[-1]['val_loss']:.4f} "
            f"(web {by['web']:.4f}, code {by['code']:.4f})")
    assert line in p.stdout, p.stdout
    val = json.loads((run / "report" / "val_loss.json").read_text())
    assert val == {"steps": [2, 4], "val_loss": [r["val_loss"] for r in evals],
                   "by_source": {k: [r["val_loss_by_source"][k] for r in evals]
                                 for k in ("web", "code")},
                   "weights": {"web": 0.3, "code": 0.7}}
    page = (run / "report" / "index.html").read_text()
    section = page.split("<h2>Validation loss per source</h2>")[1].split("<h2>")[0]
    assert "<img id='val_loss'" in section and (run / "report" / "val_loss.png").exists()
    first, last = evals[0]["val_loss_by_source"]["code"], by["code"]
    assert (f"<tr><td>code</td><td>0.7</td><td>{first:.4f}</td><td>{last:.4f}</td>"
            in section), section
    assert (f"<tr><td>4</td><td>{evals[-1]['val_loss']:.4f}</td><td>{by['web']:.4f}</td>"
            f"<td>{by['code']:.4f}</td></tr>" in section), section
    # resumed with its sources in another order: refused before anything starts, naming
    # data.sources (not "was it re-prepared?"): it would re-read some samples and skip others
    p = run_cli("train", "--run-dir", str(run), "--nproc", "2", *TINY,
                "--training.global_batch=32", "--training.micro_batch=16",
                f"--data.sources={code}:0.7,{web}:0.3", "--training.steps=6",
                "--allow-data-change", check=False)
    assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert (f"data.sources = '{code}:0.7,{web}:0.3': the checkpoint of step 4 was trained on "
            f"the mixture '{web}:0.3,{code}:0.7'; on resume a mixture keeps its sources") \
        in p.stderr, p.stderr


def test_a_mixture_may_move_its_directories_and_epoch_limits_on_resume(tmp_path):
    """Only the sources, their order and their shares are the mixture's order: a moved
    directory of the same name, weights scaled alike, or another epoch limit resume."""
    from myria.data.mixture import check_resume

    check_resume("data/web:0.3,data/code:0.7", "/mnt/web:3,/mnt/code:7:2", 10)
    check_resume("", "data/web:1", 10)        # from one directory: its fingerprint judges
    for new in ("data/code:0.7,data/web:0.3", "data/web:0.3,data/code:0.6",
                "data/web:0.3,data/code:0.7,data/chat:0.1"):
        with pytest.raises(ConfigError, match="keeps its sources, and the weights of the steps"):
            check_resume("data/web:0.3,data/code:0.7", new, 10)
    # phases: those from the next step on may change, one before it may not
    check_resume("data/web:1,data/code:3", "data/web:1,data/code:3", 10, "",
                 "11:web=3,code=1")
    check_resume("data/web:1,data/code:3", "data/web:1,data/code:3", 10, "20:web=3,code=1",
                 "15:web=2,code=1")
    with pytest.raises(ConfigError, match="and yours from step 11 on"):
        check_resume("data/web:1,data/code:3", "data/web:1,data/code:3", 10, "",
                     "10:web=3,code=1")


def test_phases_go_on_from_where_each_source_stood():
    """C_k(t) across phases: continuous, the step's G samples, within one sample of each
    phase's weights over the phase's steps; the steps before a phase read as without it."""
    from myria.data.mixture import schedule

    src = parse_sources("data/web:1,data/code:3")
    plain, phased = schedule(src), schedule(src, "5:web=3,code=1;9:web=1,code=1")
    g = 16
    for t in range(0, 4 + 1):
        assert (phased.counts(t, g) == plain.counts(t, g)).all()
    for t in range(1, 14):
        c = phased.counts(t, g)
        assert c.sum() == t * g and (c >= phased.counts(t - 1, g)).all()
    at4 = phased.counts(4, g)   # phase 2 (first step 5) starts after 4 steps
    for t in (5, 6, 8):
        assert np.all(np.abs(phased.counts(t, g) - at4 - (t - 4) * g * np.array([0.75, 0.25]))
                      < 1)
    assert phased.at(3) == plain.at(3) and [float(x) for x in phased.at(4)] == [0.75, 0.25]
    with pytest.raises(ConfigError, match="gives no weight to code"):
        schedule(src, "5:web=1")
    with pytest.raises(ConfigError, match="must be 2 or later, and later than the phase before"):
        schedule(src, "1:web=1,code=1")


def test_new_weights_on_resume_are_a_phase_from_the_next_step():
    from myria.data.mixture import resolve_resume

    old = "data/web:1,data/code:3"
    assert resolve_resume(old, "", old, "", 40) == (old, "", None)
    base, phases, said = resolve_resume(old, "", "/mnt/web:3,/mnt/code:1", "", 40)
    # the steps done keep their weights (the new paths), the new ones apply from step 41
    assert (base, phases) == ("/mnt/web:1.0,/mnt/code:3.0", "41:web=3.0,code=1.0")
    assert "change from step 41 on (web 0.75, code 0.25)" in said and "steps 1-40" in said
    # resumed again with the same command: the phase goes on, nothing to say
    assert resolve_resume(base, phases, "/mnt/web:3,/mnt/code:1", "", 90) == (
        base, phases, None)
    # a third mixture at step 90: a second phase
    assert resolve_resume(base, phases, "data/web:1,data/code:1", "", 90)[1] == \
        "41:web=3.0,code=1.0;91:web=1.0,code=1.0"
    # typed phases, or other sources, are taken as typed (check_resume judges them)
    assert resolve_resume(old, "", old, "50:web=1,code=1", 40) == (old, "50:web=1,code=1",
                                                                   None)
    assert resolve_resume(old, "", "data/web:1", "", 40) == ("data/web:1", "", None)
    # a phase declared for later and left out of the resumed config: dropped, and said
    src, phases, said = resolve_resume(old, "50:web=1,code=1", old, "", 40)
    assert (src, phases) == (old, "") and "phase(s) from step 50 on are not in this " \
        "config and are dropped" in said


def test_new_weights_on_resume_train_as_the_same_phase_declared(two_sources, tmp_path):
    """Stopped after 2 steps and resumed with other weights of the same sources: the losses
    and the samples per source of every step equal a run that declared the phase from the
    start (data.phases as TOML tables); the report reads the phase's weights; a phase that
    would rewrite the steps done is refused in one line."""
    web, code = two_sources
    common = [*TINY, "--training.steps=4", "--checkpoint.interval=2",
              "--training.eval_interval=0"]
    resumed, declared = tmp_path / "resumed", tmp_path / "declared"
    run_cli("train", "--run-dir", str(resumed), *common, f"--data.sources={web}:1,{code}:3",
            "--stop-after", "2")
    p = run_cli("train", "--run-dir", str(resumed), *common, f"--data.sources={web}:3,{code}:1")
    assert "the mixture's weights change from step 3 on (web 0.75, code 0.25)" in p.stdout
    toml = tmp_path / "phases.toml"
    toml.write_text(f'[data]\nsources = "{web}:1,{code}:3"\n'
                    "phases = [{from_step = 3, weights = {web = 3, code = 1}}]\n")
    run_cli("train", "--config", str(toml), "--run-dir", str(declared), *common)
    rows = {r: [(x["step"], x["loss"], x["samples_by_source"]) for x in map(
        json.loads, (r / "metrics.jsonl").read_text().splitlines())] for r in (resumed,
                                                                             declared)}
    assert rows[resumed] == rows[declared] and len(rows[resumed]) == 4
    assert rows[resumed][1][2] == {"web": 4, "code": 12}   # 1:3 for two steps of 8
    assert rows[resumed][3][2] == {"web": 16, "code": 16}  # then 3:1
    changes = (resumed / "config_changes.jsonl").read_text()
    assert '"field": "data.phases"' in changes and "3:web=3.0,code=1.0" in changes
    from myria.observe.report_sections import phase_starts, training_by_source

    assert phase_starts(resumed) == [3]   # the report's curves mark it
    mix = training_by_source(resumed)
    assert mix["weights_from_step"] == 3 and mix["sources"]["web"]["weight"] == 3.0
    assert all(x["off_by_samples"] == 0 for x in mix["sources"].values())
    bad = run_cli("train", "--run-dir", str(resumed), *common, "--training.steps=6",
                  f"--data.sources={web}:3,{code}:1", "--data.phases=2:web=1,code=1;6:web=1,code=1",
                  check=False)
    assert bad.returncode == 2 and "and yours from step 5 on" in bad.stderr
    # the phases to type: the run's (from step 3) and a new one after the steps done
    assert "--data.phases='3:web=3.0,code=1.0;6:web=1.0,code=1.0'" in bad.stderr, bad.stderr
    assert bad.stderr.strip().count("\n") == 0


def test_reading_a_source_more_than_once_is_said(two_sources, tiny_data):
    """training.steps that read a directory more than once: a note of how many times; one
    step reading more samples of it than it has: a warning (the preflight's lines)."""
    from myria import config
    from myria.data.mixture import open_dataset
    from myria.train.preflight import data_passes

    web, code = two_sources

    def lines(*overrides):
        cfg = config.load(None, [*TINY, *overrides])
        return data_passes(cfg, open_dataset(cfg.data, cfg.model.seq_len, verify=False))

    one = open_dataset(DataConfig(path=str(tiny_data)), 64, verify=False).num_samples
    assert lines(f"--data.path={tiny_data}", "--training.steps=1") == []
    passes = 3 * one // 8   # steps that read it 3 times
    assert lines(f"--data.path={tiny_data}", f"--training.steps={passes}") == [
        f"note: training.steps = {passes} read data.path {tiny_data} 3 times over (each sample "
        "once per pass)"]
    (w,) = lines(f"--data.path={tiny_data}", "--model.seq_len=512",
                 f"--training.global_batch={2 * (one // 8) + 2}", "--training.steps=1")
    assert w.startswith(f"warning: data.path {tiny_data} has {one // 8:,} training samples of "
                        "model.seq_len = 512, fewer than the") and "each step repeats" in w, w
    mix = open_dataset(DataConfig(sources=f"{web}:1,{code}:1"), 64, verify=False)
    steps = int(2 * mix.sizes[1]) // 4 + 1     # code read just over twice, web less than once
    (note,) = lines(f"--data.sources={web}:1,{code}:1", f"--training.steps={steps}")
    assert note.startswith(f"note: training.steps = {steps} read source 'code' ({code}) "
                           f"{mix.epochs(steps, 8)[1]:.3g} times over") and "web" not in note


def test_a_finished_run_says_no_new_phase(tmp_path):
    """Other weights for a run already trained to training.steps: nothing to train, so no line
    that the weights change; with steps to train, the line."""
    from myria.train.preflight import run_config

    ck = tmp_path / "checkpoints" / "step_00000004"
    ck.mkdir(parents=True)
    (ck / "meta.json").write_text(json.dumps(
        {"step": 4, "config": {"data": {"sources": "data/web:1,data/code:3"}}}))
    (tmp_path / "checkpoints" / "latest").write_text("step_00000004")
    new = ["--data.sources=data/web:3,data/code:1"]
    cfg, said = run_config(None, [*new, "--training.steps=4"], tmp_path)
    assert said is None and cfg.data.phases == "5:web=3.0,code=1.0"
    _, said = run_config(None, [*new, "--training.steps=5"], tmp_path)
    assert "the mixture's weights change from step 5 on" in said
