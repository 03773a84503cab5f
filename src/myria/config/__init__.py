"""Run configuration: dataclass sections, TOML loading, `--section.key=value` overrides, validation.

Every field has a default and a one-line description (`help` metadata). Unknown keys, wrong
types, out-of-range values and inconsistent combinations raise `ConfigError` naming the field,
the value seen and what is valid.
"""

from __future__ import annotations

import dataclasses
import difflib
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from myria.config.model import (
    ModelConfig,
    refuse_settings_that_do_nothing,
    validate_model,
)
from myria.config.schema import schema_field
from myria.errors import ConfigError

_f = schema_field


def _tables(where: str, value: Any, keys: tuple[str, ...], text_form: str, example: str):
    """Each table of a TOML list of tables (`where`, with its index) and its name for errors:
    ConfigError for anything but a list of tables of `keys` (the field's `text_form` is its
    other spelling, `example` one table)."""
    if not isinstance(value, list):
        raise ConfigError(f"{where} = {value!r}: expected {text_form} or a list of tables "
                          f"[{example}, ...]")
    for i, t in enumerate(value):
        entry = f"{where}[{i}]"
        if not isinstance(t, dict):
            raise ConfigError(f"{entry} = {t!r}: expected a table {example}")
        extra = sorted(set(t) - set(keys))
        if extra:
            raise ConfigError(f"{entry}: unknown key {extra[0]!r}; valid keys: "
                              f"{', '.join(keys)}" + suggest(extra[0], keys))
        yield entry, t


def sources_from_tables(where: str, value: Any) -> str:
    """data.sources written as TOML's list of tables ([{path = "data/web", weight = 0.7,
    epochs = 2}, ...]) as the equivalent 'PATH:WEIGHT[:EPOCHS],...' text."""
    out = []
    for entry, t in _tables(where, value, ("path", "weight", "epochs"),
                            "'PATH:WEIGHT[:EPOCHS],...'",
                            '{path = "...", weight = 0.3}'):
        path, weight, epochs = t.get("path"), t.get("weight"), t.get("epochs", 0)
        if not isinstance(path, str) or not path or "," in path:
            raise ConfigError(f"{entry}.path = {path!r}: expected a directory path (without ',')")
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not weight > 0:
            raise ConfigError(f"{entry}.weight = {weight!r}: expected a number > 0")
        if isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 0:
            raise ConfigError(f"{entry}.epochs = {epochs!r}: expected a whole number >= 0 "
                              "(0: no limit)")
        out.append(f"{path}:{weight!r}" + (f":{epochs}" if epochs else ""))
    return ",".join(out)


def phases_from_tables(where: str, value: Any) -> str:
    """data.phases written as TOML's list of tables ([{from_step = 9001, weights = {web = 0.3,
    code = 0.7}}, ...]) as the equivalent 'STEP:NAME=WEIGHT,...;...' text."""
    out = []
    for entry, t in _tables(where, value, ("from_step", "weights"),
                            "'STEP:NAME=WEIGHT,...;...'",
                            "{from_step = 9001, weights = {web = 0.3, code = 0.7}}"):
        step, weights = t.get("from_step"), t.get("weights")
        if isinstance(step, bool) or not isinstance(step, int) or step < 2:
            got = "missing" if step is None else f"= {step!r}"
            raise ConfigError(f"{entry}.from_step {got}: expected the phase's first step, 2 "
                              "or later (data.sources' own weights apply from step 1)")
        if not isinstance(weights, dict) or not weights:
            got = "missing" if weights is None else f"= {weights!r}"
            raise ConfigError(f"{entry}.weights {got}: expected a table of source names and "
                              "weights, {web = 0.3, code = 0.7}")
        for name, w in weights.items():
            if isinstance(w, bool) or not isinstance(w, (int, float)) or not w > 0:
                raise ConfigError(f"{entry}.weights.{name} = {w!r}: expected a number > 0")
        out.append(f"{step}:" + ",".join(f"{n}={w!r}" for n, w in weights.items()))
    return ";".join(out)


