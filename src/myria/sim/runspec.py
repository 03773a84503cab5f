"""Run descriptions for the simulator: the `[[run]]` TOML schema, its documented defaults, checks.

A run file holds one or more `[[run]]` tables, or a single run written without the wrapper. Each
run has the sections `model`, `training`, `parallel`, `overlap`, `kernels` and `cluster` (see the
field help strings below, which are also the documentation of every default), plus free-form
`name`, `source`, `notes` and `measured` (ignored by the model; the calibration bench reads it).

Unknown sections and keys are errors with a "did you mean" suggestion, like the training config.
"""

from __future__ import annotations

import dataclasses
import tomllib
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from myria.config import Config, ParallelConfig, read_text_file, section_values, suggest
from myria.config.model import ModelConfig, validate_model
from myria.config.schema import schema_field
from myria.device import DEVICES, lookup
from myria.errors import ConfigError
from myria.layout import Layout

_f = schema_field
REQUIRED = object()  # marker default of fields a run must give
# No NIC runs faster (800G and 1.6T ports are the newest): a larger cluster.nic_gbps is a unit
# slip (bits or bytes per second)
MAX_NIC_GBPS = 10_000.0


# The [model] section is the trainer's own ModelConfig seen with the simulator's defaults: every
# ModelConfig field is a key here (a field added there appears here, with its help and checks),
# vocab_size is spelled `vocab` as published tables do, and these fields differ in default
# (published GPT runs: Megatron-LM's defaults) or type (tie_embeddings: auto by architecture).
MODEL_RENAMED = {"vocab_size": "vocab"}
_MODEL_FACE = {
    "arch": (str, _f("gpt", "gpt (LayerNorm, GELU, biases, learned positions), llama "
                     "(RMSNorm, SwiGLU, RoPE, GQA), retnet (multi-scale retention), griffin "
                     "(RG-LRU and local attention per block_pattern) or hybrid (llama with a "
                     "mixer per layer from block_pattern: Gated DeltaNet, Mamba-2, attention, "
                     "RG-LRU)", choices=("gpt", "llama", "retnet", "griffin", "hybrid"))),
    "layers": (int, _f(REQUIRED, "transformer blocks", min=1)),
    "hidden": (int, _f(REQUIRED, "model width", min=1)),
    "heads": (int, _f(REQUIRED, "attention (query) heads", min=1)),
    "vocab_size": (int, _f(0, "vocabulary size; 0 means 51200 (gpt) or 32000 (llama)", min=0)),
    "seq_len": (int, _f(2048, "sequence length in tokens", min=1)),
    "capacity_factor": (float, _f(1.0, "MoE expert capacity factor (padding of expert "
                                  "batches); 0 means dropless (no padding)", min=0.0)),
    "tie_embeddings": (str, _f("auto", "share input embedding and output layer: auto (yes for "
                               "gpt, as Megatron-LM, no for llama), true or false",
                               choices=("auto", "true", "false"))),
}
_MODEL_ONLY_HERE = [  # what the simulator needs and myria's models do not have
    ("dropout", float, _f(-1.0, "dropout probability of attention and hidden dropout; -1 means "
                          "0.1 for gpt (Megatron-LM GPT default) and 0 for llama", min=-1.0)),
]


def _face(name: str, src: type, doc: str, overrides: dict, extra: list, keep=None,
          renamed: dict | None = None) -> type:
    """A schema dataclass that shows fields of the trainer's `src` dataclass (all, or `keep`)
    with their help and checks, some spelled differently (`renamed`) or with the simulator's
    default (`overrides`: name -> (type, field)), plus `extra` fields of its own."""
    hints = typing.get_type_hints(src)
    out = []
    for f in dataclasses.fields(src):
        if keep is not None and f.name not in keep:
            continue
        key = (renamed or {}).get(f.name, f.name)
        if f.name in overrides:
            out.append((key, *overrides[f.name]))
        elif f.default_factory is not dataclasses.MISSING:
            out.append((key, hints[f.name], field(default_factory=f.default_factory,
                                                  metadata=f.metadata)))
        else:
            out.append((key, hints[f.name], field(default=f.default, metadata=f.metadata)))
    return dataclasses.make_dataclass(name, out + extra, namespace={
        "__doc__": doc, "__module__": __name__})


