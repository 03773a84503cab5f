"""State in peer memory (myria.train.peer): the ring neighbour holds each rank's snapshot,
bit for bit, checksummed, both ways: over the group (another host) and in shared memory (the
same host)."""

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


def _ring(rank, world, shared):
    from myria.train import peer

    eng = FakeEngine(rank)
    ring = peer.PeerSnapshots(1, eng, rank, world, None, shared=shared)
    ring.after_step(1)
    ring.wait()
    got = ring.held_state()
    left = FakeEngine((rank - 1) % world)
    res = {"shared": ring.shared_left, "from": ring.held["from"], "step": got["_step"],
           "equal": torch.equal(got["model/w"], left.w) and
           torch.equal(got["optim/w.exp_avg"], left.m) and got["optim/w.step"] == 7}
    # step 2's checksum disagrees with its bytes (a damaged transfer or copy)
    real = peer.crc32
    peer.crc32 = lambda b: real(b) ^ (1 if b is ring.buf else 0)
    eng.w += 1
    ring.after_step(2)
    ring.wait()
    peer.crc32 = real
    res.update(held=ring.held["step"], failures=ring.stats["crc_failures"],
               damaged=ring.verify())
    # kept for in-job recovery: its own snapshots, and the left's copies that were held
    kept = ring.kept()
    res.update(own=sorted(kept["own"]), kept_held=sorted(kept["held"]))
    return ring, res, left


def _worker(rank, world, port, out):
    tdist.init(rank, world, port)
    import torch.distributed as dist

    # over the group: the damaged step 2 is refused on receipt, the step-1 copy kept intact
    ring, net, left = _ring(rank, world, False)
    net["still_equal"] = torch.equal(ring.held_state()["model/w"], left.w)
    # step 4: a bit of the buffer changes after it was packed and checked, before its CRC-32
    # is taken (the CRC-32 would hold the wrong bytes): checked again after the CRC-32, it is
    # not kept as this rank's own, and its holder does not hold it
    from myria.train import peer

    real = peer.crc32

    def flip_first(b):
        if b is ring.buf:
            b[0] ^= 0x01
        return real(b)

    peer.crc32 = flip_first
    ring.after_step(4)
    ring.wait()
    peer.crc32 = real
    net.update(flip_held=ring.held["step"], flip_own=sorted(ring.kept()["own"]),
               flip_failures=ring.stats.get("integrity_failures"))
    ring.held["buf"][5] ^= 0xFF  # memory damaged while held
    net["damaged"] = ring.verify()
    # shared memory: the holder finds the damage when it uses the copy; the copy of step 3
    # outlives its sender's files
    ring2, shm, left = _ring(rank, world, None)
    ring2.after_step(3)
    ring2.wait()
    dist.barrier()
    ring2.close()    # the sender removes its files...
    dist.barrier()
    left.w += 1      # ...and the holder still has step 3 (its sender's w + 1), bit for bit
    shm["after_close"] = torch.equal(ring2.held_state()["model/w"], left.w)
    (out / f"r{rank}.json").write_text(json.dumps({"net": net, "shm": shm}))
    tdist.finish()


@pytest.mark.slow
def test_ring_neighbour_holds_each_rank_bit_for_bit(tmp_path):
    tdist.spawn(_worker, 2, tmp_path)
    for rank in (0, 1):
        r = json.loads((tmp_path / f"r{rank}.json").read_text())
        net, shm = r["net"], r["shm"]
        assert net["from"] == 1 - rank and net["step"] == 1 and net["equal"], net
        assert not net["shared"] and shm["shared"], r
        assert net["held"] == 1 and net["failures"] == 1 and net["still_equal"], net
        assert "no longer matches its CRC-32" in net["damaged"], net
        assert net["flip_held"] == 1 and net["flip_own"] == [1, 2] and \
            net["flip_failures"] == 1, net
        assert shm["equal"] and shm["held"] == 2 and "no longer matches" in shm["damaged"], shm
        assert shm["after_close"], shm
        # each rank keeps its own snapshots; over the group the damaged step 2 never became a
        # held copy (in shared memory it is found damaged only when used)
        assert net["own"] == shm["own"] == [1, 2] and net["kept_held"] == [1], r
        assert shm["kept_held"] == [1, 2], shm
