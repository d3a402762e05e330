"""The rule of each request field, declared once: its JSON type, its limits, its description. POST /jobs
(and the stored job the worker checks, contract/requests.py), the /v1 bodies and a batch file's lines
declare their fields with these types, so a value gets the same verdict wherever it is sent.

The rule for types is strict, as OpenAI's own API is: a value must have the field's JSON type. `"8"` is
not an integer, `8.0` is not an integer either, `1` is not a boolean; an integer is a number (a
`temperature` of `1` is 1.0). `null` is the same as leaving the field out (its default), on every surface.
A body model derives from `RequestBody`, which makes every field it declares strict, named or not here,
and refuses unknown fields by name (genq never ignores what it cannot honour).

Limits that depend on the deployment (the model's `max_model_len`, its vocabulary, the models it serves)
are checked where the model is known: webapi/prompts.py, and `ModelName` through the validation context.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Annotated, Any

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StringConstraints,
    ValidationInfo,
)
from pydantic_core import PydanticCustomError

SERVED_MODELS = "served_models"  # the validation context's key: the names `model` may give (a frozenset)
# the validation context's key: a function from a body's `model` (None: the fleet's default) to (the served
# model's name, its vocabulary size: token ids are below it), or None for a model it does not serve
VOCAB_SIZE = "vocab_size"


class RequestBody(BaseModel):
    """A request body (or part of one): strict JSON types, unknown fields refused by name."""

    model_config = ConfigDict(extra="forbid", strict=True)


def no_nul(value: Any) -> Any:
    """Postgres text and JSON cannot hold NUL characters: refuse them rather than fail later."""
    if has_nul(value):
        raise ValueError("NUL characters are not supported")
    return value


def has_nul(value: Any) -> bool:
    if isinstance(value, str):
        return "\x00" in value
    if isinstance(value, list):
        return any(map(has_nul, value))
    if isinstance(value, dict):
        return any(has_nul(k) or has_nul(v) for k, v in value.items())
    return False


def drop_nulls(data: Any) -> Any:
    """A body's fields without those given as null (null means "the default")."""
    return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data


def _as_list(value: str | list[str]) -> list[str]:
    return [value] if isinstance(value, str) else value


def _served(value: str, info: ValidationInfo) -> str:
    """The model must be one the fleet serves (webapi/fleet.py), when the caller's
    validation context says which (the API always does); 404 model_not_found otherwise (webapi/validation.py)."""
    served = (info.context or {}).get(SERVED_MODELS)
    if served is not None and value not in served:
        raise PydanticCustomError(
            "model_not_found",
            "the model `{model}` does not exist here; this server serves {served}",
            {"model": value, "served": ", ".join(f"`{name}`" for name in sorted(served))},
        )
    return value


def _token_id_keys(value: dict[str, float], info: ValidationInfo) -> dict[str, float]:
    """logit_bias's keys are token ids written as decimal strings (OpenAI's form), below the vocabulary size of
    the model the body names (a field declared before this one), when the validation context says it; returned
    in canonical form ("007" -> "7")."""
    vocab_of = (info.context or {}).get(VOCAB_SIZE)
    named = vocab_of(info.data.get("model")) if vocab_of is not None else None
    name, vocab = named if named is not None else (None, None)
    canonical = {}
    for key, bias in value.items():
        if not (key.isascii() and key.isdigit()) or int(key) >= 2**31:
            raise ValueError(f'keys are token ids as decimal strings, such as "50256"; got "{key[:32]}"')
        if vocab is not None and int(key) >= vocab:
            raise ValueError(
                f"token id {int(key)} is outside the vocabulary of the model `{name}`: ids are below {vocab}"
            )
        canonical[str(int(key))] = bias
    return canonical


# --- the prompt
PromptText = Annotated[str, StringConstraints(min_length=1)]  # NUL is fine: prompts are stored as bytes
TokenId = Annotated[int, Field(ge=0, lt=2**31)]
TokenIds = Annotated[list[TokenId], Field(min_length=1)]

