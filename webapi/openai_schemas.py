"""OpenAI's request and response bodies, as far as genq serves them (chat and text completions, files,
batches), and how a completion request maps onto a genq job. They validate /v1 requests and the lines
of batch input files, and through webapi/spec.py make /openapi.json."""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from typing import Annotated, Any, Generic, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, field_validator

from jobstore.models import Batch, File

Item = TypeVar("Item")

CHAT_ENDPOINT = "/v1/chat/completions"
COMPLETIONS_ENDPOINT = "/v1/completions"
Endpoint = Literal["/v1/chat/completions", "/v1/completions"]
StopString = Annotated[str, StringConstraints(min_length=1, max_length=128)]


class TextPart(BaseModel):
    """A part of a message's content; genq serves text only."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    """A message of a conversation. `developer` is OpenAI's newer name for `system`, and is rendered so."""

    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = Field(None, max_length=64)

    @field_validator("content")
    @classmethod
    def no_nul(cls, value):
        text = value if isinstance(value, str) else "".join(p.text for p in value)
        if "\x00" in text:
            raise ValueError("NUL characters are not supported")
        return value

    def for_template(self) -> dict[str, str]:
        """The message as chat templates take it: content as one string (text parts joined by newlines)."""
        content = self.content if isinstance(self.content, str) else "\n".join(p.text for p in self.content)
        message = {"role": "system" if self.role == "developer" else self.role, "content": content}
        if self.name is not None:
            message["name"] = self.name
        return message


