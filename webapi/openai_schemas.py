"""OpenAI's request and response bodies, as far as genq serves them (chat and text completions, files,
batches), and how a completion request maps onto a genq job. They validate /v1 requests and the lines
of batch input files, and through webapi/spec.py make /openapi.json.

Request bodies derive from contract.fields.RequestBody (strict JSON types, unknown fields refused) and
declare the fields they share with POST /jobs with contract/fields.py's types, so a value gets the same
verdict on /jobs, /v1 and in a batch line. A new field follows the same rule by being declared on one of
these models: webapi/validation.py words its errors for the caller."""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import datetime
from typing import Annotated, Any, Generic, Literal, TypeVar

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    PrivateAttr,
    StringConstraints,
    Tag,
    ValidationInfo,
    field_validator,
    model_validator,
)

from batching.grammar import JSON_OBJECT_SCHEMA
from contract.fields import (
    LogitBias,
    MaxTokens,
    MinP,
    MinTokens,
    ModelName,
    Penalty,
    Priority,
    PromptText,
    RepetitionPenalty,
    RequestBody,
    Seed,
    Stop,
    StopTokenIds,
    Temperature,
    TokenId,
    TokenIds,
    TopLogprobs,
    TopP,
    json_schema_compiles,
    no_nul,
)
from jobstore.models import Batch, File

Item = TypeVar("Item")

CHAT_ENDPOINT = "/v1/chat/completions"
COMPLETIONS_ENDPOINT = "/v1/completions"
Endpoint = Literal["/v1/chat/completions", "/v1/completions"]


class TextPart(RequestBody):
    """A part of a message's content; genq serves text only."""

    type: Literal["text"]
    text: str


class ChatMessage(RequestBody):
    """A message of a conversation. `developer` is OpenAI's newer name for `system`, and is rendered so."""

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


# vLLM's and OpenAI's fields that genq takes only at the value that changes nothing (vLLM's default), and
# why it takes no other: {field: (the no-op value, the reason)}. A client that always sends them (vLLM's
# benchmark sends `repetition_penalty: 1.0`, `logprobs: null`) runs untouched; another value is refused by
# name, never silently ignored.
NO_OPS: dict[str, tuple[Any, str]] = {
    "best_of": (1, "genq makes one choice per request"),
    "spaces_between_special_tokens": (True, "genq decodes special tokens as its tokenizer does"),
    "use_beam_search": (False, "genq does not search beams"),
    "length_penalty": (1.0, "genq does not search beams"),
    "truncate_prompt_tokens": (None, "genq never truncates a prompt; it refuses one too long"),
    "allowed_token_ids": (None, "genq does not restrict the vocabulary yet"),
    "return_tokens_as_token_ids": (False, "genq returns tokens as text"),
}

COMPLETION_NO_OPS: dict[str, tuple[Any, str]] = {
    "suffix": (None, "genq does not insert text (no suffix)"),
    "add_special_tokens": (True, "genq encodes a text prompt with the tokenizer's special tokens"),
}
CHAT_NO_OPS: dict[str, tuple[Any, str]] = {
    "echo": (False, "genq does not echo the conversation"),
    "add_generation_prompt": (True, "genq always opens the assistant's turn"),
    "continue_final_message": (False, "genq always opens a new assistant turn"),
    "add_special_tokens": (False, "the chat template places the special tokens"),
    "chat_template": (None, "genq renders with the model's own chat template"),
    "chat_template_kwargs": ({}, "genq renders the chat template with no extra arguments"),
    "tools": ([], "genq calls no tools"),
    "tool_choice": ("none", "genq calls no tools"),
}