ModelSpec = _face("ModelSpec", ModelConfig, "The model being trained: myria's ModelConfig as a "
                  "run file spells it.", _MODEL_FACE, _MODEL_ONLY_HERE, renamed=MODEL_RENAMED)


def model_section(mc: ModelConfig) -> dict:
    """The [model] table of a myria ModelConfig (the inverse of `RunSpec.model_config`)."""
    out = {MODEL_RENAMED.get(f.name, f.name): getattr(mc, f.name)
           for f in dataclasses.fields(ModelConfig)}
    out["tie_embeddings"] = "true" if mc.tie_embeddings else "false"
    out["dropout"] = 0.0  # myria's models have no dropout
    return out


@dataclass
class TrainingSpec:
    """Batch, recomputation, optimizer and precision."""

    global_batch: int = _f(REQUIRED, "sequences per optimizer step", min=1)
    micro_batch: int = _f(1, "sequences per forward/backward pass on one pipeline", min=1)
    recompute: str = _f("none", "activation recomputation: none, selective (attention core, "
                        "Korthikanti et al. 2022), elementwise (keep GEMM and attention "
                        "outputs, recompute norms, RoPE, activation functions and dropout: "
                        "torchtitan's op-level selective checkpointing, myria's own selective) "
                        "or full (every layer)",
                        choices=("none", "selective", "elementwise", "full"))
    optimizer: str = _f("adam", "adam or lamb (both keep two fp32 moments)",
                        choices=("adam", "lamb"))
    zero_stage: int = _f(0, "ZeRO stage 0-3 (3 = FSDP full sharding) over the data-parallel "
                         "ranks", min=0)
    precision: str = _f("bf16", "compute precision: bf16, fp16, fp8 (Hopper GEMMs at twice the "
                        "bf16 peak) or fp32", choices=("bf16", "fp16", "fp8", "fp32"))
    reshard_after_forward: bool = _f(True, "ZeRO-3/FSDP: free the gathered parameters after "
                                     "each forward and gather them again for backward, every "
                                     "microbatch (false: keep them gathered across the step's "
                                     "microbatches: one all-gather per step, full parameter "
                                     "memory)")
    reduce_once: bool = _f(False, "ZeRO 2-3: gradients accumulate whole over the step's "
                           "microbatches and are reduce-scattered once per step, as myria's "
                           "trainer runs FSDP2 (gradient sync off until the last microbatch; "
                           "more gradient memory, less traffic); false: reduce-scattered after "
                           "every microbatch (DeepSpeed's ZeRO-2/3). Under a pipeline always "
                           "once per step")
    offload: str = _f("none", "ZeRO-Offload/Infinity: the optimizer state to cpu memory (with "
                      "zero_stage 3 also the sharded parameters and gradients, as FSDP2's "
                      "CPUOffloadPolicy) or nvme (myria's nvme tier: files streamed through the "
                      "device, overlapped with the update); none keeps all on the device",
                      choices=("none", "cpu", "nvme"))
    offload_params: bool = _f(False, "offload = nvme: the parameters' master copy on disk too, "
                              "three layers at a time on the device")
    data_loading_s: float = _f(0.0, "exposed data-loading time per iteration in seconds (0: the "
                               "loader prefetches behind compute)", min=0.0)


# The trainer's parallel.activation_checkpoint for the simulator's training.recompute: myria's
# "selective" keeps the matmul outputs and recomputes the elementwise operators (the
# simulator's "elementwise"); the attention-core "selective" (Korthikanti et al.) it does not run
TRAINER_RECOMPUTE = {"none": "none", "full": "full", "elementwise": "selective"}
RECOMPUTE_OF_TRAINER = {v: k for k, v in TRAINER_RECOMPUTE.items()}


