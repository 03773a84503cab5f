"""The fault matrix's hooks (bench/fault_matrix.py) and its most fragile case under `myria
supervise`."""

from __future__ import annotations

from myria import faults


def test_a_fault_can_be_bound_to_a_restart_attempt(tmp_path, monkeypatch):
    """`attempt=A` fires only in the workers of the supervisor's attempt A (torch elastic's
    TORCHELASTIC_RESTART_COUNT): a second fault right after the first restart."""
    spec = "kill:rank=0:step=8:attempt=1,kill:rank=1:step=10"
    assert [f.params for f in faults.parse(spec)] == [
        {"rank": 0, "step": 8, "attempt": 1}, {"rank": 1, "step": 10}]
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    assert faults.FaultInjector(tmp_path, 0, spec).due("kill", 8) is None   # attempt 0
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    inj = faults.FaultInjector(tmp_path, 0, spec)
    f = inj.due("kill", 8)
    assert f is not None and f.tag == "kill_attempt1_rank0_step8"
    inj.mark(f)
    assert inj.due("kill", 8) is None
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    assert faults.FaultInjector(tmp_path, 1, spec).due("kill", 10) is not None  # any attempt
    # a slowed rank too: slowed in its attempt only
    slow = "slow:rank=0:factor=30:step=7:attempt=0"
    assert faults.FaultInjector(tmp_path, 0, slow).slow() is None            # attempt 2
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    assert faults.FaultInjector(tmp_path, 0, slow).slow() == (30.0, 7)
