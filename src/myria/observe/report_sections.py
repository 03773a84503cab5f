"""The sections of `myria report`'s page beside the timeline (myria.observe.report): validation
losses (per source of a data mixture), a hung run's report, a mixture's training figures per
source, the performance model's prediction beside the measured step, the goodput ledger and
the recoveries, the profiler's traces. Each has a reader of the run directory and an HTML
writer; the figures are PNGs inlined in the page."""

from __future__ import annotations

import base64
import html
import json
import statistics
from pathlib import Path

from myria import rundir
from myria.errors import MyriaError


def png(fig, path: Path) -> str:
    """Save matplotlib figure `fig` to `path` and return it base64-encoded for the page."""
    fig.savefig(path, dpi=110, bbox_inches="tight")
    import matplotlib.pyplot as plt

    plt.close(fig)
    return base64.b64encode(path.read_bytes()).decode()


def metrics_rows(run_dir: Path) -> list[dict]:
    """The training rows of RUN_DIR/metrics.jsonl (those with a loss)."""
    return [r for r in rundir.read_jsonl(run_dir / rundir.METRICS)
            if "loss" in r and isinstance(r.get("step"), int)]


# -- validation loss, per source of a data mixture ------------------------------------------

VAL_FILE = "val_loss.json"
VAL_TABLE_ROWS = 40   # eval steps listed in the page's table (evenly spaced, the last kept)


def validation_losses(run_dir: Path) -> dict | None:
    """The validation losses metrics.jsonl records (`val_loss`, and `val_loss_by_source` for a
    data mixture) by eval step, the last row of a step winning; each source's weight from the
    run's config.json (`data.sources`). None when no eval ran."""
    rows: dict[int, dict] = {}
    for r in rundir.read_jsonl(run_dir / rundir.METRICS):
        if isinstance(r.get("step"), int) and isinstance(r.get("val_loss"), (int, float)):
            rows[r["step"]] = r
    if not rows:
        return None
    steps = sorted(rows)
    per = {s: rows[s].get("val_loss_by_source") or {} for s in steps}
    names = list(dict.fromkeys(n for s in steps for n in per[s]))
    weights = validation_weights(run_dir)
    return {"steps": steps, "val_loss": [rows[s]["val_loss"] for s in steps],
            "by_source": {n: [per[s].get(n) for s in steps] for n in names},
            "weights": {n: weights[n] for n in names if n in weights}}


def write_validation(run_dir: Path, out: Path) -> dict | None:
    """val_loss.json and val_loss.png in the report directory (both removed when no eval ran);
    the losses, with the figure inlined under "png"."""
    val = validation_losses(run_dir)
    for name in (VAL_FILE, "val_loss.png"):
        (out / name).unlink(missing_ok=True)
    if val is None:
        return None
    (out / VAL_FILE).write_text(json.dumps(val, indent=1))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.4))
    for n, ys in val["by_source"].items():
        pts = [(x, y) for x, y in zip(val["steps"], ys, strict=True) if y is not None]
        w = val["weights"].get(n)
        ax.plot(*zip(*pts), marker=".",
                label=n + (f" (data.sources weight {w:g})" if w else ""))
    ax.plot(val["steps"], val["val_loss"], color="black", linestyle="--", marker=".",
            label="mixture (weighted by data.sources)" if val["by_source"] else "validation")
    ax.set_xlabel("step")
    ax.set_ylabel("validation loss")
    ax.set_title("validation loss" + (" per source" if val["by_source"] else ""))
    ax.legend(fontsize=8)
    return {**val, "png": png(fig, out / "val_loss.png")}


def validation_line(val: dict) -> str:
    """One line: the last eval's loss, and each source's."""
    per = ", ".join(f"{n} {ys[-1]:.4f}" for n, ys in val["by_source"].items()
                    if ys[-1] is not None)
    return (f"validation loss at step {val['steps'][-1]}: {val['val_loss'][-1]:.4f}" +
            (f" ({per})" if per else ""))


