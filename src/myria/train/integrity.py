"""Silent data corruption and numerical faults, checked inside the training loop.

**Replica consistency.** Every `resilience.sdc_interval` steps, and before every checkpoint (so
a committed checkpoint never holds diverged replicas), the ranks that must hold identical values
compare an exact checksum of them (the integer sum of each parameter's bits). Replicas are found
from the parameters themselves: every DTensor mesh dimension a parameter is `Replicate` on, and
the data-parallel (x context-parallel) group for DDP and for pipelines whose gradients are
all-reduced by hand; plain FSDP shards have none and rely on `myria.train.sdc`, driven by
`StepGuard`. A mismatch names the odd rank out by majority (with two replicas, both) and the
first parameter that differs; every rank stops with `SilentCorruption`.

**Numerical faults.** A non-finite loss or gradient norm, or a loss spike (above a running mean
by `loss_spike_sigmas` running deviations, after `SPIKE_WARMUP` steps), is judged the same on
every rank, then: `skip` the update, `rollback` (stop; the restart skips the step's batch, listed
in RUN_DIR/skip_steps.json) or `stop`. Every detection is one line in RUN_DIR/events.jsonl
(`myria.detections`). The rules in full: docs/robustness.md, "Reasons behind the peer snapshot,
fault and SDC modules".
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from myria import detections
from myria.errors import MyriaError
from myria.fsutil import atomic_write
from myria.tensors import local_shard

SKIP_STEPS = "skip_steps.json"
# what a detected corruption under sdc_action = "rollback" does (the restarted job resumes)
ROLLBACK = "rolling back to the newest checkpoint (step 0 when none is saved)"
SPIKE_WARMUP = 20        # steps before the running loss estimate judges spikes
SPIKE_DECAY = 0.9        # running mean and deviation: exponential, this weight on the past


class SilentCorruption(MyriaError):
    """Replicas that must be identical differ: the state since the last check is suspect."""

    exit_code = 1     # a fault of the machine, not of the input: the supervisor restarts


class NumericalFault(MyriaError):
    """A non-finite or spiking loss under `numerical_action = rollback` (exit 1: restarted) or
    `stop` (exit 2: not restarted)."""

    def __init__(self, message: str, restart: bool):
        super().__init__(message)
        self.exit_code = 1 if restart else 2


# ---------------------------------------------------------------------------------------------
# Replica consistency


def bit_checksum(t: torch.Tensor) -> int:
    """The exact integer sum of a tensor's elements read as integers of their width."""
    t = local_shard(t.detach()).contiguous().reshape(-1)
    width = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.int8}[t.element_size()]
    return int(t.view(width).sum(dtype=torch.int64))


@dataclass
class ReplicaGroup:
    """Parameters whose local tensors are identical on every rank of `group`."""

    name: str
    group: object
    ranks: list[int]
    params: list[tuple[str, torch.Tensor]] = field(default_factory=list)


def replica_groups(engine) -> list[ReplicaGroup]:
    """The replica groups of an engine's parameters (see the module docstring)."""
    from torch.distributed.tensor import DTensor

    groups: dict[tuple, ReplicaGroup] = {}

    def add(key, name, group, pname, p):
        if key not in groups:
            groups[key] = ReplicaGroup(name, group, dist.get_process_group_ranks(group))
        groups[key].params.append((pname, p))

    plain_replicated = engine.dims.loss_group is not None and (
        engine.cfg.training.data_parallel == "ddp" or engine.manual_dp)
    for part in engine.parts:
        for pname, p in part.named_parameters():
            if isinstance(p, DTensor):
                mesh = p.device_mesh
                for i, pl in enumerate(p.placements):
                    if pl.is_replicate() and mesh.size(i) > 1:
                        dim = (mesh.mesh_dim_names or [str(i)])[i]
                        add(("mesh", id(mesh), i), dim, mesh.get_group(i), pname, p)
            if plain_replicated:
                add(("dp",), "dp", engine.dims.loss_group, pname, p)
    return [g for g in groups.values() if len(g.ranks) > 1]


@dataclass
class Mismatch:
    group: str
    ranks: list[int]
    suspects: list[int]       # the odd rank(s) out
    param: str                # the first parameter that differs
    checksums: dict[int, int]

    def evidence(self) -> dict:
        return {"group": self.group, "ranks": self.ranks, "suspects": self.suspects,
                "param": self.param, "checksums": {str(k): v for k, v in
                                                   self.checksums.items()}}


