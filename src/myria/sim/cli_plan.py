"""`myria plan`: search parallel layouts for a model on a cluster; draw pipeline schedules.

The model comes from a run file (first run, or --run), a myria training config (its
`model.init_from` config.json when it names one, as `myria train` reads it), or flags
(--layers --hidden --heads ...). Batch, sequence and cluster come from the file or flags; flags
win. A training config is priced as myria's trainer runs it (`perf.trainer_stack`, what its dry
run prices), so the plan and `myria train --dry-run` agree on its layouts. Every assumption
that can change a layout's rank is a flag whose default is what the public stack does by
default, and the plan's first lines say each one and the flag that changes it
(`assumptions`): the attention kernel (--kernels: the newest FlashAttention the device runs,
fa3 on Hopper, fa2 on Ampere), fused elementwise kernels, which communication overlaps compute
(--overlap: tensor-parallel collectives, pipeline sends and data-parallel buckets, as
Megatron-Core's pretraining recipes run them; `DEFAULT_OVERLAP`), the fabric (--topology,
--oversubscription, --routing, --nic-gbps; `note:` lines say where the fabric's formulas leave
its own shape, `topology.Fabric.notes`) and the memory reserve.

`--show-schedule out.png --pp 4 --vpp 2 --microbatches 8` only draws that schedule; with a model
it draws the best layout's schedule with the stage times the step model predicts.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import sys
import time
from pathlib import Path

from myria.config import suggest as config_suggest
from myria.errors import ConfigError
from myria.sim import reliability, runspec
from myria.sim.planner import SearchSpace, plan
from myria.sim.runspec import MAX_NIC_GBPS, RunSpec


def _ints(text: str) -> list[int]:
    """A comma list of degrees or sizes, each >= 1."""
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected integers separated by commas")\
            from None
    if not vals or any(v < 1 for v in vals):
        raise argparse.ArgumentTypeError(f"{text!r}: every value must be an integer >= 1")
    return vals


def _zero_stages(text: str) -> list[int]:
    """A comma list of ZeRO stages, each 0-3."""
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        vals = []
    if not vals or any(v not in (0, 1, 2, 3) for v in vals):
        raise argparse.ArgumentTypeError(f"{text!r}: ZeRO stages are 0, 1, 2, 3 "
                                         "(comma-separated)")
    return vals


def at_least(lo: float, kind=int):
    """An argparse type: a number of `kind` that is >= lo."""
    def parse(text: str):
        try:
            v = kind(text)
        except ValueError:
            what = "an integer" if kind is int else "a number"
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
        if v < lo:
            raise argparse.ArgumentTypeError(f"{text!r}: must be >= {lo:g}")
        return v
    return parse


def nic_gbps(text: str) -> float:
    """--nic-gbps: a line rate in Gbit/s, above 0 and at most MAX_NIC_GBPS."""
    v = at_least(1e-3, float)(text)
    if v > MAX_NIC_GBPS:
        raise argparse.ArgumentTypeError(
            f"{text!r} Gbit/s is faster than any NIC (at most {MAX_NIC_GBPS:,.0f}): give the "
            "line rate in Gbit/s, e.g. 400 for a 400G NIC")
    return v


# --find's keys: the layout's fields (`StepResult.layout`), mb and zero as the flags say them
FIND_KEYS = {"tp": "tp", "pp": "pp", "cp": "cp", "dp": "dp", "ep": "ep", "vpp": "vpp",
             "mb": "micro_batch", "zero": "zero_stage", "recompute": "recompute",
             "schedule": "schedule"}


def _find(text: str) -> dict:
    """--find 'tp=8,pp=16': {layout field: value}."""
    out = {}
    for item in (x.strip() for x in text.split(",") if x.strip()):
        key, eq, value = item.partition("=")
        if not eq or key.strip() not in FIND_KEYS:
            raise argparse.ArgumentTypeError(
                f"{item!r}: expected KEY=VALUE with KEY one of {', '.join(FIND_KEYS)}"
                + config_suggest(key.strip(), FIND_KEYS))
        value = value.strip()
        out[FIND_KEYS[key.strip()]] = int(value) if value.isdigit() else value
    if not out:
        raise argparse.ArgumentTypeError("give KEY=VALUE pairs, e.g. 'tp=8,pp=16'")
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("base", nargs="?", help="what to plan: a run TOML (the model, batch, "
                        "cluster, kernels, overlap), a myria training TOML (the model and batch, "
                        "priced as myria's trainer runs it, as its --dry-run), or a Hugging Face "
                        "model "
                        "directory or its config.json (the model only: give --seq-len and "
                        "--global-batch)")
    parser.add_argument("--run", default="", help="which run of a multi-run file")
    g = parser.add_argument_group("model (instead of, or overriding, a file)")
    g.add_argument("--arch", choices=("gpt", "llama"),
                   help="block style: gpt (LayerNorm, GELU, learned positions) or llama "
                   "(RMSNorm, SwiGLU, RoPE)")
    for name, what in (("layers", "transformer layers"), ("hidden", "model width"),
                       ("heads", "attention heads"), ("kv-heads", "key/value heads (GQA)"),
                       ("ffn-hidden", "MLP width"), ("vocab", "vocabulary size"),
                       ("top-k", "experts per token")):
        g.add_argument(f"--{name}", type=at_least(1), help=what)
    g.add_argument("--experts", type=at_least(0), help="experts per MoE layer (0: dense)")
    g = parser.add_argument_group("run and cluster")
    g.add_argument("--seq-len", type=at_least(1), help="tokens per sequence")
    g.add_argument("--global-batch", type=at_least(1), help="sequences per iteration")
    g.add_argument("--gpu", help="a100-sxm-80gb, h100-sxm-80gb, h200, ...")
    g.add_argument("--gpus", type=at_least(1), help="number of devices")
    g.add_argument("--gpus-per-node", type=at_least(1), help="devices per server")
    g.add_argument("--nic-gbps", type=nic_gbps, help="NIC line rate, Gbit/s (400 for a 400G "
                   "NIC)")
    g.add_argument("--topology", choices=("fat-tree", "clos3", "rail-optimized"))
    g.add_argument("--oversubscription", type=at_least(1.0, float),
                   help="fabric oversubscription (1 = non-blocking)")
    g.add_argument("--routing", choices=("adaptive", "ecmp"),
                   help="how the fabric spreads flows over uplinks: adaptive (evenly) or ecmp "
                   f"(hashed per flow; default {DEFAULT_ROUTING})")
    g.add_argument("--rank-jitter", type=at_least(0.0, float),
                   help="spread of one rank's step time against its peers' (share of the "
                   "compute; default 0.01, assumed): the step waits for the slowest rank")
    g.add_argument("--jitter-tail", metavar="SHARE,EXCESS",
                   help="straggler tail: the share of rank-steps with an extra delay and its "
                   "mean in rank-jitter units (default 0,0: none; bench/sim_rank_jitter.py "
                   "measures both from a run's event files)")
    g.add_argument("--kernels", choices=("fa3", "fa2", "fa1", "unfused"),
                   help="attention kernel: FlashAttention-3 (Hopper), FlashAttention-2, "
                   "FlashAttention-1 (Ampere), or unfused softmax attention (default: the "
                   "newest the device runs)")
    g.add_argument("--no-flash", action="store_true", help="same as --kernels unfused")
    g.add_argument("--unfused-ops", action="store_true",
                   help="eager elementwise kernels (no fused bias+GELU, norms, softmax)")
    g.add_argument("--overlap", help="overlaps to switch on: tp, pp, dp (comma list) or none "
                   f"(default: {DEFAULT_OVERLAP}, as Megatron-Core's pretraining recipes run; "
                   "torchtitan without async TP: pp,dp)")
    g = parser.add_argument_group("search space (comma lists)")
    g.add_argument("--tp", type=_ints, help="tensor-parallel degrees (default: powers of two "
                   "up to a server)")
    g.add_argument("--pp", type=_ints, help="pipeline stages (default: divisors of the layers "
                   "and powers of two)")
    g.add_argument("--cp", type=_ints, help="context-parallel degrees (default: powers of two "
                   "up to 16, >= 256 tokens each)")
    g.add_argument("--ep", type=_ints, help="expert-parallel degrees (default: divisors of "
                   "--experts)")
    g.add_argument("--vpp", type=_ints, help="virtual stages per pipeline rank, interleaved "
                   "1F1B (default: 1-8)")
    g.add_argument("--mb", type=_ints, help="micro-batch sizes")
    g.add_argument("--recompute", help="none,selective,elementwise,full")
    g.add_argument("--zero", type=_zero_stages, help="ZeRO stages, e.g. 0,1,3")
    parser.add_argument("--top", type=at_least(1), default=10,
                        help="layouts to show (default 10)")
    parser.add_argument("--find", type=_find, metavar="LAYOUT",
                        help="where a layout stands in the whole ranking, e.g. "
                        "'tp=8,pp=16,cp=1' (keys: " + ", ".join(FIND_KEYS) + "); the best "
                        "ranked layout with those values is shown with its place and whether "
                        "it is tied with #1")
    parser.add_argument("--reserve-gb", type=at_least(0.0, float), default=None,
                        help="device memory kept free beyond the model's estimate, which "
                        "already counts the allocator's fragmentation and the runtime's "
                        "workspaces (default 0; see myria.sim.planner)")
    reliability.add_arguments(parser, at_least(1e-3, float), at_least(0.0, float))
    parser.add_argument("--json", action="store_true", help="print the ranked layouts as JSON")
    parser.add_argument("--write-run", metavar="TOML", help="write the first layout as a run "
                        "file, every assumption of this plan in it: `myria simulate TOML` "
                        "prices it as the plan did (and can be edited to try variations)")
    parser.add_argument("--csv", metavar="FILE", help="also write the ranked layouts (--top "
                        "of them) to FILE as CSV, one row per layout: its degrees and settings, "
                        "step time, MFU and band, memory, ETTR and the step's breakdown in "
                        "seconds (for a spreadsheet)")
    g = parser.add_argument_group("pipeline schedule drawing")
    g.add_argument("--show-schedule", metavar="PNG", help="draw a pipeline schedule to PNG")
    g.add_argument("--microbatches", type=at_least(1),
                   help="m for --show-schedule (with one --pp)")
    g.add_argument("--schedule", choices=("gpipe", "1f1b", "interleaved-1f1b", "zero-bubble"),
                   help="schedule to draw (default: interleaved-1f1b with --vpp > 1, else 1f1b)")


# What overlaps compute when no file says, as Megatron-Core runs large models in NVIDIA's
# pretraining recipes (NeMo's llama3_405b, gpt3_175b, ...: tp_comm_overlap with
# TransformerEngine's userbuffers, overlap_grad_reduce, overlap_param_gather, asynchronous
# pipeline sends): tensor-parallel collectives in chunks behind their GEMMs, pipeline sends,
# data-parallel buckets. torchtitan overlaps pipeline and FSDP2 traffic by default and
# tensor-parallel traffic only with async TP switched on: --overlap pp,dp prices that.
DEFAULT_OVERLAP = "tp,pp,dp"
# The fabric's routing when neither file nor flag says: the run schema's own default.
DEFAULT_ROUTING = runspec.ClusterSpec.__dataclass_fields__["routing"].default


def _base_from_args(args) -> RunSpec:
    model: dict = {}
    training: dict = {}
    cluster: dict = {}
    kernels: dict = {"flash_attention": True, "fused_ops": True, "flash_version": "auto"}
    overlap: dict = {k: k in DEFAULT_OVERLAP.split(",") for k in ("tp", "pp", "dp")}
    parallel: dict = {}
    name = "plan"
    trainer_cfg = None   # a myria training config: priced as myria's trainer runs it
    hf_dir = _model_directory(Path(args.base)) if args.base else None
    if hf_dir is not None:
        from myria.interop import hf

        # a Hugging Face model directory gives the model; the run (sequence, batch) is typed
        seq = [f"--model.seq_len={args.seq_len}"] if args.seq_len else []
        cfg, _ = hf.load_config(None, [f"--model.init_from={hf_dir}", *seq], weights=False)
        model = runspec.model_section(cfg.model)
        del model["seq_len"]
        name = hf_dir.resolve().name
    elif args.base:
        p = Path(args.base)
        if p.is_dir():
            raise ConfigError(f"{p}: a directory without config.json; give a run or training "
                              "TOML, or a Hugging Face model directory (it holds config.json)")
        from myria.config import read_text_file

        text = read_text_file(p)
        if runspec.is_run_file(text):
            runs = runspec.loads(text, str(p))
            run = next((r for r in runs if r.name == args.run), None) if args.run else runs[0]
            if run is None:
                raise ConfigError(f"--run {args.run!r}: no such run in {args.base}; it has "
                                  f"{', '.join(r.name for r in runs)}")
            if not args.run and len(runs) > 1:
                print(f"note: planning {run.name!r}, the first of the {len(runs)} runs in "
                      f"{args.base} (--run NAME plans another: "
                      f"{', '.join(r.name for r in runs[1:])})", file=sys.stderr)
            model = dataclasses.asdict(run.model)
            training = dataclasses.asdict(run.training)
            cluster = dataclasses.asdict(run.cluster)
            kernels = dataclasses.asdict(run.kernels)
            overlap = dataclasses.asdict(run.overlap)
            parallel = {"schedule": run.parallel.schedule
                        if run.parallel.schedule in ("gpipe", "zero-bubble") else "1f1b"}
            name = run.name
        else:
            from myria.interop import hf

            trainer_cfg, _ = hf.load_config(p, weights=False)
            model = runspec.model_section(trainer_cfg.model)
            name = p.stem
    if args.run and not (args.base and hf_dir is None and runspec.is_run_file(text)):
        raise ConfigError(f"--run picks a run of a simulator run file; "
                          f"{args.base or 'the typed model'} is "
                          + ("a Hugging Face model directory" if hf_dir is not None else
                             "a training config, one run" if args.base else "one run"))
    if args.arch is not None and model.get("arch", args.arch) != args.arch:
        print(f"note: --arch {args.arch} replaces {name}'s architecture {model['arch']!r}: "
              f"the plan prices a {args.arch} model of its sizes, not the file's",
              file=sys.stderr)
    for flag, key in (("arch", "arch"), ("layers", "layers"), ("hidden", "hidden"),
                      ("heads", "heads"), ("kv_heads", "kv_heads"),
                      ("ffn_hidden", "ffn_hidden"), ("vocab", "vocab"),
                      ("experts", "experts"), ("top_k", "top_k"), ("seq_len", "seq_len")):
        if getattr(args, flag) is not None:
            model[key] = getattr(args, flag)
    if args.global_batch is not None:
        training["global_batch"] = args.global_batch
    for flag in ("gpu", "gpus", "gpus_per_node", "nic_gbps", "topology", "oversubscription",
                 "routing"):
        if getattr(args, flag) is not None:
            cluster[flag] = getattr(args, flag)
    args.trainer_config = trainer_cfg is not None   # its search: what the trainer runs
    if trainer_cfg is not None:
        from myria.sim.perf import trainer_stack

        stack = trainer_stack(trainer_cfg, is_cpu=str(cluster.get("gpu")).lower() == "cpu")
        training = {**stack["training"], **training}   # --global-batch over the config's
        kernels, overlap = stack["kernels"], stack["overlap"]
    if args.rank_jitter is not None:
        cluster["rank_jitter"] = args.rank_jitter
    if args.jitter_tail is not None:
        cluster["jitter_tail_share"], cluster["jitter_tail_excess"] = _jitter_tail(
            args.jitter_tail)
    if args.no_flash or args.kernels == "unfused":
        kernels["flash_attention"] = False
    elif args.kernels:
        kernels.update(flash_attention=True, flash_version=args.kernels)
    if args.unfused_ops:
        kernels["fused_ops"] = False
    if args.overlap is not None:
        want = {x.strip() for x in args.overlap.split(",") if x.strip() and x != "none"}
        bad = want - {"tp", "pp", "dp"}
        if bad:
            raise ConfigError(f"--overlap {args.overlap!r}: unknown {sorted(bad)}; use tp, pp, "
                              "dp or none")
        overlap = {k: k in want for k in ("tp", "pp", "dp")}
    if model.get("top_k", 1) > 1 and not model.get("experts"):
        raise ConfigError(f"--top-k {model['top_k']}: experts per token of a dense model; give "
                          "--experts N (experts per MoE layer) too")
    given = " (a model directory gives the model, not the run)" if hf_dir else ""
    if hf_dir and model.get("seq_len") is None:   # the run's default would be a guess
        raise ConfigError(f"myria plan needs --seq-len{given}")
    for req, what in ((model.get("layers"), "--layers (or a file)"),
                      (model.get("hidden"), "--hidden"), (model.get("heads"), "--heads"),
                      (training.get("global_batch"), f"--global-batch{given}"),
                      (cluster.get("gpu"), "--gpu"), (cluster.get("gpus"), "--gpus")):
        if req is None:
            raise ConfigError(f"myria plan needs {what}")
    data = {"name": name, "model": model, "training": training, "cluster": cluster,
            "kernels": kernels, "overlap": overlap, "parallel": parallel}
    # reuse the run-file parser for types, defaults and checks; search fields are reset
    training.pop("micro_batch", None)
    for k in ("recompute", "zero_stage"):
        training.pop(k, None)
    base = runspec.parse_run(data, check=False)
    if base.kernels.flash_attention:
        from myria.sim.hardware import flash_kernel

        try:
            flash_kernel(base.cluster.gpu, base.kernels.flash_version)
        except ConfigError as e:
            raise ConfigError(f"--kernels {base.kernels.flash_version}: "
                              f"{str(e).split(': ', 1)[1]}") from None
    from myria.config import validate_model

    validate_model(base.model_config())  # the layout is the search's: only the model's checks
    return base


def _model_directory(p: Path) -> Path | None:
    """The Hugging Face model directory `myria plan` was given (the directory, or its
    config.json), or None for a TOML file."""
    if p.is_dir() and (p / "config.json").is_file():
        return p
    if p.name == "config.json" and p.is_file():
        return p.parent
    return None


def _space(args) -> SearchSpace:
    """The search the flags ask for; of a training config (`args.trainer_config`), only the
    data-parallel stages and recomputations myria's trainer has (ddp, zero2, fsdp: ZeRO 0, 2,
    3; none, selective, full: the model's none, elementwise, full)."""
    sp = SearchSpace()
    if getattr(args, "trainer_config", False):
        sp.zero_stage = [0, 2, 3]
        sp.recompute = list(runspec.TRAINER_RECOMPUTE)
    for f in ("tp", "pp", "cp", "ep", "vpp"):
        if getattr(args, f):
            setattr(sp, f, getattr(args, f))
    if args.mb:
        sp.micro_batch = args.mb
    if args.recompute:
        vals = [x.strip() for x in args.recompute.split(",")]
        bad = [x for x in vals if x not in ("none", "selective", "elementwise", "full")]
        if bad:
            raise ConfigError(f"--recompute: {bad[0]!r} is not none, selective, elementwise "
                              "or full")
        sp.recompute = vals
    if args.zero:
        sp.zero_stage = args.zero
    return sp