def validation_html(val: dict | None) -> str:
    """The page's section: the curve, a table per source (weight, first, last, best, change),
    and the losses at each eval step."""
    if val is None:
        return ""
    esc = html.escape
    steps, names = val["steps"], list(val["by_source"])
    cols = [("mixture" if names else "validation", None, val["val_loss"])] + \
        [(n, val["weights"].get(n), val["by_source"][n]) for n in names]

    def f(x) -> str:
        return "-" if x is None else f"{x:.4f}"

    summary = ""
    for name, w, ys in cols:
        pts = [(s, y) for s, y in zip(steps, ys, strict=True) if y is not None]
        if not pts:
            continue
        best = min(pts, key=lambda p: p[1])
        summary += (f"<tr><td>{esc(name)}</td><td>{'-' if w is None else f'{w:g}'}</td>"
                    f"<td>{f(pts[0][1])}</td><td>{f(pts[-1][1])}</td>"
                    f"<td>{f(best[1])} (step {best[0]})</td>"
                    f"<td>{pts[-1][1] - pts[0][1]:+.4f}</td></tr>")
    keep = range(len(steps))
    if len(steps) > VAL_TABLE_ROWS:
        keep = sorted({round(i * (len(steps) - 1) / (VAL_TABLE_ROWS - 1))
                       for i in range(VAL_TABLE_ROWS)})
    head = "".join(f"<th>{esc(n)}</th>" for n, _, _ in cols)
    body = "".join(f"<tr><td>{steps[i]}</td>" + "".join(f"<td>{f(ys[i])}</td>"
                                                         for _, _, ys in cols) + "</tr>"
                   for i in keep)
    img = (f"<img id='val_loss' alt='validation loss' src='data:image/png;base64,{val['png']}'>"
           if val.get("png") else "")
    shown = "" if len(keep) == len(steps) else f" ({len(keep)} of {len(steps)} evals shown)"
    return f"""<h2>Validation loss{' per source' if names else ''}</h2>{img}
<p>{esc(validation_line(val))}. First and last eval: steps {steps[0]} and {steps[-1]}
(<code>{VAL_FILE}</code> holds every eval).</p>
<table id="val-by-source"><tr><th>{'source' if names else ''}</th><th>weight</th>
<th>first</th><th>last</th><th>best</th><th>change</th></tr>{summary}</table>
<table id="val-steps"><tr><th>step{shown}</th>{head}</tr>{body}</table>"""


# -- a hang: the supervisor's report/hang.json ------------------------------------------------

def hang_report(out: Path) -> dict | None:
    """The supervisor's merged hang report (report/hang.json), None when the run never hung;
    `went_on_to`: the last step the run trained after it (a restart recovered), else None."""
    try:
        rep = json.loads((out / "hang.json").read_text())
    except (OSError, ValueError):
        return None
    if not (isinstance(rep, dict) and "stuck" in rep):
        return None
    at = float(rep.get("requested_at") or 0)
    later = [r["step"] for r in rundir.read_jsonl(out.parent / rundir.METRICS)
             if "loss" in r and float(r.get("time") or 0) > at] \
        if at and (out.parent / rundir.METRICS).exists() else []
    return {**rep, "went_on_to": max(later) if later else None}


def _taken_at(rep: dict) -> str:
    """The fault a hang report's stacks were taken at, in words ("hang" for a report without
    the field, which only hangs wrote)."""
    return (rep.get("fault") or "hang").replace("-", " ")


def hang_outcome(rep: dict) -> str:
    """What became of a run after its hang (or the fault its stacks were taken at), for the
    report's line and page."""
    what = f"the {_taken_at(rep)}"
    if rep.get("went_on_to") is None:
        return f"the steps every rank completed, before {what}"
    return (f"every step the ranks completed: the run was restarted after {what} and trained "
            f"on to step {rep['went_on_to']}")


def hang_title(rep: dict) -> str:
    """What the hang report was taken at: "the run hung", or for another fault whose
    detection takes the ranks' stacks (a host dropping out of the rendezvous) its name."""
    kind = _taken_at(rep)
    return "the run hung" if kind == "hang" else f"the ranks' stacks at the {kind}"


