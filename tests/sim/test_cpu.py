"""The CPU path of the simulator: measured figures in, eager kernels counted, directions right."""

from __future__ import annotations

import dataclasses

import pytest

from myria.config import Config
from myria.device import DeviceSpec
from myria.sim import collectives as coll
from myria.sim.hardware import build_hardware
from myria.sim.measure import cpu, multiproc, profile_summary
from myria.sim.op_timing import measured_rate, op_time, rate_key
from myria.sim.operators import Efficiency, Op, layer_shape
from myria.sim.perf import config_run, efficiency_for, run_shape, simulate_config

HERE = DeviceSpec("cpu", 0.15, 0.15, 16.0, 0.0, 0.0, source="measured (test)")


def demo_config(**over) -> Config:
    cfg = Config()
    m = cfg.model
    m.vocab_size, m.layers, m.hidden, m.heads, m.kv_heads, m.seq_len = 8192, 4, 512, 8, 4, 256
    cfg.training.global_batch, cfg.training.micro_batch = 16, 4
    for k, v in over.items():
        section, key = k.split("__")
        setattr(getattr(cfg, section), key, v)
    return cfg


def synthetic_profile(threads: int = 1, gflops: float = 100.0, bw_gbs: float = 20.0,
                      gloo_gbs: float = 1.0, nproc: int = 2) -> cpu.CpuProfile:
    """A profile with flat GEMM/SDPA rates (a few shapes, the rest interpolated)."""
    rates = tuple(sorted([
        (("nt", 1024, 512, 512), gflops * 1e9), (("nn", 1024, 512, 512), gflops * 1e9),
        (("tn", 512, 512, 1024), gflops * 1e9), (("tna", 8192, 512, 512), gflops * 1e9),
        (("attn-fwd", 32, 256, 256, 64, 2), 0.3 * gflops * 1e9),
        (("attn-bwd", 32, 256, 256, 64, 2), 0.2 * gflops * 1e9),
    ]))
    gloo = (("all_gather", 50e-6, gloo_gbs * 1e9), ("all_reduce", 80e-6, gloo_gbs * 1e9),
            ("p2p", 40e-6, gloo_gbs * 1e9), ("reduce_scatter", 60e-6, gloo_gbs * 1e9))
    return cpu.CpuProfile(threads=threads, rates=rates, elementwise_bw=bw_gbs * 1e9,
                          kernel_overhead_s=2e-6, optimizer_s_per_param=5e-9, nproc=nproc,
                          gloo=gloo if nproc > 1 else ())


@pytest.fixture(autouse=True)
def no_measuring(monkeypatch, tmp_path):
    """Tests never measure this machine (a call would fail) and never touch the real cache."""
    monkeypatch.setenv("MYRIA_CACHE", str(tmp_path))

    def refuse(*a, **k):
        raise AssertionError("a test must not measure the CPU")
    monkeypatch.setattr(cpu, "measure_compute", refuse)
    monkeypatch.setattr(cpu, "run_measurements", refuse)


def test_cpu_hardware_uses_the_measured_figures():
    prof = synthetic_profile()
    run, spec, threads = config_run(demo_config(), 2, HERE)
    assert threads == cpu.default_threads(2) and run.kernels.eager
    hw = build_hardware(run.cluster, run.training.precision, spec=spec, cpu=prof)
    assert hw.cpu is prof and hw.mem_bw == pytest.approx(20e9)
    eff = efficiency_for(hw)
    assert eff.rates == prof.rates and eff.mem == 1.0 and eff.kernel_overhead_s == 2e-6
    # gloo alpha-beta replaces the NVLink model between local processes
    grp = coll.make_group(hw, 2, 1)
    assert coll.allreduce(8.0, grp)[0] == pytest.approx(80e-6, rel=1e-3)
    assert coll.all_gather(1e9, grp) == (pytest.approx(50e-6 + 0.5), "gloo")
    assert coll.p2p(1e6, grp)[0] == pytest.approx(40e-6 + 1e-3)
    # a datasheet GPU never picks up a CPU profile
    gpu = build_hardware(dataclasses.replace(run.cluster, gpu="h100-sxm-80gb", peak_tflops=0.0,
                                             memory_bw_gbs=0.0), "bf16", cpu=prof)
    assert gpu.cpu is None


