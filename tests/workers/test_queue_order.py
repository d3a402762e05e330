"""workers/queue_order.py against the real schema: which waiting jobs of a class a worker takes first."""

from __future__ import annotations

import uuid
from datetime import datetime, timedelta, timezone

import pytest
from sqlalchemy import text as sql

from jobstore import jobs
from jobstore.keys import create_key
from tests.conftest import job_request, tenant_of
from workers.queue_order import QueueOrder

T0 = datetime(2026, 11, 1, tzinfo=timezone.utc)


@pytest.fixture()
def tenant(sessions):
    with sessions.begin() as s:
        return tenant_of(s, create_key(s, f"q-{uuid.uuid4().hex[:8]}")).id


def job(
    sessions, tenant_id, at: float, max_tokens: int, *, status="queued", output=0, deadline=None, done=None
):
    """A job of `tenant_id` created at T0 + `at` seconds with a 3-token prompt, `output` tokens saved (or made,
    if it finished at T0 + `done`), and a deadline at T0 + `deadline`."""
    with sessions.begin() as s:
        created, _ = jobs.create_job(s, tenant_id, job_request(max_tokens=max_tokens), prompt_tokens=3)
        s.execute(
            sql(
                "UPDATE jobs SET status = :status, created_at = :created, finished_at = :finished, "
                "output_token_ids = array_fill(7, ARRAY[:n]), deadline = :deadline WHERE id = :id"
            ),
            dict(
                status=status,
                created=T0 + timedelta(seconds=at),
                finished=None if done is None else T0 + timedelta(seconds=done),
                n=output,
                deadline=None if deadline is None else T0 + timedelta(seconds=deadline),
                id=created.id,
            ),
        )
        return created.id


def order(settings, sessions, named, count=None, now: float = 1000.0, **overrides):
    """The jobs a fresh worker (no costs remembered) takes from `named`, first first, at T0 + `now`."""
    clock = (T0 + timedelta(seconds=now)).timestamp
    chosen = QueueOrder(settings.replace(**overrides), sessions, clock).choose(named, count or len(named))
    assert chosen is not None
    return chosen


def test_shorter_predicted_work_is_taken_first_within_the_aging_bound(settings, sessions, tenant):
    """Place = creation + predicted cost x 0.02 s, moved back 30 s at most: short jobs sent after a long one
    are taken before it, until they were created more than the aging bound after it."""
    long = job(sessions, tenant, 0, 2000)  # 2,003 tokens: 40 s, capped at 30
    shorts = [job(sessions, tenant, 1 + i, 8) for i in range(3)]  # 11 tokens: 0.22 s
    late = job(sessions, tenant, 31, 8)  # created 31 s after the long job: its place is later
    named = [long, *shorts, late]
    assert order(settings, sessions, named, 2) == shorts[:2]
    assert order(settings, sessions, named) == [*shorts, long, late]
    assert order(settings, sessions, named, scheduling_aging_seconds=0.0) == named  # aging 0: first come


def test_the_tenants_history_predicts_the_output(settings, sessions, tenant):
    """A tenant whose jobs made 2 tokens each: its job of max_tokens 1,000 is predicted at 2 and goes ahead of
    another tenant's job of 100 sent before it (whose tenant has no history: its max_tokens)."""
    with sessions.begin() as s:
        other = tenant_of(s, create_key(s, f"o-{uuid.uuid4().hex[:8]}")).id
    for i in range(3):
        job(sessions, tenant, i, 1000, status="succeeded", output=2, done=i + 1)
    hundred = job(sessions, other, 10, 100)
    thousand = job(sessions, tenant, 11, 1000)
    assert order(settings, sessions, [hundred, thousand]) == [thousand, hundred]


def test_saved_tokens_count_and_a_deadline_at_risk_goes_first(settings, sessions, tenant):
    """A job resumed with most of its output saved costs what the engine computes again (prompt and saved
    tokens) and what is left: no less than a fresh one. A job whose deadline is at risk (predicted to be met with
    less than DEADLINE_MARGIN_SECONDS to spare) goes first, earliest first; a deadline that cannot be met any
    more, or is far, leaves the job in its place."""
    fresh = job(sessions, tenant, 0, 500)  # 503 tokens
    resumed = job(sessions, tenant, 1, 500, output=495)  # 3 + 495 saved + 5 left: 503, created later
    assert order(settings, sessions, [resumed, fresh]) == [fresh, resumed]
    short = job(sessions, tenant, 0, 8)
    # at T0 + 1000, 100 output tokens take 2 s: a deadline at 1004 leaves 2 s of slack (< 5): at risk
    risky = job(sessions, tenant, 5, 100, deadline=1004)
    risky_later = job(sessions, tenant, 4, 100, deadline=1006)
    lost = job(sessions, tenant, 6, 100, deadline=1001)  # 2 s needed, 1 s left: keeps its place
    far = job(sessions, tenant, 7, 100, deadline=2000)
    named = [short, far, lost, risky_later, risky]
    assert order(settings, sessions, named) == [risky, risky_later, short, lost, far]


def test_a_message_for_a_job_not_queued_is_taken_first_and_a_restarted_worker_takes_the_same_order(
    settings, sessions, tenant
):
    """A message whose job is not queued (cancelled, or run already) is taken first, to be dropped. The order
    comes from the rows alone: another QueueOrder (a restarted worker, with nothing remembered) gives the same."""
    long, short = job(sessions, tenant, 0, 2000), job(sessions, tenant, 1, 8)
    gone = job(sessions, tenant, 0, 8, status="cancelled")
    named = [long, short, gone, uuid.uuid4()]
    first = order(settings, sessions, named)
    assert set(first[:2]) == {gone, named[3]} and first[2:] == [short, long]
    assert order(settings, sessions, named) == first
    worker = QueueOrder(settings, sessions, (T0 + timedelta(seconds=1000)).timestamp)
    assert worker.choose([long, short], 1) == [short]
    assert worker.choose([long], 1) == [long]
