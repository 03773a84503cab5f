"""The nvme tier (parallel.offload = nvme): same bits as in memory, checkpoints, faults, budget."""

from __future__ import annotations

import json

import pytest
import torch

from myria import config
from myria.errors import CheckpointError, ConfigError, OffloadError
from myria.layout import Layout
from myria.offload.diskio import ALIGN, HUGE_PAGE, aligned_buffer
from myria.offload.files import FileMap
from myria.train.checkpoint.pipeline import CheckpointManager
from myria.train.engine import Engine
from tests.conftest import TINY, final_params, losses, run_cli

SMALL = ["--model.vocab_size=512", "--model.layers=2", "--model.hidden=64", "--model.heads=4",
         "--model.kv_heads=2", "--model.seq_len=32", "--training.global_batch=4",
         "--training.micro_batch=2"]


def engine(tmp_path, *overrides):
    cfg = config.load(None, [*SMALL, *overrides])
    return Engine(cfg, None, torch.device("cpu"), tmp_path)


def train_steps(e: Engine, steps: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randint(0, 512, (2, 2, 33), generator=g)
        e.forward_backward(x[..., :-1], x[..., 1:])
        e.clip_grads(1.0)
        e.step()
    return {k: v.clone() for k, v in e.model.state_dict().items()}


def test_file_map_pieces_tile_every_tensor_once():
    lay = FileMap([((3, 1000), torch.float32), ((7,), torch.float32), ((5000,), torch.float32),
                  ((0,), torch.float32)], ("exp_avg", "exp_avg_sq"))
    assert all(o % ALIGN == 0 for o in lay.offsets) and lay.region % ALIGN == 0
    for cap in (ALIGN, 3 * ALIGN, lay.region):
        covered = {i: [] for i in range(4)}
        for ch in lay.chunks(cap):
            assert ch.stop - ch.start <= cap and ch.start % ALIGN == 0
            for pc in ch.pieces:
                covered[pc.index].append((pc.start, pc.stop))
        for i, n in enumerate(lay.numels):
            spans = sorted(covered[i])
            assert sum(b - a for a, b in spans) == n
            assert all(a2 == b1 for (_, b1), (a2, _) in zip(spans, spans[1:]))


@pytest.mark.parametrize("budget", ["0", "0.006"])
def test_disk_matches_memory_bit_for_bit(tmp_path, budget):
    # 0.006 GB: chunks of one layer, tensors cut between chunks
    ref_engine = engine(tmp_path / "mem")
    ref = train_steps(ref_engine, 4)
    off = engine(tmp_path / "disk", "--parallel.offload=nvme",
                 f"--parallel.fast_memory_gb={budget}")
    opt = off.optimizers[0]
    if budget != "0":
        assert len(opt.chunks) >= 4 and len(opt.pipe.buffers) >= 3
        cut = [pc.index for ch in opt.chunks for pc in ch.pieces if pc.start > 0]
        assert cut, "no tensor was cut between chunks"
    got = train_steps(off, 4)
    assert ref.keys() == got.keys()
    for k in ref:
        assert torch.equal(ref[k], got[k]), k
    ref_steps = [s["step"] for s in ref_engine.optimizers[0].state.values()]
    assert [opt.state[p]["step"] for p in opt.tensors] == ref_steps
    # the moments on disk are AdamW's, and only the last generation is kept (beside the
    # replaced one's file, which the next is written into)
    opt.flush()
    files = sorted(p.name for p in opt.dir.iterdir())
    assert files == ["gen_00000004.bin", "gen_00000004.json", "spare.bin"]
    ref_opt = ref_engine.optimizers[0]
    raw = torch.frombuffer(bytearray(opt.gens.path(4).read_bytes()), dtype=torch.uint8)
    m = opt.filemap.section("exp_avg")
    for t, p in enumerate(opt.tensors):
        at = m * opt.filemap.region + opt.filemap.offsets[t]
        disk = raw[at:at + p.numel() * 4].view(torch.float32).view_as(p)
        assert torch.equal(disk, ref_opt.state[list(ref_opt.state)[t]]["exp_avg"])
    off.close()
    stats = json.loads((tmp_path / "disk" / "offload_stats" / "rank00000.json").read_text())
    assert stats["steps"] == 4 and stats["bytes_written"] == 4 * opt.filemap.file_bytes


@pytest.mark.parametrize("ac", ["full", "selective"])
def test_parameters_on_disk_match_memory_bit_for_bit(tmp_path, ac):
    common = [f"--parallel.activation_checkpoint={ac}", "--model.layers=3"]
    ref = engine(tmp_path / "mem", *common)
    train_steps(ref, 3)
    off = engine(tmp_path / "disk", *common, "--parallel.offload=nvme",
                 "--parallel.offload_params=true")
    train_steps(off, 3)
    # between steps no parameter is in memory: each layer was read for its forward/backward
    assert all(p.numel() == 0 for p in off.model.parameters())
    # every microbatch reads every layer for forward, and most of them again for backward
    once = sum(off.optimizers[0].filemap.numels) * 4
    ps = off.optimizers[0].streamer
    assert 3 * 2 * once < ps.bytes_read + ps.bytes_copied < 3 * 2 * 2 * once * 1.05
    # by the last chunk of the first update nearly all gradient memory is given back and no
    # buffer is lent yet: that chunk waits for its write in a buffer of its own, off the ring
    opt = off.optimizers[0]
    assert opt.pipe.stats.behind_buffers >= 1
    # the gradient memory lent out is all accounted for, after steps and after a skipped one
    opt.flush()
    assert opt.loan.inflight == 0 and opt.loan.room + opt.loan.extra == sum(opt.loan.grad_bytes)
    x = torch.randint(0, 512, (2, 2, 33))
    off.forward_backward(x[..., :-1], x[..., 1:])
    assert opt.loan.room + opt.loan.extra < sum(opt.loan.grad_bytes)   # backward took its share
    off.skip_step()
    assert opt.loan.room + opt.loan.extra == sum(opt.loan.grad_bytes)
    a, b = ref.state_dict()["model"], off.state_dict()["model"]   # b: mapped from the file
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    off.close()


def test_update_runs_behind_the_next_forward(tmp_path, monkeypatch):
    """With parameters on disk, step() returns before its chunks are updated; the next forward
    waits for each unit's chunks to be updated, and takes their parameters from memory while
    their writes trail (here: held back); the run stays bit-equal to the in-memory one."""
    import os
    import threading
    import time

    from myria.offload import pipeline
    from myria.offload.adamw import OffloadedAdamW

    common = ["--parallel.activation_checkpoint=full", "--model.layers=3"]
    ref = engine(tmp_path / "mem", *common)
    want = train_steps(ref, 3)
    gate, writes = threading.Event(), threading.Event()
    real_io, real_update = pipeline.full_io, OffloadedAdamW._update

    def gated_io(op, fd, mv, offset):
        if op is os.pwritev:
            writes.wait()
        return real_io(op, fd, mv, offset)

    def gated_update(self, *a):
        gate.wait()
        return real_update(self, *a)

    monkeypatch.setattr(pipeline, "full_io", gated_io)
    monkeypatch.setattr(OffloadedAdamW, "_update", gated_update)
    gate.set()
    writes.set()   # open while the initial generation is written
    # a budget with a buffer for every chunk: with the writes held back the update still ends
    off = engine(tmp_path / "disk", *common, "--parallel.offload=nvme",
                 "--parallel.offload_params=true", "--parallel.fast_memory_gb=1")
    opt = off.optimizers[0]
    assert opt.asynchronous and len(opt.pipe.buffers) >= len(opt.chunks)
    opt.speculate = False   # the update starts in step() (the next test: during backward)
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 512, (2, 2, 33), generator=g) for _ in range(3)]

    def run(x):
        off.forward_backward(x[..., :-1], x[..., 1:])
        off.clip_grads(1.0)

    # 1. the update held back: step() returns, the next forward cannot start on old parameters
    run(batches[0])
    gate.clear()
    off.step()                      # returns with no chunk updated yet
    assert not any(ev.is_set() for ev in opt._computed)
    nxt = threading.Thread(target=run, args=(batches[1],))
    nxt.start()
    nxt.join(timeout=2.0)
    assert nxt.is_alive(), "the next forward ran on parameters not yet updated"
    gate.set()
    nxt.join(timeout=60)
    assert not nxt.is_alive()
    # 2. the writes held back: the next forward reads every unit from the update's buffers,
    # starting with the first units' reads that step() itself queues: count from before them
    marks = []

    def mark():
        marks.append(opt.streamer.bytes_copied)

    opt.after_step.insert(0, mark)
    writes.clear()
    off.step()
    once = sum(opt.filemap.numels) * 4
    copied0 = marks[-1]
    nxt = threading.Thread(target=run, args=(batches[2],))
    nxt.start()
    # a forward that needs a unit not in memory waits for the held writes and stops copying:
    # failed once nothing was copied for 20 s (a loaded host copies slowly, not never)
    seen, since = copied0, time.time()
    try:
        while opt.streamer.bytes_copied - copied0 < once and time.time() - since < 20:
            if opt.streamer.bytes_copied != seen:
                seen, since = opt.streamer.bytes_copied, time.time()
            time.sleep(0.05)
        assert not any(ev.is_set() for ev in opt._written), "a write went through"
        assert opt.streamer.bytes_copied - copied0 >= once, \
            ("the forward did not run from memory", opt.streamer.bytes_copied - copied0, once,
             [e.is_set() for e in opt._computed], opt.pipe.stats)
    finally:
        writes.set()
    nxt.join(timeout=60)
    assert not nxt.is_alive()
    off.step()
    got = off.state_dict()["model"]
    for k in want:
        assert torch.equal(want[k], got[k]), k
    stats = opt.pipe.stats
    assert stats.behind_s > 0 and stats.steps == 3
    off.close()


