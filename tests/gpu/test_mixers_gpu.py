"""The sub-quadratic mixers and hybrids on a device: each trains in bf16 and tracks fp32, and
each mixer's kernel path agrees with its reference form there.

Tests with a device parameter run their CPU case in the normal suite and their CUDA case
marked `gpu` (bench/gpu/run.sh); the CUDA-only ones run the bodies of CPU tests in tests/models
with device="cuda". On CUDA the mixers' kernel paths differ from the CPU's: block-sparse and
document-masked attention run FlexAttention (forward and backward), linear attention and Gated
DeltaNet run flash-linear-attention's Triton kernels when `fla` imports (bench/gpu/run.sh `fla`
carries it), and the chunked forms of retention, linear attention, Gated DeltaNet, Mamba-2 and
the RG-LRU scan run on cuBLAS.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from tests.gpu.conftest import GPU, gpu_only
from tests.models import test_architectures as arch
from tests.models import test_hybrids as hybrids

DEVICES = ["cpu", pytest.param("cuda", marks=GPU)]
EOS = 3
STEPS = 6
# head_dim 16: FlexAttention's compiled kernels (parallel.compile) need at least 16
BASE = ["--model.vocab_size=256", "--model.layers=2", "--model.hidden=64", "--model.heads=4",
        "--model.kv_heads=2", "--model.seq_len=64", "--model.chunk_size=16",
        "--training.global_batch=4", "--training.micro_batch=2",
        "--optimizer.lr=3e-3", "--optimizer.warmup_steps=0", "--training.seed=0"]
MIXERS = {
    "retnet": ["--model.arch=retnet", "--model.kv_heads=0"],
    "griffin": ["--model.arch=griffin", "--model.block_pattern=RA",
                "--model.attention_window=16"],
    "linear": ["--model.attention=linear"],
    "block_sparse": ["--model.attention=block_sparse", "--model.attention_window=16",
                     "--model.global_tokens=4"],
    "deltanet": ["--model.arch=hybrid", "--model.block_pattern=DA"],
    "mamba2": ["--model.arch=hybrid", "--model.block_pattern=MA", "--model.ssm_state=16"],
    "document_mask": ["--model.document_mask=true", "--model.attention_window=24"],
}


def _batch(device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """One fixed batch [accum 2, micro 2, 64] with EOS every 13 tokens (documents of 12)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randint(EOS + 1, 256, (2, 2, 65), generator=g)
    x[..., ::13] = EOS
    x = x.to(device)
    return x[..., :-1], x[..., 1:]


def train_losses(device: str, dtype: str, overrides: list[str]) -> list[float]:
    """STEPS optimizer steps of one process (myria's Engine: bf16 through FSDP2's mixed
    precision on a one-rank mesh, fp32 without sharding) on one repeated batch."""
    from myria import config
    from myria.train.engine import Engine

    cfg = config.load(None, [*BASE, *overrides, f"--training.dtype={dtype}",
                             f"--training.device={device}"])
    try:
        engine = Engine(cfg, None, torch.device(device), eos_id=EOS)
        x, y = _batch(device)
        out = []
        for _ in range(STEPS):
            out.append(engine.forward_backward(x, y).item())
            engine.clip_grads(1.0)
            engine.step()
        return out
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


@pytest.mark.parametrize("mixer", list(MIXERS))
@pytest.mark.parametrize("device", DEVICES)
def test_mixer_trains_in_bf16_and_tracks_fp32(device, mixer, record_property):
    """Finite losses from about log(256) = 5.5 that fall (memorising one batch), and bf16
    within 0.03 of fp32 at every step, 0.015 on average: ten times the largest difference
    bf16 shows on the CPU (0.007, document masking; 0.003 for the others)."""
    bf16 = train_losses(device, "bfloat16", MIXERS[mixer])
    fp32 = train_losses(device, "float32", MIXERS[mixer])
    diffs = [abs(a - b) for a, b in zip(bf16, fp32)]
    record_property(f"{mixer}_bf16_vs_fp32_max_abs_loss_diff", max(diffs))
    assert all(math.isfinite(v) for v in bf16 + fp32), (bf16, fp32)
    assert abs(fp32[0] - math.log(256)) < 0.5, fp32
    assert bf16[-1] < bf16[0] - 0.8 and fp32[-1] < fp32[0] - 0.8, (bf16, fp32)
    assert max(diffs) < 0.03 and sum(diffs) / len(diffs) < 0.015, (bf16, fp32)