def json_schema_of(response_format: dict[str, Any]) -> str | None:
    """The JSON schema (a JSON string) a response_format asks the output to follow; None for free text.
    ValueError naming what is wrong."""
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return JSON_OBJECT_SCHEMA
    if kind != "json_schema":
        raise ValueError(f'type must be "text", "json_object" or "json_schema", got {json.dumps(kind)}')
    spec = response_format.get("json_schema")
    schema = spec.get("schema") if isinstance(spec, dict) else None
    if not isinstance(schema, dict):
        raise ValueError(
            'json_schema.schema: give the JSON schema (an object) in {"json_schema": {"schema": ...}}'
        )
    text = json.dumps(schema)
    json_schema_compiles(text)  # one llguidance cannot follow: 400 naming response_format, not a failed job
    return text


def _only_no_op(table: dict[str, tuple[Any, str]], value: Any, field: str) -> Any:
    no_op, reason = table[field]
    if value is not None and value != no_op:
        raise ValueError(f"{reason}; send {json.dumps(no_op)} or leave it out")
    return value


class _Sampling(RequestBody):
    """The sampling fields both endpoints share, with OpenAI's (and vLLM's) names and genq's limits
    (contract/fields.py). A field genq takes only at its no-op value (NO_OPS) is refused with the reason for
    any other; a field neither OpenAI nor vLLM has is refused by name (extra="forbid")."""

    model: ModelName | None = None
    max_tokens: MaxTokens | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: int | None = Field(
        None, ge=-1, lt=2**31, description="vLLM's: the k most likely tokens; 0 or -1 is off."
    )
    seed: Seed | None = None
    stop: Stop | None = None
    stop_token_ids: StopTokenIds | None = None
    ignore_eos: bool | None = Field(
        None, description="vLLM's: generate past the end of sequence, to max_tokens."
    )
    stream: bool | None = Field(None, description="Batch requests cannot stream.")
    user: str | None = Field(None, max_length=256, description="Accepted and ignored.")
    n: int | None = Field(None, description="Choices of the prompt; a batch line makes 1.")
    best_of: int | None = Field(None, description="Only 1.")
    frequency_penalty: Penalty | None = None
    presence_penalty: Penalty | None = None
    repetition_penalty: RepetitionPenalty | None = None
    min_p: MinP | None = None
    min_tokens: MinTokens | None = None
    logit_bias: LogitBias | None = None
    prompt_logprobs: TopLogprobs | None = Field(
        None, description="vLLM's: each prompt token's log probability and this many alternatives."
    )
    include_stop_str_in_output: bool | None = Field(
        None, description="vLLM's: the stop string (or stop token) that ended the choice stays in its text."
    )
    skip_special_tokens: bool | None = Field(
        None, description="vLLM's: false keeps special tokens in the text (true by default)."
    )
    spaces_between_special_tokens: bool | None = Field(None, description="vLLM's; only true.")
    use_beam_search: bool | None = Field(None, description="vLLM's; only false.")
    length_penalty: float | None = Field(None, allow_inf_nan=False, description="vLLM's; only 1.")
    truncate_prompt_tokens: int | None = Field(None, description="vLLM's; only null.")
    allowed_token_ids: list[int] | None = Field(None, description="vLLM's; only null.")
    return_tokens_as_token_ids: bool | None = Field(None, description="vLLM's; only false.")
    response_format: dict[str, Any] | None = Field(
        None,
        description='{"type": "text"} (free text), {"type": "json_object"} (any JSON object) or '
        '{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}: the output follows it.',
    )

    @field_validator(*NO_OPS)
    @classmethod
    def no_op_only(cls, value, info: ValidationInfo):
        return _only_no_op(NO_OPS, value, info.field_name)

    @field_validator("response_format")
    @classmethod
    def known_format(cls, value):
        if value is not None:
            json_schema_of(value)
        return value

    @field_validator("stream")
    @classmethod
    def no_stream(cls, value):
        if value:
            raise ValueError("a batch request cannot stream; leave stream out or false")
        return value

    @field_validator("n")
    @classmethod
    def one_choice(cls, value):
        if value not in (None, 1):
            raise ValueError(
                "a batch line makes one choice (one job); send n=1, or n > 1 to the synchronous call"
            )
        return value

    def sampling(self) -> dict[str, Any]:
        """The genq job fields these set (unset ones keep genq's defaults, which are OpenAI's and vLLM's)."""
        fields = {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "seed": self.seed,
            "ignore_eos": self.ignore_eos,
            "include_stop_str_in_output": self.include_stop_str_in_output,
            "skip_special_tokens": self.skip_special_tokens,
            "min_p": self.min_p,
            "min_tokens": self.min_tokens,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "repetition_penalty": self.repetition_penalty,
            "top_k": None if self.top_k is None else max(self.top_k, 0),  # vLLM's -1: off, genq's 0
        }
        fields = {k: v for k, v in fields.items() if v is not None}
        if self.stop is not None:
            fields["stop"] = list(self.stop)
        if self.stop_token_ids:
            fields["stop_token_ids"] = list(self.stop_token_ids)
        if self.logit_bias:
            fields["logit_bias"] = dict(self.logit_bias)
        if self.prompt_logprobs is not None:
            fields["prompt_logprobs"] = self.prompt_logprobs
        if self.response_format is not None and (schema := json_schema_of(self.response_format)) is not None:
            fields["json_schema"] = schema
        return fields


