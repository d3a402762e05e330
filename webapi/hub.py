"""The token events of the jobs this API process follows: one reader of the Redis stream for all its callers.

One `Hub` per API process reads the events stream (contract/token_events.py) with one blocking XREAD at a
time, while at least one caller follows a job, and puts each followed job's events in its followers' inboxes:
a follower (webapi/following.py) costs an inbox, not a thread, a connection or a read of its own (under
gunicorn's gevent workers it is a greenlet waiting on its inbox).

A follower takes every event queued for it at once (Inbox), so one that fell behind sends the steps it missed
together. Under the gevent worker a waiting follower may set its GreenInbox's `direct`: the hub's put hands
it the event first, and the follower is woken only when `direct` did not take it (webapi/following.py).

When the hub cannot vouch for what it read (Redis went away, a publisher announced lost events, the hub fell
behind the stream's retention), it puts LOST in every inbox: each follower reads its job's row again.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque

import redis

from contract.redis_client import redis_client
from contract.token_events import LOST_FIELD, decode, publish_status, stream_key

try:  # gunicorn's gevent workers (the api extra); importing it patches nothing
    from gevent import get_hub as gevent_hub
    from gevent import monkey as gevent_monkey
    from gevent.hub import Waiter as GeventWaiter
except ImportError:
    gevent_monkey = None

log = logging.getLogger(__name__)
LOST = object()  # put in every inbox when the hub may have missed events: its followers read their rows


class Inbox:
    """A follower's queue of events: the hub appends, the follower takes everything queued at once.

    Taking all of it at once is what lets a follower that fell behind (thousands of streams, each woken
    once per engine step) send the steps it missed as one chunk: one wake-up and one write, not one per
    step (vLLM's output collector merges a slow consumer's deltas the same way). Cheaper than a
    queue.Queue per event: no lock and no timer when events are already there."""

    __slots__ = ("_items", "_ready")

    def __init__(self):
        self._items: deque = deque()
        self._ready = threading.Event()

    def put(self, item) -> None:
        self._items.append(item)
        self._ready.set()

    def take(self, timeout: float) -> list:
        """Everything queued, in order; waits up to `timeout` seconds for the first ([] when none came)."""
        items = self._items
        if not items:
            deadline = time.monotonic() + timeout
            while not items:
                left = deadline - time.monotonic()
                if left <= 0 or not self._ready.wait(left):
                    return []
                self._ready.clear()
        self._ready.clear()
        return self._drain()

    def _drain(self) -> list:
        """What is queued now, taken out; a put meanwhile stays for the next take."""
        items = self._items
        taken = list(items)
        for _ in range(len(taken)):
            items.popleft()
        return taken


class GreenInbox(Inbox):
    """An Inbox for a follower that is a greenlet (gunicorn's gevent workers): it sleeps in gevent's hub on a
    Waiter, with one timer kept for its wait (restarted, not made anew). A streamed token wakes a follower
    once; threading.Event.wait(timeout) under gevent builds a Timeout and a timer watcher for each wait,
    a third of what a chunk costs a gevent server (bench/job_cpu.py, issue 25)."""

    __slots__ = ("_waiter", "_loop", "_timer", "_period", "direct")

    def __init__(self):
        self._items = deque()
        self._waiter = None  # the Waiter of a take() under way
        self._loop = gevent_hub().loop
        self._timer = None
        self._period = 0.0
        # set by a follower while it waits: direct(item) -> True when it handled the item without waking it
        self.direct = None

    def put(self, item) -> None:
        waiter = self._waiter
        if waiter is None:
            self._items.append(item)
            return
        direct = self.direct  # the follower waits, so nothing is queued: the item may be handled at once
        if direct is not None:
            try:
                if direct(item):
                    return
            except Exception:  # never the hub's end: the follower gets the event the usual way
                log.exception("a direct write failed; the stream's own greenlet writes the event")
        self._items.append(item)
        self._waiter = None
        self._loop.run_callback(waiter.switch, True)  # a Waiter is switched from gevent's hub

    def take(self, timeout: float) -> list:
        items = self._items
        if not items and timeout > 0:
            if self._timer is None or self._period != timeout:
                if self._timer is not None:
                    self._timer.close()
                self._timer, self._period = self._loop.timer(timeout, timeout), timeout
            waiter = self._waiter = GeventWaiter()
            self._timer.again(waiter.switch, False)
            try:
                waiter.get()  # until put() or the timer; a late switch only lands in this spent Waiter
            finally:
                self._timer.stop()
                self._waiter = None
        return self._drain()


def default_inbox_type() -> type[Inbox]:
    """GreenInbox where gevent has patched threading (followers are greenlets), else Inbox."""
    return GreenInbox if gevent_monkey is not None and gevent_monkey.is_module_patched("threading") else Inbox


class Hub:
    """Reads the token events of one API process's followed jobs, one blocking XREAD at a time."""

    def __init__(
        self,
        redis_url: str,
        prefix: str,
        idle_seconds: float = 30.0,
        retention_seconds: float = 60.0,
        inbox_type: type[Inbox] | None = None,
    ):
        self._client = redis_client(redis_url, timeout=10, connect_timeout=2)
        self._prefix, self._key = prefix, stream_key(prefix)
        self._idle_seconds = idle_seconds
        # a read this long after the one before may have missed entries trimmed meanwhile (EVENTS_RETENTION)
        self._stall_seconds = retention_seconds / 2
        self._lock = threading.Lock()
        self._followers: dict[str, set[Inbox]] = {}
        self._last_id: bytes | None = None  # where the reader is in the stream; None: not reading
        self._reading = False
        self._positioned = threading.Event()
        self._inbox_type = inbox_type or default_inbox_type()  # what the followers wait on

    def subscribe(self, key: str) -> Inbox:
        """An inbox that gets job `key`'s events from now on (its position in the stream is fixed on return)."""
        inbox = self._inbox_type()
        with self._lock:
            self._followers.setdefault(key.encode(), set()).add(inbox)
            start = not self._reading
            if start:
                self._reading = True
                self._positioned = threading.Event()
            positioned = self._positioned
        if start:
            try:
                last = self._client.xrevrange(self._key, count=1)
                self._last_id = last[0][0] if last else b"0-0"
            except redis.RedisError as exc:
                log.warning("token events unavailable (%s): followers read Postgres", exc.__class__.__name__)
                self._last_id = None
            positioned.set()
            threading.Thread(target=self._read, name="events-hub", daemon=True).start()
        positioned.wait(5)  # the reader's place in the stream is fixed: every later event reaches `inbox`
        return inbox

    def unsubscribe(self, key: str, inbox: Inbox) -> None:
        field = key.encode()
        with self._lock:
            inboxes = self._followers.get(field)
            if inboxes is not None:
                inboxes.discard(inbox)
                if not inboxes:
                    del self._followers[field]

    def publish_status(self, changes) -> None:
        """Tell followers (in every API process) of status changes made here: a cancel."""
        try:
            publish_status(self._client, self._prefix, changes)
        except redis.RedisError as exc:  # followers notice at their next read of the row
            log.warning("status change not sent as an event (%s)", exc.__class__.__name__)

    def _read(self) -> None:
        """The reader: one blocking XREAD at a time on a connection of its own, sent and read directly on
        the connection (half the CPU of `Redis.xread` per call, measured: 48 against 98 µs for a 256-job
        step; every API process makes one call per engine step), its reply dispatched as it comes."""
        idle_since = read_at = time.monotonic()
        backoff = 0.1
        pool, connection = self._client.connection_pool, None
        while True:
            with self._lock:
                if self._followers:
                    idle_since = time.monotonic()
                elif time.monotonic() - idle_since > self._idle_seconds:
                    self._reading = False
                    if connection is not None:
                        pool.release(connection)
                    return
            try:
                if self._last_id is None:  # after an outage: from the stream's end
                    last = self._client.xrevrange(self._key, count=1)
                    self._last_id = last[0][0] if last else b"0-0"
                if connection is None:
                    connection = pool.get_connection()
                connection.send_command(
                    "XREAD", "COUNT", 1000, "BLOCK", 1000, "STREAMS", self._key, self._last_id
                )
                replies = connection.read_response() or ()  # nil: the block ran out
                backoff = 0.1
                if time.monotonic() - read_at > self._stall_seconds:  # this process stalled (CPU, GC, stop)
                    log.warning("token events: the hub fell behind the stream; followers read their rows")
                    self._broadcast(LOST)
                read_at = time.monotonic()
            except redis.RedisError as exc:
                log.warning("token events: Redis unavailable (%s); followers read Postgres", exc)
                if connection is not None:
                    connection.disconnect()
                    pool.release(connection)
                    connection = None
                self._last_id = None
                self._broadcast(LOST)
                time.sleep(backoff)
                backoff = min(backoff * 2, 2.0)
                continue
            for _, entries in replies:
                for entry_id, fields in entries:
                    self._last_id = entry_id
                    self._dispatch(fields)

    def _dispatch(self, fields: list[bytes]) -> None:
        """One entry: its fields and values alternating (job id hex, event), as XREAD returns them."""
        if fields[0] == LOST_FIELD:  # a publisher dropped events: every follower reads its row
            self._broadcast(LOST)
            return
        with self._lock:
            followers = self._followers
            found = [
                (fields[i + 1], list(inboxes))
                for i in range(0, len(fields), 2)
                if (inboxes := followers.get(fields[i]))
            ]
        for payload, inboxes in found:
            event = decode(payload)
            for inbox in inboxes:
                inbox.put(event)

    def _broadcast(self, item) -> None:
        with self._lock:
            inboxes = [inbox for group in self._followers.values() for inbox in group]
        for inbox in inboxes:
            inbox.put(item)
