"""Running one job: claim it, hand it to the engine, write progress, then the result.

The task thread writes the tokens generated so far every `progress_interval` seconds (one UPDATE,
whatever the number of new tokens), which also renews its lease. When such a write finds the job is
no longer this worker's (cancelled, or the lease lapsed and the job was re-dispatched), the request
is aborted in the engine, freeing its batch slot.

Faults: every database write is retried with backoff for `db_retry_seconds` (Postgres may be
restarting; a progress write that fails is simply tried again at the next interval). When the worker
shuts down (`DRAINING` is set by the warm-shutdown signal), each running job saves its tokens, drops its
lease and goes back to `queued`, and `hand_back` sends it to Redis at once: another worker resumes it
from those tokens without waiting for the lease to lapse.
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
from tenacity import Retrying, before_sleep_log, retry_if_exception_type, stop_after_delay, wait_exponential

from batching import SamplingParams
from jobstore import jobs
from jobstore.models import Job, JobStatus
from jobstore.settings import Settings
from workers import metrics
from workers.engine_host import EngineHost, HostStopped, RequestHandle

log = logging.getLogger(__name__)
DRAINING = threading.Event()  # set when the worker shuts down: running jobs are handed back
DB_DOWN = (OperationalError, InterfaceError, PoolTimeout)


class Draining(Exception):
    """The worker is shutting down; the job was not claimed (its message goes back to the queue)."""


def with_retries(settings: Settings, fn: Callable, *args, **kwargs):
    """`fn(*args, **kwargs)`, retried with exponential backoff while the database is unreachable."""
    retrying = Retrying(retry=retry_if_exception_type(DB_DOWN), wait=wait_exponential(multiplier=0.1, max=2.0),
                        stop=stop_after_delay(settings.db_retry_seconds), reraise=True,
                        before_sleep=before_sleep_log(log, logging.WARNING))
    return retrying(fn, *args, **kwargs)


def _in_transaction(sessions: sessionmaker[Session], fn: Callable, *args, **kwargs):
    with sessions.begin() as session:
        return fn(session, *args, **kwargs)


def run_job(job_id: uuid.UUID, *, worker_id: str, host: EngineHost, sessions: sessionmaker[Session],
            settings: Settings, hand_back: Callable[[uuid.UUID, int], None] | None = None) -> str:
    """Run the job to a final state if it can be claimed; returns what happened, for the log.

    Raises Draining, without claiming, when the worker is shutting down. `hand_back(job_id, priority)`
    sends a job handed back at shutdown to Redis (without it, the reconciler sends it)."""
    if DRAINING.is_set():
        raise Draining(str(job_id))
    # The lease is held by this attempt, not by the process: if the lease lapses (a starved machine) and
    # the reconciler re-dispatches the job to this same worker, the new attempt claims it under another
    # id, so the stale attempt's next write fails, and it aborts its engine request and writes nothing more.
    worker_id = f"{worker_id}#{uuid.uuid4().hex[:8]}"
    job = with_retries(settings, _in_transaction, sessions, _claim, job_id, worker_id, settings)
    if isinstance(job, str):
        log.info("job %s %s", job_id, job)
        return job
    try:
        jobs.check_job_row(job, settings.max_model_len)
    except ValueError as exc:
        log.error("job %s has an invalid row; failing it: %s", job_id, exc)
        with_retries(settings, _in_transaction, sessions, jobs.fail_job, job_id, worker_id, code="invalid_job",
                     message=f"the stored job is not valid: {exc}")
        return "failed (invalid_job)"
    resumed = list(job.output_token_ids)
    if len(resumed) == job.max_tokens:  # the last run saved every token, then died before finishing
        ours = with_retries(settings, _in_transaction, sessions, jobs.finish_job, job_id, worker_id,
                            token_ids=resumed, text=job.output_text, finish_reason="length",
                            prompt_tokens=job.prompt_tokens or 0)
        return "succeeded (every token was saved before)" if ours else "dropped"
    log.info("job %s claimed: priority %d, attempt %d%s", job_id, job.priority, job.attempts,
             f", resuming after {len(resumed)} tokens" if resumed else "")
    started = time.monotonic()
    # one engine request per attempt: a stale attempt still in the engine never blocks a new one
    handle = host.submit(f"{job_id}/{job.attempts}", job.prompt if job.prompt is not None else list(job.input_ids),
                         sampling_params(job), job.priority, resume_token_ids=resumed or None)
    try:
        if not follow(handle, job_id, worker_id, host, sessions, settings):
            if DRAINING.is_set() or isinstance(handle.error, HostStopped):
                return metrics.job_done(job, handle, give_back(handle, job, worker_id, host, sessions, settings,
                                                               hand_back))
            log.info("job %s stopped: cancelled or no longer leased by this worker", job_id)
            return metrics.job_done(job, handle, "stopped")
        return metrics.job_done(job, handle, record_result(handle, job_id, worker_id, sessions, time.monotonic() - started,
                                                             settings))
    except BaseException:
        host.abort(handle.request_id)  # nobody follows the request any more; free its slot
        raise


def _claim(session: Session, job_id: uuid.UUID, worker_id: str, settings: Settings) -> Job | str:
    """The claimed job, or why it was not claimed."""
    job = jobs.claim_job(session, job_id, worker_id, settings.lease_seconds)
    if job is None:
        current = jobs.get_job(session, job_id)
        return f"dropped ({JobStatus(current.status).value})" if current else "dropped (no such job)"
    return job


def give_back(handle: RequestHandle, job: Job, worker_id: str, host: EngineHost, sessions: sessionmaker[Session],
              settings: Settings, hand_back: Callable[[uuid.UUID, int], None] | None) -> str:
    """The worker is shutting down: save the tokens so far, drop the lease, and send the job to the queue."""
    host.abort(handle.request_id)
    output = handle.output
    tokens = list(output.token_ids) if output is not None else list(job.output_token_ids)
    text = output.text if output is not None else job.output_text
    if not with_retries(settings, _in_transaction, sessions, jobs.release_job, job.id, worker_id,
                        token_ids=tokens, text=text):
        return "stopped at shutdown (no longer this worker's)"
    if hand_back is not None:
        try:
            hand_back(job.id, job.priority)
        except Exception as exc:  # the job is queued and unsent in Postgres: the reconciler sends it
            log.warning("job %s handed back but not sent (the reconciler will): %s", job.id, exc)
    log.info("job %s handed back at shutdown after %d tokens", job.id, len(tokens))
    return f"handed back after {len(tokens)} tokens"


def sampling_params(job: Job) -> SamplingParams:
    return SamplingParams(max_tokens=job.max_tokens, temperature=job.temperature, top_p=job.top_p,
                          top_k=job.top_k, seed=job.seed, stop=list(job.stop))


def follow(handle: RequestHandle, job_id: uuid.UUID, worker_id: str, host: EngineHost,
           sessions: sessionmaker[Session], settings: Settings) -> bool:
    """Write progress until the request is done; False (and the request aborted) if the job was taken away."""
    saved = -1
    while not handle.done.wait(settings.progress_interval):
        if DRAINING.is_set():
            return False
        output = handle.output
        try:
            with sessions.begin() as session:
                if output is not None and len(output.token_ids) != saved:
                    ours = jobs.save_progress(session, job_id, worker_id, settings.lease_seconds,
                                              token_ids=output.token_ids, text=output.text,
                                              first_token_at=handle.first_token_at)
                    saved = len(output.token_ids)
                else:
                    ours = jobs.renew_lease(session, job_id, worker_id, settings.lease_seconds)
        except DB_DOWN as exc:  # tried again at the next interval; the engine keeps generating
            log.warning("job %s: progress not saved, database unavailable: %s", job_id, exc.__class__.__name__)
            continue
        if not ours:
            host.abort(handle.request_id)
            return False
    return not isinstance(handle.error, HostStopped)


def record_result(handle: RequestHandle, job_id: uuid.UUID, worker_id: str, sessions: sessionmaker[Session],
                  seconds: float, settings: Settings | None = None) -> str:
    """Write the final state: succeeded with the output, or failed with the engine's error."""
    output = handle.output
    if isinstance(handle.error, HostStopped):
        log.info("job %s left running; its lease lapses and the reconciler re-dispatches it", job_id)
        return "left for the reconciler"
    if handle.error is not None:
        # the engine refusing a request outright (ValueError, no output): the stored row is one the API would
        # have refused (e.g. a prompt over max_model_len written behind its back)
        refused = isinstance(handle.error, ValueError) and output is None
        code = "invalid_job" if refused else "invalid_request" if isinstance(handle.error, ValueError) else "engine_error"
        write = lambda s: jobs.fail_job(s, job_id, worker_id, code=code, message=str(handle.error))  # noqa: E731
        outcome = f"failed ({code}: {handle.error})"
    else:
        write = lambda s: jobs.finish_job(  # noqa: E731
            s, job_id, worker_id, token_ids=output.token_ids, text=output.text, finish_reason=output.finish_reason,
            prompt_tokens=len(output.prompt_token_ids), first_token_at=handle.first_token_at)
        outcome = (f"succeeded: {len(output.token_ids)} tokens ({output.finish_reason}) in {seconds:.2f}s, "
                   f"{output.num_preemptions} preemptions")
    ours = with_retries(settings or Settings(), _in_transaction, sessions, write)
    if not ours:
        outcome = "finished, but the job was no longer this worker's; result discarded"
    log.info("job %s %s", job_id, outcome)
    return outcome