def test_measured_rate_exact_and_interpolated():
    rates = ((("nt", 1024, 512, 512), 100e9), (("nt", 1024, 2048, 512), 50e9))
    exact = Op("x", "gemm", "fwd", 2 * 1024 * 512 * 512, 0.0, (1024, 512, 512), layout="nt")
    assert measured_rate(exact, rates) == 100e9
    mid = dataclasses.replace(exact, dims=(1024, 1024, 512))
    assert 50e9 < measured_rate(mid, rates) < 100e9
    eff = Efficiency(gemm=1.0, half_dim=0.0, mem=1.0, mem_eager=(), kernel_overhead_s=2e-6,
                     rates=rates)
    t, bound = op_time(exact, 1e12, 1e10, eff)
    assert bound == "compute" and t == pytest.approx(exact.flops / 100e9 + 2e-6)
    # a layout never measured borrows any GEMM's rate; attention keys stay separate
    tn = dataclasses.replace(exact, layout="tn")
    assert measured_rate(tn, rates) == pytest.approx(100e9, rel=0.01)
    attn = Op("sdpa", "attn", "fwd", 1.0, 0.0, (256, 256, 64), batch=32, layout="attn-fwd")
    assert measured_rate(attn, rates) is None
    assert rate_key(attn) == ("attn-fwd", 32, 256, 256, 64, 1)


def test_eager_ops_follow_myria_modules():
    cfg = demo_config()
    shape = layer_shape(cfg.model, 4, flash=True, fused=False, act_bytes=4, eager=True)
    from myria.sim.operators import layer_ops
    ops = layer_ops(shape)
    gemms = [o for o in ops if o.kind == "gemm"]
    # q, k, v, o, w1, w3, w2: one forward and two backward GEMMs each
    assert len(gemms) == 21
    assert {o.layout for o in gemms} == {"nt", "nn", "tn"}
    assert [o.name for o in ops if o.kind == "attn"] == ["sdpa", "sdpa.bwd"]
    # the FLOPs are the model's: 3x the forward of every matmul
    fwd = sum(o.flops for o in gemms if o.phase == "fwd")
    assert sum(o.flops for o in gemms) == pytest.approx(3 * fwd)
    # `myria analyze` tells the host time of a layer from the head's by name, labels it as both
    # passes' time, and the fused loss's gradient GEMMs (run inside the forward) as such
    from myria.sim.cli_analyze import _phase
    from myria.sim.operators import head_ops

    head = head_ops(dataclasses.replace(shape, ce_chunk=64), True, True)
    assert [o.name for o in ops + head if o.kind == "host"] == ["host.block", "host.head"]
    shown = {o.name: _phase({"name": o.name, "phase": o.phase, "kind": o.kind})
             for o in ops + head}
    assert shown["host.block"] == shown["host.head"] == "fwd+bwd"
    assert shown["logits.dgrad"] == shown["logits.wgrad"] == "fwd (grad)"
    assert shown["logits"] == "fwd" and shown["w1.dgrad"] == "bwd"