def hang_html(rep: dict | None) -> str:
    """The page's first section for a run that hung: the supervisor's own line (who is stuck,
    where, what the others wait in) and each stuck rank's stack, innermost frame first."""
    if rep is None:
        return ""
    from myria.observe.hang import summary_line

    esc = html.escape
    stacks = rep.get("stacks") or {}
    blocks = ""
    stuck = [str(r) for r in rep.get("stuck_ranks", [])]
    for r in stuck + [str(r) for r in rep.get("silent_ranks", [])]:
        frames = (stacks.get(r) or {}).get("main") or []
        tool = (stacks.get(r) or {}).get("tool")
        what = "stuck outside any collective" if r in stuck else "wrote nothing"
        blocks += (f"<h3>rank {esc(r)}: {what}" + (f" (stack by {esc(tool)}, innermost "
                                                     "first)" if frames else " (no stack)")
                   + "</h3>" + (f"<pre class=stack>{esc(chr(10).join(frames))}</pre>"
                                if frames else ""))
    coll = rep.get("collective") or {}
    for r in coll.get("ranks", []):
        frames = (stacks.get(str(r)) or {}).get("main") or []
        if frames:
            blocks += (f"<h3>rank {r}: waits in {esc(str(coll.get('name')))}</h3>"
                       f"<pre class=stack>{esc(chr(10).join(frames[:8]))}</pre>")
    rep = {**rep, "stuck": {int(k): v for k, v in rep["stuck"].items()}}
    title = hang_title(rep)
    return (f"<h2 id=hang>{esc(title[0].upper() + title[1:])}</h2><p>"
            f"<b>{esc(summary_line(rep))}</b> (the "
            "supervisor's hang report, <code>hang.json</code>). The blame below covers "
            f"{esc(hang_outcome(rep))}.</p>{blocks}")


# -- training figures per source of a data mixture -------------------------------------------

MIX_FILE = "mixture.json"


def training_by_source(run_dir: Path) -> dict | None:
    """A data mixture's training figures from metrics.jsonl: per source, the samples, tokens
    and epochs read up to the last logged step, the weight in effect there, the samples off
    the mixture's order (`mixture_at`: under one, phase by phase, when the run read as
    configured) and the training loss at the first and last step that measured it. None for a
    run on one directory."""
    rows = [r for r in metrics_rows(run_dir) if isinstance(r.get("samples_by_source"), dict)]
    if not rows:
        return None
    last = rows[-1]
    total = sum(last["samples_by_source"].values())
    weights, expected, since = mixture_at(run_dir, last["step"])
    lossed = [r for r in rows if isinstance(r.get("loss_by_source"), dict)]
    out = {"step": last["step"], "samples": total, "weights_from_step": since, "sources": {}}
    for n, c in last["samples_by_source"].items():
        w = weights.get(n)
        first_loss = next((r["loss_by_source"][n] for r in lossed if n in r["loss_by_source"]),
                          None)
        last_loss = next((r["loss_by_source"][n] for r in reversed(lossed)
                          if n in r["loss_by_source"]), None)
        out["sources"][n] = {
            "weight": w, "samples": c, "tokens": last["tokens_by_source"].get(n),
            "epochs": (last.get("epochs_by_source") or {}).get(n),
            "share": c / total if total else None,
            "off_by_samples": None if n not in expected else round(c - expected[n], 4),
            "first_loss": first_loss, "last_loss": last_loss}
    return out


def run_mixture(run_dir: Path) -> tuple[list, list[tuple[int, dict]], int] | None:
    """The run's mixture from its config.json: its sources (`data.sources`), its phases
    (`data.phases`: first step, weights) and training.global_batch; None without a config or
    a mixture."""
    try:
        from myria.data.mixture import parse_phases, parse_sources

        cfg = json.loads((run_dir / rundir.CONFIG).read_text())
        data = cfg.get("data") or {}
        if not data.get("sources"):
            return None
        src, phases = parse_sources(data["sources"]), str(data.get("phases") or "")
        return (src, parse_phases(phases, [x.name for x in src]) if phases else [],
                int(cfg["training"]["global_batch"]))
    except (OSError, ValueError, KeyError, TypeError, MyriaError):
        return None   # no or unreadable config: the figures without the weights


