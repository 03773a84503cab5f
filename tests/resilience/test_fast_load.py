"""Fast loading: one rank per group of replicas reads a shard, the others receive it by broadcast.

DDP replicas (2 ranks) and HSDP (2 replicas x 2 shards, 4 ranks) resume bit for bit while only
one rank per replica group reads from storage (RUN_DIR/checkpoint_stats/rankN.json counts it).
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from tests.conftest import TINY, losses
from tests.conftest import train as train_job

STEPS = 8


def train(run_dir, data, nproc, *extra):
    return train_job(run_dir, data, *TINY, f"--training.steps={STEPS}",
                     "--checkpoint.interval=0", *extra, nproc=nproc)


def bytes_read(run_dir, nproc):
    return [json.loads((run_dir / "checkpoint_stats" / f"rank{r:05d}.json").read_text())
            ["bytes_read"] for r in range(nproc)]


def params(run_dir):
    from myria.train.export import load_checkpoint_model
    return dict(load_checkpoint_model(run_dir, None)[0].state_dict())


@pytest.mark.slow
@pytest.mark.parametrize("nproc,layout,readers", [
    (2, ["--training.data_parallel=ddp"], [0]),
    (4, ["--parallel.dp_replicate=2"], [0, 1]),
])
def test_one_reader_per_replica_group(tmp_path, tiny_data, nproc, layout, readers):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    train(straight, tiny_data, nproc, *layout, f"--checkpoint.interval={STEPS // 2}")
    # the same run stopped after the first checkpoint: drop what came after it
    shutil.copytree(straight, resumed)
    shutil.rmtree(resumed / "checkpoints" / f"step_{STEPS:08d}")
    (resumed / "checkpoints" / "latest").write_text(f"step_{STEPS // 2:08d}\n")
    rows = (resumed / "metrics.jsonl").read_text().splitlines()
    (resumed / "metrics.jsonl").write_text("".join(
        r + "\n" for r in rows if json.loads(r).get("step", 0) <= STEPS // 2))
    p = train(resumed, tiny_data, nproc, *layout, f"--checkpoint.interval={STEPS // 2}")
    assert "resumed from" in p.stdout
    got = bytes_read(resumed, nproc)
    assert [r for r in range(nproc) if got[r] > 0] == readers, got
    a, b = losses(straight), losses(resumed)
    assert [a[s] for s in range(1, STEPS + 1)] == [b[s] for s in range(1, STEPS + 1)]
    pa, pb = params(straight), params(resumed)
    assert all(torch.equal(pa[k], pb[k]) for k in pa)