class ChatCompletionRequest(_Sampling):
    """A body of POST /v1/chat/completions (in a batch line)."""

    messages: list[ChatMessage] = Field(min_length=1, max_length=1024)
    max_completion_tokens: MaxTokens | None = Field(None, description="OpenAI's newer name for max_tokens.")
    logprobs: bool | None = Field(None, description="The output tokens' log probabilities.")
    top_logprobs: TopLogprobs | None = Field(None, description="With logprobs: this many alternatives, 0-20.")
    echo: bool | None = Field(None, description="vLLM's; only false.")
    add_generation_prompt: bool | None = Field(None, description="vLLM's; only true.")
    continue_final_message: bool | None = Field(None, description="vLLM's; only false.")
    add_special_tokens: bool | None = Field(None, description="vLLM's; only false.")
    chat_template: str | None = Field(None, description="vLLM's; only null.")
    chat_template_kwargs: dict[str, Any] | None = Field(None, description="vLLM's; only {}.")
    tools: list[dict[str, Any]] | None = Field(None, description="Only [].")
    tool_choice: str | None = Field(None, description='Only "none".')
    parallel_tool_calls: bool | None = Field(None, description="Accepted; genq calls no tools.")

    @field_validator(*CHAT_NO_OPS)
    @classmethod
    def chat_no_op_only(cls, value, info: ValidationInfo):
        return _only_no_op(CHAT_NO_OPS, value, info.field_name)

    @model_validator(mode="after")
    def top_logprobs_needs_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs: send it with logprobs=true")
        return self

    def sampling(self) -> dict[str, Any]:
        fields = super().sampling()
        if self.logprobs:
            fields["logprobs"] = self.top_logprobs or 0
        return fields

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def max_tokens_field(self) -> str:
        """The field that set the limit: the one the caller gave."""
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"


