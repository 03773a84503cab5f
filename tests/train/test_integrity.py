"""Silent data corruption and numerical faults: a flipped bit in one replica is found
within the check interval and its rank named; under `myria supervise` the job rolls back and ends
bit-equal to a fault-free run; an injected NaN is attributed to its rank and its update skipped
(or rolled back past)."""

from __future__ import annotations

import json

import pytest
import torch

from myria import detections, faults
from myria.train.integrity import LossTracker, bit_checksum, flip_bit
from tests.conftest import TINY, final_params, losses, run_cli

STEPS = 16
DDP4 = [*TINY, "--training.global_batch=16", f"--training.steps={STEPS}",
        "--training.data_parallel=ddp", "--checkpoint.interval=4", "--resilience.sdc_interval=3",
        "--resilience.diagnose=false", "--resilience.heartbeat_s=0.5",
        "--resilience.backoff_s=0.2"]


def test_checksum_sees_every_bit_and_nothing_else():
    t = torch.randn(1000)
    base = bit_checksum(t)
    assert bit_checksum(t.clone()) == base
    for bit in (0, 7, 22, 30):
        u = t.clone()
        flip_bit(u, bit)
        assert bit_checksum(u) != base and not torch.equal(u, t)
    assert bit_checksum(torch.zeros(3, dtype=torch.bfloat16)) == 0


def test_ledger_names_what_changed_at_rest():
    """Each rank's checksums of its parameters, optimizer state and gradients: a flipped bit in
    any of them is named; an optimizer update recorded afterwards is not a false alarm."""
    from types import SimpleNamespace

    from myria.train.sdc import StateLedger

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters())
    ledger = StateLedger(SimpleNamespace(parts=[model], optimizers=[opt]))
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    ledger.record_state()
    assert ledger.verify_state() == []
    flip_bit(opt.state[model[1].weight]["exp_avg"])
    assert ledger.verify_state() == ["optimizer 1.weight.exp_avg"]
    ledger.record_state()
    flip_bit(model[0].bias, bit=0)              # the lowest bit too
    assert ledger.verify_state() == ["param 0.bias"]
    opt.zero_grad()
    model(torch.randn(4, 8)).sum().backward()
    ledger.record_grads()
    flip_bit(model[1].bias.grad)
    assert ledger.verify_grads() == ["grad 1.bias"]
    opt.step()                                  # a legitimate write, then recorded
    ledger.record_state()
    assert ledger.verify_state() == []


def test_retest_tells_a_stuck_cell_from_a_transient_flip():
    """At rest, a changed tensor is rewritten (its complement, then its value) and read back: a
    flipped bit that a rewrite clears is transient, a cell stuck at its flipped value (the
    `sticky=yes` hook) is persistent; the tensor keeps the value it was found with."""
    from types import SimpleNamespace

    from myria.train.sdc import StateLedger, stick

    model = torch.nn.Linear(8, 4)
    ledger = StateLedger(SimpleNamespace(parts=[model], optimizers=[]))
    ledger.record_state()
    flip_bit(model.weight)
    found = model.weight.detach().clone()
    assert ledger.verify_state() == ["param weight"]
    assert ledger.retest(["param weight"]) == "transient"
    assert torch.equal(model.weight, found)
    ledger.record_state()
    ledger.stuck.append(stick(model.bias))
    assert ledger.verify_state() == ["param bias"]
    assert ledger.retest(["param bias"]).startswith("persistent (memory of param bias")
    assert ledger.retest(["param weight"]) == "transient"   # only the stuck tensor fails


def test_fault_hooks_parse():
    f = faults.parse("bitflip:rank=2:step=5,nan:rank=1:step=3")
    assert f[0].params == {"rank": 2, "step": 5, "target": "param"}
    assert faults.parse("bitflip:rank=0:step=1:target=grad")[0].params["target"] == "grad"
    assert faults.parse("bitflip:rank=0:step=1:target=optimizer")[0].params["target"] == \
        "optimizer"
    for bad in ("bitflip:step=3", "nan:rank=1", "bitflip:rank=1:step=2:target=weights"):
        with pytest.raises(ValueError):
            faults.parse(bad)


