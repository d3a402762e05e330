"""A batch input file, validated line by line into genq job rows, a group of lines at a time.

Each line is `{custom_id, method, url, body}`; the body is an OpenAI chat or text completion request. A file
may mix models: each line runs on the model its body's `model` names (absent: the fleet's default), and is
checked against that model as POST /jobs checks a job: its prompt rendered and counted with that model's
tokenizer, its length against that model's max_model_len, logit_bias against its vocabulary; its job names the
model (so it goes to that model's queue). The job a line makes is checked with JobCreate, the schema the worker
checks stored jobs with. Every invalid line is reported (line number, field, message); the caller queues nothing
of a file with any invalid line. A line naming a model the fleet does not serve is not invalid: it fails alone, as
the request alone would (404 model_not_found), in the batch's error file (its job is written failed, never queued;
jobstore/batches.py), and the rest of the file runs. The prompts of a group are rendered and tokenized in one call
per model.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone

from pydantic import ValidationError

from contract.fields import VOCAB_SIZE
from contract.requests import JobCreate
from jobstore.batches import job_row
from webapi.fleet import FleetModel, ModelNotServed
from webapi.openai_schemas import (
    CHAT_ENDPOINT,
    ChatBatchLine,
    ChatCompletionRequest,
    CompletionBatchLine,
    CompletionRequest,
)
from webapi.prompts import (
    PromptError,
    check_length,
    check_token_ids,
    count_texts,
    render_chats,
    tokenizer_for,
)
from webapi.validation import parsed, problems

MAX_REPORTED_ERRORS = 1000  # a file with more invalid lines reports its first this many


@dataclass(frozen=True, slots=True)
class LineError:
    line: int
    code: str
    message: str
    param: str | None = None

    def as_dict(self) -> dict:
        return {"code": self.code, "message": self.message, "param": self.param, "line": self.line}


@dataclass
class _Request:
    """A line that passed the shape checks, waiting for its prompt to be rendered and counted."""

    line: int
    index: int
    custom_id: str
    body: ChatCompletionRequest | CompletionRequest
    served: FleetModel | ModelNotServed  # the model it runs on, or why none does (the line fails alone)
    prompt_ids: list[int] | None = None
    prompt_tokens: int = 0


@dataclass
class BatchBuilder:
    """Turns the lines of one batch's input file into job rows; `errors` collects every invalid line."""

    batch_id: str
    tenant_id: uuid.UUID
    endpoint: str
    priority: int
    # a body's `model` (None: the fleet's default) -> the served model it runs on (webapi/fleet.py's resolve)
    resolve: Callable[[str | None], FleetModel]
    vocabulary: Callable[[str | None], tuple[str, int | None] | None] | None = None  # logit_bias's: spec.py
    deadline: datetime | None = None  # every job's: the end of the batch's completion window (its expires_at)
    # every job's: the W3C traceparent of the request creating the batch (contract/tracing.py); None: untraced
    traceparent: str | None = None
    errors: list[LineError] = field(default_factory=list)
    error_count: int = 0
    requests: int = 0  # valid lines so far
    refused: int = 0  # of which naming a model the fleet does not serve (each fails alone)
    job_ids: list[uuid.UUID] = field(default_factory=list)
    job_models: list[str] = field(default_factory=list)  # each job's model, as job_ids
    sent_at: datetime = field(default_factory=lambda: datetime.now(timezone.utc))
    _custom_ids: set[str] = field(default_factory=set)
    # each body's `model` resolved once a file
    _models: dict[str | None, FleetModel | ModelNotServed] = field(default_factory=dict)

    @property
    def models(self) -> list[str]:
        """The served models the valid lines run on, each once, in the order the file first names them."""
        return list(dict.fromkeys(self.job_models))

    def add(self, lines: Sequence[tuple[int, bytes]]) -> list[tuple]:
        """Job rows (jobstore.batches.JOB_COLUMNS) of the valid lines among `lines` ((line number, text))."""
        parsed = [request for number, raw in lines if (request := self._parse(number, raw)) is not None]
        self._prepare_prompts(parsed)
        rows = []
        for request in parsed:
            row = self._job_row(request)
            if row is not None:
                rows.append(row)
        return rows

    def _error(self, line: int, code: str, message: str, param: str | None = None) -> None:
        self.error_count += 1
        if len(self.errors) < MAX_REPORTED_ERRORS:
            self.errors.append(LineError(line, code, message, param))

    def _parse(self, number: int, raw: bytes) -> _Request | None:
        model = ChatBatchLine if self.endpoint == CHAT_ENDPOINT else CompletionBatchLine
        try:  # parsed and checked in one pass, body included
            line = model.model_validate_json(raw, context=self._context)
        except ValidationError as exc:
            first = exc.errors(include_url=False)[0]
            if first["type"] == "json_invalid":
                self._error(number, "invalid_json_line", f"line {number} is not valid JSON: {first['msg']}")
            else:
                self._validation_error(number, exc, parsed(raw))
            return None
        if line.url != self.endpoint:
            self._error(
                number,
                "mismatched_endpoint",
                f"url: {line.url} is not the batch's endpoint {self.endpoint}",
                "url",
            )
            return None
        if line.custom_id in self._custom_ids:
            self._error(
                number,
                "duplicate_custom_id",
                f"custom_id: {line.custom_id!r} is used by an earlier line",
                "custom_id",
            )
            return None
        self._custom_ids.add(line.custom_id)
        index, self.requests = self.requests, self.requests + 1
        return _Request(number, index, line.custom_id, line.body, self._served(line.body.model))

    def _served(self, name: str | None) -> FleetModel | ModelNotServed:
        if name not in self._models:
            try:
                self._models[name] = self.resolve(name)
            except ModelNotServed as exc:
                self._models[name] = exc
        return self._models[name]

    @property
    def _context(self) -> dict:
        """Any `model` passes the line's checks (one the fleet does not serve fails its line alone: _job_row);
        logit_bias is checked against the vocabulary of the model it names."""
        return {VOCAB_SIZE: self.vocabulary}

    def _validation_error(self, number: int, exc: ValidationError, document, prefix: str = "") -> None:
        """The line's first problem (enough to fix it), worded as POST /jobs and /v1 word it."""
        found = problems(exc, document)
        problem = next((p for p in found if p.status != 422), found[0])  # an unknown model first
        param = prefix + problem.param if problem.param else prefix.rstrip(".") or None
        self._error(number, problem.code, f"{param}: {problem.text}" if param else problem.text, param)

    def _prepare_prompts(self, requests: list[_Request]) -> None:
        """Render chats, and count text prompts, in one call per model per group of lines."""
        by_model: dict[str, list[_Request]] = {}  # checkpoint -> its lines
        for request in requests:
            if isinstance(request.served, FleetModel):  # a refused line's prompt is not read
                by_model.setdefault(request.served.model, []).append(request)
        for model, group in by_model.items():
            self._prepare_model_prompts(model, group)

    def _prepare_model_prompts(self, model: str, requests: list[_Request]) -> None:
        """The prompts of lines that all run on the checkpoint `model`, with its tokenizer."""
        tokenizer = tokenizer_for(model)
        chats = [r for r in requests if isinstance(r.body, ChatCompletionRequest)]
        if chats:
            rendered = render_chats(
                tokenizer, model, [[m.for_template() for m in r.body.messages] for r in chats]
            )
            for request, ids in zip(chats, rendered, strict=True):
                if isinstance(ids, PromptError):
                    request.prompt_tokens = -1
                    self._error(request.line, "invalid_request", f"body.{ids}", "body.messages")
                else:
                    request.prompt_ids, request.prompt_tokens = ids, len(ids)
        texts = [
            r for r in requests if isinstance(r.body, CompletionRequest) and isinstance(r.body.prompt, str)
        ]
        for request, count in zip(texts, count_texts(tokenizer, model, [r.body.prompt for r in texts])):
            request.prompt_tokens = count
        for request in requests:
            if isinstance(request.body, CompletionRequest) and isinstance(request.body.prompt, list):
                request.prompt_ids, request.prompt_tokens = request.body.prompt, len(request.body.prompt)
                error = check_token_ids(request.prompt_ids, tokenizer, model)
                if error is not None:
                    request.prompt_tokens = -1
                    self._error(
                        request.line, "invalid_request", f"body.prompt: {error.message}", "body.prompt"
                    )

    def _job_row(self, request: _Request) -> tuple | None:
        if request.prompt_tokens < 0:  # its prompt was refused
            return None
        if isinstance(request.served, ModelNotServed):
            return self._refused_row(request, request.served)
        body = request.body
        chat = isinstance(body, ChatCompletionRequest)
        max_model_len = request.served.max_model_len
        max_tokens = body.requested_max_tokens()
        if max_tokens is None:  # OpenAI's chat default: as much as the context leaves
            max_tokens = max(1, max_model_len - request.prompt_tokens)
        error = check_length(
            request.prompt_tokens,
            max_tokens,
            max_model_len,
            "messages" if chat else "prompt",
            body.max_tokens_field(),
            defaulted=getattr(body, body.max_tokens_field()) is None,
        )
        if error is not None:
            self._error(request.line, "context_length_exceeded", f"body.{error}", f"body.{error.field}")
            return None
        fields = dict(
            body.sampling(),
            max_tokens=max_tokens,
            priority=self.priority,
            deadline=self.deadline,
            model=request.served.name,
            metadata={"batch_id": self.batch_id, "custom_id": request.custom_id},
        )
        if request.prompt_ids is not None:
            fields["input_ids"] = request.prompt_ids
        else:
            fields["prompt"] = body.prompt
        try:
            job = JobCreate.model_validate(fields).model_dump()
        except ValidationError as exc:
            self._validation_error(request.line, exc, fields, prefix="body.")
            return None
        job_id, row = job_row(
            self.tenant_id,
            self.batch_id,
            request.index,
            job,
            request.prompt_tokens,
            self.sent_at,
            self.traceparent,
        )
        self.job_ids.append(job_id)
        self.job_models.append(request.served.name)
        return row

    def _refused_row(self, request: _Request, refusal: ModelNotServed) -> tuple:
        """The failed job of a line naming a model the fleet does not serve: the request as its line gives it
        (JobCreate's defaults for what only its model would say: a chat is never rendered, its prompt left
        empty), the refused name as its model (cut to the column's 200 characters), code model_not_found."""
        self.refused += 1
        body = request.body
        fields = {
            name: info.get_default(call_default_factory=True) for name, info in JobCreate.model_fields.items()
        }
        fields.update(
            body.sampling(),
            max_tokens=body.requested_max_tokens() or 1,
            priority=self.priority,
            deadline=self.deadline,
            model=refusal.name[:200],
            metadata={"batch_id": self.batch_id, "custom_id": request.custom_id},
        )
        prompt = getattr(body, "prompt", "")  # a chat's: never rendered, without the model's template
        fields["prompt" if isinstance(prompt, str) else "input_ids"] = prompt
        _, row = job_row(
            self.tenant_id,
            self.batch_id,
            request.index,
            fields,
            0,
            self.sent_at,
            self.traceparent,
            refusal=("model_not_found", str(refusal)),
        )
        return row
