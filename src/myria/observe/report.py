"""`myria report RUN_DIR`: one timeline of every rank, who waited on whom, and a page to read.

Writes RUN_DIR/report/:

    trace.json    Chrome trace events (Perfetto and chrome://tracing open it): a process per
                  host, a track per rank named by its (dp, pp, cp, tp, ep) coordinate, every
                  event of the timer, flow arrows from each pipeline send to its receive
    blame.json    {"ranks": [{rank, coord, compute_s, blamed_s, last_arrival_s,
                  waited_s}], "most_blamed_rank", "steps", ...}: see myria.observe.analyze
    index.html    a self-contained page (images inlined): heat map of rank x step compute time,
                  the step-time breakdown beside the performance model's prediction, loss,
                  learning-rate, tokens/s and MFU curves, the blame table, what is missing
    prediction.json  the performance model's step for the same config and processes, beside
                  the measured one
    val_loss.json the validation losses of metrics.jsonl by eval step, per source for a data
                  mixture (`data.sources`), with each source's weight: {"steps", "val_loss",
                  "by_source": {name: [...]}, "weights": {name: w}} (absent: no eval ran)
    mixture.json  a data mixture's training figures per source: samples, tokens, epochs, the
                  share against the weight, training loss (absent: one data directory)
    *.png         the same figures as files

The prediction on a CPU is made from this CPU's measured figures at the run's threads per
process (`myria.sim.measure.cpu`: the GEMM/SDPA rates of the model's own shapes, eager elementwise
bandwidths, gloo among the run's processes), measured on first use and cached, as `myria train
--dry-run` does; never from the matmul peak alone, which prices an eager step 2-3x too fast.

A directory that is not a run, or a run with missing or truncated event files, gets a report
of what there is and a list of what is missing (one line for a run without events); never a
traceback.
"""

from __future__ import annotations

import argparse
import base64
import html
import json
import statistics
from pathlib import Path

from myria import rundir
from myria.errors import DataError, MyriaError
from myria.observe.analyze import Run, blame_report, compute_matrix, load_run, step_table

