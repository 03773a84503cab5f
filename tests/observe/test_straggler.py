"""Straggler detection from the event timer: a rank slowed by 20% is named within K steps; clean
runs on this busy 2-core host raise nothing; detections are JSON lines in RUN_DIR/events.jsonl.
The supervisor's report of a straggler, once, is in tests/resilience/test_supervisor.py."""

from __future__ import annotations

import json

import pytest

from myria import detections
from myria.observe.analyze import load_run
from myria.observe.straggler import detect, detect_dir
from tests.conftest import TINY, run_cli

# Windows of 4 steps. The fixtures' steps take ~30 ms of compute each on 4 processes over 2
# cores: with windows of 3, one rank of a clean run that lost CPU for ~0.2 s (a busy moment of the
# shared host) was named in two consecutive windows (slowdown 11% and 13%, z 2.6 and 3.5; one
# full suite of this session). The two-window rule rejects blips shorter than a window; at real
# step times a window is minutes.
WINDOW, WINDOWS = 4, 2
# Named within K measured steps of the slowdown (it starts at step 1; step 1 is the warm-up):
# K = window x windows when the evidence is clear, one window more when noise resets the streak
# (the detector's documented bound).
SLOW_WINDOW = WINDOW
K = SLOW_WINDOW * (WINDOWS + 1)


@pytest.mark.slow
def test_a_rank_slowed_by_20_percent_is_named_within_k_steps(tmp_path, tiny_data):
    # Steps of ~120 ms of compute (global batch 64), not ~30 ms: in one full suite the 30 ms
    # steps were so noisy (per-step sigma 0.2-0.3 with the host busy) that the 20% slowdown
    # reached z of only 1.0-1.6 and nobody was named. Reproduced with two busy loops beside the
    # run: 1 miss in 4 runs at batch 16, 0 in 4 at batch 64 (z 2.9-6.0, sigma 0.14-0.21).
    run = tmp_path / "run"
    run_cli("train", "--run-dir", str(run), f"--data.path={tiny_data}", *TINY,
            "--training.global_batch=64", "--training.steps=18", "--checkpoint.interval=0",
            "--nproc", "4", env={"MYRIA_FAULT": "slow:rank=3:factor=1.2"}, timeout=600)
    found = detect(load_run(run), window=SLOW_WINDOW, windows=WINDOWS)
    assert [s.rank for s in found] == [3], [(s.rank, s.windows) for s in found]
    s = found[0]
    assert s.detected_step <= 1 + K  # within K steps of the first measured step
    # The hook spins for 20% more than each span took. On 2 cores shared by 4 ranks, a busy host
    # makes the spinning rank lose more CPU than its peers, so it is slowed by more than 20%:
    # 0.20-0.70 per window with one or two busy loops beside it, past 1.0 on a host loaded far
    # beyond its cores.
    assert 0.10 <= s.slowdown < 2.0 and s.cost_s_per_step > 0
    assert all(w["slowdown"] >= 0.10 for w in s.windows)


# Four processes on two cores are not scheduled evenly: in a clean run one rank can compute up
# to ~20% longer than its peers for the whole run, a straggler in all but cause. A clean run is
# judged with a threshold above that noise floor, against a rank slowed 2x; the figures are in
# bench/RESULTS_detect.md ("A clean run's noise floor on this host").
CLEAN_THRESHOLD = 0.25


@pytest.mark.slow
def test_clean_and_slowed_runs(clean_dp, slow_dp):
    judge = {"window": WINDOW, "windows": WINDOWS, "threshold": CLEAN_THRESHOLD}
    assert detect(load_run(clean_dp), **judge) == []
    found = detect(load_run(slow_dp), **judge)
    assert [s.rank for s in found] == [2]
    # a supervisor judges only the steps timed since it started: the slowed run's steps, all
    # before the middle of the run, are not a new supervisor's straggler
    events = [e["t0"] for r in load_run(slow_dp).ranks.values() for e in r.events]
    middle = (min(events) + max(events)) / 2e6
    assert detect_dir(slow_dp, since=max(events) / 1e6 + 1, **judge) == []
    assert [s.rank for s in detect_dir(slow_dp, since=0.0, **judge)] == [2]
    assert all(s.first_step > 1 for s in detect_dir(slow_dp, since=middle, **judge))


def test_detections_are_json_lines(tmp_path):
    detections.record(tmp_path, "straggler", 3, "host-a", 12, {"slowdown": 0.2}, "warn")
    detections.record(tmp_path, "health", None, "host-a", 0, {"gemm": "ok"}, "none")
    (tmp_path / "events.jsonl").open("a").write('{"kind": "cut')  # a crash mid-line
    rows = detections.read(tmp_path)
    assert [r["kind"] for r in rows] == ["straggler", "health"]
    assert set(rows[0]) >= {"kind", "rank", "host", "step", "evidence", "action"}
    assert detections.read(tmp_path, "straggler")[0]["evidence"] == {"slowdown": 0.2}
    with pytest.raises(ValueError):
        detections.record(tmp_path, "gremlin", 0, "h", 0, {}, "none")
    json.dumps(rows)


def test_rebalancing_is_weighed_not_done():
    from myria.observe.straggler import rebalance

    r = rebalance(0.5, 8, 3)     # 8 x 1.5 = 12 before; moving 2: max(6 x 1.5, 8 + 1) = 9
    assert r["possible"] and r["move_microbatches"] == 2 and r["step_saving_fraction"] == 0.25
    assert "not bit for bit" in r["numbers"]
    assert not rebalance(0.5, 1, 3)["possible"]           # one microbatch: nothing to move
    assert not rebalance(0.1, 2, 1)["possible"]           # the peer would become the straggler


def test_tensor_parallel_partners_are_not_each_others_peers():
    """tp2 x pp2, rank 1 slowed: its tp partner waits for it inside tensor-parallel collectives
    the timer counts as compute, and so, one stage on, does one rank of the next pair for the
    other. Compared with each other, the innocent rank 2 was named; peers are data-parallel
    replicas, and here every rank has none and is judged against its own steady pace."""
    from types import SimpleNamespace

    coords = {0: {"pp": 0, "tp": 0}, 1: {"pp": 0, "tp": 1}, 2: {"pp": 1, "tp": 0},
              3: {"pp": 1, "tp": 1}}
    pace = {0: 0.20, 1: 0.20, 2: 0.145, 3: 0.10}   # rank 2 holds rank 3's wait for rank 1
    run = SimpleNamespace(ranks={r: SimpleNamespace(header={"coord": c, "host": "h"})
                                 for r, c in coords.items()})
    table = {r: {s: {"compute_s": pace[r] * (1 + 0.01 * ((s * (r + 3)) % 5))}
                 for s in range(1, 21)} for r in coords}
    assert detect(run, window=4, windows=2, table=table) == []
    # data-parallel replicas still are peers: a slow replica of the same (pp, tp) is named
    coords[4] = {"pp": 1, "tp": 0, "dp": 1}
    run.ranks[4] = SimpleNamespace(header={"coord": coords[4], "host": "h"})
    table[4] = {s: {"compute_s": 0.100 * (1 + 0.01 * (s % 3))} for s in range(1, 21)}
    assert [s.rank for s in detect(run, window=4, windows=2, table=table)] == [2]
