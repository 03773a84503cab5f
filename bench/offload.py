"""Train a model whose training state is >= 3x the fast-tier budget.

    .venv/bin/python bench/offload.py [--steps 5] [--rounds 3] [--budget-gb 1.9] [--dir DIR]

The same model and batches are trained for `--steps` steps twice per round, each in a process of
its own (so each peak resident memory is its own):

- `memory`: everything in RAM (AdamW, activation checkpointing as below);
- `disk`:   `parallel.offload = nvme`, `offload_params = true`, `fast_memory_gb = --budget-gb`:
            parameters and both AdamW moments in files under `--dir`, streamed through buffers.

Both recompute activations (`activation_checkpoint = full`; the parameter tier needs it), so the
arithmetic is the same and tokens/s compare the tiers, not the recomputation. Between the two
runs of a round the disk's sequential bandwidth is measured on the same directory (O_DIRECT
writes then reads of `--probe-gb`, then both at once, the best of 2), the limit the offload can
reach.

Reported per round: training state (16 bytes per parameter: fp32 weights, gradients, two
moments) against the budget; peak resident memory of each run (VmHWM) against budget and the
runtime's own memory (the process after `import torch` with the model's code, measured in the
same child); tokens/s of both (median step after the first); whether the final parameters are
bit-equal; bytes moved per step, each I/O thread's achieved bandwidth against the measured
sequential bandwidth; the limit the bandwidths allow (the larger of the in-memory step and the
disk time of the step's bytes: reads and writes at the rates measured while both run, the rest
alone), and how much of the I/O hid behind compute: hidden = 1 - exposed / that disk time, where
exposed is the time the training loop waited on a chunk or a layer not yet there (or, in
backward, for write-behind buffers to give memory back). With `--ab`, a third run per round,
`disk-sync`, is the A/B of the update behind training: the same disk run with the update
finished inside step(), before the next forward starts.

Each round runs the pair twice: with the gradient clipped at 1.0, which binds at every step of
this short run from random weights (norms 7-40), and with a clip of `--loose-clip` (1000),
above every norm here: the regime of most of a pretraining run once the norm has settled under
the clip. Only there can the update run during backward (the speculation of
myria.offload.adamw: it assumes the gradients will not be scaled, and is dropped if they are).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench" / "results" / "offload.json"

# with the defaults (--layers 24 --hidden 1152): 359M parameters, 5.74 GB of training state
MODEL = ["--model.vocab_size=8192",
         "--model.heads=12", "--model.kv_heads=4", "--model.seq_len=256",
         "--training.global_batch=2", "--training.micro_batch=2",
         "--parallel.activation_checkpoint=full"]


def child(mode: str, steps: int, budget: float, directory: Path, size: list[str],
          clip: float, update_threads: int = 0) -> dict:
    """One run in this process: train `steps` steps, report timings, memory and a digest.
    `update_threads`: `torch.set_num_threads(n)` called on the thread that runs the update. In
    this torch build (OpenMP) that sets that thread's OpenMP pool and the count threads started
    afterwards take; the training thread keeps its own (checked: `torch.get_num_threads()` there
    stays 2). MKL's setting is per thread too."""
    import torch

    from myria import config
    from myria.offload.procmem import current_rss, peak_rss
    from myria.train.engine import Engine

    torch.set_num_threads(os.cpu_count() or 1)
    runtime_rss = current_rss()
    extra = [] if mode == "memory" else [
        "--parallel.offload=nvme", "--parallel.offload_params=true",
        f"--parallel.fast_memory_gb={budget}", f"--parallel.offload_dir={directory}"]
    cfg = config.load(None, [*MODEL, *size, *extra])
    e = Engine(cfg, None, torch.device("cpu"), directory / f"run-{mode}")
    if mode == "disk-sync":   # the A/B: the update before the next forward, not behind it
        e.optimizers[0].asynchronous = False
    if update_threads:
        from myria.offload.adamw import OffloadedAdamW

        real = OffloadedAdamW._run_behind

        def run_behind(self, u):
            torch.set_num_threads(update_threads)   # this thread's pool (see above)
            return real(self, u)

        OffloadedAdamW._run_behind = run_behind
    g = torch.Generator().manual_seed(7)
    times, norms, cpu = [], [], []
    for _ in range(steps):
        c0 = sum(os.times()[:2])
        x = torch.randint(0, cfg.model.vocab_size, (1, 2, cfg.model.seq_len + 1), generator=g)
        t0 = time.perf_counter()
        e.forward_backward(x[..., :-1], x[..., 1:])
        norms.append(e.clip_grads(clip))
        e.step()
        times.append(time.perf_counter() - t0)
        cpu.append(sum(os.times()[:2]) - c0)
    out = {"mode": mode, "step_s": times, "grad_norms": norms, "cpu_s": cpu,
           "peak_rss_bytes": peak_rss(),
           "runtime_rss_bytes": runtime_rss,
           "params": sum(p.numel() for p in e.model.parameters())}
    if mode != "memory":
        from myria.layout import Layout
        from myria.offload.budget import plan_for_config
        out["planned_bytes"] = plan_for_config(cfg, Layout()).resident
        opt = e.optimizers[0]
        opt.flush()
        st = opt.pipe.stats
        ps = opt.streamer
        out.update(io={"bytes_read": st.bytes_read + ps.bytes_read,
                       "bytes_written": st.bytes_written,
                       "opt_read_s": st.read_s, "opt_write_s": st.write_s,
                       "param_read_s": ps.read_s, "opt_wait_s": st.wait_s,
                       "param_wait_s": ps.wait_s,
                       "param_waits": dict(sorted(ps.waits.items(), key=lambda kv: -kv[1])),
                       "behind_s": st.behind_s,
                       "room_wait_s": st.room_wait_s, "param_copied": ps.bytes_copied,
                       "write_behind_buffers": st.behind_buffers,
                       "write_behind_peak_bytes": st.behind_peak_bytes,
                       "spec_confirmed": st.spec_confirmed,
                       "spec_cancelled": st.spec_cancelled,
                       "spec_cancel_s": st.spec_cancel_s,
                       "spec_chunks_ahead": st.spec_chunks_ahead, "chunks": len(opt.chunks),
                       "direct": opt.direct,
                       "buffers": len(opt.pipe.buffers),
                       "buffer_bytes": int(opt.pipe.buffers[0].numel())},
                   params=sum(opt.filemap.numels))
    sd = e.state_dict()["model"]
    h = hashlib.sha256()
    for k in sorted(sd):
        h.update(k.encode())
        h.update(sd[k].detach().contiguous().view(torch.uint8).numpy().tobytes())
    out["digest"] = h.hexdigest()
    e.close()
    return out


