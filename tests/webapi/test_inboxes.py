"""A follower's inbox (webapi/hub.py): what the hub puts comes out once, in order, all that is queued at
each take; a take waits up to its timeout and wakes on a put. The same for threads (Inbox) and for
greenlets (GreenInbox, gunicorn's gevent workers), and a response (webapi/sse.py) joins what was ready into
one write."""

from __future__ import annotations

import threading
import time

import gevent
import pytest

from webapi.hub import GreenInbox, Inbox
from webapi.sse import FLUSH, in_writes


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
