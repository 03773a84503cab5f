"""Memory model: Korthikanti et al. 2022 activation formulas, ZeRO, pipeline schedules."""

from __future__ import annotations

import pytest

from myria.config import ModelConfig
from myria.models.memory import in_flight_microbatches, layer_activation_bytes
from myria.sim.operators import layer_shape

GPT = ModelConfig(arch="gpt", vocab_size=51200, layers=24, hidden=2048, heads=16, seq_len=2048)


def shape(**kw):
    return layer_shape(GPT, kw.pop("b", 2), dropout=0.1, **kw)


def test_korthikanti_formulas():
    s, b, h, a = 2048, 2, 2048, 16
    sbh = s * b * h
    # no parallelism: sbh (34 + 5 a s / h)
    assert layer_activation_bytes(shape(), "none") == pytest.approx(sbh * (34 + 5 * a * s / h))
    for t in (2, 4, 8):
        # tensor parallel: sbh (10 + 24/t + 5 a s / (h t))
        assert layer_activation_bytes(shape(tp=t), "none") == pytest.approx(
            sbh * (10 + 24 / t + 5 * a * s / (h * t)))
        # tensor + sequence parallel: sbh/t (34 + 5 a s / h)
        assert layer_activation_bytes(shape(tp=t, sp=True), "none") == pytest.approx(
            sbh / t * (34 + 5 * a * s / h))
        # selective recomputation with sequence parallel: 34 sbh / t
        assert layer_activation_bytes(shape(tp=t, sp=True), "selective") == pytest.approx(
            34 * sbh / t)
    # full recomputation: the layer input, 2 sbh
    assert layer_activation_bytes(shape(tp=8), "full") == pytest.approx(2 * sbh)


def test_flash_attention_drops_the_score_matrix():
    plain = layer_activation_bytes(shape(), "none")
    flash = layer_activation_bytes(shape(flash=True), "none")
    assert flash < plain
    assert flash == pytest.approx(layer_activation_bytes(shape(), "selective"), rel=0.01)


def test_in_flight_microbatches():
    assert in_flight_microbatches("gpipe", 4, 1, 16) == 16
    assert in_flight_microbatches("1f1b", 4, 1, 16) == 4
    assert in_flight_microbatches("1f1b", 4, 1, 2) == 2
    assert in_flight_microbatches("interleaved-1f1b", 4, 2, 16) == pytest.approx(
        4 * (1 + 3 / 8))
    assert in_flight_microbatches("1f1b", 1, 1, 16) == 1


def test_model_state_bytes(calibration):
    from myria.sim.perf import simulate

    r = calibration[0]   # 1.7B, pure data parallel: 2 + 4 + 12 bytes per parameter
    res = simulate(r)
    n = res.memory.params_per_device
    assert res.memory.weights == pytest.approx(2 * n)
    assert res.memory.gradients == pytest.approx(4 * n)
    assert res.memory.optimizer == pytest.approx(12 * n)
    z1 = simulate(r.replace(training={"zero_stage": 1}))
    assert z1.memory.optimizer == pytest.approx(12 * n / 32)
    z3 = simulate(r.replace(training={"zero_stage": 3}))
    assert z3.memory.weights == 0   # FSDP2's shards are the fp32 master weights
    assert z3.memory.gradients == pytest.approx(4 * n / 32)
    fp32 = simulate(r.replace(training={"zero_stage": 3, "precision": "fp32"}))
    assert fp32.memory.weights == pytest.approx(4 * n / 32)


