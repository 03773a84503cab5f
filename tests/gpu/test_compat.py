"""myria against the running torch: every module imports and every torch name it imports exists.

CI runs this on the pinned torch (2.13); bench/gpu/run.sh runs it on the GPU image's (2.11), which
is how `myria.compat`'s claim that all features' APIs are present from 2.11 on is checked.
"""

from __future__ import annotations

import ast
import importlib
import pkgutil
from pathlib import Path

import myria
from myria import compat


def test_every_module_and_torch_name_resolves_on_this_torch():
    failed = []
    for m in pkgutil.walk_packages(myria.__path__, "myria."):
        if not m.name.endswith("__main__"):
            try:
                importlib.import_module(m.name)
            except Exception as e:  # noqa: BLE001
                failed.append(f"{m.name}: {e!r}")
    for f in Path(myria.__file__).parent.rglob("*.py"):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
                mod = importlib.import_module(node.module)
                for a in node.names:
                    if not hasattr(mod, a.name):
                        try:
                            importlib.import_module(f"{node.module}.{a.name}")
                        except ImportError:
                            failed.append(f"{f.name}: from {node.module} import {a.name}")
    assert not failed, failed


def test_torch_note_says_what_this_torch_is():
    note = compat.torch_note()
    if compat.torch_version() == compat.TESTED:
        assert note is None
    else:
        import torch

        assert note.startswith(f"torch {torch.__version__}:") and "\n" not in note
