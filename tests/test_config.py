"""Config loading, overrides and validation errors."""

import pytest

from myria import config
from myria.config import resume_rules
from myria.errors import ConfigError
from myria.layout import Layout


def test_defaults_validate():
    """The defaults load, validate and equal the dataclass defaults field by field (no default
    is rewritten by validation), and the default layout is one data-parallel run."""
    import dataclasses

    cfg = config.load()
    for section, cls in config.SECTIONS.items():
        for f in dataclasses.fields(cls):
            want = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            assert getattr(getattr(cfg, section), f.name) == want, f"{section}.{f.name}"
    assert Layout.resolve(cfg.parallel, 1)["dp"] == 1


def test_toml_and_overrides(tmp_path):
    p = tmp_path / "c.toml"
    p.write_text('[model]\nlayers = 3\n[training]\nsteps = 7\n')
    cfg = config.load(p, ["--training.steps=9", "--model.arch=gpt", "--logging.tensorboard=false"])
    assert cfg.model.layers == 3 and cfg.training.steps == 9
    assert cfg.model.arch == "gpt" and cfg.logging.tensorboard is False


@pytest.mark.parametrize("override,needle", [
    ("--model.layer=3", "did you mean 'layers'"),
    ("--modle.layers=3", "did you mean 'model'"),
    ("--model.layers=three", "model.layers = 'three': expected an integer"),
    ("--model.layers=0", "model.layers = 0: must be >= 1"),
    ("--model.arch=gtp", "did you mean 'gpt'"),
    ("--model.heads=7", "model.heads = 7 does not divide model.hidden = 256"),
    ("--model.kv_heads=3", "model.kv_heads = 3 must divide model.heads = 8"),
    ("--model.attention=block_sparse --model.attention_window=999",
     "attention_window = 999 is larger than model.seq_len"),
    ("--training.micro_batch=99", "exceeds training.global_batch"),
    ("--model.top_k=2", "model.top_k = 2: mixture-of-experts setting(s) on a dense model"),
    ("--model.capacity_factor=1.25", "model.capacity_factor = 1.25: mixture-of-experts"),
    # mixer settings that would do nothing, and a pattern longer than the model
    ("--model.block_pattern=DDDA", "model.block_pattern = 'DDDA': a layer pattern for arch "
     "griffin or hybrid (model.arch = 'llama') setting(s) that would do nothing"),
    ("--model.feature_map=relu", "model.feature_map = 'relu': linear attention's"),
    ("--model.ssm_state=16", "model.ssm_state = 16: Mamba-2's, for the M layers of model.arch = "
     "'hybrid' (this model: arch 'llama')"),
    ("--model.arch=griffin --model.attention_window=8 --model.layers=2",
     "model.block_pattern = 'RRA' is longer than model.layers = 2"),
    ("--data.eval_batches=0 --training.eval_interval=40",
     "data.eval_batches = 0 with training.eval_interval = 40: an evaluation needs a batch"),
])
def test_errors_name_field_value_and_valid(override, needle):
    with pytest.raises(ConfigError) as e:
        config.load(None, override.split())
    assert needle in str(e.value)


def test_world_size_mismatch():
    cfg = config.load(None, ["--parallel.tp=2", "--parallel.dp_shard=2"])
    with pytest.raises(ConfigError, match="world size is 2"):
        Layout.resolve(cfg.parallel, 2)
    cfg = config.load(None, ["--training.global_batch=6", "--training.micro_batch=2"])
    with pytest.raises(ConfigError, match="divisible by data-parallel ranks"):
        Layout.resolve(cfg.parallel, 2).check(cfg)
    assert Layout.resolve(cfg.parallel, 3)["dp"] == 3