@dataclass
class DataConfig:
    """Token shards written by `myria prepare`."""

    path: str = _f("data/demo", "directory written by `myria prepare` (index.json, shards, "
                   "tokenizer.json)")
    sources: str = _f("", "a weighted mixture of prepared directories instead of path: "
                      "'PATH:WEIGHT[:EPOCHS],...' (e.g. 'data/web:0.7,data/code:0.3:2'; EPOCHS "
                      "limits the passes over a source; one tokenizer for all), or TOML's list "
                      "of tables: [{path = 'data/web', weight = 0.7}, {path = 'data/code', "
                      "weight = 0.3, epochs = 2}]", parse=sources_from_tables)
    phases: str = _f("", "later weights of the same data.sources from a step on (e.g. an "
                     "annealing phase): 'STEP:NAME=WEIGHT,...;...' by source (directory) name, "
                     "STEP the phase's first step as the logs count them, e.g. "
                     "'9001:web=0.3,code=0.7', or TOML's list of tables [{from_step = 9001, "
                     "weights = {web = 0.3, code = 0.7}}]; each source goes on from where it "
                     "stood. A resume given other weights of the same sources adds a phase from "
                     "its next step", parse=phases_from_tables)
    prefetch: int = _f(2, "batches the background loader thread keeps ready", min=0)
    eval_batches: int = _f(4, "validation batches (of global_batch sequences) per evaluation",
                           min=0)


@dataclass
class TrainingConfig:
    """The optimisation run."""

    steps: int = _f(200, "optimizer steps to train in total", min=1)
    max_time_s: float = _f(0.0, "wall-time limit of the job in seconds (`myria train "
                           "--max-time`): stop cleanly with a committed checkpoint before the "
                           "next step and its save would pass it, as before a scheduler's limit; "
                           "0 = none", min=0.0)
    global_batch: int = _f(16, "sequences per optimizer step, whatever the number of processes",
                           min=1)
    micro_batch: int = _f(4, "sequences per forward/backward pass on one rank", min=1)
    seed: int = _f(1234, "seed of weight initialisation, data order and the global generators "
                   "(train.state.seed_rng)", min=0)
    grad_clip: float = _f(1.0, "clip the global gradient norm to this; 0 disables", min=0.0)
    dtype: str = _f("auto", "parameter/compute precision: auto (bf16 on GPU, fp32 on CPU), "
                    "float32 or bfloat16", choices=("auto", "float32", "bfloat16"))
    deterministic: bool = _f(False, "torch's deterministic algorithms (and "
                             "CUBLAS_WORKSPACE_CONFIG): on a GPU, flash attention's backward "
                             "and other atomics-based kernels give the same bits every run, "
                             "which bitwise resume needs there; slower. CPU runs are "
                             "deterministic without it")
    float8: bool = _f(False, "float8 linear layers in the blocks (torchao's float8 training, "
                      "dynamic scaling; embedding and output stay bf16): CUDA with compute "
                      "capability >= 8.9 (H100) and torchao installed; docs/gpu.md")
    data_parallel: str = _f("fsdp", "data-parallel engine: fsdp (FSDP2 full sharding), "
                            "zero2 (FSDP2 keeping the blocks gathered for the whole step: one "
                            "all-gather per step, gradients reduce-scattered once per step; "
                            "ZeRO-1's traffic) or ddp",
                            choices=("fsdp", "zero2", "ddp"))
    device: str = _f("auto", "auto (cuda if available, else cpu), cpu or cuda",
                     choices=("auto", "cpu", "cuda"))
    init_timeout_s: float = _f(300.0, "process-group timeout while starting up", min=1.0)
    timeout_s: float = _f(120.0, "process-group timeout once training is warm", min=1.0)
    eval_interval: int = _f(0, "evaluate on the validation split every N steps and at the "
                            "last step; 0 disables", min=0)
    threads: int = _f(0, "CPU threads per process; 0 means cores / local processes", min=0)
    gc_interval: int = _f(50, "synchronised garbage collection: Python's automatic collector "
                          "off, every rank collects at the same steps, every N; 0 leaves the "
                          "automatic collector on (each rank pauses at its own moments and the "
                          "others wait for it)", min=0)