class CompletionRequest(_Sampling):
    """A body of POST /v1/completions (in a batch line): one prompt, text or token ids."""

    prompt: PromptText | TokenIds = Field(description="Text to continue, or token ids used as they are.")
    echo: bool | None = Field(
        None,
        description="The reply begins with the prompt (and its log probabilities); with max_tokens 0, the reply "
        "is the prompt alone. Streamed: the first chunk carries the prompt.",
    )
    logprobs: TopLogprobs | None = Field(
        None, description="Each token's log probability and this many alternatives (0-20)."
    )
    suffix: str | None = Field(None, description="Only null.")
    add_special_tokens: bool | None = Field(None, description="vLLM's; only true (a text prompt gets BOS).")

    _echo_only: bool = PrivateAttr(False)  # echo with max_tokens 0: the answer is the prompt alone

    @field_validator(*COMPLETION_NO_OPS)
    @classmethod
    def completion_no_op_only(cls, value, info: ValidationInfo):
        return _only_no_op(COMPLETION_NO_OPS, value, info.field_name)

    @model_validator(mode="wrap")
    @classmethod
    def echo_alone(cls, data: Any, handler):
        """OpenAI's max_tokens 0 with echo: the prompt (and its log probabilities), nothing generated. The job
        draws one token, as vLLM's does, and the answer leaves it out (JobCreate.echo_only); without echo, 0
        gets max_tokens' own refusal."""
        alone = (
            isinstance(data, dict)
            and data.get("echo") is True
            and type(data.get("max_tokens")) is int
            and data["max_tokens"] == 0
        )
        model = handler({**data, "max_tokens": 1} if alone else data)
        model._echo_only = alone
        return model

    def sampling(self) -> dict[str, Any]:
        fields = super().sampling()
        if self.logprobs is not None:
            fields["logprobs"] = self.logprobs
        if self.echo:
            fields["echo"] = True
            if self.logprobs is not None:  # the prompt's tokens come with theirs
                fields["prompt_logprobs"] = max(self.logprobs, self.prompt_logprobs or 0)
        if self._echo_only:
            fields["echo_only"] = True
        return fields

    def requested_max_tokens(self) -> int:
        return self.max_tokens if self.max_tokens is not None else 16  # OpenAI's default for completions

    def max_tokens_field(self) -> str:
        return "max_tokens"


class StreamOptions(RequestBody):
    include_usage: bool | None = Field(None, description="A last chunk with the usage (and no choices).")


MAX_N = 16  # choices of one synchronous call's prompt


class _Synchronous(RequestBody):
    """What a synchronous call (POST /v1/chat/completions, /v1/completions) adds to a batch line's body: it
    may stream, and `priority` (genq's own field: `extra_body={"priority": 3}` in OpenAI's client)."""

    n: int | None = Field(
        None,
        description=f"Choices of each prompt, 1 to {MAX_N}: one job each; streamed, chunks carry `index`.",
    )
    stream: bool | None = Field(None, description="Answer as server-sent events as the tokens come.")
    stream_options: StreamOptions | None = None
    priority: Priority | None = Field(None, description="genq's priority: 0 (the default) most urgent … 9.")

    @field_validator("stream")
    @classmethod
    def no_stream(cls, value):  # replaces the batch lines' refusal: a synchronous call may stream
        return value

    @field_validator("n")
    @classmethod
    def one_choice(cls, value):  # replaces the batch lines' refusal: a synchronous call makes up to MAX_N
        if value is not None and not 1 <= value <= MAX_N:
            raise ValueError(f"must be 1 to {MAX_N}, got {value}")
        return value

    def choices(self) -> int:
        """Choices per prompt (n)."""
        return self.n or 1


class ChatCompletionCreate(_Synchronous, ChatCompletionRequest):
    """Body of POST /v1/chat/completions: a chat to answer now (it waits for its job, or streams it)."""


PromptList = Annotated[list[PromptText] | list[TokenIds], Field(min_length=1, max_length=256)]


def _prompt_kind(value: Any) -> str:
    """A list of prompts ("many": its items are strings or lists) or one prompt ("one"), so that one prompt
    gets the same verdict as in a batch line."""
    many = isinstance(value, list) and bool(value) and isinstance(value[0], (str, list))
    return "many" if many else "one"


class CompletionCreate(_Synchronous, CompletionRequest):
    """Body of POST /v1/completions: a prompt to continue now (it waits for its job, or streams it); or a list
    of prompts (texts or token-id lists), one job and one choice (`index`) each."""

    prompt: Annotated[
        Annotated[PromptText | TokenIds, Tag("one")] | Annotated[PromptList, Tag("many")],
        Discriminator(_prompt_kind),
    ] = Field(
        description="Text to continue, token ids used as they are, or a list of either (one choice each)."
    )

    def prompts(self) -> list[str | list[int]]:
        """The prompts, one per choice."""
        many = isinstance(self.prompt, list) and not isinstance(self.prompt[0], int)
        return list(self.prompt) if many else [self.prompt]  # type: ignore[list-item]


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ReplyMessage(BaseModel):
    role: Literal["assistant"]
    content: str


