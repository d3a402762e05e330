"""/v1/chat/completions and /v1/completions: OpenAI's synchronous calls. The request becomes a genq job at
priority 0 unless its `priority` says otherwise (the same caps, rate limit and cancel as POST /jobs), and
the API process follows it (webapi/following.py): subscribed to its token events before the job is sent, it
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

from collections.abc import Iterator
from types import SimpleNamespace

from flask import Blueprint, Response
from pydantic import ValidationError

from contract.deltas import Delta
from contract.requests import JobCreate
from jobstore.batch_output import response_body
from jobstore.models import Job, JobStatus
from webapi.auth import require_api_key
from webapi.completion_chunks import DONE, Chunks
from webapi.errors import APIError, from_validation_error
from webapi.extensions import services
from webapi.fleet import FleetModel
from webapi.following import Ended, JobFollower, Tick
from webapi.jobs import served_model, submit_job
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
from webapi.sse import FLUSH, HEARTBEAT, Flush
from webapi.tenant_limits import tenant_policy

bp = Blueprint("completions", __name__, url_prefix="/v1")
bp.before_request(require_api_key)
KEEPALIVE_SECONDS = 1.0  # a streamed call with no new text writes a HEARTBEAT (a blank line) this often


@bp.post("/chat/completions")
@endpoint(body=ChatCompletionCreate, responses={200: ChatCompletion}, errors=(403, 404, 409))
def chat_completion(body: ChatCompletionCreate):
    """Answer a chat now: waits for its job (priority 0 unless `priority`), or streams it (`stream`)."""
    return complete(body, CHAT_ENDPOINT)


@bp.post("/completions")
@endpoint(body=CompletionCreate, responses={200: Completion}, errors=(403, 404, 409))
def text_completion(body: CompletionCreate):
    """Continue a prompt now: waits for its job (priority 0 unless `priority`), or streams it (`stream`)."""
    return complete(body, COMPLETIONS_ENDPOINT)


def complete(body: ChatCompletionCreate | CompletionCreate, endpoint: str):
    """Submit a job per choice (choice i * n + j: prompt i's j-th, seed + j when seeded), each followed from
    before it is sent, then answer once all have succeeded, or stream them (`stream`)."""
    prompts = body.prompts() if isinstance(body, CompletionCreate) else [None]
    served = served_model(body.model)
    requests = [completion_job(body, served, prompt, j) for prompt in prompts for j in range(body.choices())]
    found = services()
    timeout = found.settings.completion_timeout_seconds
    with JobFollower(
        found, timeout=timeout, tick_seconds=KEEPALIVE_SECONDS, cancel_on_abandon=True
    ) as follower:
        jobs = [
            submit_job(request, tokens, on_created=follower.follow_created) for request, tokens in requests
        ]
        if body.stream:
            return stream(follower, body, endpoint, jobs, sum(tokens for _, tokens in requests), served)
        succeeded = [succeeded_job(follower, index) for index in range(len(jobs))]
    return reply(succeeded, endpoint, served)


def succeeded_job(follower: JobFollower, index: int) -> Job:
    """The follower's job `index` once it succeeded; 503 when the time runs out first (the follower cancels
    the call's jobs), the job's error when it ends otherwise."""
    done = follower.wait(index)
    if done is None:
        raise timeout_error(follower.timeout)
    if done.status != JobStatus.SUCCEEDED:
        raise ended_error(done)
    return done


def stream(
    follower: JobFollower,
    body: ChatCompletionCreate | CompletionCreate,
    endpoint: str,
    jobs: list[Job],
    prompt_tokens: int,
    served: FleetModel,
) -> Response:
    """The choices' chunks as server-sent events; one choice's plain steps written by the hub as they come
    (gevent worker)."""
    chunks = [Chunks(endpoint, served.name, jobs[0].id, job, i, served.model) for i, job in enumerate(jobs)]
    usage = body.stream_options is not None and bool(body.stream_options.include_usage)
    if len(chunks) == 1:
        return follower.stream(chunk_pieces(follower, chunks[0], usage, prompt_tokens), chunks[0].plain_step)
    return follower.stream(merged_chunk_pieces(follower, chunks, usage, prompt_tokens))


def reply(ended: list[Job], endpoint: str, served: FleetModel) -> dict:
    """The endpoint's response body for the call's succeeded jobs: a choice per job, in order."""
    answers = [answer(job, endpoint, served) for job in ended]
    if len(answers) == 1:
        return answers[0]
    reply = answers[0]
    reply["choices"] = [dict(a["choices"][0], index=i) for i, a in enumerate(answers)]
    reply["usage"] = {name: sum(a["usage"][name] for a in answers) for name in reply["usage"]}
    return reply


def completion_job(
    body: ChatCompletionCreate | CompletionCreate, served: FleetModel, prompt=None, choice: int = 0
) -> tuple[dict, int]:
    """The job's fields (JobCreate's) and its prompt token count on the `served` model (for `prompt`, one of a
    completion's, and its `choice`-th sample: seed + choice); 400 naming the field when the prompt cannot run."""
    chat = isinstance(body, ChatCompletionCreate)
    # the tenant's sync_priority (0 unless its policy says) when the call names none
    priority = body.priority if body.priority is not None else tenant_policy().sync_priority
    fields = dict(body.sampling(), priority=priority, model=served.name)
    if choice and body.seed is not None:
        fields["seed"] = (body.seed + choice) % 2**63
    try:
        if isinstance(body, ChatCompletionCreate):
            messages = [m.for_template() for m in body.messages]
            ids, prompt_tokens, error = prepare_prompt(served.model, messages=messages)
        elif isinstance(prompt, list):
            ids, prompt_tokens, error = prepare_prompt(served.model, input_ids=prompt)
        else:
            ids, prompt_tokens, error = prepare_prompt(served.model, text=prompt)
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
        max_tokens = max(1, served.max_model_len - prompt_tokens)
    error = check_length(
        prompt_tokens,
        max_tokens,
        served.max_model_len,
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


def answer(job: Job, endpoint: str, served: FleetModel) -> dict:
    """The endpoint's response body for a succeeded job (the Batch API's output lines hold the same)."""
    body = response_body(_row(job), endpoint, served.name, tokenizer_for(served.model))
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


def timeout_error(seconds: float) -> APIError:
    """The error for a call not done in its COMPLETION_TIMEOUT_SECONDS (its jobs cancelled)."""
    return APIError(
        503,
        "timeout",
        f"not done in {seconds:g} s (COMPLETION_TIMEOUT_SECONDS); its job "
        "was cancelled. Long generations belong in a batch or POST /jobs",
        {"Retry-After": "5"},
    )


def chunk_pieces(
    follower: JobFollower, chunks: Chunks, usage: bool, prompt_tokens: int
) -> Iterator[bytes | Flush]:
    """One choice streamed: a chunk per step as the worker sends it, then (with `usage`) the usage, then
    [DONE]; an error chunk when the job ends without a finish of its own (cancelled or failed) or the time
    runs out."""
    yield from chunks.opening()
    for item in follower.events():
        if isinstance(item, Delta):
            yield from chunks.step(item)
            if item.finish_reason in ("stop", "length"):
                if usage:
                    yield chunks.usage(prompt_tokens, chunks.completion_tokens(item))
                yield DONE
                return
        elif isinstance(item, Ended):  # it ended without a finish of its own: cancelled or failed
            error = ended_error(item.job)
            yield chunks.error(error.code, error.message)
            return
        elif item is FLUSH:
            yield FLUSH
        elif isinstance(item, Tick):
            yield HEARTBEAT  # a client gone is noticed at a write
    error = timeout_error(follower.timeout)  # the follower cancelled the job
    yield chunks.error(error.code, error.message)


def merged_chunk_pieces(
    follower: JobFollower, chunks: list[Chunks], usage: bool, prompt_tokens: int
) -> Iterator[bytes | Flush]:
    """Several choices streamed (n > 1, a list of prompts): their chunks as they come, each with its choice's
    `index` and ending with its own finish_reason; [DONE] once all have. A failed or cancelled choice, or
    the time running out, ends the stream with an error chunk (the follower cancels the jobs still running)."""
    for choice in chunks:
        yield from choice.opening()
    tokens = [0] * len(chunks)
    open_choices = set(range(len(chunks)))
    for item in follower.merged_events():
        if isinstance(item, Tick):
            yield HEARTBEAT  # a client gone is noticed at a write
            yield FLUSH
            continue
        index, event = item
        if event is None:
            if index in open_choices:  # its follower gave up: COMPLETION_TIMEOUT_SECONDS passed
                error = timeout_error(follower.timeout)
                yield chunks[index].error(error.code, error.message)
                return
            continue
        if isinstance(event, Ended):  # it ended without a finish of its own: cancelled or failed
            error = ended_error(event.job)
            yield chunks[index].error(error.code, error.message)
            return
        tokens[index] = chunks[index].completion_tokens(event)
        yield from chunks[index].step(event)
        if event.finish_reason in ("stop", "length"):
            open_choices.discard(index)
            if not open_choices:
                break
        yield FLUSH
    if usage:
        yield chunks[0].usage(prompt_tokens, sum(tokens))
    yield DONE
