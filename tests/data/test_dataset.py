"""Tests of TokenDataset (windows, checks), the data-order rule and BatchLoader."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from myria.data import prepare as P
from myria.data.dataset import (
    TokenDataset,
    epoch_permutation,
    global_batch_indices,
    rank_batch_indices,
)
from myria.data.loader import BatchLoader
from myria.errors import ConfigError, DataError
from myria.layout import Layout

SEQ = 16


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("ds")
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()
    rng = np.random.default_rng(0)
    for i in range(6):
        text = " ".join(rng.choice(words, size=150 + 20 * i)) + "\n"
        (root / f"f{i}.txt").write_text(text)
    out = root / "data"
    P.prepare(out, inputs=[str(root / "*.txt")], vocab_size=280, shard_tokens=97,
              val_fraction=0.2, seed=3)
    return out


def stream(path: Path, ds: TokenDataset) -> np.ndarray:
    return np.concatenate([np.fromfile(path / s["file"], dtype=ds.dtype) for s in ds.shards])


def test_windows_span_shards(data_dir: Path) -> None:
    ds = TokenDataset(data_dir, SEQ)
    assert len(ds.shards) > 3
    tokens = stream(data_dir, ds).astype(np.int64)
    assert ds.num_tokens == len(tokens)
    assert ds.num_samples == len(ds) == (len(tokens) - 1) // SEQ
    ends = np.cumsum([s["tokens"] for s in ds.shards])
    crossing = 0
    for i in range(ds.num_samples):
        w = ds.get(i)
        assert w.dtype == np.int64 and w.shape == (SEQ + 1,)
        np.testing.assert_array_equal(w, tokens[i * SEQ: i * SEQ + SEQ + 1])
        crossing += bool(((ends > i * SEQ) & (ends < i * SEQ + SEQ + 1)).any())
    assert crossing > 0
    many = ds.get_many([3, 0, ds.num_samples - 1])
    assert many.shape == (3, SEQ + 1)
    np.testing.assert_array_equal(many[1], ds.get(0))
    with pytest.raises(IndexError):
        ds.get(ds.num_samples)
    assert ds.vocab_size <= 280 and ds.tokenizer_path.is_file()
    starts = ds.document_starts()
    np.testing.assert_array_equal(tokens[starts[1:] - 1], ds.eos_id)
    val = TokenDataset(data_dir, SEQ, split="val")
    assert val.num_samples > 0 and val.num_tokens != ds.num_tokens


def test_missing_dir_and_index(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"nope.*does not exist.*myria prepare"):
        TokenDataset(tmp_path / "nope", SEQ)
    with pytest.raises(DataError, match=r"index\.json.*not found.*myria prepare"):
        TokenDataset(tmp_path, SEQ)


def test_damaged_shards(data_dir: Path, tmp_path: Path) -> None:
    bad = tmp_path / "bad"
    shutil.copytree(data_dir, bad)
    shard = bad / "train_00001.bin"
    raw = bytearray(shard.read_bytes())
    raw[5] ^= 0xFF
    shard.write_bytes(bytes(raw))
    # the fix named is the one that works: a plain rerun of prepare finds index.json
    with pytest.raises(DataError, match=r"train_00001\.bin.*damaged.*sha256.*"
                       f"myria prepare --out {bad} --force"):
        TokenDataset(bad, SEQ)
    TokenDataset(bad, SEQ, verify=False)  # size still matches
    shard.write_bytes(bytes(raw[:-2]))
    with pytest.raises(DataError, match=r"train_00001\.bin.*bytes"):
        TokenDataset(bad, SEQ, verify=False)
    shard.unlink()
    with pytest.raises(DataError, match=r"train_00001\.bin.*missing"):
        TokenDataset(bad, SEQ, verify=False)
    with pytest.raises(DataError, match="no split 'test'"):
        TokenDataset(data_dir, SEQ, split="test")
    with pytest.raises(DataError, match="fewer than seq_len"):
        TokenDataset(data_dir, 10**6)


def test_an_empty_validation_split_says_how_it_came_to_be(data_dir: Path, tmp_path: Path
                                                          ) -> None:
    """A split 'val' prepared with --val-fraction 0 is empty: the line says so and how to get
    one, not to shorten the sequence length (which cannot help)."""
    P.prepare(tmp_path / "noval", inputs=[str(data_dir.parent / "*.txt")], vocab_size=280,
              val_fraction=0)
    with pytest.raises(DataError) as e:
        TokenDataset(tmp_path / "noval", SEQ, split="val")
    assert "is empty (prepared with --val-fraction 0)" in str(e.value) and \
        "--val-fraction > 0" in str(e.value) and "sequence length" not in str(e.value)


def test_replaced_tokenizer_is_refused(data_dir: Path, tmp_path: Path) -> None:
    """Shards read with a tokenizer other than the one index.json records would be other text."""
    import json

    bad = tmp_path / "bad"
    shutil.copytree(data_dir, bad)
    want = json.loads((bad / "index.json").read_text())["tokenizer_sha256"]
    tok = bad / "tokenizer.json"
    tok.write_text(tok.read_text().replace('"<|endoftext|>"', '"<|eos|>"'))
    with pytest.raises(DataError) as e:
        TokenDataset(bad, SEQ, verify=False)
    got = P.sha256_file(tok)
    assert got[:12] in str(e.value) and want[:12] in str(e.value)
    assert f"myria prepare --out {bad} --force" in str(e.value) and "\n" not in str(e.value)


# ----------------------------------------------------------------------------- order


def test_order_is_a_pure_function() -> None:
    a = global_batch_indices(5, 8, 37, seed=11)
    np.testing.assert_array_equal(a, global_batch_indices(5, 8, 37, seed=11))
    assert not np.array_equal(a, global_batch_indices(5, 8, 37, seed=12))
    assert not np.array_equal(a, global_batch_indices(6, 8, 37, seed=11))
    np.testing.assert_array_equal(epoch_permutation(0, 37, 11),
                                  np.random.default_rng([11, 0]).permutation(37))


def test_epochs_cover_each_sample_once() -> None:
    n, g = 10, 4  # steps straddle epochs: step 2 holds positions 8..11
    flat = np.concatenate([global_batch_indices(t, g, n, seed=1) for t in range(10)])
    for e in range(4):
        np.testing.assert_array_equal(np.sort(flat[e * n:(e + 1) * n]), np.arange(n))
        np.testing.assert_array_equal(flat[e * n:(e + 1) * n], epoch_permutation(e, n, 1))
    assert not np.array_equal(flat[:n], flat[n:2 * n])
    # a global batch larger than the dataset spans several epochs
    big = global_batch_indices(0, 25, 10, seed=1)
    np.testing.assert_array_equal(np.sort(big[:20]), np.sort(np.tile(np.arange(10), 2)))


@pytest.mark.parametrize("dp", [1, 2, 4, 8])
def test_dp_sizes_share_the_global_batch(dp: int) -> None:
    for step in (0, 3, 7):
        g = global_batch_indices(step, 8, 23, seed=5)
        parts = [rank_batch_indices(step, 8, 23, 5, r, dp) for r in range(dp)]
        np.testing.assert_array_equal(np.concatenate(parts), g)
    with pytest.raises(ConfigError):
        rank_batch_indices(0, 8, 23, 5, 0, 3)


# ----------------------------------------------------------------------------- loader


def take(loader: BatchLoader, n: int) -> list:
    return [next(loader) for _ in range(n)]


def test_loader_shapes_and_ranks(data_dir: Path) -> None:
    ds = TokenDataset(data_dir, SEQ)
    with BatchLoader(ds, global_batch=8, micro_batch=2, dp_rank=0, dp_size=1, seed=4,
                     prefetch=0) as one:
        b = next(one)
        assert b.step == 0 and b.inputs.shape == (4, 2, SEQ) and b.inputs.dtype == torch.long
        assert torch.equal(b.inputs[..., 1:], b.targets[..., :-1])
        full = torch.from_numpy(ds.get_many(global_batch_indices(0, 8, ds.num_samples, 4)))
        assert torch.equal(b.inputs.reshape(8, SEQ), full[:, :-1])
        assert one.samples_read == 8
    halves = []
    for r in range(2):
        with BatchLoader(ds, 8, 2, dp_rank=r, dp_size=2, seed=4, prefetch=0) as ld:
            x = next(ld)
            assert x.inputs.shape == (2, 2, SEQ) and ld.samples_read == 4
            halves.append(x.inputs.reshape(4, SEQ))
    assert torch.equal(torch.cat(halves), b.inputs.reshape(8, SEQ))
    with pytest.raises(ConfigError, match="divisible"):   # the one microbatch rule
        Layout().microbatches(8, 3)


def test_prefetch_matches_sync_and_resume(data_dir: Path) -> None:
    ds = TokenDataset(data_dir, 200, verify=False)  # few samples: 6 steps cross epochs
    sync = BatchLoader(ds, 4, 2, 0, 1, seed=9, prefetch=0)
    ref = take(sync, 6)  # 4 * 6 > num_samples: crosses an epoch
    assert 4 * 6 > ds.num_samples
    pre = BatchLoader(ds, 4, 2, 0, 1, seed=9, prefetch=3)
    got = take(pre, 3)
    state = pre.state_dict()
    assert state == {"step": 3, "seed": 9, "global_batch": 4}
    got += take(pre, 3)
    pre.close()
    assert pre._thread is None
    for a, b in zip(ref, got, strict=True):
        assert a.step == b.step and torch.equal(a.inputs, b.inputs)
        assert torch.equal(a.targets, b.targets)
    resumed = BatchLoader(ds, 4, 2, 0, 1, seed=9, prefetch=2)
    resumed.load_state_dict(state)
    for a, b in zip(ref[3:], take(resumed, 3), strict=True):
        assert a.step == b.step and torch.equal(a.inputs, b.inputs)
    resumed.load_state_dict({"step": 1, "seed": 9, "global_batch": 4})  # rewind mid-iteration
    assert torch.equal(next(resumed).inputs, ref[1].inputs)
    resumed.close()
    started = BatchLoader(ds, 4, 2, 0, 1, seed=9, start_step=5, prefetch=1)
    assert torch.equal(next(started).inputs, ref[5].inputs)
    started.close()
    with pytest.raises(ConfigError, match="seed"):
        BatchLoader(ds, 4, 2, 0, 1, seed=1).load_state_dict(state)


class SlowDataset:
    """Wraps a dataset and delays every read."""

    def __init__(self, ds: TokenDataset, delay: float) -> None:
        self.ds, self.delay = ds, delay
        self.num_samples, self.seq_len = ds.num_samples, ds.seq_len
        self.batch_indices = ds.batch_indices

    def get_many(self, idx):
        time.sleep(self.delay)
        return self.ds.get_many(idx)


def test_wait_time_is_measured(data_dir: Path) -> None:
    ds = TokenDataset(data_dir, SEQ, verify=False)
    ld = BatchLoader(SlowDataset(ds, 0.05), 4, 2, 0, 1, seed=0, prefetch=0)
    next(ld)
    next(ld)
    w = ld.pop_wait_time()
    assert w >= 0.09 and ld.last_wait_s >= 0.045
    assert ld.pop_wait_time() == 0.0
    pre = BatchLoader(SlowDataset(ds, 0.05), 4, 2, 0, 1, seed=0, prefetch=2)
    next(pre)  # the first batch is always waited for
    time.sleep(0.3)  # the thread fills the queue meanwhile
    pre.pop_wait_time()
    next(pre)
    assert pre.pop_wait_time() < 0.04
    pre.close()


def test_loader_surfaces_worker_errors(data_dir: Path) -> None:
    class Broken(SlowDataset):
        def get_many(self, idx):
            raise RuntimeError("disk on fire")

    ds = TokenDataset(data_dir, SEQ, verify=False)
    ld = BatchLoader(Broken(ds, 0), 4, 2, 0, 1, seed=0, prefetch=2)
    with pytest.raises(RuntimeError, match="disk on fire"):
        next(ld)
    ld.close()
