"""Running one job: claim it, hand it to the engine, write progress, then the result.

The task thread writes the tokens generated so far every `progress_interval` seconds (one UPDATE,
whatever the number of new tokens), which also renews its lease. When such a write finds the job is
no longer this worker's (cancelled, or the lease lapsed and the job was re-dispatched), the request
is aborted in the engine, freeing its batch slot.
"""

from __future__ import annotations

import logging
import time
import uuid

from sqlalchemy.orm import Session, sessionmaker

from batching import SamplingParams
from jobstore import jobs
from jobstore.models import Job, JobStatus
from jobstore.settings import Settings
from workers.engine_host import EngineHost, HostStopped, RequestHandle

log = logging.getLogger(__name__)


def run_job(job_id: uuid.UUID, *, worker_id: str, host: EngineHost, sessions: sessionmaker[Session],
            settings: Settings) -> str:
    """Run the job to a final state if it can be claimed; returns what happened, for the log."""
    with sessions.begin() as session:
        job = jobs.claim_job(session, job_id, worker_id, settings.lease_seconds)
        if job is None:
            current = jobs.get_job(session, job_id)
            outcome = f"dropped ({JobStatus(current.status).value})" if current else "dropped (no such job)"
            log.info("job %s %s", job_id, outcome)
            return outcome
    resumed = list(job.output_token_ids)
    log.info("job %s claimed: priority %d, attempt %d%s", job_id, job.priority, job.attempts,
             f", resuming after {len(resumed)} tokens" if resumed else "")
    started = time.monotonic()
    # one engine request per attempt: a stale attempt still in the engine never blocks a new one
    handle = host.submit(f"{job_id}/{job.attempts}", job.prompt if job.prompt is not None else list(job.input_ids),
                         sampling_params(job), job.priority, resume_token_ids=resumed or None)
    try:
        if not follow(handle, job_id, worker_id, host, sessions, settings):
            log.info("job %s stopped: cancelled or no longer leased by this worker", job_id)
            return "stopped"
        return record_result(handle, job_id, worker_id, sessions, time.monotonic() - started)
    except BaseException:
        host.abort(handle.request_id)  # nobody follows the request any more; free its slot
        raise


def sampling_params(job: Job) -> SamplingParams:
    return SamplingParams(max_tokens=job.max_tokens, temperature=job.temperature, top_p=job.top_p,
                          top_k=job.top_k, seed=job.seed, stop=list(job.stop))


def follow(handle: RequestHandle, job_id: uuid.UUID, worker_id: str, host: EngineHost,
           sessions: sessionmaker[Session], settings: Settings) -> bool:
    """Write progress until the request is done; False (and the request aborted) if the job was taken away."""
    saved = -1
    while not handle.done.wait(settings.progress_interval):
        output = handle.output
        with sessions.begin() as session:
            if output is not None and len(output.token_ids) != saved:
                ours = jobs.save_progress(session, job_id, worker_id, settings.lease_seconds,
                                          token_ids=output.token_ids, text=output.text,
                                          first_token_at=handle.first_token_at)
                saved = len(output.token_ids)
            else:
                ours = jobs.renew_lease(session, job_id, worker_id, settings.lease_seconds)
        if not ours:
            host.abort(handle.request_id)
            return False
    return True


def record_result(handle: RequestHandle, job_id: uuid.UUID, worker_id: str, sessions: sessionmaker[Session],
                  seconds: float) -> str:
    """Write the final state: succeeded with the output, or failed with the engine's error."""
    output = handle.output
    if isinstance(handle.error, HostStopped):
        log.info("job %s left running; its lease lapses and the reconciler re-dispatches it", job_id)
        return "left for the reconciler"
    with sessions.begin() as session:
        if handle.error is not None:
            code = "invalid_request" if isinstance(handle.error, ValueError) else "engine_error"
            ours = jobs.fail_job(session, job_id, worker_id, code=code, message=str(handle.error))
            outcome = f"failed ({code}: {handle.error})"
        else:
            ours = jobs.finish_job(session, job_id, worker_id, token_ids=output.token_ids, text=output.text,
                                   finish_reason=output.finish_reason, prompt_tokens=len(output.prompt_token_ids),
                                   first_token_at=handle.first_token_at)
            outcome = (f"succeeded: {len(output.token_ids)} tokens ({output.finish_reason}) in {seconds:.2f}s, "
                       f"{output.num_preemptions} preemptions")
    if not ours:
        outcome = "finished, but the job was no longer this worker's; result discarded"
    log.info("job %s %s", job_id, outcome)
    return outcome
