"""The step's watchers: each watcher is called at its point of the step, in order, and an
exception inside the step skips the end-of-step hooks and leaves the step event open."""

from __future__ import annotations

import contextlib

import pytest

from myria.train.watchers import Judged, StepWatchers


class Log:
    """Every watcher at once: records each call as (object, method, args)."""

    def __init__(self):
        self.calls: list[tuple] = []
        self.step = 0

    def of(self, who: str, verdicts: dict | None = None):
        log, verdicts = self, verdicts or {}

        class Fake:
            def __getattr__(self, name):
                def call(*args):
                    log.calls.append((who, name, *args))
                    if name in ("phase", "span"):
                        return contextlib.nullcontext()
                    return verdicts.get(name)
                return call
        return Fake()


def watchers(log: Log, before=True, judge=True, gc_interval=0) -> StepWatchers:
    rec = log.of("rec", {"begin": "ev"})
    return StepWatchers(log.of("hb"), rec, log.of("faults"),
                        log.of("guard", {"before": before, "judge": judge}), log.of("ckpt"),
                        log.of("peers"), gc_interval)


def run_step(w: StepWatchers, step: int, fail: bool = False) -> bool:
    with w.step(step) as train:
        with w.phase("data"):
            pass
        judged = None
        if train:
            with w.backward():
                if fail:
                    raise RuntimeError("a lost peer")
            with w.phase("grad-clip"), w.span("loss_mean", "compute"):
                pass
            judged = Judged("local", 2.0, 1.0, "batch")
        with w.update(judged) as apply:
            return apply


def test_each_watcher_at_its_point_of_the_step():
    log = Log()
    assert run_step(watchers(log, gc_interval=4), 3) is True
    names = [c[:3] if c[1] in ("phase", "span") else c[:2] for c in log.calls]
    assert names == [
        ("rec", "begin"), ("hb", "phase", "step-start"), ("faults", "at_step_start"),
        ("guard", "before"), ("hb", "phase", "data"), ("hb", "phase", "forward-backward"),
        ("guard", "after_backward"), ("hb", "phase", "grad-clip"), ("rec", "span", "loss_mean"),
        ("guard", "judge"), ("hb", "phase", "snapshot-wait"), ("ckpt", "before_update"),
        ("hb", "phase", "optimizer"), ("rec", "span", "gc"), ("guard", "check_replicas"),
        ("hb", "phase", "peer-snapshot"), ("peers", "after_step"), ("rec", "end")]
    # the step numbers: hooks at the start count the steps done, those after it the step's own
    by = {c[:2]: c[2:] for c in log.calls}
    assert by[("faults", "at_step_start")] == (3,) and by[("guard", "before")] == (3,)
    assert by[("guard", "after_backward")] == (3,)
    assert by[("guard", "judge")] == (4, "local", 2.0, 1.0, "batch")
    assert by[("guard", "check_replicas")] == (4,) and by[("peers", "after_step")] == (4,)
    assert by[("rec", "end")] == ("ev",)


def test_a_skipped_batch_or_a_rejected_update_is_not_applied():
    log = Log()
    assert run_step(watchers(log, before=False), 0) is False   # rollback: the batch skipped
    assert ("guard", "judge") not in [c[:2] for c in log.calls]
    assert run_step(watchers(Log(), judge=False), 0) is False  # a numerical fault: skip


def test_an_exception_skips_the_end_of_step_and_leaves_the_event_open():
    log = Log()
    with pytest.raises(RuntimeError, match="lost peer"):
        run_step(watchers(log), 0, fail=True)
    done = [c[:2] for c in log.calls]
    assert done[-1] == ("hb", "phase") and log.calls[-1][2] == "forward-backward"
    for hook in (("guard", "after_backward"), ("guard", "check_replicas"),
                 ("peers", "after_step"), ("rec", "end")):
        assert hook not in done
