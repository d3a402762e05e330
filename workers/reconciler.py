"""The reconciler, run by `celery -A workers beat` in its own process (workers/beat.py): recovery every
RECONCILE_INTERVAL seconds, which nothing the jobs do can delay.

Postgres is the source of truth; Redis only says "job X is ready". `recover` mends the ways they disagree:

- a job committed but never sent to Redis (the API died, or Redis was down), or handed back and not sent
  (its worker died in between): sent once `enqueue_grace_seconds` passed;
- a job whose worker died while it ran (its lease expired): back to `queued`, keeping its tokens, and sent
  again at the head of its priority; the next worker resumes from those tokens;
- a job whose message a worker took from Redis and never claimed (the worker died in between): sent again
  a lease after it was taken (workers/unclaimed.py), not after kombu's visibility timeout (an hour);
- Redis lost its data (restarted without persistence), taking the messages of queued jobs with it. The
  reconciler keeps a marker key in Redis (holding the time of its last run: `python -m workers.beat
  --check` reads it); when the marker is gone, every queued job is sent again. (A queued job sent
  `resend_after_seconds` ago and still unclaimed is also sent again, a last safety net.)

Extra messages are harmless (a claim only succeeds on a queued job), so a race between two reconcilers, or
with a slow worker, costs a message at most.

`maintain` finalizes the Batch API's batches whose jobs have all ended (writes their output and error files:
jobstore/batches.py), so a batch completes even if nobody polls it, ends as `expired` the batches still in
progress past their expires_at (their unfinished jobs cancelled, code batch_expired), and, with
JOB_RETENTION_DAYS set, deletes finished jobs older than that, in batches of PURGE_BATCH rows (one short
transaction each), at most once every PURGE_EVERY_SECONDS.
"""

from __future__ import annotations

import logging
import time

import redis
from celery import Celery
from sqlalchemy.orm import Session, sessionmaker

from batching.tokenizer import load_tokenizer  # no model code: names the tokens of log probabilities
from contract.dispatch import model_queue, send_job, send_to_head
from contract.fleet import live_workers
from contract.redis_client import redis_client
from contract.settings import WorkerSettings
from jobstore import batches, jobs
from workers.unclaimed import unclaimed_jobs

log = logging.getLogger(__name__)
PURGE_EVERY_SECONDS = 3600  # finished_at has no index: a purge reads the table, so not every run
PURGE_BATCH = 1000  # rows deleted per transaction
PURGE_MAX_BATCHES = 50  # per run; a run that stops there leaves the rest to the next run


def reconcile(sessions: sessionmaker[Session], celery: Celery, settings: WorkerSettings) -> dict[str, int]:
    """`recover` and then `maintain` (beat runs them apart, each at its own pace); their counts."""
    return recover(sessions, celery, settings) | maintain(sessions, settings)