def mixture_at(run_dir: Path, step: int) -> tuple[dict[str, float], dict[str, int], int]:
    """Each source's weight at step `step` (`data.sources`'s, or the `data.phases` phase in
    effect), the samples the mixture's order takes from it in the first `step` steps, and the
    first step of those weights; ({}, {}, 1) without a mixture (`run_mixture`)."""
    from myria.data.mixture import format_phases, schedule

    if (mix := run_mixture(run_dir)) is None:
        return {}, {}, 1
    src, phases, global_batch = mix
    weights, since = {x.name: x.weight for x in src}, 1
    for first, ws in phases:
        if first <= step:
            weights, since = ws, first
    counts = schedule(src, format_phases(phases)).counts(step, global_batch)
    return weights, {x.name: int(c) for x, c in zip(src, counts, strict=True)}, since


def fault_steps(run_dir: Path) -> list[int]:
    """The step each fault of the run's supervised jobs came at (`job_summaries`)."""
    return sorted({int(f["last_step"]) for s in job_summaries(run_dir)
                   for f in s.get("faults") or [] if isinstance(f.get("last_step"), int)})


def phase_starts(run_dir: Path) -> list[int]:
    """The first step of each `data.phases` phase of the run (`run_mixture`); [] for none."""
    mix = run_mixture(run_dir)
    return [first for first, _ in mix[1]] if mix else []


def _seconds(x) -> str:
    """A table's seconds: two decimals, "-" when not measured."""
    return "-" if x is None else f"{float(x):.2f}"


def validation_weights(run_dir: Path) -> dict[str, float]:
    """Each source's weight from the run's config.json (`data.sources`); {} without one."""
    try:
        from myria.data.mixture import parse_sources

        cfg = json.loads((run_dir / rundir.CONFIG).read_text())
        spec = (cfg.get("data") or {}).get("sources") or ""
        return {src.name: src.weight for src in parse_sources(spec)} if spec else {}
    except (OSError, ValueError, MyriaError):
        return {}   # no or unreadable config: the figures without the weights


def mixture_line(mix: dict) -> str:
    """One line: each source's share of the samples against its weight, and its last loss."""
    parts = []
    for n, x in mix["sources"].items():
        w = "" if x["weight"] is None else f" (weight {x['weight']:g}" + (
            f" from step {mix['weights_from_step']})" if mix.get("weights_from_step", 1) > 1
            else ")")
        loss = "" if x["last_loss"] is None else f", loss {x['last_loss']:.4f}"
        parts.append(f"{n} {x['samples']:,} samples = {x['share']:.4f}{w}{loss}")
    return f"training by source to step {mix['step']}: " + "; ".join(parts)


def mixture_html(mix: dict | None) -> str:
    if mix is None:
        return ""
    esc = html.escape

    def f(x, spec=".4f") -> str:
        return "-" if x is None else format(x, spec)

    body = "".join(
        f"<tr><td>{esc(n)}</td><td>{f(x['weight'], 'g')}</td><td>{x['samples']:,}</td>"
        f"<td>{f(x['tokens'], ',')}</td><td>{f(x['share'])}</td>"
        f"<td>{f(x['off_by_samples'], '+g')}</td><td>{f(x['epochs'], '.3f')}</td>"
        f"<td>{f(x['first_loss'])}</td><td>{f(x['last_loss'])}</td></tr>"
        for n, x in mix["sources"].items())
    return f"""<h2>Training per source</h2><p>{esc(mixture_line(mix))}.</p>
<table id="train-by-source"><tr><th>source</th><th>weight</th><th>samples</th><th>tokens</th>
<th>share</th><th>samples off the mixture's order</th><th>epochs</th><th>first loss</th>
<th>last loss</th></tr>{body}</table>"""


