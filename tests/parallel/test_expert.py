"""Expert parallelism on gloo ranks equals one process: layer, training steps, FSDP2, checkpoint.

One gloo job of 4 processes (spawning costs more than the cases) runs every case and writes its
errors to JSON; the test functions check them. Layouts: dp = ep = 2 on the rank pairs {0, 1}
and {2, 3} (two independent 2-rank runs; experts are not replicated), and dp = 4 with ep = 2
(each expert held by 2 replicas whose gradients must be averaged).
"""

from __future__ import annotations

import copy
import json
import os

import pytest
import torch

from myria.config import ModelConfig
from myria.parallel.expert import clip_grad_norm_, is_expert_parameter
from tests.conftest import moe_cfg
from tests.dist import finish, init, spawn

STEPS = 5
TRAIN_REL_TOL = 1e-4


# -- single process -----------------------------------------------------------------------------

def test_is_expert_parameter():
    assert is_expert_parameter("layers.3.feed_forward.experts.w1")
    assert is_expert_parameter("layers.0.feed_forward.experts.w2_bias")
    assert not is_expert_parameter("layers.0.feed_forward.router.weight")
    assert not is_expert_parameter("layers.0.feed_forward.w1.weight")
    assert not is_expert_parameter("w1")


def test_clip_grad_norm_matches_torch():
    torch.manual_seed(0)
    a = [torch.nn.Parameter(torch.randn(5, 3)) for _ in range(3)]
    b = [torch.nn.Parameter(p.detach().clone()) for p in a]
    for p, q in zip(a, b):
        p.grad = torch.randn_like(p)
        q.grad = p.grad.clone()
    want = torch.nn.utils.clip_grad_norm_(b, 0.5)
    got = clip_grad_norm_(a, 0.5)
    torch.testing.assert_close(got, want)
    for p, q in zip(a, b):
        torch.testing.assert_close(p.grad, q.grad)
    assert clip_grad_norm_(a, 0.0).item() == pytest.approx(0.5, rel=1e-5)  # measure only


# -- multi-process (gloo) -----------------------------------------------------------------------

def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def _layer_case(ep_mesh, rank: int, world: int, arch: str, top_k: int, cf: float) -> dict:
    """One MoE layer (fp64): output, input/router/expert gradients, router losses."""
    from myria.models.moe import MoE
    from myria.parallel.expert import apply_expert_parallel

    cfg = moe_cfg(arch=arch, top_k=top_k, capacity_factor=cf)
    torch.manual_seed(11)
    ref = MoE(cfg).double()
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_(0.0, 0.3)
    par = copy.deepcopy(ref)
    assert apply_expert_parallel(par, ep_mesh) == 1
    g = torch.Generator().manual_seed(3)
    xs = torch.randn(world, 2, 12, cfg.hidden, generator=g, dtype=torch.float64)
    dys = torch.randn(world, 2, 12, cfg.hidden, generator=g, dtype=torch.float64)
    # this rank's microbatch through the expert-parallel layer
    x = xs[rank].clone().requires_grad_()
    out = par(x)
    (out * dys[rank]).sum().backward()
    # single-process reference: every microbatch, expert gradients summed over the ep group
    ref_grads = []
    for r in range(world):
        xr = xs[r].clone().requires_grad_()
        o = ref(xr)
        gr = torch.autograd.grad((o * dys[r]).sum(), [xr, *ref.parameters()])
        ref_grads.append(dict(zip(["x", *(n for n, _ in ref.named_parameters())], gr)))
        if r == rank:
            ref_out, ref_aux, ref_stats = o.detach(), ref.aux_loss.item(), ref.stats
    ep = ep_mesh.size()
    errs = {"out": _rel(out.detach(), ref_out), "dx": _rel(x.grad, ref_grads[rank]["x"]),
            "aux": abs(par.aux_loss.item() - ref_aux) / ref_aux,
            "kept": float(not torch.equal(par.stats["kept"], ref_stats["kept"]))}
    grad_err = 0.0
    first = rank - ep_mesh.get_local_rank()  # the ep group is world ranks [first, first + ep)
    for name, p in par.named_parameters():
        if is_expert_parameter(name):
            e = p.to_local().shape[0]
            lo = ep_mesh.get_local_rank() * e
            want = sum(ref_grads[r][name][lo:lo + e] for r in range(first, first + ep)) / ep
            grad_err = max(grad_err, _rel(p.grad.to_local(), want))
        else:
            grad_err = max(grad_err, _rel(p.grad, ref_grads[rank][name]))
    errs["grad"] = grad_err
    return errs