def test_model_state_is_what_fsdp2_holds_in_bf16():
    """One process in bf16 trains under FSDP2's mixed precision on a one-rank mesh: the bytes
    of its parameters, gradients and optimizer state after a step are the memory model's
    weights + gradients + optimizer state for that run (16 bytes a parameter, no bf16 copy)."""
    import torch
    import torch.distributed as dist

    from myria import config, device
    from myria.sim.perf import config_run, simulate
    from myria.tensors import local_shard
    from myria.train.engine import Engine

    cfg = config.load(None, ["--model.vocab_size=512", "--model.layers=2", "--model.hidden=64",
                             "--model.heads=4", "--model.kv_heads=2", "--model.seq_len=32",
                             "--training.global_batch=2", "--training.micro_batch=2",
                             "--training.dtype=bfloat16"])
    try:
        e = Engine(cfg, None, torch.device("cpu"))
        x = torch.randint(0, 512, (1, 2, 33), generator=torch.Generator().manual_seed(0))
        e.forward_backward(x[..., :-1], x[..., 1:])
        params = [p for p in e.model.parameters()]
        held = sum(local_shard(t).numel() * local_shard(t).element_size()
                   for p in params for t in (p, p.grad))
        e.step()
        held += sum(local_shard(v).numel() * local_shard(v).element_size()
                    for st in e.optimizers[0].state.values() for v in st.values()
                    if isinstance(v, torch.Tensor) and v.dim() > 0)   # not the step counts
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    assert all(local_shard(p).dtype == torch.float32 for p in params)
    run, spec, _ = config_run(cfg, 1, device.lookup("h100"), 1)
    m = simulate(run).memory
    assert run.training.zero_stage == 3 and run.training.precision != "fp32"
    assert m.weights + m.gradients + m.optimizer == pytest.approx(held, rel=1e-6)


def test_offload_moves_optimizer_to_host(calibration):
    from myria.sim.perf import simulate

    r = calibration[0].replace(training={"zero_stage": 1})
    off = simulate(r.replace(training={"offload": "cpu"}))
    on = simulate(r)
    assert off.memory.optimizer == 0 and off.memory.host_bytes_per_node > 0
    assert off.memory_gb_per_gpu < on.memory_gb_per_gpu
    assert off.breakdown["offload"] > 0 and off.iteration_time_s > on.iteration_time_s


def test_unfitting_layout_flagged(calibration):
    from myria.sim.perf import simulate

    big = calibration[-1].replace(training={"recompute": "none"})   # 1T without recompute
    res = simulate(big)
    assert not res.fits and any("GB per device" in w for w in res.warnings)


# -- the model against measured peaks of myria's own model on this CPU -------------------------
def _measured_peak(cfg, recompute: str, batch: int) -> float:
    """Peak bytes of live tensors during one microbatch's forward and backward of myria's model
    (recomputation applied as the trainer applies it), above what was live before it (weights,
    and the gradients a first microbatch left: gradient accumulation), as torch's memory
    profiler (profile_memory=True) records every allocation and free on the CPU."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from myria.models.transformer import Transformer
    from myria.parallel.parallelize import apply_ac

    torch.manual_seed(0)
    model = Transformer(cfg)
    model.init_weights(0)
    apply_ac(model, recompute)
    x = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len))
    y = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len))
    model(x, y).backward()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        model(x, y).backward()
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    live = peak = 0
    for e in events:
        live += e.nbytes()
        peak = max(peak, live)
    return peak


def _modelled_peak(cfg, recompute: str, batch: int) -> float:
    """The memory model's activations and temporaries for the same single-process run."""
    from myria.models.flops import loss_chunk_rows
    from myria.sim.memory import memory

    sh = layer_shape(cfg, batch, flash=True, fused=False, act_bytes=4, eager=True,
                     ce_chunk=loss_chunk_rows(cfg.vocab_size))
    r = memory(sh, layers=cfg.layers, pp=1, vpp=1, microbatches=2, schedule="1f1b",
               recompute=recompute, zero_stage=0, dp=1, ep=1, precision="fp32",
               offload="none", capacity=1e12, gpus_per_node=1, reserved=0.0,
               fragmentation=0.0)
    return r.activations + r.temporary


# 12 configurations (architecture x recomputation x shape); three run in the quick suite, the
# rest under -m slow (the profiler makes each take seconds on a loaded 2-core machine)
_GRID = [pytest.param(a, r, *shp, marks=() if (a, shp[0]) == ("llama", 64) else pytest.mark.slow)
         for a in ("llama", "gpt") for r in ("none", "selective", "full")
         for shp in ((64, 128, 4, 2), (128, 256, 2, 3))]


@pytest.mark.parametrize("arch, recompute, hidden, seq, batch, layers", _GRID)
def test_activation_model_within_10_percent_of_measured_peak(arch, recompute, hidden, seq,
                                                             batch, layers):
    cfg = ModelConfig(arch=arch, vocab_size=512, layers=layers, hidden=hidden, heads=4,
                      kv_heads=2 if arch == "llama" else 0, seq_len=seq)
    measured = _measured_peak(cfg, recompute, batch)
    assert _modelled_peak(cfg, recompute, batch) == pytest.approx(measured, rel=0.10)