BACKGROUND_TID = 100000  # + rank: the track of a rank's helper threads
CATEGORY_COLORS = {"compute": "thread_state_running", "comm": "terrible", "wait": "bad",
                   "p2p": "yellow", "data": "grey", "ckpt": "olive", "step": "generic_work"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", metavar="RUN_DIR", help="a run directory written by myria train")
    p.add_argument("--no-prediction", action="store_true",
                   help="skip the performance model's predicted breakdown")


def run(args) -> int:
    out = write_report(Path(args.run_dir), predict=not args.no_prediction)
    b = json.loads((out / "blame.json").read_text())
    if not b["ranks"]:
        print(f"report of {args.run_dir}: {'; '.join(b['problems'])}: loss and learning-rate "
              "curves and the prediction only")
    else:
        print(f"report of {args.run_dir}: {b['steps']} step(s), {len(b['ranks'])} rank(s); "
              f"most blamed rank {b['most_blamed_rank']}" +
              (f" (stands out: ranks {b['standout_ranks']})" if b["standout_ranks"] else
               " (no rank stands out of the noise)"))
        hosts: dict[str, list[int]] = {}
        for r in b["ranks"]:
            hosts.setdefault(str(r.get("host", "?")), []).append(r["rank"])
        if len(hosts) > 1:
            print("  hosts: " + "; ".join(f"{h} ranks {rs}" for h, rs in sorted(hosts.items())))
        for p in b["problems"]:
            print(f"  missing: {p}")
        for x in b.get("slow_links", []):
            print(f"  {slow_link_line(x)}")
    if (hang := hang_report(out)) is not None:
        from myria.observe.hang import summary_line

        print(f"  the run hung: {summary_line(hang)}")
    if (mix_path := out / MIX_FILE).exists():
        print(f"  {mixture_line(json.loads(mix_path.read_text()))}")
    val_path = out / VAL_FILE
    if val_path.exists():
        print(f"  {validation_line(json.loads(val_path.read_text()))}")
    pred_path = out / "prediction.json"
    if pred_path.exists():
        print(f"  {prediction_line(json.loads(pred_path.read_text()))}")
    print(f"  open {out / 'index.html'} (timeline: load {out / 'trace.json'} in "
          "https://ui.perfetto.dev or chrome://tracing)")
    for f in profile_files(Path(args.run_dir)):
        print(f"  profile: {f}")
    from myria.observe import tracking

    if sent := tracking.log_report(Path(args.run_dir), sorted(out.glob("*.png"))):
        print(f"  figures sent to the run's {' and '.join(sent)} run")
    return 0


def write_report(run_dir: Path, predict: bool = True) -> Path:
    if not run_dir.is_dir():
        raise DataError(f"{run_dir} is not a directory")
    run = load_run(run_dir)
    if not run.ranks and not (run_dir / rundir.METRICS).exists():
        raise DataError(f"{run_dir} is not a myria run directory (no {rundir.EVENTS_DIR}/ "
                        f"and no {rundir.METRICS}); pass the --run-dir of `myria train`")
    out = rundir.report_dir(run_dir)
    out.mkdir(parents=True, exist_ok=True)
    table = step_table(run)
    blame = blame_report(run, table)
    from myria.observe.straggler import default_window, detect

    found = detect(run, window=default_window(blame["steps"] + 1), table=table)
    blame["stragglers"] = [dict(s.evidence(), rank=s.rank, host=s.host,
                                detected_step=s.detected_step) for s in found]
    blame["slow_links"] = slow_links(run_dir, table)
    (out / "blame.json").write_text(json.dumps(blame, indent=1))
    (out / "trace.json").write_text(json.dumps(chrome_trace(run)))
    figs = figures(run, table, blame, out)
    pred = None
    (out / "prediction.json").unlink(missing_ok=True)
    if predict:
        pred = prediction(run_dir, run.world or None)
        if pred is not None:
            pred.update(measured_step(table, _metrics(run_dir)))
            (out / "prediction.json").write_text(json.dumps(pred, indent=1))
    val = write_validation(run_dir, out)
    mix = training_by_source(run_dir)
    (out / MIX_FILE).unlink(missing_ok=True)
    if mix is not None:
        (out / MIX_FILE).write_text(json.dumps(mix, indent=1))
    (out / "index.html").write_text(page(run, table, blame, figs, pred, val,
                                         recovery_section(run_dir, out)
                                         + profile_section(run_dir), mix,
                                         hang_report(out)))
    return out


def slow_links(run_dir: Path, table: dict) -> list[dict]:
    """Communication blamed on a host's link: each slow-link detection of the run (its
    supervisor's link probe, myria.resilience.multihost.LinkProbe) with that host's ranks' time
    in collectives per step before the detection and from it. The compute-time blame cannot
    see a slow link: on a ring every rank waits for it alike."""
    from myria import detections

    def per_step(ranks: list[int], lo: int, hi: int) -> float | None:
        xs = [sum(row["comm_s"].values()) for r in ranks
              for s, row in table.get(r, {}).items() if lo <= s < hi]
        return statistics.median(xs) if xs else None

    out = []
    for d in detections.read(run_dir, "slow-link"):
        ev = d.get("evidence") or {}
        ranks, at = ev.get("ranks") or [], int(d.get("step") or 0)
        out.append({"host": d.get("host", "?"), "ranks": ranks, "detected_step": at,
                    "evidence": ev.get("evidence", ""),
                    "comm_s_per_step_before": per_step(ranks, 0, at),
                    "comm_s_per_step_from": per_step(ranks, at, 1 << 62)})
    return out


def slow_link_line(x: dict) -> str:
    def f(v) -> str:
        return "?" if v is None else f"{v:.3f}"

    return (f"blame: communication on {x['host']} (ranks {x['ranks']}): its link is degraded "
            f"from step {x['detected_step']} ({x['evidence']}); its ranks' collectives took "
            f"{f(x['comm_s_per_step_from'])} s per step from then, "
            f"{f(x['comm_s_per_step_before'])} s before")


# -- the trace -------------------------------------------------------------------------------

def coord_label(hdr: dict) -> str:
    c = hdr.get("coord", {})
    return "(" + ", ".join(f"{k}{c.get(k, 0)}" for k in ("dp", "pp", "cp", "tp", "ep")) + ")"


def chrome_trace(run: Run) -> dict:
    """The Trace Event Format object: pid = host, tid = rank, ts/dur in µs."""
    hosts = sorted({r.header.get("host", "?") for r in run.ranks.values()})
    pid_of = {h: i + 1 for i, h in enumerate(hosts)}
    ev: list[dict] = []
    t_min = min((e["t0"] for r in run.ranks.values() for e in r.events), default=0)
    for h, pid in pid_of.items():
        ev.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0,
                   "args": {"name": f"host {h}"}})
    sends: dict[tuple, tuple] = {}
    for r, re in sorted(run.ranks.items()):
        pid = pid_of[re.header.get("host", "?")]
        ev.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": r,
                   "args": {"name": f"rank {r} {coord_label(re.header)}"}})
        ev.append({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": r,
                   "args": {"sort_index": r}})
        side = set()
        for e in re.events:
            args = dict(e.get("a") or {}, step=e["s"])
            if "m" in e:
                args["microbatch"] = e["m"]
            # the training thread's spans nest; a helper thread's (checkpoint snapshot and
            # persist) overlap them, so they get a track of their own under the rank's
            tid = r
            if e.get("th", 0):
                tid = BACKGROUND_TID + r
                side.add(tid)
            name = e["n"] if "m" not in e else f"{e['n']} mb{e['m']}"
            ev.append({"ph": "X", "name": name, "cat": e["c"], "pid": pid, "tid": tid,
                       "ts": e["t0"] - t_min, "dur": max(0, e["t1"] - e["t0"]), "args": args,
                       "cname": CATEGORY_COLORS.get(e["c"], "generic_work")})
            if e["c"] == "p2p":
                for op in (e.get("a") or {}).get("ops", []):
                    if op["kind"] == "send":
                        sends[(r, op["peer"], op["seq"])] = (pid, r, e["t0"] - t_min)
        for tid in side:
            ev.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid,
                       "args": {"name": f"rank {r} background (checkpoint)"}})
            ev.append({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": tid,
                       "args": {"sort_index": BACKGROUND_TID + r}})
    # flow arrows: send -> the matching receive
    flow_id = 0
    for r, re in sorted(run.ranks.items()):
        pid = pid_of[re.header.get("host", "?")]
        for e in re.events:
            if e["c"] != "p2p":
                continue
            for op in (e.get("a") or {}).get("ops", []):
                src = sends.get((op["peer"], r, op["seq"])) if op["kind"] == "recv" else None
                if src is None:
                    continue
                flow_id += 1
                ev.append({"ph": "s", "id": flow_id, "name": "p2p", "cat": "p2p",
                           "pid": src[0], "tid": src[1], "ts": src[2]})
                ev.append({"ph": "f", "bp": "e", "id": flow_id, "name": "p2p", "cat": "p2p",
                           "pid": pid, "tid": r, "ts": e["t1"] - t_min})
    return {"traceEvents": ev, "displayTimeUnit": "ms",
            "otherData": {"run_dir": str(run.run_dir), "missing_ranks": run.missing,
                          "truncated_ranks": run.truncated}}


