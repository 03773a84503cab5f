"""Shared fixtures: a small prepared corpus and a helper that runs the `myria` CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def bench_module(name: str):
    """A script of bench/ imported as a module (bench/ is not a package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod

# A model small enough that a 2-process step takes milliseconds. One CPU thread per process:
# a one-process run would otherwise take every core, and on a host busy with other work its
# threads spin-wait for each other and cost several times the CPU of one thread;
# several processes get one thread each anyway.
TINY = ["--model.vocab_size=1024", "--model.layers=2", "--model.hidden=64", "--model.heads=4",
        "--model.kv_heads=2", "--model.seq_len=64", "--training.global_batch=8",
        "--training.micro_batch=2", "--optimizer.warmup_steps=4", "--logging.tensorboard=false",
        "--data.prefetch=2", "--training.threads=1"]


def moe_cfg(**kw):
    """A tiny mixture-of-experts model config (4 experts, top-1) for layer-level tests."""
    from myria.config import ModelConfig

    base = dict(vocab_size=96, layers=2, hidden=16, heads=2, seq_len=16, ffn_hidden=24,
                experts=4, top_k=1)
    base.update(kw)
    return ModelConfig(**base)


def run_cli(*args: str, env: dict | None = None, check: bool = True,
            timeout: float = 300) -> subprocess.CompletedProcess:
    """Run `python -m myria ARGS` in a fresh process, as a user would. The process is forked
    from a forkserver that has imported torch and myria (`myria.train.launch.fork_module`, as
    `myria supervise` starts its workers), so that each of the suite's hundreds of commands
    does not import them again; with MYRIA_TEST_SPAWN=1 each starts a new interpreter. What
    a new interpreter imports (no torch for `--help` or the planner) is tested with new
    interpreters (tests/test_imports.py)."""
    e = dict(os.environ)
    e.pop("MYRIA_FAULT", None)
    e.update(env or {})
    if os.environ.get("MYRIA_TEST_SPAWN"):
        p = subprocess.run([sys.executable, "-m", "myria", *args], capture_output=True,
                           text=True, env=e, timeout=timeout, cwd=ROOT)
    else:
        p = _forked_cli(list(args), e, timeout)
    if check and p.returncode != 0:
        raise AssertionError(f"myria {' '.join(args)} exited {p.returncode}\n"
                             f"stdout:\n{p.stdout[-3000:]}\nstderr:\n{p.stderr[-5000:]}")
    return p


def _forked_cli(args: list[str], env: dict, timeout: float) -> subprocess.CompletedProcess:
    """`python -m myria ARGS` forked (`run_cli`): its exit status and output, as
    `subprocess.run` gives them; on `timeout`, killed and TimeoutExpired raised."""
    import signal
    import tempfile

    from myria.train.launch import fork_module

    with tempfile.TemporaryDirectory(prefix="myria-cli-") as d:
        out, err = Path(d) / "stdout", Path(d) / "stderr"
        proc = fork_module(("-u", "-m", "myria", *args), env, str(out), str(err), cwd=str(ROOT))
        try:
            code = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.signal_group(signal.SIGKILL)
            proc.wait(60)
            raise subprocess.TimeoutExpired(["myria", *args], timeout, out.read_text(),
                                            err.read_text()) from None
        read = lambda f: f.read_text(errors="replace") if f.exists() else ""  # noqa: E731
        return subprocess.CompletedProcess(["myria", *args], code, read(out), read(err))


def run_cli_all(*commands: list[str], **kw) -> list[subprocess.CompletedProcess]:
    """`run_cli` of each of `commands` (independent ones), as many at a time as there are cores:
    each is mostly one thread (imports, the planner), so a 2-core host runs two in the time of
    one. Results in the order given."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=max(1, os.cpu_count() or 1)) as pool:
        return list(pool.map(lambda c: run_cli(*c, **kw), commands))


def train(run_dir: Path, data: Path | str, *args: str, nproc: int = 1, env: dict | None = None,
          check: bool = True, timeout: float = 300) -> subprocess.CompletedProcess:
    """`myria train` into `run_dir` on the prepared corpus `data` with the config flags `args`,
    on `nproc` local processes: the one runner of the tests' training jobs."""
    return run_cli("train", "--run-dir", str(run_dir), f"--data.path={data}", *args,
                   *(["--nproc", str(nproc)] if nproc > 1 else []), env=env, check=check,
                   timeout=timeout)


def running(pid: int) -> bool:
    """Whether process `pid` runs (a zombie is gone for a test's purpose)."""
    try:
        return "Z" not in open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False


def wait_gone(pids, limit_s: float = 60.0) -> float:
    """Seconds until none of `pids` runs (at most about `limit_s`)."""
    import time

    t0 = time.time()
    while time.time() - t0 < limit_s and any(running(pid) for pid in pids):
        time.sleep(0.1)
    return time.time() - t0


def losses(run_dir: Path) -> dict[int, float]:
    rows = [json.loads(x) for x in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def final_params(run_dir: Path) -> dict:
    """The parameters of a run's newest checkpoint, as a plain state dict."""
    from myria.train.export import load_checkpoint_model
    model, _, _ = load_checkpoint_model(run_dir, None)
    return dict(model.state_dict())


def assert_bit_equal(run: Path, reference: Path, steps: int) -> None:
    """`run` (which met faults) against the uninterrupted `reference`: every step logged
    exactly once, the same loss at every step, the same final parameters bit for bit."""
    import torch

    logged = [json.loads(x)["step"] for x in (Path(run) / "metrics.jsonl").read_text()
              .splitlines() if "loss" in x]
    assert sorted(logged) == list(range(1, steps + 1)), "each step exactly once"
    ref, got = losses(reference), losses(run)
    assert [got[s] for s in range(1, steps + 1)] == [ref[s] for s in range(1, steps + 1)]
    pa, pb = final_params(reference), final_params(run)
    assert pa.keys() == pb.keys() and all(torch.equal(pa[k], pb[k]) for k in pa)


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory) -> Path:
    """The first 20 State of the Union speeches, 1024-token BPE."""
    out = tmp_path_factory.mktemp("data") / "tiny"
    run_cli("prepare", "--corpus", "demo", "--max-docs", "20", "--vocab-size", "1024",
            "--out", str(out), "--quiet")
    return out


# -- 4-rank runs shared by the observability and straggler tests ------------------------------
OBSERVE_STEPS = 10
OBSERVE_ARGS = [*TINY, "--training.global_batch=16", f"--training.steps={OBSERVE_STEPS}",
                "--checkpoint.interval=0", "--training.eval_interval=0"]


def train4(run_dir: Path, data: Path, *extra: str, fault: str | None = None) -> Path:
    """`myria train` on 4 ranks with the event timer on (the default)."""
    train(run_dir, data, *OBSERVE_ARGS, *extra, nproc=4,
          env={"MYRIA_FAULT": fault} if fault else None, timeout=600)
    return run_dir


@pytest.fixture(scope="session")
def slow_dp(tmp_path_factory, tiny_data) -> Path:
    """4-rank data parallel, rank 2 slowed 2x from step 1."""
    return train4(tmp_path_factory.mktemp("slow_dp"), tiny_data, fault="slow:rank=2:factor=2")


@pytest.fixture(scope="session")
def clean_dp(tmp_path_factory, tiny_data) -> Path:
    """4-rank data parallel, no fault."""
    return train4(tmp_path_factory.mktemp("clean_dp"), tiny_data)
