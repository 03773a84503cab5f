"""Process-group start-up: who am I, which device and backend, and explicit timeouts.

torchrun / torch elastic set RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and
MASTER_PORT. The backend is chosen by detection: NCCL when CUDA is present, gloo on CPU. This is
the only place where the GPU and CPU paths differ in start-up.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class DistEnv:
    """This process's place in the job."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    device: torch.device = torch.device("cpu")
    backend: str = "gloo"

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def read_env() -> DistEnv:
    """Rank and world from the launcher's environment (a lone process is rank 0 of 1)."""
    return DistEnv(
        rank=int(os.environ.get("RANK", 0)),
        world_size=int(os.environ.get("WORLD_SIZE", 1)),
        local_rank=int(os.environ.get("LOCAL_RANK", 0)),
        local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", 1)),
    )


def device_type(requested: str) -> str:
    """`training.device` resolved: cuda when asked, or when `auto` and a GPU is present."""
    return "cuda" if requested == "cuda" or (requested == "auto" and torch.cuda.is_available()) \
        else "cpu"


def pick_device(requested: str, env: DistEnv) -> tuple[torch.device, str]:
    """Device and backend: cuda/nccl when available (or requested), else cpu/gloo."""
    if device_type(requested) == "cuda":
        if not torch.cuda.is_available():
            from myria.errors import ConfigError
            raise ConfigError("training.device = 'cuda' but no CUDA device is available; "
                              "use 'auto' or 'cpu'")
        torch.cuda.set_device(env.local_rank)
        return torch.device("cuda", env.local_rank), "nccl"
    return torch.device("cpu"), "gloo"


def set_cpu_threads(threads: int, env: DistEnv) -> int:
    """Give each local process its share of the cores (oversubscription slows every rank)."""
    n = threads or max(1, (os.cpu_count() or 1) // max(1, env.local_world_size))
    torch.set_num_threads(n)
    return n


def init(requested_device: str = "auto", init_timeout_s: float = 300.0,
         store=None) -> DistEnv:
    """Initialise the default process group (if several processes) with an explicit timeout;
    on `store` when given (in-job recovery: the supervisor's, outliving every worker), else
    the launcher's rendezvous (MASTER_ADDR, MASTER_PORT)."""
    env = read_env()
    env.device, env.backend = pick_device(requested_device, env)
    if env.distributed and not dist.is_initialized():
        kwargs = {}
        if env.backend == "nccl":
            kwargs["device_id"] = env.device  # eager NCCL init, no lazy first-collective stall
        if store is not None:
            kwargs.update(store=store, rank=env.rank, world_size=env.world_size)
        try:
            dist.init_process_group(backend=env.backend,
                                    timeout=datetime.timedelta(seconds=init_timeout_s), **kwargs)
        except RuntimeError as e:   # torch's DistStoreError / DistNetworkError are RuntimeErrors
            if store is not None or not type(e).__name__.startswith("Dist"):
                raise
            from myria.errors import LaunchError, first_line

            where = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
            raise LaunchError(
                f"rank {env.rank}: the {env.world_size} ranks did not gather at the process "
                f"group's store {where} within training.init_timeout_s = {init_timeout_s:g} s "
                f"({first_line(e, 160)}): a rank did not start, or another process "
                "took that port before the store did; a new start picks another port") from None
    return env


def set_timeout(seconds: float) -> None:
    """Shorten the collective timeout once training is warm (long at start-up, short after)."""
    if not dist.is_initialized():
        return
    try:
        dist.distributed_c10d._set_pg_timeout(datetime.timedelta(seconds=seconds), None)
    except (AttributeError, RuntimeError):  # not supported by every backend/version
        pass


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def collective_device(group=None) -> torch.device:
    """Where a tensor must be for a collective on `group` (default: the world's): the current
    GPU under NCCL (which takes no host tensors), else the host."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
