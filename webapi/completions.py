"""/v1/chat/completions and /v1/completions: OpenAI's synchronous calls. The request becomes a genq job at
priority 0 unless its `priority` says otherwise (the same caps, rate limit and cancel as POST /jobs), and
the API process waits for it, reading the job's row every COMPLETION_POLL_SECONDS: the answer is OpenAI's
chat.completion / text_completion. With `stream: true` it is server-sent events of the text as the worker
writes it (every PROGRESS_INTERVAL), then `data: [DONE]`.

Waiting holds a thread of the API process for the job's length: gunicorn's gthread workers
(gunicorn.conf.py) give each process API_THREADS threads, at most COMPLETION_SLOTS of which wait at once
(threads - 2, so that quick calls always find a thread); a call beyond that answers 429 with Retry-After,
which OpenAI's clients wait out and retry. A waiting thread sleeps between reads: it holds no database
connection and no CPU. A streamed call whose client goes away cancels its job (noticed at the next
write: text, or a keep-alive comment every KEEPALIVE_SECONDS); a call not done in
COMPLETION_TIMEOUT_SECONDS cancels its job and answers 503.
"""

from __future__ import annotations

import collections
import json
import logging
import time
import uuid
from collections.abc import Iterator
from types import SimpleNamespace

from flask import Blueprint, Response
from pydantic import ValidationError

from jobstore import jobs
from jobstore.batch_output import response_body
from jobstore.models import Job, JobStatus
from jobstore.requests import JobCreate
from webapi.auth import current_tenant, require_api_key
from webapi.errors import APIError, from_validation_error
from webapi.extensions import Services, services
from webapi.jobs import submit_job
from webapi.openai_schemas import (
    CHAT_ENDPOINT,
    COMPLETIONS_ENDPOINT,
    ChatCompletion,
    ChatCompletionCreate,
    Completion,
    CompletionCreate,
)
from webapi.prompts import NoChatTemplate, check_length, prepare_prompt
from webapi.spec import endpoint

log = logging.getLogger(__name__)
bp = Blueprint("completions", __name__, url_prefix="/v1")
bp.before_request(require_api_key)
KEEPALIVE_SECONDS = 1.0  # a streamed call with no new text writes an SSE comment this often


class CompletionTimeout(Exception):
    """The job did not finish in COMPLETION_TIMEOUT_SECONDS (it has been cancelled)."""


@bp.post("/chat/completions")
@endpoint(body=ChatCompletionCreate, responses={200: ChatCompletion}, errors=(409,))
def chat_completion(body: ChatCompletionCreate):
    """Answer a chat now: waits for its job (priority 0 unless `priority`), or streams it (`stream`)."""
    return complete(body, CHAT_ENDPOINT)


@bp.post("/completions")
@endpoint(body=CompletionCreate, responses={200: Completion}, errors=(409,))
def text_completion(body: CompletionCreate):
    """Continue a prompt now: waits for its job (priority 0 unless `priority`), or streams it (`stream`)."""
    return complete(body, COMPLETIONS_ENDPOINT)


def complete(body: ChatCompletionCreate | CompletionCreate, endpoint: str):
    """Submit the job, hold a waiting slot, and answer when it ends (or stream it)."""
    request, prompt_tokens = completion_job(body)
    found = services()
    slots = found.completion_slots
    if slots is None:
        raise APIError(
            503,
            "unavailable",
            "synchronous completions are off on this server (COMPLETION_SLOTS=0, or a sync gunicorn worker): "
            "use the Batch API, or POST /jobs and poll",
            {"Retry-After": "60"},
        )
    if not slots.acquire(blocking=False):
        raise APIError(
            429,
            "too_many_waiting_completions",
            f"this server process already waits on {found.settings.completion_slots} completions, the most "
            "it holds (COMPLETION_SLOTS); retry after Retry-After seconds",
            {"Retry-After": "1"},
        )
    streaming = False
    try:
        job = submit_job(request, prompt_tokens)
        log.info("completion job %s for tenant %s, priority %d", job.id, current_tenant().name, job.priority)
        if body.stream:
            streaming = True
            return stream(found, job, endpoint, body, slots.release)
        try:
            done = last(follow(found, job.id))
        except CompletionTimeout:
            raise timeout_error(found) from None
    finally:
        if not streaming:
            slots.release()
    if done.status == JobStatus.SUCCEEDED:
        return answer(done, endpoint, found.settings.model)
    raise ended_error(done)


