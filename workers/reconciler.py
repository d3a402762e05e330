"""The reconciler (run every RECONCILE_INTERVAL seconds by `celery -A workers beat`).

Postgres is the source of truth; Redis only says "job X is ready". Two ways they disagree are
mended here: a job committed but never sent to Redis (the API died, or Redis was down), and a job
whose worker died (its lease expired): it goes back to `queued`, keeping its tokens, and is sent
again; the next worker resumes from those tokens. A third: Redis lost its data (restarted without
persistence), taking the messages of queued jobs with it. The reconciler keeps a marker key in Redis;
when the marker is gone, every queued job is sent again. (A queued job whose message went missing
any other way is sent again `resend_after_seconds` after it was sent.) Extra messages are harmless (a claim only
succeeds on a queued job), so two reconcilers racing between commit and send cost nothing.

With JOB_RETENTION_DAYS set, it also deletes finished jobs older than that, in batches of
PURGE_BATCH rows (one short transaction each), at most once every PURGE_EVERY_SECONDS.

It also finalizes the Batch API's batches whose jobs have all ended (writes their output and error
files: jobstore/batches.py), so a batch completes even if nobody polls it, and ends as `expired` the
batches still in progress past their expires_at (their unfinished jobs cancelled, code batch_expired).
"""

from __future__ import annotations

import logging

import redis
from celery import Celery
from sqlalchemy.orm import Session, sessionmaker

from jobstore import batches, jobs
from jobstore.dispatch import send_job
from jobstore.settings import WorkerSettings

log = logging.getLogger(__name__)
PURGE_EVERY_SECONDS = 3600  # finished_at has no index: a purge reads the table, so not every run
PURGE_BATCH = 1000  # rows deleted per transaction
PURGE_MAX_BATCHES = 50  # per run; a run that stops there leaves the rest to the next run


def reconcile(sessions: sessionmaker[Session], celery: Celery, settings: WorkerSettings) -> dict[str, int]:
    """Requeue jobs with expired leases and send every queued job Redis never got; returns the counts."""
    redis_lost = not _marker_present(settings)
    with sessions.begin() as session:
        if not jobs.try_reconciler_lock(session):
            log.info("reconciler: another run holds the lock; skipping")
            return {"requeued": 0, "sent": 0}
        forgotten = jobs.forget_sent(session, 0.0 if redis_lost else settings.resend_after_seconds)
        if redis_lost and forgotten:
            log.warning(
                "reconciler: this Redis has no record of earlier runs (new, flushed, or restarted without "
                "persistence): sending the %d queued jobs it was given again, in case their messages are "
                "gone (a job runs once however many messages it gets)",
                forgotten,
            )
        elif redis_lost:
            log.info(
                "reconciler: first run on this Redis; no queued job was sent before it, nothing to resend"
            )
        requeued = jobs.requeue_expired(session)
        unsent = jobs.unsent_jobs(session, 0.0 if redis_lost else settings.enqueue_grace_seconds)
    # sent only once committed: a worker taking a message at once must find the job queued
    to_send = dict(requeued + unsent)
    for job_id, priority in to_send.items():
        send_job(celery, job_id, priority)
    with sessions.begin() as session:
        jobs.mark_enqueued(session, list(to_send))
    if to_send:
        log.info(
            "reconciler: %d jobs requeued after their lease expired (%s); %d jobs sent to Redis",
            len(requeued),
            ", ".join(str(job_id) for job_id, _ in requeued[:10]),
            len(to_send),
        )
    if redis_lost:
        _set_marker(settings)
    expired = expire_batches(sessions, settings)
    finalized = finalize_batches(sessions, settings)
    purged = purge_old_jobs(sessions, settings) if _purge_due(settings) else 0
    return {
        "requeued": len(requeued),
        "sent": len(to_send),
        "resent": forgotten,
        "expired": expired,
        "finalized": finalized,
        "purged": purged,
    }


def purge_old_jobs(
    sessions: sessionmaker[Session],
    settings: WorkerSettings,
    batch: int = PURGE_BATCH,
    max_batches: int = PURGE_MAX_BATCHES,
) -> int:
    """Delete jobs finished more than JOB_RETENTION_DAYS ago, `batch` rows per transaction; how many."""
    if settings.job_retention_days is None:
        return 0
    purged = 0
    for _ in range(max_batches):
        with sessions.begin() as session:
            deleted = jobs.purge_finished(session, settings.job_retention_days, batch)
        purged += deleted
        if deleted < batch:
            break
    else:  # more may be left: let the next run go on
        _purge_again_next_run(settings)
    if purged:
        log.info(
            "reconciler: deleted %d jobs finished more than %g days ago (JOB_RETENTION_DAYS)",
            purged,
            settings.job_retention_days,
        )
    return purged


def finalize_batches(sessions: sessionmaker[Session], settings: WorkerSettings) -> int:
    """Write the output files of the batches whose jobs have all ended (each in a transaction of its own,
    so one batch's failure leaves the others done); returns how many were finalized. GET /v1/batches/<id>
    does the same for the batch it reads: whichever comes first does it, the other passes by."""
    with sessions.begin() as session:
        ready = batches.ready_batches(session)
    finalized = 0
    for batch_id in ready:
        with sessions.begin() as session:
            finalized += batches.finalize_batch(session, batch_id, settings.model)
    if finalized:
        log.info("reconciler: %d batches finalized", finalized)
    return finalized


def expire_batches(sessions: sessionmaker[Session], settings: WorkerSettings) -> int:
    """End as `expired` the batches still in progress past their expires_at (each in a transaction of its
    own): their unfinished jobs are cancelled (a running one leaves its worker at its next progress write),
    and their output and error files written; returns how many batches expired."""
    with sessions.begin() as session:
        due = batches.expiring_batches(session)
    expired = 0
    for batch_id in due:
        with sessions.begin() as session:
            cancelled = batches.expire_batch(session, batch_id, settings.model)
        if cancelled is not None:
            expired += 1
            log.info("reconciler: batch %s expired; %d unfinished jobs cancelled", batch_id, cancelled)
    return expired


def _marker_key(settings: WorkerSettings) -> str:
    return f"{settings.redis_key_prefix}genq:reconciler-marker"


def _marker_present(settings: WorkerSettings) -> bool:
    """Whether the marker the reconciler left in Redis is still there (absent: Redis lost its data)."""
    with redis.Redis.from_url(settings.redis_url, socket_timeout=5, socket_connect_timeout=5) as client:
        return bool(client.exists(_marker_key(settings)))


def _set_marker(settings: WorkerSettings) -> None:
    with redis.Redis.from_url(settings.redis_url, socket_timeout=5, socket_connect_timeout=5) as client:
        client.set(_marker_key(settings), "1")


def _purge_key(settings: WorkerSettings) -> str:
    return f"{settings.redis_key_prefix}genq:retention-purged"


def _purge_due(settings: WorkerSettings) -> bool:
    """True at most once per PURGE_EVERY_SECONDS (whichever worker runs the reconciler), if retention is on."""
    if settings.job_retention_days is None:
        return False
    with redis.Redis.from_url(settings.redis_url, socket_timeout=5, socket_connect_timeout=5) as client:
        return bool(client.set(_purge_key(settings), "1", nx=True, ex=PURGE_EVERY_SECONDS))


def _purge_again_next_run(settings: WorkerSettings) -> None:
    with redis.Redis.from_url(settings.redis_url, socket_timeout=5, socket_connect_timeout=5) as client:
        client.delete(_purge_key(settings))
