"""A follower's inbox (webapi/hub.py): what the hub puts comes out once, in order, all that is queued at
each take; a take waits up to its timeout and wakes on a put. The same for threads (Inbox) and for
greenlets (GreenInbox, gunicorn's gevent workers). (The hub's reader against Redis:
tests/contract/test_event_losses.py.)"""

from __future__ import annotations

import threading
import time

import gevent

from webapi.hub import GreenInbox, Inbox


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