def disk_bandwidth(directory: Path, gb: float) -> dict:
    """Sequential write then read of `gb` GB with O_DIRECT (where the file system allows it) in
    the offload's own chunk size, then both at once on two threads (a reader over the file just
    written, a writer to a second file), as the offload runs them: the bandwidths the tier could
    reach on this disk now, alone and sharing the disk."""
    import threading

    from myria.offload.budget import CHUNK_BYTES
    from myria.offload.diskio import aligned_buffer, full_io, open_file, probe_direct

    direct = probe_direct(directory)
    n = max(1, int(gb * (1 << 30)) // CHUNK_BYTES)
    bufs = [aligned_buffer(CHUNK_BYTES) for _ in range(2)]
    for b in bufs:
        b.fill_(1)
    mvs = [memoryview(b.numpy()).cast("B") for b in bufs]
    paths = [directory / "probe.bin", directory / "probe2.bin"]
    fds = [open_file(p, os.O_RDWR | os.O_CREAT, direct) for p in paths]

    def run(op, fd, mv, out, key):
        t0 = time.perf_counter()
        for i in range(n):
            full_io(op, fd, mv, i * CHUNK_BYTES)
        if op is os.pwritev:
            os.fdatasync(fd)
        out[key] = time.perf_counter() - t0

    t: dict[str, float] = {}
    try:
        run(os.pwritev, fds[0], mvs[0], t, "write")
        run(os.preadv, fds[0], mvs[0], t, "read")
        both = [threading.Thread(target=run, args=(os.preadv, fds[0], mvs[0], t, "read_shared")),
                threading.Thread(target=run, args=(os.pwritev, fds[1], mvs[1], t,
                                                   "write_shared"))]
        for th in both:
            th.start()
        for th in both:
            th.join()
    finally:
        for fd in fds:
            os.close(fd)
        for p in paths:
            p.unlink(missing_ok=True)
    b = n * CHUNK_BYTES
    return {"write_gbs": b / t["write"] / 1e9, "read_gbs": b / t["read"] / 1e9,
            "read_shared_gbs": b / t["read_shared"] / 1e9,
            "write_shared_gbs": b / t["write_shared"] / 1e9, "direct": direct, "bytes": b}


def io_time(read: float, written: float, bw: dict) -> float:
    """Seconds to read and write these bytes on this disk, both streams at once while both
    last (the shared rates), the rest of the longer one alone."""
    gb = 1e9
    r, w = read / (bw["read_shared_gbs"] * gb), written / (bw["write_shared_gbs"] * gb)
    together = min(r, w)
    rest_r = (read - together * bw["read_shared_gbs"] * gb) / (bw["read_gbs"] * gb)
    rest_w = (written - together * bw["write_shared_gbs"] * gb) / (bw["write_gbs"] * gb)
    return together + max(0.0, rest_r) + max(0.0, rest_w)


def run_child(mode: str, a, directory: Path, clip: float, update_threads: int = 0) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src") + os.pathsep +
               os.environ.get("PYTHONPATH", ""))
    cp = subprocess.run([sys.executable, __file__, "--child", mode, "--steps", str(a.steps),
                         "--budget-gb", str(a.budget_gb), "--dir", str(directory),
                         "--layers", str(a.layers), "--hidden", str(a.hidden),
                         "--clip", str(clip), "--update-threads", str(update_threads)],
                        env=env, capture_output=True, text=True)
    if cp.returncode:
        sys.exit(f"{mode} run failed:\n{cp.stderr[-3000:]}")
    return json.loads(cp.stdout.strip().splitlines()[-1])


