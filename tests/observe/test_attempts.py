"""A run directory whose ranks were restarted: each step is analysed as the newest attempt ran
it, and the work of an attempt a later one redid is drawn as such, never added to it."""

from __future__ import annotations

import json

import pytest

from myria.observe import analyze, report

MS = 1000   # µs


def _step(s: int, t: int, late: int = 0) -> list[dict]:
    """One step of 10 ms forward + one all-reduce; the rank issues it `late` µs after t."""
    return [{"n": "forward", "c": "compute", "s": s, "t0": t, "t1": t + 10 * MS + late, "th": 0},
            {"n": "all_reduce", "c": "comm", "s": s, "t0": t + 10 * MS + late,
             "t1": t + 12 * MS + 600 * MS, "th": 0,
             "a": {"dim": "dp", "group": [0, 1], "seq": 0, "bytes": 8}},
            {"n": "step", "c": "step", "s": s, "t0": t, "t1": t + 13 * MS + 600 * MS, "th": 0}]


def _write(run_dir, with_attempt: bool, second: int = 1) -> None:
    """Attempt 0 runs steps 1-2 (rank 1 late by 0.6 s in step 2) and dies inside step 3;
    attempt 1 resumes from step 1's checkpoint and runs steps 2-3 evenly, 30 s later (its
    header says attempt `second`: 0 when `myria train` was run again by hand). The
    collectives' sequence numbers start again at 0 in each attempt."""
    (run_dir / "events").mkdir(parents=True)
    for r in (0, 1):
        h = {"rank": r, "world": 2, "host": "h", "coord": {"dp": r}, "groups": {"dp": [0, 1]}}

        def header(n: int, h=h) -> dict:
            return {"header": dict(h, attempt=n) if with_attempt else h}
        lines: list[dict] = [header(0)]
        t = 1_000_000
        for s, seq in ((1, 0), (2, 1)):
            evs = _step(s, t + s * 700 * MS, late=600 * MS if (r == 1 and s == 2) else 0)
            evs[1]["a"]["seq"] = seq
            lines += evs
        lines.append({"n": "forward", "c": "compute", "s": 3, "t0": t + 2200 * MS,
                      "t1": t + 2210 * MS, "th": 0})
        lines.append(header(second))
        t += 30_000_000
        for s, seq in ((2, 0), (3, 1)):
            evs = _step(s, t + s * 700 * MS)
            evs[1]["a"]["seq"] = seq
            lines += evs
        (run_dir / "events" / f"rank{r:05d}.jsonl").write_text(
            "".join(json.dumps(x) + "\n" for x in lines))


@pytest.mark.parametrize("with_attempt,second", [(True, 1), (False, 1), (True, 0)],
                         ids=["attempt", "header-count", "rerun-by-hand"])
def test_a_step_run_again_is_read_as_its_last_attempt_ran_it(tmp_path, with_attempt, second):
    _write(tmp_path, with_attempt, second)
    run = analyze.load_run(tmp_path)
    assert run.steps == [1, 2, 3] and not run.problems
    table = analyze.step_table(run)
    for r in (0, 1):   # step 2 once, as attempt 1 ran it (not both attempts' spans added)
        assert table[r][2]["compute_s"] == pytest.approx(0.010)
        assert table[r][2]["step_s"] == pytest.approx(0.613)
        redone = run.ranks[r].redone
        assert {(e["s"], e["attempt"]) for e in redone} == {(2, 0), (3, 0)}
        assert all(e["s"] != 2 or e["t0"] > 30e6 for e in run.ranks[r].events)
    # each collective matched within its attempt: nobody waited 30 s, nor rank 1's old 0.6 s
    for inst in analyze.instances(run):
        assert max(inst.waited.values(), default=0) < 1 * MS, inst
    blame = analyze.blame_report(run, table)
    assert all(row["waited_s"] < 0.01 for row in blame["ranks"]), blame["ranks"]
    assert blame["standout_ranks"] == []
    # the timeline still shows the lost work, named as redone
    trace = report.chrome_trace(run)["traceEvents"]
    lost = [e for e in trace if e.get("name") == "step (redone)"]
    assert len(lost) == 2 and all(e["args"] == {"step": 2, "attempt": 0, "redone": True}
                                  for e in lost)


def _two_attempts(run_dir, second_attempt: int, second_steps) -> None:
    """Attempt 0 runs steps 1-6; a second start (its header says `second_attempt`: 0 when
    `myria train` was run again by hand) 30 s later, its set-up's collective first (numbered
    step 0, as the trainer's are), then `second_steps`."""
    (run_dir / "events").mkdir()
    for r in (0, 1):
        h = {"rank": r, "world": 2, "host": "h", "coord": {"dp": r}, "groups": {"dp": [0, 1]}}
        lines: list[dict] = [{"header": dict(h, attempt=0)}]
        t = 1_000_000
        for s in range(1, 7):
            lines += _step(s, t + s * 700 * MS)
        lines.append({"header": dict(h, attempt=second_attempt)})
        t += 30_000_000
        lines.append({"n": "barrier", "c": "comm", "s": 0, "t0": t, "t1": t + MS, "th": 0,
                      "a": {"dim": "dp", "group": [0, 1], "seq": 0}})
        for s in second_steps:
            lines += _step(s, t + s * 700 * MS)
        (run_dir / "events" / f"rank{r:05d}.jsonl").write_text(
            "".join(json.dumps(x) + "\n" for x in lines))


def test_a_start_from_an_earlier_step_rewinds_what_it_did_not_reach(tmp_path):
    """Attempt 0 ran steps 1-6; a start again at step 1 (a fresh start in the used run
    directory, or a rollback) stopped after step 2: steps 3-6 of attempt 0 are not the run's,
    though no later attempt ran them."""
    _two_attempts(tmp_path, 0, (1, 2))
    run = analyze.load_run(tmp_path)
    assert run.steps == [1, 2]
    assert {e["s"] for e in run.ranks[0].redone} == {1, 2, 3, 4, 5, 6}


def test_a_restart_from_a_checkpoint_keeps_the_steps_before_it(tmp_path):
    """Attempt 0 ran steps 1-6 and died; attempt 1 (its set-up's collectives at step 0)
    resumed from step 4 and ran 5-8: steps 1-4 are attempt 0's, 5-8 attempt 1's."""
    _two_attempts(tmp_path, 1, range(5, 9))
    run = analyze.load_run(tmp_path)
    assert run.steps == list(range(1, 9))
    kept = {(e["s"], e["t0"] > 30e6) for e in run.ranks[0].events if e["n"] == "step"}
    assert kept == {(s, s >= 5) for s in range(1, 9)}
    assert {e["s"] for e in run.ranks[0].redone} == {5, 6}
