"""The heartbeat store protocol: what the workers write and the supervisor reads.

Both sides import this module: the sender (`myria.train.heartbeat`) and the reader
(`myria.resilience.supervisor`, whose `Watchdog` in `myria.resilience.watch` judges the records).

- Where: the supervisor serves a TCPStore on 127.0.0.1 (default) or uses a Redis server (MegaScale
  moved its heartbeats to Redis), and passes its address to the workers in the environment:

      MYRIA_HEARTBEAT       tcp://127.0.0.1:PORT or redis://HOST:PORT/DB
      MYRIA_HEARTBEAT_S     the period in seconds
      MYRIA_HEARTBEAT_JOB   the key namespace (one per supervised job)

- Key: `myria/<job>/hb/<rank>` (`key`), one per rank, overwritten by each heartbeat.
- Record: one JSON object (`encode`/`decode`): rank, host, pid, attempt, seq, time, step, phase,
  phase_s, progress, collective, in_collective, collectives, tokens_per_s, step_bytes,
  comm_bytes, mem_bytes, resumed_from, first_step_at (`myria.train.heartbeat.Progress.record`).
- Stores: `open_store(url)` gives a client with put / get_many / delete / close.
"""

from __future__ import annotations

import datetime
import json
from typing import Any
from urllib.parse import urlparse

from myria.errors import ConfigError

ENV_STORE = "MYRIA_HEARTBEAT"
ENV_PERIOD = "MYRIA_HEARTBEAT_S"
ENV_JOB = "MYRIA_HEARTBEAT_JOB"


# what a TCPStore client's error says when the server's process has gone
LOST_CONNECTION = ("Broken pipe", "Connection reset", "Connection refused")


def key(job: str, rank: int) -> str:
    """The store key of `rank`'s heartbeat in job `job`."""
    return f"myria/{job}/hb/{rank}"


# -- stores ----------------------------------------------------------------------------------
class HeartbeatStore:
    """The two operations heartbeats need from a key-value store."""

    def put(self, k: str, value: bytes) -> None:
        raise NotImplementedError

    def get_many(self, keys: list[str]) -> list[bytes | None]:
        raise NotImplementedError

    def delete(self, keys: list[str]) -> None:
        raise NotImplementedError

    def close(self) -> None:
        pass


class TCPHeartbeatStore(HeartbeatStore):
    """A torch.distributed TCPStore (client, or the server object itself)."""

    def __init__(self, store) -> None:
        self.store = store

    @classmethod
    def connect(cls, host: str, port: int, timeout_s: float) -> TCPHeartbeatStore:
        import torch.distributed as dist

        return cls(dist.TCPStore(host, port, is_master=False, wait_for_workers=False,
                                 timeout=datetime.timedelta(seconds=timeout_s)))

    def put(self, k: str, value: bytes) -> None:
        self.store.set(k, value)

    def get_many(self, keys: list[str]) -> list[bytes | None]:
        out: list[bytes | None] = []
        for k in keys:
            out.append(self.store.get(k) if self.store.check([k]) else None)
        return out

    def delete(self, keys: list[str]) -> None:
        for k in keys:
            self.store.delete_key(k)


class RedisHeartbeatStore(HeartbeatStore):
    """A Redis server (needs the `redis` package: pip install 'myria[redis]')."""

    def __init__(self, url: str, timeout_s: float, ttl_s: float | None = None) -> None:
        try:
            import redis
        except ImportError:
            raise ConfigError("resilience.store = 'redis' needs the redis package: "
                              "pip install 'myria[redis]'") from None
        self.client = redis.Redis.from_url(url, socket_timeout=timeout_s,
                                           socket_connect_timeout=timeout_s)
        self.ttl = max(1, int(ttl_s)) if ttl_s else None

    def put(self, k: str, value: bytes) -> None:
        self.client.set(k, value, ex=self.ttl)

    def get_many(self, keys: list[str]) -> list[bytes | None]:
        return list(self.client.mget(keys)) if keys else []

    def delete(self, keys: list[str]) -> None:
        if keys:
            self.client.delete(*keys)

    def close(self) -> None:
        self.client.close()


def open_store(url: str, timeout_s: float = 10.0, ttl_s: float | None = None) -> HeartbeatStore:
    """A client of the store at `url` (tcp://host:port or redis://host:port/db)."""
    u = urlparse(url)
    if u.scheme == "tcp":
        return TCPHeartbeatStore.connect(u.hostname or "127.0.0.1", int(u.port or 0), timeout_s)
    if u.scheme in ("redis", "rediss", "unix"):
        return RedisHeartbeatStore(url, timeout_s, ttl_s)
    raise ConfigError(f"heartbeat store {url!r}: expected tcp://HOST:PORT or redis://HOST:PORT")


def encode(record: dict[str, Any]) -> bytes:
    """A heartbeat record as stored."""
    return json.dumps(record).encode()


def decode(value: bytes | None) -> dict[str, Any] | None:
    """A stored heartbeat record (None for no record)."""
    return json.loads(value) if value else None
