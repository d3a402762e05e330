"""The fleet: which worker serves which model, as each worker announces it in Redis (workers/announce.py) and
the API reads it (webapi/fleet.py).

Each worker writes its announcement, a hash `genq:worker:<id>` (name, model, max_model_len, capacity, held,
heartbeat), every FLEET_HEARTBEAT_SECONDS with an expiry of three heartbeats, and scores its id in the sorted set
`genq:workers` with the time it expires. A reader takes the ids scored in the future and their hashes: a worker
that stopped (killed, its machine gone) drops out within three heartbeats, with nothing to clean up (a stale id
in the set is removed by the next reader).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import redis

LIVE_HEARTBEATS = 3  # a worker not heard from for this many heartbeats is gone


@dataclass(frozen=True, slots=True)
class Announcement:
    """What one worker serves, as of its last heartbeat."""

    worker: str  # the worker's id (host:pid:random)
    name: str  # the model's served name (MODEL_NAME, or MODEL)
    model: str  # MODEL: a Hugging Face id, a path, or tiny-llama
    max_model_len: int
    capacity: int  # jobs it holds at most
    held: int  # jobs it holds now
    heartbeat: float  # time.time() of the announcement

    def to_hash(self) -> dict[str, str]:
        return {key: str(value) for key, value in asdict(self).items()}

    @classmethod
    def from_hash(cls, fields: dict[bytes, bytes]) -> Announcement | None:
        """The announcement a hash holds, None if it is not one (written by another version, half expired)."""
        text = {key.decode(): value.decode() for key, value in fields.items()}
        try:
            return cls(
                worker=text["worker"],
                name=text["name"],
                model=text["model"],
                max_model_len=int(text["max_model_len"]),
                capacity=int(text["capacity"]),
                held=int(text["held"]),
                heartbeat=float(text["heartbeat"]),
            )
        except (KeyError, ValueError):
            return None


def workers_key(prefix: str) -> str:
    return f"{prefix}genq:workers"


def worker_key(prefix: str, worker: str) -> str:
    return f"{prefix}genq:worker:{worker}"


def announce(client: redis.Redis, prefix: str, announcement: Announcement, heartbeat_seconds: float) -> None:
    """Write `announcement`, live for LIVE_HEARTBEATS heartbeats (one MULTI)."""
    ttl = heartbeat_seconds * LIVE_HEARTBEATS
    key = worker_key(prefix, announcement.worker)
    with client.pipeline(transaction=True) as pipe:
        pipe.hset(key, mapping=announcement.to_hash())
        pipe.pexpire(key, max(1, int(ttl * 1000)))
        pipe.zadd(workers_key(prefix), {announcement.worker: announcement.heartbeat + ttl})
        pipe.execute()


def withdraw(client: redis.Redis, prefix: str, worker: str) -> None:
    """Remove a worker's announcement (it shuts down)."""
    with client.pipeline(transaction=True) as pipe:
        pipe.delete(worker_key(prefix, worker))
        pipe.zrem(workers_key(prefix), worker)
        pipe.execute()


def live_workers(client: redis.Redis, prefix: str) -> list[Announcement]:
    """Every live worker's announcement (two round trips), stale ids removed from the set."""
    now = time.time()
    with client.pipeline(transaction=False) as pipe:
        pipe.zremrangebyscore(workers_key(prefix), "-inf", now)
        pipe.zrangebyscore(workers_key(prefix), now, "+inf")
        _, ids = pipe.execute()
    if not ids:
        return []
    with client.pipeline(transaction=False) as pipe:
        for worker in ids:
            pipe.hgetall(worker_key(prefix, worker.decode()))
        found = pipe.execute()
    return [a for fields in found if fields and (a := Announcement.from_hash(fields)) is not None]