# The [parallel] section: the trainer's degrees, interleaving, schedule and sequence parallelism
# (`myria.config.ParallelConfig`, same help and checks), with the data-parallel degree of a
# cluster run (dp fills the GPUs; the trainer's dp_replicate x dp_shard) and sequence
# parallelism off by default, as in the published runs without it.
ParallelSpec = _face(
    "ParallelSpec", ParallelConfig, "The parallel layout; dp is what remains of the GPUs after "
    "tp*pp*cp.", {"sequence_parallel": (bool, _f(False, "Megatron sequence parallelism "
                                                 "(norm/dropout activations sharded over tp; "
                                                 "all-gather + reduce-scatter instead of "
                                                 "all-reduce)"))},
    [("dp", int, _f(0, "data-parallel degree; 0 means gpus/(tp*pp*cp), otherwise it is "
                    "checked", min=0)),
     ("dp_shard", int, _f(0, "HSDP: data-parallel ranks one ZeRO shard group spans (0: all of "
                          "them); the dp/dp_shard replicas all-reduce their sharded gradients "
                          "once per step", min=0))],
    keep=("tp", "pp", "cp", "ep", "vpp", "schedule", "sequence_parallel"))


@dataclass
class OverlapSpec:
    """Which communication overlaps compute (each has an explicit rule in perf.py)."""

    tp: bool = _f(False, "tensor-parallel collectives decomposed and overlapped with GEMMs")
    pp: bool = _f(False, "pipeline send/receive overlapped with compute")
    dp: bool = _f(False, "data-parallel gradient reduction (and ZeRO gathers) overlapped with "
                  "backward/forward compute")


@dataclass
class KernelSpec:
    """Kernel choices."""

    flash_attention: bool = _f(False, "FlashAttention (no materialised score matrix)")
    flash_version: str = _f("auto", "which FlashAttention: fa3 (Hopper only), fa2, fa1 (Ampere "
                            "only), or auto (the newest the device runs: fa3 on Hopper, fa2 "
                            "elsewhere)", choices=("auto", "fa1", "fa2", "fa3"))
    fused_ops: bool = _f(True, "fused elementwise kernels (bias+GELU, bias+dropout+add, "
                         "scale+mask+softmax, fused cross-entropy) as in Megatron-LM")
    eager: bool = _f(False, "myria's own eager PyTorch runtime (the CPU self-check): separate "
                     "Q/K/V and gate/up GEMMs, elementwise kernels as myria's modules run them, "
                     "chunked fused linear+cross-entropy when pp = tp = 1, FSDP2 semantics "
                     "(gradients reduce-scattered once per step), FLOP-balanced pipeline stages")


@dataclass
class ClusterSpec:
    """Devices, servers and the network fabric."""

    gpu: str = _f(REQUIRED, "device: a100-sxm-80gb, h100-sxm-80gb, h200, ... (myria.device) or "
                  "cpu (measured peak and memory bandwidth)")
    gpus: int = _f(REQUIRED, "devices in the run", min=1)
    gpus_per_node: int = _f(8, "devices per server (one NVLink domain)", min=1)
    nics_per_node: int = _f(0, "network interfaces per server; 0 means one per device", min=0)
    nic_gbps: float = _f(0.0, "line rate per NIC in Gb/s; 0 means 200 (A100 era, HDR) or 400 "
                         "(Hopper, NDR)", min=0.0)
    topology: str = _f("fat-tree", "fabric: fat-tree (2 switch tiers), clos3 (3 tiers, pods) or "
                       "rail-optimized (NIC i of every server on rail switch i)",
                       choices=("fat-tree", "clos3", "rail-optimized"))
    oversubscription: float = _f(1.0, "downlink:uplink bandwidth ratio at the top "
                                 "oversubscribed tier (1 = full bisection)", min=1.0)
    routing: str = _f("adaptive", "adaptive (load spread evenly over uplinks; also what IB "
                      "fat-tree routing achieves for collectives) or ecmp (hash per flow)",
                      choices=("adaptive", "ecmp"))
    rank_jitter: float = _f(0.01, "spread (standard deviation, a share of the step's compute) "
                            "of one rank's step time against its peers': a synchronous step "
                            "waits for the slowest rank. 0.01 is assumed, not fitted (the "
                            "calibration's 32-3,072 GPUs do not pin it); measure yours with "
                            "bench/sim_rank_jitter.py", min=0.0)
    jitter_tail_share: float = _f(0.0, "share of rank-steps that also take a rare extra delay "
                                  "(a straggler tail: host interrupts, garbage collection, "
                                  "throttling), at most 1; 0 means the normal law alone",
                                  min=0.0)
    jitter_tail_excess: float = _f(0.0, "mean of that extra delay in units of rank_jitter "
                                   "(exponential)", min=0.0)
    flows_per_pair: int = _f(2, "flows (queue pairs) NCCL opens per connection; more flows give "
                             "ECMP more entropy", min=1)
    switch_radix: int = _f(64, "ports per switch (half down, half up)", min=2)
    peak_tflops: float = _f(0.0, "override the device's dense peak TFLOP/s (required meaning for "
                            "cpu: 0 measures it)", min=0.0)
    memory_bw_gbs: float = _f(0.0, "override the device memory bandwidth in GB/s (cpu: 0 "
                              "measures it)", min=0.0)
    memory_gb: float = _f(0.0, "override the device memory in GB (cpu: 0 reads the host's)",
                          min=0.0)
    nvme_gbs: float = _f(0.0, "sequential bandwidth of the offload disks per server in GB/s "
                         "(nvme tier); 0 means the server's datasheet figure, on a cpu 1 GB/s "
                         "(a prior: measure yours with bench/offload.py)", min=0.0)
    intra_node_gbs: float = _f(0.0, "override the achieved intra-node all-reduce bus bandwidth "
                               "GB/s (NVLink ring, nccl-tests convention)", min=0.0)


