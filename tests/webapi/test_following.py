"""A call following jobs (webapi/following.py), against this session's Postgres and Redis: the row's output and
the token events join with no gap and no duplicate, an event beyond the caller waits for the row, the hub
writes a waiting stream's plain steps itself, a job its caller left is cancelled, and the slot is held once."""

from __future__ import annotations

import dataclasses
import time
import uuid

import gevent
import pytest
from sqlalchemy import select, update

from contract.deltas import Delta, Position
from contract.token_events import LOST_FIELD, Status, encode, stream_key
from jobstore import jobs
from jobstore.keys import create_key
from jobstore.models import Tenant
from tests.conftest import job_request
from webapi.errors import APIError
from webapi.following import Ended, JobFollower, Tick
from webapi.hub import GreenInbox, Hub
from webapi.sse import FLUSH

TEXT = "abcdefghij"


@pytest.fixture()
def found(app):
    return app.extensions["genq"]


@pytest.fixture()
def new_job(found, sessions):
    """`new_job(**columns)`: a queued job of a new tenant, with `columns` written to its row."""

    def make(**columns):
        name = f"follow-{uuid.uuid4().hex[:8]}"
        with sessions.begin() as s:
            create_key(s, name)
            tenant_id = s.scalars(select(Tenant.id).where(Tenant.name == name)).one()
        with found.engine.begin() as conn:
            job, _ = jobs.create_job(conn, tenant_id, job_request())
            if columns:
                conn.execute(update(jobs.JOBS).where(jobs.JOBS.c.id == job.id).values(**columns))
        return job

    return make


def status_of(found, job) -> str:
    with found.autocommit.connect() as conn:
        return jobs.get_job(conn, job.id).status


def set_row(found, job, **columns):
    with found.engine.begin() as conn:
        conn.execute(update(jobs.JOBS).where(jobs.JOBS.c.id == job.id).values(**columns))


def publish(redis_client, found, job, event) -> None:
    """A worker's token event for `job`, on the stream the app's hub reads."""
    redis_client.xadd(stream_key(found.settings.redis_key_prefix), {job.id.hex: encode(event)})


def step(n: int, count: int = 1, finish: str | None = None) -> Delta:
    """The engine's step adding tokens n..n+count-1 (one character each)."""
    return Delta(n, list(range(n, n + count)), n, TEXT[n : n + count], finish)


def given(events, count: int) -> list:
    """The next `count` events, FLUSHes and Ticks left out."""
    got: list = []
    for item in events:
        if item is not FLUSH and type(item) is not Tick:
            got.append(item)
            if len(got) == count:
                break
    return got


def test_the_row_then_the_events_each_token_once(found, new_job, redis_client):
    """The row holds 3 tokens; the caller held 1 (Last-Event-ID): it gets the row's 2, then events trimmed to
    what it lacks (one overlaps the row), then the finish, then the result from the row."""
    job = new_job(status="running", output_token_ids=[0, 1, 2], output_text=TEXT[:3])
    with JobFollower(found) as follower:
        follower.follow(job)
        events = follower.events(since=Position(1, 1))
        assert next(events) == Status("running")
        assert next(events) == Delta(1, [1, 2], 1, "bc")
        publish(redis_client, found, job, step(2, 2))  # overlaps the row: only token 3 is new
        publish(redis_client, found, job, step(4, 1, "stop"))
        assert given(events, 2) == [Delta(3, [3], 3, "d"), step(4, 1, "stop")]
        assert follower.held() == Position(5, 5)
        set_row(found, job, status="succeeded", output_token_ids=[0, 1, 2, 3, 4], output_text=TEXT[:5])
        publish(redis_client, found, job, Status("succeeded"))
        [ended] = given(events, 1)
        assert type(ended) is Ended
        assert ended.job.status == "succeeded" and ended.job.output_text == TEXT[:5]


