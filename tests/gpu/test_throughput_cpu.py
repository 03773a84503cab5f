"""bench/gpu_throughput.py at toy sizes on the CPU (`--cpu`), so the GPU benchmark never rots.

Not marked `gpu`: it runs in the normal suite. The plain loop and `myria train` must train the
same model on the same data with the same optimizer: in fp32 on one CPU process their losses
agree step for step, with the silent-corruption checks on or off and with `zero2`.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys

from tests.conftest import ROOT


def test_gpu_throughput_cpu_mode(tmp_path, tiny_data):
    out = tmp_path / "gpu_cpu.json"
    p = subprocess.run([sys.executable, "bench/gpu_throughput.py", "--cpu", "--warmup", "1",
                        "--steps", "2", "--data", str(tiny_data), "--out", str(out)],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    r = json.loads(out.read_text())
    rows = {x["loop"]: x for x in r["rows"]}
    assert set(rows) == {"myria", "plain", "myria-nochecks", "myria-zero2", "plain-fsdp"} \
        and not r["skipped"]
    profiled = {"plain", "myria", "myria-nochecks"}   # one more step each, untimed
    for loop, x in rows.items():
        assert len(x["losses"]) == 3 + (loop in profiled)
        assert all(math.isfinite(v) for v in x["losses"])
        assert ("profile" in x) == (loop in profiled) and x.get("profile") is None  # no device
        assert x["step_s"] > 0 and x["tokens_per_s"] > 0 and 0 < x["mfu"] < 1
        assert x["breakdown_s"]["forward"] > 0 and x["breakdown_s"]["backward"] > 0
        assert x["predicted"]["step_s"] > 0 and x["predicted"]["memory_gb"] > 0
    for loop in ("myria", "myria-nochecks", "myria-zero2", "plain-fsdp"):   # no value changes
        for a, b in zip(rows[loop]["losses"], rows["plain"]["losses"]):
            assert abs(a - b) < 1e-4, (rows[loop]["losses"], rows["plain"]["losses"])
    s = r["summary"]["toy/compile=off"]
    assert "overhead_vs_plain" in s and "step_time_error" in s
    assert "overhead_without_checks" in s and "fsdp_one_rank_vs_autocast" in s
    assert "overhead_zero2" in s
    assert "toy" in p.stdout and "MFU" in p.stdout   # the table


def test_a_profiled_step_says_how_busy_the_device_was(tmp_path):
    """`device_profile` over a trace: the device's busy time is the union of its events (two
    overlapping kernels count once), the window runs from the first to the last event, host
    or device; kernels are ranked by their summed time."""
    from tests.conftest import bench_module

    ev = [{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 100},
          {"ph": "X", "cat": "kernel", "name": "gemm", "ts": 10, "dur": 30},
          {"ph": "X", "cat": "kernel", "name": "gemm", "ts": 30, "dur": 20},   # overlaps
          {"ph": "X", "cat": "kernel", "name": "softmax", "ts": 70, "dur": 10},
          {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD", "ts": 190, "dur": 10},
          {"ph": "i", "cat": "kernel", "name": "marker", "ts": 500}]            # no duration
    (tmp_path / "t.json").write_text(json.dumps({"traceEvents": ev}))
    pr = bench_module("gpu_throughput").device_profile(tmp_path / "t.json")
    assert pr["window_s"] == 200e-6 and pr["device_busy_s"] == 60e-6
    assert pr["device_busy_share"] == 0.3 and pr["device_events"] == 4
    assert [k for k, *_ in pr["top"]] == ["gemm", "softmax", "Memcpy HtoD"]
    assert pr["top"][0][1] == 50e-6
    (tmp_path / "cpu.json").write_text(json.dumps({"traceEvents": ev[:1]}))
    assert bench_module("gpu_throughput").device_profile(tmp_path / "cpu.json") is None
