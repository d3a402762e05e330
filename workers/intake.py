"""Intake: how a worker takes jobs from Redis. As many as its engine can use, and never less urgent ones
while more urgent ones wait.

A Celery task thread takes one message (`take`): it claims the job in Postgres and adds it to the job
book, which submits it to the engine; the task then returns, so holding a job costs no thread. Before the
thread is given its next message (in `task_postrun`, before the late ack lets Celery fetch another), it
waits in `wait_for_room` until one of these holds:

- **room**: the worker holds fewer than `capacity` jobs (its engine's `max_num_seqs` plus a small
  reserve that waits in the engine, ready to start the moment a slot frees);
- **more urgent work waits in Redis**: a watcher thread reads the lengths of the per-priority lists
  (one pipelined round trip of `LLEN`s every `queue_watch_interval`) while the worker is full, and
  releases one thread when a waiting priority would be admitted (workers/admission.py). Celery's
  consumer takes the most urgent message first; taking it, the worker hands its least urgent held job
  back to the queue (tokens saved, lease dropped, re-sent at its own priority).

So `--concurrency` is the number of messages a worker takes at once (claims in flight), not how many jobs
it holds; a few are enough. A message that arrives when it is no longer wanted (another worker took the
urgent job first) is sent back to the queue unclaimed.

A backlog does not go through Celery one message at a time: while Celery's consumer consumes `generate`
(a `cancel_consumer` pauses this too) and the worker has room, a puller thread takes up to `INTAKE_PULL`
messages at once from the most urgent non-empty list (one BLMPOP, contract.dispatch.take_messages) and
claims them in one statement (jobs.claim_jobs), the room they fill kept for them meanwhile. A Celery
message costs the worker ~2 ms of CPU (kombu's delivery and acknowledgement bookkeeping, the task's trace,
a claim of its own); a pulled one a small fraction of that. A worker killed between the pull and the claim
leaves jobs that the reconciler sends again (workers/unclaimed.py), as for a message Celery took.

    Redis ──message──▶ take(): claim ─▶ JobBook.add ─▶ engine      watcher: LLEN generate, generate:1..9
          ──up to INTAKE_PULL──▶ puller: claim all ─┘
                       wait_for_room() ◀── room or urgent ◀──────────────┘
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable
from datetime import datetime, timezone

import redis
from sqlalchemy.orm import Session, sessionmaker
from tenacity import Retrying, before_sleep_log, retry_if_exception_type, stop_after_delay, wait_exponential

from contract.dispatch import QUEUE, queue_key, take_messages
from contract.settings import WorkerSettings
from jobstore import jobs
from jobstore.models import Job, JobStatus
from workers import admission, metrics
from workers.job_book import DB_DOWN, JobBook
from workers.outcomes import Outcome

log = logging.getLogger(__name__)


class Intake:
    def __init__(
        self,
        book: JobBook,
        sessions: sessionmaker[Session],
        settings: WorkerSettings,
        worker_id: str,
        send: Callable[[uuid.UUID, int], None],
        capacity: int,
    ):
        self.capacity = capacity
        self._book, self._sessions, self._settings = book, sessions, settings
        self._worker_id, self._send = worker_id, send
        # two conditions on the book's lock, so that a freed slot wakes one task thread, not every waiter
        self._room = threading.Condition(book.lock)  # task threads in wait_for_room
        self._look = threading.Condition(book.lock)  # the watcher
        book.on_change = self._changed
        self._closing = False
        self._waiting = 0  # task threads in wait_for_room
        self._released = 0  # threads let go whose next message has not started yet
        self._urgent: int | None = None  # a waiting priority the watcher found admissible
        self._claiming: dict[
            str, admission.Held
        ] = {}  # by lease: taken, being claimed; their places are kept
        self._redis = redis.Redis.from_url(settings.redis_url, socket_timeout=5, socket_connect_timeout=5)
        self._watcher = threading.Thread(target=self._watch, name="queue-watcher", daemon=True)
        self._pulled = threading.Condition(book.lock)  # the puller
        self._pulling = 0  # room kept for the messages of a pull in flight
        self._consuming: Callable[[], bool] = lambda: False
        self._puller: threading.Thread | None = None

    def start(self) -> Intake:
        metrics.set_intake(0, self.capacity)
        self._watcher.start()
        return self

    def pull(self, consuming: Callable[[], bool]) -> None:
        """Start the puller (INTAKE_PULL > 0): it takes messages while `consuming()` (Celery's consumer
        consumes `generate`) and the worker has room."""
        if self._settings.intake_pull > 0:
            with self._room:
                self._consuming = consuming
                self._puller = threading.Thread(target=self._pull_loop, name="queue-puller", daemon=True)
                self._puller.start()
                self._room.notify_all()

    def close(self) -> None:
        """Stop taking jobs: waiting threads return, messages taken from now on go back unclaimed."""
        with self._room:
            self._closing = True
            self._room.notify_all()
            self._look.notify_all()
            self._pulled.notify_all()

    # --- a task thread's message ---------------------------------------------------------------------

    def message_started(self) -> None:
        """A task (any) started: one released thread got its message."""
        with self._room:
            self._released = max(0, self._released - 1)
            self._look.notify()

    def take(self, job_id: uuid.UUID, priority: int) -> Outcome | None:
        """Claim the job and hand it to the engine if the worker should hold it; None when it is held now."""
        # The lease is held by this claim, not by the process: if the lease lapses (a starved machine) and
        # the reconciler re-dispatches the job to this same worker, the new claim is another lease, so the
        # stale one's next write fails, and its request is aborted.
        lease = f"{self._worker_id}#{uuid.uuid4().hex[:8]}"
        with self._room:
            wanted = not self._closing and self._admit(priority).take
            if wanted:  # its place is kept while it is claimed
                self._claiming[lease] = admission.Held(
                    lease, priority, datetime.now(timezone.utc), 0, pinned=True
                )
        if (
            not wanted
        ):  # shutting down, or full of work at least as urgent (another worker took what we woke for)
            self._send(job_id, priority)
            metrics.JOBS.labels(str(priority), Outcome.DECLINED.value).inc()
            log.info(
                "job %s sent back to the queue unclaimed (%s)",
                job_id,
                "shutting down" if self._closing else "full of work at least as urgent",
            )
            return Outcome.DECLINED
        try:
            job = self._write(self._claim, job_id, lease)
            if isinstance(job, str):
                log.info("job %s dropped (%s)", job_id, job)
                metrics.JOBS.labels(str(priority), Outcome.DROPPED.value).inc()
                return Outcome.DROPPED
            done = self._finish_without_engine(job, lease)
            if done is not None:
                return done
            _log_claim(job)
            with self._room:
                self._hold(job, lease)
        finally:
            with self._room:
                self._claiming.pop(lease, None)
                self._room.notify()  # a slot kept for a claim that came to nothing
                self._look.notify()
        return None

    def wait_for_room(self) -> None:
        """Block until the worker wants another message (room, or more urgent work waiting in Redis)."""
        with self._room:
            self._waiting += 1
            self._look.notify()  # the watcher looks at Redis only while a thread waits
            try:
                while not self._closing:
                    # the puller fills the room while it runs: a thread goes only for more urgent work then
                    if self._held() + self._released < self.capacity and not self._puller_runs():
                        break
                    if self._urgent is not None and self._released == 0:
                        self._urgent = None
                        break
                    self._room.wait()
                self._released += 1
            finally:
                self._waiting -= 1

    # --- helpers -------------------------------------------------------------------------------------

    def _slots(self) -> list[admission.Held]:
        return self._book.slots() + list(self._claiming.values())

    def _admit(self, priority: int) -> admission.Admission:
        if self._held() < self.capacity:  # what admit() answers, without listing every held job
            return admission.Admission(True)
        return admission.admit(
            self._slots(), priority, capacity=self.capacity, max_handbacks=self._settings.max_handbacks
        )

    def _hold(self, job: Job, lease: str) -> None:
        """(lock held) Hold a claimed job (its place was kept while it was claimed). Admission is decided
        again with the row's own priority (the message's may differ) and what is held now: the least urgent
        held job may have to go back to the queue to make room."""
        del self._claiming[lease]
        victim = self._admit(job.priority).victim
        self._book.add(job, lease)
        if self._closing:  # closed while it was claimed: back to the queue with the rest
            self._book.hand_back(lease, Outcome.HANDED_BACK)
        elif victim is not None and (moved := self._book.hand_back(victim)) is not None:
            log.info(
                "job %s (priority %d) takes the place of job %s (priority %d): handing it back",
                job.id,
                job.priority,
                moved.job.id,
                moved.job.priority,
            )
        metrics.set_intake(len(self._book), self.capacity)

    def _changed(self) -> None:
        """A job left the book (lock held): the puller, or else a waiting thread, may have room now."""
        metrics.set_intake(len(self._book), self.capacity)
        self._wake_for_room()

    def _wake_for_room(self) -> None:
        """(lock held) Room may have freed: wake the one that fills it (a task thread woken while the puller
        runs would only go back to waiting: a thread switch for nothing)."""
        if self._puller_runs():
            self._pulled.notify()
        else:
            self._room.notify()

    def _claim(self, session: Session, job_id: uuid.UUID, lease: str) -> Job | str:
        """The claimed job, or why it was not claimed."""
        job = jobs.claim_job(session, job_id, lease, self._settings.lease_seconds)
        if job is None:
            current = jobs.get_job(session, job_id)
            return JobStatus(current.status).value if current else "no such job"
        return job

    def _finish_without_engine(self, job: Job, lease: str) -> Outcome | None:
        """A claimed job the engine need not see: an invalid row (failed), or one whose every token was saved."""
        try:
            jobs.check_job_row(job, self._settings.max_model_len)
        except ValueError as exc:
            log.error("job %s has an invalid row; failing it: %s", job.id, exc)
            self._write(
                jobs.fail_job,
                job.id,
                lease,
                code="invalid_job",
                message=f"the stored job is not valid: {exc}",
            )
            metrics.job_done(job, None, Outcome.FAILED, error_code="invalid_job")
            return Outcome.FAILED
        if len(job.output_token_ids) == job.max_tokens:  # the last run saved every token, then died
            self._write(
                jobs.finish_job,
                job.id,
                lease,
                token_ids=list(job.output_token_ids),
                text=job.output_text,
                finish_reason="length",
                prompt_tokens=job.prompt_tokens or 0,
            )
            log.info("job %s succeeded (every token was saved before)", job.id)
            metrics.job_done(job, None, Outcome.SUCCEEDED)
            return Outcome.SUCCEEDED
        return None

    def _write(self, fn: Callable, *args, **kwargs):
        """`fn(session, *args, **kwargs)` in a session of its own, retried with exponential backoff (each try
        a new session) while the database is unreachable."""

        def once():
            with self._sessions() as session:
                return fn(session, *args, **kwargs)

        try:  # the common case, without building a Retrying
            return once()
        except DB_DOWN:
            pass
        retrying = Retrying(
            retry=retry_if_exception_type(DB_DOWN),
            wait=wait_exponential(multiplier=0.1, max=2.0),
            stop=stop_after_delay(self._settings.db_retry_seconds),
            reraise=True,
            before_sleep=before_sleep_log(log, logging.WARNING),
        )
        return retrying(once)

    # --- the watcher thread ----------------------------------------------------------------------------

    def _watch(self) -> None:
        """While a thread waits and the worker is full, look for more urgent work in Redis."""
        interval = self._settings.queue_watch_interval
        while True:
            with self._look:
                while not self._closing and not self._should_look():
                    self._look.wait(1.0)
                if self._closing:
                    return
                priorities = [slot.priority for slot in self._slots()]
                if not priorities:  # full of pulled messages not claimed yet: nothing held to hand back
                    self._look.wait(interval)
                    continue
                least_urgent = max(priorities)
            try:
                lengths = self._queue_lengths(range(least_urgent))
            except redis.RedisError as exc:
                log.warning("queue watcher: Redis unavailable (%s)", exc.__class__.__name__)
                lengths = {}
            with self._look:
                for priority in sorted(p for p, n in lengths.items() if n):
                    if self._should_look() and self._admit(priority).take:
                        self._urgent = priority
                        self._room.notify()
                        break
                self._look.wait(interval)

    def _should_look(self) -> bool:
        return (
            self._waiting > 0
            and self._released == 0
            and self._urgent is None
            and 0 < self.capacity <= self._held()
        )

    def _held(self) -> int:
        return len(self._book) + len(self._claiming) + self._pulling

    # --- the puller thread -----------------------------------------------------------------------------

    def _puller_runs(self) -> bool:
        return self._puller is not None and self._consuming()

    def _room_to_pull(self) -> int:
        if self._closing or not self._consuming():
            return 0
        return min(self._settings.intake_pull, self.capacity - self._held() - self._released)

    def _pull_loop(self) -> None:
        """While there is room, take messages from Redis many at a time, and hold their jobs."""
        while True:
            with self._pulled:
                while not self._closing and (room := self._room_to_pull()) <= 0:
                    self._pulled.wait(0.5)  # woken when a job leaves; `consuming()` is looked at each time
                if self._closing:
                    return
                self._pulling = room
            try:
                taken = take_messages(self._redis, self._settings, room, timeout=1.0)
            except redis.RedisError as exc:
                log.warning("queue puller: Redis unavailable (%s)", exc.__class__.__name__)
                taken = []
                time.sleep(1.0)
            try:
                self._hold_taken(taken)
            except Exception:  # the jobs stay queued; the reconciler sends them again (workers/unclaimed.py)
                log.exception("queue puller: %d jobs taken from Redis and not claimed", len(taken))

    def _hold_taken(self, taken: list[tuple[uuid.UUID | None, int]]) -> None:
        """Claim the jobs of pulled messages in one statement and hand them to the engine (their room was kept
        by `_pulling`); a message for a job not queued any more is dropped, as `take` drops it."""
        now, claims, seen = datetime.now(timezone.utc), [], set()
        with self._room:
            self._pulling = 0
            if taken and (self._closing or not self._consuming()):
                # shutting down, or Celery's consumer was cancelled during the pull: back to the head of
                # their lists, unclaimed, the last first (so the first is next again)
                for job_id, priority in reversed(taken):
                    if job_id is not None:
                        self._send(job_id, priority)
                return
            declined = []
            for job_id, priority in taken:
                if job_id is None or job_id in seen:
                    log.warning("queue puller: a message naming no job (or a job twice) dropped")
                    continue
                seen.add(job_id)
                # decided as `take` decides: the room kept for this pull may have gone meanwhile to a message
                # Celery's consumer delivered (the BLMPOP waits up to its timeout), so a message that came
                # after may find the worker full of work at least as urgent
                if not self._admit(priority).take:
                    declined.append((job_id, priority))
                    continue
                lease = f"{self._worker_id}#{uuid.uuid4().hex[:8]}"
                self._claiming[lease] = admission.Held(lease, priority, now, 0, pinned=True)
                claims.append((job_id, lease, priority))
            for job_id, priority in reversed(declined):  # back to the head, the first next again
                self._send(job_id, priority)
                metrics.JOBS.labels(str(priority), Outcome.DECLINED.value).inc()
            if declined:
                log.info(
                    "queue puller: %d jobs sent back unclaimed (full of work at least as urgent)",
                    len(declined),
                )
        if not claims:
            return
        try:
            if len(claims) == 1:  # a trickle, not a backlog: the one-job claim is the cheaper statement
                ((job_id, lease, _),) = claims
                one = self._write(jobs.claim_job, job_id, lease, self._settings.lease_seconds)
                found = [] if one is None else [one]
            else:
                found = self._write(
                    jobs.claim_jobs, [(j, lease) for j, lease, _ in claims], self._settings.lease_seconds
                )
            claimed = {job.id: job for job in found}
            for job_id, lease, priority in claims:
                job = claimed.get(job_id)
                if job is None or job.worker_id != lease:
                    log.info("job %s dropped (not queued)", job_id)
                    metrics.JOBS.labels(str(priority), Outcome.DROPPED.value).inc()
                    continue
                if self._finish_without_engine(job, lease) is not None:
                    continue
                _log_claim(job)
                with self._room:
                    self._hold(job, lease)
        finally:
            with self._room:
                for _, lease, _ in claims:
                    self._claiming.pop(lease, None)
                if not self._puller_runs():  # the puller itself takes the room of a claim that failed
                    self._room.notify()
                if self._should_look():
                    self._look.notify()

    def _queue_lengths(self, priorities) -> dict[int, int]:
        """Messages waiting in the queue's Redis list of each priority, in one round trip."""
        priorities = list(priorities)
        if not priorities:
            return {}
        pipe = self._redis.pipeline(transaction=False)
        for p in priorities:
            pipe.llen(queue_key(self._settings, QUEUE, p))
        return dict(zip(priorities, pipe.execute()))


def _log_claim(job: Job) -> None:
    log.info(
        "job %s claimed: priority %d, attempt %d%s",
        job.id,
        job.priority,
        job.attempts,
        f", resuming after {len(job.output_token_ids)} tokens" if job.output_token_ids else "",
    )
