"""Intake: the one way a worker takes jobs from Redis. As many as its engine can use, and never less urgent ones
while more urgent ones wait.

One thread takes messages from its model's queue's priority lists (`generate` for the fleet's default model,
`generate.<name>` for another; contract/dispatch.py alone knows kombu's lists and message format), claims their
jobs (its model's only) in Postgres in one statement and adds them to the job book,
which submits them to the engine. Celery's own consumer does not consume `generate` (workers/tasks.py gives the
queue to the intake; workers/control.py makes `add_consumer` / `cancel_consumer generate` resume and pause it),
so no Celery task thread holds a message, and each job is one task in Flower, ended as the job ended
(workers/job_tasks.py). The thread does one of three things, decided under the book's lock:

- **room** (the worker holds fewer than its base: its engine's `max_num_seqs` plus a small reserve that waits in
  the engine, ready to start the moment a slot frees; WorkerSettings.worker_base_capacity): one BLMPOP takes up to
  `INTAKE_PULL` messages, at most the room to its base, from the most urgent non-empty list, waiting up to a
  second while every list is empty. Asking no more than the base, workers waiting together share one push of
  many jobs;
- **beyond its base** (below `capacity`: SCHEDULING_POLICY=preemptive holds 3x `max_num_seqs`, so that short jobs
  reach the engine, where they take the slots of long ones): one LMPOP, no wait, every `QUEUE_WATCH_INTERVAL` and
  never right after a take, so a message goes to an idle worker first (Redis serves a worker blocked in BLMPOP at
  the push itself, and one between two pulls is back within that time). A worker with free slots whose pull
  found nothing for a second says so in Redis (`<queue>:hungry`: its free slots and its name, for three
  seconds); another worker beyond its base takes that word (GETDEL: one worker answers it) and hands back as
  many held jobs beyond its base that made no token for a second (waiting or swapped out in its engine), the
  least urgent and latest created first; the idle worker's waiting pull takes them at once, and they resume
  there from their tokens;
- **full**: every `QUEUE_WATCH_INTERVAL` (and at once when a job leaves the book), one LMPOP looks for a message
  in the lists of the priorities it would still take (workers/admission.py: those more urgent than a held job
  that may be handed back, or than the jobs at their hand-back bound). Taking one, the worker hands its least
  urgent movable job back to the queue (tokens saved, lease dropped, re-sent at its own priority).

Within a priority's list, under SCHEDULING_POLICY=predicted, the worker takes the messages whose jobs the engine
would start first (workers/queue_order.py: predicted shortest first with aging, deadlines at risk first, from the
jobs' rows), looking at a window at the list's head; under fcfs, or when all of a list fits, it takes the head.

A message costs the worker a fraction of the CPU Celery's consumer spends per message (kombu's delivery and
acknowledgement bookkeeping, the task's trace, a claim of its own). A worker killed between a take and its claim
leaves jobs that are queued and in no list: the reconciler sends them again (workers/unclaimed.py), within a lease
and two reconciler intervals.

    Redis ──BLMPOP (room) / LMPOP (full, more urgent lists)──▶ intake: claim all ─▶ JobBook.add ─▶ engine
                                                                         └── hand back the least urgent held
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable

import redis
from sqlalchemy.orm import Session, sessionmaker
from tenacity import Retrying, before_sleep_log, retry_if_exception_type, stop_after_delay, wait_exponential

from contract.dispatch import PRIORITIES, model_queue, peek_head, take_jobs, take_messages
from contract.log_setup import job_fields
from contract.redis_client import redis_client
from contract.settings import WorkerSettings
from jobstore import jobs
from jobstore.models import Job
from jobstore.output_length import JobShape, predicted_output_tokens
from workers import admission, metrics
from workers.job_book import DB_DOWN, JobBook
from workers.job_tasks import JobTasks
from workers.outcomes import Outcome
from workers.queue_order import WINDOW, QueueOrder

log = logging.getLogger(__name__)
PULL_WAIT = 1.0  # seconds a BLMPOP waits for a message while every list is empty
# a held job that made no token for this long is not running in the engine: it may go to an idle worker
IDLE_AFTER = 1.0


class Intake:
    def __init__(
        self,
        book: JobBook,
        sessions: sessionmaker[Session],
        settings: WorkerSettings,
        worker_id: str,
        send: Callable[[uuid.UUID, int], None],
        capacity: int,
        tasks: JobTasks,
        base_capacity: int | None = None,
        slots: int | None = None,
    ):
        self.capacity = capacity
        # taken as fast as they come (None: all of capacity), and the engine's slots (None: the base)
        self.base_capacity = capacity if base_capacity is None else min(base_capacity, capacity)
        self.slots = self.base_capacity if slots is None else slots
        self._next_rebalance = 0.0  # time.monotonic() of the next look for an idle worker's word
        self._book, self._sessions, self._settings = book, sessions, settings
        self._worker_id, self._send, self._tasks = worker_id, send, tasks
        # notified when a job leaves the book, and when the intake is resumed or closed
        self._wake = threading.Condition(book.lock)
        book.on_change = self._changed
        self._consuming = False  # paused until resumed (the worker is ready)
        self._closing = False
        self._redis = redis_client(settings.redis_url, timeout=5)
        # the worker's model's queue (`generate` for the fleet's default model), and what its claims check
        served = settings.served_model_name()
        self.queue = model_queue(settings, served)
        self._hungry_key = f"{settings.redis_key_prefix}{self.queue}:hungry"  # free slots of an idle worker
        self._model = jobs.ServedModel(served, is_default=served == settings.fleet_default_model())
        # the order of the waiting jobs of a class (None: first come, first served)
        self._order = QueueOrder(settings, sessions) if settings.scheduling_policy != "fcfs" else None
        self._thread = threading.Thread(target=self._run, name="intake", daemon=True)

    def start(self) -> Intake:
        metrics.set_intake(0, self.capacity)
        self._thread.start()
        return self

    @property
    def consuming(self) -> bool:
        return self._consuming and not self._closing

    def resume(self) -> None:
        """Take jobs (the worker is ready; `celery control add_consumer generate`)."""
        with self._wake:
            self._consuming = True
            self._wake.notify()

    def pause(self) -> None:
        """Take no more jobs for now; held jobs run on (`celery control cancel_consumer generate`)."""
        with self._wake:
            self._consuming = False

    def close(self) -> None:
        """Stop taking jobs for good (the worker shuts down): messages taken from now on go back unclaimed."""
        with self._wake:
            self._closing = True
            self._wake.notify()

    # --- the intake thread ---------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._wake:
                # woken when a job leaves, or the intake is resumed or closed; holding beyond its base, a second
                # at most (an idle worker may be asking for its jobs)
                while not self._closing and (plan := self._plan()) is None:
                    if not self._wake.wait(PULL_WAIT) and len(self._book) > self.base_capacity:
                        break
                if self._closing:
                    return
            try:
                self._rebalance()
                if plan is None:
                    continue
                priorities, count, wait = plan
                taken = self._take(priorities, count, wait)
                if not taken and wait is not None:
                    self._say_hungry()
            except redis.RedisError as exc:
                log.warning("intake: Redis unavailable (%s)", exc.__class__.__name__)
                time.sleep(1.0)
                continue
            except Exception:  # never the intake's end: a worker that stopped taking jobs would idle for good
                log.exception("intake: a pass failed; trying again in a second")
                time.sleep(1.0)
                continue
            if not taken and wait is None:  # full, and nothing more urgent waits: look again in a while
                with self._wake:
                    if not self._closing:
                        self._wake.wait(self._settings.queue_watch_interval)
                continue
            try:
                self._hold_taken(taken)
            except Exception:  # the jobs stay queued; the reconciler sends them again (workers/unclaimed.py)
                log.exception("intake: %d jobs taken from Redis and not claimed", len(taken))
            with self._wake:  # beyond its base: the next messages go to an idle worker's pull, if one waits
                if not self._closing and self.base_capacity <= len(self._book) < self.capacity:
                    self._wake.wait(self._settings.queue_watch_interval)

    def _take(self, priorities: range, count: int, wait: float | None) -> list[tuple[uuid.UUID | None, int]]:
        """Up to `count` messages of the most urgent non-empty list of `priorities`: under fcfs (or when the list
        holds no more than `count`) those at its head; else the ones workers/queue_order.py puts first among the
        WINDOW at its head. With `wait`, waits for a message while every list is empty."""
        if self._order is None:
            return take_messages(self._redis, self._settings, priorities, count, wait, self.queue)
        head = peek_head(self._redis, self._settings, priorities, WINDOW, self.queue)
        if head is None:  # every list empty: the first message to come is the one to take
            return take_messages(self._redis, self._settings, priorities, count, wait, self.queue)
        priority, length, named = head
        # a message sent to a more urgent list since the look goes first: the head's take takes it instead, the
        # chosen jobs' take takes nothing (and the next pass looks again)
        more_urgent = [p for p in priorities if p < priority]
        known = [job_id for job_id in named if job_id is not None]
        chosen = self._order.choose(known, count) if length > count and len(known) == len(named) else None
        if chosen is None:  # all of it fits, a message names no job, or no costs: the head
            taken = take_messages(
                self._redis, self._settings, [*more_urgent, priority], count, None, self.queue
            )
            self._order.forget(job_id for job_id, _ in taken)
            return taken
        return list(take_jobs(self._redis, self._settings, priority, chosen, WINDOW, self.queue, more_urgent))

    def _plan(self) -> tuple[range, int, float | None] | None:
        """(lock held) What to take now: (priorities whose lists to look at, how many messages at most, how long
        to wait for one), or None: nothing (paused, or full of work at least as urgent as any that can come)."""
        if not self._consuming:
            return None
        room = self.capacity - len(self._book)
        if self.base_capacity - len(self._book) > 0:
            return (
                PRIORITIES,
                min(self._settings.intake_pull, self.base_capacity - len(self._book)),
                PULL_WAIT,
            )
        if room > 0:  # beyond the base: no wait, so that a worker blocked in its pull is served first
            return PRIORITIES, min(self._settings.intake_pull, room), None
        below = admission.admitted_below(
            self._book.held(), capacity=self.capacity, max_handbacks=self._settings.max_handbacks
        )
        return (range(below), 1, None) if below > 0 else None

    # --- sharing a queue's work with idle workers ------------------------------------------------------

    def _say_hungry(self) -> None:
        """A pull found nothing for PULL_WAIT: with free slots in the engine, say how many to the workers holding
        jobs beyond their base (for three pulls' time; the latest word stands)."""
        with self._wake:
            free = self.slots - len(self._book)
        if free > 0 and self.consuming:  # the word names its worker, which never answers it itself
            self._redis.set(self._hungry_key, f"{free} {self._worker_id}", px=int(3000 * PULL_WAIT))

    def _rebalance(self) -> None:
        """At most once every PULL_WAIT while holding beyond its base: if an idle worker said it has free slots,
        hand back as many held jobs beyond the base that are not running (no token for IDLE_AFTER seconds), the
        least urgent and latest created first. Their messages go to the head of their lists, where the idle
        worker's waiting pull takes them. Its own word (said while it had room, before a take put it beyond
        its base) it drops: answering it would hand jobs back to itself, each a second claim for nothing."""
        now = time.monotonic()
        if now < self._next_rebalance:
            return
        self._next_rebalance = now + PULL_WAIT
        with self._wake:
            if len(self._book) <= self.base_capacity:
                return
        word = self._redis.getdel(self._hungry_key)
        if not word:
            return
        asked, _, worker = word.decode(errors="replace").partition(" ")  # an older worker's: the count alone
        # its own word (stale: said before a take put it beyond its base), or no count
        if worker == self._worker_id or not asked.isdigit():
            return
        since = time.time() - IDLE_AFTER
        with self._wake:
            waiting = [h for h in self._book.held() if h.ran_at < since]
            waiting.sort(key=lambda h: (h.priority, h.created_at), reverse=True)
            moved = [
                h.job.id
                for h in waiting[: min(int(asked), len(self._book) - self.base_capacity)]
                if self._book.hand_back(h.lease, Outcome.REBALANCED) is not None
            ]
        if moved:
            log.info("intake: %d held jobs handed back for a worker with free slots: %s", len(moved), moved)

    def _changed(self) -> None:
        """A job left the book (lock held): there may be room."""
        metrics.set_intake(len(self._book), self.capacity)
        self._wake.notify()

    # --- claiming and holding what was taken ---------------------------------------------------------

    def _hold_taken(self, taken: list[tuple[uuid.UUID | None, int]]) -> None:
        """Claim the jobs of the taken messages in one statement and hand them to the engine; a message for a job
        not queued any more is dropped. Taken while the intake stopped: back to the head of their lists."""
        if not taken:
            return
        with self._wake:
            stopped = not self.consuming
        if stopped:
            self._send_back_unclaimed(taken)
            return
        claims: dict[uuid.UUID, tuple[str, int]] = {}  # job id -> (lease, the message's priority)
        for job_id, priority in taken:
            if job_id is None or job_id in claims:
                log.warning("intake: a message naming no job (or a job twice) dropped")
                continue
            # the lease is this claim's, not the process's: if it lapses (a starved machine) and the reconciler
            # re-dispatches the job to this same worker, the new claim is another lease, so the stale one's next
            # write fails and its request is aborted
            claims[job_id] = (f"{self._worker_id}#{uuid.uuid4().hex[:8]}", priority)
        if not claims:
            return
        found = self._claim(claims)
        ready = []
        for job_id, (lease, priority) in claims.items():
            job = found.get(job_id)
            if job is None or job.worker_id != lease:
                log.info("job %s dropped (not queued)", job_id, extra={"job_id": str(job_id)})
                metrics.JOBS.labels(str(priority), Outcome.DROPPED.value).inc()
                continue
            self._tasks.started(job)
            if self._finish_without_engine(job, lease) is None:
                ready.append((job, lease))
        predictions = self._predict([job for job, _ in ready])
        with self._wake:
            for (job, lease), predicted in zip(ready, predictions, strict=True):
                _log_claim(job)
                self._hold(job, lease, predicted)

    def _send_back_unclaimed(self, taken: list[tuple[uuid.UUID | None, int]]) -> None:
        """Messages taken while the intake stopped go back to the head of their lists, the last first
        (so the first is next again)."""
        for job_id, priority in reversed(taken):
            if job_id is not None:
                self._send(job_id, priority)
                metrics.JOBS.labels(str(priority), Outcome.DECLINED.value).inc()
        log.info("intake: %d messages sent back unclaimed (the intake stopped)", len(taken))

    def _claim(self, claims: dict[uuid.UUID, tuple[str, int]]) -> dict[uuid.UUID, Job]:
        """The claimed jobs by id (one statement: one job's claim is the cheaper one for a trickle)."""
        if len(claims) == 1:
            ((job_id, (lease, _)),) = claims.items()
            one = self._write(jobs.claim_job, job_id, lease, self._settings.lease_seconds, self._model)
            return {} if one is None else {one.id: one}
        pairs = [(job_id, lease) for job_id, (lease, _) in claims.items()]
        claimed = self._write(jobs.claim_jobs, pairs, self._settings.lease_seconds, self._model)
        return {job.id: job for job in claimed}

    def _predict(self, claimed: list[Job]) -> list[int | None]:
        """Each claimed job's predicted output (jobstore/output_length.py: one query), which places it within
        its priority class in the engine under SCHEDULING_POLICY=predicted (and preemptive); None under fcfs.
        Advisory: a failed prediction leaves the jobs to max_tokens."""
        if self._settings.scheduling_policy == "fcfs" or not claimed:
            return [None] * len(claimed)
        shapes = [JobShape(job.tenant_id, job.created_at, job.max_tokens, job.model) for job in claimed]
        try:
            return list(self._write(predicted_output_tokens, shapes))
        except Exception:  # noqa: BLE001 - the jobs run all the same, placed by max_tokens
            log.warning("intake: no output predictions for %d jobs", len(claimed), exc_info=True)
            return [None] * len(claimed)

    def _hold(self, job: Job, lease: str, predicted_output_tokens: int | None = None) -> None:
        """(lock held) Hold a claimed job. Admission is decided again with the row's own priority (the message's
        may differ) and what is held now: the least urgent held job may have to go back to the queue."""
        victim = self._admit(job.priority).victim
        self._book.add(job, lease, predicted_output_tokens)
        if self._closing:  # closed while it was claimed: back to the queue with the rest
            self._book.hand_back(lease, Outcome.HANDED_BACK)
        elif victim is not None and (moved := self._book.hand_back(victim.lease)) is not None:
            log.info(
                "job %s (priority %d) takes the place of job %s (priority %d): handing it back",
                job.id,
                job.priority,
                moved.job.id,
                moved.job.priority,
                extra=job_fields(job),
            )
        metrics.set_intake(len(self._book), self.capacity)

    def _admit(self, priority: int) -> admission.Admission:
        if len(self._book) < self.capacity:  # what admit() answers, without listing every held job
            return admission.Admission(True)
        return admission.admit(
            self._book.held(), priority, capacity=self.capacity, max_handbacks=self._settings.max_handbacks
        )

    def _finish_without_engine(self, job: Job, lease: str) -> Outcome | None:
        """A claimed job the engine need not see: an invalid row (failed), or one whose every token was saved."""
        try:
            jobs.check_job_row(job, self._settings.max_model_len)
        except ValueError as exc:
            log.error("job %s has an invalid row; failing it: %s", job.id, exc, extra=job_fields(job))
            self._write(
                jobs.fail_job,
                job.id,
                lease,
                code="invalid_job",
                message=f"the stored job is not valid: {exc}",
            )
            metrics.job_done(job, None, Outcome.FAILED, error_code="invalid_job")
            self._tasks.ended(job, Outcome.FAILED, "invalid_job")
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
            log.info("job %s succeeded (every token was saved before)", job.id, extra=job_fields(job))
            metrics.job_done(job, None, Outcome.SUCCEEDED)
            self._tasks.ended(job, Outcome.SUCCEEDED)
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


def _log_claim(job: Job) -> None:
    log.info(
        "job %s claimed: priority %d, attempt %d%s",
        job.id,
        job.priority,
        job.attempts,
        f", resuming after {len(job.output_token_ids)} tokens" if job.output_token_ids else "",
        extra=job_fields(job),
    )