class ReplicaCheck:
    """Compares the checksums of every replica group; collective over the whole world."""

    def __init__(self, engine):
        self.groups = replica_groups(engine)
        self.device = engine.device

    def check(self) -> list[Mismatch]:
        found: list[Mismatch] = []
        for g in self.groups:
            local = torch.tensor([bit_checksum(p) for _, p in g.params], dtype=torch.int64,
                                 device=self.device)
            gathered = [torch.empty_like(local) for _ in g.ranks]
            dist.all_gather(gathered, local, group=g.group)
            table = torch.stack(gathered).cpu()          # [ranks, params]
            differs = (table != table[0]).any(dim=0)
            if not bool(differs.any()):
                continue
            j = int(differs.nonzero()[0])
            col = table[:, j].tolist()
            counts = {v: col.count(v) for v in col}
            top = max(counts.values())
            majority = [v for v, c in counts.items() if c == top]
            suspects = [g.ranks[i] for i, v in enumerate(col)
                        if len(majority) > 1 or v != majority[0]]
            found.append(Mismatch(g.name, g.ranks, suspects, g.params[j][0],
                                  dict(zip(g.ranks, col))))
        # Every rank learns whether any group diverged, so that all act together.
        flag = torch.tensor([len(found)], dtype=torch.int64, device=self.device)
        dist.all_reduce(flag)
        if int(flag) and not found:
            found.append(Mismatch("elsewhere", [], [], "", {}))
        return found


def flip_bit(p: torch.Tensor, bit: int = 22, last: bool = False) -> None:
    """Flip one bit (22: the top mantissa bit of fp32, a change of up to half the value) of the
    first (or `last`) element of a parameter's (or gradient's) local tensor."""
    t = local_shard(p.detach()).reshape(-1)
    t = t[-1:] if last else t[:1]
    width = {4: torch.int32, 2: torch.int16, 8: torch.int64}[t.element_size()]
    v = t.view(width)
    v.bitwise_xor_(torch.tensor(1 << (bit % (8 * t.element_size() - 1)), dtype=width))


def flip_held(peers, rank: int) -> int | None:
    """The `bitflip:target=peer` hook: once the exchange in flight has landed, flip bit 22 of
    the first float32 value of the newest snapshot this rank holds for its left neighbour
    (memory damaged after the copy's CRC-32 was taken). Its step, or None when none is held."""
    if not hasattr(peers, "wait"):   # peer snapshots off
        return None
    peers.wait()
    held = peers.held
    item = next((i for i in (held or {}).get("meta", {}).get("layout", [])
                 if i.get("n") and i["dtype"] == "float32" and i["off"] % 4 == 0), None)
    if item is None:
        return None
    flip_bit(held["buf"][item["off"]:item["off"] + item["n"]].view(torch.float32))
    print(f"FAULT bitflip: rank {rank} damaged its copy of rank {held['from']}'s snapshot of "
          f"step {held['step']} ({item['k']})", flush=True)
    return held["step"]


# ---------------------------------------------------------------------------------------------
# Numerical faults


class LossTracker:
    """A running mean and absolute deviation of the (global) loss; judges spikes."""

    def __init__(self, sigmas: float):
        self.sigmas = sigmas
        self.mean: float | None = None
        self.dev = 0.0
        self.n = 0

    def is_spike(self, loss: float) -> bool:
        if self.sigmas <= 0 or self.mean is None or self.n < SPIKE_WARMUP:
            return False
        return loss > self.mean + self.sigmas * max(self.dev, 0.01 * abs(self.mean))

    def update(self, loss: float) -> None:
        if not math.isfinite(loss):
            return
        if self.mean is None:
            self.mean = loss
        else:
            self.dev = SPIKE_DECAY * self.dev + (1 - SPIKE_DECAY) * abs(loss - self.mean)
            self.mean = SPIKE_DECAY * self.mean + (1 - SPIKE_DECAY) * loss
        self.n += 1


