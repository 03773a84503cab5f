"""Every optimisation flag moves the prediction the right way, by a plausible amount."""

from __future__ import annotations

import pytest

from myria.sim import layer_cost
from myria.sim.perf import simulate
from tests.conftest import bench_module


def t(run):
    return simulate(run).iteration_time_s


def mem(run):
    return simulate(run).memory_gb_per_gpu


def speedup(base, other):
    """How much faster `other` is than `base` (> 0: faster)."""
    return t(base) / t(other) - 1


@pytest.mark.parametrize("which", ["tp", "pp", "dp"])
def test_overlap_raises_mfu(llama, gpt39, which):
    for base in (gpt39, llama):
        off = base.replace(overlap={which: False})
        on = base.replace(overlap={which: True})
        gain = speedup(off, on)
        assert 0 < gain < 0.35, (base.name, which, gain)
        assert simulate(on).mfu > simulate(off).mfu


def test_parallel_block_raises_mfu(llama, gpt39):
    for base in (gpt39, llama):
        gain = speedup(base, base.replace(model={"parallel_block": True}))
        assert 0.01 < gain < 0.25, gain   # PaLM reports ~15% at large scale


def test_flash_attention_faster_and_smaller(llama, gpt39):
    for base in (gpt39, llama):
        off = base.replace(kernels={"flash_attention": False},
                           training={"recompute": "none"})
        on = off.replace(kernels={"flash_attention": True})
        assert 0.02 < speedup(off, on) < 0.6
        assert mem(on) < mem(off)


def test_fused_kernels_faster(gpt39, llama):
    for base in (gpt39, llama):
        gain = speedup(base.replace(kernels={"fused_ops": False}), base)
        assert 0 < gain < 0.2


def test_sequence_parallel_saves_memory_and_time(llama):
    off = llama.replace(parallel={"sequence_parallel": False})
    assert mem(llama) < 0.8 * mem(off)
    assert 0 < speedup(off, llama) < 0.2


def test_recompute_ordering(gpt39, llama):
    for base in (gpt39, llama.replace(kernels={"flash_attention": False})):
        runs = {k: base.replace(training={"recompute": k}) for k in ("none", "selective",
                                                                     "full")}
        times = {k: t(r) for k, r in runs.items()}
        mems = {k: mem(r) for k, r in runs.items()}
        assert times["none"] < times["selective"] < times["full"]
        assert mems["none"] > mems["selective"] > mems["full"]
        # full recomputation adds about one forward pass: a third of the compute at most
        assert times["full"] / times["none"] < 1.45
    # hardware FLOP/s counts the recomputation, model FLOP/s does not
    full = simulate(gpt39)
    assert full.hardware_tflops_per_gpu > full.tflops_per_gpu


def test_zero_stages(llama):
    res = {z: simulate(llama.replace(training={"zero_stage": z})) for z in range(4)}
    m = [res[z].memory_gb_per_gpu for z in range(4)]
    # under a pipeline (pp 4) sharded gradients accumulate whole until each stage's last
    # backward (torch.distributed.pipelining): ZeRO-2 keeps what ZeRO-1 keeps (each unit's
    # shard is written as its whole gradient is reduced and freed)
    assert m[0] > m[1] and m[3] < m[1]
    assert m[2] == pytest.approx(m[1], rel=1e-3)
    one = llama.replace(parallel={"pp": 1, "vpp": 1, "schedule": "1f1b"})
    flat = [mem(one.replace(training={"zero_stage": z})) for z in range(4)]
    assert flat[0] > flat[1] > flat[2] > flat[3]
    # ZeRO-1/2 move the same bytes as an all-reduce (less: parameters gather in 16 bits)
    assert res[1].iteration_time_s <= res[0].iteration_time_s * 1.02
    # ZeRO-3 gathers the weights every microbatch: slower, slower still without overlap
    assert res[3].iteration_time_s > res[2].iteration_time_s
    no_ov = llama.replace(training={"zero_stage": 3}, overlap={"dp": False})
    assert t(no_ov) > res[3].iteration_time_s


def test_zero3_memory_shrinks_with_dp(llama):
    base = llama.replace(training={"zero_stage": 3, "global_batch": 4096},
                         parallel={"pp": 1, "vpp": 1, "schedule": "1f1b"})
    mems = [mem(base.replace(cluster={"gpus": g})) for g in (64, 256, 1024)]
    assert mems[0] > mems[1] > mems[2]
    z0 = base.replace(training={"zero_stage": 0})
    assert mem(z0.replace(cluster={"gpus": 64})) == pytest.approx(
        mem(z0.replace(cluster={"gpus": 1024})), rel=0.01)