def recover(sessions: sessionmaker[Session], celery: Celery, settings: WorkerSettings) -> dict[str, int]:
    """Requeue jobs with expired leases, and send every queued job whose message is missing; the counts."""
    with _redis(settings) as client:
        redis_lost = not client.exists(marker_key(settings))
        with sessions.begin() as session:
            if not jobs.try_reconciler_lock(session):
                log.info("reconciler: another run holds the lock; skipping")
                return {"requeued": 0, "unclaimed": 0, "sent": 0, "resent": 0}
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
            unclaimed = [] if redis_lost else unclaimed_jobs(session, client, settings)
            unsent = jobs.unsent_jobs(session, 0.0 if redis_lost else settings.enqueue_grace_seconds)
            # each job goes to its model's queue (`generate` for the fleet's default model)
            models = jobs.models_of(session, [job_id for job_id, _ in requeued + unclaimed + unsent])
        queue = {job_id: model_queue(settings, model) for job_id, model in models.items()}
        # sent only once committed: a worker taking a message at once must find the job queued. Jobs taken
        # from the queue before go back to the head of their priority, new ones to the tail.
        recovered = dict(requeued + unclaimed)
        for job_id, priority in recovered.items():
            send_to_head(celery, client, settings, job_id, priority, queue[job_id])
        for job_id, priority in unsent:
            if job_id not in recovered:
                send_job(celery, job_id, priority, queue[job_id])
        sent = recovered.keys() | {job_id for job_id, _ in unsent}
        with sessions.begin() as session:
            jobs.mark_enqueued(session, list(sent))
        client.set(marker_key(settings), repr(time.time()))
    if requeued:
        log.info(
            "reconciler: %d jobs requeued after their lease expired (%s)",
            len(requeued),
            ", ".join(str(job_id) for job_id, _ in requeued[:10]),
        )
    if unclaimed:
        log.warning(
            "reconciler: %d jobs taken from Redis and never claimed (their worker died?) sent again (%s)",
            len(unclaimed),
            ", ".join(str(job_id) for job_id, _ in unclaimed[:10]),
        )
    if sent:
        log.info("reconciler: %d jobs sent to Redis", len(sent))
    return {"requeued": len(requeued), "unclaimed": len(unclaimed), "sent": len(sent), "resent": forgotten}


def maintain(sessions: sessionmaker[Session], settings: WorkerSettings) -> dict[str, int]:
    """Expire and finalize batches, and purge old jobs when due; the counts."""
    expired = expire_batches(sessions, settings)
    finalized = finalize_batches(sessions, settings)
    purged = purge_old_jobs(sessions, settings) if _purge_due(settings) else 0
    return {"expired": expired, "finalized": finalized, "purged": purged}


def last_run(settings: WorkerSettings) -> float | None:
    """When `recover` last ran against this Redis (time.time()), or None if it never did."""
    with _redis(settings) as client:
        value = client.get(marker_key(settings))
    try:
        return float(value) if value is not None else None
    except ValueError:  # a marker from before it held the time
        return None


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
            finalized += batches.finalize_batch(session, batch_id, batch_models(settings))
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
            cancelled = batches.expire_batch(session, batch_id, batch_models(settings))
        if cancelled is not None:
            expired += 1
            log.info("reconciler: batch %s expired; %d unfinished jobs cancelled", batch_id, cancelled)
    return expired


def batch_models(settings: WorkerSettings) -> batches.ModelOf:
    """A batch job's model (None: the fleet's default) -> (the name its output line gives, its tokenizer):
    this process's MODEL for its own served name, else the checkpoint a live worker of that model announces."""

    def model_of(name: str | None) -> tuple[str, object]:
        name = name or settings.fleet_default_model()
        if name == settings.served_model_name():
            return name, load_tokenizer(settings.model)
        with _redis(settings) as client:
            live = live_workers(client, settings.redis_key_prefix)
        checkpoint = next((w.model for w in live if w.name == name), None)
        return name, None if checkpoint is None else load_tokenizer(checkpoint)  # None: tokens by id

    return model_of


def marker_key(settings: WorkerSettings) -> str:
    return f"{settings.redis_key_prefix}genq:reconciler-marker"


def _redis(settings: WorkerSettings) -> redis.Redis:
    return redis_client(settings.redis_url, timeout=5)


def _purge_key(settings: WorkerSettings) -> str:
    return f"{settings.redis_key_prefix}genq:retention-purged"


def _purge_due(settings: WorkerSettings) -> bool:
    """True at most once per PURGE_EVERY_SECONDS (whichever worker runs the reconciler), if retention is on."""
    if settings.job_retention_days is None:
        return False
    with _redis(settings) as client:
        return bool(client.set(_purge_key(settings), "1", nx=True, ex=PURGE_EVERY_SECONDS))


def _purge_again_next_run(settings: WorkerSettings) -> None:
    with _redis(settings) as client:
        client.delete(_purge_key(settings))
