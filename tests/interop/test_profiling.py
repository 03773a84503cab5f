"""[profiling]: two ranks write a torch.profiler trace of the chosen steps each (and the
memory records on request); `myria report` links them."""

from __future__ import annotations

import json

import pytest

from tests.conftest import TINY, run_cli


@pytest.mark.slow
def test_profile_window_per_rank_linked_from_report(tmp_path, tiny_data):
    run = tmp_path / "run"
    run_cli("train", "--run-dir", str(run), "--nproc", "2", f"--data.path={tiny_data}", *TINY,
            "--training.steps=4", "--profiling.start_step=2", "--profiling.steps=2",
            "--profiling.memory=true")
    prof = run / "profile"
    for rank in (0, 1):
        trace = json.loads((prof / f"trace_rank{rank:05d}.json").read_text())
        names = {e.get("name", "") for e in trace["traceEvents"]}
        assert any("aten::mm" in n or "aten::addmm" in n for n in names), rank
        assert any(e.get("name") == "[memory]" for e in trace["traceEvents"]), rank
        table = (prof / f"ops_rank{rank:05d}.txt").read_text()
        assert table.startswith(f"steps 2-3, rank {rank}, sorted by self_cpu_memory_usage")
    p = run_cli("report", str(run))
    assert f"profile: {prof / 'trace_rank00001.json'}" in p.stdout
    assert "../profile/trace_rank00000.json" in (run / "report" / "index.html").read_text()