# -- figures ---------------------------------------------------------------------------------

def _png(fig, path: Path) -> str:
    fig.savefig(path, dpi=110, bbox_inches="tight")
    import matplotlib.pyplot as plt

    plt.close(fig)
    return base64.b64encode(path.read_bytes()).decode()


def breakdown(table: dict) -> dict[str, float]:
    """Mean seconds per step over ranks and steps (the warm-up step excluded)."""
    parts: dict[str, list[float]] = {}
    for rows in table.values():
        steps = sorted(rows)[1:] if len(rows) > 1 else sorted(rows)
        for s in steps:
            row = rows[s]
            vals = {"compute": row["model_compute_s"], "optimizer": row["optimizer_s"],
                    "other compute": row["compute_s"] - row["model_compute_s"] -
                    row["optimizer_s"], "data wait": row["data_s"],
                    "checkpoint": row["ckpt_s"], "idle / bubble": row["idle_s"]}
            for dim, v in row["comm_s"].items():
                vals[f"exposed comm ({dim})"] = v
            for k, v in vals.items():
                parts.setdefault(k, []).append(v)
    n = max((len(v) for v in parts.values()), default=1)
    return {k: sum(v) / n for k, v in parts.items()}


def figures(run: Run, table: dict, blame: dict, out: Path) -> dict[str, str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    figs = {}
    ranks, steps, rows = compute_matrix(run, table)
    if ranks and steps:
        data = np.array(rows, dtype=float)
        fig, ax = plt.subplots(figsize=(max(6, min(16, len(steps) * 0.35 + 3)),
                                        max(2.5, len(ranks) * 0.45 + 1.5)))
        # the colour scale ignores the warm-up step, which would wash the others out
        steady = data[:, 1:] if data.shape[1] > 1 else data
        finite = steady[np.isfinite(steady)]
        lo, hi = (float(finite.min()) * 1e3, float(finite.max()) * 1e3) if finite.size else \
            (None, None)
        im = ax.imshow(data * 1e3, aspect="auto", cmap="viridis", interpolation="nearest",
                       vmin=lo, vmax=hi)
        ax.set_yticks(range(len(ranks)),
                      [f"rank {r} {coord_label(run.ranks[r].header)}" for r in ranks])
        step_ticks = list(range(0, len(steps), max(1, len(steps) // 12)))
        ax.set_xticks(step_ticks, [str(steps[i]) for i in step_ticks])
        ax.set_xlabel("step")
        ax.set_title("compute-only time per rank and step (ms; waits excluded; colour scale "
                     "from step 2)", fontsize=9)
        fig.colorbar(im, ax=ax, label="ms")
        figs["heatmap"] = _png(fig, out / "heatmap.png")
    bd = breakdown(table)
    if bd:
        fig, ax = plt.subplots(figsize=(7, 3.2))
        names = [k for k, v in sorted(bd.items(), key=lambda kv: -kv[1]) if v > 0]
        ax.barh(names[::-1], [bd[k] * 1e3 for k in names[::-1]], color="#4477aa")
        ax.set_xlabel("ms per step (mean over ranks and steps)")
        ax.set_title("where a step's time goes (measured)")
        figs["breakdown"] = _png(fig, out / "breakdown.png")
    metrics = _metrics(run.run_dir)
    if metrics:
        fig, axes = plt.subplots(1, 4, figsize=(16, 3))
        for ax, key, label in zip(axes, CURVES, ("loss", "learning rate", "tokens/s", "MFU")):
            pts = [(m["step"], m[key]) for m in metrics if m.get(key) is not None]
            if pts:
                ax.plot(*zip(*pts), color="#aa3377")
            ax.set_xlabel("step")
            ax.set_title(label)
            ax.ticklabel_format(axis="y", style="sci", scilimits=(-3, 4))
        figs["curves"] = _png(fig, out / "curves.png")
    return figs


CURVES = ("loss", "lr", "tokens_per_s", "mfu")   # metrics.jsonl keys, in the curves' order


def _metrics(run_dir: Path) -> list[dict]:
    return [r for r in rundir.read_jsonl(run_dir / rundir.METRICS) if "loss" in r]


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
        ax.plot(*zip(*pts), marker=".", label=n + (f" (weight {w:g})" if w else ""))
    ax.plot(val["steps"], val["val_loss"], color="black", linestyle="--", marker=".",
            label="mixture (share-weighted)" if val["by_source"] else "validation")
    ax.set_xlabel("step")
    ax.set_ylabel("validation loss")
    ax.set_title("validation loss" + (" per source" if val["by_source"] else ""))
    ax.legend(fontsize=8)
    return {**val, "png": _png(fig, out / "val_loss.png")}


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
    """The supervisor's merged hang report (report/hang.json), None when the run never hung."""
    try:
        rep = json.loads((out / "hang.json").read_text())
    except (OSError, ValueError):
        return None
    return rep if isinstance(rep, dict) and "stuck" in rep else None


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
    return (f"<h2 id=hang>The run hung</h2><p><b>{esc(summary_line(rep))}</b> (the "
            "supervisor's hang report, <code>hang.json</code>). The blame below covers the "
            f"steps every rank completed, before the hang.</p>{blocks}")


# -- training figures per source of a data mixture -------------------------------------------

MIX_FILE = "mixture.json"


def training_by_source(run_dir: Path) -> dict | None:
    """A data mixture's training figures from metrics.jsonl: per source, the samples, tokens
    and epochs read up to the last logged step, the share of samples against the weight (the
    deviation in samples, under one by the mixture's order) and the training loss at the first
    and last step that measured it. None for a run on one directory."""
    rows = [r for r in _metrics(run_dir) if isinstance(r.get("samples_by_source"), dict)]
    if not rows:
        return None
    last = rows[-1]
    total = sum(last["samples_by_source"].values())
    weights = validation_weights(run_dir)
    wsum = sum(weights.values()) or 1.0
    lossed = [r for r in rows if isinstance(r.get("loss_by_source"), dict)]
    out = {"step": last["step"], "samples": total, "sources": {}}
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
            "off_by_samples": None if w is None else round(c - total * w / wsum, 4),
            "first_loss": first_loss, "last_loss": last_loss}
    return out


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
        w = "" if x["weight"] is None else f" (weight {x['weight']:g})"
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
        f"<td>{f(x['off_by_samples'], '+.2f')}</td><td>{f(x['epochs'], '.3f')}</td>"
        f"<td>{f(x['first_loss'])}</td><td>{f(x['last_loss'])}</td></tr>"
        for n, x in mix["sources"].items())
    return f"""<h2>Training per source</h2><p>{esc(mixture_line(mix))}.</p>
<table id="train-by-source"><tr><th>source</th><th>weight</th><th>samples</th><th>tokens</th>
<th>share</th><th>samples off the weight</th><th>epochs</th><th>first loss</th>
<th>last loss</th></tr>{body}</table>"""


# -- the model's prediction ------------------------------------------------------------------

def prediction(run_dir: Path, world: int | None = None) -> dict | None:
    """The performance model's step for the run's config on its `world` processes (default:
    its event files), in the meter's MFU convention; None with no config.json. On a CPU it is
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
        spec, prof, threads = _prediction_device(cfg, world)
        res = simulate_config(cfg, world, spec, cpu_profile=prof)
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
    """Why a CPU profile is not a quiet host's, or "": compute timed on the wall clock (several
    threads per process) while other work held the cores (load average above this process's
    own threads: the measuring processes' own)."""
    import os

    own = prof.threads * max(1, prof.nproc)
    if prof.clock == "thread CPU time" or prof.loadavg <= own + 0.5:
        return ""
    from myria.sim.cpu_profile import profile_path

    return (f"this CPU's figures were timed on the wall clock ({prof.threads} threads per "
            f"process) at load average {prof.loadavg:.1f} on {os.cpu_count()} cores: other "
            "jobs held the cores, so the predicted step is too long; remove "
            f"{profile_path()} and run `myria report` again on a quiet host")


def run_world(run_dir: Path) -> int:
    """How many processes a run had, from the per-rank files it leaves besides its events (the
    data loader's statistics, the checkpoint manager's): 1 when there are none."""
    counts = [sum(1 for _ in (run_dir / d).glob(pattern)) for d, pattern in
              ((rundir.EVENTS_DIR, "rank*.jsonl"), (rundir.DATA_STATS, "data_rank*.json"),
               (rundir.CHECKPOINT_STATS, "rank*.json"))]
    return max(1, *counts)


def _prediction_device(cfg, world: int):
    """(device spec, CPU profile or None, threads per process or 0) of a run's prediction."""
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

    run, spec, threads = config_run(cfg, world, cpu_device_spec())   # at its threads/process
    gpn = run.cluster.gpus_per_node
    shape = run_shape(run)
    have = mcpu.load_profile(threads, gpn, shape)
    if have is None or mcpu.missing_ops(shape, have, run.parallel.pp):
        from myria.device import cache_dir

        mcpu.check_measurable(shape, gpn)   # more processes than cores: one line, no measuring

        print(f"predicting the step: measuring this CPU's figures for this model as {gpn} "
              f"process(es) x {threads} thread(s) (once; cached in {cache_dir()})", flush=True)
    return spec, mcpu.measured_profile(cfg, world, spec), threads


def measured_step(table: dict, metrics: list[dict]) -> dict:
    """The measured median step (the events' steps after the first; metrics.jsonl's after the
    first three when there are no events) and median MFU of the meter."""
    steps = [row["step_s"] for rows in table.values() for _, row in sorted(rows.items())[1:]]
    src = "events"
    if not steps:
        steps = [m["step_time_s"] for m in metrics[3:] if m.get("step_time_s")]
        src = rundir.METRICS
    mfus = [m["mfu"] for m in metrics[3:] if m.get("mfu") is not None]
    return {"measured_step_s": statistics.median(steps) if steps else None,
            "measured_from": src, "measured_mfu": statistics.median(mfus) if mfus else None}


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

def page(run: Run, table: dict, blame: dict, figs: dict[str, str], pred: dict | None,
         val: dict | None = None, recovery: str = "", mix: dict | None = None,
         hang: dict | None = None) -> str:
    """The report's HTML; `recovery` is `recovery_section`'s (goodput and recoveries), `hang`
    the supervisor's hang report. A rank is marked red only where the evidence names it: it
    stands out of the noise, or the hang report finds it stuck."""
    esc = html.escape
    red = set(blame["standout_ranks"]) | {int(r) for r in (hang or {}).get("stuck_ranks", [])}
    rows = "".join(
        f"<tr{' class=hot' if r['rank'] in red else ''}>"
        f"<td>{r['rank']}</td><td>{esc(coord_label({'coord': r['coord']}))}</td>"
        f"<td>{esc(r['host'])}</td><td>{r['compute_s']:.3f}</td><td>{r['blamed_s']:.3f}</td>"
        f"<td>{r.get('last_arrival_s', 0.0):.3f}</td>"
        f"<td>{r['waited_s']:.3f}</td></tr>" for r in blame["ranks"])
    img = "".join(f"<h2>{esc(t)}</h2><img id='{k}' alt='{esc(t)}' "
                  f"src='data:image/png;base64,{figs[k]}'>"
                  for k, t in (("heatmap", "Compute time per rank and step"),
                               ("breakdown", "Step-time breakdown"),
                               ("curves", "Loss, learning rate, tokens/s and MFU"))
                  if k in figs)
    bd = breakdown(table)
    pred_html = "<p>no prediction (no config.json in the run directory)</p>"
    if pred and "error" in pred:
        pred_html = f"<p>no prediction: {esc(pred['error'])}</p>"
    elif pred:
        prow = "".join(f"<tr><td>{esc(k)}</td><td>{v * 1e3:.1f}</td></tr>"
                       for k, v in sorted(pred["breakdown"].items(), key=lambda kv: -kv[1])
                       if v > 0)
        mrow = "".join(f"<tr><td>{esc(k)}</td><td>{v * 1e3:.1f}</td></tr>"
                       for k, v in sorted(bd.items(), key=lambda kv: -kv[1]) if v > 0)
        basis = f"peak {pred['peak']}" + (f"; figures {pred['figures']}"
                                          if pred.get("figures") else "")
        pred_html = (f"<p id=prediction>{esc(prediction_line(pred))} (MFU in the meter's "
                     f"convention; measured from {esc(pred.get('measured_from') or '-')}).</p>"
                     f"<p><small>{esc(basis)}. On a shared host the measured step includes "
                     "the time other jobs held the cores; the prediction is for a quiet host."
                     "</small></p><div class=row>"
                     f"<table><tr><th>predicted</th><th>ms</th></tr>{prow}</table>"
                     f"<table><tr><th>measured</th><th>ms</th></tr>{mrow}</table></div>")
    problems = "".join(f"<li>{esc(p)}</li>" for p in blame["problems"]) or "<li>none</li>"
    strag = "".join(
        f"<li>rank {s['rank']} ({esc(s['host'])}): {s['slowdown']:.0%} slower than its peers "
        f"from step {s['first_step']}, costing {s['cost_s_per_step'] * 1e3:.0f} ms per step"
        "</li>" for s in blame.get("stragglers", [])) or "<li>none</li>"
    standout = (f"rank(s) {blame['standout_ranks']} stand out" if blame["standout_ranks"]
                else "no rank stands out of the noise")
    whatif = blame["whatif_saving_s"]
    most = (f"<b>{blame['most_blamed_rank']}</b>" if blame["standout_ranks"] else
            str(blame["most_blamed_rank"]))
    summary = f"""<p>{len(run.ranks)} rank(s) of {run.world}, {blame['steps']} step(s) analysed
(first step excluded as warm-up). Most blamed rank: {most}; {standout}
(noise {blame['noise_s']:.3f} s). If it ran at its peers' median speed the steps would have
taken {whatif:.3f} s less in total.</p>
<h2>Blame: who waited on whom</h2>
<table id="blame"><tr><th>rank</th><th>(dp, pp, cp, tp, ep)</th><th>host</th>
<th>compute s</th><th>waiting it caused, s</th><th>others waited where it came last, s</th>
<th>it waited, s</th></tr>{rows}</table>"""
    strag_html = f"""<h2>Stragglers (compute-only time against peers of the same stage)</h2>
<ul id="stragglers">{strag}</ul>"""
    if links := blame.get("slow_links"):
        strag_html += ("<h2>Slow links (each host's link probe)</h2><ul id=slow-links>" +
                       "".join(f"<li><b>{esc(slow_link_line(x))}</b></li>" for x in links)
                       + "</ul>")
    if not run.ranks:   # no events: one line instead of empty tables
        summary = f"<p id=no-events><b>{esc('; '.join(blame['problems']))}</b>.</p>"
        strag_html = ""
    return f"""<!doctype html><html><head><meta charset="utf-8"><title>myria report</title>
<style>body{{font-family:sans-serif;margin:2em;max-width:1200px}}table{{border-collapse:collapse;
margin:1em 1em 1em 0}}td,th{{border:1px solid #ccc;padding:3px 8px;text-align:right}}
tr.hot{{background:#fdd}}pre.stack{{background:#f6f6f6;padding:.5em}}img{{max-width:100%}}.row{{display:flex;gap:2em}}</style></head><body>
<h1>myria report: {esc(str(run.run_dir))}</h1>
{hang_html(hang)}
{summary}
{img}
{mixture_html(mix)}
{validation_html(val)}
{strag_html}
<h2>Predicted beside measured</h2>{pred_html}
<h2>Missing</h2><ul>{problems}</ul>
<p>Timeline: <code>trace.json</code> (Perfetto, chrome://tracing).</p>{recovery}</body></html>"""


# -- recovery and goodput (issue 26) ---------------------------------------------------------
LEDGER_COLORS = {"productive": "#2ca02c", "startup": "#9467bd", "data_wait": "#7f7f7f",
                 "checkpoint": "#bcbd22", "eval": "#17becf", "straggler": "#ff7f0e",
                 "detection": "#d62728", "recovery": "#e377c2", "lost": "#8c564b",
                 "redone": "#f7b6d2", "shutdown": "#c5b0d5", "other": "#000000"}


def goodput_ledger(run_dir: Path) -> tuple[dict | None, list[dict]]:
    """The run's goodput ledger (the supervisor's, or else one made from metrics.jsonl's rows)
    and the supervisor's faults (empty without a supervisor)."""
    from myria.observe import goodput

    path = run_dir / "supervisor_summary.json"
    if path.exists():
        try:
            s = json.loads(path.read_text())
        except ValueError:
            s = {}
        if s.get("goodput"):
            return s["goodput"], s.get("faults", [])
    rows = goodput.ledger_rows(run_dir, 0.0)
    if not rows:
        return None, []
    return goodput.summarize(run_dir, min(r["goodput_since"] for r in rows),
                             max(r["time"] for r in rows), []), []


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


def recovery_section(run_dir: Path, out: Path) -> str:
    """HTML: the goodput ledger (table, ETTR, a stacked bar of wall time over time) and each
    fault's recovery by phase; '' for a run without a ledger."""
    from myria.observe.goodput import RECOVERY_PHASES

    ledger, faults = goodput_ledger(run_dir)
    if ledger is None:
        return ""
    esc = html.escape
    wall = ledger["wall_s"] or 1.0
    rows = "".join(f"<tr><td>{esc(k)}</td><td>{v:.1f}</td><td>{100 * v / wall:.1f}%</td></tr>"
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
            ax.bar(starts, vals, width=width, bottom=bottom, align="edge", label=c,
                   color=LEDGER_COLORS.get(c))
            bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
        ax.set_xlabel("wall time since start, s")
        ax.set_ylabel("seconds per slice")
        ax.set_title(f"Goodput ledger: ETTR {ledger['ettr']:.3f}")
        ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
        img = f"<img id=goodput alt='goodput ledger' src='data:image/png;base64," \
              f"{_png(fig, out / 'goodput.png')}'>"
    frows = ""
    for f in faults:
        ph = f.get("recovery_phases") or {}
        cells = "".join(f"<td>{ph[k]:.2f}</td>" if k in ph else "<td>-</td>"
                        for k in RECOVERY_PHASES)
        kind = str(f.get("kind"))
        if v := f.get("sdc"):   # the workers' silent-corruption verdict (myria.train.sdc)
            kind += f" ({v.get('check')} check at step {v.get('step')}: {v.get('verdict')}" + (
                "; host blocklisted" if any(str(a).startswith("blocklist ")
                                            for a in f.get("action", [])) else "") + ")"
        frows += (f"<tr><td>{esc(kind)}</td><td>{esc(str(f.get('ranks')))}</td>"
                  f"<td>{f.get('last_step')}</td><td>{esc(str(f.get('recovery') or '-'))}</td>"
                  f"{cells}<td>{f.get('time_lost_s')}</td></tr>")
    ftable = ""
    if faults:
        head = "".join(f"<th>{esc(k)}</th>" for k in RECOVERY_PHASES)
        ftable = (f"<h2>Recoveries by phase, s</h2><table id=recoveries><tr><th>fault</th>"
                  f"<th>ranks</th><th>step</th><th>path</th>{head}<th>total lost</th></tr>"
                  f"{frows}</table>")
    try:   # in-job shrinks and grows (resilience.shrink): the job's size over time
        resizes = json.loads((run_dir / "supervisor_summary.json").read_text()).get(
            "resizes", [])
    except (OSError, ValueError):
        resizes = []
    if resizes:
        t0 = resizes[0]["at"]
        ftable += ("<h2>Resizes (in-job shrink and grow)</h2><table id=resizes><tr><th>at, s"
                   "</th><th>kind</th><th>ranks</th><th>resumed from</th><th>to first step, "
                   "s</th></tr>" + "".join(
                       f"<tr><td>{z['at'] - t0:.1f}</td><td>{esc(z['kind'])}</td>"
                       f"<td>{esc(str(z['ranks']))}</td><td>{z.get('resumed_from', '-')}</td>"
                       f"<td>{z.get('to_first_step_s', '-')}</td></tr>" for z in resizes)
                   + "</table>")
    return (f"<h2>Goodput ledger</h2><p id=ettr>ETTR {ledger['ettr']:.4f}: {ledger['wall_s']:.1f}"
            f" s of wall time, {ledger['accounted_s']:.1f} s accounted.</p>"
            f"<table id=ledger><tr><th>category</th><th>s</th><th>of wall</th></tr>{rows}"
            f"</table>{img}{ftable}")
