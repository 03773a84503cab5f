"""Trustworthy self-measurement: the CPU peak is a core's, measured once on its own CPU time and
pinned; other measured figures are the best of several probes, raised and never lowered,
labelled with their samples; a throughput below its own
history is re-measured, then judged against peers first and becomes a warning (never a fault)
when every peer reads as low; golden tests catch a wrong GEMM."""

from __future__ import annotations

import pytest
import torch

from myria import device
from myria.resilience.checks import expected as ex
from myria.resilience.checks.golden import check_golden
from myria.resilience.checks.hooks import parse_faults
from myria.resilience.checks.report import Check, HostReport


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MYRIA_CACHE", str(tmp_path))
    return tmp_path


def _probes(*values):
    it = iter(values)
    return lambda: next(it)


def test_a_peak_measured_on_a_busy_host_is_raised_and_never_lowered(cache):
    busy = device.measured_figure("x", 2, _probes(0.05, 0.048, 0.049))
    assert busy.value == 0.05 and len(busy.samples) == 3
    assert f"the best probe ever, at {busy.measured_at}; the last 3 kept since" in busy.source
    assert "2 threads" in busy.source
    # Cached: no probe runs without refresh.
    assert device.measured_figure("x", 2, _probes()).value == 0.05
    quiet = device.measured_figure("x", 2, _probes(0.15, 0.16, 0.14), refresh=True)
    assert quiet.value == 0.16 and len(quiet.samples) == 6
    busy_again = device.measured_figure("x", 2, _probes(0.04, 0.05, 0.03), refresh=True)
    assert busy_again.value == 0.16                    # a lower probe never lowers it
    assert [s[1] for s in busy_again.samples][-3:] == [0.04, 0.05, 0.03]   # but is kept


def test_history_is_bounded(cache):
    for i in range(30):
        fig = device.measured_figure("z", 1, _probes(float(i)), refresh=True, probes=1)
    assert len(fig.samples) == device.HISTORY and fig.value == 29.0
    # a best older than the kept samples is said to be: not "best of the last N since T"
    entry = device._load_figures()[device.cpu_key(1)]["z"]
    entry["best"], entry["best_at"] = 99.0, "2020-01-01T00:00:00"
    device._save_figures({device.cpu_key(1): {"z": entry}})
    old = device.measured_figure("z", 1, _probes())
    assert old.value == 99.0 and old.source.endswith(
        f"the best probe ever, at 2020-01-01T00:00:00; the last {device.HISTORY} kept since "
        f"{old.samples[0][0]})"), old.source


def test_cache_follows_myria_cache_then_xdg(monkeypatch, tmp_path):
    monkeypatch.delenv("MYRIA_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert device.cache_dir() == tmp_path / "xdg" / "myria"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/xdg")   # invalid by the spec: ignored
    assert device.cache_dir() == device.Path.home() / ".cache" / "myria"
    monkeypatch.setenv("MYRIA_CACHE", str(tmp_path / "own"))
    assert device.cache_dir() == tmp_path / "own"


def test_cpu_peak_is_a_pinned_core_peak_times_threads(cache, monkeypatch):
    """Measured once (a real measurement: a high quantile of one-thread calls on CPU time),
    then re-used without measuring; every thread count is threads x the same core figure."""
    one = device.cpu_device_spec(threads=1)
    # the performance model knows it for a spec measured here, at its threads
    from myria.sim.perf import measured_here

    assert device.measured_threads(one.source) == 1 and measured_here(one)
    assert device.measured_threads(device.cpu_device_spec(threads=2).source) == 2
    hand = device.DeviceSpec("cpu", 0.2, 0.2, 16.0, 20.0, 0.0, source="measured (test)")
    assert device.measured_threads(hand.source) is None and not measured_here(hand)
    entry = device._load_figures()[device.cpu_key(1)][device.CORE_PEAK]
    q10, q50, q90 = entry["q10_q50_q90"]
    assert entry["calls"] >= 600 and 0 < q10 <= q50 <= q90 <= one.peak_fp32_tflops
    assert entry["rounds"][-1] == one.peak_fp32_tflops

    def refuse(*a, **k):
        raise AssertionError("a pinned peak is not measured again")
    monkeypatch.setattr(device, "core_matmul_rates", refuse)
    assert device.cpu_device_spec(threads=2).peak_fp32_tflops == 2 * one.peak_fp32_tflops
    assert device.local_peak_tflops("cpu", "float32")[0] == \
        torch.get_num_threads() * one.peak_fp32_tflops
    # `myria doctor --refresh` measures again and replaces it
    monkeypatch.setattr(device, "core_matmul_rates", lambda **k: [0.1] * 5 + [0.2] * 95)
    assert device.cpu_device_spec(threads=2, refresh=True).peak_fp32_tflops == 0.4
    # under load: calls slowed by other processes do not lower the pinned figure, a high
    # quantile of every call once a round no longer moves it
    loaded = iter([0.1, 0.12, 0.09, 0.2, 0.1, 0.11, 0.1])
    monkeypatch.setattr(device, "core_matmul_rates",
                        lambda **k: [next(loaded)] * 97 + [0.3] * 3)
    assert device.cpu_device_spec(threads=1, refresh=True).peak_fp32_tflops == 0.3
    assert device.quantile([1.0, 2.0, 3.0, 4.0, 5.0], 0.9) == pytest.approx(4.6)


def _gemm(rank, measured, expected=1.0, src=ex.OWN_HISTORY + "CPU peak"):
    return ex.throughput_check("gemm-throughput", rank, measured, expected, src, 0.5, "TFLOP/s")