def test_eager_memory_bytes_match_a_dispatch_trace():
    """The hand-counted bytes of the eager elementwise kernels match what torch dispatches."""
    torch = pytest.importorskip("torch")
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    from myria.models.transformer import build_model
    from myria.sim.operators import layer_ops

    cfg = demo_config()
    cfg.model.hidden, cfg.model.seq_len, cfg.model.vocab_size = 128, 64, 256
    b = 2
    skip = {"view", "t", "transpose", "_unsafe_view", "expand", "detach", "slice", "unsqueeze",
            "select", "alias", "as_strided", "permute", "squeeze", "mm", "addmm",
            "_scaled_dot_product_flash_attention_for_cpu",
            "_scaled_dot_product_flash_attention_for_cpu_backward"}
    counted = [0]

    def nbytes(x):
        return sum(t.numel() * t.element_size() for t in tree_leaves(x)
                   if isinstance(t, torch.Tensor))

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            name = func.overloadpacket.__name__
            if name not in skip:
                counted[0] += nbytes((args, kwargs)) + (0 if name.endswith("_") else nbytes(out))
            return out

    model = build_model(cfg.model, "cpu")
    model.init_weights(0)
    block = model.layers["0"]
    x = torch.randn(b, cfg.model.seq_len, cfg.model.hidden, requires_grad=True)
    rope = model.rope_tables_for(cfg.model.seq_len, torch.float32)
    with Count():
        y = block(x, rope)
    grad = torch.randn_like(y)
    with Count():
        y.backward(grad)
    shape = layer_shape(cfg.model, b, flash=True, fused=False, act_bytes=4, eager=True)
    modelled = sum(o.bytes for o in layer_ops(shape) if o.kind == "mem")
    assert modelled == pytest.approx(counted[0], rel=0.05)


def test_demo_pipeline_uses_myrias_stage_split():
    cfg = demo_config(parallel__pp=2)
    res = simulate_config(cfg, 2, HERE, cpu_profile=synthetic_profile())
    from myria.parallel.pipeline import split_layers
    ranges = split_layers(cfg.model, 2)
    assert [len(r) for r in ranges] == [3, 1]   # the head weighs about a layer and a half
    st = res.details["stage_time_s"]
    assert res.layout["pp"] == 2 and res.layout["microbatches"] == 4
    assert res.breakdown["pp_bubble"] > 0 and st["first"] != st["last"]


def test_directions_on_a_measured_cpu():
    prof1, prof2 = synthetic_profile(threads=1), synthetic_profile(threads=2, gflops=190.0,
                                                                   bw_gbs=30.0, nproc=1)
    demo = demo_config()
    two = simulate_config(demo, 2, HERE, cpu_profile=prof1)
    one = simulate_config(demo, 1, HERE, cpu_profile=prof2)
    assert two.layout["zero_stage"] == 3 and two.breakdown["dp_comm_exposed"] > 0
    assert one.breakdown["dp_comm_exposed"] == 0
    # two processes on one core each beat one process on both cores only if the cores scale
    assert two.iteration_time_s < one.iteration_time_s
    slow_gloo = simulate_config(demo, 2, HERE,
                                cpu_profile=synthetic_profile(threads=1, gloo_gbs=0.1))
    assert slow_gloo.iteration_time_s > two.iteration_time_s
    faster = simulate_config(demo, 2, HERE, cpu_profile=synthetic_profile(gflops=200.0))
    assert faster.iteration_time_s < two.iteration_time_s
    # more microbatches shrink the pipeline bubble's share
    pp4 = simulate_config(demo_config(parallel__pp=2), 2, HERE, cpu_profile=prof1)
    pp8 = simulate_config(demo_config(parallel__pp=2, training__global_batch=32), 2, HERE,
                          cpu_profile=prof1)
    assert pp8.details["bubble_fraction"] < pp4.details["bubble_fraction"]


def test_fused_loss_only_without_pipelining():
    run, _, _ = config_run(demo_config(), 1, HERE)
    assert run_shape(run).ce_chunk == 512          # myria.models.loss: 4M logits per chunk
    run, _, _ = config_run(demo_config(parallel__pp=2), 2, HERE)
    assert run_shape(run).ce_chunk == 0


def test_described_cpu_is_never_measured():
    # the autouse fixture fails any measurement; a hand-described CPU needs none
    spec = DeviceSpec("cpu", 0.2, 0.2, 16.0, 20.0, 0.0, source="measured (test)")
    res = simulate_config(demo_config(), 2, spec)
    assert res.iteration_time_s > 0


