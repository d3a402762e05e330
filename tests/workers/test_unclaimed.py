"""workers/unclaimed.py with the intake's window: a worker may take a message from anywhere among the HEAD at the
head of a list (workers/queue_order.py), so a job taken from behind jobs that are passed over, by a worker that
died before claiming it, must be found as soon as one taken at the head is."""

from __future__ import annotations

import time

import redis

from contract.dispatch import take_jobs
from jobstore.models import JobStatus
from tests.workers.test_reconciler import celery, fresh, new_job, new_tenant, next_in_line, send  # noqa: F401
from workers import reconciler, unclaimed


def test_a_job_taken_from_behind_waiting_jobs_and_never_claimed_is_sent_again(fresh, celery):  # noqa: F811
    """A list longer than HEAD, sent 10 ms apart; a dead worker took two jobs from within the window (the jobs
    ahead of them still wait, passed over as long ones are). Both are found unclaimed: the order of sends tells
    it from the job named farthest from the head, not the nearest (which a passed-over job keeps at the head
    however long it waits), less MARK_SLACK (2 s: 200 sends here). A lease later they are sent again, at the
    head; nothing else is."""
    st, sessions = fresh
    st = st.replace(lease_seconds=1.0)
    client = redis.Redis.from_url(st.redis_url)
    reconciler.recover(sessions, celery, st)
    tenant = new_tenant(sessions)
    backlog = [new_job(sessions, tenant, JobStatus.QUEUED, age_days=0) for _ in range(unclaimed.HEAD + 20)]
    send(celery, sessions, backlog, ago=60)  # 10 ms apart, oldest first
    middle, later = backlog[5], backlog[40]
    assert take_jobs(client, st, 5, [middle, later], unclaimed.HEAD) == [(middle, 5), (later, 5)]

    assert reconciler.recover(sessions, celery, st)["unclaimed"] == 0  # watched for a lease first
    time.sleep(st.lease_seconds + 0.1)
    assert reconciler.recover(sessions, celery, st)["unclaimed"] == 2
    line = next_in_line(st, client)
    assert set(line[:2]) == {middle, later} and line[2:] == [j for j in backlog if j not in (middle, later)]
    time.sleep(st.lease_seconds + 0.1)
    assert reconciler.recover(sessions, celery, st)["unclaimed"] == 0
