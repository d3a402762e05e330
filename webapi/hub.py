"""Following a job from the API: its row in Postgres, then its token events from Redis, with no gap and no
duplicate. Used by GET /jobs/<id>/events, GET /jobs/<id>?wait= and the /v1 completions.

One `Hub` per API process reads the events stream (contract/token_events.py) with one blocking XREAD at a time,
while at least one caller follows a job, and hands each followed job's events to its followers' queues:
a follower costs a queue, not a thread, a connection or a read of its own (under gunicorn's gevent workers
it is a greenlet waiting on its queue).

A follower takes every event queued for it at once (Inbox) and yields FLUSH before it waits again, so a
response built on it (webapi/sse.py) writes the steps that came together in one write.

Under the gevent worker a stream's follower may also hand the hub a `direct` writer: while the follower
waits with nothing queued and the caller holds the output up to exactly where an event starts, the hub has
the event written at once (webapi/gevent_worker.DirectWriter) instead of waking the follower to write it:
per token per caller, no wake-up, no switch there and back, no pass through the generators between the
follower and the socket. Everything else (a status, a finish, a gap, a socket that is full) wakes the
follower as before, which goes on from the position the direct writes reached.

`follow()` joins the two sources by position (contract.deltas): it subscribes first, then reads the row,
sends what the row holds beyond the caller's position, then each event trimmed to what the caller lacks.
An event that starts beyond the caller (it joined late and the row lagged, events were lost, Redis went
away) is not sent: the row is read again (it holds everything up to its last progress write) and the
follower goes on from there. So a caller gets every token once, in order, whichever source had it first.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import NamedTuple

import redis
from sqlalchemy.exc import InterfaceError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout

from contract.deltas import Delta, Gap, Position, trim
from contract.token_events import LOST_FIELD, Status, decode, publish_status, stream_key
from jobstore import jobs
from jobstore.models import Job, JobStatus

try:  # gunicorn's gevent workers (the api extra); importing it patches nothing
    from gevent import get_hub as gevent_hub
    from gevent import monkey as gevent_monkey
    from gevent.hub import Waiter as GeventWaiter
except ImportError:
    gevent_monkey = None

log = logging.getLogger(__name__)
START = Position()
GAP_READ_SECONDS = 0.1  # while events wait for the row to catch up, it is read this often
MAX_RESYNC_FACTOR = 6  # a quiet follower's row reads back off up to this many times EVENTS_RESYNC_SECONDS
RETRY = object()  # a read of a row that failed
LOST = object()  # put in every follower's queue when the hub lost Redis: they read their rows again
ENDED = frozenset(s.value for s in JobStatus if s.finished)


# What a stream writes when nothing came for a while (a Tick): a blank line. Every SSE reader skips it (an
# empty event), and writing it keeps proxies from timing the connection out and notices a caller gone.
# Not a comment line (": keep-alive"): vLLM's benchmark client strips each network read of its blank lines
# before splitting events at them, so a comment sent on its own glues onto the next event, which is lost.
HEARTBEAT = b"\n"


class Tick(NamedTuple):
    """Nothing came for a while: time for a HEARTBEAT (and a chance to notice a caller gone)."""


class Flush(NamedTuple):
    """Everything that was ready has been given out; the follower waits now: time to write (webapi/sse.py)."""


FLUSH = Flush()


class Ended(NamedTuple):
    """The job ended and its row holds the result."""

    job: Job


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


def inbox_type() -> type[Inbox]:
    """GreenInbox where gevent has patched threading (followers are greenlets), else Inbox."""
    return GreenInbox if gevent_monkey is not None and gevent_monkey.is_module_patched("threading") else Inbox


class Hub:
    """Reads the token events of one API process's followed jobs, one blocking XREAD at a time."""

    def __init__(
        self, redis_url: str, prefix: str, idle_seconds: float = 30.0, retention_seconds: float = 60.0
    ):
        self._client = redis.Redis.from_url(redis_url, socket_connect_timeout=2, socket_timeout=10)
        self._prefix, self._key = prefix, stream_key(prefix)
        self._idle_seconds = idle_seconds
        # a read this long after the one before may have missed entries trimmed meanwhile (EVENTS_RETENTION)
        self._stall_seconds = retention_seconds / 2
        self._lock = threading.Lock()
        self._followers: dict[str, set[Inbox]] = {}
        self._last_id: bytes | None = None  # where the reader is in the stream; None: not reading
        self._reading = False
        self._positioned = threading.Event()
        self._inbox_type = inbox_type()

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


