"""/v1/chat/completions and /v1/completions: OpenAI's synchronous calls. The request becomes a genq job at
priority 0 unless its `priority` says otherwise (the same caps, rate limit and cancel as POST /jobs), and
the API process follows it (webapi/events.py): subscribed to its token events before the job is sent, it
answers OpenAI's chat.completion / text_completion once the job's row holds the result, or, with
`stream: true`, sends each engine step's new text as a server-sent event as the worker publishes it, then
`data: [DONE]`.

A waiting call holds one of the process's COMPLETION_SLOTS (beyond them: 429 with Retry-After, which
OpenAI's clients wait out and retry); under gunicorn's gevent workers (gunicorn.conf.py) it is a greenlet
waiting on a queue: no thread, no database connection, no read of its own. A streamed call whose client goes
away cancels its job (noticed at the next write: text, or a heartbeat, a blank line, every KEEPALIVE_SECONDS); a
call not done in COMPLETION_TIMEOUT_SECONDS cancels its job and answers 503.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
import uuid
from collections.abc import Iterator
from json.encoder import encode_basestring_ascii  # type: ignore[attr-defined]
from types import SimpleNamespace

from flask import Blueprint, Response
from pydantic import ValidationError
from sqlalchemy.exc import InterfaceError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout

from contract.deltas import Delta
from contract.logprob_shapes import chat_logprobs, completion_logprobs
from contract.requests import JobCreate
from jobstore import jobs
from jobstore.batch_output import echoed_prompt, response_body
from jobstore.models import Job, JobStatus
from webapi.auth import current_tenant, require_api_key
from webapi.errors import APIError, from_validation_error
from webapi.events import FLUSH, HEARTBEAT, Ended, Tick, acquire_slot, follow, read_job
from webapi.extensions import Services, services
from webapi.jobs import submit_job
from webapi.metrics import JOBS_CANCELLED, count_streamed_deltas
from webapi.openai_schemas import (
    CHAT_ENDPOINT,
    COMPLETIONS_ENDPOINT,
    ChatCompletion,
    ChatCompletionCreate,
    Completion,
    CompletionCreate,
)
from webapi.prompts import NoChatTemplate, check_length, prepare_prompt, tokenizer_for
from webapi.spec import endpoint
from webapi.sse import SSE_HEADERS, direct_writer, sse_response

log = logging.getLogger(__name__)
bp = Blueprint("completions", __name__, url_prefix="/v1")
bp.before_request(require_api_key)
KEEPALIVE_SECONDS = 1.0  # a streamed call with no new text writes a HEARTBEAT (a blank line) this often


@bp.post("/chat/completions")
@endpoint(body=ChatCompletionCreate, responses={200: ChatCompletion}, errors=(404, 409))
def chat_completion(body: ChatCompletionCreate):
    """Answer a chat now: waits for its job (priority 0 unless `priority`), or streams it (`stream`)."""
    return complete(body, CHAT_ENDPOINT)


@bp.post("/completions")
@endpoint(body=CompletionCreate, responses={200: Completion}, errors=(404, 409))
def text_completion(body: CompletionCreate):
    """Continue a prompt now: waits for its job (priority 0 unless `priority`), or streams it (`stream`)."""
    return complete(body, COMPLETIONS_ENDPOINT)


def complete(body: ChatCompletionCreate | CompletionCreate, endpoint: str):
    """Submit the job, hold a waiting slot, and answer when it ends (or stream it)."""
    prompts = body.prompts() if isinstance(body, CompletionCreate) else [None]
    if len(prompts) > 1 or body.choices() > 1:  # choice i * n + j: prompt i's j-th (seed + j when seeded)
        requests = [completion_job(body, p, j) for p in prompts for j in range(body.choices())]
        if body.stream:
            return stream_many(body, endpoint, requests)
        return complete_many(body, endpoint, requests)
    request, prompt_tokens = completion_job(body, prompts[0])
    found = services()
    release = acquire_slot(found)
    streaming = False
    subscribed: list = []  # to the job's events, before the job is sent: none can come before
    try:
        job = submit_job(
            request,
            prompt_tokens,
            on_created=lambda job: subscribed.append((job.id.hex, found.hub.subscribe(job.id.hex))),
        )
        log.debug("completion job %s for tenant %s, priority %d", job.id, current_tenant().name, job.priority)
        if not subscribed:  # an existing job (not sent by this call): follow it from its row
            subscribed.append((job.id.hex, found.hub.subscribe(job.id.hex)))
        # a job just created is queued with no output: no need to read its row to start
        row = job if job.status == JobStatus.QUEUED else None
        if body.stream:
            streaming = True
            return stream(found, job, endpoint, body, row, prompt_tokens, release, subscribed[0])
        events = follow_job(found, job, subscribed[0][1], row=row)
        done = next((item.job for item in events if isinstance(item, Ended)), None)
        if done is None:
            cancel(found, job)
            raise timeout_error(found)
    finally:
        if not streaming:
            release()
            for key, inbox in subscribed:
                found.hub.unsubscribe(key, inbox)
    if done.status == JobStatus.SUCCEEDED:
        return answer(done, endpoint, found.settings.model)
    raise ended_error(done)


def complete_many(
    body: ChatCompletionCreate | CompletionCreate, endpoint: str, requests: list[tuple[dict, int]]
) -> dict:
    """Several choices (a list of prompts, n > 1): every job submitted, then one answer with a choice per
    job, in order. With prefix caching, a prompt's later choices start on the blocks its first computed."""
    found = services()
    release = acquire_slot(found)
    subscribed: list = []
    try:
        submitted = submit_followed(found, requests, subscribed)
        ended = []
        for job, (_, inbox) in zip(submitted, subscribed, strict=True):
            done = next(
                (item.job for item in follow_job(found, job, inbox, row=job) if isinstance(item, Ended)), None
            )
            if done is None:
                for other in submitted:
                    cancel(found, other)
                raise timeout_error(found)
            if done.status != JobStatus.SUCCEEDED:
                raise ended_error(done)
            ended.append(done)
    finally:
        release()
        for key, inbox in subscribed:
            found.hub.unsubscribe(key, inbox)
    answers = [answer(job, endpoint, found.settings.model) for job in ended]
    reply = answers[0]
    reply["choices"] = [dict(a["choices"][0], index=i) for i, a in enumerate(answers)]
    reply["usage"] = {name: sum(a["usage"][name] for a in answers) for name in reply["usage"]}
    return reply