# -- the model's prediction ------------------------------------------------------------------

def prediction(run_dir: Path, world: int | None = None, ranks_per_host: int = 0
               ) -> dict | None:
    """The performance model's step for the run's config on its `world` processes (default:
    its event files), `ranks_per_host` to a host (0: all on one), in the meter's MFU
    convention; None with no config.json. On a CPU it is
    priced from this CPU's figures measured at the run's threads per process (measured now if
    the cache lacks them, `myria.sim.measure.cpu.measured_profile`); elsewhere on the device the
    planner would use (`myria.device.planning_device`)."""
    cfg_path = run_dir / rundir.CONFIG
    if not cfg_path.exists():
        return None
    try:
        from myria import config as mconfig
        from myria.sim.perf import simulate_config

        cfg = mconfig.from_dict(json.loads(cfg_path.read_text()))
        world = world or run_world(run_dir)
        spec, prof, threads = _prediction_device(cfg, world, ranks_per_host)
        res = simulate_config(cfg, world, spec, gpus_per_node=ranks_per_host, cpu_profile=prof)
    except Exception as e:  # a prediction is a bonus: say why there is none
        return {"error": f"{type(e).__name__}: {e}"}
    out = {"iteration_time_s": res.iteration_time_s, "mfu": res.mfu,
           "breakdown": res.breakdown, "device": spec.name, "processes": world,
           "threads": threads, "peak": spec.source}
    if prof is not None:
        out["figures"] = prof.source
        busy = busy_figures(prof)
        if busy:
            out["caveat"] = busy
    return out


def busy_figures(prof) -> str:
    """Why a CPU profile is not a quiet host's, with what to do, or "" (`busy_note`)."""
    from myria.sim.cpu_profile import busy_note

    return busy_note(prof, "myria report")


def run_world(run_dir: Path) -> int:
    """How many processes a run had, from the per-rank files it leaves besides its events (the
    data loader's statistics, the checkpoint manager's): 1 when there are none."""
    counts = [sum(1 for _ in (run_dir / d).glob(pattern)) for d, pattern in
              ((rundir.EVENTS_DIR, "rank*.jsonl"), (rundir.DATA_STATS, "data_rank*.json"),
               (rundir.CHECKPOINT_STATS, "rank*.json"))]
    return max(1, *counts)


def _prediction_device(cfg, world: int, ranks_per_host: int = 0):
    """(device spec, CPU profile or None, threads per process or 0) of a run's prediction
    (`ranks_per_host` to a host; 0: all on one)."""
    from myria.device import cpu_device_spec, planning_device

    device = cfg.training.device
    if device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device != "cpu":
        dtype = cfg.training.dtype if cfg.training.dtype != "auto" else "bfloat16"
        return planning_device(dtype), None, 0
    from myria.sim.measure import cpu as mcpu
    from myria.sim.perf import config_run, run_shape

    run, spec, threads = config_run(cfg, world, cpu_device_spec(),   # at its threads/process
                                    ranks_per_host)
    gpn = run.cluster.gpus_per_node
    shape = run_shape(run)
    have = mcpu.load_profile(threads, gpn, shape)
    if have is None or mcpu.missing_ops(shape, have, run.parallel.pp):
        from myria.device import cache_dir

        mcpu.check_measurable(shape, gpn)   # more processes than cores: one line, no measuring

        print(f"predicting the step: measuring this CPU's figures for this model as {gpn} "
              f"process(es) x {threads} thread(s) (once; cached in {cache_dir()})", flush=True)
    return spec, mcpu.measured_profile(cfg, world, spec, gpus_per_node=ranks_per_host), threads