def row_delta(job: Job) -> Delta:
    """What a job's row holds of its output, as a delta from the start."""
    ended = JobStatus(job.status).finished
    return Delta(
        0, list(job.output_token_ids), 0, job.output_text or "", job.finish_reason if ended else None
    )


def follow(
    hub: Hub,
    read_row,
    job_id,
    since: Position = START,
    *,
    inbox: Inbox | None = None,
    row: Job | None = None,
    tick_seconds: float = 1.0,
    resync_seconds: float = 10.0,
    deadline: float | None = None,
    direct: Callable[[Delta], bool] | None = None,
) -> Iterator[Delta | Status | Tick | Flush | Ended]:
    """A job's output beyond `since` as deltas, its status changes, Ticks when nothing comes for
    `tick_seconds`, a Flush before each wait, and last Ended once its row holds the result (or return at
    `deadline`, monotonic).
    `read_row()` reads the job's row (None: gone). `inbox`: a subscription to the job made earlier (before
    the job was sent to the queue: then no event of it can come before); `row`: the job's row as read just
    before (then it is not read again to start). Without any event for
    about `resync_seconds` (spread +-25%, and doubled after each quiet read up to MAX_RESYNC_FACTOR times), the
    row is read again (a lost event never leaves a follower waiting for ever); a read that fails is tried
    again the same way.
    `direct(delta) -> bool`: writes a delta to the caller from the hub's greenlet while this follower waits
    (a GreenInbox; the module's docstring), or says False; the deltas it wrote are not yielded, and a Tick
    comes only when neither they nor anything else came for `tick_seconds`."""
    key = job_id.hex
    inbox = inbox if inbox is not None else hub.subscribe(key)
    pending: list[Delta] = []  # events beyond what the caller holds, waiting for the row to catch up
    taken: deque = deque()  # events taken from the inbox, not handled yet
    read_at = 0.0
    finished = False  # a delta with the finish was sent
    written_at = 0.0  # when `direct` last wrote a delta

    def write_directly(event) -> bool:
        """The hub's put while this follower waits: a delta that goes on exactly where the caller is, written."""
        nonlocal held, quiet_since, resync, written_at
        if (
            type(event) is not Delta
            or event.finish_reason is not None
            or finished
            or event.start != held.tokens
            or event.text_start != held.chars
            or not direct(event)
        ):
            return False
        held = event.end
        quiet_since = written_at = time.monotonic()
        resync = first_resync
        return True

    if direct is not None and not hasattr(inbox, "direct"):  # a thread's Inbox: the follower writes all
        direct = None
    try:
        held = since
        job = row if row is not None else read_row()
        while job is RETRY:
            time.sleep(tick_seconds)
            job = read_row()
        if job is None:
            return
        status = JobStatus(job.status).value
        yield Status(status)
        quiet_since = time.monotonic()
        # spread over time, and doubled while nothing comes: thousands of followers of queued jobs (a paused
        # or busy worker) read their rows a few times a minute in all, not each every few seconds at once
        resync = first_resync = resync_seconds * random.uniform(0.75, 1.25)
        while True:
            if job is RETRY:  # the database did not answer: try again at the next resync (backed off)
                job = None
            if job is not None:  # a row read: send what it holds beyond the caller, then what waited
                read_at = time.monotonic()
                new = trim(row_delta(job), held, finished) if _covers(job, held) else None
                if new is not None:
                    held, finished = new.end, finished or new.finish_reason is not None
                    yield new
                while pending:
                    try:
                        new = trim(pending[0], held, finished)
                    except Gap:
                        break
                    pending.pop(0)
                    if new is not None:
                        held, finished = new.end, finished or new.finish_reason is not None
                        yield new
                if JobStatus(job.status).finished:
                    yield Ended(job)
                    return
                job = None
            wait = tick_seconds
            if deadline is not None:
                wait = min(wait, deadline - time.monotonic())
                if wait <= 0:
                    return
            if pending:  # the row lags the events: read it again soon
                wait = min(wait, max(0.0, read_at + GAP_READ_SECONDS - time.monotonic()))
            if not taken:
                yield FLUSH  # all that was ready went out: write it before waiting
                if direct is not None and not pending:
                    inbox.direct = write_directly
                    taken.extend(inbox.take(wait))
                    inbox.direct = None
                else:
                    taken.extend(inbox.take(wait))
                if not taken:
                    if pending or time.monotonic() - quiet_since >= resync:
                        if not pending:  # quiet again after this read (or it failed): the next one later
                            resync = min(resync * 2, MAX_RESYNC_FACTOR * resync_seconds)
                        job, quiet_since = read_row(), time.monotonic()
                        if job is None:
                            return
                        continue
                    if time.monotonic() - written_at >= tick_seconds:  # else deltas went out directly
                        yield Tick()
                    continue
                quiet_since, resync = time.monotonic(), first_resync
            event = taken.popleft()
            if event is LOST:
                job = read_row()
                if job is None:
                    return
            elif isinstance(event, Status):
                if event.status in ENDED:
                    job = read_row()  # the result, from the record
                    if job is None:
                        return
                elif event.status != status:
                    status = event.status
                    yield event
            elif pending:
                pending.append(event)
            else:
                try:
                    new = trim(event, held, finished)
                except Gap:  # joined late, or missed events: the row has them (or will, at its next write)
                    pending.append(event)
                    job = read_row()
                    if job is None:
                        return
                    continue
                if new is not None:
                    held, finished = new.end, finished or new.finish_reason is not None
                    yield new
    finally:
        hub.unsubscribe(key, inbox)