def test_bad_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        config.load(tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[model\nlayers=")
    with pytest.raises(ConfigError, match="not valid TOML"):
        config.load(bad)
    wrong = tmp_path / "w.toml"
    wrong.write_text("[model]\nhidden = 1.5\n")
    with pytest.raises(ConfigError, match="model.hidden = 1.5: expected an integer"):
        config.load(wrong)


def test_shipped_configs_validate():
    from pathlib import Path

    root = Path(__file__).resolve().parents[1] / "configs"
    files = sorted(root.glob("*.toml"))
    assert len(files) >= 3
    for f in files:
        config.load(f)


def test_describe_has_every_field_with_help():
    """Every field of every section appears once in `describe`, under its section, with its
    value and a non-empty one-line description."""
    import dataclasses
    import tomllib

    text = config.describe(config.Config())
    assert tomllib.loads("\n".join(ln.split(" # ")[0] for ln in text.splitlines()))
    section = None
    seen = set()
    for line in text.splitlines():
        if line.startswith("["):
            section = line.strip("[]")
        elif line:
            name, _, help_ = line.partition(" # ")
            seen.add((section, name.split("=")[0].strip()))
            assert help_.strip() and "\n" not in help_, line
    every = {(s, f.name) for s, cls in config.SECTIONS.items() for f in dataclasses.fields(cls)}
    assert seen == every and len(every) > 100
    assert "global_batch = 16" in text and "# sequences per optimizer step" in text


def test_resume_changes_apply_refuse_and_keep_the_lr_horizon():
    """A resumed run: what changed against the checkpoint's config, what cannot change."""
    before = config.load(None, ["--training.steps=120"]).to_dict()
    cfg = config.load(None, ["--training.steps=300", "--optimizer.lr=1e-5",
                             "--checkpoint.resume_from=/x"])  # session fields are not changes
    found = resume_rules.resume_changes(before, cfg, 120)
    assert found == [("training.steps", 120, 300), ("optimizer.lr", 0.003, 1e-5)]
    assert cfg.optimizer.decay_steps == 120  # the decay keeps the horizon it was trained with
    cfg = config.load(None, ["--training.steps=300", "--optimizer.decay_steps=300"])
    assert ("optimizer.decay_steps", 120, 300) in resume_rules.resume_changes(before, cfg, 120)
    cfg = config.load(None, ["--model.hidden=512", "--training.seed=7", "--optimizer.lr=1"])
    with pytest.raises(ConfigError) as e:
        resume_rules.resume_changes(before, cfg, 120)
    msg = str(e.value)
    assert "model.hidden = 512 (the checkpoint has 256" in msg and "training.seed = 7" in msg
    assert "optimizer.lr" not in msg and "\n" not in msg
    cfg = config.load(None, ["--model.attention=linear"])   # another mixer on the same weights
    with pytest.raises(ConfigError, match="model.attention = 'linear' .*trained as that mixer"):
        resume_rules.resume_changes(before, cfg, 120)
    # still warming up at step 10 of 20: the decay has not begun, stretching it cannot jump
    cfg = config.load(None, ["--training.steps=300"])
    assert resume_rules.resume_changes(before, cfg, 10) == [("training.steps", 120, 300),
                                                      ("optimizer.decay_steps", 120, 300)]
    assert cfg.optimizer.decay_steps == 0
    # a checkpoint that recorded only its model (older meta.json): only the model is compared
    assert resume_rules.resume_changes({"model": before["model"]}, config.load(), 10) == []
    # a derived size written out (ffn_hidden 0 is the architecture's width, kv_heads 0 one per
    # head) is the same shape: it resumes; another size is refused, naming the derived one
    m = config.load().model
    same = config.load(None, [f"--model.ffn_hidden={m.ffn_dim}", f"--model.kv_heads={m.heads}"])
    plain = config.load(None, ["--model.kv_heads=0"]).to_dict()
    assert resume_rules.resume_changes(plain, same, 10) == []
    with pytest.raises(ConfigError, match=rf"ffn_hidden = 64 \(the checkpoint has 0, i.e. "
                                          rf"{m.ffn_dim}:"):
        resume_rules.resume_changes(plain, config.load(None, ["--model.ffn_hidden=64"]), 10)
    # a hybrid's checkpoint resumed as llama: the architecture is named, not the layer pattern
    # llama does not read (its default, which the user never typed)
    hybrid = config.load(None, ["--model.arch=hybrid", "--model.block_pattern=DMAR",
                                "--model.layers=4"]).to_dict()
    with pytest.raises(ConfigError) as e:
        resume_rules.resume_changes(hybrid, config.load(None, ["--model.layers=4"]), 10)
    assert "model.arch = 'llama' (the checkpoint has 'hybrid'" in str(e.value)
    assert "block_pattern" not in str(e.value) and "ssm_" not in str(e.value)


def test_demo_config_evaluates_before_its_last_step():
    """The demo shows a validation loss in its summary: it evaluates, at its last step too."""
    cfg = config.load("configs/demo.toml")
    t = cfg.training
    assert 0 < t.eval_interval <= t.steps and t.steps % t.eval_interval == 0
    assert cfg.data.eval_batches > 0


def test_an_unknown_command_points_to_the_one_that_does_its_work(capsys):
    """`myria import` (what other tools call it) says how a Hugging Face model starts a run;
    another unknown command gets the nearest name."""
    from myria.cli import main

    assert main(["import"]) == 2
    assert "myria train --model.init_from=MODEL_DIR" in capsys.readouterr().err
    assert main(["reprot"]) == 2
    assert "did you mean 'report'?" in capsys.readouterr().err


def test_an_errors_first_line_is_cut_at_a_word():
    """A long one-line error of torch or gloo, quoted in one of myria's lines, ends at a whole
    word with " ..." (not mid-word); only the first line is kept."""
    from myria.errors import first_line

    text = ("[pair.cc:537] Read error [10.0.0.1]:1234: Connection reset by peer. Check the logs "
            "on the other host\nsecond line")
    cut = first_line(RuntimeError(text), 70)
    assert cut == "[pair.cc:537] Read error [10.0.0.1]:1234: Connection reset by ..."
    assert first_line(text) == text.splitlines()[0] and first_line("") == ""