def test_a_measurement_leaves_the_global_random_streams_alone():
    """The first process to need this machine's peak measures it, often a training rank after
    seeding: its random matrices come from a generator of their own, so the run's saved
    generator states do not depend on whether the cache was filled."""
    from myria.resilience.checks.compute import measure_gemm_tflops

    torch.manual_seed(7)
    before = torch.get_rng_state()
    device.core_matmul_rates(n=32, calls=2, warmup_s=0.0)
    device.measure_matmul_tflops(n=32, seconds=0.0)
    measure_gemm_tflops(torch.device("cpu"), "float32", n=32, seconds=0.0, reps=1)
    assert torch.equal(torch.get_rng_state(), before)
    a, b = device.operands(8, torch.float32)
    assert torch.equal(a, device.operands(8, torch.float32)[0]) and not torch.equal(a, b)


def test_remeasure_before_failing():
    first = _gemm(0, 0.3)
    assert first.status == "fail"
    again = ex.remeasure(first, _probes(0.2, 0.8), pause_s=0)
    assert again.status == "pass" and again.details["samples"] == [0.3, 0.2, 0.8]
    assert ex.remeasure(_gemm(0, 0.9), _probes(), pause_s=0).status == "pass"   # no re-run


def test_peers_first_own_history_second(monkeypatch):
    quiet = {"load_average": [0.5, 0.4, 0.3], "cores": 2}
    monkeypatch.setattr(ex, "host_load", lambda: quiet)
    # One rank far below its peers: a fault of that rank.
    odd = ex.judge([_gemm(0, 0.2), _gemm(1, 0.9), _gemm(2, 0.85)])
    assert [c.status for c in odd] == ["fail", "pass", "pass"]
    assert "odd one out" in odd[0].reason and odd[0].details["peers"] == [0.9, 0.85]
    # The same on an oversubscribed host (more runnable processes than cores): the ranks were
    # measured at different moments of a varying load, not comparable: a warning
    crowded = ex.judge([_gemm(0, 0.2), _gemm(1, 0.9)],
                       load={"load_average": [17.0, 12.0, 9.0], "cores": 2})
    assert [c.status for c in crowded] == ["warn", "pass"]
    assert "not comparable" in crowded[0].reason and "on 2 cores" in crowded[0].reason
    # Every rank as low against its own history: a busy host, a warning with the evidence.
    busy = ex.judge([_gemm(0, 0.3), _gemm(1, 0.35)])
    assert [c.status for c in busy] == ["warn", "warn"]
    assert "load_average" in busy[0].details and "not a fault" in busy[0].reason
    # Nothing to compare with: a warning too.
    alone = ex.judge([Check("memory-bandwidth", "fail", "low", None, 3.0, 10.0, "GB/s",
                            {"expected_source": ex.OWN_HISTORY + "x", "tolerance": 0.5})])
    assert alone[0].status == "warn"
    # A configured or datasheet figure is not this host's history: the failure stands.
    assert ex.judge([_gemm(0, 0.3, src="configured"), _gemm(1, 0.3, src="configured")])[0] \
        .status == "fail"
    report = HostReport("h", 2, "cpu", "gloo", "float32", busy)
    assert report.passed and len(report.warnings) == 2 and "warn" in report.summary


def test_performance_only_failures():
    slow = HostReport("h", 2, "cpu", "gloo", "float32", [_gemm(0, 0.1, src="configured")])
    assert not slow.passed and slow.performance_only
    wrong = HostReport("h", 2, "cpu", "gloo", "float32",
                       [Check("golden", "fail", "wrong", 0)])
    assert not wrong.performance_only


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_golden_answers(dtype):
    cpu = torch.device("cpu")
    assert check_golden(cpu, dtype, rank=0).status == "pass"
    bad = check_golden(cpu, dtype, rank=1, faults=parse_faults("wrong-gemm:rank=1"))
    assert bad.status == "fail" and "integer GEMM" in bad.reason
    assert check_golden(cpu, dtype, rank=0, faults=parse_faults("wrong-gemm:rank=1")) \
        .status == "pass"




def test_the_doctor_raises_a_low_history(cache):
    """A history measured on a busy host (here: absurdly low) is raised by the doctor's own
    measurements; the doctor's GEMM check expects the pinned core peak x threads, which no low
    history lowers (the MFU meter divides by the same figure)."""
    import json

    from myria.resilience import diagnostics as dg

    threads = torch.get_num_threads()
    low = {"best": 1e-6, "best_at": "2026-01-01T00:00:00",
           "samples": [["2026-01-01T00:00:00", 1e-6, 9.0]]}
    core = {"value": 0.02, "quantile": 0.9, "calls": 100, "n": 512,
            "q10_q50_q90": [0.02, 0.02, 0.02], "measured_at": "2026-01-01T00:00:00",
            "loadavg": 0.0}
    (cache / "machine_figures.json").write_text(json.dumps(
        {device.cpu_key(threads): {"fp32_matmul_tflops": low, "membw_gbs": low},
         device.cpu_key(1): {device.CORE_PEAK: core}}))
    report = dg.run_diagnostics(1, timeout_s=60, gemm_seconds=0.2)
    gemm = next(c for c in report.checks if c.name == "gemm-throughput")
    assert gemm.expected == pytest.approx(threads * 0.02) and gemm.status == "pass"
    fig = json.loads((cache / "machine_figures.json").read_text())
    assert fig[device.cpu_key(1)][device.CORE_PEAK]["value"] == 0.02
    fig = fig[device.cpu_key(threads)]
    assert fig["fp32_matmul_tflops"]["best"] >= round(gemm.measured, 6) > 1e-3
    assert fig["membw_gbs"]["best"] > 1e-3 and len(fig["membw_gbs"]["samples"]) == 2