def test_loss_spike_tracker():
    lt = LossTracker(sigmas=6)
    for i in range(30):
        lt.update(5.0 - 0.01 * i + (0.02 if i % 2 else -0.02))
    assert not lt.is_spike(4.8) and lt.is_spike(9.0)
    assert not LossTracker(0).is_spike(1e9)


@pytest.fixture(scope="module")
def ddp4_reference(tmp_path_factory, tiny_data):
    d = tmp_path_factory.mktemp("ddp4ref")
    run_cli("train", "--run-dir", str(d), "--nproc", "4", f"--data.path={tiny_data}", *DDP4,
            timeout=600)
    return d


@pytest.mark.slow
def test_bitflip_in_a_replica_is_named_and_rolled_back_bit_equal(tmp_path, tiny_data,
                                                                  ddp4_reference):
    run = tmp_path / "run"
    run_cli("supervise", "--run-dir", str(run), "--nproc", "4", f"--data.path={tiny_data}",
            *DDP4, env={"MYRIA_FAULT": "bitflip:rank=2:step=5:target=param"}, timeout=600)
    sdc = detections.read(run, "sdc")
    assert len(sdc) == 1, sdc
    row = sdc[0]
    # Flipped at the start of step 6: the rank's own at-rest checksum sees it before the
    # forward, before the replica check (steps 3, 6, 9, ...) would.
    assert row["rank"] == 2 and row["step"] == 6 and row["action"] == "rollback", row
    assert row["evidence"]["check"] == "at rest" and row["evidence"]["ranks"] == [2], row
    assert row["evidence"]["tensors"][0].startswith("param "), row
    summary = json.loads((run / "supervisor_summary.json").read_text())
    assert summary["status"] == "succeeded" and summary["restarts"] == 1
    assert summary["faults"][0]["resumed_from"] == 4     # the newest checkpoint before it
    ref, got = losses(ddp4_reference), losses(run)
    assert [got[s] for s in range(1, STEPS + 1)] == [ref[s] for s in range(1, STEPS + 1)]
    pa, pb = final_params(ddp4_reference), final_params(run)
    assert all(torch.equal(pa[k], pb[k]) for k in pa)


# -- the default layout (FSDP, no replica), every target ----------------------------------------
FSDP2 = [*TINY, "--training.steps=8", "--checkpoint.interval=4", "--resilience.sdc_interval=3",
         "--resilience.diagnose=false", "--resilience.heartbeat_s=0.5",
         "--resilience.backoff_s=0.2", "--training.eval_interval=0"]


@pytest.fixture(scope="module")
def fsdp2_reference(tmp_path_factory, tiny_data):
    d = tmp_path_factory.mktemp("fsdp2ref")
    # with the checks off: a run with them on (and a fault caught) must end bit-equal to it
    run_cli("train", "--config", "configs/demo.toml", "--run-dir", str(d), "--nproc", "2",
            f"--data.path={tiny_data}", *FSDP2, "--resilience.sdc_interval=0", timeout=600)
    return d