class _Sampling(BaseModel):
    """The sampling fields both endpoints share, with OpenAI's names and genq's limits. Fields OpenAI has
    and genq cannot honour are refused by name (extra="forbid"), never silently ignored."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = Field(None, max_length=256, description="Recorded; genq serves its one MODEL.")
    max_tokens: int | None = Field(None, ge=1, description="Most tokens to generate.")
    temperature: float | None = Field(None, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0.0, le=1.0, allow_inf_nan=False)
    seed: int | None = Field(None, ge=0, le=2**63 - 1, description="Same seed, same tokens.")
    stop: StopString | list[StopString] | None = Field(None, description="Up to 8 stop strings.")
    n: int | None = Field(None, description="Choices per request; genq makes 1.")
    stream: bool | None = Field(None, description="Batch requests cannot stream.")
    user: str | None = Field(None, max_length=256, description="Accepted and ignored.")
    frequency_penalty: float | None = Field(None, description="Only 0 (genq applies no penalty).")
    presence_penalty: float | None = Field(None, description="Only 0 (genq applies no penalty).")

    @field_validator("n")
    @classmethod
    def one_choice(cls, value):
        if value not in (None, 1):
            raise ValueError("genq makes one choice per request; send n=1 (or leave it out)")
        return value

    @field_validator("stream")
    @classmethod
    def no_stream(cls, value):
        if value:
            raise ValueError("a batch request cannot stream; leave stream out or false")
        return value

    @field_validator("frequency_penalty", "presence_penalty")
    @classmethod
    def no_penalty(cls, value):
        if value not in (None, 0, 0.0):
            raise ValueError("genq applies no frequency or presence penalty; send 0 or leave it out")
        return value

    @field_validator("stop")
    @classmethod
    def at_most_8(cls, value):
        if isinstance(value, list) and len(value) > 8:
            raise ValueError("at most 8 stop strings")
        if value is not None and "\x00" in "".join([value] if isinstance(value, str) else value):
            raise ValueError("NUL characters are not supported")
        return value

    def sampling(self) -> dict[str, Any]:
        """The genq job fields these set (unset ones keep genq's defaults, which are OpenAI's)."""
        fields = {"temperature": self.temperature, "top_p": self.top_p, "seed": self.seed}
        fields = {k: v for k, v in fields.items() if v is not None}
        if self.stop is not None:
            fields["stop"] = [self.stop] if isinstance(self.stop, str) else list(self.stop)
        return fields


class ChatCompletionRequest(_Sampling):
    """A body of POST /v1/chat/completions (in a batch line)."""

    messages: list[ChatMessage] = Field(min_length=1, max_length=1024)
    max_completion_tokens: int | None = Field(None, ge=1, description="OpenAI's newer name for max_tokens.")

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(_Sampling):
    """A body of POST /v1/completions (in a batch line): one prompt, text or token ids."""

    prompt: Annotated[str, StringConstraints(min_length=1)] | list[Annotated[int, Field(ge=0, lt=2**31)]]
    echo: bool | None = Field(None, description="Only false.")

    @field_validator("prompt")
    @classmethod
    def usable_prompt(cls, value):
        if isinstance(value, list) and not value:
            raise ValueError("give at least one token id")
        if isinstance(value, str) and "\x00" in value:
            raise ValueError("NUL characters are not supported")
        return value

    @field_validator("echo")
    @classmethod
    def no_echo(cls, value):
        if value:
            raise ValueError("genq does not echo the prompt; send echo=false or leave it out")
        return value

    def requested_max_tokens(self) -> int:
        return self.max_tokens if self.max_tokens is not None else 16  # OpenAI's default for completions


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: bool | None = Field(None, description="A last chunk with the usage (and no choices).")


class _Synchronous(BaseModel):
    """What a synchronous call (POST /v1/chat/completions, /v1/completions) adds to a batch line's body: it
    may stream, and `priority` (genq's own field: `extra_body={"priority": 3}` in OpenAI's client)."""

    stream: bool | None = Field(None, description="Answer as server-sent events as the tokens come.")
    stream_options: StreamOptions | None = None
    priority: int = Field(0, ge=0, le=9, description="genq's priority: 0 (the default) most urgent … 9.")

    @field_validator("stream")
    @classmethod
    def no_stream(cls, value):  # replaces the batch lines' refusal: a synchronous call may stream
        return value


class ChatCompletionCreate(_Synchronous, ChatCompletionRequest):
    """Body of POST /v1/chat/completions: a chat to answer now (it waits for its job, or streams it)."""


class CompletionCreate(_Synchronous, CompletionRequest):
    """Body of POST /v1/completions: a prompt to continue now (it waits for its job, or streams it)."""


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ReplyMessage(BaseModel):
    role: Literal["assistant"]
    content: str


class ChatChoice(BaseModel):
    index: int
    message: ReplyMessage
    logprobs: None
    finish_reason: Literal["stop", "length"] | None


class ChatCompletion(BaseModel):
    """A chat reply (OpenAI's chat.completion); with `stream`, chat.completion.chunk events instead."""

    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class TextChoice(BaseModel):
    index: int
    text: str
    logprobs: None
    finish_reason: Literal["stop", "length"] | None


class Completion(BaseModel):
    """A text completion (OpenAI's text_completion); with `stream`, text_completion chunk events instead."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[TextChoice]
    usage: Usage


CustomId = Annotated[str, StringConstraints(min_length=1, max_length=512)]


class BatchLine(BaseModel):
    """One line of a batch input file."""

    model_config = ConfigDict(extra="forbid")

    custom_id: CustomId
    method: Literal["POST"]
    url: Endpoint
    body: dict[str, Any]

    @field_validator("custom_id")
    @classmethod
    def no_nul(cls, value: str) -> str:
        if "\x00" in value:
            raise ValueError("NUL characters are not supported")
        return value


class ChatBatchLine(BatchLine):
    """A line of a /v1/chat/completions batch: validated from its JSON text in one pass."""

    body: ChatCompletionRequest


class CompletionBatchLine(BatchLine):
    """A line of a /v1/completions batch."""

    body: CompletionRequest


class BatchCreate(BaseModel):
    """Body of POST /v1/batches. `metadata.priority` ("0" most urgent … "9") sets the jobs' priority."""

    model_config = ConfigDict(extra="forbid")

    input_file_id: str = Field(max_length=64)
    endpoint: Endpoint
    completion_window: Literal["24h"] = Field(
        description="OpenAI's one window: a batch not done 24 hours after it was created (BATCH_WINDOW_SECONDS) "
        "ends `expired`; its unfinished requests go to the error file with code `batch_expired`."
    )
    metadata: (
        dict[
            Annotated[str, StringConstraints(min_length=1, max_length=64)],
            Annotated[str, StringConstraints(max_length=512)],
        ]
        | None
    ) = Field(None, max_length=16)

    @field_validator("metadata")
    @classmethod
    def priority_digit(cls, value):
        if value and "priority" in value and value["priority"] not in {str(p) for p in range(10)}:
            raise ValueError("priority: give a digit, 0 (most urgent) to 9")
        if value and any("\x00" in k + v for k, v in value.items()):
            raise ValueError("NUL characters are not supported")
        return value


class BatchListQuery(BaseModel):
    """Query string of GET /v1/batches."""

    model_config = ConfigDict(extra="forbid")

    after: str | None = Field(None, max_length=64, description="The last batch id of the previous page.")
    limit: int = Field(20, ge=1, le=100)


class FileObject(BaseModel):
    """A file (OpenAI's File object)."""

    id: str
    object: Literal["file"] = "file"
    bytes: int
    created_at: int
    filename: str
    purpose: str
    status: Literal["processed"] = "processed"
    expires_at: int | None = None
    status_details: str | None = None

    @classmethod
    def of(cls, file: File) -> FileObject:
        return cls(
            id=file.id,
            bytes=file.bytes,
            created_at=_unix(file.created_at),
            filename=file.filename,
            purpose=file.purpose,
        )


class FileListQuery(BaseModel):
    """Query string of GET /v1/files (OpenAI's parameters)."""

    model_config = ConfigDict(extra="forbid")

    purpose: str | None = Field(
        None, max_length=32, description="Only files of this purpose (`batch`, `batch_output`)."
    )
    limit: int = Field(10000, ge=1, le=10000, description="Files per page.")
    order: Literal["asc", "desc"] = Field("desc", description="By creation time; newest first by default.")
    after: str | None = Field(None, max_length=64, description="The last file id of the previous page.")


class ListPage(BaseModel, Generic[Item]):
    """A page of a list in OpenAI's shape; pass `last_id` as `after` for the next."""

    object: Literal["list"] = "list"
    data: list[Item]
    first_id: str | None
    last_id: str | None
    has_more: bool

    @classmethod
    def of(cls, rows: list, limit: int, item: Callable[[Any], Item]) -> ListPage[Item]:
        """The page of `rows` (fetched with `limit + 1`, so one more means there is a next page)."""
        more, rows = len(rows) > limit, rows[:limit]
        return cls(
            data=[item(r) for r in rows],
            first_id=rows[0].id if rows else None,
            last_id=rows[-1].id if rows else None,
            has_more=more,
        )


class FilePage(ListPage[FileObject]):
    """A page of files; pass `last_id` as `after` for the next."""


class FileDeleted(BaseModel):
    id: str
    object: Literal["file"] = "file"
    deleted: bool


class BatchError(BaseModel):
    code: str
    message: str
    param: str | None = None
    line: int | None = None


class BatchErrors(BaseModel):
    object: Literal["list"] = "list"
    data: list[BatchError]


class RequestCounts(BaseModel):
    total: int
    completed: int
    failed: int


class BatchObject(BaseModel):
    """A batch (OpenAI's Batch object); timestamps are Unix seconds."""

    id: str
    object: Literal["batch"] = "batch"
    endpoint: str
    model: str
    errors: BatchErrors | None
    input_file_id: str
    completion_window: str
    status: str
    output_file_id: str | None
    error_file_id: str | None
    created_at: int
    in_progress_at: int | None
    expires_at: int | None
    finalizing_at: int | None
    completed_at: int | None
    failed_at: int | None
    expired_at: int | None
    cancelling_at: int | None
    cancelled_at: int | None
    request_counts: RequestCounts
    metadata: dict[str, str] | None

    @classmethod
    def of(cls, batch: Batch, counts: RequestCounts, model: str) -> BatchObject:
        return cls(
            id=batch.id,
            endpoint=batch.endpoint,
            model=model,
            errors=BatchErrors(data=batch.errors) if batch.errors else None,
            input_file_id=batch.input_file_id,
            completion_window=batch.completion_window,
            status=batch.status.value if hasattr(batch.status, "value") else batch.status,
            output_file_id=batch.output_file_id,
            error_file_id=batch.error_file_id,
            request_counts=counts,
            metadata=batch.metadata_,
            **{
                name: _unix(getattr(batch, name))
                for name in (
                    "created_at",
                    "in_progress_at",
                    "expires_at",
                    "finalizing_at",
                    "completed_at",
                    "failed_at",
                    "expired_at",
                    "cancelling_at",
                    "cancelled_at",
                )
            },
        )


class BatchPage(ListPage[BatchObject]):
    """A page of batches, newest first; pass `last_id` as `after` for the next."""


class OpenAIErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class OpenAIError(BaseModel):
    """Every error answer under /v1 has OpenAI's shape."""

    error: OpenAIErrorInfo


def _unix(value: datetime | None) -> int | None:
    return None if value is None else int(value.timestamp())