def plan_argv(argv: list[str], top: int | None = None):
    """(base run, PlanResult) of `myria plan ARGV` exactly as the command prices it (its parser,
    defaults and search space); `top` overrides --top (the whole ranking: a large number)."""
    parser = argparse.ArgumentParser(prog="myria plan")
    add_arguments(parser)
    args = parser.parse_args(argv)
    if top is not None:
        args.top = top
    base = _base_from_args(args)
    return base, _plan(base, _space(args), args)


def expert_commands() -> list[dict]:
    """The typed commands of well-known runs and their published degrees
    (data/expert_commands.toml), each with `argv` as a list."""
    import tomllib

    path = runspec.calibration_path().with_name("expert_commands.toml")
    runs = tomllib.loads(path.read_text())["run"]
    return [{**r, "argv": r["argv"].split()} for r in runs]


def _draw_only(args) -> int:
    from myria.sim.schedule_plot import draw, formula_bubble, simulate_schedule

    if not args.pp or len(args.pp) != 1:
        raise ConfigError("--show-schedule with --microbatches needs one --pp value (stages)")
    p = args.pp[0]
    v = args.vpp[0] if args.vpp else 1
    m = args.microbatches
    sched = args.schedule or ("interleaved-1f1b" if v > 1 else "1f1b")
    slots = simulate_schedule(sched, p, v, m)
    frac = draw(slots, p, v, m, sched, args.show_schedule)
    print(f"{sched}: p={p} vpp={v} m={m}: bubble {frac:.1%} of stage time (closed form "
          f"{formula_bubble(sched, p, v, m):.1%}) -> {args.show_schedule}")
    return 0