@pytest.mark.slow
@pytest.mark.parametrize("target", ["param", "grad", "optimizer", "compute", "wgrad"])
def test_bitflip_on_fsdp_is_named_and_rolled_back_bit_equal(tmp_path, tiny_data,
                                                            fsdp2_reference, target):
    """The user's path: `myria supervise --config configs/demo.toml` (FSDP, the
    default) on 2 processes, one flipped bit on rank 1 in step 6 (a checked step)."""
    run = tmp_path / "run"
    run_cli("supervise", "--config", "configs/demo.toml", "--run-dir", str(run), "--nproc", "2",
            f"--data.path={tiny_data}", *FSDP2,
            env={"MYRIA_FAULT": f"bitflip:rank=1:step=5:target={target}"}, timeout=600)
    sdc = detections.read(run, "sdc")
    assert [(r["rank"], r["step"], r["action"]) for r in sdc] == [(1, 6, "rollback")], sdc
    ev = sdc[0]["evidence"]
    if target in ("compute", "wgrad"):   # rank 0 recomputed rank 1's microbatch; rank 1's
        # replay agreed. The second check (step 6) recomputes block 1's weight gradients: a
        # wrong forward changes every pass, a wrong weight-gradient GEMM only its own
        assert ev["check"] == "compute" and ev["verdict"] == "transient", ev
        assert ev["microbatch_of"] == 1 and ev["recomputed_by"] == 0, ev
        assert ev["differs"] == {"compute": ["forward", "backward", "weight gradients (block 1)"],
                                 "wgrad": ["weight gradients (block 1)"]}[target], ev
        assert ev["checksums"]["replay"] == ev["checksums"]["partner"] != ev["checksums"]["own"]
    else:
        word = {"optimizer": "optimizer", "grad": "grad", "param": "param"}[target]
        assert ev["check"] == "at rest" and ev["tensors"][0].startswith(word + " "), ev
        assert ev["verdict"] == "transient", ev
    summary = json.loads((run / "supervisor_summary.json").read_text())
    assert summary["status"] == "succeeded" and summary["faults"][0]["resumed_from"] == 4
    # the supervisor reads the workers' verdict: a transient fault does not blocklist the host
    fault = summary["faults"][0]
    assert fault["kind"] == "sdc" and fault["ranks"] == [1], fault
    assert fault["sdc"]["step"] == 6 and fault["sdc"]["verdict"] == "transient", fault
    assert not fault["sdc"]["persistent"] and summary["blocklist"] == [], summary
    pa, pb = final_params(fsdp2_reference), final_params(run)
    assert all(torch.equal(pa[k], pb[k]) for k in pa)


@pytest.mark.slow
def test_persistent_sdc_blocklists_the_host_and_the_run_goes_on(tmp_path, tiny_data,
                                                                 fsdp2_reference):
    """A stuck memory cell on rank 1 (`sticky=yes`: the flipped bit survives a rewrite) under
    `myria supervise --config configs/demo.toml` on 2 processes: the at-rest check names rank 1,
    its retest calls it persistent, the supervisor files the fault as sdc, blocklists the host
    (one host: kept, no spare), the restart resumes from the newest verified checkpoint and the
    run ends bit-equal to a clean one; the report shows the verdict."""
    from myria.observe.report_sections import recovery_section

    run = tmp_path / "run"
    run_cli("supervise", "--config", "configs/demo.toml", "--run-dir", str(run), "--nproc", "2",
            f"--data.path={tiny_data}", *FSDP2,
            env={"MYRIA_FAULT": "bitflip:rank=1:step=5:target=param:sticky=yes"}, timeout=600)
    sdc = detections.read(run, "sdc")
    assert [(r["rank"], r["step"]) for r in sdc] == [(1, 6)], sdc
    assert sdc[0]["evidence"]["verdict"].startswith("persistent"), sdc
    summary = json.loads((run / "supervisor_summary.json").read_text())
    fault = summary["faults"][0]
    assert fault["kind"] == "sdc" and fault["ranks"] == [1] and fault["sdc"]["persistent"]
    assert fault["sdc"]["check"] == "at rest" and "persistent" in fault["cause"], fault
    host = sdc[0]["host"]
    assert summary["blocklist"] == [host] and f"blocklist {host}" in fault["action"], summary
    assert (run / "blocklist.txt").read_text().split() == [host]
    assert summary["status"] == "succeeded" and fault["resumed_from"] == 4, summary
    pa, pb = final_params(fsdp2_reference), final_params(run)
    assert all(torch.equal(pa[k], pb[k]) for k in pa)
    (run / "report").mkdir()
    page = recovery_section(run, run / "report")
    assert "sdc (at rest check at step 6: persistent" in page and "host blocklisted" in page


