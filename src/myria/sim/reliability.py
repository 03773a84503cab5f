"""Expected effective training time: failures, checkpoints and restarts priced for a layout.

What a failure costs is the time to detect it, restart and reload, plus the work done since the
last *committed* checkpoint; what protection costs is the stall of each checkpoint. This module
prices both from the layout's checkpoint size and the cluster's bandwidths and picks the
checkpoint interval that maximises the effective training time ratio (ETTR: the share of wall
time spent in steps whose result is kept). First-order model, failures independent and
exponential with rate λ = per-GPU rate × GPUs: a checkpoint every τ seconds of training stalls
the loop δ (the snapshot to host memory) and writes in the background for w; a failure costs
R = detection + restart + load and loses (τ + δ) / 2 + w;
ETTR(τ) = τ / (τ + δ) × (1 − λ (R + (τ + δ) / 2 + w)), floored at 0; the interval is Young's
τ* = √(2 δ / λ), never shorter than w nor than one step. The defaults, their sources and what is
not modelled: docs/performance_model.md, "Planning with headroom and honesty" and "Reasons
behind the simulator modules".
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from dataclasses import dataclass

from myria.config import ResilienceConfig

# the supervisor's default detection time: missed heartbeats x their period
_DEFAULT_DETECT_S = ResilienceConfig().heartbeat_s * ResilienceConfig().missed_heartbeats

LLAMA3_FAILURES_PER_GPU_HOUR = 419 / (54 * 24 * 16384)


@dataclass(frozen=True)
class Reliability:
    """The failure and recovery facts of a cluster (see the module docstring for sources)."""

    failures_per_gpu_hour: float = LLAMA3_FAILURES_PER_GPU_HOUR
    detect_s: float = _DEFAULT_DETECT_S
    restart_s: float = 300.0
    storage_write_gbs_per_node: float = 5.0
    storage_read_gbs_per_node: float = 5.0


@dataclass(frozen=True)
class Ettr:
    """Expected ETTR of a run at its best checkpoint interval, with the parts that make it."""

    ettr: float
    interval_s: float
    interval_steps: int
    mtbf_s: float
    stall_s: float
    write_s: float
    recovery_s: float

    def to_json(self) -> dict:
        return {"ettr": self.ettr, "checkpoint_interval_s": self.interval_s,
                "checkpoint_interval_steps": self.interval_steps, "mtbf_s": self.mtbf_s,
                "checkpoint_stall_s": self.stall_s, "checkpoint_write_s": self.write_s,
                "recovery_s": self.recovery_s}


def ettr_at(interval_s: float, stall_s: float, write_s: float, recovery_s: float,
            failure_rate_per_s: float) -> float:
    """ETTR with a checkpoint every `interval_s` seconds of training (module docstring)."""
    period = interval_s + stall_s
    lost = failure_rate_per_s * (recovery_s + period / 2 + write_s)
    return max(0.0, interval_s / period * (1.0 - lost))


def expected_ettr(iteration_time_s: float, gpus: int, gpus_per_node: int,
                  snapshot_bytes_per_gpu: float, checkpoint_bytes: float, snapshot_gbs: float,
                  rel: Reliability | None = None) -> Ettr:
    """The best checkpoint interval and the ETTR it gives.

    `snapshot_bytes_per_gpu` is what each GPU copies to host memory at a save (its weights and
    optimizer state, replicas included); `checkpoint_bytes` the whole checkpoint on storage
    (each byte written once, shared evenly by the servers); `snapshot_gbs` the device-to-host
    bandwidth (PCIe).
    """
    rel = rel or Reliability()
    if iteration_time_s <= 0 or gpus < 1:
        raise ValueError("iteration time and GPU count must be positive")
    lam = rel.failures_per_gpu_hour * gpus / 3600.0
    nodes = max(1, math.ceil(gpus / max(1, gpus_per_node)))
    stall = snapshot_bytes_per_gpu / (snapshot_gbs * 1e9)
    write = checkpoint_bytes / nodes / (rel.storage_write_gbs_per_node * 1e9)
    load = checkpoint_bytes / nodes / (rel.storage_read_gbs_per_node * 1e9)
    recovery = rel.detect_s + rel.restart_s + load
    tau = math.sqrt(2 * stall / lam) if lam > 0 and stall > 0 else math.inf
    tau = max(tau, write, iteration_time_s)
    if not math.isfinite(tau):  # no failures: checkpoint as rarely as you like
        return Ettr(1.0, math.inf, 0, math.inf, stall, write, recovery)
    steps = max(1, round(tau / iteration_time_s))
    tau = steps * iteration_time_s
    return Ettr(ettr_at(tau, stall, write, recovery, lam), tau, steps, 1 / lam, stall, write,
                recovery)


# What `plan` and `simulate` say when the failure rate is 0: Young/Daly's interval is then
# infinite (`expected_ettr` returns 0 steps), a number no one should read as "every 0 steps".
NO_FAILURES = ("no failures assumed (--failures-per-gpu-hour 0): every step is kept (ETTR 1) "
               "and no checkpoint interval is derived")


def no_failures(ettr_json: dict) -> bool:
    """Whether an `Ettr.to_json()` derived no checkpoint interval (no failures assumed)."""
    return not ettr_json["checkpoint_interval_steps"]


def interval_text(steps: int) -> str:
    """A table cell for the checkpoint interval: "N steps", or "none (no failures)"."""
    return f"{steps} steps" if steps else "none (no failures)"


def add_arguments(parser: argparse.ArgumentParser, positive, non_negative) -> None:
    """The reliability flags of `myria plan` and `myria simulate` (types check the values)."""
    g = parser.add_argument_group("reliability (expected effective training time)")
    g.add_argument("--failures-per-gpu-hour", type=non_negative, default=None,
                   help="failure rate per GPU-hour (default 1.97e-5: Llama 3 405B, 419 "
                   "interruptions in 54 days on 16,384 GPUs)")
    g.add_argument("--restart-s", type=non_negative, default=None,
                   help="time to restart a failed job, excluding checkpoint load (default 300)")
    g.add_argument("--storage-gbs", type=positive, default=None,
                   help="checkpoint storage bandwidth per server, GB/s (default 5)")


def from_args(args: argparse.Namespace) -> Reliability:
    """The Reliability the flags of `add_arguments` describe (defaults where not given)."""
    r = Reliability()
    if args.failures_per_gpu_hour is not None:
        r = dataclasses.replace(r, failures_per_gpu_hour=args.failures_per_gpu_hour)
    if args.restart_s is not None:
        r = dataclasses.replace(r, restart_s=args.restart_s)
    if args.storage_gbs is not None:
        r = dataclasses.replace(r, storage_write_gbs_per_node=args.storage_gbs,
                                storage_read_gbs_per_node=args.storage_gbs)
    return r


def run_ettr(res, run, hw, rel: Reliability | None = None) -> Ettr:
    """Expected ETTR of a simulated run (`step_result.StepResult` of `run` on `hw`): the
    checkpoint holds the 16-bit weights and the fp32 master weights and moments once (14 bytes
    per parameter; fp32 training 12), and each device snapshots over PCIe what it saves.
    Frameworks that deduplicate replicated tensors before staging (Megatron's distributed
    checkpoint, DCP's save planner) save at most an even share per device, so ZeRO-0/1's
    16-bit copy on every rank is not written by every rank. myria's trainer (a myria config:
    `reduce_once`, set by `perf.config_run`) stages every tensor of its state dict: FSDP2's
    fp32 shards and the optimizer's (counted in `optimizer`), a DDP replica whole."""
    from myria.models.flops import param_counts

    mem = res.memory
    tr = run.training
    bytes_per_param = 14 if tr.precision != "fp32" else 12
    total = param_counts(run.model_config()).total(run.model.layers) * bytes_per_param
    if tr.reduce_once:
        held = mem.optimizer + (mem.weights if tr.zero_stage == 0 else 0.0)
    else:
        held = min(mem.weights + mem.optimizer, total / hw.gpus)
    return expected_ettr(res.iteration_time_s, hw.gpus, hw.gpus_per_node, held, total,
                         hw.server.pcie_gbs, rel)