def test_more_stages_raise_the_bubble(gpt39):
    base = gpt39.replace(parallel={"vpp": 1, "schedule": "1f1b"})
    fr = []
    for pp in (2, 4, 8):
        r = base.replace(parallel={"pp": pp}, cluster={"gpus": 16 * pp * 8},
                         training={"global_batch": 512})
        fr.append(simulate(r).details["bubble_fraction"])
    assert fr[0] < fr[1] < fr[2]
    # at the same layout, fewer microbatches mean a larger bubble share
    small = base.replace(training={"global_batch": 256})
    assert simulate(small).details["bubble_fraction"] > simulate(base).details[
        "bubble_fraction"]


def test_schedules(llama):
    one = llama.replace(parallel={"vpp": 1, "schedule": "1f1b"})
    inter = llama
    zb = llama.replace(parallel={"vpp": 1, "schedule": "zero-bubble"})
    gpipe = llama.replace(parallel={"vpp": 1, "schedule": "gpipe"})
    b = {k: simulate(r).details["bubble_fraction"] for k, r in
         (("1f1b", one), ("inter", inter), ("zb", zb), ("gpipe", gpipe))}
    assert b["inter"] < b["1f1b"] and b["zb"] < b["1f1b"]
    assert b["gpipe"] == pytest.approx(b["1f1b"], rel=1e-6)
    assert mem(gpipe) > mem(one)
    assert t(inter) < t(one) and t(zb) < t(one)


def test_context_parallel_cuts_activation_memory(llama):
    long = llama.replace(model={"seq_len": 32768}, training={"global_batch": 128,
                                                             "recompute": "none"})
    cp = long.replace(parallel={"cp": 4})
    assert simulate(cp).memory.activations < 0.5 * simulate(long).memory.activations


def test_context_parallel_ring_pays_for_cutting_attention(llama):
    """Ring attention hides its K/V exchange by running one FlashAttention kernel per key block
    as it arrives: cp kernels over s/cp keys each, at FlashAttention's lower rate for the
    shorter key length (r s / (s + s_half)) plus a launch each; the charge is what moves the
    step's attention time against the same run without context parallelism."""
    import dataclasses

    from myria.sim import perf
    from myria.sim.op_timing import flash_efficiency, ring_attention_time, timed_layer_ops

    long = llama.replace(model={"seq_len": 8192}, training={"global_batch": 256})
    cp = long.replace(parallel={"cp": 4})
    hw = perf.build_hardware(cp.cluster, cp.training.precision)
    eff = perf.efficiency_for(hw, cp.kernels.flash_version)
    shape = perf.run_shape(cp)
    ops = timed_layer_ops(shape, hw.peak_flops, hw.mem_bw, eff)
    fa = next(o for o in ops if o.name == "flash_attn")
    assert fa.dims[:2] == (2048, 8192)
    assert ring_attention_time(fa, 1, hw.peak_flops, hw.mem_bw, eff) == fa.time
    block = dataclasses.replace(fa, dims=(2048, 2048, fa.dims[2]))
    want = fa.flops / hw.peak_flops * (1 / flash_efficiency(block, eff)
                                       - 1 / flash_efficiency(fa, eff)) \
        + 3 * eff.kernel_overhead_s
    got = ring_attention_time(fa, 4, hw.peak_flops, hw.mem_bw, eff) - fa.time
    assert got == pytest.approx(want, rel=1e-6) and 0.1 * fa.time < got < 0.4 * fa.time
    cut = layer_cost.split_costs(ops, False, shape.tp, hw, eff, shape.cp)
    assert set(cut) == {"flash_attn", "flash_attn.bwd"} and all(v > 0 for v in cut.values())
    assert layer_cost.split_costs(ops, False, shape.tp, hw, eff) == {}
    attn = lambda r: simulate(r).breakdown["compute_attention"]  # noqa: E731
    assert attn(cp) > 1.05 * attn(long)


def test_expert_parallel(llama):
    moe = llama.replace(model={"experts": 8, "top_k": 2})
    res = {ep: simulate(moe.replace(parallel={"ep": ep})) for ep in (1, 2, 8)}
    assert res[1].memory_gb_per_gpu > res[2].memory_gb_per_gpu > res[8].memory_gb_per_gpu
    dense = simulate(llama)
    assert res[8].iteration_time_s > dense.iteration_time_s   # top-2: twice the MLP work
    assert res[8].breakdown["ep_comm_exposed"] > 0