@pytest.mark.slow
def test_compute_check_under_a_pipeline_names_the_stage_rank(tmp_path, tiny_data):
    """PP2 x DP2: a wrong GEMM result on rank 3 (stage 1) in step 6 is found by its DP partner
    of the same stage, which recomputes the stage's forward and backward from the stage input
    and output gradient rank 3 kept; the verdict is transient and the run rolls back."""
    run = tmp_path / "run"
    run_cli("supervise", "--run-dir", str(run), "--nproc", "4", f"--data.path={tiny_data}",
            *FSDP2, "--training.global_batch=16", "--parallel.pp=2",
            env={"MYRIA_FAULT": "bitflip:rank=3:step=5:target=compute"}, timeout=600)
    sdc = detections.read(run, "sdc")
    assert [(r["rank"], r["step"]) for r in sdc] == [(3, 6)], sdc
    ev = sdc[0]["evidence"]
    assert ev["check"] == "compute" and ev["verdict"] == "transient", ev
    assert ev["group"] == [2, 3] and ev["recomputed_by"] == 2, ev
    assert ev["differs"] == ["stage 1 forward", "stage 1 backward",
                             "stage 1 weight gradients (block 1)"], ev
    summary = json.loads((run / "supervisor_summary.json").read_text())
    assert summary["status"] == "succeeded" and summary["faults"][0]["resumed_from"] == 4


@pytest.mark.slow
def test_nan_is_attributed_and_its_update_skipped(tmp_path, tiny_data):
    run = tmp_path / "run"
    run_cli("train", "--run-dir", str(run), "--nproc", "2", f"--data.path={tiny_data}", *TINY,
            "--training.steps=8", "--checkpoint.interval=1", "--checkpoint.keep=10",
            env={"MYRIA_FAULT": "nan:rank=1:step=5"}, timeout=600)
    rows = detections.read(run, "nonfinite")
    assert len(rows) == 1 and rows[0]["rank"] == 1 and rows[0]["step"] == 6, rows
    assert rows[0]["evidence"]["ranks_with_nonfinite_loss"] == [1]
    assert rows[0]["evidence"]["replay"]["ranks"] == {"1": "transient"}   # it did not repeat
    assert rows[0]["action"] == "skip"
    metrics = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    skipped = [r["step"] for r in metrics if r.get("skipped")]
    assert skipped == [6]
    # No update at step 6: the parameters of steps 5 and 6 are identical.
    from myria.train.export import load_checkpoint_model

    def params(step):
        return dict(load_checkpoint_model(run, step)[0].state_dict())

    s5, s6, s7 = params(5), params(6), params(7)
    assert s5.keys() == s6.keys() and all(torch.equal(s5[k], s6[k]) for k in s5)
    assert any(not torch.equal(s6[k], s7[k]) for k in s6)      # training went on
    assert all(r["loss"] == r["loss"] for r in metrics if r["step"] != 6)   # finite elsewhere


@pytest.mark.slow
def test_nan_rollback_skips_the_batch(tmp_path, tiny_data):
    run = tmp_path / "run"
    run_cli("supervise", "--run-dir", str(run), "--nproc", "2", f"--data.path={tiny_data}",
            *TINY, "--training.steps=8", "--checkpoint.interval=2",
            "--resilience.numerical_action=rollback", "--resilience.diagnose=false",
            "--resilience.backoff_s=0.2", env={"MYRIA_FAULT": "nan:rank=0:step=4"}, timeout=600)
    rows = detections.read(run, "nonfinite")
    assert [(r["rank"], r["step"], r["action"]) for r in rows] == [(0, 5, "rollback")]
    assert json.loads((run / "skip_steps.json").read_text()) == [5]
    summary = json.loads((run / "supervisor_summary.json").read_text())
    assert summary["status"] == "succeeded" and summary["faults"][0]["resumed_from"] == 4
    metrics = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in metrics if r.get("skipped")] == [5]