def _batches(cfg: ModelConfig, world: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, cfg.vocab_size, (world, 2, cfg.seq_len + 1), generator=g)
            for _ in range(STEPS)]


def _reference_losses(cfg: ModelConfig, world: int, steps: int) -> tuple[list[float], dict]:
    """One process: each step accumulates `world` microbatches (the mean of their losses)."""
    from myria.models.transformer import build_model

    model = build_model(cfg, "cpu")
    model.init_weights(5)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for tokens in _batches(cfg, world)[:steps]:
        total = 0.0
        for m in range(world):
            loss = model(tokens[m, :, :-1], tokens[m, :, 1:]) / world
            loss.backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses, {n: p.detach() for n, p in model.named_parameters()}


def _train_case(dp_mesh, ep_mesh, replica_mesh) -> dict:
    """Manual loop: EP on a meta model, dense grads averaged over dp, experts over replicas."""
    import torch.distributed as dist

    from myria.models.transformer import build_model
    from myria.parallel.expert import apply_expert_parallel, sync_gradients

    world, rank = dp_mesh.size(), dp_mesh.get_local_rank()
    cfg = moe_cfg(arch="llama", top_k=2, capacity_factor=1.25, parallel_block=True)
    ref_losses, ref_params = _reference_losses(cfg, world, STEPS)
    ref_init = build_model(cfg, "cpu")
    ref_init.init_weights(5)
    model = build_model(cfg, "meta")
    apply_expert_parallel(model, ep_mesh)
    model.to_empty(device="cpu")
    model.init_weights(5)
    init_err = 0.0
    for (name, p), q in zip(model.named_parameters(), ref_init.parameters(), strict=True):
        if is_expert_parameter(name):
            e = p.to_local().shape[0]
            q = q[ep_mesh.get_local_rank() * e:][:e]
        init_err = max(init_err, (_local(p) - q).abs().max().item())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    dp_group, rep_group = dp_mesh.get_group(), replica_mesh.get_group()
    losses = []
    for tokens in _batches(cfg, world):
        loss = model(tokens[rank, :, :-1], tokens[rank, :, 1:])
        loss.backward()
        sync_gradients(model, dp_group, rep_group)
        clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean, group=dp_group)
        losses.append(mean.item() / world)
    param_err = 0.0
    for name, p in model.named_parameters():
        param_err = max(param_err, _rel(p.full_tensor() if hasattr(p, "full_tensor") else p,
                                        ref_params[name]))
    return {"init": init_err, "param": param_err,
            "loss": max(abs(a / b - 1) for a, b in zip(losses, ref_losses, strict=True))}