def test_network_fabric_never_helps(llama):
    base = simulate(llama).iteration_time_s
    assert t(llama.replace(cluster={"routing": "ecmp"})) >= base
    over = llama.replace(cluster={"topology": "clos3", "oversubscription": 7.0, "gpus": 8192},
                         training={"global_batch": 8192})
    full = over.replace(cluster={"oversubscription": 1.0})
    assert t(over) >= t(full)


def test_fp8_faster_and_micro_batch_tradeoff(llama):
    assert 0.1 < speedup(llama, llama.replace(training={"precision": "fp8"})) < 1.0
    mb2 = llama.replace(training={"micro_batch": 2})
    assert mem(mb2) > mem(llama)


def test_hopper_gemms_reach_a_smaller_share_of_peak(gpt39):
    from myria.sim.hardware import build_hardware
    from myria.sim.perf import efficiency_for

    a100 = efficiency_for(build_hardware(gpt39.cluster, "bf16"))
    h100_run = gpt39.replace(cluster={"gpu": "h100-sxm-80gb", "nic_gbps": 400})
    h100 = efficiency_for(build_hardware(h100_run.cluster, "bf16"))
    assert h100.gemm == pytest.approx(a100.gemm * 0.801 / 0.859)
    # faster than the A100 run, but by less than the 3.17x of the datasheet peaks
    gain = t(gpt39) / t(h100_run)
    assert 1.8 < gain < 989 / 312


def dp_time(run):
    r = simulate(run)
    return r.breakdown["dp_comm_exposed"]


def test_sharded_data_parallel_memory_and_time_agree(llama):
    """Without a pipeline ZeRO-2's sharded gradients cost a reduce-scatter per microbatch;
    ZeRO-1 keeps whole gradients and reduces once per step: more memory, less traffic. Under a
    pipeline (torch.distributed.pipelining) ZeRO-2 also reduces once per step, after each
    stage's last backward, and keeps whole gradients until then: the same bytes, in FSDP's
    units (one collective per block, each with its latency) instead of Megatron's one bucket."""
    base = llama.replace(overlap={"dp": False}, parallel={"pp": 1, "vpp": 1,
                                                          "schedule": "1f1b"})
    z1, z2 = base.replace(training={"zero_stage": 1}), base.replace(training={"zero_stage": 2})
    assert mem(z2) < mem(z1)
    assert t(z2) > t(z1)  # m reduce-scatters instead of one
    m = z1.microbatches
    assert m >= 8
    # the extra cost is (m - 1) reduce-scatters of the model's fp32 gradients over 128 ranks
    # without overlap: large, but bounded
    assert 0.2 < t(z2) / t(z1) - 1 < 3.0
    piped = base.replace(parallel={"pp": 4})
    p1, p2 = piped.replace(training={"zero_stage": 1}), piped.replace(training={"zero_stage": 2})
    assert dp_time(p1) < dp_time(p2) < 1.05 * dp_time(p1) and mem(p2) >= mem(p1)


def test_fsdp_without_resharding_trades_memory_for_traffic(llama):
    base = llama.replace(overlap={"dp": False}, training={"zero_stage": 3},
                         parallel={"pp": 4, "vpp": 1, "schedule": "1f1b"})
    keep = base.replace(training={"reshard_after_forward": False})
    assert t(keep) < t(base)           # one all-gather per step instead of two per microbatch
    assert mem(keep) > mem(base)       # the weights stay whole
    z2 = base.replace(training={"zero_stage": 2})
    assert t(keep) == pytest.approx(t(z2), rel=1e-9)  # the same collectives as ZeRO-2


def test_hsdp_keeps_per_microbatch_traffic_inside_a_server(llama):
    # tp2 x dp512, 8 microbatches: FSDP gathers and scatters 70B over 512 ranks across the
    # fabric 3 times per microbatch; HSDP does it inside each server (4 ranks) and all-reduces
    # a quarter of the gradients across the 128 replicas once per step
    base = llama.replace(overlap={"dp": False}, training={"zero_stage": 3, "global_batch": 4096},
                         parallel={"tp": 2, "pp": 1, "vpp": 1, "schedule": "1f1b"})
    hsdp = base.replace(parallel={"dp_shard": 4})
    assert t(hsdp) < t(base)       # all-gathers and reduce-scatters over NVLink, not the NICs
    assert mem(hsdp) > mem(base)   # a shard is 1/4 of the model, not 1/512
    r = simulate(hsdp)
    assert r.layout["dp_shard"] == 4
    # with one microbatch per step the replica all-reduce is not paid back
    one = dict(training={"global_batch": 512})
    assert t(hsdp.replace(**one)) > t(base.replace(**one))
    with pytest.raises(Exception, match="dp_shard"):
        base.replace(parallel={"dp_shard": 7})