@pytest.mark.slow
def test_replay_tells_a_persistent_fault_from_a_transient_one(tmp_path, tiny_data):
    """A device that keeps computing NaN (sticky hook on rank 1) is `persistent`: its replay
    fails again while rank 0 computes the same microbatch finitely; with `stop` the job ends
    (exit 2, not restarted) after one detection."""
    run = tmp_path / "run"
    p = run_cli("train", "--run-dir", str(run), "--nproc", "2", f"--data.path={tiny_data}",
                *TINY, "--training.steps=6", "--checkpoint.interval=0",
                "--resilience.numerical_action=stop",
                env={"MYRIA_FAULT": "nan:rank=1:step=2:sticky=yes"}, check=False, timeout=600)
    assert p.returncode != 0
    rows = detections.read(run, "nonfinite")
    assert len(rows) == 1 and rows[0]["rank"] == 1 and rows[0]["action"] == "stop"
    assert rows[0]["evidence"]["replay"]["ranks"] == {"1": "persistent"}
    assert rows[0]["evidence"]["replay"]["replayed_on"] == {"1": 0}


@pytest.mark.slow
def test_flip_while_the_checkpoint_is_copied_is_never_committed(tmp_path, tiny_data,
                                                               fsdp2_reference):
    """The default overlapped snapshot of checkpoint 4 is copied during step 5, after a bit of
    rank 1's state flipped at that step's start (the copy is made to come after the flip: see
    CheckpointManager._flip_due): the copy does not hold what the optimizer wrote, so the
    save is not committed, and the rollback goes to checkpoint 2, not to the corrupted 4."""
    run = tmp_path / "run"
    run_cli("supervise", "--config", "configs/demo.toml", "--run-dir", str(run), "--nproc", "2",
            f"--data.path={tiny_data}", *FSDP2, "--checkpoint.interval=2",
            env={"MYRIA_FAULT": "bitflip:rank=1:step=4:target=param"}, timeout=600)
    sdc = detections.read(run, "sdc")
    assert [(r["rank"], r["step"]) for r in sdc] == [(1, 5)], sdc
    q = [p for p in (run / "checkpoints" / "quarantine").iterdir() if p.is_dir()]
    assert [p.name.split(".")[0] for p in q] == ["step_00000004"], q
    why = json.loads((q[0] / "QUARANTINED.json").read_text())["reason"]
    assert "differs from the state the optimizer wrote" in why, why
    summary = json.loads((run / "supervisor_summary.json").read_text())
    assert summary["status"] == "succeeded" and summary["faults"][0]["resumed_from"] == 2
    ref, got = losses(fsdp2_reference), losses(run)
    assert [got[s] for s in range(1, 9)] == [ref[s] for s in range(1, 9)]
    pa, pb = final_params(fsdp2_reference), final_params(run)
    assert all(torch.equal(pa[k], pb[k]) for k in pa)


@pytest.mark.slow
def test_a_compute_fault_between_two_checks_is_said_to_be_undetected(tmp_path, tiny_data):
    """The compute check is sampled (one microbatch every sdc_interval = 3 steps): a wrong GEMM
    result in step 4 is not recomputed and is trained in. The run succeeds, and the supervisor
    says that the hook fired and that nothing detected it."""
    run = tmp_path / "run"
    run_cli("supervise", "--config", "configs/demo.toml", "--run-dir", str(run), "--nproc", "2",
            f"--data.path={tiny_data}", *FSDP2, "--training.steps=5",
            env={"MYRIA_FAULT": "bitflip:rank=1:step=3:target=compute"}, timeout=600)
    assert detections.read(run, "sdc") == []
    summary = json.loads((run / "supervisor_summary.json").read_text())
    assert summary["status"] == "succeeded" and summary["faults"] == [], summary
    assert summary["undetected_hooks"] == ["bitflip_rank1_step3_targetcompute"], summary
    log = (run / "supervisor.log").read_text()
    assert "fault hook bitflip_rank1_step3_targetcompute fired (MYRIA_FAULT) and no check " \
        "detected it: its effect, if any, was trained in (the compute check recomputes one " \
        "microbatch every resilience.sdc_interval steps" in log, log[-2000:]


