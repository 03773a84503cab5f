"""A damaged peer-memory snapshot held across hosts, on the emulated cluster: is it refused?

    .venv/bin/python bench/cluster_peer_damage.py [--out bench/results/cluster_peer_damage.json]

Needs root and Slurm's packages (`make cluster-packages`), like tests/cluster. The set-up is
`test_lost_host_taken_over_in_job`'s: `sbatch` of scripts/myria.sbatch on 3 emulated hosts (2
in the job, one spare), 2 processes each, in-job recovery, rank 0 slowed 30x from step 7 of the
first attempt (each of its steps from then on takes ~30x as long). One fault more:
`bitflip:rank=0:step=7:target=peer` flips, at the start of step 8, a bit of the newest copy rank
0 holds in memory for its ring neighbour on the other host (rank 2, step 7), after that copy's
CRC-32 was taken. A second later, in the slowed step 8, the host of ranks 2 and 3 is killed:
the spare takes them over and needs that copy. Expected: recovery refuses rank 2's step-7 copy
by its CRC-32 (RUN_DIR/peer/injob.json), restores every rank from the step-6 copies held too,
and the run ends bit-equal to the same 4 ranks on one host with no fault.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.cluster.test_cluster import (  # noqa: E402
    ARGS,
    HOLD,
    STEPS,
    _members,
    _out,
    _submit,
    _wait_step,
)
from tests.conftest import assert_bit_equal, run_cli  # noqa: E402

from myria import cluster  # noqa: E402

OUT = ROOT / "bench" / "results" / "cluster_peer_damage.json"
FLIP = "bitflip:rank=0:step=7:target=peer:attempt=0"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(OUT))
    args = ap.parse_args(argv)
    if why := cluster.missing():
        print(f"emulated cluster unavailable: {why}")
        return 2
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="myria-cluster-peer-") as d:
        d = Path(d)
        data = d / "tiny"
        run_cli("prepare", "--corpus", "demo", "--max-docs", "20", "--vocab-size", "1024",
                "--out", str(data), "--quiet")
        ref = d / "one-host"
        run_cli("supervise", "--run-dir", str(ref), "--nproc", "4", f"--data.path={data}",
                *ARGS, env={"OMP_NUM_THREADS": "1"}, timeout=600)
        run = d / "injob"
        try:
            cluster.up(3, quiet=True)
            job = _submit(run, data, 3, "--resilience.recovery=in-job", MYRIA_NNODES="2",
                          MYRIA_FAULT=f"{HOLD['MYRIA_FAULT']},{FLIP}")
            _wait_step(run, 7, checkpoint=False)
            time.sleep(1)   # rank 0 is in its slowed step 8: the flip has landed
            lost = _members(run)[1]
            cluster.kill_host(lost)
            state = cluster.wait_job(job, 600)
        finally:
            cluster.down(quiet=True)
        restored = json.loads((run / "peer" / "injob.json").read_text())
        summary = json.loads((run / "supervisor_summary.json").read_text())
        try:
            assert_bit_equal(run, ref, STEPS)
            equal = True
        except AssertionError as e:
            equal, why = False, str(e)
        row = {"slurm": state, "lost_host": lost, "status": summary.get("status"),
               "faults": [{k: f.get(k) for k in ("kind", "host", "recovery", "ranks",
                                                  "resumed_from")}
                          for f in summary.get("faults", [])],
               "restored": [{k: x.get(k) for k in ("step", "sources", "copy", "facts")}
                            for x in restored],
               "refused": any("refused, CRC-32: [7]" in x.get("facts", "") for x in restored),
               "bit_equal": equal, "wall_s": round(time.time() - t0, 1)}
        if not equal:
            row["why"] = why[-600:]
            row["job_output_tail"] = _out(run)[-2000:]
    Path(args.out).write_text(json.dumps({"command": " ".join(sys.argv),
                                          "date": time.strftime("%Y-%m-%d %H:%M"),
                                          "row": row}, indent=1))
    print(json.dumps(row, indent=1))
    used = [x.get("step") for x in row["restored"]]
    return 0 if row["refused"] and used == [6] and equal and state == "COMPLETED" else 1


if __name__ == "__main__":
    sys.exit(main())