def submit_followed(found: Services, requests: list[tuple[dict, int]], subscribed: list) -> list[Job]:
    """Submit each choice's job, following its events from the moment it exists (before it can make a
    token); the (key, inbox) of each goes into `subscribed` as it is made, for the caller to unsubscribe
    even when a later submission fails."""
    return [
        submit_job(
            request,
            tokens,
            on_created=lambda job: subscribed.append((job.id.hex, found.hub.subscribe(job.id.hex))),
        )
        for request, tokens in requests
    ]


def completion_job(
    body: ChatCompletionCreate | CompletionCreate, prompt=None, choice: int = 0
) -> tuple[dict, int]:
    """The job's fields (JobCreate's) and its prompt token count (for `prompt`, one of a completion's, and its
    `choice`-th sample: seed + choice); 400 naming the field when the prompt cannot run."""
    settings = services().settings
    chat = isinstance(body, ChatCompletionCreate)
    fields = dict(body.sampling(), priority=body.priority or 0)
    if choice and body.seed is not None:
        fields["seed"] = (body.seed + choice) % 2**63
    try:
        if isinstance(body, ChatCompletionCreate):
            messages = [m.for_template() for m in body.messages]
            ids, prompt_tokens, error = prepare_prompt(settings.model, messages=messages)
        elif isinstance(prompt, list):
            ids, prompt_tokens, error = prepare_prompt(settings.model, input_ids=prompt)
        else:
            ids, prompt_tokens, error = prepare_prompt(settings.model, text=prompt)
    except NoChatTemplate as exc:
        raise APIError(422, "invalid_request", str(exc)) from None
    if error is not None:  # OpenAI's field for token ids is `prompt`
        raise APIError(422, "invalid_request", str(error) if chat else f"prompt: {error.message}")
    if ids is not None:
        fields["input_ids"] = ids
    else:
        fields["prompt"] = prompt
    max_tokens = body.requested_max_tokens()
    if max_tokens is None:  # OpenAI's chat default: as much as the context leaves
        max_tokens = max(1, settings.max_model_len - prompt_tokens)
    error = check_length(
        prompt_tokens,
        max_tokens,
        settings.max_model_len,
        "messages" if chat else "prompt",
        body.max_tokens_field(),
        defaulted=getattr(body, body.max_tokens_field()) is None,
    )
    if error is not None:
        raise APIError(422, "context_length_exceeded", str(error))
    fields["max_tokens"] = max_tokens
    try:  # the job as the worker will check it (and genq's defaults for what the body left out)
        return JobCreate.model_validate(fields).model_dump(), prompt_tokens
    except ValidationError as exc:
        raise from_validation_error(exc, document=fields) from None