@pytest.mark.slow
def test_sticky_compute_fault_on_two_ranks_is_named_by_the_known_answer_probe(tmp_path,
                                                                               tiny_data):
    """A GEMM that keeps computing wrongly on rank 1 of 2 (`sticky=yes`, from step 4 on): the
    check of step 6 finds both microbatches differ and each rank reproduces its own answer, so
    replays cannot decide; the probe recorded at the agreed check of step 3 still gives rank 0
    its answer and no longer rank 1, which is named, persistent, in both mismatches."""
    run = tmp_path / "run"
    run_cli("train", "--config", "configs/demo.toml", "--run-dir", str(run), "--nproc", "2",
            f"--data.path={tiny_data}", *FSDP2, "--training.steps=6",
            "--checkpoint.interval=0", "--resilience.sdc_action=warn",
            env={"MYRIA_FAULT": "bitflip:rank=1:step=3:target=compute:sticky=yes"}, timeout=600)
    sdc = detections.read(run, "sdc")
    assert sorted((r["evidence"]["microbatch_of"], r["rank"], r["step"]) for r in sdc) == \
        [(0, 1, 6), (1, 1, 6)], sdc
    for r in sdc:
        ev = r["evidence"]
        assert ev["check"] == "compute" and ev["verdict"].startswith("persistent (its known"), ev
        assert ev["probe"] == {"0": "equals its record", "1": "differs from its record"}, ev
        assert "suspects" not in ev, ev


@pytest.mark.slow
def test_a_tensor_parallel_fault_seen_through_a_peer_still_marks_checkpoints_suspect(
        tmp_path, tiny_data):
    """TP2 x DP2, a GEMM that keeps computing wrongly on rank 3 from step 4 on: its group
    {1, 3} names rank 3 persistent; the group {0, 2} sees the fault only through the
    tensor-parallel reduction (affected, no verdict of its own). Rank 0 must still judge the
    fault persistent and mark the checkpoints copied since the clean check of step 3 suspect."""
    run = tmp_path / "run"
    p = run_cli("train", "--run-dir", str(run), "--nproc", "4", f"--data.path={tiny_data}",
                *FSDP2, "--training.global_batch=16", "--parallel.tp=2", "--training.steps=6",
                "--checkpoint.interval=0",
                env={"MYRIA_FAULT": "bitflip:rank=3:step=3:target=compute:sticky=yes"},
                check=False, timeout=600)
    assert p.returncode != 0
    sdc = detections.read(run, "sdc")
    assert sorted((r["rank"], r["evidence"]["group"][0]) for r in sdc) == [(3, 1), (3, 1)], sdc
    mark = json.loads((run / "checkpoints" / "suspect.json").read_text())
    assert (mark["after"], mark["found_at"]) == (3, 6), mark