def test_update_runs_during_backward_and_is_kept_only_if_gradients_stay(tmp_path, monkeypatch):
    """With parameters on disk the update starts during the last backward, each chunk once its
    gradients are final, betting that clipping leaves them as they are. step() keeps it when
    it did; clipping, a skipped step or a changed gradient drop it and the update runs from
    step() as before. Every path ends bit-equal to AdamW in memory with the same steps."""

    from myria.offload.params import ParamStreamer

    common = ["--parallel.activation_checkpoint=full", "--model.layers=3"]
    # (clip, what happens): the first step speculates; a clipped step drops it and the next one
    # does not speculate; a skipped step or a gradient changed after backward drops it
    plan = [(1e-3, "step"), (100.0, "step"), (100.0, "step"), (100.0, "skip"),
            (100.0, "step"), (100.0, "change"), (100.0, "step")]

    def train(e: Engine, during_backward=None) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(1)
        for i, (clip, what) in enumerate(plan):
            x = torch.randint(0, 512, (2, 2, 33), generator=g)
            e.forward_backward(x[..., :-1], x[..., 1:])
            if during_backward is not None:
                during_backward(i)
            if what == "change":
                p = next(p for p in e.model.parameters() if p.grad is not None)
                p.grad.mul_(0.5)
                e.gradients_changed()
            e.clip_grads(clip)
            e.step() if what != "skip" else e.skip_step()
        return {k: v.clone() for k, v in e.state_dict()["model"].items()}

    want = train(engine(tmp_path / "mem", *common))
    # the first unit's backward (the last to run) waits until some chunk of the update is
    # done: an update that starts only after backward would never come (then: timeout)
    seen: list[bool] = []
    real = ParamStreamer._before_backward

    def first_unit_waits(self, u, i):
        spec = self.opt._spec
        if i == 0 and spec is not None:
            seen.append(any(ev.wait(10) for ev in spec.computed[-1:]))
        return real(self, u, i)

    monkeypatch.setattr(ParamStreamer, "_before_backward", first_unit_waits)
    off = engine(tmp_path / "disk", *common, "--parallel.offload=nvme",
                 "--parallel.offload_params=true", "--parallel.fast_memory_gb=0.01")
    opt = off.optimizers[0]
    assert len(opt.chunks) >= 3

    def before_step(i):
        if i == 2:   # a kept speculation: every chunk is updated before step() is called,
            spec = opt._spec   # into a generation not committed until step() keeps it
            assert spec is not None and all(ev.wait(10) for ev in spec.computed)
            assert opt.gen == spec.g and not opt.gens.path(spec.new, ".json").exists()
            # the gradients it used up are still held (a dropped speculation needs them)
            assert spec.used and opt.loan.room + opt.loan.extra == 0

    got = train(off, before_step)
    assert seen == [True] * 6, seen   # every speculating step updated chunks during backward
    st = opt.pipe.stats
    assert (st.spec_confirmed, st.spec_cancelled) == (3, 3)
    assert st.spec_chunks_ahead >= len(opt.chunks)
    for k in want:
        assert torch.equal(want[k], got[k]), k
    opt.flush()
    assert opt.loan.inflight == 0 and opt.loan.room + opt.loan.extra == sum(opt.loan.grad_bytes)
    assert sorted(f.name for f in opt.dir.iterdir()) == ["gen_00000006.bin",
                                                         "gen_00000006.json", "spare.bin"]
    off.close()