def measured_step(table: dict, metrics: list[dict]) -> dict:
    """The measured median step (the events' steps after the first; metrics.jsonl's after the
    first three when there are no events) and the MFU of a step that long (a row's MFU times
    its step time is the step's FLOPs over the devices' peak: the same for every step of one
    layout and batch, the last row's after an in-job shrink or a changed batch), so the two
    figures describe one step."""
    steps = [row["step_s"] for rows in table.values() for _, row in sorted(rows.items())[1:]]
    src = "events"
    if not steps:
        steps = [m["step_time_s"] for m in metrics[3:] if m.get("step_time_s")]
        src = rundir.METRICS
    last = next((m for m in reversed(metrics) if isinstance(m.get("mfu"), (int, float))
                 and isinstance(m.get("step_time_s"), (int, float))), None)
    step = statistics.median(steps) if steps else None
    return {"measured_step_s": step, "measured_from": src,
            "measured_mfu": last["mfu"] * last["step_time_s"] / step if last and step
            else None}


def prediction_line(pred: dict) -> str:
    """One line: predicted beside measured step (and MFU), and the prediction's error."""
    if "error" in pred:
        return f"no prediction: {pred['error']}"
    who = f"{pred['processes']} x {pred['device']}" + \
        (f" ({pred['threads']} thread(s) each)" if pred.get("threads") else "")
    line = (f"predicted step {pred['iteration_time_s'] * 1e3:.0f} ms on {who}, MFU "
            f"{pred['mfu']:.1%}")
    if pred.get("measured_step_s"):
        err = pred["iteration_time_s"] / pred["measured_step_s"] - 1
        line += (f"; measured median step {pred['measured_step_s'] * 1e3:.0f} ms" +
                 (f", MFU {pred['measured_mfu']:.1%}" if pred.get("measured_mfu") is not None
                  else "") + f": prediction {err:+.0%}")
    if pred.get("caveat"):
        line += f" [{pred['caveat']}]"
    return line


# -- the page --------------------------------------------------------------------------------


# -- recovery and goodput -------------------------------------------------------------------
LEDGER_COLORS = {"productive": "#2ca02c", "startup": "#9467bd", "data_wait": "#7f7f7f",
                 "checkpoint": "#bcbd22", "eval": "#17becf", "straggler": "#ff7f0e",
                 "slow": "#ffbb78",
                 "detection": "#d62728", "recovery": "#e377c2", "lost": "#8c564b",
                 "redone": "#1f77b4", "shutdown": "#c5b0d5", "other": "#000000"}