def follow_job(found: Services, job: Job, inbox, row: Job | None, direct=None) -> Iterator:
    """The job's events (webapi/events.follow) until it ends or COMPLETION_TIMEOUT_SECONDS pass."""
    return follow(
        found.hub,
        read_job(found.autocommit, job.id),
        job.id,
        inbox=inbox,
        row=row,
        tick_seconds=KEEPALIVE_SECONDS,
        resync_seconds=found.settings.events_resync_seconds,
        deadline=time.monotonic() + found.settings.completion_timeout_seconds,
        direct=direct,
    )


def cancel(found: Services, job: Job) -> None:
    try:
        with found.autocommit.connect() as conn:
            _, cancelled = jobs.cancel_job(conn, job.id, job.tenant_id)
    except (OperationalError, InterfaceError, PoolTimeout) as exc:  # it runs to its end, unread
        log.warning("completion job %s not cancelled, database unavailable (%s)", job.id, exc)
        return
    if cancelled:  # counted and published once
        JOBS_CANCELLED.labels(str(job.priority)).inc()
        found.hub.publish_status([(job.id.hex, JobStatus.CANCELLED.value)])


def answer(job: Job, endpoint: str, model: str) -> dict:
    """The endpoint's response body for a succeeded job (the Batch API's output lines hold the same)."""
    body = response_body(_row(job), endpoint, model, tokenizer_for(model))
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
        options=job.options,
        logprobs=job.logprobs,
        prompt=job.prompt,
        input_ids=job.input_ids,
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


def stream(
    found: Services, job: Job, endpoint: str, body, row: Job | None, prompt_tokens: int, release, subscription
) -> Response:
    """Server-sent events of the job's text, each step's piece as the worker sends it; `release` frees the
    slot when the response closes (all sent, or the client went away: then the job is cancelled). Under the
    gevent worker the hub writes a step's plain text chunk itself while the stream waits (`direct`)."""
    ended = False
    chunks = Chunks(endpoint, found.settings.model, job.id, job)
    writer = direct_writer()

    def direct(item: Delta) -> bool:
        """A plain step's chunk written now by the hub (webapi/events.follow), or False."""
        chunk = chunks.plain_step(item)
        if chunk is None:
            return False
        return writer.write(chunk) if chunk else True

    events = follow_job(found, job, subscription[1], row, direct if writer is not None else None)

    written = 0  # steps' deltas written by this stream's greenlet (the hub's: writer.written)

    def chunks_of_events() -> Iterator[bytes]:
        nonlocal ended, written
        yield from chunks.opening()
        tokens = 0
        for item in events:
            if isinstance(item, Delta):
                written += 1
                tokens = chunks.completion_tokens(item)
                yield from chunks.step(item)
                if item.finish_reason in ("stop", "length"):
                    if body.stream_options and body.stream_options.include_usage:
                        yield chunks.usage(prompt_tokens, tokens)
                    yield b"data: [DONE]\n\n"
                    ended = True
                    return
            elif isinstance(item, Ended):  # it ended without a finish of its own: cancelled or failed
                error = ended_error(item.job)
                yield chunks.error(error.code, error.message)
                ended = True
                return
            elif item is FLUSH:
                yield FLUSH
            elif isinstance(item, Tick):
                yield HEARTBEAT  # a client gone is noticed at a write
        cancel(found, job)  # COMPLETION_TIMEOUT_SECONDS passed
        error = timeout_error(found)
        yield chunks.error(error.code, error.message)
        ended = True

    def close() -> None:
        release()
        found.hub.unsubscribe(*subscription)  # also when the generator never started
        count_streamed_deltas(written, writer)
        if not ended:  # the client went away before the end: nobody will read the rest
            log.info("completion job %s: the client went away; cancelling it", job.id)
            cancel(found, job)

    return sse_response(chunks_of_events(), close, writer)


