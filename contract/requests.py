"""What a job asks for. The API validates each request body with `JobCreate`, and the worker validates
the stored job row with it again before use: the worker trusts nothing a row says beyond this schema.
Each field's rule (type, limits) is declared once, in contract/fields.py."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import Field, ValidationInfo, field_validator, model_validator

from contract.dispatch import DEFAULT_PRIORITY
from contract.fields import (
    Deadline,
    JsonSchema,
    LogitBias,
    MaxTokens,
    MetadataKey,
    MetadataValue,
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
    TokenIds,
    TopK,
    TopLogprobs,
    TopP,
    no_nul,
)

__all__ = ["OPTIONS", "JobCreate", "MetadataValue", "job_columns", "options_of", "request_fields"]


class JobCreate(RequestBody):
    """A generation job: a prompt (text or token ids) and how to sample its continuation."""

    # first: the fields after it are checked against the model it names (logit_bias's vocabulary)
    model: ModelName | None = Field(
        None, description="The served model to run on (GET /models lists them); absent: the fleet's default."
    )
    prompt: PromptText | None = Field(None, description="Text to continue. Give this or input_ids.")
    input_ids: TokenIds | None = Field(
        None, description="Token ids to continue, used as they are. Give this or prompt."
    )
    max_tokens: MaxTokens = 64
    min_tokens: MinTokens = 0
    temperature: Temperature = 1.0
    top_p: TopP = 1.0
    top_k: TopK = 0
    seed: Seed | None = None
    stop: Stop = Field(default_factory=list)
    stop_token_ids: StopTokenIds = Field(default_factory=list)
    ignore_eos: bool = Field(False, description="Generate past the end-of-sequence token, up to max_tokens.")
    include_stop_str_in_output: bool = Field(
        False, description="The stop string (or stop token) that ended the job stays at the end of the text."
    )
    skip_special_tokens: bool = Field(
        True, description="False keeps special tokens (BOS, EOS, ...) in the text."
    )
    min_p: MinP = Field(0.0, description="Drop tokens less likely than min_p times the most likely one.")
    presence_penalty: Penalty = Field(0.0, description="Subtracted from each generated token's logit, once.")
    frequency_penalty: Penalty = Field(0.0, description="Subtracted per occurrence of each generated token.")
    repetition_penalty: RepetitionPenalty = Field(
        1.0,
        description="Divides (multiplies, if negative) the logit of every token of the prompt and output.",
    )
    logit_bias: LogitBias = Field(default_factory=dict)
    logprobs: TopLogprobs | None = Field(
        None, description="Each output token's log probability and its this many most likely alternatives."
    )
    prompt_logprobs: TopLogprobs | None = Field(
        None, description="Each prompt token's (but the first) log probability, and this many alternatives."
    )
    json_schema: JsonSchema | None = None
    echo: bool = Field(
        False, description="/v1/completions: the reply's text and log probabilities begin with the prompt's."
    )
    echo_only: bool = Field(
        False,
        description="/v1/completions' echo with max_tokens 0: the reply is the prompt alone (the job draws one "
        "token, as vLLM does, and the reply leaves it out).",
    )
    priority: Priority = DEFAULT_PRIORITY
    deadline: Deadline | None = None
    metadata: dict[MetadataKey, MetadataValue] = Field(
        default_factory=dict, max_length=16, description="Your own labels, returned with the job."
    )

    @field_validator("metadata")
    @classmethod
    def no_nul(cls, value):
        return no_nul(value)

    @field_validator("min_tokens")
    @classmethod
    def at_most_max_tokens(cls, value: int, info: ValidationInfo) -> int:
        max_tokens = info.data.get("max_tokens")
        if max_tokens is not None and value > max_tokens:
            raise ValueError(f"must be at most max_tokens ({max_tokens}), got {value}")
        return value

    @model_validator(mode="after")
    def prompt_xor_input_ids(self) -> JobCreate:
        if (self.prompt is None) == (self.input_ids is None):
            raise ValueError("give exactly one of `prompt` or `input_ids`")
        if self.echo_only and not (self.echo and self.max_tokens == 1):
            raise ValueError("echo_only: send it with echo=true and max_tokens=1")
        return self


# JobCreate's fields stored together in the job's `options` column (JSONB), those that differ from their
# defaults: the sampling controls beyond the columns every job has
OPTIONS = (
    "min_tokens",
    "stop_token_ids",
    "ignore_eos",
    "include_stop_str_in_output",
    "skip_special_tokens",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logit_bias",
    "logprobs",
    "prompt_logprobs",
    "json_schema",
    "echo",
    "echo_only",
)


def job_columns(request: Mapping[str, Any]) -> dict[str, Any]:
    """A validated request (JobCreate's fields) as the job row's columns: OPTIONS in `options`."""
    columns = {name: value for name, value in request.items() if name not in OPTIONS}
    columns["options"] = options_of(request)
    return columns


def options_of(request: Mapping[str, Any]) -> dict[str, Any]:
    """The job's `options` column: the request's OPTIONS that differ from their defaults."""
    return {name: request[name] for name in OPTIONS if name in request and request[name] != _DEFAULTS[name]}


def request_fields(row: Any) -> dict[str, Any]:
    """The request a stored job holds (JobCreate's fields), from its columns."""
    options = getattr(row, "options", None) or {}
    return {
        name: options.get(name, _DEFAULTS[name])
        if name in OPTIONS
        else getattr(row, "metadata_" if name == "metadata" else name)
        for name in JobCreate.model_fields
    }


_DEFAULTS = {name: JobCreate.model_fields[name].get_default(call_default_factory=True) for name in OPTIONS}
