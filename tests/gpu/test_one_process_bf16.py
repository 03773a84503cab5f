"""One process in bf16 trains through FSDP2's mixed-precision policy, on the CPU and on a GPU.

A lone process has no data-parallel mesh; with `training.dtype = bfloat16` (or `auto` on CUDA)
the engine shards over a one-rank mesh so that FSDP2's policy applies as on N ranks: bf16
parameters and compute inside the blocks, fp32 sharded parameters, fp32 gradients (the
reduction dtype). The CPU case runs in the normal suite; the CUDA case is marked `gpu`.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist


def _engine_step(device: str, dtype: str):
    from myria import config
    from myria.train.engine import Engine

    cfg = config.load(None, ["--model.vocab_size=512", "--model.layers=2", "--model.hidden=64",
                             "--model.heads=4", "--model.kv_heads=2", "--model.seq_len=64",
                             "--training.global_batch=2", "--training.micro_batch=2",
                             f"--training.dtype={dtype}", f"--training.device={device}"])
    try:
        engine = Engine(cfg, None, torch.device(device))
        seen = []
        block = next(iter(engine.model.layers.values()))
        block.attention.wq.register_forward_hook(
            lambda m, i, o: seen.append((m.weight.dtype, o.dtype)))
        g = torch.Generator().manual_seed(0)
        x = torch.randint(0, 512, (1, 2, 64), generator=g).to(device)
        loss = engine.forward_backward(x, x.roll(-1, dims=-1))
        params = list(engine.model.parameters())
        return loss.item(), seen, params
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _check(device: str) -> None:
    from torch.distributed.tensor import DTensor

    loss16, seen16, params16 = _engine_step(device, "bfloat16")
    assert seen16 == [(torch.bfloat16, torch.bfloat16)]           # compute in bf16
    assert all(isinstance(p, DTensor) for p in params16)          # sharded by FSDP2 (one rank)
    assert {p.dtype for p in params16} == {torch.float32}         # fp32 master weights
    assert {p.grad.dtype for p in params16} == {torch.float32}    # fp32 reduction
    loss32, seen32, params32 = _engine_step(device, "float32")
    assert seen32 == [(torch.float32, torch.float32)]
    assert not any(isinstance(p, DTensor) for p in params32)      # fp32: no FSDP on one process
    assert abs(loss16 - loss32) < 0.05 * abs(loss32), (loss16, loss32)


def test_one_cpu_process_in_bf16_uses_fsdp2_mixed_precision():
    _check("cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_one_gpu_in_bf16_uses_fsdp2_mixed_precision():
    _check("cuda")



@pytest.mark.slow
def test_one_cpu_process_in_bf16_resumes_bitwise(tmp_path, tiny_data):
    from tests.conftest import TINY, final_params, losses, run_cli

    def train(d, *extra):
        return run_cli("train", "--run-dir", str(d), f"--data.path={tiny_data}", *TINY,
                       "--training.dtype=bfloat16", "--training.steps=6",
                       "--checkpoint.interval=0", *extra)

    train(tmp_path / "straight")
    train(tmp_path / "resumed", "--stop-after", "3")
    assert "resumed from" in train(tmp_path / "resumed").stdout
    a, b = losses(tmp_path / "straight"), losses(tmp_path / "resumed")
    assert [a[s] for s in range(1, 7)] == [b[s] for s in range(1, 7)]
    pa, pb = final_params(tmp_path / "straight"), final_params(tmp_path / "resumed")
    assert all(torch.equal(pa[k], pb[k]) for k in pa)
