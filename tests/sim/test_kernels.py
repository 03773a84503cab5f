"""Kernel efficiencies against the published microbenchmarks they come from: attention, and
the memory-bound kernels (norms, RoPE, activations, softmax, loss) fused and eager."""

from __future__ import annotations

import pytest

from myria.sim.calibration import (
    attention_tflops,
    fit_memory_tables,
    kernel_tables,
    memory_kernel_time,
    memory_points,
)
from myria.sim.hardware import KERNEL_LAUNCH_S, MEMORY_EFFICIENCY
from myria.sim.operators import DEFAULT_EFFICIENCY


def _table(direction: str, causal: bool) -> dict:
    return next(t for t in kernel_tables() if t["direction"] == direction
                and t["causal"] == causal)


@pytest.mark.parametrize("direction,causal", [("fwd", True), ("bwd", False)])
def test_flash_attention_rates_follow_flashattention3(direction, causal):
    tab = _table(direction, causal)
    for s, pub in zip(tab["seq"][1:], tab["tflops"]["flash-attention-3"][1:]):
        assert attention_tflops(tab["device"], direction, s, True) == pytest.approx(pub,
                                                                                    rel=0.10)


def test_first_flashattention_runs_at_half_the_second_on_ampere():
    """FlashAttention-2's paper (Dao 2023, section 4.1 and introduction, A100): FA2 is "around
    2x faster" than the first FlashAttention, which reaches 30-50% of peak forward and 25-35%
    backward (the model's half-FA2 curve sits at 26% forward at 2k tokens: the bound allows
    that much below the stated range, no more)."""
    peak = 312.0
    for s in (2048, 8192):
        for d, (lo, hi) in (("fwd", (0.25, 0.50)), ("bwd", (0.20, 0.35))):
            fa1 = attention_tflops("a100-sxm-80gb", d, s, True, version="fa1")
            fa2 = attention_tflops("a100-sxm-80gb", d, s, True, version="fa2")
            assert fa1 == pytest.approx(fa2 / 2, rel=0.01)
            assert lo * peak < fa1 < hi * peak, (s, d, fa1)


def test_unfused_attention_is_priced_from_its_memory_passes_not_fitted():
    causal, plain = _table("fwd", True), _table("fwd", False)
    bwd = _table("bwd", False)
    for i, s in enumerate(causal["seq"][1:5], 1):
        model = attention_tflops(causal["device"], "fwd", s, False)
        # a decoder's unfused forward (scale, causal mask, softmax passes) sits between
        # PyTorch's causal (a materialised mask: more passes) and unmasked attention
        assert 2 * causal["tflops"]["standard"][i] * 0.9 < model < \
            plain["tflops"]["standard"][i] * 1.1
        assert attention_tflops(bwd["device"], "bwd", s, False) == pytest.approx(
            bwd["tflops"]["standard"][i], rel=0.20)
        # and FlashAttention does the causal half at several times the rate
        assert attention_tflops(causal["device"], "fwd", s, True) > 4 * model


# -- memory-bound kernels ------------------------------------------------------------------------
def _pairs() -> list[tuple[dict, dict]]:
    """(fused, eager) published points of the same table and size, outliers left out."""
    pts = [p for p in memory_points() if not p["outlier"]]
    out = []
    for f in pts:
        if f["fused"]:
            out += [(f, e) for e in pts if not e["fused"] and e["source"] == f["source"]
                    and e["size"] == f["size"]]
    return out


def test_memory_efficiencies_are_the_fit_of_the_kernel_tables():
    fit = fit_memory_tables()
    assert MEMORY_EFFICIENCY["fused"] == pytest.approx(fit["fused"], abs=0.005)
    for cls, e in MEMORY_EFFICIENCY["eager"].items():
        assert e == pytest.approx(fit["eager"][cls], abs=0.005), cls
    assert KERNEL_LAUNCH_S == pytest.approx(fit["overhead_eager_s"], abs=0.5e-6)
    # and they are what the model prices datasheet devices with
    assert DEFAULT_EFFICIENCY.mem == MEMORY_EFFICIENCY["fused"]
    assert dict(DEFAULT_EFFICIENCY.mem_eager) == MEMORY_EFFICIENCY["eager"]
    # a fused kernel reaches more of the bandwidth than any class of eager kernels but softmax
    # (PyTorch's own row kernel), and never more than the datasheet
    assert all(e <= MEMORY_EFFICIENCY["fused"] < 1 for e in MEMORY_EFFICIENCY["eager"].values())