def test_megascale_optimisation_ladder_each_step_raises_mfu_plausibly():
    """MegaScale's ablation (Jiang et al. 2024, section 3), priced by `bench/sim_ladder.py`:
    its 175B layout on 256 A100 (tp8 pp8 vpp6 dp4, sequence parallel, ZeRO-1, 64 microbatches)
    from Megatron-LM (the first FlashAttention, nothing recomputed, unfused elementwise
    kernels, no overlap, a synchronous batch fetch per microbatch), switching on the eight
    techniques one after another. MFU counts the baseline model's FLOPs at every step, as an
    ablation does. The bounds (points of MFU) come from what each step can remove, not from
    MegaScale's figures:

    - parallel block: one TP collective pair per layer instead of two, one norm and one
      residual fewer (PaLM: ~15% faster at scale): 0.5-10;
    - sliding window of 512 keys per query over 2048 tokens (448 keys on average against the
      causal 1024): removes 56% of the causal attention blocks, forward and backward, and
      attention is 2-4% of this model's step (s / 6h FLOPs, at FlashAttention-1's rate):
      0.3-2 (FlashAttention's local mode skips the blocks);
    - TP overlap: hides most of the tp8 collectives (~4% of this step after the parallel
      block) but cuts the GEMMs they pipeline against into pieces (8 of 256 rows for the
      ring-exchanged all-gathers, FC1's and FC2's data gradient's, as MegaScale's Figure 3b
      fuses them with the FFN's GEMMs only; 4 for the forward reduce-scatter), each at the
      roofline's lower efficiency for a short dimension (up to ~10% slower by the shape
      factor): -3-10,
      the GEMMs' time rising and the exposed TP time falling;
    - PP overlap: one activation (6 MB with SP) per chunk boundary and microbatch, ~0.3 ms at
      25 GB/s against ~100 ms of compute per chunk, and the bundled blocking exchanges' wait
      for the slower neighbour (each operation spread by the assumed 1%: ~0.8% of the compute
      around a ring of 8 stages): 0.3-2;
    - DP overlap: the ZeRO-1 reduce-scatter and all-gather of 2.7B parameters per GPU over 4
      replicas, ~0.5 s of a ~13 s step, hidden behind the other chunks' work: 0.2-5;
    - efficient operators (FlashAttention-2 for the first FlashAttention, fused norm, GELU,
      bias-dropout-add): FlashAttention-2 halves the attention kernels' time (its paper's "around
      2x" on the A100), the memory-bound kernels are 2-3% of the step and fusion removes their
      extra passes and launches: 0.1-3;
    - misc (MegaScale 6.1: the data pipeline and the code whose time fluctuates per rank): the
      synchronous fetch is ~0.1 ms per microbatch against ~200 ms of compute, and the wait for
      the slowest of 256 ranks at the assumed 1% spread is ~2.6% of the step: 0.5-3, with no
      wait left;
    - LAMB with a 3x batch: 192 instead of 64 microbatches shrink the bubble (p-1)/(vm) from 1.8%
      to 0.6% and the DP traffic per token to a third: 1-10.

    Every other gain is positive and the whole ladder stays under the GEMM ceiling E_GEMM."""
    from myria.sim.operators import DEFAULT_EFFICIENCY

    bench = bench_module("sim_ladder")
    bounds = {"parallel block": (0.5, 10), "sliding window": (0.3, 2),
              "tp overlap": (-3, 10), "pp overlap": (0.3, 2), "dp overlap": (0.2, 5),
              "efficient operators": (0.1, 3), "misc": (0.5, 3),
              "lamb 3x batch": (1, 10)}
    rows = bench.ladder()
    assert [r["step"] for r in rows[1:]] == list(bounds)
    for r in rows[1:]:
        lo, hi = bounds[r["step"]]
        assert lo < r["gain_points"] < hi, (r["step"], r["gain_points"])
    assert 5 < 100 * (rows[-1]["mfu"] - rows[0]["mfu"]) < 25
    assert rows[-1]["mfu"] < DEFAULT_EFFICIENCY.gemm
    sec = lambda r, k: r["breakdown"][k] * r["iteration_time_s"]  # noqa: E731
    # Megatron's FlashAttention path recomputes nothing under selective recomputation
    assert "recompute" not in rows[0]["breakdown"]
    # sliding window: the attention kernels fall as the keys per query
    before, after = rows[1], rows[2]
    assert 0.40 < sec(after, "compute_attention") / sec(before, "compute_attention") < 0.48
    # TP overlap: the cut GEMMs take longer, the exposed TP collectives less
    before, after = rows[2], rows[3]
    assert sec(after, "compute_gemm") > 1.03 * sec(before, "compute_gemm")
    assert sec(after, "tp_comm_exposed") < 0.5 * sec(before, "tp_comm_exposed")
    assert rows[6]["breakdown"]["sync_wait"] > 0.02 and "sync_wait" not in rows[7]["breakdown"]
    # efficient operators: the memory-bound time the fused kernels remove, and FlashAttention-2
    # at twice the first one's rate on the same blocks
    before, after = rows[5], rows[6]
    assert sec(after, "compute_memory_bound") < sec(before, "compute_memory_bound")
    assert 0.45 < sec(after, "compute_attention") / sec(before, "compute_attention") < 0.6


