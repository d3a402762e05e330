"""JobBook: the jobs one worker process holds, and the one thread that writes them all to Postgres.

Intake (workers/intake.py) claims a job and `add()`s it; from then on the book owns it. The job goes to
the engine, and one writer thread does every database write of every held job, batched:

- every `progress_interval`: the new tokens of all held jobs, and their lease renewals, in one
  statement (jobs.save_progress); a job missing from its reply was cancelled or lost its lease, and its
  engine request is aborted at once (so a cancel frees its batch slot within one interval);
- as soon as jobs finish: their results, in one statement (jobs.finish_jobs), so a result lands within
  milliseconds of its last token, and results finishing together share a write;
- hand-backs (a more urgent job took the slot, the worker shuts down, or the engine process died): abort
  the request, save its tokens, drop the lease, send the job back to the queue at its own priority.

The moments a held job's row keeps no time of (jobstore/job_events.py: its preemptions inside the engine and
resumes, which its HeldJob notes from the engine's reports; its hand-back) ride on these same writes.

Each engine step's new output of every held job also leaves at once as token events (contract/token_events.py:
one XADD per step, from a publisher thread), for the API's streaming callers; the writer publishes status
changes (claimed, handed back, result stored) after the write that makes them true.

A failed write (Postgres unreachable) is kept and tried again at the next wake-up while the engine
goes on generating; what is written is idempotent (jobs.Output), so a retry never duplicates tokens.

    intake ──add──▶ JobBook ──submit──▶ EngineHost ──on_end──▶ writer ──batched UPDATEs──▶ Postgres
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable

from sqlalchemy.exc import InterfaceError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout
from sqlalchemy.orm import Session, sessionmaker

from contract.deltas import Delta
from contract.log_setup import job_fields
from contract.settings import WorkerSettings
from contract.token_events import EventPublisher
from jobstore import jobs
from jobstore.models import Job, JobStatus
from workers import job_spans, metrics
from workers.engine_host import EngineHost, EngineLost, HostStopped
from workers.held_job import HeldJob
from workers.job_tasks import JobTasks
from workers.outcomes import Outcome

log = logging.getLogger(__name__)
DB_DOWN = (OperationalError, InterfaceError, PoolTimeout)


class JobBook:
    """The held jobs of one worker process. Thread-safe; `lock` also guards intake's decisions."""

    def __init__(
        self,
        host: EngineHost,
        sessions: sessionmaker[Session],
        settings: WorkerSettings,
        send: Callable[[uuid.UUID, int], None],
        events: EventPublisher | None = None,
        tasks: JobTasks | None = None,
    ):
        self.lock = threading.RLock()
        self._events = events
        self._tasks = tasks if tasks is not None else JobTasks()
        host.on_step, host.on_end = self._stepped, self._ended_in_engine
        self.on_change: Callable[[], None] = lambda: None  # called (lock held) when a job leaves the book
        self._host, self._sessions, self._settings, self._send = host, sessions, settings, send
        # in the engine (what counts against capacity), by lease: a job re-dispatched to this worker while a stale
        # claim of it is still here is held twice, until the stale one's next write finds its lease gone
        self._held: dict[str, HeldJob] = {}
        self._ended: list[HeldJob] = []  # requests done in the engine, result not yet written
        self._returning: list[tuple[HeldJob, Outcome]] = []  # to hand back to the queue
        self._closing = False
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._write_loop, name="job-writer", daemon=True)

    def start(self) -> JobBook:
        self._thread.start()
        return self

    # --- what intake sees (call with `lock` held) --------------------------------------------------

    def held(self) -> list[HeldJob]:
        return list(self._held.values())

    def __len__(self) -> int:
        return len(self._held)

    # --- changes -------------------------------------------------------------------------------------

    def add(self, job: Job, lease: str, predicted_output_tokens: int | None = None) -> None:
        """Hold a claimed job and submit it to the engine, resuming after the tokens its row holds. Its place
        within its priority class comes from its row (creation time, deadline) and `predicted_output_tokens`,
        so it is the same after a restart or a hand-back."""
        held = HeldJob(job, lease)
        with self.lock:
            self._held[lease] = held
            job_spans.claimed(held)  # traces (workers/job_spans.py), before its first step can be reported
            self._host.submit(
                held,
                held.prompt,
                held.sampling_params(),
                held.resume_token_ids,
                arrival_time=job.created_at.timestamp(),
                predicted_output_tokens=predicted_output_tokens,
                deadline=job.deadline.timestamp() if job.deadline is not None else None,
            )
        if self._events is not None:  # goes with the next step's events (the engine steps for it soon)
            self._events.status([(held.key, JobStatus.RUNNING.value)], wake=False)

    def hand_back(self, lease: str, outcome: Outcome = Outcome.PREEMPTED) -> HeldJob | None:
        """Take a held job out of the engine now; the writer saves its tokens and sends it back to the queue."""
        with self.lock:
            held = self._held.get(lease)
            # a job whose last step ended it in the engine (its finish applied, its end on the way) is not handed
            # back: its result is written (_ended_in_engine); resumed, it would go on past its end (its EOS)
            if held is None or held.transcript.finished:
                return None
            del self._held[lease]
            self._host.abort(held.request_id)
            self._returning.append((held, outcome))
            self.on_change()
        self._wake.set()
        return held

    def close(self) -> None:
        """Hand every held job back (the worker shuts down); the writer ends once they are written."""
        with self.lock:
            self._closing = True
            for lease in list(self._held):
                self.hand_back(lease, Outcome.HANDED_BACK)
        self._wake.set()

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)

    def _stepped(self, added: list[tuple[HeldJob, Delta]]) -> None:
        """On the host's reader thread: one engine step's new output of each job, sent as token events."""
        job_spans.stepped(added)
        if self._events is not None:
            self._events.step([(held.key, held.event(delta)) for held, delta in added])

    def _done(self, held: HeldJob, outcome: Outcome, error_code: str | None = None) -> None:
        """The worker's hold on a job ended: counted, and its task ended in Flower."""
        job_spans.done(held, outcome)
        metrics.job_done(held.job, held.first_token_at, outcome, error_code=error_code)
        self._tasks.ended(held.job, outcome, error_code, time.monotonic() - held.claimed_at)

    def _status(self, changes: list[tuple[HeldJob, JobStatus]]) -> None:
        if self._events is not None and changes:
            self._events.status([(h.key, status.value) for h, status in changes])

    def _ended_in_engine(self, held: HeldJob) -> None:
        """On the host's reader thread: the request finished or failed; its slot is free now, its result
        written soon. A request lost with its engine process goes back to the queue with its tokens."""
        with self.lock:
            if self._held.pop(held.lease, None) is None:  # handed back or taken away meanwhile
                return
            if isinstance(held.error, EngineLost):
                self._returning.append((held, Outcome.ENGINE_LOST))
            else:
                self._ended.append(held)
            self.on_change()
        self._wake.set()

    # --- the writer thread ---------------------------------------------------------------------------

    def _write_loop(self) -> None:
        interval = self._settings.progress_interval
        next_progress = time.monotonic() + interval
        while True:
            self._wake.wait(max(0.0, next_progress - time.monotonic()))
            self._wake.clear()
            with self.lock:
                ended, self._ended = self._ended, []
                returning, self._returning = self._returning, []
                closing = self._closing
            ended = self._attempt(self._write_results, ended)
            returning = self._attempt(self._write_hand_backs, returning)
            if time.monotonic() >= next_progress:
                self._attempt(self._write_progress, None)
                next_progress = time.monotonic() + interval
            if ended or returning:  # not written (Postgres unreachable): again at the next wake-up
                with self.lock:
                    self._ended[:0], self._returning[:0] = ended, returning
                time.sleep(min(interval, 0.5))
                self._wake.set()
            elif closing:
                with self.lock:
                    if not (self._held or self._ended or self._returning):
                        return

    def _attempt(self, write: Callable, items):
        """`write(items)`; on a database outage the items are returned to be written later."""
        if items is not None and not items:
            return items
        try:
            write(items)
        except DB_DOWN as exc:
            log.warning("job writes failed, database unavailable (%s); trying again", exc.__class__.__name__)
            return items
        except Exception:
            log.exception("job writes failed")
            return items
        return [] if items is not None else None

    def _write_progress(self, _=None) -> None:
        """New tokens and lease renewals of every held job, in one statement; abort the jobs no longer ours."""
        with self.lock:
            held = list(self._held.values())
        if not held:
            return
        outputs = [h.output() for h in held]
        with self._sessions() as session:
            ours = jobs.save_progress(session, [o for o, _ in outputs], self._settings.lease_seconds)
        stopped = []
        for h, (output, position) in zip(held, outputs):
            if (h.job.id, h.lease) in ours:
                h.saved(output, position)
                continue
            with self.lock:
                if self._held.pop(h.lease, None) is None:  # ended meanwhile: its result write will say
                    continue
                self._host.abort(h.request_id)
                self.on_change()
            log.info(
                "job %s stopped: cancelled or no longer leased by this worker",
                h.job.id,
                extra=job_fields(h.job),
            )
            self._done(h, Outcome.STOPPED)
            stopped.append(h)
        # followers read the row on an ended status (cancelled here or by a batch's cancel or expiry, which
        # publish nothing; or back in the queue: the row says which)
        self._status([(h, JobStatus.CANCELLED) for h in stopped])

    def _write_results(self, ended: list[HeldJob]) -> None:
        """Results of requests the engine ended: successes in one statement, failures one by one (rare).
        Once the successes are written they leave `ended`, so a failure write that fails retries only itself."""
        done = [h for h in ended if h.error is None]
        if done:
            outputs = [h.output(final=True)[0] for h in done]
            with self._sessions() as session:
                ours = jobs.finish_jobs(session, outputs)
            ended[:] = [h for h in ended if h.error is not None]
            for h in done:  # logged first: a process killed between the commit and its log loses less
                if (h.job.id, h.lease) in ours:
                    log.info(
                        "job %s succeeded: %d tokens (%s) in %.2fs, %d preemptions",
                        h.job.id,
                        h.transcript.position.tokens,
                        h.transcript.finish_reason,
                        time.monotonic() - h.claimed_at,
                        h.num_preemptions,
                        extra=job_fields(h.job),
                    )
                    self._done(h, Outcome.SUCCEEDED)
                else:
                    log.info(
                        "job %s finished, but was no longer this worker's; result discarded",
                        h.job.id,
                        extra=job_fields(h.job),
                    )
                    self._done(h, Outcome.DISCARDED)
            self._status([(h, JobStatus.SUCCEEDED) for h in done if (h.job.id, h.lease) in ours])
        if ended:
            with self._sessions() as session:
                failures = [(h, *self._fail(session, h)) for h in ended]
            self._status([(h, JobStatus.FAILED) for h, outcome, _ in failures if outcome is Outcome.FAILED])
            for h, outcome, code in failures:
                self._done(h, outcome, error_code=code)

    def _fail(self, session: Session, held: HeldJob) -> tuple[Outcome, str | None]:
        """Write a request the engine failed as a failed job; the outcome and the error code."""
        error = held.error
        if isinstance(error, HostStopped):
            log.info(
                "job %s left running; its lease lapses and the reconciler re-dispatches it",
                held.job.id,
                extra=job_fields(held.job),
            )
            return Outcome.LEFT, None
        # the engine refusing a request outright (ValueError, no output): the stored row is one the API would
        # have refused (e.g. a prompt over max_model_len written behind its back)
        refused = isinstance(error, ValueError) and not held.updated
        code = (
            "invalid_job"
            if refused
            else "invalid_request"
            if isinstance(error, ValueError)
            else "engine_error"
        )
        if not jobs.fail_job(
            session, held.job.id, held.lease, code=code, message=str(error), events=held.unwritten_events()
        ):
            return Outcome.DISCARDED, None
        log.info("job %s failed (%s: %s)", held.job.id, code, error, extra=job_fields(held.job))
        return Outcome.FAILED, code

    def _write_hand_backs(self, returning: list[tuple[HeldJob, Outcome]]) -> None:
        """Save each job's tokens, drop its lease, and send it back to the queue at its own priority. A job the
        engine ended before the hand-back reached it (its stop or length came first) is not handed back: resumed,
        it would go on past its end; its result is written instead. Written ones leave `returning`."""
        kept = []
        for h, outcome in returning:
            at = h.resumable()
            if at is None:
                with self.lock:
                    self._ended.append(h)
                self._wake.set()
            else:
                kept.append((h, outcome, at))
        returning[:] = [(h, outcome) for h, outcome, _ in kept]
        released = []
        with self._sessions() as session:
            for h, outcome, at in kept:
                transcript = h.transcript
                tokens, text = transcript.token_ids[: at.tokens], transcript.text_since(0, at.chars)
                if jobs.release_job(
                    session,
                    h.job.id,
                    h.lease,
                    token_ids=tokens,
                    text=text,
                    preempted=outcome is Outcome.PREEMPTED,
                    # preempted, handed_back (shutting down), rebalanced (for an idle worker) or engine_lost
                    reason=outcome.value,
                    events=h.unwritten_events(),
                ):
                    released.append((h, outcome, len(tokens)))
                else:
                    log.info(
                        "job %s stopped while being handed back (no longer this worker's)",
                        h.job.id,
                        extra=job_fields(h.job),
                    )
                    self._done(h, Outcome.STOPPED)
        self._status([(h, JobStatus.QUEUED) for h, _, _ in released])
        sent = []
        for h, outcome, n in released:
            try:
                self._send(h.job.id, h.job.priority)
                sent.append(h.job.id)
            except Exception as exc:  # queued and unsent in Postgres: the reconciler sends it
                log.warning(
                    "job %s handed back but not sent (the reconciler will): %s",
                    h.job.id,
                    exc,
                    extra=job_fields(h.job),
                )
            log.info(
                "job %s handed back (%s) after %d tokens", h.job.id, outcome.value, n, extra=job_fields(h.job)
            )
            self._done(h, outcome)
        if sent:
            with self._sessions() as session:
                jobs.mark_enqueued(session, sent)