def completion_job(body: ChatCompletionCreate | CompletionCreate) -> tuple[dict, int]:
    """The job's fields (JobCreate's) and its prompt token count; 400 naming the field when the prompt
    cannot run (no chat template, unknown token ids, too long for MAX_MODEL_LEN)."""
    settings = services().settings
    chat = isinstance(body, ChatCompletionCreate)
    fields = dict(body.sampling(), priority=body.priority)
    try:
        if isinstance(body, ChatCompletionCreate):
            messages = [m.for_template() for m in body.messages]
            ids, prompt_tokens, error = prepare_prompt(settings.model, messages=messages)
        elif isinstance(body.prompt, list):
            ids, prompt_tokens, error = prepare_prompt(settings.model, input_ids=body.prompt)
        else:
            ids, prompt_tokens, error = prepare_prompt(settings.model, text=body.prompt)
    except NoChatTemplate as exc:
        raise APIError(422, "invalid_request", str(exc)) from None
    if error is not None:  # OpenAI's field for token ids is `prompt`
        raise APIError(422, "invalid_request", str(error) if chat else f"prompt: {error.message}")
    if ids is not None:
        fields["input_ids"] = ids
    else:
        fields["prompt"] = body.prompt
    max_tokens = body.requested_max_tokens()
    if max_tokens is None:  # OpenAI's chat default: as much as the context leaves
        max_tokens = max(1, settings.max_model_len - prompt_tokens)
    error = check_length(prompt_tokens, max_tokens, settings.max_model_len, "messages" if chat else "prompt")
    if error is not None:
        raise APIError(422, "context_length_exceeded", str(error))
    fields["max_tokens"] = max_tokens
    try:  # the job as the worker will check it (and genq's defaults for what the body left out)
        return JobCreate.model_validate(fields).model_dump(), prompt_tokens
    except ValidationError as exc:
        raise from_validation_error(exc) from None


def follow(found: Services, job_id: uuid.UUID) -> Iterator[Job]:
    """The job's row every COMPLETION_POLL_SECONDS until it ends (the last one yielded is ended); cancels
    the job and raises CompletionTimeout after COMPLETION_TIMEOUT_SECONDS."""
    settings = found.settings
    deadline = time.monotonic() + settings.completion_timeout_seconds
    while True:
        with found.autocommit.connect() as conn:  # a connection per read: none held while sleeping
            job = jobs.get_job(conn, job_id)
        if job is None:  # deleted under us (its tenant was removed)
            raise APIError(404, "not_found", "the job of this completion is gone")
        yield job
        if JobStatus(job.status).finished:
            return
        if time.monotonic() > deadline:
            cancel(found, job)
            raise CompletionTimeout
        time.sleep(settings.completion_poll_seconds)


def last(rows: Iterator[Job]) -> Job:
    """The last row: the ended job."""
    return collections.deque(rows, maxlen=1)[0]


def cancel(found: Services, job: Job) -> None:
    with found.autocommit.connect() as conn:
        jobs.cancel_job(conn, job.id, job.tenant_id)


def answer(job: Job, endpoint: str, model: str) -> dict:
    """The endpoint's response body for a succeeded job (the Batch API's output lines hold the same)."""
    body = response_body(_row(job), endpoint, model)
    return (ChatCompletion if endpoint == CHAT_ENDPOINT else Completion).model_validate(body).model_dump()


def _row(job: Job) -> SimpleNamespace:
    """The columns response_body reads, from a job."""
    return SimpleNamespace(
        id=job.id,
        prompt_tokens=job.prompt_tokens,
        completion_tokens=len(job.output_token_ids),
        output_text=job.output_text,
        finish_reason=job.finish_reason,
        finished_at=job.finished_at,
    )