def test_the_ladder_takes_a_measured_gemm_half_dimension():
    """`bench/sim_ladder.py --half-dim H` prices every rung with a device's GEMM_HALF_DIM (from
    bench/gpu_gemm_shapes.py) in place of the prior: with none, cutting the TP GEMMs into
    pieces costs only their launches and weight rereads, so the TP-overlap rung gains more."""
    bench = bench_module("sim_ladder")
    tp = lambda rows: next(r for r in rows if r["step"] == "tp overlap")  # noqa: E731
    prior, none = bench.ladder(), bench.ladder(half_dim=0.0)
    assert tp(none)["gain_points"] > tp(prior)["gain_points"] + 1.0
    sec = lambda r: r["breakdown"]["compute_gemm"] * r["iteration_time_s"]  # noqa: E731
    i = [r["step"] for r in none].index("tp overlap")
    assert sec(none[i]) < 1.02 * sec(none[i - 1])
    assert bench.ladder(half_dim=32.0) == prior   # the prior's value: the same ladder


def test_tp_overlap_pays_for_cutting_its_gemms(llama):
    """Pipelining a TP collective against a GEMM cuts the GEMM into pieces along its tokens:
    each piece runs at the roofline's efficiency for its shorter dimension, rereads the weight
    and pays a launch. As TransformerEngine's overlap runs by default: the all-gathers by ring
    exchange (tp pieces of the forward GEMM they feed, of the data-gradient GEMM in backward),
    the forward reduce-scatter pipelined in 4 pieces, the backward reduce-scatter of the input
    gradient in bulk beside the weight-gradient GEMM (nothing cut). A forward or data-gradient
    GEMM is cut along M, a weight gradient along K; with overlap.tp off (or tp = 1) nothing is
    cut, and the charge is what moves the step."""
    from myria.sim import perf
    from myria.sim.op_timing import shape_factor, split_gemm_time, timed_layer_ops
    from myria.sim.operators import DEFAULT_EFFICIENCY as eff

    run = llama.replace(overlap={"tp": True})
    hw = perf.build_hardware(run.cluster, run.training.precision)
    shape = perf.run_shape(run)
    ops = timed_layer_ops(shape, hw.peak_flops, hw.mem_bw, eff)
    gemms = {o.name: o for o in ops if o.kind == "gemm"}
    big = gemms["fc1"]                                   # 4,096 x 7,168 x 8,192 per rank
    assert split_gemm_time(big, 1, hw.peak_flops, hw.mem_bw, eff) == big.time
    m, n, k = big.dims
    compute = big.flops / (hw.peak_flops * eff.gemm)
    want = (compute / shape_factor((m / 8, n, k), eff.half_dim)
            - compute / shape_factor((m, n, k), eff.half_dim) + 7 * eff.kernel_overhead_s)
    got = split_gemm_time(big, 8, hw.peak_flops, hw.mem_bw, eff) - big.time
    assert got == pytest.approx(want, rel=1e-6) and 0.02 * big.time < got < 0.15 * big.time
    wg = gemms["fc1.wgrad"]                              # its tokens are the reduction dim
    assert split_gemm_time(wg, 8, hw.peak_flops, hw.mem_bw, eff) > wg.time
    # only the GEMMs a chunked TP collective pipelines against pay, and only with overlap.tp
    cut = layer_cost.split_costs(ops, True, shape.tp, hw, eff)
    assert set(cut) == {"qkv", "fc1", "attn_out", "fc2", "attn_out.dgrad", "fc2.dgrad"}
    assert cut["fc2"] == pytest.approx(split_gemm_time(gemms["fc2"], 4, hw.peak_flops,
                                                       hw.mem_bw, eff) - gemms["fc2"].time)
    assert cut["fc1"] == pytest.approx(got)
    assert all(v > 0 for v in cut.values())
    assert layer_cost.split_costs(ops, False, shape.tp, hw, eff) == {}
    assert layer_cost.split_costs(ops, True, 1, hw, eff) == {}
    # the ring exchange moves its chunks by copy engine (TransformerEngine: num_sm 1, use_ce):
    # what it hides slows the GEMM by one SM's share, not by NCCL's 16 channels'
    from myria.sim.collectives import layout_groups
    from myria.sim.hardware import SM_COUNT
    from myria.sim.overlap import overlap_interference

    grp = layout_groups(hw, shape.tp, 1, 1, run.dp, run.parallel.pp)["tp"]
    sms = SM_COUNT[hw.device]
    assert overlap_interference(hw, 0.0, grp, 1) == pytest.approx(1 / (sms - 1))
    assert overlap_interference(hw, 0.0, grp) == pytest.approx(16 / (sms - 16))
    # the parallel block (MegaScale, section 3.2, Figure 3b): one gather feeds both branches and
    # is pipelined against the FFN's GEMM only; QKV reads the gathered input whole
    block = perf.run_shape(run.replace(model={"parallel_block": True}))
    ops_b = timed_layer_ops(block, hw.peak_flops, hw.mem_bw, eff)
    assert set(layer_cost.split_costs(ops_b, True, block.tp, hw, eff)) == \
        {"fc1", "fc2", "fc2.dgrad"}
    assert {o.pair for o in ops_b if o.name.startswith("block_in.")} == \
        {"fc1", "fc1.wgrad", "fc1.dgrad"}
    on, off = simulate(run), simulate(llama)
    assert on.breakdown["compute_gemm"] > off.breakdown["compute_gemm"]