def test_profile_cache_round_trip():
    assert cpu.load_profile(1) is None
    entry = {"rates": {"nt,1024,512,512": 1e11}, "elementwise_bw": 2e10,
             "kernel_overhead_s": 1e-6, "optimizer_s_per_param": 4e-9}
    cpu.update_cache(cpu.compute_key(1), entry)
    cpu.update_cache(cpu.compute_key(1), {"rates": {"nn,1024,512,512": 9e10}})
    prof = cpu.load_profile(1)
    assert dict(prof.rates) == {("nn", 1024, 512, 512): 9e10, ("nt", 1024, 512, 512): 1e11}
    cache = cpu.read_cache()
    cache[cpu.gloo_key(1, 2)] = {"fits": {"all_reduce": [1e-4, 1e9]}}
    cpu.write_cache(cache)
    assert cpu.with_gloo(prof, 2).gloo_fit("all_reduce") == (1e-4, 1e9)
    assert cpu.with_gloo(prof, 1).gloo == ()


def test_figures_of_a_busy_host_are_measured_again_once_it_is_quiet(monkeypatch):
    """Figures timed on the wall clock while other jobs held the cores are flagged (an entry
    keeps the worst load average merged into it), priced with a caveat while the host stays
    busy, and measured again, in place of the old ones, the first time the load leaves the
    measurement its cores."""
    key = cpu.compute_key(2)
    shape = layer_shape(demo_config().model, 2)
    base = {"elementwise_bw": 2e10, "kernel_overhead_s": 1e-6, "optimizer_s_per_param": 4e-9,
            "clock": "wall", "threads": 2, "eager_bw": {cpu.eager_key(shape): [1e10, 1e10]}}
    cpu.update_cache(key, {**base, "rates": {"nt,64,64,64": 1e11}, "loadavg": 1.0})
    assert cpu.load_profile(2).busy() == ""
    cpu.update_cache(key, {"rates": {"tn,64,384,256": 4e8}, "loadavg": 6.0})   # a busy moment
    cpu.update_cache(key, {"rates": {"nn,8,8,8": 1e10}, "loadavg": 1.2})       # quiet again
    prof = cpu.load_profile(2)
    assert "load average 6.0" in prof.busy() and "too long" in prof.busy()
    assert cpu.CpuProfile(threads=1, clock="thread CPU time", loadavg=9.0).busy() == ""
    calls = []
    monkeypatch.setattr(cpu, "missing_ops", lambda shape, prof, pp: [])
    monkeypatch.setattr(cpu, "run_measurements",
                        lambda *a, **k: calls.append(k) or cpu.update_cache(
                            key, {**base, "rates": {"nt,64,64,64": 1.1e11}, "loadavg": 1.1},
                            replace=k["replace"]))
    monkeypatch.setattr(cpu, "_loadavg", lambda: 5.0)     # still busy: priced as it is
    assert cpu.profile_for(shape, 2).busy() and calls == []
    # other work holding the cores the measurement needs: still not measured again
    monkeypatch.setattr(cpu, "_loadavg", lambda: cpu.quiet_to_measure(2) + 0.5)
    assert cpu.profile_for(shape, 2).busy() and calls == []
    monkeypatch.setattr(cpu, "_loadavg", lambda: 0.2)     # quiet: measured again, replaced
    prof = cpu.profile_for(shape, 2)
    assert [c["replace"] for c in calls] == [True] and prof.busy() == ""
    rates = dict(prof.rates)
    assert rates[("nt", 64, 64, 64)] == 1.1e11 and ("tn", 64, 384, 256) not in rates


def test_alpha_beta_fit():
    pts = [(x, 1e-4 + x / 2e9) for x in (1e5, 1e6, 1e7)]
    alpha, bw = multiproc.fit_alpha_bw(pts)
    assert alpha == pytest.approx(1e-4, rel=1e-6) and bw == pytest.approx(2e9, rel=1e-6)