def test_checksums_on_a_device_equal_the_host_ones():
    """Every way `sums` takes (numpy for host tensors; on a device, small tensors summed
    together per width and larger ones alone, run here on host tensors through the device
    path) gives each tensor's wrapping integer sum of its bits, wrapping included."""
    import numpy as np

    from myria.train.checksums import SMALL, _device_sum, _gathered, one_sum, sums

    g = torch.Generator().manual_seed(0)
    tensors = [torch.randn(999, generator=g), torch.randn(77, generator=g).to(torch.bfloat16),
               torch.randn(5, generator=g).double(), torch.tensor(7.0),
               torch.full((SMALL + 10,), 2**30, dtype=torch.int32),     # large, wraps
               torch.full((3001,), 2**29, dtype=torch.int32),           # small, wraps
               torch.full((5000,), -(2**14), dtype=torch.int16),        # wraps below
               torch.randn(SMALL + 1, generator=g).half(), torch.zeros(0),
               torch.randint(-128, 127, (64,), dtype=torch.int8), torch.randn(3, 100_000)]
    widths = {8: (torch.int64, np.int64), 4: (torch.int32, np.int32),
              2: (torch.int16, np.int32), 1: (torch.int8, np.int32)}

    def alone(t):   # the definition: numpy's wrapping sum of the tensor's bits
        width, acc = widths[t.element_size()]
        return int(t.reshape(-1).view(width).numpy().sum(dtype=acc))

    want = [alone(t) for t in tensors]
    assert sums(tensors).tolist() == want
    assert all(-(2**31) <= w < 2**31 for w, t in zip(want, tensors) if t.element_size() < 8)
    n = len(tensors)
    for host in ([], [3], [0, 3, 5, 9], list(range(0, n, 2)), list(range(n))):
        assert _gathered(tensors, host, torch.device("cpu")).tolist() == want, host
    assert sums([]).tolist() == []
    # one tensor alone (the gradient hooks' path), on the host and through the device's
    assert [int(one_sum(t)) for t in tensors] == want
    assert [int(_device_sum(t)) for t in tensors] == want


def test_checksums_replay_a_graph_only_after_it_agreed():
    """On a device `sums` replays one CUDA graph of its operations for a list of tensors seen
    before (same addresses, dtypes, shapes). Here a stand-in graph reruns the captured
    operations into its output, as a replay rewrites its buffer: a list is captured the second
    time, the graph is trusted after its first replay equalled the direct sums, it reads the
    tensors as they are at each replay, one replay does not rewrite an earlier result, and a
    graph whose replay differs turns graphs off for the process, with one warning."""
    import warnings

    from myria.train.checksums import SMALL, _gathered, _Replays, sums

    captured = []

    def capture(fn, device, wrong=False):
        out = fn()

        class Graph:
            def replay(self):
                out.copy_(torch.zeros_like(out) if wrong else fn())

        captured.append(device)
        return Graph(), out

    cpu = torch.device("cpu")
    ts = [torch.randn(SMALL + 5), torch.randn(10).to(torch.bfloat16), torch.tensor(3.0)]
    want = sums(ts).tolist()
    replays = _Replays(capture, least=1)
    assert _gathered(ts, [2], cpu, replays).tolist() == want and captured == []
    second = _gathered(ts, [2], cpu, replays)
    (entry,) = replays.entries.values()
    assert second.tolist() == want and captured == [cpu] and entry.trusted
    flip_bit(ts[0])
    third = _gathered(ts, [2], cpu, replays)
    assert third.tolist() == sums(ts).tolist() != want and second.tolist() == want
    assert len(captured) == 1                                   # replayed, not captured again
    other = [torch.randn(7)]
    for _ in range(2):
        assert _gathered(other, [], cpu, replays).tolist() == sums(other).tolist()
    assert len(replays.entries) == 2 and len(captured) == 2

    bad = _Replays(lambda fn, device: capture(fn, device, wrong=True), least=1)
    assert _gathered(ts, [], cpu, bad).tolist() == sums(ts).tolist()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert _gathered(ts, [], cpu, bad).tolist() == sums(ts).tolist()
    assert bad.disabled and not bad.entries and len(caught) == 1
    assert _gathered(ts, [], cpu, bad).tolist() == sums(ts).tolist()
    none = _Replays(lambda fn, device: None, least=1)
    for _ in range(3):
        assert _gathered(ts, [], cpu, none).tolist() == sums(ts).tolist()
    assert not none.disabled and list(none.entries.values())[0].graph is False
    few = _Replays(capture)   # fewer device tensors than `least`: never kept, never captured
    for _ in range(3):
        assert _gathered(ts, [2], cpu, few).tolist() == sums(ts).tolist()
    assert not few.entries and len(captured) == 3