def model_config_of(m: ModelSpec) -> ModelConfig:
    """The myria ModelConfig of a [model] section (`RunSpec.model_config`)."""
    kw = {f.name: getattr(m, MODEL_RENAMED.get(f.name, f.name))
          for f in dataclasses.fields(ModelConfig)}
    kw["tie_embeddings"] = m.tie_embeddings == "true" or (
        m.tie_embeddings == "auto" and m.arch == "gpt")
    kw["vocab_size"] = m.vocab or (51200 if m.arch == "gpt" else 32000)
    kw["top_k"] = m.top_k if m.experts else 1
    return ModelConfig(**kw)


SECTIONS: dict[str, type] = {
    "model": ModelSpec, "training": TrainingSpec, "parallel": ParallelSpec,
    "overlap": OverlapSpec, "kernels": KernelSpec, "cluster": ClusterSpec,
}
FREE_KEYS = ("name", "source", "notes", "measured")


@dataclass
class RunSpec:
    """One run to simulate."""

    name: str
    model: ModelSpec
    training: TrainingSpec
    parallel: ParallelSpec = field(default_factory=ParallelSpec)
    overlap: OverlapSpec = field(default_factory=OverlapSpec)
    kernels: KernelSpec = field(default_factory=KernelSpec)
    cluster: ClusterSpec = None  # type: ignore[assignment]
    source: str = ""
    measured: dict = field(default_factory=dict)

    # -- derived quantities ------------------------------------------------------------------
    @property
    def dp(self) -> int:
        p = self.parallel
        return self.cluster.gpus // (p.tp * p.pp * p.cp)

    @property
    def microbatches(self) -> int:
        """Microbatches per pipeline per iteration (gradient-accumulation steps)."""
        return self.layout().microbatches(self.training.global_batch, self.training.micro_batch)

    def layout(self) -> Layout:
        """The run's parallel layout (parallel.dp_shard 0: every data-parallel rank shards)."""
        p, dp = self.parallel, self.dp
        shard = p.dp_shard or dp
        return Layout(dp // shard, shard, p.tp, p.pp, p.cp, p.ep, p.vpp, p.schedule,
                      bool(p.sequence_parallel and p.tp > 1))

    def trainer_config(self) -> Config:
        """The run as myria's training Config (model, batch, data-parallel engine, offload), the
        input of the layout's one check (`Layout.check`)."""
        t = self.training
        cfg = Config(model=self.model_config())
        cfg.training.global_batch, cfg.training.micro_batch = t.global_batch, t.micro_batch
        # ZeRO-1 (optimizer state sharded) runs as zero2: FSDP2 shards the optimizer state
        # with the parameters and gradients, for the same traffic per step (a gradient
        # reduce-scatter, a parameter all-gather) and no more memory than ZeRO-1 priced; DDP
        # shards nothing and runs without tp, pp or cp only
        cfg.training.data_parallel = {3: "fsdp", 2: "zero2", 1: "zero2"}.get(t.zero_stage,
                                                                            "ddp")
        cfg.parallel.offload, cfg.parallel.offload_params = t.offload, t.offload_params
        cfg.parallel.activation_checkpoint = TRAINER_RECOMPUTE.get(t.recompute, t.recompute)
        cfg.optimizer.name = {"adam": "adamw"}.get(t.optimizer, t.optimizer)
        return cfg

    @property
    def dropout(self) -> float:
        d = self.model.dropout
        return (0.1 if self.model.arch == "gpt" else 0.0) if d < 0 else d

    @property
    def act_bytes(self) -> int:
        """Bytes per activation element (fp8 GEMMs still keep bf16 activations)."""
        return 4 if self.training.precision == "fp32" else 2

    def model_config(self) -> ModelConfig:
        """The myria ModelConfig of this run (every field passes through by name), so that
        models/flops.py counts its FLOPs as the live meter does."""
        return model_config_of(self.model)

    def replace(self, **sections: dict) -> RunSpec:
        """A copy with some fields changed: replace(parallel={"tp": 4}, overlap={"dp": True})."""
        kw = {}
        for sec, changes in sections.items():
            if sec in SECTIONS:
                kw[sec] = dataclasses.replace(getattr(self, sec), **changes)
            else:
                kw[sec] = changes
        out = dataclasses.replace(self, **kw)
        validate(out)
        return out


