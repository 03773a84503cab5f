"""Start N local worker processes through torch elastic (the launcher behind torchrun).

`myria train --nproc N` re-runs itself as N workers, each one rank; workers inherit the same
arguments without --nproc. Across hosts, use torchrun (or `myria supervise`) with a rendezvous
endpoint instead: the workers are the same. `myria supervise` (myria.resilience.supervisor) uses
the same torch elastic agent with heartbeats, fault detection and recovery on top.
"""

from __future__ import annotations

import os
import socket
import sys
import uuid

from myria.errors import LaunchError


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def inside_launcher() -> bool:
    """True when this process is already a worker started by torchrun / torch elastic."""
    return "TORCHELASTIC_RUN_ID" in os.environ or "RANK" in os.environ


def launch_local(nproc: int, argv: list[str], max_restarts: int = 0) -> None:
    """Run `python -m myria *argv` as `nproc` ranks on this host; raise LaunchError on failure."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    # The agent and the workers would otherwise share one TCPStore, which makes restarts
    # flaky in torch 2.13 (upstream issues #135712, #167288).
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=str(uuid.uuid4()),
        rdzv_backend="c10d", rdzv_endpoint=f"127.0.0.1:{free_port()}",
        # explicit timeouts: joining, waiting for late hosts (none: fixed size), closing, and
        # each rendezvous-store read
        rdzv_configs={"join_timeout": 300, "last_call_timeout": 1, "close_timeout": 30,
                      "read_timeout": 120},
        max_restarts=max_restarts, monitor_interval=0.2,
        start_method="spawn",
    )
    try:
        elastic_launch(config, entrypoint=sys.executable)("-m", "myria", *argv)
    except SignalException as e:  # the agent forwarded it; workers saved at their next step
        raise LaunchError(f"stopped by {e.sigval.name}: the workers were asked to save a "
                          "checkpoint and exit; run the same command to resume") from None
    except ChildFailedError as e:
        first = min(e.failures)
        f = e.failures[first]
        raise LaunchError(f"worker rank {f.local_rank} failed with exit code {f.exitcode} "
                          f"({len(e.failures)} of {nproc} ranks failed); its message is above"
                          ) from None