def summarise(mem: dict, disk: dict, bw: dict, budget: float, tokens: int,
              mem2: dict | None = None) -> dict:
    """`mem2`: a second in-memory run after the disk run; the in-memory step is then the
    mean of the two (the disk run is bracketed: the machine is shared and drifts), and their
    difference is reported as the noise floor of the comparison."""
    gb = 1e9
    state = 16 * mem["params"]
    median = lambda r: statistics.median(r["step_s"][1:] or r["step_s"])  # noqa: E731
    mems = [mem] + ([mem2] if mem2 else [])
    mem_s = statistics.fmean(median(m) for m in mems)
    steady = lambda r: mem_s if r is mem else median(r)  # noqa: E731
    io, steps = disk["io"], len(disk["step_s"])
    opt_busy = max(io["opt_read_s"], io["opt_write_s"])
    io_busy = max(opt_busy, io["param_read_s"])
    exposed = io["opt_wait_s"] + io["param_wait_s"] + io.get("room_wait_s", 0.0) + \
        io.get("spec_cancel_s", 0.0)
    # the limit: the step's bytes at the probe's rates (reads and writes sharing the disk),
    # overlapped with all of the in-memory run's compute
    disk_s = io_time(io["bytes_read"], io["bytes_written"], bw) / steps
    bound = max(steady(mem), disk_s)
    return {
        "params": mem["params"], "state_gb": state / gb, "budget_gb": budget,
        "state_over_budget": state / (budget * gb),
        "peak_gb": {"memory": mem["peak_rss_bytes"] / gb, "disk": disk["peak_rss_bytes"] / gb},
        "runtime_gb": disk["runtime_rss_bytes"] / gb,
        "over_budget_gb": disk["peak_rss_bytes"] / gb - budget,
        "planned_gb": disk["planned_bytes"] / gb,
        "tokens_per_s": {"memory": tokens / steady(mem), "disk": tokens / steady(disk)},
        "speed_ratio": steady(mem) / steady(disk),
        "bit_equal": all(m["digest"] == disk["digest"] for m in mems),
        "memory_runs_s": [median(m) for m in mems],
        "memory_spread": (max(median(m) for m in mems) - min(median(m) for m in mems)) / mem_s,
        "param_waits_s_per_step": {k: v / steps for k, v in
                                   list(io.get("param_waits", {}).items())[:4] if v > 0},
        "grad_norms": [min(disk.get("grad_norms", [0])), max(disk.get("grad_norms", [0]))],
        "digests": {"memory": mem["digest"][:16], "disk": disk["digest"][:16]},
        "io_per_step_gb": {"read": io["bytes_read"] / steps / gb,
                           "written": io["bytes_written"] / steps / gb,
                           "params_from_memory": io.get("param_copied", 0) / steps / gb},
        "speculation": {"kept": io.get("spec_confirmed", 0),
                        "dropped": io.get("spec_cancelled", 0),
                        "drop_s_per_step": io.get("spec_cancel_s", 0.0) / steps,
                        "updated_in_backward": io.get("spec_chunks_ahead", 0)
                        / max(1, io.get("spec_confirmed", 0)) / max(1, io.get("chunks", 1))},
        "write_behind": {"buffers_per_step": io.get("write_behind_buffers", 0) / steps,
                         "peak_gb": io.get("write_behind_peak_bytes", 0) / gb,
                         "backward_wait_s_per_step": io.get("room_wait_s", 0.0) / steps},
        "achieved_gbs": {
            "read": io["bytes_read"] / max(1e-9, io["opt_read_s"] + io["param_read_s"]) / gb,
            "write": io["bytes_written"] / max(1e-9, io["opt_write_s"]) / gb},
        "sequential_gbs": {"read": bw["read_gbs"], "write": bw["write_gbs"],
                           "read_shared": bw["read_shared_gbs"],
                           "write_shared": bw["write_shared_gbs"]},
        "direct": io["direct"],
        "io_busy_s_per_step": io_busy / steps, "exposed_s_per_step": exposed / steps,
        "hidden_fraction": max(0.0, 1 - exposed / steps / disk_s) if disk_s else 1.0,
        "step_s": {"memory": steady(mem), "disk": steady(disk)},
        # CPU seconds (user + system, every thread) per step: what moving the data costs the
        # cores that also compute
        "cpu_s": {k: statistics.median(r["cpu_s"][1:] or r["cpu_s"]) for k, r in
                  (("memory", mem), ("memory_after", mem2), ("disk", disk))
                  if r and "cpu_s" in r},
        "disk_s_per_step": disk_s, "bound_step_s": bound,
        "step_over_bound": steady(disk) / bound,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--budget-gb", type=float, default=1.9,
                    help="fast-tier budget, GB (parallel.fast_memory_gb)")
    ap.add_argument("--probe-gb", type=float, default=2.0)
    ap.add_argument("--dir", default="", help="offload directory (a local disk; default: a "
                    "temporary directory under the project, not /tmp, which may be tmpfs)")
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--hidden", type=int, default=1152, help="model width (heads: 12)")
    ap.add_argument("--loose-clip", type=float, default=1000.0,
                    help="the clip of the second pair of runs, above every gradient norm")
    ap.add_argument("--ab", action="store_true",
                    help="also the disk run with the update finished inside step()")
    ap.add_argument("--child", default="", help=argparse.SUPPRESS)
    ap.add_argument("--clip", type=float, default=1.0, help=argparse.SUPPRESS)
    ap.add_argument("--update-threads", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--threads-ab", action="store_true",
                    help="also the loose-clip disk run with torch.set_num_threads(1) called on "
                    "the update's thread (its own OpenMP pool; training keeps its own)")
    a = ap.parse_args()
    if a.child:
        size = [f"--model.layers={a.layers}", f"--model.hidden={a.hidden}"]
        print(json.dumps(child(a.child, a.steps, a.budget_gb, Path(a.dir), size, a.clip,
                               a.update_threads)))
        return
    base = Path(a.dir) if a.dir else Path(tempfile.mkdtemp(prefix="offload-bench-", dir=ROOT))
    tokens = 2 * 256
    rounds = []
    try:
        for r in range(a.rounds):
            d = base / f"round{r}"
            d.mkdir(parents=True, exist_ok=True)
            mem = run_child("memory", a, d, 1.0)
            bw = max((disk_bandwidth(d, a.probe_gb) for _ in range(2)),
                     key=lambda b: b["read_shared_gbs"] + b["write_shared_gbs"])
            disk = run_child("disk", a, d, 1.0)
            mem2 = run_child("memory", a, d, 1.0)
            s = summarise(mem, disk, bw, a.budget_gb, tokens, mem2)
            if a.ab:
                sync = run_child("disk-sync", a, d, 1.0)
                s["update_before_forward"] = {
                    "step_s": statistics.median(sync["step_s"][1:] or sync["step_s"]),
                    "exposed_s_per_step": (sync["io"]["opt_wait_s"] +
                                           sync["io"]["param_wait_s"]) / len(sync["step_s"]),
                    "bit_equal": sync["digest"] == mem["digest"], "digest": sync["digest"][:16]}
            s["clip"] = 1.0
            rounds.append(s)
            mem_l = run_child("memory", a, d, a.loose_clip)
            bw_l = max((disk_bandwidth(d, a.probe_gb) for _ in range(2)),
                       key=lambda b: b["read_shared_gbs"] + b["write_shared_gbs"])
            disk_l = run_child("disk", a, d, a.loose_clip)
            mem_l2 = run_child("memory", a, d, a.loose_clip)
            s["loose"] = summarise(mem_l, disk_l, bw_l, a.budget_gb, tokens, mem_l2)
            s["loose"]["clip"] = a.loose_clip
            if a.threads_ab:
                one = summarise(mem_l, run_child("disk", a, d, a.loose_clip, 1), bw_l,
                                a.budget_gb, tokens)
                s["loose"]["update_one_thread"] = {
                    k: one[k] for k in ("step_s", "step_over_bound", "exposed_s_per_step",
                                        "cpu_s", "bit_equal")}
                print(f"round {r}, clip {a.loose_clip:g}, update on one thread: step "
                      f"{one['step_s']['disk']:.2f} s ({one['step_over_bound']:.2f}x the limit) "
                      f"against {s['loose']['step_s']['disk']:.2f} s", flush=True)
            for x in (s, s["loose"]):
                    print(f"round {r}, clip {x['clip']:g}: state {x['state_gb']:.2f} GB = "
                      f"{x['state_over_budget']:.2f}x budget; peak {x['peak_gb']['disk']:.2f} GB "
                      f"(memory run {x['peak_gb']['memory']:.2f}; planned "
                      f"{x['planned_gb']:.2f}, runtime {x['runtime_gb']:.2f}); "
                      f"{x['tokens_per_s']['disk']:.1f} vs {x['tokens_per_s']['memory']:.1f} "
                      f"tokens/s; step {x['step_over_bound']:.2f}x the limit; bit-equal "
                      f"{x['bit_equal']}; update during backward kept "
                      f"{x['speculation']['kept']}, dropped {x['speculation']['dropped']}; "
                      f"hidden {100 * x['hidden_fraction']:.0f}%; memory runs "
                      + "/".join(f"{t:.2f}" for t in x["memory_runs_s"])
                      + f" s, disk {x['step_s']['disk']:.2f} s", flush=True)
            shutil.rmtree(d, ignore_errors=True)
    finally:
        if not a.dir:
            shutil.rmtree(base, ignore_errors=True)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    res = {"command": "python bench/offload.py " + " ".join(sys.argv[1:]),
           "machine": f"{platform.machine()}, {os.cpu_count()} cores, "
                      f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 1e9:.0f} GB",
           "date": time.strftime("%Y-%m-%d"), "steps": a.steps, "probe_gb": a.probe_gb,
           "rounds": rounds}
    OUT.write_text(json.dumps(res, indent=1))
    (ROOT / "bench" / "RESULTS_offload.md").write_text(markdown(res))
    print(f"wrote {OUT} and bench/RESULTS_offload.md")