def console(min_width: int = 150):
    """A rich Console for wide tables: the terminal's width (at least `min_width`); when the
    output is not a terminal (piped, redirected) wide enough that no column is cut."""
    from rich.console import Console

    probe = Console()
    if not probe.is_terminal:
        return Console(width=max(min_width, 400))
    return Console(width=max(min_width, probe.width))


# A search that runs longer than this (a mixture of experts on thousands of GPUs: minutes)
# says how far it got on stderr every this many seconds when stderr is not a terminal (a CI
# log, a pipe), where the spinner does not show.
PIPE_EVERY_S = 20.0


@contextlib.contextmanager
def searching(what: str, err_console=None, clock=time.monotonic):
    """A `progress` callback for `plan` that shows, on stderr while the search runs, how many
    layouts are priced and how many fit, and the time so far (a spinner that leaves no trace);
    when stderr is not a terminal, one line every PIPE_EVERY_S of a long search instead.
    `err_console`: another rich Console, `clock`: another clock (tests)."""
    from rich.console import Console
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    con = err_console or Console(stderr=True)
    bar = Progress(SpinnerColumn(), TextColumn(f"{what}: {{task.fields[n]:,}} layouts priced, "
                                               "{task.fields[fit]:,} fit in memory"),
                   TimeElapsedColumn(), console=con, transient=True,
                   disable=not con.is_terminal)
    task = bar.add_task(what, total=None, n=0, fit=0)
    t0 = clock()
    said = [t0]

    def progress(n: int, fit: int) -> None:
        bar.update(task, n=n, fit=fit)
        now = clock()
        if not con.is_terminal and now - said[0] >= PIPE_EVERY_S:
            said[0] = now
            con.print(f"{what}: {n:,} layouts priced, {fit:,} fit in memory "
                      f"({now - t0:.0f} s)", highlight=False, soft_wrap=True)

    with bar:
        yield progress