def test_an_event_beyond_the_caller_waits_for_the_row(found, new_job, redis_client):
    """The caller joined while events were lost: the event from token 4 starts beyond what it holds (2), so it
    is held back and the row read again; once the row holds up to 4, the caller gets the row's tokens 2-3, then
    the held-back event, and nothing twice."""
    job = new_job(status="running", output_token_ids=[0, 1], output_text=TEXT[:2])
    with JobFollower(found) as follower:
        follower.follow(job)
        events = follower.events()
        assert next(events) == Status("running")
        assert next(events) == Delta(0, [0, 1], 0, "ab")
        publish(redis_client, found, job, step(4))
        time.sleep(0.3)  # the row lags: read again every GAP_READ_SECONDS, nothing to send meanwhile
        set_row(found, job, output_token_ids=[0, 1, 2, 3], output_text=TEXT[:4])
        publish(redis_client, found, job, step(5, 1, "length"))
        assert given(events, 3) == [Delta(2, [2, 3], 2, "cd"), step(4), step(5, 1, "length")]


def test_a_lost_status_is_found_in_the_row(found, new_job, redis_client):
    """A job that ends with no event reaching the API (cancelled in the row alone) ends its follower within
    about EVENTS_RESYNC_SECONDS."""
    job = new_job()
    quick = dataclasses.replace(found, settings=found.settings.replace(events_resync_seconds=0.3))
    with JobFollower(quick, tick_seconds=0.1) as follower:
        follower.follow(job, row=job)
        set_row(found, job, status="cancelled", finish_reason="abort")
        started = time.monotonic()
        ended = follower.wait()
    assert ended is not None and ended.status == "cancelled"
    assert time.monotonic() - started < 2


def test_a_status_change_whose_event_was_lost_comes_from_the_row_before_its_tokens(
    found, new_job, redis_client
):
    """The job started and made tokens while the hub could not vouch for its reads (LOST): the follower reads
    the row and gives the caller "running" first, then the row's tokens (CI once saw a delta follow "queued")."""
    job = new_job()
    with JobFollower(found, timeout=5.0, tick_seconds=0.1) as follower:  # its events end in 5 s at most
        follower.follow(job)
        events = follower.events()
        assert next(events) == Status("queued")
        set_row(found, job, status="running", output_token_ids=[0, 1], output_text=TEXT[:2])
        redis_client.xadd(stream_key(found.settings.redis_key_prefix), {LOST_FIELD: b"lost"})
        assert given(events, 2) == [Status("running"), Delta(0, [0, 1], 0, "ab")]


def test_a_caller_that_leaves_before_the_end_cancels_its_job(found, new_job, redis_client):
    job = new_job(status="running", output_token_ids=[0], output_text="a")
    with JobFollower(found, cancel_on_abandon=True) as follower:
        follower.follow(job)
        events = follower.events()
        assert next(events) == Status("running")
        assert next(events) == Delta(0, [0], 0, "a")
    assert status_of(found, job) == "cancelled"


def test_a_caller_that_got_the_finish_cancels_nothing(found, new_job, redis_client):
    job = new_job(status="running")
    with JobFollower(found, cancel_on_abandon=True) as follower:
        follower.follow(job)
        events = follower.events()
        assert next(events) == Status("running")
        publish(redis_client, found, job, step(0, 2, "stop"))
        assert given(events, 1) == [step(0, 2, "stop")]
    assert status_of(found, job) == "running"


def test_a_job_not_done_in_time_is_cancelled_and_its_wait_answers_none(found, new_job):
    job = new_job()
    with JobFollower(found, timeout=0.3, tick_seconds=0.1, cancel_on_abandon=True) as follower:
        follower.follow(job, row=job)
        assert follower.wait() is None
        assert status_of(found, job) == "cancelled"  # before its answer


def test_a_wait_alone_cancels_nothing(found, new_job):
    job = new_job()
    with JobFollower(found, timeout=0.2, tick_seconds=0.1) as follower:
        follower.follow(job, row=job)
        assert follower.wait() is None
        assert follower.row().status == "queued"


