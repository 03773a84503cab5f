"""`training.float8` on a CPU: refused in one line naming the field (the GPU case: test_gpu.py)."""

from __future__ import annotations

from tests.conftest import TINY, run_cli


def test_float8_is_refused_on_cpu_in_one_line(tmp_path, tiny_data):
    p = run_cli("train", "--run-dir", str(tmp_path), f"--data.path={tiny_data}", *TINY,
                "--training.steps=1", "--training.device=cpu", "--training.float8=true",
                check=False)
    assert p.returncode != 0 and "Traceback" not in p.stderr, p.stderr[-2000:]
    lines = [x for x in p.stderr.splitlines() if x.strip()]
    assert len(lines) == 1, lines
    assert lines[0].startswith("myria train: error: training.float8 = true needs a CUDA GPU")