def test_megatron_hides_the_input_gradient_reduce_scatter_beside_wgrad(llama):
    """Megatron-LM's sequence-parallel linear (LinearWithGradAccumulationAndAsyncCommunication,
    also in the commit MegaScale names as its baseline) launches the input gradient's
    reduce-scatter asynchronously and computes the weight gradient while it runs, overlap.tp or
    not. Without overlap.tp a layer exposes its four forward collectives and the two
    output-gradient all-gathers; the two reduce-scatters (and the recomputed input gathers
    beside the data gradients) cost only their interference."""
    from myria.sim import perf
    from myria.sim.collectives import COLLECTIVES, layout_groups
    from myria.sim.op_timing import timed_layer_ops
    from myria.sim.operators import DEFAULT_EFFICIENCY as eff

    hw = perf.build_hardware(llama.cluster, llama.training.precision)
    shape = perf.run_shape(llama)
    assert shape.sp and shape.tp > 1 and not llama.overlap.tp
    ops = timed_layer_ops(shape, hw.peak_flops, hw.mem_bw, eff)
    groups = layout_groups(hw, shape.tp, 1, 1, llama.dp, llama.parallel.pp)
    t = {o.name: COLLECTIVES[o.coll](o.bytes, groups["tp"])[0] for o in ops if o.group == "tp"}
    hidden = {n for n in t if n.endswith(".rs.bwd") or n in ("qkv.ag.bwd", "fc1.ag.bwd")}
    assert len(t) == 10 and len(hidden) == 4
    ph = layer_cost.sum_ops(ops, False, shape.tp, 1, groups, hw)
    paid = ph.fwd_cat["tp"] + ph.bwd_cat["tp"]
    exposed = sum(v for n, v in t.items() if n not in hidden)
    assert exposed < paid < exposed + 0.3 * sum(t[n] for n in hidden)


@pytest.mark.parametrize("p, v, m", [(4, 1, 8), (4, 2, 16)])
def test_blocking_pipeline_sends_cost_no_more_than_the_model_charges(p, v, m):
    """Without overlap.pp the model charges 2 v transfers per microbatch and stage. Megatron's
    blocking, bundled exchanges (every send waits for its receiver), replayed in its own order
    (bench/sim_pp_exchange.py): without transfers the replay is the closed form exactly; with
    them it never ends later than the model's charge: with equal, fixed operation times the
    coupling of the ranks costs nothing (with spread times it does: the next test)."""
    bench = bench_module("sim_pp_exchange")
    assert bench.blocking_pipeline_time(p, v, m, 1.0, 2.0, 0.0) == pytest.approx(
        bench.closed_form(p, v, m, 1.0, 2.0, 0.0))
    for tx in (0.004, 0.02):
        replay = bench.blocking_pipeline_time(p, v, m, 1.0, 2.0, tx)
        assert bench.closed_form(p, v, m, 1.0, 2.0, 0.0) < replay <= \
            bench.closed_form(p, v, m, 1.0, 2.0, tx) * (1 + 1e-9)