def _covers(job: Job, held: Position) -> bool:
    """The row holds at least up to `held` (else it lags the events sent already: nothing to take)."""
    return len(job.output_token_ids) >= held.tokens and len(job.output_text or "") >= held.chars


def read_job(autocommit, job_id, tenant_id=None):
    """A function reading the job's row, each time on a connection of its own (none held while waiting);
    RETRY when the database did not answer (a follower tries again later rather than failing its caller)."""

    def read():
        try:
            with autocommit.connect() as conn:
                return jobs.get_job(conn, job_id, tenant_id)
        except (OperationalError, InterfaceError, PoolTimeout) as exc:
            log.warning(
                "job %s: its row could not be read (%s); trying again", job_id, exc.__class__.__name__
            )
            return RETRY

    return read


def acquire_slot(found):
    """Hold one of this process's COMPLETION_SLOTS for a call that waits on a job; returns the release.
    429 naming the cap when all are held; 503 when waiting calls are off (a sync worker)."""
    from webapi.errors import APIError

    slots = found.completion_slots
    if slots is None:
        raise APIError(
            503,
            "unavailable",
            "calls that wait on a job are off on this server (COMPLETION_SLOTS=0, or a sync gunicorn "
            "worker): use the Batch API, or POST /jobs and poll",
            {"Retry-After": "60"},
        )
    if not slots.acquire(blocking=False):
        raise APIError(
            429,
            "too_many_waiting_completions",
            f"this server process already holds {found.settings.completion_slots} waiting calls, the most it "
            "holds (COMPLETION_SLOTS); retry after Retry-After seconds",
            {"Retry-After": "1"},
        )
    return slots.release
