"""A worker's announcement: what it serves (its model's served name, MODEL, max_model_len, capacity, the jobs it
holds), written to Redis every FLEET_HEARTBEAT_SECONDS by a thread of its own (contract/fleet.py), so the API
knows the fleet (webapi/fleet.py): which models are served, by which live workers. Withdrawn when the worker shuts
down; a worker killed drops out within three heartbeats."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import redis

from contract.fleet import Announcement, announce, withdraw
from contract.settings import WorkerSettings

log = logging.getLogger(__name__)


class Announcer:
    def __init__(
        self,
        client: redis.Redis,
        settings: WorkerSettings,
        worker_id: str,
        max_model_len: int,
        capacity: int,
        held: Callable[[], int],
    ):
        self._client, self._settings, self._held = client, settings, held
        self._worker, self._max_model_len, self._capacity = worker_id, max_model_len, capacity
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="announce", daemon=True)

    def start(self) -> Announcer:
        self.announce()  # known before the first heartbeat passes
        self._thread.start()
        return self

    def announce(self) -> None:
        settings = self._settings
        announcement = Announcement(
            worker=self._worker,
            name=settings.served_model_name(),
            model=settings.model,
            max_model_len=self._max_model_len,
            capacity=self._capacity,
            held=self._held(),
            heartbeat=time.time(),
        )
        try:
            announce(self._client, settings.redis_key_prefix, announcement, settings.fleet_heartbeat_seconds)
        except (
            redis.RedisError
        ) as exc:  # the next heartbeat tries again; the API keeps configured models served
            log.warning("announce: Redis unavailable (%s)", exc.__class__.__name__)

    def close(self) -> None:
        """Stop announcing and withdraw the announcement (the worker shuts down)."""
        self._stop.set()
        try:
            withdraw(self._client, self._settings.redis_key_prefix, self._worker)
        except redis.RedisError:
            pass  # it expires by itself

    def _run(self) -> None:
        while not self._stop.wait(self._settings.fleet_heartbeat_seconds):
            self.announce()
