"""workers/reconciler.py against a database and a Redis namespace of its own: what it tells an operator
on a first start and after Redis lost its data, the retention purge (JOB_RETENTION_DAYS), and jobs whose
message a worker took and never claimed (workers/unclaimed.py)."""

from __future__ import annotations

import logging
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from datetime import timedelta

import pytest
import redis
from sqlalchemy import func, select, update

from contract.dispatch import QUEUE, make_celery, queue_key, send_job, send_to_head, waiting_jobs
from jobstore import jobs
from jobstore.db import create_database_if_missing, drop_database, make_engine, make_session_factory
from jobstore.keys import create_key
from jobstore.models import Batch, BatchStatus, Job, JobStatus
from tests.conftest import ROOT, job_request, settings_env, tenant_of
from workers import reconciler, unclaimed

REQUEST = job_request()


@pytest.fixture
def fresh(settings):
    """Settings naming a new, empty database (alembic upgrade head) and a new Redis namespace."""
    run = uuid.uuid4().hex[:8]
    base, _, _ = settings.database_url.rpartition("/")
    st = settings.replace(
        database_url=f"{base}/genq_test_reconciler_{run}",
        redis_key_prefix=f"{settings.redis_key_prefix}reconciler-{run}:",
    )
    create_database_if_missing(st.database_url)
    engine = make_engine(st.database_url)
    client = redis.Redis.from_url(st.redis_url)
    try:
        subprocess.run(
            [sys.executable, "-m", "alembic", "upgrade", "head"],
            cwd=ROOT,
            env=settings_env(st),
            check=True,
            capture_output=True,
        )
        yield st, make_session_factory(engine)
    finally:
        engine.dispose()
        keys = list(client.scan_iter(match=f"{st.redis_key_prefix}*"))
        if keys:
            client.delete(*keys)
        client.close()
        drop_database(st.database_url)


@pytest.fixture
def celery(fresh) -> Iterator:
    app = make_celery(fresh[0])
    yield app
    app.close()


def new_tenant(sessions) -> uuid.UUID:
    with sessions.begin() as s:
        return tenant_of(s, create_key(s, f"t-{uuid.uuid4().hex[:8]}")).id


def new_job(sessions, tenant_id, status: JobStatus, age_days: float) -> uuid.UUID:
    """A job in `status`, created (and, if finished, finished) `age_days` ago."""
    with sessions.begin() as s:
        job, _ = jobs.create_job(s, tenant_id, REQUEST, prompt_tokens=3)
        then = func.now() - timedelta(days=age_days)
        s.execute(
            update(Job)
            .where(Job.id == job.id)
            .values(status=status, created_at=then, finished_at=then if status.finished else None)
        )
        return job.id


def remaining(sessions, ids) -> set[uuid.UUID]:
    with sessions.begin() as s:
        return set(s.scalars(select(Job.id).where(Job.id.in_(ids))))


def test_first_start_is_calm_and_a_lost_redis_is_explained(fresh, celery, caplog):
    st, sessions = fresh
    caplog.set_level(logging.INFO, logger="workers.reconciler")
    assert reconciler.reconcile(sessions, celery, st)["resent"] == 0
    first = [r for r in caplog.records if r.name == "workers.reconciler"]
    assert [r.levelno for r in first] == [logging.INFO] and "first run on this Redis" in first[0].getMessage()

    tenant = new_tenant(sessions)
    job = new_job(sessions, tenant, JobStatus.QUEUED, age_days=0)
    with sessions.begin() as s:
        jobs.mark_enqueued(s, [job])  # its message went to Redis ...
    redis.Redis.from_url(st.redis_url).delete(
        f"{st.redis_key_prefix}genq:reconciler-marker"
    )  # ... which lost it
    caplog.clear()
    assert reconciler.reconcile(sessions, celery, st)["resent"] == 1
    (warning,) = [  # the reconciler's own (another thread of this process may warn meanwhile)
        r for r in caplog.records if r.levelno == logging.WARNING and r.name == "workers.reconciler"
    ]
    assert (
        "no record of earlier runs" in warning.getMessage()
        and "sending the 1 queued jobs" in warning.getMessage()
    )
    caplog.clear()
    assert reconciler.reconcile(sessions, celery, st)["resent"] == 0  # marker back: nothing to say
    assert not [r for r in caplog.records if r.levelno >= logging.INFO and "Redis" in r.getMessage()]


