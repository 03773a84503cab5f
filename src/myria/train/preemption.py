"""Save-then-exit on SIGTERM: the signal sets a flag; all ranks agree on it at the end of a step.

Schedulers announce preemption with SIGTERM and follow with SIGKILL after a grace period (Slurm
`--signal`, Kubernetes `terminationGracePeriodSeconds`); torch elastic forwards the agent's
SIGTERM to its workers. The handler only records the request (the loop may be inside a
collective), and the ranks agree through a one-integer all-reduce on a small gloo group of
their own at the end of every step, so every rank saves the same step. A second SIGTERM while
saving restores the default action and ends the process at once.
"""

from __future__ import annotations

import datetime
import signal
import threading

import torch
import torch.distributed as dist


class StopRequest:
    """A SIGTERM (or SIGINT) flag that the ranks agree on, step by step."""

    def __init__(self, timeout_s: float = 120.0, signals: tuple = (signal.SIGTERM,)) -> None:
        self.requested = False
        self.signal_name = ""
        self._previous: dict[int, object] = {}
        self._group = None
        if dist.is_initialized() and dist.get_world_size() > 1:
            self._group = dist.new_group(backend="gloo",
                                         timeout=datetime.timedelta(seconds=timeout_s))
        if threading.current_thread() is threading.main_thread():
            for s in signals:
                self._previous[s] = signal.signal(s, self._handle)

    def _handle(self, signum, frame) -> None:
        if self.requested:  # a second signal: stop trying to save
            signal.signal(signum, signal.SIG_DFL)
            signal.raise_signal(signum)
            return
        self.requested = True
        self.signal_name = signal.Signals(signum).name

    def agreed(self) -> bool:
        """True on every rank if any rank was asked to stop (collective, cheap)."""
        if self._group is None:
            return self.requested
        flag = torch.tensor([1 if self.requested else 0], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group)
        if flag.item() and not self.requested:
            self.requested, self.signal_name = True, "SIGTERM (on another rank)"
        return bool(flag.item())

    def restore(self) -> None:
        """Put the previous signal handlers back."""
        for s, h in self._previous.items():
            try:
                signal.signal(s, h)
            except (ValueError, TypeError):
                pass
        self._previous.clear()
