"""The optimizer step of a training step: the update on the device or the host, and the
transfers of offloaded state (cpu, myria's nvme tier). `s` is the step model's shared state
(`perf.Step`; not imported here, as perf imports this module)."""

from __future__ import annotations

from myria.sim import collectives as coll
from myria.sim.dataparallel import GRAD_BYTES
from myria.sim.hardware import Hardware

ADAM_BYTES_PER_PARAM = 38     # read g, p, m, v (fp32), write p, m, v, 16-bit copy, norm, zero g


LAMB_EXTRA_BYTES = 16         # second pass: trust-ratio norms and the scaled update


CPU_ADAM_BYTES_PER_PARAM = 32  # host-side Adam on fp32 p, m, v, g


def optimizer_time(s, t_compute: float) -> tuple[float, float]:
    """(optimizer step, exposed offload transfers) per iteration."""
    run, hw, dpc = s.run, s.hw, s.dpc
    tr, par = run.training, run.parallel
    dp, cp, ep, m = run.dp, par.cp, par.ep, s.m
    shard = dpc.shard_n if tr.zero_stage >= 1 else 1
    n_opt = dpc.dense0 / shard + dpc.expert0 / (max(1, dp * cp // ep) if tr.zero_stage >= 1
                                                else 1)
    per_param = ADAM_BYTES_PER_PARAM + (LAMB_EXTRA_BYTES if tr.optimizer == "lamb" else 0)
    t_offload = 0.0
    on_device = tr.offload in ("none", "nvme")   # where the update's arithmetic runs
    if on_device and s.eager and hw.cpu is not None and hw.cpu.optimizer_s_per_param:
        # measured: myria's foreach gradient clip + AdamW per parameter on this CPU, plus the
        # two scalar all-reduces of the step (gradient norm, logged loss) per reduction group
        t_opt = n_opt * hw.cpu.optimizer_s_per_param
        for name in ("dp", "pp"):
            t_opt += 2 * coll.allreduce(8.0, s.groups[name])[0]
    elif on_device:
        t_opt = n_opt * per_param / (hw.mem_bw * s.eff.mem)
    else:
        srv = hw.server
        t_opt = n_opt * CPU_ADAM_BYTES_PER_PARAM * hw.gpus_per_node / \
            (srv.host_memory_bw_gbs * 1e9)
        t_offload = n_opt * (GRAD_BYTES + s.w_b) / (srv.pcie_gbs * 1e9)
        if tr.zero_stage >= 3:
            # FSDP2's CPU offload copies the sharded weights in for forward and backward of
            # every microbatch
            t_offload += m * 2 * n_opt * s.w_b / (srv.pcie_gbs * 1e9)
    if tr.offload == "nvme":
        t_offload = nvme_time(tr, hw, n_opt, t_opt, m, s.w_b, t_compute)
    return t_opt, t_offload


def nvme_time(tr, hw: Hardware, n_opt: float, t_opt: float, m: int, w_b: int,
               t_compute: float) -> float:
    """Exposed time of myria's nvme tier (myria.offload) per iteration.

    The update runs on the device chunk by chunk while a reader and a writer thread stream the
    optimizer state from disk and back (across the host bus on a GPU): the optimizer phase
    takes the slowest of its arithmetic, the disk and the bus, so what the offload adds is the
    excess over the arithmetic. Every server's devices share its disks. The prefetch of the
    next step's chunks and the trailing writes, which hide more behind forward and backward as
    far as the buffers reach, are not counted (conservative).

    With offload_params each microbatch also reads the parameters for forward and backward, a
    layer ahead of the compute, and the update runs behind training (during the last backward
    while clipping does not bind, else from the step on, followed chunk by chunk by the next
    forward): the state's stream and the layers' reads share the disk with compute and the
    update's arithmetic, and only what exceeds both is exposed. bench/offload.py measures
    1.03-1.20x the in-memory step where the disk needs 0.5-0.7x of it."""
    srv, gpn = hw.server, hw.gpus_per_node
    state_b = (12 if tr.precision != "fp32" else 8) + \
        (w_b if tr.offload_params and tr.precision == "fp32" else 0)
    stream = 2 * n_opt * state_b                       # read and write, per device
    if tr.offload_params:
        stream += m * 2 * n_opt * w_b
    t_disk = stream * gpn / (srv.nvme_gbs * 1e9)
    t_bus = 0.0 if hw.device == "cpu" else stream / (srv.pcie_gbs * 1e9)
    if tr.offload_params:
        return max(0.0, max(t_disk, t_bus) - t_opt - t_compute)
    return max(0.0, max(t_disk, t_bus) - t_opt)
