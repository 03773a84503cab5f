"""State in peer memory (myria.resilience.peer): the ring neighbour holds each rank's snapshot,
bit for bit, checksummed; a damaged copy is refused and a damaged transfer keeps the last one."""

from __future__ import annotations

import json

import pytest
import torch

from tests import dist as tdist


class FakeEngine:
    """The part of the Engine a snapshot reads: a state dict of tensors and plain values."""

    def __init__(self, rank: int):
        g = torch.Generator().manual_seed(rank)
        self.w = torch.randn(64, 33, generator=g)
        self.m = torch.randn(1000, generator=g).to(torch.bfloat16)

    def state_dict(self):
        return {"model": {"w": self.w}, "optim": {"w.exp_avg": self.m, "w.step": 7}}


def _worker(rank, world, port, out):
    tdist.init(rank, world, port)
    from myria.resilience import peer

    eng = FakeEngine(rank)
    ring = peer.start(1, eng, rank, world, None)
    ring.after_step(1)
    ring.wait()
    got = ring.held_state()
    left = FakeEngine((rank - 1) % world)
    res = {"from": ring.held["from"], "step": got["_step"],
           "equal": torch.equal(got["model/w"], left.w) and
           torch.equal(got["optim/w.exp_avg"], left.m) and got["optim/w.step"] == 7}
    # step 2 arrives damaged (the sender's checksum disagrees): the step-1 copy is kept
    real = peer.crc32
    peer.crc32 = lambda b: real(b) ^ (1 if b is ring.buf else 0)
    eng.w += 1
    ring.after_step(2)
    ring.wait()
    peer.crc32 = real
    res.update(kept=ring.held["step"], failures=ring.stats["crc_failures"],
               still_equal=torch.equal(ring.held_state()["model/w"], left.w))
    ring.held["buf"][5] ^= 0xFF  # memory damaged while held
    res["damaged"] = ring.verify()
    (out / f"r{rank}.json").write_text(json.dumps(res))
    tdist.finish()


@pytest.mark.slow
def test_ring_neighbour_holds_each_rank_bit_for_bit(tmp_path):
    tdist.spawn(_worker, 2, tmp_path)
    for rank in (0, 1):
        r = json.loads((tmp_path / f"r{rank}.json").read_text())
        assert r["from"] == 1 - rank and r["step"] == 1 and r["equal"], r
        assert r["kept"] == 1 and r["failures"] == 1 and r["still_equal"], r
        assert "no longer matches its CRC-32" in r["damaged"], r
