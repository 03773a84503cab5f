"""The watchers of a training step, behind one seam that `Run.build` assembles.

What observes or guards a step, besides the engine that computes it: the heartbeat (the phase
the supervisor's hang detection sees), the goodput ledger and the event timer (both fed by the
heartbeat's phase), fault injection, the `StepGuard` (silent corruption, numerical faults), the
checkpoint's overlapped snapshot and the peer snapshot. `train_step` calls them at five points,
each a context around the engine's calls; the order inside each is the contract:

- `step(step)`: the timer's step event opens, phase `step-start`, the process faults due, the
  guard's pre-forward hooks; it yields whether this step trains on its batch (False: a batch
  skipped after a rollback). On a normal exit: the synchronised garbage collection on
  `training.gc_interval`, the replica check, phase `peer-snapshot` and the peer snapshot, and
  the step event closes. An exception skips all of these and leaves the event open (the
  exception dump shows it).
- `phase(name)`: the heartbeat phase (and ledger category), and the timer's span of the same
  moment (`heartbeat.TIMED`); the phase lasts until the next one is marked.
- `backward()`: phase `forward-backward`; on a normal exit, the guard's gradient hooks.
- `span(name, cat)`: a timer span alone (the heartbeat's phase does not change).
- `update(judged)`: the guard's verdict on the step's loss and gradient norm (`judged`, None for
  a skipped batch: no update), the wait for an overlapped checkpoint snapshot (phase
  `snapshot-wait`), then phase `optimizer`; it yields whether to apply the update.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator
from typing import Any, NamedTuple

import torch

from myria.faults import FaultInjector
from myria.observe import events
from myria.train.integrity import StepGuard


class Judged(NamedTuple):
    """What the guard judges a step by: this rank's loss sum, the global loss and gradient
    norm (every rank decides alike), and the batch (replayed to attribute a fault)."""

    local_loss: torch.Tensor
    loss: float
    grad_norm: float
    batch: Any


class StepWatchers:
    """Everything `train_step` calls besides the engine (see the module docstring)."""

    def __init__(self, hb, rec: events.Recorder, faults: FaultInjector, guard: StepGuard,
                 ckpt, peers, gc_interval: int = 0) -> None:
        self.hb, self.rec, self.faults, self.guard = hb, rec, faults, guard
        self.ckpt, self.peers, self.gc_interval = ckpt, peers, gc_interval
        self.at = 0   # steps done before the step in progress

    @contextlib.contextmanager
    def step(self, step: int) -> Iterator[bool]:
        self.at = step
        self.rec.step = step + 1
        ev = self.rec.begin("step", "step")
        self.hb.phase("step-start")  # a rank held here is not said to be in the last checkpoint
        self.faults.at_step_start(step)
        yield self.guard.before(step)
        if self.gc_interval and (step + 1) % self.gc_interval == 0:
            with self.rec.span("gc", "check"):
                gc.collect()  # every rank at the same step (automatic collection is off)
        self.guard.check_replicas(step + 1)
        self.hb.phase("peer-snapshot")
        self.peers.after_step(step + 1)  # this rank's state into its ring neighbour's memory
        self.rec.end(ev)

    def phase(self, name: str):
        return self.hb.phase(name)

    def span(self, name: str, cat: str):
        return self.rec.span(name, cat)

    @contextlib.contextmanager
    def backward(self) -> Iterator[None]:
        self.hb.phase("forward-backward")
        yield
        self.guard.after_backward(self.at)

    @contextlib.contextmanager
    def update(self, judged: Judged | None) -> Iterator[bool]:
        apply = judged is not None and self.guard.judge(self.at + 1, *judged)
        with self.hb.phase("snapshot-wait"):
            self.ckpt.before_update()  # an overlapped snapshot is copied before weights change
        with self.hb.phase("optimizer"):
            yield apply