@dataclass
class OptimizerConfig:
    """Optimizer and learning-rate schedule."""

    name: str = _f("adamw", "adamw (PyTorch) or lamb (layer-wise trust ratio)",
                   choices=("adamw", "lamb"))
    lr: float = _f(3e-3, "peak learning rate", min=0.0)
    min_lr_ratio: float = _f(0.1, "final learning rate as a fraction of the peak", min=0.0)
    warmup_steps: int = _f(20, "linear warm-up steps", min=0)
    schedule: str = _f("cosine", "decay after warm-up; wsd: warm-up, stable at the peak, then "
                       "a linear decay over the last decay_fraction of the steps (MiniCPM's "
                       "warmup-stable-decay: a run can be extended from any checkpoint of its "
                       "stable phase)", choices=("cosine", "linear", "constant", "wsd"))
    decay_fraction: float = _f(0.2, "wsd: the share of the decay horizon spent decaying, at its "
                               "end", min=0.0)
    beta1: float = _f(0.9, "first-moment decay", min=0.0)
    beta2: float = _f(0.95, "second-moment decay", min=0.0)
    eps: float = _f(1e-8, "denominator epsilon", min=0.0)
    weight_decay: float = _f(0.1, "decoupled weight decay (not applied to norms and biases)",
                             min=0.0)
    decay_steps: int = _f(0, "step at which the decay reaches min_lr_ratio (cosine, linear) and "
                          "stays; 0 = training.steps of the run's start: a run resumed with more "
                          "training.steps keeps its horizon and goes on at the minimum lr; set it "
                          "to stretch the decay anew (docs/resume.md)", min=0)


@dataclass
class ParallelConfig:
    """The parallel layout; the product of the dimensions must equal the world size."""

    dp_replicate: int = _f(1, "data-parallel replicas (HSDP outer dimension)", min=1)
    dp_shard: int = _f(-1, "data-parallel sharding degree (FSDP); -1 fills the rest of the "
                       "world", min=-1)
    tp: int = _f(1, "tensor-parallel degree", min=1)
    pp: int = _f(1, "pipeline-parallel stages", min=1)
    cp: int = _f(1, "context-parallel degree (ring attention)", min=1)
    ep: int = _f(1, "expert-parallel degree (borrows data-parallel ranks)", min=1)
    vpp: int = _f(1, "virtual pipeline chunks per rank (interleaved schedules)", min=1)
    schedule: str = _f("1f1b", "pipeline schedule: gpipe, 1f1b, interleaved-1f1b, zero-bubble "
                       "(torch's interleaved zero-bubble, ZB-H1 order, any vpp) or zbv (V shape, "
                       "vpp = 2); myria.layout", choices=("gpipe", "1f1b", "interleaved-1f1b",
                                                          "zero-bubble", "zbv"))
    sequence_parallel: bool = _f(True, "with tp > 1, shard norms and dropout regions along the "
                                 "sequence (Megatron-LM sequence parallelism)")
    loss_parallel: bool = _f(True, "with tp > 1, compute the cross-entropy on vocabulary-sharded "
                             "logits without gathering them")
    cp_impl: str = _f("ring", "context-parallel attention: ring (ours, CPU and GPU) or torch "
                      "(torch's context_parallel, GPU only)", choices=("ring", "torch"))
    activation_checkpoint: str = _f("none", "recompute activations in backward: none, full "
                                    "(every block) or selective (keep matmul outputs)",
                                    choices=("none", "full", "selective"))
    compile: bool = _f(False, "torch.compile each block (no speedup for fp32 on CPU)")
    fsdp_prefetch: int = _f(1, "blocks whose FSDP all-gather is issued ahead (forward and "
                            "backward); 0 leaves FSDP2's default of one", min=0)
    offload: str = _f("none", "where the optimizer state lives: none (beside the model), cpu "
                      "(host memory, with the parameters and gradients: FSDP2 "
                      "CPUOffloadPolicy, needs FSDP on > 1 rank) or nvme (files in offload_dir "
                      "streamed through a few buffers by background I/O; docs/offload.md)",
                      choices=("none", "cpu", "nvme"))
    offload_dir: str = _f("", "directory of the nvme tier's files (a fast local disk); empty "
                          "means RUN_DIR/offload")
    offload_params: bool = _f(False, "offload = nvme: the parameters live in the files too and "
                              "are read layer by layer for forward and backward (one process, "
                              "no tensor/pipeline/context parallelism)")
    fast_memory_gb: float = _f(0.0, "memory budget per rank of the fast tier (accelerator "
                               "memory; RAM on a CPU) for parameters, gradients, activations and "
                               "the nvme tier's buffers; checked before training; 0 = no budget",
                               min=0.0)
    data_broadcast: bool = _f(True, "one rank per tensor/context-parallel group reads each batch "
                              "and broadcasts it (MegaScale's removal of redundant loaders)")
    hosts: str = _f("", "comma-separated host names in rank order for placement reports; empty "
                    "means this host only (or $MYRIA_HOSTS / Slurm's node list)")
    hosts_per_switch: int = _f(0, "hosts under one leaf switch, for the dry run's placement "
                               "report (which groups cross switches); 0 = unknown (one "
                               "switch)", min=0)
    fast_domain: int = _f(0, "ranks per fast (NVLink) domain; 0 means the ranks of one host",
                          min=0)