def test_blocking_pipeline_exchanges_wait_for_the_slower_neighbour():
    """Megatron's bundled, blocking exchanges end only when both neighbours have posted theirs.
    With every operation's time spread independently (the rank-jitter prior, 1% of itself) an
    interleaved pipeline moves in lockstep around its ring of stages and loses
    `lockstep_rate`(pp) x sigma x sqrt(F^2 + B^2) per microbatch (`overlap.exchange_wait`).
    The replay of Megatron's order (bench/sim_pp_exchange.py) loses that much more than the
    same order with asynchronous sends, which loses a tenth of it; the model charges the wait
    only without overlap.pp, only interleaved, only with a spread."""
    import math

    from myria.sim import perf
    from myria.sim.overlap import exchange_wait, lockstep_rate

    assert lockstep_rate(2) == pytest.approx(1 / math.sqrt(math.pi), rel=0.03)
    assert lockstep_rate(3) == pytest.approx(1.5 / math.sqrt(math.pi), rel=0.03)
    assert lockstep_rate(4) < lockstep_rate(16) < 1.2
    coupled, alone = bench_module("sim_pp_exchange").spread_cost(4, 2, 16, draws=4)
    want = 0.01 * lockstep_rate(4) * math.hypot(1.0, 2.0)
    assert 0.8 * want < coupled < 1.2 * want and alone < 0.2 * coupled
    run = bench_module("sim_ladder").baseline()              # tp8 pp8 vpp6, no overlap, 1% spread
    hw = perf.build_hardware(run.cluster, run.training.precision)
    s = perf._step_context(run, hw, perf.efficiency_for(hw, run.kernels.flash_version))
    mid = perf._stages(s)["mid"]
    wait = exchange_wait(hw, mid["F"], mid["B"], 8, 6)
    assert wait == pytest.approx(0.01 * lockstep_rate(8) * math.hypot(mid["F"], mid["B"]))
    assert mid["steady"] - mid["C"] - 2 * 6 * s.t_p2p == pytest.approx(wait)
    assert 0.005 < wait / mid["C"] < 0.01
    exposed = lambda r: simulate(r).breakdown["pp_p2p_exposed"]  # noqa: E731
    base = exposed(run)
    for other in ({"overlap": {"pp": True}}, {"cluster": {"rank_jitter": 0.0}}):
        assert exposed(run.replace(**other)) < base - 0.9 * s.m * wait
    assert exchange_wait(hw, mid["F"], mid["B"], 8, 1) == 0.0


def test_interleaved_chunks_reduce_as_each_becomes_final():
    """Overlapped gradient reduction of an interleaved pipeline, chunk by chunk: Megatron's
    order ends with groups of pp backwards per chunk (chunk v-1 first), so chunk j >= 1 is
    final j x G before the backward ends (G = pp backwards of one chunk) and its share queues
    on one stream; chunk 0's buckets follow behind its own last backward. The exposed time is
    that queue's, replayed here, and small shares hide entirely."""
    from myria.sim.overlap import Buckets, buckets_exposed, grad_reduce_exposed

    pp, v, bwd = 8, 6, 0.6                      # G = 0.8 s
    for total in (1.2, 6.0, 12.0):
        b = Buckets(total, total / 60, 60)
        own = b.scaled(1 / v)
        share = (total - own.total) / (v - 1)
        end = -1e9                               # the stream, relative to the backward's end
        for j in range(v - 1, 0, -1):
            end = max(end, -j * pp * bwd / v) + share
        want = max(0.0, end) + buckets_exposed(own, bwd / v)
        assert grad_reduce_exposed(b, bwd, pp, v) == pytest.approx(want)
    small = Buckets(1.2, 0.02, 60)
    assert grad_reduce_exposed(small, bwd, pp, v) == buckets_exposed(small.scaled(1 / v), 0.1)
    assert grad_reduce_exposed(small, bwd, 1, 1) == buckets_exposed(small, bwd)