def test_model_reproduces_published_fused_over_eager_speedups():
    """At the largest size of each table (bandwidth-bound): the model's speedup of the fused
    kernel over the eager code within 35% of the published one, the median within 10% (the
    worst is RMSNorm: the norm class figure, 0.54, sits below Hugging Face RMSNorm's own 0.65)."""
    largest: dict = {}
    for f, e in _pairs():
        if f["size"] >= largest.get(f["source"], (f, e))[0]["size"]:
            largest[f["source"]] = (f, e)
    errs = []
    for f, e in largest.values():
        published = e["published_s"] / f["published_s"]
        model = memory_kernel_time(e) / memory_kernel_time(f)
        errs.append(abs(model / published - 1))
        assert model == pytest.approx(published, rel=0.35), (f["family"], f["direction"])
    assert len(errs) >= 6
    assert sorted(errs)[len(errs) // 2] < 0.10


def test_fused_never_slower_than_eager_published_and_modelled():
    for f, e in _pairs():
        assert f["published_s"] <= e["published_s"], (f["family"], f["size"])
        assert memory_kernel_time(f) < memory_kernel_time(e), (f["family"], f["size"])


@pytest.mark.parametrize("arch", ["gpt", "llama"])
@pytest.mark.parametrize("tp,sp", [(1, False), (8, True)])
def test_unfused_layer_ops_are_eager_chains_never_faster(arch, tp, sp):
    from myria.config import ModelConfig
    from myria.sim.hardware import build_hardware
    from myria.sim.op_timing import timed_layer_ops
    from myria.sim.operators import layer_shape
    from myria.sim.perf import efficiency_for
    from myria.sim.runspec import ClusterSpec

    hw = build_hardware(ClusterSpec(gpu="a100-sxm-80gb", gpus=8), "bf16")
    cfg = ModelConfig(arch=arch, layers=4, hidden=4096, heads=32, seq_len=2048,
                      vocab_size=32000)
    times = {}
    for fused in (True, False):
        shape = layer_shape(cfg, 2, tp=tp, sp=sp, flash=False, fused=fused, dropout=0.1)
        ops = [o for o in timed_layer_ops(shape, hw.peak_flops, hw.mem_bw, efficiency_for(hw))
               if o.kind == "mem"]
        times[fused] = {o.name: o for o in ops}
        eager = {o.name.removesuffix(".bwd"): o.eager for o in ops if o.eager}
        if fused:
            assert not eager
        else:   # every unfused operator runs as eager kernels of its class, one launch each
            want = {"softmax": "softmax", "attn_residual": "pointwise",
                    "mlp_residual": "pointwise", "attn_norm": "norm", "mlp_norm": "norm",
                    "bias_gelu" if arch == "gpt" else "swiglu": "pointwise"}
            if arch == "llama":
                want["rope"] = "rope"
            assert eager == want
            for o in ops:
                if o.eager:
                    e = dict(efficiency_for(hw).mem_eager)[o.eager]
                    assert o.time == pytest.approx(o.bytes / (hw.mem_bw * e)
                                                   + o.kernels * KERNEL_LAUNCH_S)
                    # torch's LayerNorm is one native kernel each way; the rest are chains
                    assert o.kernels >= (1 if arch == "gpt" and "norm" in o.name else 2)
    for name, op in times[True].items():
        assert op.time <= times[False][name].time, name
    assert sum(o.time for o in times[True].values()) < \
        0.8 * sum(o.time for o in times[False].values())


def test_measured_devices_keep_one_bandwidth_for_eager_kernels():
    """On the CPU (measured figures, E = 1) an eager kernel is priced like any other."""
    from myria.sim.op_timing import op_time
    from myria.sim.operators import MEASURED_EFFICIENCY, Op

    for cls in ("", "norm", "rope", "softmax", "pointwise"):
        op = Op("x", "mem", "fwd", bytes=1e9, eager=cls)
        assert op_time(op, 1.0, 1e10, MEASURED_EFFICIENCY)[0] == pytest.approx(0.1 + 10e-6)
