"""LAMB against a NumPy reference, and the weight-decay grouping of build_optimizer."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from myria.config import ModelConfig, OptimizerConfig
from myria.models.transformer import build_model
from myria.optim import Lamb, build_optimizer, no_decay, param_groups
from tests.dist import finish, spawn
from tests.dist import init as init_group

SHAPES = [(4, 3), (5,), (2, 3, 2), (3, 3), (2, 2)]


def lamb_reference(params, grads_per_step, lr, betas, eps, wds, max_ratio=None):
    """Textbook LAMB in float64 NumPy; wds[i] is the weight decay of parameter i."""
    b1, b2 = betas
    w = [p.astype(np.float64).copy() for p in params]
    m = [np.zeros_like(x) for x in w]
    v = [np.zeros_like(x) for x in w]
    for t, grads in enumerate(grads_per_step, start=1):
        for i, g in enumerate(grads):
            m[i] = b1 * m[i] + (1 - b1) * g
            v[i] = b2 * v[i] + (1 - b2) * g * g
            mhat = m[i] / (1 - b1 ** t)
            vhat = v[i] / (1 - b2 ** t)
            u = mhat / (np.sqrt(vhat) + eps) + wds[i] * w[i]
            wn, un = np.linalg.norm(w[i]), np.linalg.norm(u)
            r = wn / un if wn > 0 and un > 0 else 1.0
            if max_ratio is not None:
                r = min(r, max_ratio)
            w[i] = w[i] - lr * r * u
    return w


def _problem(steps=5, seed=0):
    """Initial values and per-step gradients; includes zero-norm weights and gradients."""
    rng = np.random.default_rng(seed)
    init = [rng.standard_normal(s) for s in SHAPES]
    init[3][:] = 0.0                      # ||w|| = 0 at the first step -> trust ratio 1
    init[4][:] = 0.0                      # stays 0: zero weight, zero gradient -> ||u|| = 0
    grads = []
    for _ in range(steps):
        gs = [rng.standard_normal(s) for s in SHAPES]
        gs[4][:] = 0.0
        grads.append(gs)
    return init, grads


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-6)])
@pytest.mark.parametrize("max_ratio", [None, 0.5])
def test_lamb_matches_numpy_reference(dtype, tol, max_ratio):
    init, grads = _problem()
    lr, betas, eps = 0.05, (0.9, 0.95), 1e-6
    wds = [0.1, 0.0, 0.1, 0.1, 0.1]
    params = [torch.nn.Parameter(torch.tensor(x, dtype=dtype)) for x in init]
    groups = [{"params": [p for p, wd in zip(params, wds, strict=True) if wd], "weight_decay": 0.1},
              {"params": [p for p, wd in zip(params, wds, strict=True) if not wd],
               "weight_decay": 0.0}]
    opt = Lamb(groups, lr=lr, betas=betas, eps=eps, max_trust_ratio=max_ratio)
    for gs in grads:
        for p, g in zip(params, gs, strict=True):
            p.grad = torch.tensor(g, dtype=dtype)
        opt.step()
    ref = lamb_reference(init, grads, lr, betas, eps, wds, max_ratio)
    for p, r in zip(params, ref, strict=True):
        assert np.isfinite(p.detach().numpy()).all()
        np.testing.assert_allclose(p.detach().double().numpy(), r, rtol=0, atol=tol)
    assert np.abs(ref[3]).max() > 0          # the zero-initialised weight did move
    assert torch.count_nonzero(params[4]) == 0
    assert opt.state[params[0]]["step"].item() == len(grads)


def test_lamb_skips_params_without_grad_and_validates():
    a, b = torch.nn.Parameter(torch.ones(3, 2)), torch.nn.Parameter(torch.ones(2))
    opt = Lamb([a, b], lr=0.1)
    a.grad = torch.ones(3, 2)
    opt.step()
    assert torch.equal(b.detach(), torch.ones(2)) and b not in opt.state
    assert not torch.equal(a.detach(), torch.ones(3, 2))
    with pytest.raises(ValueError, match="betas"):
        Lamb([a], betas=(1.0, 0.9))


def _small_model(**kw):
    cfg = ModelConfig(vocab_size=64, layers=2, hidden=32, heads=4, seq_len=16, **kw)
    model = build_model(cfg, "cpu")
    model.init_weights(0)
    return model


@pytest.mark.parametrize("arch", ["llama", "gpt"])
def test_no_decay_groups_on_transformer(arch):
    model = _small_model(arch=arch, tie_embeddings=True)
    groups = {g["name"]: g for g in param_groups(model, 0.1)}
    name_of = {id(p): n for n, p in model.named_parameters()}
    decay = {name_of[id(p)] for p in groups["decay"]["params"]}
    skip = {name_of[id(p)] for p in groups["no_decay"]["params"]}
    assert groups["decay"]["weight_decay"] == 0.1 and groups["no_decay"]["weight_decay"] == 0.0
    assert not decay & skip
    assert decay | skip == set(name_of.values())
    # Tied: the output weight is the embedding, counted once.
    n_params = sum(len(g["params"]) for g in groups.values())
    assert n_params == len({id(p) for p in model.parameters()})
    assert "tok_embeddings.weight" in decay and "output.weight" not in decay | skip
    assert "layers.0.attention.wq.weight" in decay
    assert "layers.1.feed_forward.w2.weight" in decay
    assert "norm.weight" in skip and "layers.0.attention_norm.weight" in skip
    for n in skip:
        assert "norm" in n or n.endswith("bias") or model.get_parameter(n).ndim < 2
    for n in decay:
        assert model.get_parameter(n).ndim >= 2 and not no_decay(n, model.get_parameter(n))
    if arch == "gpt":
        assert "layers.0.attention.wq.bias" in skip and "layers.0.ffn_norm.bias" in skip
        assert "pos_embeddings.weight" in decay


@pytest.mark.parametrize("name", ["adamw", "lamb"])
def test_build_optimizer_steps(name):
    model = _small_model()
    cfg = OptimizerConfig(name=name, lr=1e-2, weight_decay=0.1)
    opt = build_optimizer(model, cfg)
    assert isinstance(opt, torch.optim.AdamW if name == "adamw" else Lamb)
    if name == "adamw":
        assert all(g["foreach"] for g in opt.param_groups)
    assert {g["weight_decay"] for g in opt.param_groups} == {0.0, 0.1}
    assert all(g["lr"] == 1e-2 and g["betas"] == (0.9, 0.95) for g in opt.param_groups)
    tokens = torch.randint(0, 64, (2, 16))
    before = model.norm.weight.detach().clone()
    model(tokens, tokens).backward()
    opt.step()
    assert not torch.equal(before, model.norm.weight.detach())


# -- DTensor path: 2 processes, parameters sharded (unevenly) over a 1-D mesh -----------------

def _dtensor_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    torch.set_num_threads(1)
    init_group(rank, world, port)
    try:
        mesh = init_device_mesh("cpu", (world,))
        init, grads = _problem(steps=4, seed=1)
        placements = [Shard(0), Shard(0), Shard(1), Replicate(), Shard(0)]
        # gradients as tensor parallelism leaves some: a sharded parameter's whole (the
        # embedding's), a replicated one's pending its sum over the group (a norm weight's)
        grad_placements = [Replicate(), Shard(0), Shard(1), Partial(), Shard(0)]
        plain = [torch.nn.Parameter(torch.tensor(x, dtype=torch.float64)) for x in init]
        dts = [torch.nn.Parameter(distribute_tensor(torch.tensor(x, dtype=torch.float64), mesh,
                                                    [pl]))
               for x, pl in zip(init, placements, strict=True)]
        kw = dict(lr=0.05, betas=(0.9, 0.95), eps=1e-6, weight_decay=0.1)
        opt_plain, opt_dt = Lamb(plain, **kw), Lamb(dts, **kw)
        for gs in grads:
            for p, d, g, pl in zip(plain, dts, gs, grad_placements, strict=True):
                p.grad = torch.tensor(g, dtype=torch.float64)
                d.grad = DTensor.from_local(p.grad / world, mesh, [pl]) if pl.is_partial() \
                    else distribute_tensor(p.grad, mesh, [pl])
            opt_plain.step()
            opt_dt.step()
        err = max((p.detach() - d.detach().full_tensor()).abs().max().item()
                  for p, d in zip(plain, dts, strict=True))
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump({"err": err}, f)
    except BaseException:
        dist.destroy_process_group()
        raise
    finish()  # barrier, then leave without torch's gloo teardown (see tests/dist.finish)




@pytest.mark.slow
def test_lamb_dtensor_matches_plain(tmp_path):
    world = 2
    spawn(_dtensor_worker, world, str(tmp_path))
    for r in range(world):
        err = json.loads((tmp_path / f"rank{r}.json").read_text())["err"]
        assert err < 1e-12, f"rank {r}: DTensor LAMB differs from plain by {err}"