def nonfinite_ranks(local_loss: torch.Tensor, device) -> list[int]:
    """The global ranks whose own loss is non-finite (collective: call on every rank)."""
    flag = torch.tensor([0 if bool(torch.isfinite(local_loss)) else 1], dtype=torch.int64,
                        device=device)
    if not (dist.is_available() and dist.is_initialized()):
        return [0] if int(flag) else []
    flags = [torch.empty_like(flag) for _ in range(dist.get_world_size())]
    dist.all_gather(flags, flag)
    return [r for r, f in enumerate(flags) if int(f)]


def replay(engine, inputs: torch.Tensor, targets: torch.Tensor, local_bad: bool) -> dict:
    """Rerun attribution of a non-finite step (collective; pipeline parallelism excluded): every
    rank replays its first microbatch forward, and the first microbatch of the previous rank of
    its data-parallel group; a rank whose own loss was non-finite is then

    - `transient` if its replay is finite (the fault did not repeat),
    - `persistent` if its replay is non-finite again while another rank computes the same
      microbatch finitely (this rank's device is at fault: exclude its host),
    - `instability` if the other rank's replay of it is non-finite too (the data and the model
      state produce it anywhere: roll back and skip the data).
    Returns {"ranks": {rank: verdict}, "replayed_on": {rank: other rank}}."""
    if engine.schedule is not None:
        return {"note": "no replay under pipeline parallelism"}
    world = dist.get_world_size()
    rank = dist.get_rank()
    x, y = inputs[0], targets[0]
    own = engine.eval_loss(x, y)
    group = engine.dims.loss_group
    other_of = {}
    nb_bad = 0
    if group is not None and dist.get_world_size(group) > 1:
        ranks = dist.get_process_group_ranks(group)
        xs = [torch.empty_like(x) for _ in ranks]
        ys = [torch.empty_like(y) for _ in ranks]
        dist.all_gather(xs, x, group=group)
        dist.all_gather(ys, y, group=group)
        me = ranks.index(rank)
        prev = (me - 1) % len(ranks)
        nb = engine.eval_loss(xs[prev], ys[prev])
        nb_bad = 0 if bool(torch.isfinite(nb)) else 1
        # the rank that replayed each rank's microbatch: the next one in the group
        other_of = {ranks[i]: ranks[(i + 1) % len(ranks)] for i in range(len(ranks))}
    flags = torch.tensor([int(local_bad), 0 if bool(torch.isfinite(own)) else 1, nb_bad],
                         dtype=torch.int64, device=engine.device)
    table = [torch.empty_like(flags) for _ in range(world)]
    dist.all_gather(table, flags)
    out: dict[int, str] = {}
    for r, f in enumerate(table):
        bad, own_bad, _ = (int(v) for v in f)
        if not bad:
            continue
        if not own_bad:
            out[r] = "transient"
            continue
        o = other_of.get(r)
        if o is None:
            out[r] = "persistent or instability (no other rank to replay it on)"
        else:
            out[r] = "instability" if int(table[o][2]) else "persistent"
    return {"ranks": {str(k): v for k, v in out.items()},
            "replayed_on": {str(k): v for k, v in other_of.items() if k in out}}


def read_skip_steps(run_dir: Path) -> set[int]:
    try:
        return set(json.loads((run_dir / SKIP_STEPS).read_text()))
    except (OSError, ValueError):
        return set()


def add_skip_step(run_dir: Path, step: int) -> None:
    steps = sorted(read_skip_steps(run_dir) | {step})
    atomic_write(run_dir / SKIP_STEPS, json.dumps(steps))


# ---------------------------------------------------------------------------------------------
# The trainer's side