def _fsdp_case(dp_mesh, ep_mesh, replica_mesh, ckpt: str | None) -> dict:
    """The FSDP2 recipe of `myria.parallel.expert`, then a DCP checkpoint into one process."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.distributed.fsdp import fully_shard

    from myria.models.transformer import build_model
    from myria.parallel.expert import apply_expert_parallel

    world, rank, steps = dp_mesh.size(), dp_mesh.get_local_rank(), 3
    cfg = moe_cfg(arch="gpt", top_k=1, capacity_factor=1.0)
    ref_losses, ref_params = _reference_losses(cfg, world, steps)
    model = build_model(cfg, "meta")
    apply_expert_parallel(model, ep_mesh)
    for block in model.layers.values():
        fully_shard(block.feed_forward.experts, mesh=replica_mesh)
        fully_shard(block, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh, reshard_after_forward=False)
    model.to_empty(device="cpu")
    model.init_weights(5)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for tokens in _batches(cfg, world)[:steps]:
        loss = model(tokens[rank, :, :-1], tokens[rank, :, 1:])
        loss.backward()
        clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean, group=dp_mesh.get_group())
        losses.append(mean.item() / world)
    # The key bias has a zero gradient up to rounding (softmax ignores a shift of all of a
    # query's scores), which Adam blows up to lr-sized noise: it is not compared.
    compared = [n for n in ref_params if not n.endswith("wk.bias")]
    params = dict(model.named_parameters())
    res = {"loss": max(abs(a / b - 1) for a, b in zip(losses, ref_losses, strict=True)),
           "param": max(_rel(params[n].full_tensor(), ref_params[n]) for n in compared)}
    if ckpt is None:
        return res
    dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=ckpt)
    plain = build_model(cfg, "cpu")
    plain.init_weights(99)
    sd = plain.state_dict()
    dcp.load({"model": sd}, checkpoint_id=ckpt)
    res["ckpt"] = max(_rel(sd[n], ref_params[n]) for n in compared)
    return res


WORLD = 4


def _worker(rank: int, world: int, port: int, out_dir: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from myria.models.transformer import build_model
    from myria.parallel.expert import apply_expert_parallel, expert_meshes

    torch.set_num_threads(1)
    init(rank, world, port)
    try:
        results = {}
        dp4 = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",))
        dp2 = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("pair", "dp_shard"))
        dp2 = dp2["dp_shard"]  # ranks {0, 1} or {2, 3}: a 2-rank data-parallel run
        for arch, top_k, cf in [("llama", 2, 1.25), ("gpt", 1, 1.0), ("llama", 1, 0.0)]:
            for ep_mesh in (dp4, dp2):  # 1 and 2 local experts of 4
                name = f"layer_{arch}_top{top_k}_cf{cf}_ep{ep_mesh.size()}"
                results[name] = _layer_case(ep_mesh, rank, world, arch, top_k, cf)
        for dp_mesh in (dp2, dp4):
            ep_mesh, replica_mesh = expert_meshes(dp_mesh, 2)
            key = f"dp{dp_mesh.size()}_ep2"
            results[f"replicas_{key}"] = replica_mesh.size()
            results[f"train_{key}"] = _train_case(dp_mesh, ep_mesh, replica_mesh)
            ckpt = os.path.join(out_dir, "ckpt") if dp_mesh is dp4 else None
            results[f"fsdp_{key}"] = _fsdp_case(dp_mesh, ep_mesh, replica_mesh, ckpt)
        errors = []
        try:
            apply_expert_parallel(build_model(moe_cfg(experts=3), "meta"), dp2)
        except ValueError as e:
            errors.append(str(e))
        try:
            expert_meshes(dp4, 3)
        except ValueError as e:
            errors.append(str(e))
        results["errors"] = errors
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(results, f)
    except BaseException:
        dist.destroy_process_group()
        raise
    finish()  # barrier, then leave without torch's gloo teardown (see tests/dist.finish)


@pytest.fixture(scope="module")
def ep_results(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("ep")
    spawn(_worker, WORLD, str(out))
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]


@pytest.mark.slow
def test_layer_output_and_gradients_match_one_process(ep_results):
    for rank, res in enumerate(ep_results):
        names = [n for n in res if n.startswith("layer_")]
        assert len(names) == 6
        for name in names:
            assert max(res[name].values()) < 1e-10, (rank, name, res[name])


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["dp2_ep2", "dp4_ep2"])
def test_training_steps_match_one_process(ep_results, layout):
    for rank, res in enumerate(ep_results):
        assert res[f"replicas_{layout}"] == (1 if layout == "dp2_ep2" else 2)
        t = res[f"train_{layout}"]
        assert t["init"] == 0.0, (rank, t)
        assert t["loss"] <= TRAIN_REL_TOL and t["param"] < 1e-4, (rank, t)


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["dp2_ep2", "dp4_ep2"])
def test_fsdp2_recipe_matches_one_process(ep_results, layout):
    for rank, res in enumerate(ep_results):
        f = res[f"fsdp_{layout}"]
        assert f["loss"] <= TRAIN_REL_TOL and f["param"] < 1e-4, (rank, f)


@pytest.mark.slow
def test_checkpoint_of_ep_fsdp_run_loads_into_one_process(ep_results):
    for rank, res in enumerate(ep_results):
        assert res["fsdp_dp4_ep2"]["ckpt"] < 1e-4, (rank, res["fsdp_dp4_ep2"])


@pytest.mark.slow
def test_clear_errors(ep_results):
    msgs = ep_results[0]["errors"]
    assert len(msgs) == 2
    assert "model.experts = 3 is not divisible" in msgs[0]
    assert "ep = 3 must divide" in msgs[1]
