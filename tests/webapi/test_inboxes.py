"""A follower's inbox (webapi/events.py): what the hub puts comes out once, in order, all that is queued at
each take; a take waits up to its timeout and wakes on a put. The same for threads (Inbox) and for
greenlets (GreenInbox, gunicorn's gevent workers), and a response joins what was ready into one write.
A follower that waits has the deltas that go on exactly where its caller is written for it (`direct`), and
goes on from where they reached."""

from __future__ import annotations

import threading
import time
import uuid

import gevent
import pytest

from contract.deltas import Delta
from jobstore.models import Job
from webapi.events import FLUSH, GreenInbox, Hub, Inbox, Tick, follow
from webapi.sse import in_writes


def test_a_take_gets_everything_queued_in_order():
    inbox = Inbox()
    for n in range(5):
        inbox.put(n)
    assert inbox.take(1.0) == [0, 1, 2, 3, 4]
    started = time.monotonic()
    assert inbox.take(0.2) == []  # nothing left: waits out its timeout
    assert 0.15 <= time.monotonic() - started < 2


def test_a_waiting_take_wakes_on_a_put_from_another_thread():
    inbox = Inbox()
    threading.Timer(0.1, inbox.put, args=("event",)).start()
    started = time.monotonic()
    assert inbox.take(5.0) == ["event"]
    assert time.monotonic() - started < 2  # woken, not timed out


def test_puts_racing_takes_lose_nothing_and_repeat_nothing():
    inbox, got = Inbox(), []

    def put_all():
        for n in range(20_000):
            inbox.put(n)

    putter = threading.Thread(target=put_all)
    putter.start()
    while len(got) < 20_000:
        got += inbox.take(1.0)
    putter.join()
    assert got == list(range(20_000))


def test_a_green_inbox_waits_for_a_put_from_another_greenlet():
    inbox = GreenInbox()
    gevent.spawn_later(0.1, inbox.put, "event")
    started = time.monotonic()
    assert inbox.take(5.0) == ["event"]
    assert time.monotonic() - started < 2


def test_a_green_inbox_times_out_and_its_timer_is_reused():
    inbox = GreenInbox()
    for _ in range(3):  # the same timer restarted each time
        started = time.monotonic()
        assert inbox.take(0.1) == []
        assert 0.05 <= time.monotonic() - started < 2
    inbox.put(1)
    inbox.put(2)
    assert inbox.take(0.1) == [1, 2]  # queued: no wait


def test_a_put_after_a_timed_out_take_reaches_the_next_take_only():
    """A put and the timer firing in the same loop turn: the spent wait takes nothing twice, the next gets it."""
    inbox = GreenInbox()
    assert inbox.take(0.05) == []
    gevent.spawn(inbox.put, "late")
    gevent.sleep(0.01)
    assert inbox.take(1.0) == ["late"]
    assert inbox.take(0.05) == []


@pytest.mark.parametrize(
    "pieces, writes",
    [
        ([b"a", FLUSH, b"b", FLUSH], [b"a", b"b"]),  # one step at a time: a write each
        ([b"a", b"b", b"c", FLUSH], [b"abc"]),  # steps that came together: one write
        ([FLUSH, FLUSH, b"a", FLUSH, FLUSH], [b"a"]),  # nothing gathered: nothing written
        ([b"a", b"b"], [b"ab"]),  # the end writes what is left
    ],
)
def test_a_response_writes_what_was_ready_together(pieces, writes):
    closed = []
    assert list(in_writes(iter(pieces), lambda: closed.append(True))) == [b"", *writes]
    assert closed == [True]


def test_a_response_closed_early_runs_its_clean_up_once():
    """The client went away after the first write: gunicorn closes the iterator, which closes the pieces
    (the follower unsubscribes) and runs the clean-up (the slot released, the job cancelled)."""
    closed, pieces_closed = [], []

    def pieces():
        try:
            yield b"a"
            yield FLUSH
            yield b"b"
            yield FLUSH
        finally:
            pieces_closed.append(True)

    writes = in_writes(pieces(), lambda: closed.append(True))
    assert next(writes) == b"" and next(writes) == b"a"
    writes.close()
    assert closed == [True] and pieces_closed == [True]


