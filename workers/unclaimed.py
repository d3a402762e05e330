"""Queued jobs whose message left Redis but that nobody claimed: the reconciler sends them again.

A worker's intake takes a job's message out of its Redis list (with others, in one LMPOP or BLMPOP:
workers/intake.py) and claims the job in Postgres, milliseconds later. A worker killed in between leaves the
job `queued`, recorded as sent, and its message gone. Nothing else would send such a job again, so each
reconciler run looks for them, without reading whole queues:

- for each priority, one MULTI reads the length of its list and the HEAD messages next in line;
- a list that short is read whole: a queued job of that priority sent before this run began and named by
  no waiting message has left its list;
- in a longer list, messages wait in the order they were sent (pushed at the tail; a job handed back or
  declined is moved to the head, see contract.dispatch.move_to_head), and a worker takes them from among the
  HEAD messages at the head (the first ones, or under SCHEDULING_POLICY=predicted any of them:
  workers/queue_order.py), so a queued job sent before the job named farthest from the head (less MARK_SLACK:
  the API records sends in batches) and named by none of them has left it. Counting from the farthest rather
  than the nearest, a job taken from behind long jobs that are passed over is found as soon as it would be had it
  been taken at the head.

Such a job is *unclaimed*. A live worker claims within milliseconds of taking a message, so a job still
unclaimed a lease later (what a worker that stops renewing its lease is given) was taken by a dead worker:
after a last check that no message anywhere in its list names it (jobs moved to the head can make the
order above look older than it is), it is sent again, at the head of its priority. When each job was first
found unclaimed is kept in a Redis hash, so the grace spans runs and reconcilers. The bound: a lease and
two reconciler intervals after the message was taken, or after the job's send was recorded when that came
later (a job counts as sent once recorded: the API records sends every 0.5 s, webapi/sent_marks.py). A job sent again whose first message survives (a live
worker slow to claim) has two; the second finds it claimed and is dropped.
"""

from __future__ import annotations

import time
import uuid
from datetime import datetime, timedelta

import redis
from sqlalchemy.orm import Session

from contract import dispatch
from contract.settings import WorkerSettings
from jobstore import jobs
from workers.queue_order import WINDOW

# messages read at the head of each priority's list per run (a list this short is read whole): every message a
# worker may take (its window), so the one farthest from the head was sent after any job taken from before it
HEAD = WINDOW
MARK_SLACK = timedelta(seconds=2)  # how far a job's recorded send time may trail its send


def unclaimed_jobs(
    session: Session, client: redis.Redis, settings: WorkerSettings
) -> list[tuple[uuid.UUID, int]]:
    """(id, priority) of the queued jobs taken from Redis and left unclaimed for a lease: to be sent again. Each
    model's queue is looked at apart (the models of the queued jobs; the fleet's default always).

    Call it in the reconciler's transaction: the lists are read after it began (SQL `now()`), so a job
    recorded as sent before then was in its list when it was read, unless a worker had taken it."""
    default = settings.fleet_default_model()
    models = {default} | {model or default for model in jobs.queued_models(session)}
    found: list[tuple[uuid.UUID, int]] = []
    for model in sorted(models):
        served = jobs.ServedModel(model, is_default=model == default)
        found += _unclaimed_of(session, client, settings, served)
    return found


def _unclaimed_of(
    session: Session, client: redis.Redis, settings: WorkerSettings, model: jobs.ServedModel
) -> list[tuple[uuid.UUID, int]]:
    """unclaimed_jobs for one model's queue."""
    queue = dispatch.model_queue(settings, model.name)
    waiting = dispatch.waiting_jobs(client, settings, HEAD, queue)
    named = {job_id for _, ids in waiting.values() for job_id in ids}
    sent = jobs.sent_at(
        session, [job_id for length, ids in waiting.values() if length > HEAD for job_id in ids]
    )
    cutoffs: dict[int, datetime | None] = {}
    for priority, (length, ids) in waiting.items():
        if length <= HEAD:  # read whole: every job sent before this run and not in it has left it
            cutoffs[priority] = None
        elif times := [sent[job_id] for job_id in ids if job_id in sent]:
            # the job farthest from the head: moved-to-head jobs (sent later) are nearer, and a job sent after it
            # can only be behind it; a job looking taken that still waits is found by the last look (_past_grace)
            cutoffs[priority] = times[-1] - MARK_SLACK
        # else: the head names no queued job (stale duplicates); nothing is known of the order this run
    found = jobs.sent_before(session, cutoffs, excluded=named, model=model)
    long_lists = {p for p, (length, _) in waiting.items() if length > HEAD}
    return _past_grace(client, settings, found, long_lists, queue)


def _past_grace(
    client: redis.Redis,
    settings: WorkerSettings,
    found: list[tuple[uuid.UUID, int]],
    long_lists: set[int],
    queue: str = dispatch.QUEUE,
) -> list[tuple[uuid.UUID, int]]:
    """The jobs of `found` first found unclaimed a lease ago or more, and in no list; remembers the others."""
    # one hash per queue: each model's run keeps its own jobs' first sightings
    suffix = "" if queue == dispatch.QUEUE else f":{queue}"
    key, now = f"{settings.redis_key_prefix}genq:unclaimed{suffix}", time.time()
    seen = {uuid.UUID(job.decode()): float(at) for job, at in client.hgetall(key).items()}
    first = {job_id: seen.get(job_id, now) for job_id, _ in found}
    due = [(job_id, p) for job_id, p in found if now - first[job_id] >= settings.lease_seconds]
    waiting: set[uuid.UUID] = set()
    for p in {p for _, p in due} & long_lists:
        waiting |= dispatch.jobs_in_queue(
            client, settings, p, [job_id for job_id, q in due if q == p], queue=queue
        )
    for job_id in waiting:  # in its list after all: watched again from now
        first[job_id] = now
    due = [(job_id, p) for job_id, p in due if job_id not in waiting]
    for job_id, _ in due:
        del first[job_id]
    if first != seen:
        with client.pipeline(transaction=True) as pipe:
            pipe.delete(key)
            if first:
                pipe.hset(key, mapping={str(job_id): at for job_id, at in first.items()})
            pipe.execute()
    return due