class StepGuard:
    """What the training loop calls around each step (see the module docstring)."""

    def __init__(self, cfg, engine, run_dir: Path, rank: int, faults, start_step: int = 0):
        import socket

        self.r, self.engine, self.run_dir, self.rank = cfg.resilience, engine, run_dir, rank
        self.faults, self.host = faults, socket.gethostname()
        multi = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        self.replicas = ReplicaCheck(engine) if self.r.sdc_interval and multi else None
        from myria.train import sdc

        # at rest (every step) and in compute (every sdc_interval steps): myria.train.sdc
        self.ledger = sdc.StateLedger(engine) if self.r.sdc_interval else None
        self.compute = sdc.ComputeCheck(engine) if self.r.sdc_interval and multi else None
        if self.compute is not None and not self.compute.enabled:
            self.compute = None
        self.verified_at: int | None = None
        if self.ledger is not None:
            self.ledger.record_state()   # what was initialised or loaded
        self.losses = LossTracker(self.r.loss_spike_sigmas)
        self.skip = read_skip_steps(run_dir)
        self._hook = None
        self.checked_at: int | None = None
        # the newest step whose computation a check found clean (the resumed state counts)
        self.clean_at = start_step
        self.peers = None   # the peer snapshots (myria.train.peer), for the bitflip hook only

    def recorded(self) -> dict:
        """{storage key: checksum} of the state the optimizer wrote (StateLedger.recorded);
        empty when the at-rest checks are off."""
        return self.ledger.recorded() if self.ledger is not None else {}

    # -- before the forward pass -------------------------------------------------------------
    def before(self, step: int) -> bool:
        """Apply the fault hooks due at the start of `step` (steps done so far, as in
        `myria.faults`); False when the batch of step `step + 1` is to be skipped (rollback)."""
        if self.ledger is not None:
            self.ledger.watch_grads()
        if f := self.faults.due("bitflip", step):
            target = f.params.get("target")
            if target in ("param", "optimizer", "compute", "wgrad"):
                self.faults.mark(f)
                self._inject(target, f.params.get("sticky") == "yes")
            elif target == "grad" and self.ledger is not None and \
                    self.ledger.watches(p := self._target()):
                self.faults.mark(f)
                self._flip_when_reduced(p)
            elif target == "peer":   # the copy held for a ring neighbour, not this rank's state
                self.faults.mark(f)
                flip_held(self.peers, self.rank)
        if self.compute is not None:
            self.compute.cancel()
            if (step + 1) % self.r.sdc_interval == 0:
                self.compute.capture()   # this step's first microbatch, for the compute check
        if f := self.faults.due("nan", step):
            self.faults.mark(f)
            hook = self.engine.model.register_forward_hook(
                lambda mod, args, out: out * float("nan"))
            if f.params.get("sticky") != "yes":   # sticky: a device that keeps failing
                self._hook = hook
        return step + 1 not in self.skip

    def after_backward(self, step: int) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        if self.ledger is not None:   # the reduction has written them (or its hooks recorded)
            with _span():
                self.ledger.record_grads()
        if f := self.faults.due("bitflip", step):   # target = grad, recorded after backward
            self.faults.mark(f)
            p = self._target(grad=True)
            if p.grad is not None:
                flip_bit(p.grad)
                self.engine.gradients_changed()
        if self.ledger is not None:   # before clipping reads them
            with _span():
                bad = self.ledger.verify_grads()
            self._sdc(step + 1, "at rest", bad, "after the reduction")

    def _flip_when_reduced(self, p: torch.Tensor) -> None:
        """The `bitflip target=grad` hook where gradients are recorded as reduced: flip `p`'s
        gradient right after its reduction wrote (and the ledger recorded) it, with the rest of
        the backward still to run, the window the record guards. `p` is the last parameter,
        reduced first."""
        box: list = []

        def flip(param):
            box.pop().remove()   # once
            flip_bit(param.grad)
            self.engine.gradients_changed()
        box.append(p.register_post_accumulate_grad_hook(flip))

    def _target(self, grad: bool = False) -> torch.Tensor:
        """The parameter the bitflip hook corrupts: the last one of this rank's model whose
        local shard is not empty (the final norm or the output layer, whose gradient is never
        zero; an unused embedding row's would be)."""
        ps = [p for part in self.engine.parts for p in part.parameters()
              if local_shard(p).numel() and (not grad or p.grad is not None)]
        return ps[-1] if ps else list(self.engine.model.parameters())[-1]

    def _inject(self, target: str, sticky: bool) -> None:
        """The `bitflip` fault hooks acting at the start of a step (myria.faults)."""
        if target == "param" and sticky and self.ledger is not None:   # a stuck cell
            from myria.train.sdc import stick

            self.ledger.stuck.append(stick(self._target()))
        elif target == "param":
            flip_bit(self._target())
        elif target == "optimizer":   # the first moment (exp_avg) of a parameter, or any state
            state = self.ledger.optim() if self.ledger is not None else \
                sdc_state(self.engine)
            if state:
                pick = [t for n, t in state if n.endswith(".exp_avg")] or [t for _, t in state]
                flip_bit(pick[-1])
        elif target == "compute":     # a GEMM result: the first linear layer's output (its
            # last element: the first position's query would not matter, attending to itself)
            from torch import nn

            lin = next(m for m in self.engine.model.modules() if isinstance(m, nn.Linear))
            hook = None

            def corrupt(mod, args, out):
                out = out.clone()
                flip_bit(out, last=True)
                if not sticky:
                    hook.remove()
                return out

            hook = lin.register_forward_hook(corrupt)

        elif target == "wgrad":   # a weight-gradient GEMM's result: the first weight gradient
            # (its last element) of the block the next compute check recomputes, in the step's
            # first microbatch; sticky: of every block, in every microbatch from then on
            from myria.train.sdc import on_weight_grads, rotating_block

            part = self.engine.parts[0]
            b = rotating_block(part, self.compute.count if self.compute is not None else 0)
            layers = getattr(getattr(part, "module", part), "layers", {})   # DDP wraps it
            blocks = list(layers.values()) if sticky else \
                [b[1]] if b is not None else []
            for blk in blocks:
                first = next((p for p in blk.parameters() if p.requires_grad), None)
                n = sum(1 for p in blk.parameters() if p.requires_grad)
                calls = [0]

                def corrupt_grad(g, calls=calls, n=n):
                    calls[0] += 1
                    if calls[0] % n != 1 % n:   # the first gradient of each backward
                        return None
                    g = g.clone()
                    flip_bit(g, last=True)
                    return g

                if first is not None:
                    on_weight_grads(blk, corrupt_grad, [], every=sticky)

    # -- before the update -------------------------------------------------------------------
    def judge(self, step: int, local_loss: torch.Tensor, loss: float, grad_norm: float,
              batch=None) -> bool:
        """True to apply the update of step `step` (1-based, as in the metrics). `loss` and
        `grad_norm` are global, so every rank decides alike."""
        if self.ledger is not None:   # before the update reads them
            self._verify_state(step, "before the update")
        if self.compute is not None and step % self.r.sdc_interval == 0 and batch is not None:
            from myria.observe import events

            with events.current().span("compute_check", "check"):
                found = self.compute.check(batch.inputs, batch.targets)
            if found is not None:
                self._compute_fault(step, found)
            else:   # this step's update is computed from checked values
                self.clean_at = step
        kind = None
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):
            kind = "nonfinite"
        elif self.losses.is_spike(loss):
            kind = "loss_spike"
        if kind is None:
            self.losses.update(loss)
            return True
        action = self.r.numerical_action
        evidence = {"loss": loss if math.isfinite(loss) else str(loss),
                    "grad_norm": grad_norm if math.isfinite(grad_norm) else str(grad_norm)}
        named = None
        if kind == "nonfinite":
            ranks = nonfinite_ranks(local_loss, self.engine.device)
            evidence["ranks_with_nonfinite_loss"] = ranks
            named = ranks[0] if ranks else None
            if not ranks:
                evidence["note"] = ("every rank's own loss was finite: the gradients turned "
                                    "non-finite in the backward pass or their reduction")
            elif batch is not None and dist.is_initialized():
                evidence["replay"] = replay(self.engine, batch.inputs, batch.targets,
                                            self.rank in ranks)
        else:
            evidence.update(running_mean=self.losses.mean, running_dev=self.losses.dev,
                            sigmas=self.losses.sigmas)
        if self.rank == 0:
            detections.record(self.run_dir, kind, named, self.host, step, evidence, action)
            print(f"DETECTED {kind} at step {step}" +
                  (f" (first non-finite on rank(s) {evidence['ranks_with_nonfinite_loss']}; "
                   f"replay: {evidence.get('replay', {}).get('ranks')})"
                   if named is not None else "") + f": {action}", flush=True)
        if action == "skip":
            return False
        if action == "rollback" and self.rank == 0:
            add_skip_step(self.run_dir, step)
        raise NumericalFault(f"{kind} at step {step} (loss {loss}, gradient norm {grad_norm}); "
                             f"numerical_action = {action}", restart=action == "rollback")

    # -- after the update --------------------------------------------------------------------
    def check_replicas(self, step: int, force: bool = False) -> None:
        """Every sdc_interval steps, and when `force` (before a checkpoint): compare replicas.
        Called after each update (and before each checkpoint): verify and record the state."""
        if self.ledger is not None:
            if self.compute is not None:
                self.compute.cancel()
            if force:   # never commit corrupted state
                self._verify_state(step, "before the checkpoint")
            else:
                if self.verified_at != step:   # a skipped update: the state did not change
                    self._verify_state(step, "after a skipped update")
                with _span():
                    self.ledger.record_state()
        if self.replicas is None or self.checked_at == step or \
                not (force or step % self.r.sdc_interval == 0):
            return
        self.checked_at = step
        from myria.observe import events

        with events.current().span("replica_check", "check"):
            found = self.replicas.check()
        if not found:
            return
        action = self.r.sdc_action
        for m in found:
            if m.ranks and self.rank == min(m.ranks):
                named = m.suspects[0] if len(m.suspects) == 1 else None
                detections.record(self.run_dir, "sdc", named, self.host, step, m.evidence(),
                                  action)
                print(f"DETECTED sdc at step {step}: {m.group} replicas {m.ranks} differ in "
                      f"{m.param}; odd rank(s) out {m.suspects}: {action}", flush=True)
        if action == "rollback":
            raise SilentCorruption(f"replicas diverged by step {step} (see events.jsonl); "
                                   + ROLLBACK)

    # -- silent data corruption at rest and in compute (myria.train.sdc) ---------------------
    def _verify_state(self, step: int, when: str) -> None:
        self.verified_at = step
        with _span():
            bad = self.ledger.verify_state()
        self._sdc(step, "at rest", bad, when)

    def _sdc(self, step: int, check: str, bad: list[str], when: str) -> None:
        """Act on this rank's at-rest verdict; collective: every rank learns who failed."""
        from myria.train.sdc import ranks_with

        failed = ranks_with(bool(bad), self.engine.device)
        if not failed:
            return
        action = self.r.sdc_action
        if bad:
            evidence = {"check": check, "when": when, "tensors": bad[:8], "changed": len(bad),
                        "ranks": failed, "verdict": self.ledger.retest(bad)}
            detections.record(self.run_dir, "sdc", self.rank, self.host, step, evidence, action)
            print(f"DETECTED sdc at step {step} on rank {self.rank} ({check}, {when}): "
                  f"{bad[0]} changed since it was written: {action}", flush=True)
        if action == "rollback":
            raise SilentCorruption(f"state of rank(s) {failed} changed at rest by step {step} "
                                   "(see events.jsonl); " + ROLLBACK)
        if bad and self.ledger is not None:   # warn: go on from the state as it is now
            self.ledger.record_state()

    def _compute_fault(self, step: int, found: dict) -> None:
        action = self.r.sdc_action
        if self.rank == min(found["group"]):
            for v in found["mismatches"].values():
                evidence = {"check": "compute", "group": found["group"], **v}
                detections.record(self.run_dir, "sdc", v["rank"], self.host, step, evidence,
                                  action)
                print(f"DETECTED sdc at step {step}: rank {v['microbatch_of']}'s microbatch "
                      f"recomputed by rank {v['recomputed_by']} differs; {v['verdict']} "
                      f"(rank {v['rank'] if v['rank'] is not None else v.get('suspects')}): "
                      f"{action}", flush=True)
        if action == "rollback":
            transient = found["transient"]
            # a transient fault was in this step alone, found before its update: nothing
            # committed holds it. Any other may have been there since the last clean check.
            if self.rank == 0 and not transient:
                from myria import rundir
                from myria.train.checkpoint.store import mark_suspect

                mark_suspect(rundir.checkpoints_dir(self.run_dir), self.clean_at, step,
                             "a recomputed microbatch differs")
            raise SilentCorruption(f"a recomputed microbatch differs at step {step} (see "
                                   "events.jsonl); " + ROLLBACK)


def _span():
    """The event-timer span of the at-rest checksums (bench/integrity.py sums them per step)."""
    from myria.observe import events

    return events.current().span("sdc_at_rest", "check")


def sdc_state(engine) -> list[tuple[str, torch.Tensor]]:
    from myria.train.sdc import StateLedger

    return StateLedger(engine).optim()