def test_finished_jobs_past_retention_are_purged_in_batches(fresh, celery):
    st, sessions = fresh
    tenant = new_tenant(sessions)
    old = [new_job(sessions, tenant, status, age_days=8) for status in JobStatus if status.finished]
    recent = [new_job(sessions, tenant, JobStatus.SUCCEEDED, age_days=6)]
    live = [
        new_job(sessions, tenant, status, age_days=30) for status in (JobStatus.QUEUED, JobStatus.RUNNING)
    ]
    everything = old + recent + live

    kept_forever = reconciler.reconcile(sessions, celery, st)  # JOB_RETENTION_DAYS unset
    assert kept_forever["purged"] == 0 and remaining(sessions, everything) == set(everything)

    week = st.replace(job_retention_days=7)
    assert reconciler.purge_old_jobs(sessions, week, batch=2, max_batches=1) == 2  # one batch of two
    assert len(remaining(sessions, old)) == 1
    assert reconciler.reconcile(sessions, celery, week)["purged"] == 1  # the reconciler takes the rest
    assert remaining(sessions, everything) == set(recent + live)

    another = new_job(sessions, tenant, JobStatus.FAILED, age_days=8)
    assert reconciler.reconcile(sessions, celery, week)["purged"] == 0  # at most once an hour
    assert remaining(sessions, [another]) == {another}


def test_a_batch_job_is_purged_only_once_its_batch_has_ended(fresh, celery):
    """The Batch API writes a batch's output file from its jobs: retention must not take them first."""
    st, sessions = fresh
    tenant = new_tenant(sessions)
    job = new_job(sessions, tenant, JobStatus.SUCCEEDED, age_days=8)
    with sessions.begin() as s:
        s.add(
            Batch(
                id="batch_retention",
                tenant_id=tenant,
                status=BatchStatus.IN_PROGRESS,
                endpoint="/v1/completions",
                completion_window="24h",
                input_file_id="file_retention",
                priority=8,
            )
        )
        s.flush()
        s.execute(update(Job).where(Job.id == job).values(batch_id="batch_retention", batch_index=0))
    week = st.replace(job_retention_days=7)
    assert reconciler.purge_old_jobs(sessions, week) == 0 and remaining(sessions, [job]) == {job}
    with sessions.begin() as s:
        s.execute(update(Batch).where(Batch.id == "batch_retention").values(status=BatchStatus.COMPLETED))
    assert reconciler.purge_old_jobs(sessions, week) == 1 and remaining(sessions, [job]) == set()


def send(celery, sessions, job_ids, priority: int = 5, ago: float | None = None) -> None:
    """Send each job to Redis and record it as sent (`ago` seconds ago, oldest first, if given)."""
    for i, job_id in enumerate(job_ids):
        send_job(celery, job_id, priority)
        with sessions.begin() as s:
            jobs.mark_enqueued(s, [job_id])
            if ago is not None:
                sent = func.now() - timedelta(seconds=ago - i * 0.01)
                s.execute(update(Job).where(Job.id == job_id).values(enqueued_at=sent))


def next_in_line(st, client, priority: int = 5) -> list[uuid.UUID]:
    """The jobs of `priority` in the order workers will take them."""
    return waiting_jobs(client, st, limit=1000)[priority][1]


