"""Lost token events are announced, so followers need no frequent rereads of their rows (contract/token_events.py,
webapi/hub.py), against this session's Redis:

- a worker's publisher that could not send (Redis refused its XADDs) starts its next send with a LOST_FIELD
  entry, before the events that follow;
- the API's hub hands a LOST to every follower when it reads that entry, and when its reads were further
  apart than half the stream's retention (entries may have been trimmed unread).
"""

from __future__ import annotations

import time
import uuid

import pytest

from contract.deltas import Delta
from contract.token_events import LOST_FIELD, EventPublisher, decode, stream_key
from webapi.hub import LOST, Hub


@pytest.fixture()
def prefix(settings):
    return f"{settings.redis_key_prefix}{uuid.uuid4().hex[:8]}:"


def entries(redis_client, prefix: str) -> list[dict]:
    return [fields for _, fields in redis_client.xrange(stream_key(prefix))]


def wait_for(condition, seconds: float = 5.0):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if value := condition():
            return value
        time.sleep(0.02)
    raise AssertionError("not within the time")


def test_a_publisher_that_could_not_send_announces_the_loss_before_what_follows(redis_client, prefix):
    key = stream_key(prefix)
    redis_client.set(key, "not a stream")  # every XADD fails (WRONGTYPE): the publisher drops its events
    publisher = EventPublisher(redis_client, prefix, retention_seconds=60).start()
    try:
        publisher.step([("a" * 32, Delta(0, [1], 0, "x"))])
        wait_for(lambda: publisher._failing)  # its thread tried, and dropped the step
        assert redis_client.type(key) == b"string"
        redis_client.delete(key)  # Redis takes events again
        publisher.step([("a" * 32, Delta(1, [2], 1, "y"))])
        got = wait_for(lambda: entries(redis_client, prefix))
    finally:
        publisher.close()
    assert list(got[0]) == [LOST_FIELD]
    assert decode(got[1][b"a" * 32]) == Delta(1, [2], 1, "y")


def test_a_publisher_that_never_failed_sends_no_loss(redis_client, prefix):
    publisher = EventPublisher(redis_client, prefix, retention_seconds=60).start()
    try:
        publisher.step([("b" * 32, Delta(0, [1], 0, "x"))])
        got = wait_for(lambda: entries(redis_client, prefix))
    finally:
        publisher.close()
    assert [list(fields) for fields in got] == [[b"b" * 32]]


def test_the_hub_hands_a_loss_to_every_follower(settings, redis_client, prefix):
    hub = Hub(settings.redis_url, prefix)
    first, second = hub.subscribe("c" * 32), hub.subscribe("d" * 32)
    redis_client.xadd(stream_key(prefix), {"c" * 32: b'[0,[5],0,"z",null]'})
    redis_client.xadd(stream_key(prefix), {LOST_FIELD: b"lost"})
    got = first.take(5.0)
    if len(got) < 2:
        got += first.take(5.0)
    assert got == [Delta(0, [5], 0, "z"), LOST]
    assert second.take(5.0) == [LOST]  # it follows another job: the loss only


def test_a_hub_whose_reads_were_too_far_apart_for_the_retention_tells_its_followers(settings, prefix):
    """Retention 0.2 s: a read that waited out its 1 s block may have missed trimmed entries."""
    hub = Hub(settings.redis_url, prefix, retention_seconds=0.2)
    inbox = hub.subscribe("e" * 32)
    assert inbox.take(5.0) == [LOST]
    quiet = Hub(settings.redis_url, f"{prefix}quiet:")  # the default retention: no such loss in 1.5 s
    assert quiet.subscribe("e" * 32).take(1.5) == []