# -- parsing ----------------------------------------------------------------------------------
def _section(run: str, name: str, cls: type, data: Any) -> Any:
    kwargs = section_values(name, cls, {} if data is None else data, f"run {run!r}: ")
    for f in dataclasses.fields(cls):
        if f.default is REQUIRED and f.name not in kwargs:
            raise ConfigError(f"run {run!r}: {name}.{f.name} is required ({f.metadata['help']})")
    return cls(**kwargs)


def parse_run(data: dict, index: int = 0, check: bool = True) -> RunSpec:
    """Build one RunSpec from its TOML table; `check` validates the layout as well."""
    if not isinstance(data, dict):
        raise ConfigError(f"run #{index + 1} must be a table")
    name = data.get("name", f"run{index + 1}")
    if not isinstance(name, str):
        raise ConfigError(f"run #{index + 1}: name = {name!r}: expected a string")
    valid = list(SECTIONS) + list(FREE_KEYS)
    for key in data:
        if key not in valid:
            raise ConfigError(f"run {name!r}: unknown section or key {key!r}"
                              + suggest(key, valid) + f"; valid: {', '.join(valid)}")
    for sec in ("model", "training", "cluster"):
        if sec not in data:
            raise ConfigError(f"run {name!r}: section [{sec}] is required")
    secs = {sec: _section(name, sec, cls, data.get(sec)) for sec, cls in SECTIONS.items()}
    measured = data.get("measured", {})
    run = RunSpec(name=name, source=str(data.get("source", "")),
                  measured=measured if isinstance(measured, dict) else {}, **secs)
    if check:
        validate(run)
    return run


def loads(text: str, origin: str = "<string>") -> list[RunSpec]:
    """Parse run-file text: `[[run]]` tables or a single run without the wrapper."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"run file {origin!r} is not valid TOML: {e}") from None
    if "run" in data:
        runs = data["run"]
        extra = [k for k in data if k != "run"]
        if extra:
            raise ConfigError(f"run file {origin!r}: key {extra[0]!r} outside [[run]] tables; "
                              "put every run in its own [[run]] table")
        if isinstance(runs, dict):
            runs = [runs]
        if not isinstance(runs, list) or not runs:
            raise ConfigError(f"run file {origin!r}: [[run]] must hold at least one table")
        return [parse_run(r, i) for i, r in enumerate(runs)]
    return [parse_run(data)]


def dumps(run: RunSpec, notes: str = "") -> str:
    """`run` as run-file TOML (one run, its sections) that `loads` reads back equal."""
    import tomli_w

    data: dict[str, Any] = {"name": run.name}
    if run.source:
        data["source"] = run.source
    if notes:
        data["notes"] = notes
    for sec in SECTIONS:
        data[sec] = {k: v for k, v in dataclasses.asdict(getattr(run, sec)).items()
                     if v is not None}
    return tomli_w.dumps(data)


def load(path: str | Path) -> list[RunSpec]:
    """Parse a run file from disk."""

    return loads(read_text_file(path, "run file"), str(path))


def is_run_file(text: str) -> bool:
    """Whether TOML text looks like a simulator run file rather than a myria training config."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError:
        return False
    return "run" in data or "cluster" in data