# -- the kernel paths --------------------------------------------------------------------------
@pytest.mark.parametrize("device", DEVICES)
def test_block_sparse_module_equals_masked_dense(device):
    """`BlockSparseAttention` (FlexAttention with a block mask on CUDA; masked or blockwise SDPA
    on CPU) equals dense SDPA under the pattern's boolean mask, output and gradients of q, k, v,
    at a length whose tail is not a whole block. Tolerance 1e-5 in fp32 (1e-4 on CUDA, where
    FlexAttention and SDPA's masked kernel accumulate in different orders)."""
    from myria.models.attention import BlockSparseAttention, block_sparse_mask

    tol = 1e-5 if device == "cpu" else 1e-4
    q, k, v = (t.to(device).requires_grad_(True) for t in arch._qkv(s=150, d=16, kv_heads=2))
    for window, n_global, block in ((16, 4, 16), (40, 0, 32)):
        mask = block_sparse_mask(150, 150, window, n_global, device)
        ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        got = BlockSparseAttention(window, n_global, block)(q, k, v)
        assert torch.allclose(got, ref, atol=tol, rtol=tol), (got - ref).abs().max()
        w = torch.randn_like(ref)
        for a, b in zip(torch.autograd.grad((got * w).sum(), (q, k, v)),
                        torch.autograd.grad((ref * w).sum(), (q, k, v)), strict=True):
            assert torch.allclose(a, b, atol=tol, rtol=tol), (window, (a - b).abs().max())


@gpu_only
@pytest.mark.parametrize("kind", list(hybrids.FORMS))
def test_chunked_forms_equal_recurrence_on_cuda(kind):
    """Gated DeltaNet's and Mamba-2's chunked forms against their recurrences on CUDA: output,
    state and every gradient within 1e-5 in fp32 (the CPU test's body and tolerance)."""
    hybrids.test_chunked_form_equals_recurrence(kind, device="cuda")


@gpu_only
def test_retention_linear_attention_and_scan_forms_agree_on_cuda():
    """Retention's, linear attention's and the RG-LRU scan's forms agree on CUDA within 1e-5 in
    fp32 (the CPU tests' bodies and tolerance)."""
    arch.test_retention_forms_agree(device="cuda")
    arch.test_linear_attention_forms_agree(device="cuda")
    arch.test_rglru_scan_equals_step_by_step(device="cuda")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).abs().max() / b.abs().max())


@gpu_only
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 5e-3), (torch.bfloat16, 3e-2)])
def test_fla_kernels_equal_torch_forms(dtype, tol, record_property):
    """flash-linear-attention's kernels, which the linear-attention and Gated DeltaNet layers
    run on CUDA when `fla` imports, against the torch chunked forms in fp32 on the same input
    values: output and the gradients of every input (q, k, v; the decays and beta) within `tol`
    of the reference's largest magnitude (Triton's dot runs fp32 inputs in TF32: 5e-3; bf16
    inputs and outputs: 3e-2). Skipped where fla does not import."""
    pytest.importorskip("fla.ops.gated_delta_rule")
    from myria.models import deltanet, linear_attention

    xs, _ = hybrids._inputs("deltanet", b=2, h=4, s=100, dk=32, dv=32)
    xs = [x.cuda() for x in xs]
    q, k, v, g, beta = xs
    lin = [linear_attention.feature_map(t, "elu1") for t in (q, k)] + [v]
    cases = {"linear": (linear_attention._fla_chunked, lin,
                        lambda *a: linear_attention.linear_attention_chunked(*a, 16)),
             "deltanet": (deltanet._fla_chunked, xs,
                          lambda *a: deltanet.gated_delta_chunked(*a, 16))}
    for name, (fla, inputs, torch_form) in cases.items():
        # the layers hand fla their inputs in the compute dtype; the reference reads the same
        # (rounded) values in fp32, so only the kernels' own arithmetic differs
        got_in = [t.detach().to(dtype).requires_grad_(True) for t in inputs]
        ref_in = [t.detach().float().requires_grad_(True) for t in got_in]
        ref, got = torch_form(*ref_in), fla(*got_in)
        w = torch.randn_like(ref)
        g_ref = torch.autograd.grad((ref * w).sum(), ref_in)
        g_got = torch.autograd.grad((got.float() * w).sum(), got_in)
        errs = [_rel(got, ref)] + [_rel(a, b) for a, b in zip(g_got, g_ref, strict=True)]
        record_property(f"fla_{name}_{str(dtype)[6:]}_rel_errors", errs)
        assert max(errs) < tol, (name, errs)