@pytest.mark.parametrize("method", ["GET", "HEAD"])
def test_an_sse_response_runs_its_clean_up_once_and_a_head_follows_nothing(method):
    from flask import Flask

    from webapi.sse import sse_response

    started, closed = [], []

    def pieces():
        started.append(True)
        yield b"data: 1\n\n"
        yield FLUSH

    app = Flask(__name__)
    with app.test_request_context("/jobs/x/events", method=method):
        response = sse_response(pieces(), lambda: closed.append(True))
    assert response.mimetype == "text/event-stream" and response.headers["Cache-Control"] == "no-cache"
    if method == "HEAD":  # headers only: nothing followed, the slot given back at once
        assert closed == [True] and not started
        return
    assert closed == [] and list(response.response) == [b"data: 1\n\n"]
    response.response.close()  # what gunicorn does at the end
    assert closed == [True] and started == [True]


def followed(settings, direct, tick_seconds: float):
    """A running job with no output yet, its GreenInbox, and follow()'s events of it with `direct`."""
    job = Job(id=uuid.uuid4(), status="running", output_token_ids=[], output_text="", finish_reason=None)
    inbox = GreenInbox()
    events = follow(
        Hub(settings.redis_url, "unused:"),
        lambda: job,
        job.id,
        inbox=inbox,
        row=job,
        tick_seconds=tick_seconds,
        resync_seconds=60,
        direct=direct,
    )
    return inbox, events


def test_a_waiting_follower_has_the_deltas_that_go_on_where_its_caller_is_written_for_it(settings):
    """The hub's puts (here from a greenlet, as the hub's reader is one under gevent) while the follower waits:
    a delta that goes on exactly where the caller is goes to `direct`, and the follower yields nothing for
    it; one that overlaps, or a finish, wakes the follower, which trims it from where `direct` reached."""
    job = Job(id=uuid.uuid4(), status="running", output_token_ids=[], output_text="", finish_reason=None)
    inbox, hub, written, yielded = GreenInbox(), Hub(settings.redis_url, "unused:"), [], []

    def direct(delta: Delta) -> bool:
        written.append(delta)
        return True

    events = follow(
        hub, lambda: job, job.id, inbox=inbox, row=job, tick_seconds=0.3, resync_seconds=60, direct=direct
    )

    def consume():
        for item in events:
            if item is not FLUSH:
                yielded.append(item)
            if isinstance(item, Delta) and item.finish_reason:
                return

    follower = gevent.spawn(consume)
    gevent.sleep(0.05)  # it waits
    for n in range(8):  # one a step for longer than tick_seconds: written directly, and no Tick meanwhile
        inbox.put(Delta(n, [n], n, chr(97 + n)))
        gevent.sleep(0.05)
    assert written == [Delta(n, [n], n, chr(97 + n)) for n in range(8)]
    assert [type(item) for item in yielded] == [type(yielded[0])]  # its status alone: no delta, no Tick
    inbox.put(Delta(6, [6, 7, 8], 6, "ghi"))  # overlaps what the caller holds: the follower's, trimmed
    inbox.put(Delta(9, [9], 9, "j", "stop"))  # a finish: the follower's
    follower.get(timeout=5)
    assert yielded[1:] == [Delta(8, [8], 8, "i"), Delta(9, [9], 9, "j", "stop")]
    assert len(written) == 8
    assert hub._followers == {}  # unsubscribed at the end


def test_a_follower_ticks_when_neither_it_nor_direct_had_anything_for_a_tick(settings):
    written: list = []
    inbox, events = followed(settings, lambda delta: written.append(delta) or True, tick_seconds=0.2)
    gevent.spawn_later(0.15, inbox.put, Delta(0, [1], 0, "a"))
    started = time.monotonic()
    ticked = next(item for item in events if isinstance(item, Tick))
    assert ticked == Tick() and written == [Delta(0, [1], 0, "a")]
    assert time.monotonic() - started >= 0.3  # a tick after the direct write's, not the wait's start
    events.close()


def test_a_direct_write_that_raises_leaves_the_event_to_the_follower(settings):

    def broken(delta: Delta) -> bool:
        raise RuntimeError("a bug in a writer")

    inbox, events = followed(settings, broken, tick_seconds=5)
    gevent.spawn_later(0.05, inbox.put, Delta(0, [1], 0, "a"))  # the hub's put: it must not raise
    with gevent.Timeout(3):  # lost, it would never come
        assert next(item for item in events if isinstance(item, Delta)) == Delta(0, [1], 0, "a")
    events.close()
