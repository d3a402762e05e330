"""One call following its jobs: GET /jobs/<id>/events, GET /jobs/<id>?wait= and the /v1 completions.

A `JobFollower` holds what such a call holds, from the moment it starts waiting to its end:

- one of the process's COMPLETION_SLOTS (429 when all are held, 503 where waiting calls are off);
- a subscription to each job's token events at the hub (webapi/hub.py), made before the job's row is read
  (or, for a job the call creates, before it is sent to the queue: then no event can come before);
- how much of each job's output the caller holds (webapi/followed_job.py), so that the row in Postgres and
  the events from Redis join with no gap and no duplicate: the row's output beyond the caller is sent
  first, then each event trimmed to what the caller lacks. An event that starts beyond the caller (it
  joined late and the row lagged, events were lost, Redis went away) is held back and the row read again,
  which holds everything up to the worker's last progress write;
- under the gevent worker, the hub's direct writes of a waiting stream's plain steps (webapi/followed_job.py):
  per token per caller, no wake-up of the stream's greenlet, no switch there and back, no pass through the
  generators to gunicorn's write;
- cancel on abandon (the /v1 calls): a job whose caller went away, or whose COMPLETION_TIMEOUT_SECONDS
  passed, before its end is cancelled, since nobody will read the rest;
- its end, once: the slot given back, the subscriptions dropped, the streamed deltas counted.

Its `events()` are a job's output beyond a position as `Delta`s, its status changes, a Tick when nothing
came for a tick, FLUSH before each wait (the response writes what was ready in one write, webapi/sse.py)
and last `Ended` once the row holds the result. What the caller sees is rendered apart: the native events
(webapi/job_stream.py) and OpenAI's chunks (webapi/completion_chunks.py).
"""

from __future__ import annotations

import logging
import queue
import random
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import NamedTuple

from flask import Response
from sqlalchemy.exc import InterfaceError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout

from contract.deltas import Delta, Gap, Position, trim
from contract.token_events import Status
from jobstore import jobs
from jobstore.models import Job, JobStatus
from webapi.cancels import cancel
from webapi.errors import APIError
from webapi.extensions import Services
from webapi.followed_job import START, FollowedJob
from webapi.hub import LOST
from webapi.metrics import count_streamed_deltas
from webapi.sse import FLUSH, Flush, direct_writer, sse_response

log = logging.getLogger(__name__)
GAP_READ_SECONDS = 0.1  # while events wait for the row to catch up, it is read this often
MAX_RESYNC_FACTOR = 6  # a quiet follower's row reads back off up to this many times EVENTS_RESYNC_SECONDS
RETRY = object()  # a read of a row that failed: tried again later
READ_ROW = object()  # what the follower does next: read the row
ENDED = frozenset(s.value for s in JobStatus if s.finished)
RETRYABLE = (OperationalError, InterfaceError, PoolTimeout)  # the database did not answer


class Tick(NamedTuple):
    """Nothing came for a tick: time for a HEARTBEAT (and a chance to notice a caller gone)."""


class Ended(NamedTuple):
    """The job ended and its row holds the result."""

    job: Job


