"""`[profiling]`: torch.profiler over a window of steps, a trace per rank.

    [profiling]
    start_step = 10      # first profiled step, as the logs count them
    steps = 2
    memory = true        # and a memory snapshot

Every rank profiles steps start_step .. start_step + steps - 1 (CPU activities, and CUDA's on a
GPU) and writes RUN_DIR/profile/trace_rankNNNNN.json (Chrome trace format: open it in
https://ui.perfetto.dev or chrome://tracing), plus a table of the operators by time
(ops_rankNNNNN.txt). With `memory`, a CUDA rank records the allocator's history over the window
and dumps memory_rankNNNNN.pickle (drag it onto https://pytorch.org/memory_viz); a CPU rank
profiles memory in the trace and lists the operators by memory in the table. `myria report`
links the files. The window costs the profiler's overhead on those steps only.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

log = logging.getLogger("myria")
DIR = "profile"   # under RUN_DIR


def trace_file(run_dir: Path, rank: int) -> Path:
    return Path(run_dir) / DIR / f"trace_rank{rank:05d}.json"


class Profiler:
    """One rank's profiling window; `before(step)` / `after(step)` around each step."""

    def __init__(self, cfg, run_dir: Path, rank: int, device_type: str):
        self.cfg, self.run_dir, self.rank = cfg, Path(run_dir), rank
        self.cuda = device_type == "cuda"
        self.first = cfg.start_step
        self.last = cfg.start_step + cfg.steps - 1
        self.prof = None

    def before(self, step: int) -> None:
        """Step `step` (from 1) is about to run: open the window at its first step."""
        if not self.first or step != self.first:
            return
        acts = [torch.profiler.ProfilerActivity.CPU]
        if self.cuda:
            acts.append(torch.profiler.ProfilerActivity.CUDA)
            if self.cfg.memory:
                torch.cuda.memory._record_memory_history(max_entries=100_000)
        self.prof = torch.profiler.profile(activities=acts, record_shapes=True,
                                           profile_memory=self.cfg.memory)
        self.prof.__enter__()

    def after(self, step: int) -> None:
        """Step `step` is done: close the window after its last step and write the files."""
        if self.prof is None or step < self.last:
            return
        if self.cuda:
            torch.cuda.synchronize()
        self.prof.__exit__(None, None, None)
        out = self.run_dir / DIR
        try:
            out.mkdir(parents=True, exist_ok=True)
            self.prof.export_chrome_trace(str(trace_file(self.run_dir, self.rank)))
            sort = "self_cpu_memory_usage" if self.cfg.memory and not self.cuda else \
                ("self_cuda_time_total" if self.cuda else "self_cpu_time_total")
            (out / f"ops_rank{self.rank:05d}.txt").write_text(
                f"steps {self.first}-{self.last}, rank {self.rank}, sorted by {sort}\n"
                + self.prof.key_averages().table(sort_by=sort, row_limit=40))
            if self.cuda and self.cfg.memory:
                torch.cuda.memory._dump_snapshot(str(out / f"memory_rank{self.rank:05d}.pickle"))
                torch.cuda.memory._record_memory_history(enabled=None)
        except OSError as e:  # a profile is never the reason a run fails
            log.warning("profile of rank %d not written to %s: %s", self.rank, out, e)
        self.prof = None