def test_data_parallel_buckets_pay_their_latency_and_the_last_is_exposed():
    """Gradient reduction priced bucket by bucket, as Megatron-Core and FSDP run it: each bucket
    its own collective (latency), the last exposed after backward, gradients hidden behind
    backward only. MegaScale's 175B on 12,288 A100 as `myria plan` prices it: tp8 without a
    pipeline, ZeRO-2, micro-batch 4 (one microbatch per step) cannot hide its reduce-scatter
    over 1,536 ranks behind one backward, and falls below the published tp8 pp8 layout."""
    import argparse

    from myria.sim import collectives as coll
    from myria.sim.cli_plan import _base_from_args, add_arguments, expert_commands
    from myria.sim.hardware import build_hardware
    from myria.sim.overlap import Buckets, bucketed, buckets_exposed, dp_bucket_params

    assert dp_bucket_params(8) == 40e6 and dp_bucket_params(1536) == 1.536e9
    cmd = {r["name"]: r for r in expert_commands()}["megascale-175b"]
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    base = _base_from_args(parser.parse_args(cmd["argv"]))
    hw = build_hardware(base.cluster, "bf16")
    grp = coll.make_group(hw, 1536, 8)
    whole = coll.reduce_scatter(22e9 * 4, grp)[0]
    one = bucketed(coll.reduce_scatter, 22e9, 4, grp, float("inf"))
    many = bucketed(coll.reduce_scatter, 22e9, 4, grp, 40e6)
    assert one.total == pytest.approx(whole) and one.n == 1
    assert many.n == 550 and many.total > 1.2 * whole      # 550 latencies of 1,536 ranks
    b = Buckets(10.0, 0.5, 20)
    assert buckets_exposed(b, 1e9) == 0.5 and buckets_exposed(b, 0.0) == 10.0
    assert buckets_exposed(b, 5.0) == pytest.approx(10.0 - 5.0 * 19 / 20)
    z2 = simulate(base.replace(
        parallel={"tp": 8, "pp": 1, "vpp": 1, "sequence_parallel": True, "schedule": "1f1b"},
        training={"micro_batch": 4, "zero_stage": 2, "recompute": "elementwise"}))
    pub = simulate(base.replace(
        parallel={"tp": 8, "pp": 8, "vpp": 2, "sequence_parallel": True,
                  "schedule": "interleaved-1f1b"},
        training={"micro_batch": 1, "zero_stage": 1, "recompute": "selective"}))
    assert z2.layout["microbatches"] == 1
    assert z2.breakdown["dp_comm_exposed"] > 0.2 * z2.iteration_time_s
    assert z2.mfu < 0.9 * pub.mfu


def test_the_slowest_rank_with_a_straggler_tail_matches_sampling_and_grows_with_the_ranks():
    """E[max] of n ranks' jitter: without a tail the normal law's; with one, what seeded
    sampling of the same law gives (within 3 standard errors), and it grows with n faster than
    the normal core does."""
    import numpy as np

    from myria.sim.overlap import expected_max_jitter, expected_max_normal

    assert expected_max_jitter(64) == expected_max_normal(64)
    rng = np.random.default_rng(0)
    for n, share, excess in ((4, 0.05, 2.7), (256, 0.01, 3.0)):
        z = rng.standard_normal((4000, n)) + \
            (rng.random((4000, n)) < share) * rng.exponential(excess, (4000, n))
        top = z.max(axis=1)
        assert abs(expected_max_jitter(n, share, excess) - top.mean()) < 3 * top.std() / 63
    grow = expected_max_jitter(16384, 0.01, 3.0) - expected_max_jitter(64, 0.01, 3.0)
    assert grow > 2 * (expected_max_normal(16384) - expected_max_normal(64))


def test_checkpoint_stall_is_a_share_of_the_checkpoint_whatever_the_zero_stage(llama):
    """Each device snapshots its share of the checkpoint: ZeRO 1's whole 16-bit copy on every
    data-parallel rank is saved once (DCP deduplicates replicated tensors), so its stall is
    not many times ZeRO 3's; no rank snapshots more than it holds."""
    from myria.sim.hardware import build_hardware
    from myria.sim.reliability import run_ettr

    stall = {}
    for z in (1, 3):
        run = llama.replace(training={"zero_stage": z})
        res = simulate(run)
        hw = build_hardware(run.cluster, run.training.precision)
        stall[z] = run_ettr(res, run, hw).stall_s
    assert 0 < stall[3] <= stall[1] <= 1.25 * stall[3], stall
