"""`myria supervise`: its arguments, the one-line refusals judged before torch is imported, and
the start of the Supervisor (myria.resilience.supervisor) on this host.

    myria supervise --config configs/demo.toml --run-dir runs/demo --nproc 2 [--section.key=value]
    # several hosts: the same command on each, plus
    #   --nnodes 4 --rdzv-endpoint HOST0:29400 --rdzv-id JOB
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from myria.errors import ConfigError

ACCEPTS_OVERRIDES = True


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="TOML run config (default: built-in defaults)")
    p.add_argument("--run-dir", required=True, help="run directory (checkpoints, metrics, logs, "
                   "supervisor_summary.json)")
    p.add_argument("--nproc", type=int, default=1, help="worker processes (ranks) on this host")
    p.add_argument("--nnodes", default="1", help="hosts in the job: N or MIN:MAX (elastic)")
    p.add_argument("--rdzv-endpoint", default="", help="HOST:PORT of the rendezvous (default: "
                   "127.0.0.1 and a free port, one host)")
    p.add_argument("--rdzv-id", default="", help="job id shared by the hosts of one job")
    p.add_argument("--max-time", metavar="DURATION", default=None,
                   help="wall-time limit of this job, counted from the supervisor's start, as "
                   "a scheduler writes it (Slurm's [D-]HH:MM:SS or MM) or with a unit (90m, 2h): "
                   "the workers stop cleanly with a committed checkpoint before it passes, "
                   "restarts included (training.max_time_s)")
    from myria.train.preflight import add_resume_arguments

    add_resume_arguments(p)
    p.add_argument("--job-status", action="store_true", help="print job --rdzv-id's outcome "
                   "from RUN_DIR's summary and exit 0 only if it succeeded (the Slurm script's "
                   "exit)")
    p.epilog = ("Config overrides --section.key=value pass to the workers as in `myria train`; "
                "[resilience] sets heartbeats, timeouts, restarts and the blocklist hook.")


def run(args) -> int:
    if args.job_status:
        from myria.resilience.multihost import job_status

        return job_status(Path(args.run_dir), args.rdzv_id)
    from myria.train.preflight import (
        check_data_overrides,
        max_time_overrides,
        resume_overrides,
        run_config,
    )

    args.overrides += resume_overrides(args) + max_time_overrides(args)
    cfg, _ = run_config(args.config, args.overrides, args.run_dir)  # model.init_from too
    check_data_overrides(args.overrides, cfg)
    min_nodes, max_nodes = _parse_nnodes(args.nnodes)
    from myria import faults, rundir
    from myria.data.mixture import open_dataset
    from myria.layout import Layout
    from myria.train.preflight import (
        check_before_torch,
        check_data_and_model,
        check_launch,
        check_nproc,
        check_recorded_data,
        check_validation,
        preflight,
    )

    faults.parse(os.environ.get("MYRIA_FAULT"))  # a bad test hook: one line, no restarts
    # one line each, before anything; what needs torch (seconds to import) comes last
    if args.nproc < 1:
        check_nproc(args.nproc, "cpu")
    check_before_torch(cfg, args.nproc, args.nproc * min_nodes, True)
    check_recorded_data(cfg, args.run_dir)
    data = open_dataset(cfg.data, cfg.model.seq_len, verify=False)
    check_validation(cfg)
    # a finished run answers at once; a new run directory is made only once every check passed
    if Path(args.run_dir).exists() and (done := preflight(cfg, args.run_dir, args.stop_after)):
        print(done)
        return 0
    for line in faults.unreachable(os.environ.get("MYRIA_FAULT"), cfg.training.steps,
                                   args.nproc * max_nodes, args.run_dir):
        print(line, file=sys.stderr)
    from myria.train.distributed import device_type

    check_nproc(args.nproc, device_type(cfg.training.device))
    check_data_and_model(cfg, data, args.run_dir)
    check_launch(cfg, Layout.resolve(cfg.parallel, args.nproc * min_nodes),
                 device_type(cfg.training.device), args.run_dir, args.nproc)
    from myria.resilience import injob

    injob.check(cfg, min_nodes, max_nodes, args.nproc)
    if done := preflight(cfg, args.run_dir, args.stop_after):
        print(done)
        return 0
    rundir.lock(args.run_dir, "supervise", job=args.rdzv_id)   # one job per run directory
    worker_argv = ["train", "--run-dir", str(args.run_dir)]
    if args.config:
        worker_argv += ["--config", str(args.config)]
    worker_argv += list(args.overrides)
    if args.stop_after is not None:
        worker_argv += ["--stop-after", str(args.stop_after)]
    from myria.resilience.supervisor import Supervisor

    sup = Supervisor(cfg, Path(args.run_dir), args.nproc, worker_argv, min_nodes=min_nodes,
                     max_nodes=max_nodes, rdzv_endpoint=args.rdzv_endpoint,
                     rdzv_id=args.rdzv_id)
    return sup.run()


def _parse_nnodes(text: str) -> tuple[int, int]:
    try:
        lo, _, hi = str(text).partition(":")
        a, b = int(lo), int(hi or lo)
    except ValueError:
        raise ConfigError(f"--nnodes {text!r}: expected N or MIN:MAX") from None
    if not 1 <= a <= b:
        raise ConfigError(f"--nnodes {text!r}: need 1 <= MIN <= MAX")
    return a, b