def calibration_path() -> Path:
    """The packaged copy of the calibration runs (Narayanan et al. 2021, Table 1)."""
    return Path(__file__).with_name("data") / "calibration_runs.toml"


def load_calibration() -> list[RunSpec]:
    """The calibration runs as RunSpecs."""
    return load(calibration_path())


# -- checks -----------------------------------------------------------------------------------
def validate(run: RunSpec) -> None:
    """Raise ConfigError for inconsistent combinations, naming the fields."""
    t, p, c = run.training, run.parallel, run.cluster
    n = run.name

    try:
        validate_model(run.model_config())  # the trainer's own checks of a model
    except ConfigError as e:
        raise ConfigError(f"run {n!r}: {e}") from None
    if c.nic_gbps > MAX_NIC_GBPS:
        raise ConfigError(f"run {n!r}: cluster.nic_gbps = {c.nic_gbps:g} is faster than any NIC "
                          f"(at most {MAX_NIC_GBPS:,.0f} Gbit/s): give the line rate in Gbit/s")
    if c.jitter_tail_share > 1:
        raise ConfigError(f"run {n!r}: cluster.jitter_tail_share = {c.jitter_tail_share:g} "
                          "is a share: at most 1")
    if p.dp_shard and (run.dp % p.dp_shard or p.dp_shard > run.dp):
        raise ConfigError(f"run {n!r}: parallel.dp_shard = {p.dp_shard} must divide the "
                          f"data-parallel degree {run.dp}")
    if t.zero_stage > 3:
        raise ConfigError(f"run {n!r}: training.zero_stage = {t.zero_stage}: must be 0, 1, 2 "
                          "or 3")
    if c.gpus > c.gpus_per_node and c.gpus % c.gpus_per_node:
        raise ConfigError(f"run {n!r}: cluster.gpus = {c.gpus} is not a multiple of "
                          f"cluster.gpus_per_node = {c.gpus_per_node}")
    model_par = p.tp * p.pp * p.cp
    if c.gpus % model_par:
        raise ConfigError(f"run {n!r}: parallel.tp*pp*cp = {p.tp}*{p.pp}*{p.cp} = {model_par} "
                          f"does not divide cluster.gpus = {c.gpus}")
    dp = c.gpus // model_par
    if p.dp and p.dp != dp:
        raise ConfigError(f"run {n!r}: parallel.dp = {p.dp} but cluster.gpus/(tp*pp*cp) = {dp}")
    try:  # the layout's one check; the limits of myria's trainer alone are relaxed
        run.layout().check(run.trainer_config(), trainer=False)
    except ConfigError as e:
        raise ConfigError(f"run {n!r}: {e}") from None
    if c.gpu.lower() != "cpu" and lookup(c.gpu) is None:
        hint = suggest(c.gpu.lower(), list(DEVICES) + ["cpu"])
        raise ConfigError(f"run {n!r}: cluster.gpu = {c.gpu!r}: unknown device{hint}; known: "
                          f"{', '.join(list(DEVICES) + ['cpu'])}")


def describe() -> str:
    """The schema as commented TOML: every field with its default and meaning."""
    lines = ["# Run schema of `myria simulate` (one run; wrap several in [[run]] tables)",
             'name = "my-run"']
    for sec, cls in SECTIONS.items():
        lines.append(f"[{sec}]")
        for f in dataclasses.fields(cls):
            d = "(required)" if f.default is REQUIRED else repr(f.default)
            lines.append(f"# {f.name} = {d}: {f.metadata['help']}")
    return "\n".join(lines)
