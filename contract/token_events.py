"""Token events: the live output of running jobs, from the workers to the API, through one Redis stream.

Each engine step of a worker is **one** `XADD` to the stream `<prefix>genq:events`: one entry whose fields
are the job ids (hex) that changed in that step and whose values are their deltas (contract.deltas.Delta,
encoded below). Status changes (a job claimed, handed back, its result stored, cancelled) are entries of
the same shape. The stream is trimmed by age (`MINID ~`, EVENTS_RETENTION_SECONDS), so Redis holds seconds
of events, never a job's history: Postgres stays the record, and a reader that misses events (joined late,
fell behind, Redis lost them) reads the job's row again and goes on from there (webapi/events.py).

Why one stream for all jobs rather than one per job (measured, bench/events_transport.py): a step of a
wide batch costs the worker one command and Redis one entry, instead of one command per job; the API reads
it with one blocking XREAD per process, whatever the number of callers, and takes out the fields of the
jobs it has callers for.

    worker: EventPublisher ──XADD per step (pipelined)──▶ <prefix>genq:events ──XREAD BLOCK──▶ API: Hub
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from collections.abc import Iterable
from typing import NamedTuple

import orjson
import redis

from contract.deltas import Delta

log = logging.getLogger(__name__)
STREAM = "genq:events"
# An entry holding this field says events were lost (a publisher dropped what it could not send while Redis
# was unreachable): every reader reads its jobs' rows again. With it, and the API's hub noticing when it
# fell behind the stream's retention, a reader needs no frequent rereads of its own.
LOST_FIELD = b"*"
LINGER = 0.05  # seconds a status change sent without a wake-up waits at most
_dumps = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode  # keeps -inf (a log probability)


class Status(NamedTuple):
    """A job's status changed (a JobStatus value); "succeeded" and "failed" come once the row holds the result."""

    status: str


def stream_key(prefix: str) -> str:
    return f"{prefix}{STREAM}"


def encode(event: Delta | Status) -> bytes:
    """One event's bytes: a JSON string (a status) or array (a delta). orjson (a tenth of json's time: every
    token of every job is encoded once); a delta carrying per-token fields (log probabilities, which can be
    -inf, which orjson would write as null) through json."""
    if isinstance(event, Status):
        return orjson.dumps(event.status)
    d = event
    if d.fields:
        return _dumps([d.start, d.token_ids, d.text_start, d.text, d.finish_reason, d.fields]).encode()
    return orjson.dumps((d.start, d.token_ids, d.text_start, d.text, d.finish_reason, None))


def decode(payload: bytes) -> Delta | Status:
    try:
        value = orjson.loads(payload)
    except orjson.JSONDecodeError:  # -Infinity in a delta's fields
        value = json.loads(payload)
    if isinstance(value, str):
        return Status(value)
    if len(value) == len(Delta._fields):  # every field: built in C (Delta(*value) runs Python, per token)
        return tuple.__new__(Delta, value)
    return Delta(*value)  # an older worker's event, without the last fields


class EventPublisher:
    """Sends a worker's token events and status changes to Redis from a thread of its own.

    Whatever was handed to it since its last send goes in one pipeline: one XADD per engine step (all its
    jobs) and one for the status changes. Sending never blocks the caller; if Redis is unreachable the
    events are dropped, it says so once per outage, and its first send after it starts with a LOST_FIELD
    entry (readers read the rows, Postgres holds the output)."""

    def __init__(self, client: redis.Redis, prefix: str, retention_seconds: float):
        self._client, self._key = client, stream_key(prefix)
        self._retention_ms = int(retention_seconds * 1000)
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._lingering: list[dict] = []  # status changes sent with the next entry
        self._failing = False
        self._thread = threading.Thread(target=self._run, name="event-publisher", daemon=True)

    def start(self) -> EventPublisher:
        self._thread.start()
        return self

    def step(self, deltas: Iterable[tuple[str, Delta]]) -> None:
        """One engine step's new output, by job id (hex)."""
        self._queue.put({key: encode(delta) for key, delta in deltas})

    def status(self, changes: Iterable[tuple[str, str]], *, wake: bool = True) -> None:
        """Jobs' status changes, by job id (hex). `wake=False`: they go with the next send (the next engine
        step, within `LINGER` seconds at most), sparing a thread hand-off per change (a claim)."""
        entry = {key: encode(Status(status)) for key, status in changes}
        if wake:
            self._queue.put(entry)
        else:
            with self._lock:
                self._lingering.append(entry)

    def close(self, timeout: float = 5.0) -> None:
        self._queue.put(None)
        self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            try:
                entries = [self._queue.get(timeout=LINGER)]
            except queue.Empty:
                entries = []
            with self._lock:
                entries[:0], self._lingering = self._lingering, []
            while True:
                try:
                    entries.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            stop = None in entries
            self._send([e for e in entries if e])
            if stop:
                return

    def _send(self, entries: list[dict]) -> None:
        if not entries:
            return
        minid = int(time.time() * 1000) - self._retention_ms
        if self._failing:  # what failed to go out is gone: readers learn it before what comes after
            entries = [{LOST_FIELD: b"lost"}, *entries]
        try:
            pipe = self._client.pipeline(transaction=False)
            for fields in entries:
                pipe.xadd(self._key, fields, minid=minid, approximate=True)
            pipe.execute()
        except redis.RedisError as exc:
            if not self._failing:
                log.warning(
                    "token events not sent, Redis unavailable (%s); readers fall back on Postgres", exc
                )
            self._failing = True
            return
        if self._failing:
            log.info("token events sent again")
        self._failing = False


def publish_status(client: redis.Redis, prefix: str, changes: Iterable[tuple[str, str]]) -> None:
    """Send status changes at once (the API: a cancel); Redis errors are the caller's."""
    client.xadd(stream_key(prefix), {key: encode(Status(status)) for key, status in changes})
