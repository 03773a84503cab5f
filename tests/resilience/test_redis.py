"""Heartbeats through a real redis-server (MegaScale's store); skipped when it is not installed.

CI installs it with `apt-get install -y redis-server` and `pip install 'myria[redis]'`.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time

import pytest

from myria.observe import heartbeat_store as store
from myria.train import heartbeat
from myria.train.launch import free_port
from tests.conftest import TINY, run_cli

redis = pytest.importorskip("redis", reason="pip install 'myria[redis]'")
pytestmark = pytest.mark.skipif(shutil.which("redis-server") is None,
                                reason="redis-server is not installed")


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory):
    port = free_port()
    d = tmp_path_factory.mktemp("redis")
    p = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1",
                          "--save", "", "--appendonly", "no", "--dir", str(d)],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"redis://127.0.0.1:{port}/0"
    client = redis.Redis.from_url(url)
    try:
        for _ in range(200):
            try:
                client.ping()
                break
            except redis.ConnectionError:
                time.sleep(0.05)
        else:
            pytest.fail("redis-server did not start")
        yield url
    finally:
        client.close()
        p.terminate()
        p.wait(timeout=10)


def test_heartbeats_through_redis(redis_url, monkeypatch):
    monkeypatch.setenv(store.ENV_STORE, redis_url)
    monkeypatch.setenv(store.ENV_PERIOD, "0.05")
    monkeypatch.setenv(store.ENV_JOB, "redis-unit")
    hb = heartbeat.start(rank=1)
    reader = store.open_store(redis_url)
    k = store.key("redis-unit", 1)
    try:
        hb.step_done(7, 10.0)
        for _ in range(200):
            v = reader.get_many([k])[0]
            if v and json.loads(v)["step"] == 7:
                break
            time.sleep(0.02)
        rec = json.loads(v)
        assert rec["rank"] == 1 and rec["step"] == 7
        assert reader.client.ttl(k) > 0  # stale heartbeats expire
        reader.delete([k])
        assert reader.get_many([k, store.key("redis-unit", 2)]) == [None, None]
    finally:
        hb.close()
        reader.close()


@pytest.mark.slow
def test_supervisor_detects_a_frozen_worker_through_redis(tmp_path, tiny_data, redis_url):
    run_cli("supervise", "--run-dir", str(tmp_path), "--nproc", "2",
            f"--data.path={tiny_data}", *TINY, "--training.steps=12",
            "--checkpoint.interval=4", "--resilience.store=redis",
            f"--resilience.redis_url={redis_url}", "--resilience.heartbeat_s=0.5",
            "--resilience.diagnose=false", "--resilience.backoff_s=0.2",
            env={"MYRIA_FAULT": "stop:rank=0:step=6"}, timeout=300)
    s = json.loads((tmp_path / "supervisor_summary.json").read_text())
    assert s["status"] == "succeeded" and s["final_step"] == 12 and s["store"] == "redis"
    assert s["faults"][0]["kind"] == "missed-heartbeats" and s["faults"][0]["ranks"] == [0]
    client = redis.Redis.from_url(redis_url)
    assert client.get(f"myria/{s['job']}/hb/0") is not None
    client.close()