def test_the_slots_are_held_once_per_call(found, new_job):
    held = [JobFollower(found) for _ in range(found.settings.completion_slots)]
    with pytest.raises(APIError) as refused:
        JobFollower(found)
    assert refused.value.status == 429 and "COMPLETION_SLOTS" in refused.value.message
    for follower in held:
        follower.close()
        follower.close()  # once: a second close gives back nothing
    with JobFollower(found):
        pass
    assert found.completion_slots.acquire(blocking=False)  # the others are free
    found.completion_slots.release()


class Writer:
    """Stands for the stream's DirectWriter: what the hub wrote, and whether the socket takes it."""

    def __init__(self):
        self.writes: list[bytes] = []
        self.takes = True
        self.written, self.unsent = 0, b""

    def write(self, data: bytes) -> bool:
        if self.takes:
            self.writes.append(data)
            self.written += 1
        return self.takes


def green_follower(found, tick_seconds: float = 5.0) -> JobFollower:
    """A follower whose inboxes are GreenInboxes, as under gunicorn's gevent worker."""
    hub = Hub(found.settings.redis_url, "unused:", inbox_type=GreenInbox)
    return JobFollower(dataclasses.replace(found, hub=hub), tick_seconds=tick_seconds)


def test_the_hub_writes_a_waiting_streams_plain_steps_and_the_follower_goes_on_from_there(found, new_job):
    """The hub's puts (from a greenlet, as its reader is one under gevent) while the follower waits: a delta
    without a finish that goes on exactly where the caller is is written by the hub, and the follower gives
    out nothing for it (no Tick either while they come); one that overlaps, or a finish, wakes the follower,
    which trims it from where the hub's writes reached."""
    job = new_job(status="running")
    follower, writer, out = green_follower(found, tick_seconds=0.3), Writer(), []
    with follower:
        follower.follow(job)
        follower.write_directly(lambda delta: delta.text.encode(), writer)
        inbox = follower._jobs[0].inbox

        def consume():
            for item in follower.events():
                if item is not FLUSH:
                    out.append(item)
                if type(item) is Delta and item.finish_reason:
                    return

        consumer = gevent.spawn(consume)
        gevent.sleep(0.05)  # it waits
        for n in range(8):  # a step each, for longer than a tick
            inbox.put(step(n))
            gevent.sleep(0.05)
        assert writer.writes == [TEXT[n].encode() for n in range(8)]
        assert out == [Status("running")]
        assert follower.held() == Position(8, 8)
        inbox.put(step(6, 3))  # overlaps what the caller holds: the follower's, trimmed
        inbox.put(step(9, 1, "stop"))  # a finish: the follower's
        consumer.get(timeout=5)
    assert out[1:] == [step(8), step(9, 1, "stop")]
    assert len(writer.writes) == 8


def test_a_step_the_socket_does_not_take_is_the_followers(found, new_job):
    job = new_job(status="running")
    follower, writer = green_follower(found), Writer()
    writer.takes = False
    with follower:
        follower.follow(job)
        follower.write_directly(lambda delta: delta.text.encode(), writer)
        events = follower.events()
        assert next(events) == Status("running")
        gevent.spawn_later(0.05, follower._jobs[0].inbox.put, step(0))
        with gevent.Timeout(3):
            assert given(events, 1) == [step(0)]


def test_a_direct_write_that_raises_leaves_the_event_to_the_follower(found, new_job):
    def broken(delta: Delta) -> bytes:
        raise RuntimeError("a bug in a renderer")

    job = new_job(status="running")
    follower = green_follower(found)
    with follower:
        follower.follow(job)
        follower.write_directly(broken, Writer())
        events = follower.events()
        assert next(events) == Status("running")
        gevent.spawn_later(0.05, follower._jobs[0].inbox.put, step(0))  # the hub's put: it must not raise
        with gevent.Timeout(3):  # lost, it would never come
            assert given(events, 1) == [step(0)]