def test_jobs_a_dead_worker_left_go_back_to_the_queue(fresh, celery):
    """Where a worker can die with a job, and what the reconciler does: a job it ran (its lease lapses) goes back
    at once, at the head of its priority; one it handed back and had not sent yet is sent at once; one whose
    message it took from Redis and never claimed (kombu holds the message unacknowledged for an hour, or lost
    it) is sent again a lease later, at the head too."""
    st, sessions = fresh
    st = st.replace(lease_seconds=1.0)
    client = redis.Redis.from_url(st.redis_url)
    reconciler.recover(sessions, celery, st)  # its first run on this Redis
    tenant = new_tenant(sessions)
    # submitted a minute ago (a job just sent is left unsent for ENQUEUE_GRACE_SECONDS: the API records it)
    taken, crashed, waiting, handed = (
        new_job(sessions, tenant, JobStatus.QUEUED, age_days=1e-3) for _ in range(4)
    )
    send(celery, sessions, [taken, crashed, handed, waiting])
    with sessions.begin() as s:
        jobs.claim_job(s, crashed, "dead-worker#1", lease_seconds=-1)  # ran; its lease lapsed
        jobs.claim_job(s, handed, "dead-worker#2", lease_seconds=30)
        jobs.release_job(s, handed, "dead-worker#2", token_ids=[5], text="x")  # handed back, not sent
    for _ in range(3):  # the messages of `taken`, `crashed` and `handed`: taken by the worker
        client.rpop(queue_key(st, QUEUE, 5))
    assert next_in_line(st, client) == [waiting]

    first = reconciler.recover(sessions, celery, st)
    assert (first["requeued"], first["unclaimed"], first["sent"]) == (1, 0, 2)  # unclaimed: watched a lease
    assert next_in_line(st, client) == [crashed, waiting, handed]
    time.sleep(st.lease_seconds + 0.1)
    second = reconciler.recover(sessions, celery, st)
    assert (second["requeued"], second["unclaimed"], second["sent"]) == (0, 1, 1)
    assert next_in_line(st, client) == [taken, crashed, waiting, handed]
    time.sleep(st.lease_seconds + 0.1)
    assert reconciler.recover(sessions, celery, st)["sent"] == 0  # every message waits now: nothing more
    assert next_in_line(st, client) == [taken, crashed, waiting, handed]


def test_jobs_waiting_in_a_long_queue_are_never_sent_twice(fresh, celery):
    """In a list longer than the head the reconciler reads, the order of sends tells which jobs left it; jobs
    moved to the head (a worker shutting down hands many back) can make waiting jobs look taken, and a last
    look through the whole list keeps them from being sent twice. A job gone from the list is sent again."""
    st, sessions = fresh
    st = st.replace(lease_seconds=1.0)
    client = redis.Redis.from_url(st.redis_url)
    reconciler.recover(sessions, celery, st)
    tenant = new_tenant(sessions)
    backlog = [new_job(sessions, tenant, JobStatus.QUEUED, age_days=0) for _ in range(2 * unclaimed.HEAD)]
    send(celery, sessions, backlog, ago=60)
    handed_back = [new_job(sessions, tenant, JobStatus.QUEUED, age_days=0) for _ in range(unclaimed.HEAD + 6)]
    for job_id in handed_back:  # sent just now, each moved to the head
        send_to_head(celery, client, st, job_id, 5)
    with sessions.begin() as s:
        jobs.mark_enqueued(s, handed_back)
    lost = backlog[7]  # its message vanished from the middle of the list
    [message] = [m for m in client.lrange(queue_key(st, QUEUE, 5), 0, -1) if str(lost).encode() in m]
    client.lrem(queue_key(st, QUEUE, 5), 1, message)

    assert reconciler.recover(sessions, celery, st)["unclaimed"] == 0
    suspects = client.hgetall(f"{st.redis_key_prefix}genq:unclaimed")
    assert len(suspects) > 100  # the backlog looks taken, seen from the head ...
    time.sleep(st.lease_seconds + 0.1)
    assert reconciler.recover(sessions, celery, st)["unclaimed"] == 1  # ... only the lost job was
    line = next_in_line(st, client)
    assert line[0] == lost and sorted(line) == sorted(backlog + handed_back)
