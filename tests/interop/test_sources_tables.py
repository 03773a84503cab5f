"""data.sources written as TOML's list of tables is the same mixture as its PATH:WEIGHT text."""

from __future__ import annotations

import pytest

from myria import config as config_mod
from myria.errors import ConfigError


def test_sources_as_list_of_tables(tmp_path, tiny_data):
    from myria.data.mixture import open_dataset

    (tmp_path / "web").symlink_to(tiny_data)
    (tmp_path / "code").symlink_to(tiny_data)
    web, code = tmp_path / "web", tmp_path / "code"
    f = tmp_path / "run.toml"
    f.write_text(f'[data]\nsources = [{{path = "{web}", weight = 0.7}},\n'
                 f'           {{path = "{code}", weight = 0.3, epochs = 2}}]\n')
    tables = config_mod.load(f).data
    text = config_mod.load(None, [f"--data.sources={web}:0.7,{code}:0.3:2"]).data
    assert tables.sources == text.sources
    a, b = open_dataset(tables, 64), open_dataset(text, 64)
    assert [(s.path, s.weight, s.epochs) for s in a.sources] == \
        [(str(web), 0.7, 0), (str(code), 0.3, 2)] == \
        [(s.path, s.weight, s.epochs) for s in b.sources]

    f.write_text(f'[data]\nsources = [{{path = "{web}", wieght = 0.7}}]\n')
    with pytest.raises(ConfigError, match=r"data.sources\[0\]: unknown key 'wieght'.*'weight'"):
        config_mod.load(f)
