"""A spare host's takeover as the survivors' supervisors see it, on an in-memory store."""

from __future__ import annotations

import json
from types import SimpleNamespace

from myria.resilience import takeover
from myria.train.rejoin import key

JOB = "job-1"


class Store:
    """The part of torch's c10d store the takeover uses; `on_set` runs after each set."""

    def __init__(self) -> None:
        self.kv: dict[str, bytes] = {}
        self.on_set = lambda k: None

    def set(self, k, v):
        self.kv[k] = v.encode() if isinstance(v, str) else v
        self.on_set(k)

    def get(self, k):
        return self.kv[k]

    def check(self, keys):
        return all(k in self.kv for k in keys)

    def add(self, k, n):
        v = int(self.kv.get(k, b"0")) + n
        self.kv[k] = str(v).encode()
        return v


def test_a_survivor_that_sees_the_new_attempt_knows_the_host_it_replaces(tmp_path):
    """The survivor's supervisor reads the announced attempt and the takeover record once: a
    record written after the announcement (while the replacements start) would leave it not
    knowing the host was lost, and its agent would restart the round for the waiting spare."""
    store = Store()
    store.set(key(JOB, "members"), json.dumps(["h0", "h1"]))
    store.set(key(JOB, "hosts/h1"), json.dumps({"attempt": 0, "ranks": [2, 3]}))
    survivor = SimpleNamespace(job=JOB, attempt=0, announced_base=0, members=["h0", "h1"],
                               ranks=[0, 1], lost_hosts=set(), shared_store=lambda: store,
                               new_watch=lambda: None)
    agent = SimpleNamespace(_remaining_restarts=10)

    def survivor_looks(k):   # the survivor's supervisor follows at every store write
        if k == key(JOB, "attempt"):
            takeover.follow(survivor, agent)

    store.on_set = survivor_looks
    spare = SimpleNamespace(
        job=JOB, host="h2", run_dir=tmp_path, faults=[], worker_argv=[], reached=lambda f: None,
        new_watch=lambda: None, _server=Store(),
        injob=SimpleNamespace(_take_spare=lambda: (0, SimpleNamespace(pid=4242))),
        r=SimpleNamespace(heartbeat_s=1.0, missed_heartbeats=3), _endpoint="10.9.9.9:1")
    watch = takeover.Watch(spare)
    watch._take_over(store, "h1", {"ranks": [2, 3], "envs": [{"RANK": "2"}, {"RANK": "3"}]},
                     silent_at=0.0)
    assert survivor.attempt == 1 and survivor.lost_hosts == {"h1"}
    assert agent._remaining_restarts == 9
    assert spare.attempt == 1 and spare.ranks == [2, 3]
    rec = json.loads(store.get(key(JOB, "takeover/h1")))
    assert rec["by"] == "h2" and rec["started_at"] >= rec["announced_at"] >= rec["detected_at"]
