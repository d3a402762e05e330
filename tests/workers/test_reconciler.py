"""workers/reconciler.py against a database and a Redis namespace of its own: what it tells an operator
on a first start and after Redis lost its data, and the retention purge (JOB_RETENTION_DAYS)."""

from __future__ import annotations

import logging
import subprocess
import sys
import uuid
from collections.abc import Iterator
from datetime import timedelta

import pytest
import redis
from sqlalchemy import func, select, update

from jobstore import jobs
from jobstore.db import create_database_if_missing, drop_database, make_engine, make_session_factory
from jobstore.dispatch import make_celery
from jobstore.keys import create_key, tenant_for_key
from jobstore.models import Batch, BatchStatus, Job, JobStatus
from tests.conftest import ROOT, job_request, settings_env
from workers import reconciler

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
        return tenant_for_key(s, create_key(s, f"t-{uuid.uuid4().hex[:8]}")).id


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
    (warning,) = [r for r in caplog.records if r.levelno == logging.WARNING]
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
