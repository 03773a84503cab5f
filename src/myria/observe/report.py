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
import html
import json
import math
import statistics
from pathlib import Path

from myria import rundir
from myria.errors import DataError
from myria.observe.analyze import Run, blame_report, compute_matrix, load_run, step_table
from myria.observe.report_sections import (
    MIX_FILE,
    VAL_FILE,
    fault_steps,
    hang_html,
    hang_report,
    hang_title,
    measured_step,
    metrics_rows,
    mixture_html,
    mixture_line,
    phase_starts,
    png,
    prediction,
    prediction_line,
    profile_files,
    profile_section,
    recovery_section,
    training_by_source,
    validation_html,
    validation_line,
    write_validation,
)

BACKGROUND_TID = 100000  # + rank: the track of a rank's helper threads
CATEGORY_COLORS = {"compute": "thread_state_running", "comm": "terrible", "wait": "bad",
                   "p2p": "yellow", "data": "grey", "ckpt": "olive", "step": "generic_work"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", metavar="RUN_DIR", help="a run directory written by myria train")
    p.add_argument("--no-prediction", action="store_true",
                   help="skip the performance model's predicted breakdown")


def detections_line(run_dir: Path) -> str:
    """The run's detections (RUN_DIR/events.jsonl) by kind, each with its steps and what was
    done: "detected: non-finite loss or gradient at step 8 (skip); straggler at step 5
    (warn)"; "" for none."""
    from myria import detections

    by: dict[tuple, list] = {}
    for d in detections.read(run_dir):
        by.setdefault((d.get("kind"), d.get("action")), []).append(d.get("step"))
    parts = [f"{detections.WORDS.get(kind, kind)} at step{'s' if len(steps) > 1 else ''} "
             f"{', '.join(str(x) for x in sorted(set(steps), key=lambda x: x or 0))}"
             + (f" ({'no action' if action == 'none' else action})" if action else "")
             for (kind, action), steps in by.items()]
    return "detected: " + "; ".join(parts) if parts else ""


def goodput_line(gp: dict) -> str:
    """One line of the report's goodput.json: ETTR, over which wall time, the faults."""
    led, faults = gp["ledger"], gp.get("faults", [])
    jobs = led.get("jobs", 1)
    timed = [float(f["time_lost_s"]) for f in faults if f.get("time_lost_s") is not None]
    untimed = len(faults) - len(timed)
    lost = (f"{sum(timed):.1f} s lost to them" if not untimed else
            "their lost time not measured" if not timed else
            f"{sum(timed):.1f} s lost to {len(timed)} of them (the others' not measured)")
    return (f"goodput: ETTR {led['ettr']:.3f} over {led['wall_s']:.1f} s of wall time" +
            (f" ({jobs} {led.get('what', 'supervised jobs')} back to back)" if jobs > 1
             else "") +
            (f"; {len(faults)} fault(s), {lost}" if faults else ""))


def run_line(run: Run) -> str:
    """The run in one line: its layout (the events' header), steps, loss from first to last,
    and the median tokens/s and MFU of metrics.jsonl; "" without metrics."""
    import statistics

    rows = [r for r in metrics_rows(run.run_dir) if isinstance(r.get("loss"), (int, float))]
    if not rows:
        return ""
    hdr = next((re.header for re in run.ranks.values() if re.header), {})
    lay = hdr.get("layout") or {}
    layout = " ".join(f"{k}{v}" for k, v in lay.items() if k != "dp" and v and v > 1) or \
        "one process" if lay else ""
    med = {k: statistics.median(v) for k in ("tokens_per_s", "mfu")
           if (v := [r[k] for r in rows if isinstance(r.get(k), (int, float))])}
    return (f"run: {run.world} rank(s)" + (f" ({layout}" + (f", {hdr['schedule']}"
                                                            if lay.get("pp", 1) > 1 and
                                                            hdr.get("schedule") else "")
                                          + ")" if layout else "")
            + f", steps {rows[0]['step']}-{rows[-1]['step']}, loss {rows[0]['loss']:.4f} -> "
            f"{rows[-1]['loss']:.4f}"
            + (f", median {med['tokens_per_s']:,.0f} tokens/s" if "tokens_per_s" in med
               else "")
            + (f", MFU {100 * med['mfu']:.1f}%" if "mfu" in med else ""))


def fault_lines(gp: dict) -> list[str]:
    """One line per fault of the report's goodput.json (a lost host's are `lost_host_lines`):
    what, which ranks, after which step, and what followed: "fault: exit of rank(s) [1] after
    step 4; restart from step 4, 9.3 s lost"."""
    out = []
    for f in gp.get("faults", []):
        if f.get("hosts_lost"):
            continue
        resumed, lost = f.get("resumed_from"), f.get("time_lost_s")
        then = (f"{f.get('recovery') or 'recovery'} from step {resumed}" if resumed is not None
                else "not recovered (the job ended)")
        ranks = f.get("ranks") or []
        # an exit lists the culprit first, then the ranks that stopped because of it
        who = (f"rank {ranks[0]} (rank(s) {ranks[1:]} stopped after it)"
               if f.get("kind") == "exit" and len(ranks) > 1 else f"rank(s) {ranks}")
        # last_step: the steps done when it struck (a detection names the step it was in)
        out.append(f"fault: {f.get('kind', '?')} of {who} after step {f.get('last_step', '?')}; "
                   f"{then}" + (f", {float(lost):.1f} s lost" if lost is not None else ""))
    return out


def lost_host_lines(gp: dict) -> list[str]:
    """One line per host a multi-host job went on without (the report's goodput.json): which
    host, at which step, found on which survivor(s) as which fault. A fault names the host
    whose supervisor found it, a survivor; the host lost is in its `hosts_lost`. Survivors
    that each found the same loss (same job, hosts and resume point) make one line."""
    by: dict[tuple, list[dict]] = {}
    for f in gp.get("faults", []):
        if f.get("hosts_lost"):
            by.setdefault((f.get("job"), tuple(f["hosts_lost"]), f.get("resumed_from")),
                          []).append(f)
    out = []
    for (_, hosts, resumed), fs in by.items():
        found = ", ".join(sorted({f"{f.get('host', '?')} ({f.get('kind')})" for f in fs}))
        step = max(int(f.get("last_step") or 0) for f in fs)
        if any(f.get("kind") == rundir.STORE_LOST for f in fs):   # the first node: the job ended
            out.append(f"host {', '.join(hosts)} lost at step {step}, found on {found}: the "
                       "job ended with it (the rendezvous store was there); run again, it "
                       "resumes from the newest committed checkpoint")
            continue
        out.append(f"host {', '.join(hosts)} lost at step {step}, found on {found}: the job "
                   "went on without it" + (f" from step {resumed}" if resumed is not None
                                           else ""))
    return out


def run(args) -> int:
    out = write_report(Path(args.run_dir), predict=not args.no_prediction)
    b = json.loads((out / "blame.json").read_text())
    if not b["ranks"]:
        print(f"report of {args.run_dir}: {'; '.join(b['problems'])}: loss and learning-rate "
              "curves and the prediction only")
    else:
        warm = b.get("warmup_step_excluded")
        print(f"report of {args.run_dir}: {b['steps']} step(s) analysed"
              + (f" (step {warm}, the warm-up, left out)" if warm is not None else "")
              + f", {len(b['ranks'])} rank(s); "
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
    if line := unreadable_line(Path(args.run_dir)):
        print(f"  {line}")
    if line := unfinished_line(Path(args.run_dir)):
        print(f"  {line}")
    if line := detections_line(Path(args.run_dir)):
        print(f"  {line}")
    if (gp_path := out / "goodput.json").exists():
        gp = json.loads(gp_path.read_text())
        print(f"  {goodput_line(gp)}")
        for line in fault_lines(gp) + lost_host_lines(gp):
            print(f"  {line}")
    if (hang := hang_report(out)) is not None:
        from myria.observe.hang import summary_line

        went_on = hang["went_on_to"]
        print(f"  {hang_title(hang)}: {summary_line(hang)}" + (
            f"; restarted, it trained on to step {went_on}" if went_on is not None else ""))
    if (mix_path := out / MIX_FILE).exists():
        print(f"  {mixture_line(json.loads(mix_path.read_text()))}")
    val_path = out / VAL_FILE
    if val_path.exists():
        print(f"  {validation_line(json.loads(val_path.read_text()))}")
    pred_path = out / "prediction.json"
    if pred_path.exists():
        print(f"  {prediction_line(json.loads(pred_path.read_text()))}")
    print(f"  open {out / 'index.html'}" + (f" (timeline: load {out / 'trace.json'} in "
                                             "https://ui.perfetto.dev or chrome://tracing)"
                                             if b["ranks"] else ""))
    for f in profile_files(Path(args.run_dir)):
        print(f"  profile: {f}")
    from myria.observe import tracking

    if sent := tracking.log_report(Path(args.run_dir), sorted(out.glob("*.png"))):
        print(f"  figures sent to the run's {' and '.join(sent)} run")
    return 0


def unreadable_line(run_dir: Path) -> str | None:
    """"note: N unreadable line(s) of metrics.jsonl ..." naming them, when some are (the
    figures leave them out); None when every line reads."""
    bad: list[int] = []
    rundir.read_jsonl(run_dir / rundir.METRICS, skipped=bad)
    if not bad:
        return None
    said = ", ".join(map(str, bad[:5])) + (f" and {len(bad) - 5} more" if len(bad) > 5 else "")
    return (f"note: {len(bad)} unreadable line(s) of {rundir.METRICS} left out of the figures "
            f"(line {said}; a line cut by a crash is the usual cause)")


def unfinished_line(run_dir: Path) -> str | None:
    """"the run reached step N of training.steps = M ..." when its metrics stop short of its
    config's steps (a failed, stopped or running job); None when it trained them all."""
    try:
        steps = json.loads((run_dir / rundir.CONFIG).read_text())["training"]["steps"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    done = max((r["step"] for r in metrics_rows(run_dir)), default=0)
    if done >= steps:
        return None
    return (f"the run reached step {done} of training.steps = {steps}: it failed, was stopped, "
            "or is still running (the figures are of the steps so far)")


def write_report(run_dir: Path, predict: bool = True) -> Path:
    if not run_dir.is_dir():
        raise DataError(f"{run_dir} is not a directory")
    run = load_run(run_dir)
    if not run.ranks and not (run_dir / rundir.METRICS).exists():
        try:   # a supervised job that ended before its workers trained a step
            s = json.loads((run_dir / rundir.SUPERVISOR_SUMMARY).read_text())
        except (OSError, ValueError):
            s = None
        if isinstance(s, dict):
            raise DataError(f"{run_dir}: its job {s.get('job', '?')} ended before any step "
                            f"was trained (status {s.get('status', '?')}, wall "
                            f"{float(s.get('wall_s') or 0):.1f} s): nothing to report; its "
                            f"supervisor's log says why: {run_dir / 'supervisor.log'}")
        raise DataError(f"{run_dir} is not a myria run directory (no {rundir.EVENTS_DIR}/ "
                        f"and no {rundir.METRICS}); pass the --run-dir of `myria train`")
    out = rundir.report_dir(run_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:   # a file named report/, a read-only run directory
        raise DataError(f"cannot write the report to {out}: "
                        f"{'a file has that name' if out.exists() else e.strerror}") from None
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
    pred = None if predict else {"error": "skipped (--no-prediction)"}
    (out / "prediction.json").unlink(missing_ok=True)
    if predict:
        hosts = {r.header.get("host") for r in run.ranks.values()}
        per_host = run.world // len(hosts) if run.world and None not in hosts and \
            "" not in hosts and run.world % len(hosts) == 0 else 0
        pred = prediction(run_dir, run.world or None, per_host)
        if pred is not None:
            pred.update(measured_step(table, metrics_rows(run_dir)))
            (out / "prediction.json").write_text(json.dumps(pred, indent=1))
    val = write_validation(run_dir, out)
    mix = training_by_source(run_dir)
    (out / MIX_FILE).unlink(missing_ok=True)
    if mix is not None:
        (out / MIX_FILE).write_text(json.dumps(mix, indent=1))
    (out / "index.html").write_text(page(run, table, blame, figs, pred, val,
                                         recovery_section(run_dir, out,
                                                          blame.get("stragglers"))
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
    t_min = min((e["t0"] for r in run.ranks.values() for e in r.events + r.redone), default=0)
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
        for e in re.events + re.redone:
            args = dict(e.get("a") or {}, step=e["s"])
            if "m" in e:
                args["microbatch"] = e["m"]
            redone = "attempt" in e   # a step a later attempt ran again: lost work
            if redone:
                args.update(attempt=e["attempt"], redone=True)
            # the training thread's spans nest; a helper thread's (checkpoint snapshot and
            # persist) overlap them, so they get a track of their own under the rank's
            tid = r
            if e.get("th", 0):
                tid = BACKGROUND_TID + r
                side.add(tid)
            name = e["n"] if "m" not in e else f"{e['n']} mb{e['m']}"
            name += " (redone)" if redone else ""
            ev.append({"ph": "X", "name": name, "cat": e["c"], "pid": pid, "tid": tid,
                       "ts": e["t0"] - t_min, "dur": max(0, e["t1"] - e["t0"]), "args": args,
                       "cname": CATEGORY_COLORS.get(e["c"], "generic_work")})
            if e["c"] == "p2p" and not redone:
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


# The prediction's parts (myria.sim.step_result.BREAKDOWN_LABELS) under the measured step's
# categories (`breakdown`): what a rank's events can tell apart
PREDICTED_AS = {"compute": ("compute_gemm", "compute_attention", "compute_memory_bound",
                            "recompute", "host_overhead"),
                "optimizer": ("optimizer", "offload"), "data wait": ("data_loading",),
                "idle / bubble": ("pp_bubble", "sync_wait"),
                "exposed comm (dp)": ("dp_comm_exposed",), "exposed comm (tp)":
                ("tp_comm_exposed",), "exposed comm (pp)": ("pp_p2p_exposed",),
                "exposed comm (cp)": ("cp_comm_exposed",), "exposed comm (ep)":
                ("ep_comm_exposed",)}


def side_by_side(predicted: dict[str, float], measured: dict[str, float]
                 ) -> dict[str, tuple[float | None, float | None]]:
    """Predicted and measured seconds per step by the measured categories (`PREDICTED_AS`;
    the data-parallel mesh dims, dp_shard and dp_replicate, are the prediction's DP), largest
    first; None where one side has no such part."""
    meas: dict[str, float] = {}
    for k, v in measured.items():
        k = "exposed comm (dp)" if k.startswith("exposed comm (dp") else k
        meas[k] = meas.get(k, 0.0) + v
    out = {k: (sum(predicted.get(p, 0.0) for p in parts) or None, meas.get(k))
           for k, parts in PREDICTED_AS.items()}
    out.update({k: (None, v) for k, v in meas.items() if k not in out})
    keep = {k: v for k, v in out.items() if (v[0] or 0) > 0 or (v[1] or 0) > 0}
    return dict(sorted(keep.items(), key=lambda kv: -max(kv[1][0] or 0, kv[1][1] or 0)))


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
                     f"from step {steps[1] if len(steps) > 1 else steps[0]})", fontsize=9)
        fig.colorbar(im, ax=ax, label="ms")
        figs["heatmap"] = png(fig, out / "heatmap.png")
    bd = breakdown(table)
    if bd:
        fig, ax = plt.subplots(figsize=(7, 3.2))
        names = [k for k, v in sorted(bd.items(), key=lambda kv: -kv[1]) if v > 0]
        ax.barh(names[::-1], [bd[k] * 1e3 for k in names[::-1]], color="#4477aa")
        ax.set_xlabel("ms per step (mean over ranks and steps)")
        ax.set_title("where a step's time goes (measured)")
        figs["breakdown"] = png(fig, out / "breakdown.png")
    metrics = metrics_rows(run.run_dir)
    if metrics:
        fig, axes = plt.subplots(1, 4, figsize=(16, 3.6))
        from matplotlib.ticker import MaxNLocator

        phases = phase_starts(run.run_dir)   # a mixture's new weights: dotted on each curve
        faults = fault_steps(run.run_dir)     # a supervised job's faults: dashed, red
        by_source = source_losses(metrics)    # a data mixture's sources, under the loss

        for ax, key, label in zip(axes, CURVES, ("loss", "learning rate", "tokens/s",
                                                 "MFU, %")):
            scale = 100.0 if key == "mfu" else 1.0   # percent, as the step lines say it
            # a skipped step's non-finite loss is null or "inf" in metrics.jsonl: not drawn
            pts = [(m["step"], scale * m[key]) for m in metrics
                   if isinstance(m.get(key), (int, float))]
            if pts:
                ax.plot(*zip(*pts), color="#aa3377",
                        label="mixture" if key == "loss" and by_source else None)
            if key == "loss":   # a data mixture's sources, each on the steps that measured it
                for name, src_pts in by_source.items():
                    ax.plot(*zip(*src_pts), linewidth=1, marker=".", markersize=3,
                            label=name)
                if by_source:
                    ax.legend(fontsize=7)
            for first in phases:
                ax.axvline(first, color="grey", linestyle=":", linewidth=1)
            for step in faults:
                ax.axvline(step, color="#cc3311", linestyle="--", linewidth=1)
            ax.set_xlabel("step")
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))   # steps are whole
            marks = [w for w, on in (("dotted: data phases", phases), ("dashed: faults", faults))
                     if on]
            ax.set_title(label + (f" ({'; '.join(marks)})" if marks and key == "loss" else ""))
            ax.ticklabel_format(axis="y", style="sci", scilimits=(-3, 4))
        figs["curves"] = png(fig, out / "curves.png")
    return figs


CURVES = ("loss", "lr", "tokens_per_s", "mfu")   # metrics.jsonl keys, in the curves' order


def source_losses(metrics: list[dict]) -> dict[str, list[tuple[int, float]]]:
    """Each source's training loss (`loss_by_source`) as (step, loss) points, in the order
    the sources first appear; a skipped step's non-finite loss (null or "inf") is not a point."""
    out: dict[str, list[tuple[int, float]]] = {}
    for m in metrics:
        by = m.get("loss_by_source")
        for name, v in (by.items() if isinstance(by, dict) else ()):
            if isinstance(v, (int, float)) and math.isfinite(v):
                out.setdefault(name, []).append((m["step"], float(v)))
    return out




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
    if pred and "error" in pred:   # the reason, without the exception's class name
        import re

        why = re.sub(r"^\w+Error: ", "", str(pred["error"]))
        pred_html = f"<p>no prediction: {esc(why)}</p>"
    elif pred:
        both = side_by_side(pred["breakdown"], bd)
        ms = lambda v: "-" if v is None else f"{v * 1e3:.1f}"   # noqa: E731
        rows_pm = "".join(f"<tr><td>{esc(k)}</td><td>{ms(p_)}</td><td>{ms(m_)}</td></tr>"
                          for k, (p_, m_) in both.items())
        tot = [sum(x[i] or 0.0 for x in both.values()) for i in (0, 1)]
        rows_pm += (f"<tr><th>total</th><th>{ms(tot[0])}</th><th>"
                    f"{ms(tot[1]) if bd else '-'}</th></tr>")
        from myria.sim.step_result import BREAKDOWN_LABELS

        prow = "".join(f"<tr><td>{esc(BREAKDOWN_LABELS.get(k, k))}</td>"
                       f"<td>{v * 1e3:.1f}</td></tr>"
                       for k, v in sorted(pred["breakdown"].items(), key=lambda kv: -kv[1])
                       if v > 0)
        basis = f"peak {pred['peak']}" + (f"; figures {pred['figures']}"
                                          if pred.get("figures") else "")
        pred_html = (f"<p id=prediction>{esc(prediction_line(pred))} (MFU in the meter's "
                     f"convention; measured from {esc(pred.get('measured_from') or '-')}).</p>"
                     f"<p><small>{esc(basis)}. On a shared host the measured step includes "
                     "the time other jobs held the cores; the prediction is for a quiet host."
                     "</small></p>"
                     "<table id=pred-vs-measured><tr><th>ms per step</th><th>predicted</th>"
                     f"<th>measured</th></tr>{rows_pm}</table>"
                     + ("" if bd else "<p>no measured breakdown: no events</p>")
                     + "<details><summary>the prediction's own parts</summary><table>"
                     f"<tr><th>predicted</th><th>ms</th></tr>{prow}</table></details>")
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
    timeline = ("<p>Timeline: <a href='trace.json'><code>trace.json</code></a> (load it in "
                "Perfetto, ui.perfetto.dev, or chrome://tracing).</p>" if run.ranks else "")
    unfinished = unfinished_line(run.run_dir)
    # at the top, as the console says them: the run, its goodput and faults, its detections
    said = [run_line(run)]
    try:
        gp = json.loads((rundir.report_dir(run.run_dir) / "goodput.json").read_text())
        said += [goodput_line(gp), *fault_lines(gp), *lost_host_lines(gp)]
    except (OSError, ValueError, KeyError):
        pass
    said = [x for x in (*said, detections_line(run.run_dir), unreadable_line(run.run_dir)) if x]
    warm = blame.get("warmup_step_excluded")
    warm = (f"step {warm}, the warm-up, left out" if warm is not None else
            "no warm-up step left out")
    summary = (f"<p id=unfinished><b>{esc(unfinished)}</b></p>" if unfinished else "") + \
        ("<ul id=summary>" + "".join(f"<li>{esc(x)}</li>" for x in said) + "</ul>"
         if said else "") + \
        f"""<p>{len(run.ranks)} rank(s) of {run.world}, {blame['steps']} step(s) analysed
({warm}). Most blamed rank: {most}; {standout}
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
td:first-child,th:first-child,td.text{{text-align:left}}
tr.hot{{background:#fdd}}.scroll{{overflow-x:auto}}pre.stack{{background:#f6f6f6;padding:.5em}}img{{max-width:100%}}.row{{display:flex;gap:2em}}</style></head><body>
<h1>myria report: {esc(str(run.run_dir))}</h1>
{hang_html(hang)}
{summary}
{img}
{mixture_html(mix)}
{validation_html(val)}
{strag_html}
<h2>Predicted beside measured</h2>{pred_html}
<h2>Missing event data</h2><ul>{problems}</ul>
{timeline}{recovery}</body></html>"""