def test_fsdp_times_interpolate_the_measured_units():
    prof = dataclasses.replace(synthetic_profile(), fsdp=((1e6, 1e-3, 5e-4, 2e-3),
                                                          (1e7, 5e-3, 3e-3, 1e-2),
                                                          (3e7, 9e-2, 5e-2, 3e-2)))
    assert prof.fsdp_time(1e6, "block") == pytest.approx(1e-3)
    assert prof.fsdp_time(5.5e6, "block") == pytest.approx(3e-3)
    assert prof.fsdp_time(5.5e6, "reduce") == pytest.approx(6e-3)
    assert prof.fsdp_time(4e7, "root") > 5e-2            # extrapolated along the last segment
    assert synthetic_profile().fsdp_time(1e6, "block") is None
    # the FSDP traffic of a step follows the measured unit times
    demo = demo_config()
    base = simulate_config(demo, 2, HERE, cpu_profile=synthetic_profile())
    slow = simulate_config(demo, 2, HERE, cpu_profile=dataclasses.replace(
        synthetic_profile(), fsdp=((1e6, 0.05, 0.05, 0.05), (1e8, 0.5, 0.5, 0.5))))
    assert slow.breakdown["dp_comm_exposed"] > base.breakdown["dp_comm_exposed"] + 0.5


def test_fsdp_measured_around_the_model_prices_the_data_parallel_step():
    prof = dataclasses.replace(synthetic_profile(), fsdp_context=(0.01, 0.02, 0.03, 0.04))
    res = simulate_config(demo_config(), 2, HERE, cpu_profile=prof)
    # 2 microbatches x (4 blocks x 10 ms + ends 30 ms) + one reduce (4 x 20 ms + 40 ms)
    assert res.breakdown["dp_comm_exposed"] == pytest.approx(2 * (0.04 + 0.03) + 0.12)
    # the pipeline (no FSDP there: dp = 1) is unaffected
    pp = simulate_config(demo_config(parallel__pp=2), 2, HERE, cpu_profile=prof)
    assert pp.breakdown["dp_comm_exposed"] == 0


def test_host_time_is_charged_per_block_and_pass():
    rates = synthetic_profile().rates + ((("host", "block"), 0.005), (("host", "head"), 0.02))
    prof = dataclasses.replace(synthetic_profile(), rates=tuple(sorted(rates)))
    base = simulate_config(demo_config(), 1, HERE, cpu_profile=dataclasses.replace(
        synthetic_profile(), nproc=1, gloo=()))
    res = simulate_config(demo_config(), 1, HERE, cpu_profile=dataclasses.replace(
        prof, nproc=1, gloo=()))
    # 4 microbatches x (4 blocks x 5 ms + 20 ms for the ends)
    assert res.breakdown["host_overhead"] == pytest.approx(4 * (4 * 0.005 + 0.02))
    assert res.iteration_time_s - base.iteration_time_s == pytest.approx(0.16)


def test_summary_keeps_the_models_own_figures():
    run, _, _ = config_run(demo_config(), 2, HERE)
    shape = run_shape(run)
    other = (("nt", 4096, 4096, 4096), 1e11)
    prof = dataclasses.replace(synthetic_profile(),
                               rates=tuple(sorted(synthetic_profile().rates + (other,))))
    s = profile_summary.summarize(prof, shape)
    assert "nt,4096,4096,4096" not in s.gemm_gflops and "nt,1024,512,512" in s.gemm_gflops
    assert "nt,4096,4096,4096" in profile_summary.summarize(prof).gemm_gflops


def test_cpu_profile_is_a_leaf_of_the_simulator():
    """`hardware` loads profiles and `operators` reads `hardware`: `cpu_profile` imports neither
    (no circle), nor torch."""
    import subprocess
    import sys

    code = ("import sys, myria.sim.cpu_profile; "
            "print(sorted(m for m in sys.modules if m.startswith(('myria', 'torch'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "['myria', 'myria.sim', 'myria.sim.cpu_profile']"