class TokenChoice(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(TokenChoice):
    top_logprobs: list[TokenChoice]


class ChatLogprobs(BaseModel):
    """OpenAI's chat logprobs: each output token's, with its `top_logprobs` most likely alternatives."""

    content: list[ChatTokenLogprob] | None


class CompletionLogprobs(BaseModel):
    """OpenAI's completions logprobs (the prompt's tokens first with `echo`; its first token's are null)."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class ChatChoice(BaseModel):
    index: int
    message: ReplyMessage
    logprobs: ChatLogprobs | None
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
    logprobs: CompletionLogprobs | None
    finish_reason: Literal["stop", "length"] | None
    prompt_logprobs: list[dict[str, dict[str, Any]] | None] | None = Field(
        None, description="vLLM's, with `prompt_logprobs`: per prompt token (null for the first)."
    )


class Completion(BaseModel):
    """A text completion (OpenAI's text_completion); with `stream`, text_completion chunk events instead."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[TextChoice]
    usage: Usage


class TokenizeRequest(RequestBody):
    """Body of POST /tokenize (vLLM's): a text prompt, or chat messages rendered with the chat template."""

    model: ModelName | None = None
    prompt: str | None = Field(None, description="Text to tokenize. Give this or messages.")
    messages: list[ChatMessage] | None = Field(None, min_length=1, max_length=1024)
    add_special_tokens: bool | None = Field(
        None, description="A prompt's special tokens (BOS), true by default; messages: only false."
    )
    add_generation_prompt: bool | None = Field(
        None, description="Messages: only true (the assistant's turn)."
    )
    return_token_strs: bool | None = Field(None, description="Also each token's string.")

    @model_validator(mode="after")
    def prompt_xor_messages(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of `prompt` or `messages`")
        if self.messages is not None and self.add_special_tokens:
            raise ValueError("add_special_tokens: the chat template places the special tokens; send false")
        if self.messages is not None and self.add_generation_prompt is False:
            raise ValueError("add_generation_prompt: genq always opens the assistant's turn; send true")
        return self


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class TokenizerInfo(BaseModel):
    """vLLM's /tokenizer_info: the tokenizer's special tokens and chat template; model_max_length is
    MAX_MODEL_LEN."""

    tokenizer_class: str
    bos_token: str | None
    eos_token: str | None
    pad_token: str | None
    unk_token: str | None
    chat_template: str | None
    model_max_length: int


class DetokenizeRequest(RequestBody):
    """Body of POST /detokenize (vLLM's)."""

    model: ModelName | None = None
    tokens: list[TokenId] = Field(max_length=1_000_000)


class DetokenizeResponse(BaseModel):
    prompt: str


class ModelCard(BaseModel):
    """A served model (OpenAI's Model, with vLLM's `root` and `max_model_len`)."""

    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "genq"
    root: str
    parent: str | None = None
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


CustomId = Annotated[str, StringConstraints(min_length=1, max_length=512)]


class BatchLine(RequestBody):
    """One line of a batch input file."""

    custom_id: CustomId
    method: Literal["POST"]
    url: Endpoint
    body: dict[str, Any]

    @field_validator("custom_id")
    @classmethod
    def no_nul_in_custom_id(cls, value: str) -> str:
        return no_nul(value)


class ChatBatchLine(BatchLine):
    """A line of a /v1/chat/completions batch: validated from its JSON text in one pass."""

    body: ChatCompletionRequest


class CompletionBatchLine(BatchLine):
    """A line of a /v1/completions batch."""

    body: CompletionRequest


class BatchCreate(RequestBody):
    """Body of POST /v1/batches. `metadata.priority` ("0" most urgent … "9") sets the jobs' priority."""

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

    purpose: Annotated[str, AfterValidator(no_nul)] | None = Field(
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
    model: str | None = Field(
        description="The model of the batch's requests; null when its file mixes models (each output line "
        "names its own)."
    )
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
    def of(cls, batch: Batch, counts: RequestCounts, model: str | None) -> BatchObject:
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