# --- sampling
MaxTokens = Annotated[
    int, Field(ge=1, description="Most tokens to generate; prompt + max_tokens <= max_model_len.")
]
MinTokens = Annotated[
    int,
    Field(
        ge=0,
        lt=2**31,
        description="vLLM's: no end of sequence, stop token or stop string before this many tokens; at most "
        "max_tokens.",
    ),
]
Temperature = Annotated[
    float, Field(ge=0.0, le=2.0, allow_inf_nan=False, description="0 to 2; 0 samples greedily.")
]
TopP = Annotated[float, Field(gt=0.0, le=1.0, allow_inf_nan=False, description="Nucleus sampling; 1 is off.")]
TopK = Annotated[int, Field(ge=0, lt=2**31, description="Sample from the k most likely tokens; 0 is off.")]
Penalty = Annotated[
    float, Field(ge=-2.0, le=2.0, allow_inf_nan=False, description="-2 to 2 (OpenAI's); 0 is off.")
]
RepetitionPenalty = Annotated[
    float,
    Field(
        gt=0.0, le=10.0, allow_inf_nan=False, description="vLLM's: over 0; 1 is off, above 1 repeats less."
    ),
]
MinP = Annotated[float, Field(ge=0.0, le=1.0, allow_inf_nan=False, description="0 to 1; 0 is off.")]
TopLogprobs = Annotated[
    int, Field(ge=0, le=20, description="0 to 20 most likely alternatives (OpenAI's limit).")
]
Seed = Annotated[int, Field(ge=0, le=2**63 - 1, description="Same seed, same tokens, whatever the batch.")]
LogitBias = Annotated[
    dict[str, Annotated[float, Field(ge=-100.0, le=100.0, allow_inf_nan=False)]],
    Field(
        max_length=300,
        description="OpenAI's: {\"token id\": bias from -100 to 100}, at most 300; added to those tokens' logits "
        "before sampling (greedy too); -100 bans a token, 100 all but forces it.",
    ),
    AfterValidator(_token_id_keys),
]
StopString = Annotated[str, StringConstraints(min_length=1, max_length=128), AfterValidator(no_nul)]
StopList = Annotated[list[StopString], Field(max_length=8)]
StopTokenIds = Annotated[
    list[TokenId], Field(max_length=64, description="Stop when any of these token ids is generated.")
]
# a string or up to 8 strings (OpenAI's form), always a list once validated
Stop = Annotated[
    StopString | StopList,
    AfterValidator(_as_list),
    Field(description="Stop before any of these strings: one string, or a list of up to 8."),
]


def json_schema_compiles(value: str) -> str:
    """A JSON schema (as a JSON string) that llguidance, the worker's grammar engine, can constrain output to."""
    import llguidance  # imports no torch

    no_nul(value)
    try:
        # the options batching/grammar.py compiles it with (that module imports torch: the API cannot)
        grammar = llguidance.LLMatcher.grammar_from_json_schema(
            value, overrides={"whitespace_flexible": False}
        )
    except ValueError as exc:
        raise ValueError(f"not a JSON schema genq can follow: {exc}") from exc
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error:
        raise ValueError(f"not a JSON schema genq can follow: {error}")
    return value


JsonSchema = Annotated[
    str,
    StringConstraints(min_length=1, max_length=65536),
    AfterValidator(json_schema_compiles),
    Field(
        description='Structured output: a JSON schema, as a JSON string, the output follows ("{}": any JSON).'
    ),
]

# --- scheduling and bookkeeping
Priority = Annotated[int, Field(ge=0, le=9, description="0 is the most urgent, 9 the least.")]


def rfc3339_time(value: Any) -> datetime:
    """An RFC 3339 date-time with its offset ("2026-11-27T01:00:00Z", "2026-11-27T02:00:00+01:00"), as JSON writes a
    time, or a timezone-aware datetime (a stored job's). A time without an offset is refused: it names no instant."""
    time = value if isinstance(value, datetime) else None
    if isinstance(value, str) and len(value) >= 19 and value[10] in "Tt ":
        try:
            time = datetime.fromisoformat(value.upper())
        except ValueError:
            pass
    example = '"2026-11-27T01:00:00Z"'
    shown = value.isoformat() if isinstance(value, datetime) else json.dumps(value)[:60]
    if time is None:
        raise ValueError(f"expected an RFC 3339 date-time such as {example}, got {shown}")
    if time.utcoffset() is None:
        raise ValueError(f"give the time's offset from UTC (Z or +hh:mm), as in {example}; got {shown}")
    return time


Deadline = Annotated[
    datetime,
    BeforeValidator(rfc3339_time),
    Field(
        description="When the result is wanted: an RFC 3339 date-time with its offset (Z or +hh:mm), in the "
        "future. Among the jobs of its priority, one whose deadline is at risk runs first (earliest deadline "
        "first); the job's `deadline_status` says whether it is at risk, met or missed."
    ),
]
MetadataKey = Annotated[str, StringConstraints(min_length=1, max_length=64)]
MetadataValue = Annotated[str, StringConstraints(max_length=512)] | int | float | bool | None
ModelName = Annotated[
    str,
    StringConstraints(max_length=256),
    AfterValidator(_served),
    Field(
        description="A served model: one a live worker serves, MODEL, a name in MODEL_ALIASES or SERVED_MODELS; "
        "another answers 404."
    ),
]