class JobFollower:
    """The jobs one call waits on or streams (one, or a choice each), with its slot; a context manager that
    ends it on leaving, unless `stream()` handed it to a response, which ends it when it closes."""

    def __init__(
        self,
        found: Services,
        *,
        timeout: float | None = None,
        tick_seconds: float = 1.0,
        cancel_on_abandon: bool = False,
    ):
        self._found = found
        self._release = take_slot(found)
        self.timeout = timeout  # seconds the call may wait, from now (None: no limit)
        self._deadline = None if timeout is None else time.monotonic() + timeout
        self._tick_seconds = tick_seconds
        self._cancel_on_abandon = cancel_on_abandon
        self._jobs: list[FollowedJob] = []
        self._writer = None  # the stream's DirectWriter, for the hub's direct writes
        self._given = 0  # deltas given out by events() (those the hub wrote, the writer counts)
        self._streaming = False
        self._closed = False

    def follow(self, job: Job, row: Job | None = None) -> None:
        """Subscribe to `job`'s events; `row`: the job's row as it is now (not read again to start)."""
        self._jobs.append(FollowedJob(job, self._found.hub.subscribe(job.id.hex), row))

    def follow_created(self, job: Job) -> None:
        """Follow a job this call just created (submit_job's on_created): not sent yet, so no event came, and
        its row is the job as created."""
        self.follow(job, row=job)

    def __enter__(self) -> JobFollower:
        return self

    def __exit__(self, *_exc) -> None:
        if not self._streaming:
            self.close()

    def wait(self, index: int = 0) -> Job | None:
        """The job once it ended (its row), or None when the time ran out first."""
        return next((item.job for item in self.events(index) if type(item) is Ended), None)

    def held(self, index: int = 0) -> Position:
        """How much of job `index`'s output the caller holds (the id of the last event sent)."""
        return self._jobs[index].held

    def row(self, index: int = 0) -> Job | None:
        """The job's row as it is now (None: gone; the job as it was given when the database did not answer)."""
        followed = self._jobs[index]
        job = self._read_row(followed)
        return followed.job if job is RETRY else job

    def stream(
        self, pieces: Iterator[bytes | Flush], plain: Callable[[Delta], bytes | None] | None = None
    ) -> Response:
        """`pieces` (rendered from events()) as an SSE response that ends this follower when it closes.
        `plain(delta)`: the bytes of a step's delta without a finish (b"": nothing to write) or None when it
        needs the renderer; given, the hub writes such a delta itself while the stream waits (gevent worker)."""
        if plain is not None:
            self.write_directly(plain, direct_writer())
        response = sse_response(pieces, self.close, self._writer)
        self._streaming = True  # the response ends it now
        return response

    def write_directly(self, plain: Callable[[Delta], bytes | None], writer) -> None:
        """Have the hub write the job's plain deltas (rendered by `plain`) through `writer` (a DirectWriter; None:
        there is none) while its events() wait; before events() start. For one job followed by a greenlet."""
        if writer is not None and len(self._jobs) == 1 and hasattr(self._jobs[0].inbox, "direct"):
            self._writer = writer
            self._jobs[0].plain, self._jobs[0].writer = plain, writer

    def events(
        self, index: int = 0, since: Position = START
    ) -> Iterator[Delta | Status | Tick | Flush | Ended]:
        """Job `index`'s output beyond `since` as deltas, its status changes, a Tick when nothing came for a
        tick, FLUSH before each wait, and last Ended once its row holds the result; it returns when the call's
        time runs out (cancelling its jobs with cancel_on_abandon) or the job is gone.

        Without any event for about EVENTS_RESYNC_SECONDS (spread +-25%, doubled after each quiet read up to
        MAX_RESYNC_FACTOR times) the row is read again: a lost event never leaves a caller waiting for ever;
        a read that fails is tried again the same way. Deltas the hub wrote directly are not given out, and
        a Tick comes only when neither they nor anything else came for a tick."""
        followed = self._jobs[index]
        followed.held = since
        inbox = followed.inbox
        direct = followed.write_directly if followed.plain is not None else None
        tick_seconds, deadline = self._tick_seconds, self._deadline
        resync_seconds = self._found.settings.events_resync_seconds
        pending: list[Delta] = []  # events beyond what the caller holds, waiting for the row to catch up
        taken: deque = deque()  # events taken from the inbox, not handled yet
        given = 0
        try:
            job = followed.first_row if followed.first_row is not None else self._read_row(followed)
            while job is RETRY:
                time.sleep(tick_seconds)
                job = self._read_row(followed)
            if job is None:
                return
            status = JobStatus(job.status).value
            yield Status(status)
            followed.heard_at, read_at = time.monotonic(), 0.0
            # spread over time, and doubled while nothing comes: thousands of followers of queued jobs (a
            # paused or busy worker) read their rows a few times a minute in all, not each every few seconds
            followed.first_resync = followed.resync = resync_seconds * random.uniform(0.75, 1.25)
            while True:
                if job is READ_ROW:
                    job = self._read_row(followed)
                    if job is None:
                        return
                if job is not None and job is not RETRY:  # a row read: what it holds beyond the caller first
                    read_at = time.monotonic()
                    now_status = JobStatus(job.status).value
                    if now_status != status and now_status not in ENDED:  # its event was lost: the row says
                        status = now_status
                        yield Status(status)
                    for new in followed.from_row(job, pending):
                        given += 1
                        yield new
                    if JobStatus(job.status).finished:
                        followed.ended = True
                        yield Ended(job)
                        return
                job = None
                wait = tick_seconds
                if deadline is not None:
                    wait = min(wait, deadline - time.monotonic())
                    if wait <= 0:
                        if self._cancel_on_abandon:
                            self._cancel_unended()
                        return
                if pending:  # the row lags the events: read it again soon
                    wait = min(wait, max(0.0, read_at + GAP_READ_SECONDS - time.monotonic()))
                if not taken:
                    yield FLUSH  # all that was ready went out: write it before waiting
                    if direct is not None and not pending:
                        inbox.direct = direct  # type: ignore[attr-defined]
                        taken.extend(inbox.take(wait))
                        inbox.direct = None  # type: ignore[attr-defined]
                    else:
                        taken.extend(inbox.take(wait))
                    now = time.monotonic()
                    if not taken:
                        if pending or now - followed.heard_at >= followed.resync:
                            if not pending:  # quiet again after this read (or it failed): the next one later
                                followed.resync = min(followed.resync * 2, MAX_RESYNC_FACTOR * resync_seconds)
                            job, followed.heard_at = READ_ROW, now
                        elif now - followed.written_at >= tick_seconds:  # else the hub wrote deltas
                            yield Tick()
                        continue
                    followed.heard_at, followed.resync = now, followed.first_resync
                event = taken.popleft()
                if type(event) is Delta:
                    if pending:
                        pending.append(event)
                        continue
                    try:
                        new = trim(event, followed.held, followed.finished)
                    except Gap:  # joined late, or missed events: the row has them (or will at its next write)
                        pending.append(event)
                        job = READ_ROW
                        continue
                    if new is not None:
                        followed.held = new.end
                        if new.finish_reason is not None:
                            followed.finished = True
                        given += 1
                        yield new
                elif event is LOST:
                    job = READ_ROW
                elif event.status in ENDED:
                    job = READ_ROW  # the result, from the record
                elif event.status != status:
                    status = event.status
                    yield event
        finally:
            self._given += given

    def close(self) -> None:
        """End the call, once: cancel its jobs not over (cancel_on_abandon: the caller went away), give the
        slot back, drop the subscriptions, count the streamed deltas."""
        if self._closed:
            return
        self._closed = True
        self._release()
        for followed in self._jobs:
            self._found.hub.unsubscribe(followed.job.id.hex, followed.inbox)
        if self._streaming:
            count_streamed_deltas(self._given, self._writer)
        if self._cancel_on_abandon:
            self._cancel_unended()

    def merged_events(self) -> Iterator[tuple[int, Delta | Ended | None] | Tick]:
        """Every job's deltas and Ended as they come, with its index, from a follower each (a greenlet under
        gevent); (index, None) when one's events are over (at its end, or when the time ran out); a Tick when
        nothing came for a tick. The followers stop once this follower is closed."""
        merged: queue.Queue = queue.Queue()

        def pump(index: int) -> None:
            events = self.events(index)
            try:
                for item in events:
                    if self._closed:
                        return
                    if type(item) is Delta or type(item) is Ended:
                        merged.put((index, item))
                        if type(item) is Ended or item.finish_reason is not None:  # type: ignore[union-attr]
                            return
            finally:
                events.close()
                merged.put((index, None))

        for index, followed in enumerate(self._jobs):
            name = f"follow-{followed.job.id}"
            threading.Thread(target=pump, args=(index,), name=name, daemon=True).start()
        while True:
            try:
                yield merged.get(timeout=self._tick_seconds)
            except queue.Empty:
                yield Tick()

    def _cancel_unended(self) -> None:
        """Cancel the jobs whose end the caller did not get (a database that does not answer leaves them to
        run to their end, unread)."""
        for followed in self._jobs:
            if followed.over:
                continue
            followed.cancelled = True
            job = followed.job
            try:
                cancel(self._found, job.id, job.tenant_id)
            except RETRYABLE as exc:
                log.warning("job %s not cancelled, database unavailable (%s)", job.id, exc)

    def _read_row(self, followed: FollowedJob):
        """The job's row, on a connection of its own (none held while waiting); RETRY when the database did
        not answer (the follower tries again later rather than failing its caller)."""
        job = followed.job
        try:
            with self._found.autocommit.connect() as conn:
                return jobs.get_job(conn, job.id, job.tenant_id)
        except RETRYABLE as exc:
            log.warning(
                "job %s: its row could not be read (%s); trying again", job.id, exc.__class__.__name__
            )
            return RETRY


def take_slot(found: Services) -> Callable[[], None]:
    """Hold one of this process's COMPLETION_SLOTS for a call that waits on jobs; returns the release.
    429 naming the cap when all are held; 503 when waiting calls are off (a sync worker)."""
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