def stream_many(
    body: ChatCompletionCreate | CompletionCreate, endpoint: str, requests: list[tuple[dict, int]]
) -> Response:
    """Several choices streamed (n > 1, a list of prompts): every job submitted, then their events as they
    come, each chunk with its choice's `index`, each choice ending with its own finish_reason; [DONE] once
    all have. A follower per job (a greenlet under gevent) feeds one queue; a failed or cancelled choice,
    the timeout, or the client going away cancels every job still running."""
    found = services()
    release = acquire_slot(found)
    subscribed: list = []
    try:
        submitted = submit_followed(found, requests, subscribed)
    except BaseException:
        release()
        for key, inbox in subscribed:
            found.hub.unsubscribe(key, inbox)
        raise
    merged: queue.Queue = queue.Queue()
    stop = threading.Event()
    open_choices = set(range(len(submitted)))

    def pump(index: int, job: Job, inbox) -> None:
        events = follow_job(found, job, inbox, row=job)  # unsubscribes when closed
        try:
            for item in events:
                if stop.is_set():
                    return
                if isinstance(item, Delta) or isinstance(item, Ended):
                    merged.put((index, item))
                    if isinstance(item, Ended) or item.finish_reason is not None:
                        return
        finally:
            events.close()
            merged.put((index, None))  # this choice's events are over (at its end, or the timeout)

    def chunks_of_events() -> Iterator[bytes]:
        model = found.settings.model
        chunks = [Chunks(endpoint, model, submitted[0].id, job, i) for i, job in enumerate(submitted)]
        for choice in chunks:
            yield from choice.opening()
        tokens = [0] * len(chunks)
        while open_choices:
            try:
                index, item = merged.get(timeout=KEEPALIVE_SECONDS)
            except queue.Empty:
                yield HEARTBEAT  # a client gone is noticed at a write
                continue
            if item is None:
                if index in open_choices:  # its follower gave up: COMPLETION_TIMEOUT_SECONDS passed
                    error = timeout_error(found)
                    yield chunks[index].error(error.code, error.message)
                    return
                continue
            if isinstance(item, Ended):  # it ended without a finish of its own: cancelled or failed
                error = ended_error(item.job)
                yield chunks[index].error(error.code, error.message)
                return
            tokens[index] = chunks[index].completion_tokens(item)
            yield from chunks[index].step(item)
            if item.finish_reason in ("stop", "length"):
                open_choices.discard(index)
        if body.stream_options and body.stream_options.include_usage:
            yield chunks[0].usage(sum(tokens for _, tokens in requests), sum(tokens))
        yield b"data: [DONE]\n\n"

    def close() -> None:
        stop.set()
        release()
        if open_choices:  # the client went away, a choice failed, or the time ran out: nobody reads the rest
            log.info("completion jobs %s: the stream ended early; cancelling them", [j.id for j in submitted])
            for job in submitted:
                cancel(found, job)

    for index, (job, (_, inbox)) in enumerate(zip(submitted, subscribed, strict=True)):
        threading.Thread(target=pump, args=(index, job, inbox), name=f"follow-{job.id}", daemon=True).start()
    response = Response(chunks_of_events(), mimetype="text/event-stream", headers=SSE_HEADERS)
    response.call_on_close(close)
    return response


_MARK = "\x00genq-text\x00"  # stands for the text while a text chunk's template is rendered