def _mapping_of(addr: int) -> tuple[int, int, set[str]] | None:
    """(start, end, VmFlags) of this process's mapping holding `addr`, from /proc/self/smaps."""
    found = None
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                lo, hi = (int(x, 16) for x in head.split("-"))
                found = (lo, hi) if lo <= addr < hi else None
            elif found and line.startswith("VmFlags:"):
                return (*found, set(line.split()[1:]))
    return None


def test_a_chunk_read_back_other_than_written_stops_before_it_is_used(tmp_path, monkeypatch):
    """A bit flipped between the nvme tier's write of a generation and the next update's read
    of it (the disk, the controller, the copy into memory) is found against the checksum taken
    when the optimizer wrote the chunk: nothing is updated from it, and the error is a fault
    of the machine (exit 1: the supervisor restarts from the newest checkpoint)."""
    import os

    from myria.offload import pipeline
    from myria.offload.adamw import ReadBackMismatch

    off = engine(tmp_path, "--parallel.offload=nvme")
    opt = off.optimizers[0]
    first, real_io, flipped = opt.fd, pipeline.full_io, []

    def flipping_io(op, fd, mv, offset):
        real_io(op, fd, mv, offset)
        if op is os.preadv and fd != first and not flipped:   # generation 1, read back
            mv[len(mv) // 2] ^= 0x04
            flipped.append(offset)

    monkeypatch.setattr(pipeline, "full_io", flipping_io)
    train_steps(off, 1)     # reads generation 0 (no flip), writes generation 1
    before = {k: v.clone() for k, v in off.model.state_dict().items()}
    with pytest.raises(ReadBackMismatch, match="chunk 0 of generation 1 read back differs"):
        train_steps(off, 1)
    assert flipped and ReadBackMismatch.exit_code == 1
    assert all(torch.equal(before[k], v) for k, v in off.model.state_dict().items())


def test_a_parameter_read_back_other_than_written_stops_before_it_is_used(tmp_path,
                                                                        monkeypatch):
    """With the parameters on disk, each parameter the streamer reads for forward or backward
    (from the file, or from the update's buffer before its write) is checked against the sum
    the update took as it computed it: a changed bit stops training before the layer runs."""
    from myria.offload.adamw import OffloadedAdamW, ReadBackMismatch

    off = engine(tmp_path, "--parallel.activation_checkpoint=full", "--parallel.offload=nvme",
                 "--parallel.offload_params=true")
    train_steps(off, 1)
    real, flipped = OffloadedAdamW.read_params, []

    def flipping(self, slab, view, soff, at, n, gen, fd):
        copied = real(self, slab, view, soff, at, n, gen, fd)
        if not flipped:
            slab[soff] ^= 0x04
            flipped.append(gen)
        return copied

    monkeypatch.setattr(OffloadedAdamW, "read_params", flipping)
    with pytest.raises(ReadBackMismatch, match=r"parameter \d+ of \S+ in generation 1 read back "
                                               "differs from what the optimizer wrote"):
        train_steps(off, 1)
    assert flipped == [1]


def test_io_buffers_are_huge_page_mappings_given_back_when_freed():
    """The I/O buffers of a huge page and more are their own 2 MiB-aligned mappings marked for
    transparent huge pages (4 KiB pages split O_DIRECT into ~1 MB requests); a buffer lent from
    gradient memory must give it back once freed, so the mapping has to go with the tensor."""
    thp = "/sys/kernel/mm/transparent_hugepage/enabled"
    try:
        mode = open(thp).read()
    except OSError:
        pytest.skip("no transparent huge pages in this kernel")
    small = aligned_buffer(3 * ALIGN + 5)
    assert small.numel() == 3 * ALIGN + 5 and small.data_ptr() % ALIGN == 0
    n = 3 * HUGE_PAGE + 12345
    buf = aligned_buffer(n)
    addr = buf.data_ptr()
    assert buf.numel() == n and addr % HUGE_PAGE == 0
    buf.fill_(7)
    lo, hi, flags = _mapping_of(addr)
    assert hi >= addr + n
    if "[never]" not in mode:
        assert "hg" in flags   # MADV_HUGEPAGE
    view = buf[HUGE_PAGE:]   # a view keeps the mapping
    del buf
    assert _mapping_of(addr) is not None and int(view[0]) == 7
    del view
    gone = _mapping_of(addr)
    assert gone is None or gone[:2] != (lo, hi), "the buffer's mapping outlived its tensor"


def test_parameter_offload_needs_recomputation(tmp_path):
    with pytest.raises(ConfigError, match="activation_checkpoint = 'full' or 'selective'"):
        engine(tmp_path, "--parallel.offload=nvme", "--parallel.offload_params=true")


def test_checkpoint_links_the_state_and_checks_it(tmp_path):
    e = engine(tmp_path, "--parallel.offload=nvme")
    train_steps(e, 2)
    ckpt = CheckpointManager(tmp_path / "checkpoints")
    assert ckpt.save(2, e, {"scheduler": {}})
    path = ckpt.path_for(2)
    meta = json.loads((path / "meta.json").read_text())
    name = "offload/rank00000.part0.bin"
    assert name in meta["files"] and name in meta["checksums"]
    assert (path / name).stat().st_nlink == 2          # a hard link, not a copy
    opt = e.optimizers[0]
    assert (path / name).stat().st_ino == opt.gens.path(2).stat().st_ino
    # new generations: a replaced generation's file is written again as a later one, but never
    # the linked one (only its name in the offload directory goes)
    ino = {}
    for gen in (3, 4, 5):
        train_steps(e, 1)
        opt.flush()
        ino[gen] = opt.gens.path(gen).stat().st_ino
    assert (path / name).stat().st_nlink == 1 and ckpt.verify(path) is None
    assert (path / name).stat().st_ino not in ino.values()
    assert ino[5] == ino[3] != ino[4]   # generation 3's file became 5's
    assert (opt.dir / "spare.bin").stat().st_ino == ino[4]
    with open(path / name, "r+b") as fh:                # damage the offloaded state
        fh.seek(100)
        fh.write(b"\xff" * 8)
    assert "fails its checksum" in ckpt.verify(path)
    e.close()


def test_checkpoint_of_a_generation_changed_on_disk_is_quarantined(tmp_path):
    """A bit of the linked generation changed on disk between its write and the save (CRC-32
    taken over the changed bytes) is found against the checksums the update took as it wrote
    the chunks: the checkpoint is never committed, its files go to quarantine."""
    e = engine(tmp_path, "--parallel.offload=nvme")
    train_steps(e, 2)
    opt = e.optimizers[0]
    opt.flush()
    with open(opt.gens.path(opt.gen), "r+b") as fh:
        fh.seek(100)
        b = fh.read(1)[0]
        fh.seek(100)
        fh.write(bytes([b ^ 0x04]))
    ckpt = CheckpointManager(tmp_path / "checkpoints", max_failures=0)
    assert not ckpt.save(2, e, {"scheduler": {}})
    assert ckpt.committed() == []
    assert "offload/rank00000.part0.bin: chunk 0 differs from what the optimizer wrote" in \
        ckpt.last_failure
    [reason] = (tmp_path / "checkpoints" / "quarantine").glob("*/QUARANTINED.json")
    assert "differs from what the optimizer wrote" in json.loads(reason.read_text())["reason"]
    e.close()


def test_resume_with_another_offload_setting_is_refused(tmp_path):
    e = engine(tmp_path, "--parallel.offload=nvme")
    train_steps(e, 1)
    ckpt = CheckpointManager(tmp_path / "checkpoints")
    ckpt.save(1, e, {"scheduler": {}})
    e.close()
    plain = engine(tmp_path / "plain")
    with pytest.raises(CheckpointError, match="parallel.offload = 'nvme'"):
        ckpt.load(ckpt.path_for(1), plain)


def cli_train(run_dir, data, *extra, nproc=None, env=None, check=True):
    args = ["train", "--run-dir", str(run_dir), f"--data.path={data}", *TINY, *extra]
    if nproc:
        args += ["--nproc", str(nproc)]
    return run_cli(*args, env=env, check=check)


def same_params(a, b) -> bool:
    pa, pb = final_params(a), final_params(b)
    return pa.keys() == pb.keys() and all(torch.equal(pa[k], pb[k]) for k in pa)


PARAMS_ON_DISK = ["--parallel.offload_params=true", "--parallel.activation_checkpoint=full"]
# ... with no clipping: every update runs during backward (speculation kept at every step)
DURING_BACKWARD = [*PARAMS_ON_DISK, "--training.grad_clip=0"]


FULL_DIR_STEPS = ["--training.steps=8", "--checkpoint.interval=4"]


@pytest.fixture(scope="module")
def in_memory8(tmp_path_factory, tiny_data):
    """One process, FULL_DIR_STEPS, nothing offloaded: the run every full-offload-dir case,
    stopped and resumed, must end equal to."""
    d = tmp_path_factory.mktemp("in_memory8")
    cli_train(d, tiny_data, *FULL_DIR_STEPS)
    return d


@pytest.mark.slow
@pytest.mark.parametrize("extra", [[], PARAMS_ON_DISK, DURING_BACKWARD],
                         ids=["moments", "params", "params-during-backward"])
def test_full_offload_dir_stops_cleanly_and_resumes(tmp_path, tiny_data, in_memory8, extra):
    """Moments on disk: the update fails in the step; parameters too: the update runs behind
    training (or during backward) and its failure stops training, with the same one line."""
    run = tmp_path / "run"
    steps = [*FULL_DIR_STEPS, "--parallel.offload=nvme", *extra]
    p = cli_train(run, tiny_data, *steps, env={"MYRIA_FAULT": "offload-diskfull:step=6"},
                  check=False)
    assert p.returncode == 2, p.stderr[-2000:]
    err = [x for x in p.stderr.splitlines() if x.startswith("myria train: error:")]
    assert len(err) == 1 and "is full (No space left on device" in err[0], p.stderr[-2000:]
    assert "Traceback" not in p.stderr
    ckpt = CheckpointManager(run / "checkpoints")
    assert [c.name for c in ckpt.committed()] == ["step_00000004"]
    assert ckpt.verify(ckpt.committed()[0]) is None
    assert not list((run / "checkpoints").glob("*.tmp"))
    # space is back: the same command resumes and ends as a run that never stopped
    cli_train(run, tiny_data, *steps)
    assert losses(run) == losses(in_memory8) and same_params(run, in_memory8)


def test_small_budget_is_one_line_before_any_rank_starts(tmp_path, tiny_data):
    p = cli_train(tmp_path / "run", tiny_data, "--parallel.offload=nvme",
                  "--parallel.fast_memory_gb=0.001", nproc=2, check=False)
    assert p.returncode == 2, p.stderr[-2000:]
    assert p.stderr.strip().splitlines() == [p.stderr.strip()]
    assert "parallel.fast_memory_gb = 0.001 is too small for even one layer" in p.stderr
    assert not (tmp_path / "run").exists()


def test_unwritable_offload_dir_is_one_clear_error(tmp_path):
    """A file in the way is one error; a folder under one that does not exist (a mistyped
    path, an unmounted disk) is refused with the layout, before any process starts, instead of
    being created on whatever disk holds its parents."""
    from myria import config
    from myria.errors import ConfigError
    from myria.layout import Layout

    (tmp_path / "file").write_text("not a directory")
    with pytest.raises(OffloadError, match="is not writable: Not a directory"):
        engine(tmp_path, "--parallel.offload=nvme",
               f"--parallel.offload_dir={tmp_path / 'file' / 'sub'}")
    cfg = config.load(None, ["--parallel.offload=nvme", "--training.device=cpu",
                             f"--parallel.offload_dir={tmp_path / 'mnt' / 'nvme0' / 'x'}"])
    with pytest.raises(ConfigError, match=r"nvme0'? does not exist \(a mistyped path"):
        Layout.resolve(cfg.parallel, 1).check(cfg, "cpu")
    assert not (tmp_path / "mnt").exists()


@pytest.mark.slow
def test_two_fsdp_ranks_on_disk_match_memory_and_resume(tmp_path, tiny_data):
    mem, disk = tmp_path / "mem", tmp_path / "disk"
    common = ["--training.steps=10", "--checkpoint.interval=0"]
    cli_train(mem, tiny_data, *common, nproc=2)
    p = cli_train(disk, tiny_data, *common, "--parallel.offload=nvme", "--stop-after", "5",
                  nproc=2)
    assert "stopped after step 5" in p.stdout
    # resumed on another layout: refused, naming the one it was saved with, and the run
    # directory's config.json stays the one its checkpoint trained with
    config_json = (disk / "config.json").read_bytes()
    p = cli_train(disk, tiny_data, *common, "--parallel.offload=nvme", "--training.steps=12",
                  check=False)
    assert p.returncode != 0 and "2 process(es), --parallel.dp_shard=2" in p.stderr, p.stderr
    assert (disk / "config.json").read_bytes() == config_json
    cli_train(disk, tiny_data, *common, "--parallel.offload=nvme", nproc=2)
    assert losses(mem) == losses(disk) and same_params(mem, disk)
    for r in (0, 1):
        stats = json.loads((disk / "offload_stats" / f"rank{r:05d}.json").read_text())
        assert stats["steps"] == 5 and stats["gen"] == 10


@pytest.mark.slow
def test_tensor_parallel_on_disk_matches_memory(tmp_path, tiny_data):
    """Tensor parallelism leaves some gradients placed otherwise than their parameters (a norm
    weight's pending its sum over the group, the embedding's whole on every rank): the update
    on disk takes each rank's part as its parameter is placed, as AdamW in memory does."""
    mem, disk = tmp_path / "mem", tmp_path / "disk"
    common = ["--training.steps=4", "--checkpoint.interval=0", "--parallel.tp=2"]
    cli_train(mem, tiny_data, *common, nproc=2)
    cli_train(disk, tiny_data, *common, "--parallel.offload=nvme", nproc=2)
    assert losses(mem) == losses(disk) and same_params(mem, disk)


@pytest.mark.slow
@pytest.mark.parametrize("extra,nproc,rank", [([], 2, 1), (PARAMS_ON_DISK, 1, 0),
                                              (DURING_BACKWARD, 1, 0)],
                         ids=["moments", "params", "params-during-backward"])
def test_killed_mid_step_under_supervise_resumes_bit_equal(tmp_path, tiny_data, extra, nproc,
                                                           rank):
    """Killed half-way through writing generation 10 (with parameters on disk: on the thread
    that runs the update behind training). By then the step-4 checkpoint is committed (the
    step-8 save waited for it before it began); the overlapped step-8 save may be too."""
    common = [*TINY, f"--data.path={tiny_data}", "--training.steps=12",
              "--checkpoint.interval=4", "--parallel.offload=nvme", *extra]
    ref, run = tmp_path / "ref", tmp_path / "run"
    run_cli("train", "--run-dir", str(ref), "--nproc", str(nproc), *common)
    run_cli("supervise", "--run-dir", str(run), "--nproc", str(nproc), *common,
            "--resilience.heartbeat_s=0.5", "--resilience.hang_timeout_s=30",
            "--resilience.backoff_s=0.2", "--resilience.diagnose=false",
            env={"MYRIA_FAULT": f"offload-kill:rank={rank}:step=10"}, timeout=400)
    summary = json.loads((run / "supervisor_summary.json").read_text())
    assert summary["status"] == "succeeded" and summary["restarts"] == 1, summary
    assert summary["faults"][0]["resumed_from"] in (4, 8), summary
    assert f"fault hook offload-kill_rank{rank}_step10 fired" in \
        (run / "supervisor.log").read_text()
    assert losses(run) == losses(ref) and same_params(run, ref)


# -- the planner and the dry-run --------------------------------------------------------------
def _llama13b(gpus: int):
    from myria.sim import runspec

    (run,) = runspec.loads(f"""
[model]
arch = "llama"
layers = 40
hidden = 5120
heads = 40
[training]
global_batch = 16
[cluster]
gpu = "a100-sxm-80gb"
gpus = {gpus}
""")
    return run


def test_planner_proposes_offload_when_nothing_else_fits():
    from myria.sim.planner import plan

    alone = plan(_llama13b(1), top=10)    # 13B parameters x 16 bytes: no layout fits one GPU
    assert alone.offloaded and alone.ranked
    # the NVMe tier is priced fastest but myria runs it on CPU only: first, marked "priced,
    # not runnable by myria"; the trainer's best (FSDP2's CPU offload on the GPU) is named
    nvme = [r for r in alone.ranked if r.layout["offload"] == "nvme"]
    assert alone.ranked[0] is nvme[0] and not alone.ranked[0].extra["runnable"]
    for r in nvme:
        assert r.layout["offload_params"] and not r.extra["runnable"]
        assert r.memory.total < r.memory.capacity and r.memory.weights < 0.2 * r.memory.gradients
        assert r.memory.host_bytes_per_node > 13e9 * 12 and r.breakdown["offload"] >= 0
    b = alone.best_runnable
    assert b is not None and b.extra["runnable"] and b.layout["offload"] == "cpu"
    assert b.mfu < alone.ranked[0].mfu
    # priced: exposed where compute cannot hide the disk (micro-batch 8 or more hides it)
    assert any(r.breakdown["offload"] > 0 for r in nvme)
    eight = plan(_llama13b(8), top=5)    # fits on eight GPUs: no offload proposed
    assert not eight.offloaded and all(r.layout["offload"] == "none" for r in eight.ranked)


def test_offload_time_is_the_disk_beyond_the_update():
    from myria.sim.perf import simulate

    base = _llama13b(8).replace(training={"zero_stage": 3, "micro_batch": 2})
    slow = simulate(base.replace(training={"offload": "nvme"}, cluster={"nvme_gbs": 1.0}))
    fast = simulate(base.replace(training={"offload": "nvme"}, cluster={"nvme_gbs": 1000.0}))
    none = simulate(base)
    n_opt = 12.85e9 / 8                          # each device's shard, read and written
    # a fast disk: the host bus (25.6 GB/s per A100) is the limit, beyond the update's time
    bus = 2 * 12 * n_opt / 25.6e9 - fast.breakdown["optimizer"]
    assert fast.breakdown["offload"] == pytest.approx(bus, rel=0.03)
    # a slow disk: 8 devices share one server's 1 GB/s
    disk = 8 * 2 * 12 * n_opt / 1e9 - slow.breakdown["optimizer"]
    assert slow.breakdown["offload"] == pytest.approx(disk, rel=0.03)
    assert slow.memory.optimizer == 0 and none.memory.optimizer > 0
    # parameters on disk too: the update runs behind training, so the state's stream and the
    # layers' reads share the disk with compute and are exposed only beyond it (slope 1 in the
    # disk time, offset by the compute and the update's arithmetic)
    params = base.replace(training={"offload": "nvme", "offload_params": True})
    fast_p = simulate(params.replace(cluster={"nvme_gbs": 1000.0}))
    assert fast_p.breakdown["offload"] == 0.0
    off = {g: simulate(params.replace(cluster={"nvme_gbs": g})).breakdown["offload"]
           for g in (0.25, 0.5, 1.0)}
    assert off[1.0] > 0 and off[0.25] - off[0.5] == pytest.approx(2 * (off[0.5] - off[1.0]))
    hidden = off[0.25] - 2 * off[0.5]   # offload(g) = disk bytes / g - hidden
    assert 0.5 * fast_p.iteration_time_s < hidden <= fast_p.iteration_time_s * (1 + 1e-9)


def test_dry_run_accounts_for_offload():
    from tests.train.test_train import memory_parts, predicted_line

    base = ["train", "--config", "configs/llama3-8b.toml", "--dry-run", "--nproc", "8",
            "--parallel.tp=8", "--training.data_parallel=fsdp"]
    plain = memory_parts(predicted_line(run_cli(*base).stdout))[0]
    p = run_cli(*base, "--parallel.offload=nvme", "--parallel.fast_memory_gb=40")
    off = memory_parts(predicted_line(p.stdout))[0]
    assert off["optimizer"] == 0 < plain["optimizer"]
    line = next(x for x in p.stdout.splitlines() if x.startswith("# offload nvme"))
    assert "I/O buffers" in line and "(budget 40 GB)" in line and "fits in 40 GB" in p.stdout
    # the H100 figure is said to be a planning one: the tier runs on CPU
    assert "nvme tier runs on CPU in this version, not on h100" in p.stdout


def test_nvme_tier_refuses_a_gpu_in_one_line():
    from myria.train.preflight import check_run
    cfg = config.load(None, [*SMALL, "--parallel.offload=nvme"])
    layout = Layout.resolve(cfg.parallel, 1)
    check_run(cfg, layout, "cpu")
    with pytest.raises(ConfigError, match="runs on CPU in this version, not on cuda"):
        check_run(cfg, layout, "cuda")


def test_budget_counts_activations_in_the_precision_the_run_computes_in():
    """training.dtype = auto is bf16 on CUDA where FSDP2's mixed-precision policy applies (data
    or context parallel ranks, or one process on a one-rank mesh), fp32 under DDP."""
    from myria.layout import Layout
    from myria.offload.budget import activation_bytes

    cfg = config.load(None, SMALL)
    one, two = Layout(), Layout(dp_shard=2)
    assert cfg.training.dtype == "auto" and cfg.training.device == "auto"
    # 16-bit activations (log-sum-exp and the logits' fp32 copy stay 4-byte)
    assert activation_bytes(cfg, two, "cuda") < 0.6 * activation_bytes(cfg, two, "cpu")
    # one process in bf16 shards over a one-rank mesh: the same policy (tests/gpu)
    assert activation_bytes(cfg, one, "cuda") < 0.6 * activation_bytes(cfg, one, "cpu")
    ddp = config.load(None, [*SMALL, "--training.data_parallel=ddp"])
    assert activation_bytes(ddp, two, "cuda") == activation_bytes(ddp, two, "cpu")


def test_offload_package_imports_no_simulator_and_no_private_names():
    """The tier plans with models/memory.py, like the planner, not with sim/; its modules use
    each other's public names only."""
    import ast
    from pathlib import Path

    import myria.offload

    for path in [*Path(myria.offload.__file__).parent.glob("*.py"),
                 Path(myria.offload.__file__).parents[1] / "models" / "memory.py"]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                assert not node.module.startswith("myria.sim"), (path.name, node.module)
                if node.module.startswith("myria."):
                    private = [a.name for a in node.names if a.name.startswith("_")]
                    assert not private, (path.name, node.module, private)


def test_budget_counts_the_parameters_fsdp2_holds_gathered():
    """Under ZeRO-2 FSDP2 keeps every block gathered from its forward to its backward (the
    whole model beside its shards at the peak), under FSDP the root and the blocks in flight;
    DDP and the zero-bubble schedules' manual reduction shard nothing and gather nothing."""
    from myria.models.flops import param_counts
    from myria.offload.budget import plan_for_config

    nvme = [*SMALL, "--model.layers=6", "--parallel.offload=nvme"]
    two = Layout(dp_shard=2)

    def plan(*more, layout=two, device="cpu"):
        return plan_for_config(config.load(None, [*nvme, *more]), layout, device)

    m = config.load(None, nvme).model
    pc = param_counts(m)
    n, block = pc.total(m.layers), pc.total(1) - pc.total(0)
    zero2, fsdp = plan("--training.data_parallel=zero2"), plan("--training.data_parallel=fsdp")
    ddp = plan("--training.data_parallel=ddp")
    assert zero2.params == pytest.approx(4 * n / 2, abs=8) and zero2.gathered == 4 * n
    assert fsdp.gathered == 4 * (n - (m.layers - 2) * block)   # the root and 2 blocks
    assert ddp.gathered == 0 and ddp.params == 4 * n
    # in bf16 on CUDA the gathered copies are 2 bytes a parameter
    assert plan("--training.data_parallel=zero2", "--training.dtype=bfloat16",
                device="cuda").gathered == 2 * n
    zb = Layout(dp_shard=2, pp=2, schedule="zbv")
    assert plan("--parallel.pp=2", "--parallel.schedule=zbv", layout=zb).gathered == 0
    assert "gathered parameters" in zero2.describe()


def test_room_for_the_tier_files_checked_before_any_worker_starts(tmp_path, monkeypatch):
    """Two generations per local rank must fit (else one line before launch); the kept
    checkpoints' generations on the same file system draw a warning; an earlier start's
    generation files count as free space, a checkpoint-linked one does not."""
    import shutil
    from collections import namedtuple

    from myria.offload import nvme
    from myria.offload.budget import plan_for_config

    cfg = config.load(None, [*SMALL, "--parallel.offload=nvme", "--checkpoint.keep=2"])
    one = Layout()
    gen = plan_for_config(cfg, one, "cpu").offloaded
    usage = namedtuple("usage", "total used free")

    def free(n):
        monkeypatch.setattr(shutil, "disk_usage", lambda _: usage(0, 0, int(n)))

    free(2 * 2 * gen - 1)
    with pytest.raises(ConfigError, match=r"2 rank\(s\) on this host.*free space or set "
                                          "parallel.offload_dir"):
        nvme.check_disk(cfg, one, tmp_path, local_ranks=2)
    free(2 * 2 * gen)
    assert "the 2 checkpoint(s) kept" in nvme.check_disk(cfg, one, tmp_path, local_ranks=2)
    free(4 * 2 * gen)
    assert nvme.check_disk(cfg, one, tmp_path, local_ranks=2) is None
    # an earlier start's generation is reused or removed; a checkpoint's link keeps its blocks
    old = tmp_path / "offload" / "rank00000" / "part0"
    old.mkdir(parents=True)
    (old / "gen_00000003.bin").write_bytes(b"\1" * int(gen))
    free(2 * 2 * gen - 1)
    assert "the 2 checkpoint(s) kept" in nvme.check_disk(cfg, one, tmp_path, local_ranks=2)
    (tmp_path / "linked.bin").hardlink_to(old / "gen_00000003.bin")
    with pytest.raises(ConfigError):
        nvme.check_disk(cfg, one, tmp_path, local_ranks=2)