@dataclass
class CheckpointConfig:
    """Distributed checkpoints under RUN_DIR/checkpoints."""

    interval: int = _f(50, "save every N steps (and at the end); 0 saves only at the end", min=0)
    keep: int = _f(3, "committed checkpoints to keep", min=1)
    resume: bool = _f(True, "resume from the newest checkpoint in the run directory that "
                      "verifies (false: move existing checkpoints aside and start at step 0)")
    resume_from: str = _f("", "load this checkpoint directory instead (even a quarantined one); "
                          "newer checkpoints of the run are moved aside, not deleted")
    start_fresh: bool = _f(False, "when checkpoints exist but none can be loaded, train from "
                           "step 0 instead of stopping (the damaged ones stay in quarantine/)")
    allow_data_change: bool = _f(False, "resume although the data (data.path or data.sources: "
                                 "tokenizer, tokens, a mixture's sources and shares) differ "
                                 "from the fingerprint the checkpoint recorded")
    max_failed_saves: int = _f(2, "stop the run (exit status 4) once this many checkpoint "
                               "saves in a row have failed, e.g. on a full disk; 0 trains on "
                               "through failed saves, but a run whose final checkpoint is not "
                               "saved still ends with status 4", min=0)


@dataclass
class LoggingConfig:
    """Metrics and progress output."""

    interval: int = _f(1, "write metrics every N steps", min=1)
    tensorboard: bool = _f(True, "also write TensorBoard scalars to RUN_DIR/tensorboard")
    progress: bool = _f(True, "show a live progress line on rank 0")
    trackers: str = _f("", "experiment trackers that also get the metrics, the config and "
                       "`myria report`'s figures: wandb, mlflow or 'wandb,mlflow'; one tracker "
                       "run per run directory, continued by restarts and resumes "
                       "(myria.observe.tracking)")
    project: str = _f("myria", "the W&B project and MLflow experiment of the run")
    run_name: str = _f("", "the run's name in the trackers; empty = the run directory's name")
    wandb_mode: str = _f("auto", "W&B: online, offline (files in RUN_DIR/wandb; `wandb sync` "
                         "uploads them) or auto (online when WANDB_API_KEY is set)",
                         choices=("auto", "online", "offline"))
    mlflow_uri: str = _f("", "MLflow tracking URI (a server or a database); empty = a local "
                         "store in RUN_DIR/mlruns")


@dataclass
class ProfilingConfig:
    """torch.profiler traces of a few steps, per rank (myria.train.profiling)."""

    start_step: int = _f(0, "first step profiled (as the logs count steps, from 1); 0 = off",
                         min=0)
    steps: int = _f(2, "steps profiled from start_step", min=1)
    memory: bool = _f(False, "also a memory snapshot of the window: CUDA's allocator history "
                      "(memory_rankN.pickle, for pytorch.org/memory_viz); on a CPU the "
                      "profiler's memory records and a table of the operators by memory")