def markdown(res: dict) -> str:
    r0 = res["rounds"][0]
    lines = [
        "## Offload: a model 3x larger than the fast tier (issue 14)", "",
        f"`{res['command']}` — {res['machine']}, {res['date']}. {r0['params'] / 1e6:.0f}M "
        f"parameters, {r0['state_gb']:.2f} GB of training state (fp32 weights, gradients, two "
        f"AdamW moments) against a fast-tier budget of {r0['budget_gb']:g} GB "
        f"({r0['state_over_budget']:.2f}x); `disk`: parameters and moments in files "
        "(`offload = nvme`, `offload_params = true`), `memory`: everything in RAM; both "
        f"recompute activations; {res['steps']} steps each, median step after the first. "
        "Each round trains the pair with the gradient clipped at 1 (binding at every step: "
        f"norms {min(r['grad_norms'][0] for r in res['rounds']):.1f}-"
        f"{max(r['grad_norms'][1] for r in res['rounds']):.1f} from random weights) and with "
        "a clip above every norm (the update can then run during backward).", "",
        "| round | clip | peak memory run | peak disk run | budget + runtime | tokens/s memory "
        "| tokens/s disk | bit-equal | read achieved / alone / shared GB/s | write achieved / "
        "alone / shared GB/s | I/O per step | update during backward: kept, dropped, chunks "
        "done by step() | I/O hidden | step: memory before, after / disk / limit "
        "| **step / limit** |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for i, r0 in enumerate(res["rounds"]):
        for r in (r0, r0.get("loose")):
            if r is None:
                continue
            sp = r.get("speculation", {})
            lines.append(
                f"| {i} | {r.get('clip', 1.0):g} | {r['peak_gb']['memory']:.2f} GB | "
                f"{r['peak_gb']['disk']:.2f} GB | {r['budget_gb']:g} + {r['runtime_gb']:.2f} GB "
                f"| {r['tokens_per_s']['memory']:.1f} | {r['tokens_per_s']['disk']:.1f} | "
                f"{'yes' if r['bit_equal'] else 'NO'} | "
                f"{r['achieved_gbs']['read']:.2f} / {r['sequential_gbs']['read']:.2f} / "
                f"{r['sequential_gbs'].get('read_shared', float('nan')):.2f} | "
                f"{r['achieved_gbs']['write']:.2f} / {r['sequential_gbs']['write']:.2f} / "
                f"{r['sequential_gbs'].get('write_shared', float('nan')):.2f} | "
                f"{r['io_per_step_gb']['read']:.1f} GB read, "
                f"{r['io_per_step_gb']['written']:.1f} GB written, "
                f"{r['io_per_step_gb'].get('params_from_memory', 0):.1f} GB of parameters from "
                f"memory | {sp.get('kept', 0)}, {sp.get('dropped', 0)}, "
                f"{100 * sp.get('updated_in_backward', 0):.0f}% | "
                f"{100 * r['hidden_fraction']:.0f}% | "
                + ", ".join(f"{t:.2f}" for t in r.get("memory_runs_s", [r['step_s']['memory']]))
                + f" / {r['step_s']['disk']:.2f} / {r['bound_step_s']:.2f} s | "
                f"**{r['step_over_bound']:.2f}x** |")
    lines += ["", "Peak memory is the process's high-water mark (VmHWM); *runtime* is the "
              "process after importing torch and myria, which no budget removes. I/O hidden = "
              "1 - (time the loop waited for a chunk or a layer, or for a dropped speculation "
              "to stop) / (the step's bytes at the probe's rates). "
              "Achieved bandwidth is bytes over the I/O threads' busy time; sequential is an "
              f"O_DIRECT write then read of {res.get('probe_gb', 2):g} GB on the same directory in "
              f"the same round (alone), then a read and a write of {res.get('probe_gb', 2):g} GB "
              "each at once on two threads (shared), measured "
              "before each disk run. The "
              "limit is the step the bandwidths allow: the larger of the in-memory step and the "
              "disk time of the step's bytes (reads and writes at the rates the probe measured "
              "while both ran, the rest alone); the in-memory step is the mean of two runs, "
              "one before and one after the disk run, which bracket it against the host's "
              "drift (their difference is the noise of the comparison). "
              "*Update during backward*: steps whose update ran "
              "during backward and was kept, and dropped (the gradients were then clipped; "
              "the first step speculates, later ones only after an unclipped step), and the "
              "share of chunks a kept one had updated when step() came. The "
              "machine is shared: tokens/s of the runs of a round are minutes apart.", ""]
    one = [r["loose"]["update_one_thread"] for r in res["rounds"]
           if "update_one_thread" in r.get("loose", {})]
    if one:
        lines += [f"A/B, the update's thread on one torch thread (clip "
                  f"{res['rounds'][0]['loose']['clip']:g}): step " + ", ".join(
                      f"{x['step_s']['disk']:.1f} s ({x['step_over_bound']:.2f}x the limit"
                      + ("" if x["bit_equal"] else ", NOT bit-equal") + ")" for x in one)
                  + " (rounds in order; compare the clip-"
                  f"{res['rounds'][0]['loose']['clip']:g} rows above).", ""]
    ab = [r["update_before_forward"] for r in res["rounds"] if "update_before_forward" in r]
    if ab:
        lines += ["A/B, the update finished inside step() (clip 1): step " + ", ".join(
            f"{x['step_s']:.1f} s (exposed {x['exposed_s_per_step']:.1f} s"
            + ("" if x["bit_equal"] else ", NOT bit-equal") + ")" for x in ab) + ".", ""]
    count: dict[str, dict[str, int]] = {}
    for r0 in res["rounds"]:
        for r in (r0, r0.get("loose")):
            if r is None:
                continue
            c = f"clip {r.get('clip', 1.0):g}"
            for kind, d in ((f"memory, {c}", r["digests"]["memory"]),
                            (f"disk, {c}", r["digests"]["disk"]),
                            (f"update before forward, {c}", r.get("update_before_forward", {})
                             .get("digest"))):
                if d:
                    count.setdefault(kind, {}).setdefault(d, 0)
                    count[kind][d] += 1
    lines += ["Final parameters' digests over the rounds (each run a fresh process): " + "; ".join(
        f"{kind}: " + ", ".join(f"{d[:8]} x{n}" for d, n in c.items()) for kind, c in
        count.items()) + ".", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