def job_summaries(run_dir: Path) -> list[dict]:
    """The summaries of the supervised jobs that ran on the run directory, in the order they
    started: each job's kept one (`rundir.job_summary_file`) and the newest job's
    (RUN_DIR/supervisor_summary.json), one per job."""
    from myria import rundir

    paths = sorted((run_dir / rundir.SUPERVISOR_JOBS).glob("*.json")) + [
        run_dir / rundir.SUPERVISOR_SUMMARY]
    by_job: dict[str, dict] = {}
    for p in paths:
        try:
            s = json.loads(p.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(s, dict):
            by_job.setdefault(str(s.get("job", p)), s)
    return sorted(by_job.values(), key=lambda s: float(s.get("started_at") or 0.0))


def goodput_ledger(run_dir: Path, summaries: list[dict] | None = None,
                   stragglers: list[dict] | None = None) -> tuple[dict | None, list[dict]]:
    """The run's goodput ledger (its supervised jobs', back to back: `goodput.combine`; or else
    one made from metrics.jsonl's rows, with the cost of the `stragglers` the report found moved
    out of productive time, as a supervisor does with those it found) and the supervisors'
    faults, each with its job's number (1, 2, ... in the order the jobs started) when there were
    several (empty without a supervisor). `summaries`: `job_summaries(run_dir)` when the caller
    has read them."""
    from myria.observe import goodput

    if summaries is None:
        summaries = job_summaries(run_dir)
    jobs = [s for s in summaries if s.get("goodput")]
    if jobs:
        faults = [dict(f, job=i) if len(jobs) > 1 else f
                  for i, s in enumerate(jobs, 1) for f in s.get("faults", [])]
        return goodput.combine([s["goodput"] for s in jobs]), faults
    rows = goodput.ledger_rows(run_dir, 0.0)
    if not rows:
        return None, []
    # each start of the run by hand on its own, back to back: the time between two starts was
    # no process's (as between two supervised jobs)
    led = goodput.combine([goodput.summarize(run_dir, a, b, [], stragglers)
                           for a, b in goodput.process_spans(rows)])
    return dict(led, what="starts of `myria train`"), []


def goodput_bins(timeline: list[dict], bins: int = 40) -> tuple[list[float], float,
                                                                dict[str, list[float]]]:
    """The ledger's timeline as `bins` equal slices of wall time: (slice starts, width,
    seconds of each category per slice); each segment is spread over the slices it overlaps."""
    from myria.observe.goodput import CATEGORIES

    end = max((seg["t"] + seg["dt"] for seg in timeline), default=0.0)
    width = end / bins if end > 0 else 1.0
    out = {c: [0.0] * bins for c in CATEGORIES}
    for seg in timeline:
        t0, t1 = seg["t"], seg["t"] + seg["dt"]
        if t1 <= t0:
            continue
        for i in range(int(t0 // width), min(bins, int(t1 // width) + 1)):
            lo, hi = max(t0, i * width), min(t1, (i + 1) * width)
            if hi > lo:
                for c, v in seg["s"].items():
                    out.setdefault(c, [0.0] * bins)[i] += v * (hi - lo) / (t1 - t0)
    return [i * width for i in range(bins)], width, out


def profile_files(run_dir: Path) -> list[Path]:
    """The files of the run's [profiling] window (RUN_DIR/profile, myria.train.profiling)."""
    d = run_dir / "profile"
    return sorted(f for f in d.iterdir() if f.is_file()) if d.is_dir() else []


def profile_section(run_dir: Path) -> str:
    """HTML: links to the profiler's traces, operator tables and memory snapshots; '' without."""
    files = profile_files(run_dir)
    if not files:
        return ""
    items = "".join(f"<li><a href='../profile/{f.name}'>{f.name}</a></li>" for f in files)
    return ("<h2>Profile</h2><p>torch.profiler over the [profiling] steps, per rank: traces "
            "open in <a href='https://ui.perfetto.dev'>Perfetto</a> or chrome://tracing, memory "
            "snapshots in <a href='https://pytorch.org/memory_viz'>memory_viz</a>.</p>"
            f"<ul>{items}</ul>")


def recovery_section(run_dir: Path, out: Path, stragglers: list[dict] | None = None) -> str:
    """HTML: the goodput ledger (table, ETTR, a stacked bar of wall time over time) and each
    fault's recovery by phase; '' for a run without a ledger. `stragglers`: those the report
    found (`goodput_ledger`)."""
    from myria.observe.goodput import RECOVERY_PHASES

    summaries = job_summaries(run_dir)
    ledger, faults = goodput_ledger(run_dir, summaries, stragglers)
    if ledger is None:
        (out / "goodput.json").unlink(missing_ok=True)
        return ""
    esc = html.escape
    wall = ledger["wall_s"] or 1.0
    from myria.observe.goodput import MEANING

    rows = "".join(f"<tr><td>{esc(k)}</td><td>{v:.1f}</td><td>{100 * v / wall:.1f}%</td>"
                   f"<td>{esc(MEANING.get(k, ''))}</td></tr>"
                   for k, v in ledger["seconds"].items() if v > 0)
    (out / "goodput.json").write_text(json.dumps({"ledger": ledger, "faults": faults},
                                                 indent=1))
    img = ""
    if ledger.get("timeline"):
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        starts, width, cats = goodput_bins(ledger["timeline"])
        fig, ax = plt.subplots(figsize=(10, 3.2))
        bottom = [0.0] * len(starts)
        for c, vals in cats.items():
            if not any(vals):
                continue
            vals = [100.0 * v / width for v in vals]   # percent of each slice's wall time
            ax.bar(starts, vals, width=width, bottom=bottom, align="edge", label=c,
                   color=LEDGER_COLORS.get(c))
            bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
        for t in ledger.get("job_starts", [])[1:]:   # where the next supervised job began
            ax.axvline(t, color="black", linestyle="--", linewidth=1)
        ax.set_xlabel("wall time since start, s" if ledger.get("jobs", 1) == 1 else
                      f"wall time of the {ledger['jobs']} jobs back to back (dashed: the next "
                      "job starts), s")
        ax.set_ylabel(f"% of each {width:.2g} s slice")
        ax.set_title(f"Goodput ledger: ETTR {ledger['ettr']:.3f}")
        ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
        img = f"<img id=goodput alt='goodput ledger' src='data:image/png;base64," \
              f"{png(fig, out / 'goodput.png')}'>"
    frows = ""
    hosts = any("host" in f for f in faults)   # a multi-host job: the host that found each
    for f in faults:
        ph = f.get("recovery_phases") or {}
        cells = "".join(f"<td>{ph[k]:.2f}</td>" if k in ph else "<td>-</td>"
                        for k in RECOVERY_PHASES)
        kind = str(f.get("kind"))
        if f.get("hosts_lost"):   # found on a survivor: the host the fault cost the job
            kind += f" (host {', '.join(f['hosts_lost'])} lost)"
        if v := f.get("sdc"):   # the workers' silent-corruption verdict (myria.train.sdc)
            kind += f" ({v.get('check')} check at step {v.get('step')}: {v.get('verdict')}" + (
                "; host blocklisted" if any(str(a).startswith("blocklist ")
                                            for a in f.get("action", [])) else "") + ")"
        frows += ("<tr>" + (f"<td>{f['job']}</td>" if "job" in f else "") +
                  f"<td>{esc(kind)}</td>" +
                  (f"<td>{esc(str(f.get('host', '-')))}</td>" if hosts else "") +
                  f"<td>{esc(', '.join(map(str, f.get('ranks') or [])) or '-')}</td>"
                  f"<td>{f.get('last_step', '-')}</td>"
                  f"<td>{esc(str(f.get('recovery') or '-'))}</td>{cells}"
                  f"<td>{_seconds(f.get('time_lost_s'))}</td></tr>")
    ftable = ""
    if faults:
        head = "".join(f"<th>{esc(k.replace('_', ' '))}</th>" for k in RECOVERY_PHASES)
        ftable = ("<h2>Recoveries by phase, s</h2><div class=scroll><table id=recoveries><tr>" +
                  ("<th>job</th>" if "job" in faults[0] else "") + "<th>fault</th>" +
                  ("<th>found on</th>" if hosts else "") +
                  f"<th>ranks (first: the fault's)</th><th>step</th><th>path</th>{head}"
                  "<th>total lost</th></tr>"
                  f"{frows}</table></div>")
    # in-job shrinks and grows (resilience.shrink): the jobs' size over time
    resizes = [z for s in summaries for z in s.get("resizes", [])]
    if resizes:
        t0 = resizes[0]["at"]
        ftable += ("<h2>Resizes (in-job shrink and grow)</h2><table id=resizes><tr><th>at, s"
                   "</th><th>kind</th><th>ranks</th><th>resumed from</th><th>to first step, "
                   "s</th></tr>" + "".join(
                       f"<tr><td>{z['at'] - t0:.1f}</td><td>{esc(z['kind'])}</td>"
                       f"<td>{esc(str(z['ranks']))}</td><td>{z.get('resumed_from', '-')}</td>"
                       f"<td>{z.get('to_first_step_s', '-')}</td></tr>" for z in resizes)
                   + "</table>")
    jobs = ledger.get("jobs", 1)
    what = ledger.get("what", "supervised jobs")   # or starts of `myria train` by hand
    over = (f" of {jobs} {esc(what)} (their own: the time between two of them is not "
            "counted)" if jobs > 1 else "")
    return (f"<h2>Goodput ledger</h2><p id=ettr>ETTR {ledger['ettr']:.4f}: {ledger['wall_s']:.1f}"
            f" s of wall time{over}, {ledger['accounted_s']:.1f} s accounted.</p>"
            "<table id=ledger><tr><th>category</th><th>s</th><th>of wall</th>"
            f"<th>what it is</th></tr>{rows}"
            f"</table>{img}{ftable}")
