"""The at-rest checksum of the reduced gradients guards them from the moment FSDP2's reduction
writes each one: a bit flipped later in the same backward is found before clipping reads it,
and a clean step raises nothing (2 gloo ranks, each layer sharded alone as the trainer does)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from tests.dist import finish, init, spawn


def _ledger_case(rank: int, world: int, port: int, out_dir: str) -> None:
    import torch
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    from myria.offload.tier import MemoryTier
    from myria.train.integrity import flip_bit
    from myria.train.sdc import StateLedger

    init(rank, world, port)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                          nn.Linear(16, 4))
    for layer in (model[0], model[2], model[4]):
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tier = MemoryTier(SimpleNamespace(parallel=SimpleNamespace(offload="none")))
    engine = SimpleNamespace(parts=[model], model=model, optimizers=[opt], schedule=None,
                             tied=None, manual_dp=False, tier=tier)
    ledger = StateLedger(engine)
    out: dict = {}

    def step(watch: bool, flip: bool) -> list[str]:
        if watch:
            ledger.watch_grads()
        handle = None
        if flip:   # in the backward, after the last layer's reduction wrote its gradient
            handle = model[0].register_full_backward_hook(
                lambda *a: flip_bit(model[4].weight.grad))
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))
        model(x).square().mean().backward()
        if handle is not None:
            handle.remove()
        early = len(ledger._early)
        ledger.record_grads()
        bad = ledger.verify_grads()
        opt.step()
        opt.zero_grad(set_to_none=True)
        out.setdefault("early", []).append(early)
        return bad

    out["watchable"] = ledger.watchable()
    out["clean"] = step(watch=True, flip=False)
    out["watches"] = [ledger.watches(p) for p in model.parameters()]
    out["flipped"] = step(watch=True, flip=True)
    out["clean_again"] = step(watch=True, flip=False)
    # the same flip with the checksum taken after the backward is not seen
    for h in ledger._grad_hooks:
        h.remove()
    ledger._grad_hooks, ledger._hooked = [], set()
    out["recorded_after"] = step(watch=False, flip=True)
    # where gradients are written after the reduction, or read inside the backward: not
    engine.schedule = object()   # a pipeline stage divides its gradients after the reduction
    out["pipeline_watchable"] = ledger.watchable()
    engine.schedule, engine.tier = None, SimpleNamespace(reads_grads_in_backward=True)
    out["nvme_watchable"] = ledger.watchable()
    with open(f"{out_dir}/rank{rank}.json", "w") as fh:
        json.dump(out, fh)
    finish()


@pytest.mark.slow   # two spawned gloo processes
def test_a_gradient_flipped_after_its_reduction_is_found_before_clipping(tmp_path):
    spawn(_ledger_case, 2, str(tmp_path))
    for rank in (0, 1):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert got["watchable"] and not got["pipeline_watchable"] and not got["nvme_watchable"]
        assert all(got["watches"]) and len(got["watches"]) == 6
        # every gradient was checksummed by the reduction's hook, in each watched step
        assert got["early"][:3] == [6, 6, 6] and got["early"][3] == 0, got
        assert got["clean"] == [] and got["clean_again"] == [], got
        assert got["flipped"] == ["grad 4.weight"], got
        assert got["recorded_after"] == [], got   # the window the hook closes