def ended_error(job: Job) -> APIError:
    """The error for a job that ended without succeeding."""
    if job.status == JobStatus.CANCELLED:
        return APIError(409, "cancelled", f"the job of this completion ({job.id}) was cancelled")
    return APIError(500, job.error_code or "failed", job.error_message or "the job failed")


def timeout_error(found: Services) -> APIError:
    return APIError(
        503,
        "timeout",
        f"not done in {found.settings.completion_timeout_seconds:g} s (COMPLETION_TIMEOUT_SECONDS); its job "
        "was cancelled. Long generations belong in a batch or POST /jobs",
        {"Retry-After": "5"},
    )


def stream(found: Services, job: Job, endpoint: str, body, release) -> Response:
    """Server-sent events of the job's text as it grows; `release` frees the slot when the response closes
    (all sent, or the client went away: then the job is cancelled)."""
    ended = False

    def events() -> Iterator[bytes]:
        nonlocal ended
        chunks = Chunks(endpoint, found.settings.model, job.id)
        stops = [body.stop] if isinstance(body.stop, str) else body.stop or []
        holdback = max(map(len, stops), default=1) - 1
        sent, quiet_since = "", time.monotonic()
        if endpoint == CHAT_ENDPOINT:
            yield chunks.event(delta={"role": "assistant", "content": ""})
        try:
            for row in follow(found, job.id):
                finished = JobStatus(row.status).finished
                # while it runs, the text's last characters may yet be cut by a stop string: keep them back
                text = row.output_text if finished else row.output_text[: len(row.output_text) - holdback]
                if len(text) > len(sent) and text.startswith(sent):
                    yield chunks.text(text[len(sent) :])
                    sent, quiet_since = text, time.monotonic()
                elif time.monotonic() - quiet_since >= KEEPALIVE_SECONDS:
                    yield b": keep-alive\n\n"  # a client gone is noticed at a write
                    quiet_since = time.monotonic()
        except CompletionTimeout:
            error = timeout_error(found)
            yield chunks.error(error.code, error.message)
            ended = True
            return
        if row.status != JobStatus.SUCCEEDED:
            error = ended_error(row)
            yield chunks.error(error.code, error.message)
        else:
            yield chunks.finish(row.finish_reason)
            if body.stream_options and body.stream_options.include_usage:
                yield chunks.usage(row.prompt_tokens or 0, len(row.output_token_ids))
            yield b"data: [DONE]\n\n"
        ended = True

    def close() -> None:
        release()
        if not ended:  # the client went away before the end: nobody will read the rest
            log.info("completion job %s: the client went away; cancelling it", job.id)
            cancel(found, job)

    response = Response(
        events(),
        mimetype="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},  # no proxy buffering
    )
    response.call_on_close(close)
    return response


class Chunks:
    """The events of a streamed completion, in OpenAI's chunk shapes."""

    def __init__(self, endpoint: str, model: str, job_id: uuid.UUID):
        self.chat = endpoint == CHAT_ENDPOINT
        self.base = {
            "id": ("chatcmpl-" if self.chat else "cmpl-") + job_id.hex,
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": int(time.time()),
            "model": model,
        }

    def event(self, *, delta: dict | None = None, text: str = "", finish_reason: str | None = None) -> bytes:
        if self.chat:
            choice = {"index": 0, "delta": delta or {}, "logprobs": None, "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        return self._data(dict(self.base, choices=[choice]))

    def text(self, text: str) -> bytes:
        return self.event(delta={"content": text}, text=text)

    def finish(self, finish_reason: str | None) -> bytes:
        return self.event(finish_reason=finish_reason)

    def usage(self, prompt_tokens: int, completion_tokens: int) -> bytes:
        usage = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        }
        return self._data(dict(self.base, choices=[], usage=usage))

    def error(self, code: str, message: str) -> bytes:
        return self._data(
            {"error": {"message": message, "type": "server_error", "param": None, "code": code}}
        )

    @staticmethod
    def _data(payload: dict) -> bytes:
        return b"data: " + json.dumps(payload).encode() + b"\n\n"
