"""Save-then-exit on a stop signal: it sets a flag; all ranks agree on it at the end of a step.

Schedulers announce preemption with SIGTERM and follow with SIGKILL after a grace period (Slurm
`--signal`, Kubernetes `terminationGracePeriodSeconds`); a user stops a run with Ctrl-C (SIGINT)
or by closing its terminal (SIGHUP). torch elastic forwards whichever of these its agent gets
to the workers, so each is handled alike (`STOP_SIGNALS`). The handler only records the request
(the loop may be inside a collective), and the ranks agree through a one-integer all-reduce on
a small gloo group of their own at the end of every step, so every rank saves the same step. A
second signal while saving restores the default action and ends the process at once.

The same agreement carries the job's wall-time limit (`request_limit`), which each rank judges
by its own clock and step times: the all-reduce takes the largest reason code, so a rank that
did not reach the decision itself still names the reason the job stops for.
"""

from __future__ import annotations

import datetime
import signal
import threading

import torch
import torch.distributed as dist

SIGNALLED, LIMIT = 1, 2   # reason codes of the agreement (0: go on); the larger one is named
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


class StopRequest:
    """A stop signal's flag, or the wall-time limit, that the ranks agree on, step by step."""

    def __init__(self, timeout_s: float = 120.0, signals: tuple = STOP_SIGNALS) -> None:
        self.requested = False
        self.signal_name = ""
        self.signum = 0   # the stop signal this process received (0: none)
        self._code = 0
        self.limit_name = "the wall-time limit"   # the trainer names the limit it holds
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
        self.requested, self._code, self.signum = True, SIGNALLED, signum
        self.signal_name = signal.Signals(signum).name

    def request_limit(self) -> None:
        """Stop at the end of this step: the job's wall-time limit would pass during the next."""
        self.requested, self._code, self.signal_name = True, LIMIT, self.limit_name

    def agreed(self) -> bool:
        """True on every rank if any rank was asked to stop (collective, cheap)."""
        if self._group is None:
            return self.requested
        flag = torch.tensor([self._code], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group)
        code = int(flag.item())
        if code and not self.requested:
            self.requested, self._code = True, code
            self.signal_name = self.limit_name if code == LIMIT else "a stop signal (on " \
                "another rank)"
        return bool(code)

    def restore(self) -> None:
        """Put the previous signal handlers back."""
        for s, h in self._previous.items():
            try:
                signal.signal(s, h)
            except (ValueError, TypeError):
                pass
        self._previous.clear()