@dataclass
class ObserveConfig:
    """The event timer (RUN_DIR/events/) that `myria report` and the detectors read."""

    enabled: bool = _f(True, "record every rank's timed events (compute, collectives, data "
                       "wait, checkpoint) to RUN_DIR/events/")
    flush_s: float = _f(1.0, "how often the writer thread appends recorded events, seconds",
                        min=0.05)


@dataclass
class ResilienceConfig:
    """`myria supervise`: heartbeats, fault detection, recovery and two-stage checkpoints."""

    heartbeat_s: float = _f(1.0, "period of each worker's heartbeat to the supervisor's store, "
                            "seconds", min=0.05)
    missed_heartbeats: int = _f(3, "heartbeat periods without a heartbeat before a worker is "
                                "declared dead or frozen", min=1)
    hang_timeout_s: float = _f(60.0, "a live worker without step or phase progress for this long "
                               "is hung", min=0.1)
    traffic_timeout_s: float = _f(0.0, "a rank whose communicated bytes stop growing for this "
                                  "long while training is flagged; 0 means hang_timeout_s",
                                  min=0.0)
    alarm_keywords: str = _f("Traceback,CUDA error,NCCL error,out of memory", "comma-separated "
                             "keywords that raise an alarm when a worker writes them to stderr")
    alarm_grace_s: float = _f(10.0, "after a stderr alarm, restart if the rank has neither "
                              "exited nor made progress within this many seconds", min=0.0)
    max_restarts: int = _f(10, "restarts of the worker group before the supervisor gives up",
                           min=0)
    backoff_s: float = _f(1.0, "wait before the first restart; doubles on each further one",
                          min=0.0)
    backoff_max_s: float = _f(60.0, "largest wait between restarts", min=0.0)
    store: str = _f("tcp", "where heartbeats go: tcp (a TCPStore served by the supervisor on "
                    "127.0.0.1) or redis", choices=("tcp", "redis"))
    redis_url: str = _f("redis://127.0.0.1:6379/0", "Redis server for store = redis")
    diagnose: bool = _f(True, "run `myria doctor` checks on this host before each restart")
    doctor_expect: str = _f("", "expected figures for the checks as key=value,... (keys of "
                            "`myria doctor --expect`, e.g. gemm_tflops=0.02); empty = defaults")
    doctor_timeout_s: float = _f(120.0, "time limit of the diagnostics before a restart",
                                 min=1.0)
    diagnostics_ttl_s: float = _f(3600.0, "skip the diagnostics before a restart when this "
                                  "host passed them (or `myria doctor`) this recently and the "
                                  "fault does not point at the hardware; 0 = always run them",
                                  min=0.0)
    blocklist_hook: str = _f("", "shell command run for a host that fails diagnostics; {host} "
                             "and {blocklist} (file of blocked hosts) are substituted, e.g. "
                             "`scontrol update NodeName={host} State=DRAIN Reason=myria`")
    bad_host_action: str = _f("exit", "after blocklisting this host: exit (status 3, so the "
                              "scheduler requeues the job elsewhere) or recheck (run the "
                              "diagnostics again after the hook and continue if they pass)",
                              choices=("exit", "recheck"))
    straggler_threshold: float = _f(0.10, "a rank whose compute-only time is this much slower "
                                    "than its peers' (same pipeline stage) is a straggler",
                                    min=0.0)
    straggler_window: int = _f(5, "steps per straggler window (medians over each window)",
                               min=2)
    straggler_windows: int = _f(2, "consecutive slow windows before a straggler is reported",
                                min=1)
    straggler_action: str = _f("warn", "on a straggler: warn (log and RUN_DIR/events.jsonl), "
                               "replace (also exclude its host at the next restart when a spare "
                               "host exists) or none", choices=("warn", "replace", "none"))
    sigterm_grace_s: float = _f(60.0, "time workers get after SIGTERM to save a checkpoint and "
                                "exit before SIGKILL", min=0.0)
    async_checkpoint: bool = _f(True, "two-stage checkpoints: snapshot to host memory, write in "
                                "the background; false writes synchronously")
    memory_snapshot_interval: int = _f(-1, "every this many steps each rank's state is also "
                                       "held in its ring neighbour's memory, checksummed "
                                       "(myria.train.peer); 0 = off; -1 = every step with "
                                       "recovery = in-job, else off", min=-1)
    recovery: str = _f("restart", "on a lost worker under `myria supervise`: restart (stop "
                       "the worker group, start it again from the newest checkpoint on disk) "
                       "or in-job (survivors stay; a spare or a fresh process takes the lost "
                       "rank's state from its ring neighbour's memory; myria.train.rejoin)",
                       choices=("restart", "in-job"))
    spares: int = _f(0, "hot spare processes (torch imported, waiting) the supervisor keeps "
                     "for recovery = in-job; 0 = a fresh process replaces a lost worker",
                     min=0)
    shrink: bool = _f(False, "recovery = in-job with no hot spare ready: go on with one data-"
                      "parallel replica fewer on the same global batch (pure DDP layouts: "
                      "training.data_parallel = ddp over every rank) and grow back to the "
                      "full size once a spare is ready; false: a fresh process replaces the "
                      "lost worker")
    snapshot_overlap: bool = _f(True, "copy the snapshot during the next step's forward and "
                                "backward, blocking only before the optimizer changes weights")
    nccl_ib_timeout: int = _f(20, "NCCL_IB_TIMEOUT: InfiniBand verbs timeout exponent, "
                              "4.096 us * 2^N per retry (NVIDIA default 20)", min=1)
    nccl_ib_retry_cnt: int = _f(7, "NCCL_IB_RETRY_CNT: InfiniBand retransmissions before a "
                                "connection fails (NVIDIA default and maximum 7)", min=0)
    nccl_async_error_handling: int = _f(1, "TORCH_NCCL_ASYNC_ERROR_HANDLING: 1 aborts the "
                                        "communicators and ends the process on a collective "
                                        "error or timeout, so the supervisor restarts it",
                                        min=0)
    nccl_trace_buffer: int = _f(20000, "TORCH_FR_BUFFER_SIZE (was TORCH_NCCL_TRACE_BUFFER_SIZE):"
                                " collectives kept by the flight recorder (torchtitan's default),"
                                " dumped on a NCCL timeout to name the hung collective; 0 "
                                "disables", min=0)
    sdc_interval: int = _f(40, "steps between the silent-data-corruption checks that compare "
                           "ranks: a partner recomputes one microbatch, replicas compare bit "
                           "checksums (also before each checkpoint); > 0 also turns on each "
                           "rank's checksums of its state at rest, every step; 0 = off", min=0)
    sdc_action: str = _f("rollback", "on diverged replicas: rollback (stop; under `myria "
                         "supervise` restart from the newest checkpoint) or warn",
                         choices=("rollback", "warn"))
    numerical_action: str = _f("skip", "on a non-finite loss or gradient norm, or a loss spike: "
                               "skip (no update for that batch), rollback (restart from the "
                               "newest checkpoint and skip that step's batch) or stop",
                               choices=("skip", "rollback", "stop"))
    loss_spike_sigmas: float = _f(0.0, "a loss above its running mean by this many running "
                                  "deviations (after 20 steps) is a spike, handled as "
                                  "numerical_action; 0 = off (6-10 suits most runs)", min=0.0)