# The planner's largest model-parallel degrees (myria.sim.planner.candidates).
MAX_TP, MAX_CP = 64, 16


def check_gpus(base: RunSpec, space: SearchSpace) -> None:
    """One line blaming the GPU count when it is what no layout can match: whole servers, and
    no more GPUs than the batch and the model's split degrees can occupy."""
    c, m = base.cluster, base.model
    if c.gpus > c.gpus_per_node and c.gpus % c.gpus_per_node:
        lo = c.gpus // c.gpus_per_node * c.gpus_per_node
        raise ConfigError(f"--gpus {c.gpus}: a cluster of several servers has whole servers of "
                          f"--gpus-per-node {c.gpus_per_node} GPUs; use {lo} or "
                          f"{lo + c.gpus_per_node} (or set --gpus-per-node)")
    tp = max(space.tp or [min(MAX_TP, c.gpus if space.max_tp_across_nodes else c.gpus_per_node)])
    pp = max(space.pp or [m.layers])
    cp = max(space.cp or [max(1, min(MAX_CP, m.seq_len // 256))])
    most = base.training.global_batch * tp * pp * cp
    if c.gpus > most:
        raise ConfigError(f"--gpus {c.gpus}: more than this model and batch can occupy: at most "
                          f"{most:,} GPUs (global batch {base.training.global_batch} x tp {tp} x "
                          f"pp {pp} x cp {cp}); use fewer GPUs or a larger --global-batch")


def degree_problem(base: RunSpec, flag: str, v: int) -> str:
    """Why the model cannot be split `v` ways along `flag` ("" when it can): tp, cp by its
    heads, key/value heads, MLP width and sequence; pp by its layers; ep by its experts."""
    from myria.layout import validate_degrees

    m = base.model
    try:
        if flag in ("tp", "cp"):
            validate_degrees(base.model_config(), v if flag == "tp" else 1,
                             v if flag == "cp" else 1, False)
    except ConfigError as e:
        return str(e)
    if flag == "pp" and v > m.layers:
        return f"more pipeline stages than model.layers = {m.layers}"
    if flag == "ep" and v > 1 and not (m.experts and m.experts % v == 0):
        return f"must divide the experts per layer ({m.experts or 'none: a dense model'})"
    return ""


def check_degrees(base: RunSpec, space: SearchSpace, find: dict | None = None) -> None:
    """One line naming the flag when every degree it gives is one the model cannot split by
    (`degree_problem`), or when a degree --find asks for is one."""
    for flag in ("tp", "cp", "pp", "ep"):
        vals = getattr(space, flag) or []
        why = [degree_problem(base, flag, v) for v in vals]
        if vals and all(why):
            raise ConfigError(f"--{flag} {','.join(map(str, vals))}: {why[0]}")
        v = (find or {}).get(flag)
        if isinstance(v, int) and (why := degree_problem(base, flag, v)):
            raise ConfigError(f"--find {flag}={v}: {why}")


def _plan(base: RunSpec, space: SearchSpace, args):
    """The planner's result; when no layout matches, which GPU counts near this one do."""
    from myria.sim.planner import candidates

    check_degrees(base, space, getattr(args, "find", None))
    check_gpus(base, space)
    try:
        with searching("searching layouts") as progress:
            return plan(base, space, top=args.top, reserve_gb=args.reserve_gb,
                        reliability=reliability.from_args(args), progress=progress,
                        find=getattr(args, "find", None))
    except ConfigError as e:
        if not str(e).startswith("no layout matches"):
            raise
    c = base.cluster
    step = c.gpus_per_node if c.gpus >= c.gpus_per_node else 1

    def works(n: int) -> bool:
        run = dataclasses.replace(base, cluster=dataclasses.replace(c, gpus=n))
        return next(candidates(run, space), None) is not None

    near = [n for n in sorted({*range(step, 4 * c.gpus + step, step)}, key=lambda n:
                              (abs(n - c.gpus), n)) if n != c.gpus and works(n)][:2]
    fixed = ", ".join(f"--{flag} {','.join(map(str, getattr(space, f)))}"
                      for f, flag in (("tp", "tp"), ("pp", "pp"), ("cp", "cp"), ("ep", "ep"),
                                      ("vpp", "vpp"), ("micro_batch", "mb"))
                      if getattr(space, f))
    raise ConfigError(f"--gpus {c.gpus}: no layout searched splits {c.gpus} GPUs for this model "
                      f"and global batch {base.training.global_batch}"
                      + (f" with {fixed}" if fixed else "") +
                      " (the data-parallel degree, GPUs / (tp x pp x cp), times the "
                      "micro-batch must divide the global batch; unless --pp gives them, the "
                      "stages tried divide the layers or are powers of two)"
                      + (f"; {' or '.join(map(str, sorted(near)))} GPUs do" if near else ""))


def run(args: argparse.Namespace) -> int:
    for flag, path in (("--show-schedule", args.show_schedule), ("--write-run", args.write_run),
                       ("--csv", args.csv)):
        if path and not Path(path).resolve().parent.is_dir():
            raise ConfigError(f"{flag} {path}: its directory {Path(path).resolve().parent} "
                              "does not exist")
    if args.show_schedule and args.microbatches:
        return _draw_only(args)
    base = _base_from_args(args)
    res = _plan(base, _space(args), args)
    if args.json:
        # the best layout myria's trainer runs: #1 itself, a later one, or none (rank 0)
        first = res.ranked[0] if res.ranked and res.ranked[0].extra.get("runnable", True) \
            else None
        best = first or res.best_runnable
        print(json.dumps({"assumptions": assumptions(base, args.reserve_gb,
                                                     args.trainer_config),
                          "evaluated": res.evaluated, "fitting": res.fitting,
                          "seconds": res.seconds, "offloaded": res.offloaded,
                          "ranked": [r.to_json() for r in res.ranked],
                          "best_runnable": best.to_json() if best is not None else None,
                          "best_runnable_rank": 1 if first else res.best_runnable_rank,
                          "tied": res.tied_total,
                          **({"found": {"rank": res.found_rank, **res.found.to_json()}
                              if res.found is not None else None} if args.find else {}),
                          **({} if res.ranked else {"fastest_unfitting": _json(
                              res.best_unfitting), "leanest_unfitting": _json(res.leanest)})}))
    else:
        _print(base, res, args.reserve_gb, args.trainer_config)
        if args.find:
            print(found_line(res, args.find))
    if args.csv and res.ranked:
        write_csv(Path(args.csv), res.ranked)
        print(f"wrote {len(res.ranked)} ranked layout(s) to {args.csv}",
              file=sys.stderr if args.json else sys.stdout)
    if not res.ranked:
        return 1   # nothing fits: a script sees it
    if args.write_run:
        from myria.fsutil import atomic_write
        from myria.sim.planner import run_of

        first = run_of(base, res.ranked[0])
        atomic_write(Path(args.write_run), runspec.dumps(first, notes=(
            f"#1 of `myria plan`: predicted {res.ranked[0].iteration_time_s:.3f} s per "
            f"step, MFU {res.ranked[0].mfu:.1%}")))
        print(f"wrote #1 ({layout_label(res.ranked[0].layout)}) to {args.write_run}: `myria "
              f"simulate {args.write_run}` prices it as this plan did",
              file=sys.stderr if args.json else sys.stdout)
    if args.show_schedule and res.ranked:
        from myria.sim.schedule_plot import draw, simulate_schedule

        best = res.ranked[0]
        lay = best.layout
        p, v, m = lay["pp"], lay["vpp"], lay["microbatches"]
        sched = lay["schedule"] if lay["schedule"] in ("gpipe", "1f1b", "interleaved-1f1b",
                                                       "zero-bubble") else "1f1b"
        slots = simulate_schedule(sched, p, v, m)
        frac = draw(slots, p, v, m, sched, args.show_schedule,
                    title=f"best layout {layout_label(lay)}: {sched}, p={p}, vpp={v}, m={m}")
        print(f"schedule of the best layout: bubble {frac:.1%} -> {args.show_schedule}")
    return 0


CSV_LAYOUT = ("tp", "pp", "dp", "cp", "ep", "vpp", "schedule", "sequence_parallel",
              "micro_batch", "microbatches", "recompute", "zero_stage", "offload")


def write_csv(path: Path, ranked: list) -> None:
    """The ranking as CSV: rank and marks, the layout's fields, the prediction, the breakdown."""
    import csv
    import io

    parts = list(ranked[0].breakdown)
    out = io.StringIO()
    w = csv.writer(out)
    w.writerow(["rank", "tied", "runnable", "implausible", "layout", *CSV_LAYOUT,
                "iteration_time_s", "mfu", "mfu_low", "mfu_high", "tokens_per_s",
                "memory_gb_per_gpu", "ettr", "checkpoint_interval_steps",
                *(f"{k}_s" for k in parts)])
    for i, r in enumerate(ranked, 1):
        x, lay = r.extra, r.layout
        w.writerow([i, bool(x.get("tied")), bool(x.get("runnable", True)),
                    x.get("implausible") or "", layout_label(lay),
                    *(lay.get(k, "") for k in CSV_LAYOUT), f"{r.iteration_time_s:.6g}",
                    f"{r.mfu:.6g}", f"{x['mfu_low']:.6g}", f"{x['mfu_high']:.6g}",
                    f"{r.tokens_per_s:.6g}", f"{r.memory_gb_per_gpu:.6g}", f"{x['ettr']:.6g}",
                    x["checkpoint_interval_steps"],
                    *(f"{r.breakdown[k]:.6g}" for k in parts)])
    from myria.fsutil import atomic_write

    atomic_write(path, out.getvalue().encode())


def _json(r) -> dict | None:
    return r.to_json() if r is not None else None


def layout_label(lay: dict) -> str:
    """A layout in a few words, as `plan` and `simulate` label it: the degrees, HSDP's shard
    group when ZeRO shards over fewer ranks than dp, FSDP kept gathered, offload, sequence
    parallelism."""
    s = f"tp{lay['tp']} pp{lay['pp']} dp{lay['dp']}"
    if lay["cp"] > 1:
        s += f" cp{lay['cp']}"
    if lay["ep"] > 1:
        s += f" ep{lay['ep']}"
    if lay["vpp"] > 1:
        s += f" v{lay['vpp']}"
    if lay.get("dp_shard") and lay["dp_shard"] < lay["dp"] and lay["zero_stage"] >= 1:
        s += f" hsdp{lay['dp_shard']}"
    if lay["zero_stage"] >= 3 and not lay.get("reshard_after_forward", True):
        s += " keep-gathered"
    if lay.get("offload", "none") != "none":
        s += f" offload={lay['offload']}" + ("+params" if lay.get("offload_params") else "")
    return s + (" sp" if lay["sequence_parallel"] else "")


def _jitter_tail(text: str) -> tuple[float, float]:
    """--jitter-tail SHARE,EXCESS: a share in [0, 1] and a mean excess >= 0."""
    try:
        share, excess = (float(x) for x in text.split(","))
    except ValueError:
        share = excess = -1.0
    if not (0 <= share <= 1 and excess >= 0):
        raise ConfigError(f"--jitter-tail {text!r}: expected SHARE,EXCESS with SHARE in [0, 1] "
                          "and EXCESS >= 0, e.g. 0.01,3")
    return share, excess


def assumptions(base: RunSpec, reserve_gb: float | None = None, trainer: bool = False
                ) -> list[str]:
    """The assumptions that can change a layout's rank, each with the flag that changes it;
    `trainer`: the model came from a myria training config, priced as its trainer runs it."""
    from myria.sim.hardware import build_hardware, flash_kernel

    k, o, c = base.kernels, base.overlap, base.cluster
    attn = flash_kernel(c.gpu, k.flash_version) if k.flash_attention else "unfused"
    on = ",".join(x for x in ("tp", "pp", "dp") if getattr(o, x)) or "none"
    hw = build_hardware(c, base.training.precision)
    return [
        f"assumed: attention {attn} (--kernels fa3|fa2|fa1|unfused), elementwise kernels "
        f"{'fused' if k.fused_ops else 'unfused'} (--unfused-ops); overlap {on} (--overlap; "
        + ("default for a training config: none, as myria's trainer runs it, with its own "
           "modules and SDPA's FlashAttention-2; ZeRO 0, 2, 3 and its recomputations searched"
           if trainer else f"default {DEFAULT_OVERLAP} as Megatron-Core's recipes run")
        + "); data-parallel "
        "buckets: Megatron-Core's max(40M, 1M x dp) parameters for ZeRO 0-1, FSDP's units for "
        "ZeRO 2-3",
        f"assumed: {hw.gpus_per_node} GPU{'s' if hw.gpus_per_node != 1 else ''} per server "
        f"(--gpus-per-node), {hw.nics_per_node} x {hw.nic_gbps:g} Gb/s "
        f"NIC{'s' if hw.nics_per_node != 1 else ''} (--nic-gbps), {c.topology} fabric "
        f"(--topology) at oversubscription {c.oversubscription:g} (--oversubscription), "
        f"{c.routing} routing (--routing) with {c.flows_per_pair} flows per pair "
        "(cluster.flows_per_pair in a run file; ECMP hashes each); "
        f"rank jitter {c.rank_jitter:g} of the compute (--rank-jitter; assumed, not fitted), "
        f"straggler tail {c.jitter_tail_share:g},{c.jitter_tail_excess:g} (--jitter-tail)",
        f"assumed: memory: the model's estimate with {reserve_gb or 0:g} GB more kept free "
        f"(--reserve-gb); gradients of ZeRO 2-3 reduce-scattered "
        + ("once per step (training.reduce_once, as myria's trainer)" if
           base.training.reduce_once else "after every microbatch (DeepSpeed's; "
           "training.reduce_once in a run file: once per step, as myria's trainer)")
        + (f"; dropout {base.dropout:g} (model.dropout in a run file)"
           if base.model.arch == "gpt" else ""),
    ]


def fabric_notes(hw) -> list[str]:
    """`note:` lines where the fabric's formulas leave the fabric's own shape
    (`topology.Fabric.notes`), shown by `plan` and `simulate`."""
    return [f"note: {x}" for x in hw.fabric.notes()]


# How far MFU (attention charged for every key) may exceed mfu_causal before the table's MFU
# is called out: past it, a causal run's headline MFU overstates the work by more than noise.
CAUSAL_GAP = 0.05


def causal_note(res, seq_len: int, who: str) -> str:
    """The line that says a causal run's MFU counts attention work a causal query skips, when
    MFU and mfu_causal differ by more than `CAUSAL_GAP` ("" otherwise); `who` names the row."""
    if res.mfu - res.mfu_causal <= CAUSAL_GAP:
        return ""
    return (f"MFU charges attention for every key, as Megatron's and PaLM's MFU do; a causal "
            f"query sees about half of them, which at sequence {seq_len} is a large share of "
            f"the work: counting only those, {who} is {res.mfu_causal:.1%} (mfu_causal in "
            "--json)")


def separation(res) -> list[str]:
    """What separates each of the first five (or fewer, as ranked) from the first: step time,
    memory margin and the two costs that differ most (seconds per step)."""
    from myria.sim.planner import margin_bytes
    from myria.sim.step_result import BREAKDOWN_LABELS

    if len(res.ranked) < 2:
        return []
    def settings(lay: dict) -> dict:
        return {"layout": layout_label(lay), "micro-batch": lay["micro_batch"],
                "recompute": lay["recompute"], "ZeRO": lay["zero_stage"]}

    one = res.ranked[0]
    mine = settings(one.layout)
    out = [f"#1: {one.iteration_time_s:.3f} s per step, {margin_bytes(one) / 1e9:.1f} GB free"]
    for i, r in enumerate(res.ranked[1:5], 2):
        diff = {k: r.breakdown[k] - one.breakdown.get(k, 0.0) for k in r.breakdown}
        top = sorted(diff.items(), key=lambda kv: -abs(kv[1]))[:2]
        costs = ", ".join(f"{BREAKDOWN_LABELS[k]} {v:+.3f} s" for k, v in top if abs(v) > 5e-4)
        other = settings(r.layout)
        what = ", ".join(f"{k} {v}" for k, v in other.items() if v != mine[k])
        longer = r.iteration_time_s / one.iteration_time_s - 1
        out.append(f"#{i}: {what or 'the same settings'}: step "
                   f"{0.0 if abs(longer) < 5e-4 else longer:+.1%}, "   # never "-0.0%"
                   f"{margin_bytes(r) / 1e9:.1f} GB free" + (f" ({costs})" if costs else ""))
    return out


def found_line(res, find: dict) -> str:
    """--find's answer: the layout's place in the whole ranking and whether it is tied."""
    said = {field: key for key, field in FIND_KEYS.items()}
    spec = ",".join(f"{said[k]}={v}" for k, v in find.items())
    r = res.found
    if r is None:
        return (f"--find {spec}: no layout with those values fits in memory among the "
                f"{res.fitting:,} that do (or none was searched: see --help for the ranges)")
    first = res.ranked[0]
    x = r.extra
    return (f"--find {spec}: #{res.found_rank:,} of {res.fitting:,} fitting, "
            f"{layout_label(r.layout)}, mb {r.layout['micro_batch']}, recompute "
            f"{r.layout['recompute']}, ZeRO {r.layout['zero_stage']}: "
            f"{r.iteration_time_s:.3f} s per step, MFU {r.mfu:.1%}, "
            f"{r.memory_gb_per_gpu:.1f} GB; "
            + ("tied with #1 (within the model's uncertainty)" if x.get("tied") else
               f"not tied with #1 ({first.mfu:.1%}: {1 - r.mfu / first.mfu:.1%} less)")
            + (f"; {x['not_runnable']}" if x.get("not_runnable") else "")
            + (f"; ! {x['implausible']}" if x.get("implausible") else ""))


def model_line(base: RunSpec) -> str:
    """The planned model in a few words: parameters, shape, attention heads, MLP, vocabulary,
    experts."""
    from myria.models.flops import param_counts

    cfg = base.model_config()
    n = param_counts(cfg).total(cfg.layers)
    size = f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.0f}M"
    moe = f", {cfg.experts} experts (top {cfg.top_k})" if cfg.experts else ""
    mixer = (f", layers {cfg.block_pattern!r}" if cfg.arch in ("griffin", "hybrid") else "") \
        + (f", {cfg.attention} attention" if cfg.attention != "softmax" else "") \
        + (f", window {cfg.attention_window}" if 0 < cfg.attention_window < cfg.seq_len else "")
    return (f"{cfg.arch} {size}: {cfg.layers} x {cfg.hidden}, {cfg.heads} heads "
            f"({cfg.n_kv_heads} key/value), MLP {cfg.ffn_dim}, vocabulary {cfg.vocab_size:,}"
            f"{mixer}{moe}")


def _print(base: RunSpec, res, reserve_gb: float | None = None, trainer: bool = False
           ) -> None:
    from rich.table import Table

    con = console(150)
    m = base.model
    con.print(f"model {model_line(base)}, seq {m.seq_len}, global batch "
              f"{base.training.global_batch}, {base.cluster.gpus} x {base.cluster.gpu}")
    for line in assumptions(base, reserve_gb, trainer):
        con.print(line)
    from myria.sim.hardware import build_hardware

    hw = build_hardware(base.cluster, base.training.precision)
    for line in fabric_notes(hw):
        con.print(line)
    con.print(f"{res.evaluated:,} layouts evaluated in {res.seconds:.2f} s, {res.fitting:,} fit "
              "in memory")
    if res.offloaded:
        con.print("[yellow]no layout fits in device memory as it is: these keep the optimizer "
                  "state (offload=cpu: host memory; nvme: disk, myria's parallel.offload) and "
                  "with +params the parameters off the device[/yellow]")
    if not res.ranked:
        dev = hw.memory_bytes / 1e9
        con.print(f"[red]no layout fits in device memory ({dev:.0f} GB per GPU), even with "
                  "offload[/red]")
        if res.best_unfitting:
            b = res.best_unfitting
            con.print(f"fastest layout if memory allowed: {layout_label(b.layout)} needs "
                      f"{b.memory_gb_per_gpu:.0f} GB")
        if res.leanest:
            b, lay = res.leanest, res.leanest.layout
            off = lay.get("offload", "none")
            host = (f" and {b.memory.host_bytes_per_node / 1e9:,.0f} GB of "
                    f"{'host memory' if off == 'cpu' else 'NVMe'} per server"
                    if off != "none" else "")
            mem = b.memory
            state = (mem.weights + mem.gradients + mem.optimizer) / 1e9
            # a shorter sequence helps only where activations are what does not fit
            shorter = ", or a shorter sequence" if mem.activations > 0.3 * mem.total else ""
            con.print(f"closest to fitting: {layout_label(lay)}, micro-batch {lay['micro_batch']}, "
                      f"recompute {lay['recompute']}, ZeRO {lay['zero_stage']}: "
                      f"{b.memory_gb_per_gpu:.0f} GB per GPU{host} (weights, gradients and "
                      f"optimizer state {state:.0f} GB of it); more GPUs, devices or servers "
                      f"with more memory{shorter} would be needed")
        return
    tab = Table(title="best layouts by predicted MFU")
    # context- and expert-parallel traffic get their columns when a layout shown has any
    more = [(k, name) for k, name in (("cp_comm_exposed", "CP"), ("ep_comm_exposed", "EP"))
            if any(r.breakdown.get(k, 0.0) > 0 for r in res.ranked)]
    cols = ("#", "layout", "mb", "m", "recompute", "ZeRO", "iter s", "MFU (band)", "tok/s",
            "mem GB", "ETTR", "ckpt every", "compute", "recomp", "TP", "bubble", "p2p", "DP",
            *(name for _, name in more), "other")
    for c in cols:
        tab.add_column(c, justify="left" if c in ("layout", "recompute") else "right")
    for i, r in enumerate(res.ranked, 1):
        bd, t = r.breakdown, r.iteration_time_s
        comp = bd["compute_gemm"] + bd["compute_attention"] + bd["compute_memory_bound"]
        named = comp + bd["recompute"] + bd["tp_comm_exposed"] + bd["pp_bubble"] + \
            bd["pp_p2p_exposed"] + bd["dp_comm_exposed"] + sum(bd.get(k, 0.0) for k, _ in more)
        lay = r.layout
        x = r.extra
        tab.add_row(str(i) + ("=" if x.get("tied") else "") +
                    ("" if x.get("runnable", True) else "†") +
                    ("!" if x.get("implausible") else ""), layout_label(lay),
                    str(lay["micro_batch"]), str(lay["microbatches"]),
                    lay["recompute"], str(lay["zero_stage"]), f"{t:.3f}",
                    f"{r.mfu:.1%} ({x['mfu_low']:.0%}-{x['mfu_high']:.0%})",
                    f"{r.tokens_per_s:,.0f}", f"{r.memory_gb_per_gpu:.1f}",
                    f"{x['ettr']:.3f}",
                    reliability.interval_text(x["checkpoint_interval_steps"]),
                    f"{comp / t:.0%}",
                    f"{bd['recompute'] / t:.0%}", f"{bd['tp_comm_exposed'] / t:.0%}",
                    f"{bd['pp_bubble'] / t:.0%}", f"{bd['pp_p2p_exposed'] / t:.0%}",
                    f"{bd['dp_comm_exposed'] / t:.0%}",
                    *(f"{bd.get(k, 0.0) / t:.0%}" for k, _ in more), f"{(t - named) / t:.0%}")
    con.print(tab)
    first = res.ranked[0]
    note = causal_note(first, m.seq_len, "#1")
    if note:
        con.print(note)
    # a plausible layout comes first: when #1 is marked, every layout that fits is
    every = bool(first.extra.get("implausible"))
    for i, r in enumerate(res.ranked, 1):
        if r.extra.get("not_runnable"):
            con.print(f"† #{i}: {r.extra['not_runnable']}")
        if r.extra.get("implausible"):
            con.print(f"! #{i}: {'' if every else 'not first: '}{r.extra['implausible']}")
    if every:
        con.print("[yellow]every layout that fits is marked ! (a prediction the model cannot "
                  "vouch for): they are ranked by predicted MFU all the same; treat #1 as a "
                  "guess and check its memory or overlap on the cluster[/yellow]")
    if not first.extra.get("runnable", True):
        b = res.best_runnable
        if b is None:
            con.print(f"none of the {res.fitting:,} layouts that fit is one myria's trainer "
                      "runs (†: priced for other frameworks only)")
        elif res.best_runnable_rank > len(res.ranked):
            con.print(f"the best layout myria's trainer runs is #{res.best_runnable_rank}: "
                      f"{layout_label(b.layout)}, MFU {b.mfu:.1%}, {b.iteration_time_s:.3f} s per "
                      f"step, {b.memory_gb_per_gpu:.1f} GB")
        else:
            con.print(f"the best layout myria's trainer runs is #{res.best_runnable_rank}")
    tied = sum(1 for r in res.ranked if r.extra.get("tied"))
    band = res.ranked[0].extra["band"]
    if tied > 1:
        whole = (f"#1-#{res.tied_total:,} (those shown marked =)" if res.tied_total > tied
                 else f"#1-#{tied} (marked =)")
        con.print(f"{whole} lie within the model's uncertainty (±{band:.0%}, its "
                  "held-out error on the calibration runs) of the best MFU: statistically "
                  "tied, so they are ordered by predicted step time (to 0.1%), then by free "
                  "memory; a prediction the model cannot vouch for (!) is not first" +
                  (", nor one myria's trainer does not run (†) when one it runs is tied"
                   if any(not r.extra.get("runnable", True) for r in res.ranked[:tied])
                   else "") +
                  f". What separates the first {min(5, len(res.ranked))}:")
        for line in separation(res):
            con.print("  " + line)
    from myria.sim.band import describe

    con.print(describe((res.ranked[0].layout["device"],)))
    rel = res.ranked[0].extra["reliability"]
    if reliability.no_failures(rel):
        con.print(f"ETTR: {reliability.NO_FAILURES}.")
    else:
        con.print(f"ETTR: expected share of wall time in kept training steps with failures "
                  f"every {rel['mtbf_s'] / 3600:.1f} h on average (job MTBF), recovery "
                  f"{rel['recovery_s']:.0f} s, checkpoint stall "
                  f"{rel['checkpoint_stall_s']:.2f} s at the interval that maximises it "
                  "(Young/Daly); see docs/performance_model.md.")