class Chunks:
    """The events of one choice of a streamed completion (its `index`: several choices of a call share the
    `id` of the first's job), in OpenAI's chunk shapes."""

    def __init__(self, endpoint: str, model: str, job_id: uuid.UUID, job: Job, index: int = 0):
        self.chat = endpoint == CHAT_ENDPOINT
        self.model, self.job, self.index = model, job, index
        self.text_offset = 0  # completions' logprobs: characters of the token strings sent
        options = job.options or {}
        self.echo, self.alone = options.get("echo", False), options.get("echo_only", False)
        self.tokenizer = tokenizer_for(model) if options.get("logprobs") is not None else None
        self.base = {
            "id": ("chatcmpl-" if self.chat else "cmpl-") + job_id.hex,
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": int(time.time()),
            "model": model,
        }
        self._text_template: tuple[bytes, bytes] | None = None  # a text chunk's bytes around its text

    def opening(self) -> Iterator[bytes]:
        """What a choice begins with: chat's role; an echoed prompt (the first chunk carries it, as vLLM's;
        with logprobs, it waits for the first step's event, which brings the prompt's)."""
        if self.chat:
            yield self.event(delta={"role": "assistant", "content": ""})
        elif self.echo and self.tokenizer is None:
            yield self.text(echoed_prompt(self.job, tokenizer_for(self.model)))
            self.echo = False

    def step(self, item: Delta) -> Iterator[bytes]:
        """One step's chunk (its text may be empty: a character not complete yet), as vLLM sends one a step,
        and the choice's finish. With `echo_only` (max_tokens 0) the token drawn is left out."""
        if self.echo and not self.chat:  # the echoed prompt with its log probabilities (null if missed)
            self.echo = False
            prompt = (item.fields or {}).get("prompt_logprobs")
            text = echoed_prompt(self.job, tokenizer_for(self.model))
            yield self.text(text, prompt and self.logprobs(prompt, self.tokenizer))
        logprobs = (item.fields or {}).get("logprobs") if self.tokenizer is not None else None
        if not self.alone and (item.token_ids and (not item.finish_reason or logprobs) or item.text):
            yield self.text(item.text, logprobs and self.logprobs(logprobs, self.tokenizer))
        if item.finish_reason in ("stop", "length"):
            yield self.finish("length" if self.alone else item.finish_reason)

    def plain_step(self, item: Delta) -> bytes | None:
        """What step() writes for a step without a finish that is only text (b"": nothing), or None when the
        step needs step() itself (an echo to send, log probabilities, fields, echo_only)."""
        if item.fields is not None or self.echo or self.tokenizer is not None or self.alone:
            return None
        return self.text(item.text) if item.token_ids or item.text else b""

    def completion_tokens(self, item: Delta) -> int:
        return 0 if self.alone else item.start + len(item.token_ids)

    def event(
        self,
        *,
        delta: dict | None = None,
        text: str = "",
        finish_reason: str | None = None,
        logprobs: dict | None = None,
    ) -> bytes:
        if self.chat:
            choice = {
                "index": self.index,
                "delta": delta or {},
                "logprobs": logprobs,
                "finish_reason": finish_reason,
            }
        else:
            choice = {"index": self.index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
        return self._data(dict(self.base, choices=[choice]))

    def text(self, text: str, logprobs: dict | None = None) -> bytes:
        if logprobs is None:  # a step's text alone, the chunk of nearly every event: from a template
            if self._text_template is None:
                marked = self.event(delta={"content": _MARK}, text=_MARK)
                head, _, tail = marked.partition(json.dumps(_MARK).encode())
                self._text_template = (head, tail)
            head, tail = self._text_template
            return head + encode_basestring_ascii(text).encode() + tail  # json.dumps(text)'s C core
        return self.event(delta={"content": text}, text=text, logprobs=logprobs)

    def logprobs(self, entries: list, tokenizer) -> dict:
        """The log probabilities of a step's tokens, in the endpoint's shape (completions: text offsets
        counted over the token strings so far, as in the reply that does not stream)."""
        if self.chat:
            return chat_logprobs(entries, tokenizer)
        shaped = completion_logprobs(entries, tokenizer, self.text_offset)
        self.text_offset += sum(map(len, shaped["tokens"]))
        return shaped

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