@dataclass
class Config:
    """A whole run."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    resilience: ResilienceConfig = field(default_factory=ResilienceConfig)
    observe: ObserveConfig = field(default_factory=ObserveConfig)
    profiling: ProfilingConfig = field(default_factory=ProfilingConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def validate(self) -> Config:
        """Check consistency between fields (the parallel layout: `myria.layout.Layout`)."""
        validate(self)
        return self


SECTIONS: dict[str, type] = {
    "model": ModelConfig, "data": DataConfig, "training": TrainingConfig,
    "optimizer": OptimizerConfig, "parallel": ParallelConfig, "checkpoint": CheckpointConfig,
    "logging": LoggingConfig, "resilience": ResilienceConfig, "observe": ObserveConfig,
    "profiling": ProfilingConfig,
}


def suggest(name: str, valid: typing.Iterable[str]) -> str:
    """' (did you mean ...?)' for the closest valid name, or ''."""
    close = difflib.get_close_matches(name, list(valid), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""



def _field_type(cls: type, name: str) -> type:
    hints = typing.get_type_hints(cls)
    t = hints[name]
    if isinstance(t, types.UnionType):  # e.g. int | None
        t = next(a for a in typing.get_args(t) if a is not type(None))
    return t


def coerce(where: str, cls: type, name: str, value: Any) -> Any:
    """`value` checked and converted for field `name` of schema dataclass `cls` (type, choices,
    lower bound of its `_f` metadata); `where` names it in the error ("training.steps")."""
    t = _field_type(cls, name)
    meta = next(f.metadata for f in dataclasses.fields(cls) if f.name == name)
    choices = meta.get("choices")
    if meta.get("parse") is not None and not isinstance(value, t):
        value = meta["parse"](where, value)
    if t is bool:
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            value = value.lower() in ("true", "1", "yes")
        if not isinstance(value, bool):
            raise ConfigError(f"{where} = {value!r}: expected true or false")
    elif t is int:
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer():
                value = int(value)
            else:
                raise ConfigError(f"{where} = {value!r}: expected an integer")
    elif t is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where} = {value!r}: expected a number")
        value = float(value)
    elif t is str:
        if isinstance(value, bool) and choices and "true" in choices:
            value = "true" if value else "false"     # tri-state fields: auto, true, false
        if not isinstance(value, str):
            raise ConfigError(f"{where} = {value!r}: expected a string")
        if choices and value not in choices and value.lower() in choices:
            value = value.lower()
    if choices and value not in choices:
        raise ConfigError(f"{where} = {value!r}: must be one of {', '.join(map(str, choices))}"
                          + suggest(str(value), map(str, choices)))
    lo = meta.get("min")
    if lo is not None and value < lo:
        raise ConfigError(f"{where} = {value!r}: must be >= {lo}")
    return value


def section_values(section: str, cls: type, values: Any, prefix: str = "") -> dict[str, Any]:
    """The checked values of one TOML table for schema dataclass `cls`: unknown keys are errors
    with a "did you mean"; `prefix` starts every message (e.g. "run 'x': ")."""
    if not isinstance(values, dict):
        raise ConfigError(f"{prefix}[{section}] must be a table of key = value pairs")
    names = [f.name for f in dataclasses.fields(cls)]
    out = {}
    for key, value in values.items():
        if key not in names:
            raise ConfigError(f"{prefix}unknown key {section}.{key}" + suggest(key, names)
                              + f"; valid keys of [{section}]: {', '.join(names)}")
        out[key] = coerce(f"{prefix}{section}.{key}", cls, key, value)
    return out


def from_dict(data: dict, base: Config | None = None) -> Config:
    """Build a Config from nested dicts ({section: {key: value}}), starting from `base`."""
    cfg = base if base is not None else Config()
    for section, values in data.items():
        if section not in SECTIONS:
            raise ConfigError(f"unknown config section [{section}]; valid sections: "
                              f"{', '.join(SECTIONS)}" + suggest(section, SECTIONS))
        obj = getattr(cfg, section)
        for key, value in section_values(section, SECTIONS[section], values).items():
            setattr(obj, key, value)
    return cfg


def parse_override(text: str) -> tuple[str, str, Any]:
    """Parse `--section.key=value` (value in TOML syntax, or a bare string)."""
    body = text[2:] if text.startswith("--") else text
    if "=" not in body or "." not in body.split("=", 1)[0]:
        raise ConfigError(f"override {text!r}: expected --section.key=value, e.g. "
                          "--training.steps=100")
    dotted, raw = body.split("=", 1)
    section, key = dotted.split(".", 1)
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw
    return section, key, value


def read_text_file(path: str | Path, what: str = "config file") -> str:
    """The text of a TOML file the user named: one clear ConfigError when it is missing, a
    directory, unreadable or not UTF-8 (TOML files are UTF-8 by the specification)."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"{what} {str(p)!r} does not exist" if not p.exists() else
                          f"{what} {str(p)!r} is not a file")
    try:
        return p.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{what} {str(p)!r} is not UTF-8 text (byte {e.start}: "
                          f"{e.object[e.start:e.start + 1]!r}); TOML files must be UTF-8"
                          ) from None
    except OSError as e:
        raise ConfigError(f"{what} {str(p)!r} cannot be read: {e.strerror}") from None


def load(path: str | Path | None = None, overrides: typing.Sequence[str] = ()) -> Config:
    """Load a TOML config (or the defaults when `path` is None) and apply overrides."""
    cfg = Config()
    if path is not None:
        p = Path(path)
        text = read_text_file(p)
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"config file {str(p)!r} is not valid TOML: {e}") from None
        cfg = from_dict(data, cfg)
    cfg = apply_overrides(cfg, overrides)
    validate(cfg)
    return cfg


def apply_overrides(cfg: Config, overrides: typing.Sequence[str]) -> Config:
    """`cfg` (changed in place) with the `--section.key=value` overrides set."""
    nested: dict[str, dict] = {}
    for o in overrides:
        section, key, value = parse_override(o)
        nested.setdefault(section, {})[key] = value
    return from_dict(nested, cfg)




def validate(cfg: Config) -> None:
    """Raise ConfigError for inconsistent fields (the parallel layout's rules are
    `Layout.check`, run before the workers start and by each worker's engine)."""
    m, t = cfg.model, cfg.training
    validate_model(m)
    refuse_settings_that_do_nothing(m)
    if t.micro_batch > t.global_batch:
        raise ConfigError(f"training.micro_batch = {t.micro_batch} exceeds training.global_batch"
                          f" = {t.global_batch}")
    if cfg.optimizer.decay_fraction > 1:
        raise ConfigError(f"optimizer.decay_fraction = {cfg.optimizer.decay_fraction}: must be "
                          "between 0 and 1 (the share of the steps the wsd schedule decays)")
    if cfg.optimizer.beta1 >= 1 or cfg.optimizer.beta2 >= 1:
        raise ConfigError("optimizer.beta1 and optimizer.beta2 must be < 1")
    bad = [n for n in cfg.logging.trackers.split(",") if n.strip().lower()
           not in ("", "wandb", "mlflow")]
    if bad:
        raise ConfigError(f"logging.trackers = {cfg.logging.trackers!r}: {bad[0].strip()!r} is "
                          "not a tracker; use wandb, mlflow or 'wandb,mlflow'")
    if t.eval_interval and not cfg.data.eval_batches:
        raise ConfigError(f"data.eval_batches = 0 with training.eval_interval = "
                          f"{t.eval_interval}: an evaluation needs a batch; to train without "
                          "validation set training.eval_interval = 0")
    if cfg.data.phases and not cfg.data.sources:
        raise ConfigError(f"data.phases = {cfg.data.phases!r} weighs the sources of a mixture; "
                          "set data.sources (data.path is one directory)")
    r = cfg.resilience
    if r.spares and r.recovery != "in-job":   # a restart starts every worker afresh
        raise ConfigError(f"resilience.spares = {r.spares} needs resilience.recovery = "
                          f"'in-job' (recovery = {r.recovery!r} restarts every worker and "
                          "uses no spare); set recovery = 'in-job' or spares = 0")


def describe(cfg: Config) -> str:
    """The resolved config as TOML text with each field's description as a comment."""
    lines = []
    for section, cls in SECTIONS.items():
        lines.append(f"[{section}]")
        obj = getattr(cfg, section)
        rows = []
        for f in dataclasses.fields(cls):
            v = getattr(obj, f.name)
            if isinstance(v, bool):
                s = "true" if v else "false"
            elif isinstance(v, str):
                s = f'"{v}"'
            else:
                s = repr(v)
            rows.append((f"{f.name} = {s}", f.metadata.get("help", "")))
        # the comments in one column per section, past the common assignments' width
        width = max((len(a) for a, _ in rows if len(a) <= 40), default=0)
        lines += [f"{a:<{width}} # {h}" for a, h in rows]
        lines.append("")
    return "\n".join(lines)
