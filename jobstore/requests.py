"""What a job asks for. The API validates each request body with `JobCreate`, and the worker validates
the stored job row with it again before use: the worker trusts nothing a row says beyond this schema."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, field_validator, model_validator

from jobstore.dispatch import DEFAULT_PRIORITY

StopString = Annotated[str, StringConstraints(min_length=1, max_length=128)]
MetadataKey = Annotated[str, StringConstraints(min_length=1, max_length=64)]
MetadataValue = Annotated[str, StringConstraints(max_length=512)] | int | float | bool | None


class JobCreate(BaseModel):
    """A generation job: a prompt (text or token ids) and how to sample its continuation."""

    model_config = ConfigDict(extra="forbid", strict=True)

    prompt: str | None = Field(None, min_length=1, description="Text to continue. Give this or input_ids.")
    input_ids: list[Annotated[int, Field(ge=0, lt=2**31)]] | None = Field(
        None, min_length=1, description="Token ids to continue, used as they are. Give this or prompt."
    )
    max_tokens: int = Field(
        64, ge=1, description="Most tokens to generate; prompt + max_tokens <= max_model_len."
    )
    temperature: float = Field(1.0, ge=0.0, le=2.0, allow_inf_nan=False, description="0 samples greedily.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, allow_inf_nan=False, description="Nucleus sampling; 1 is off.")
    top_k: int = Field(0, ge=0, lt=2**31, description="Sample from the k most likely tokens; 0 is off.")
    seed: int | None = Field(
        None, ge=0, le=2**63 - 1, description="Same seed, same tokens, whatever the batch."
    )
    stop: list[StopString] = Field(
        default_factory=list, max_length=8, description="Stop before these strings."
    )
    priority: int = Field(DEFAULT_PRIORITY, ge=0, le=9, description="0 is the most urgent, 9 the least.")
    metadata: dict[MetadataKey, MetadataValue] = Field(
        default_factory=dict, max_length=16, description="Your own labels, returned with the job."
    )

    @field_validator("stop", "metadata")
    @classmethod
    def no_nul(cls, value):
        """Postgres text and JSON cannot hold NUL characters; refuse them rather than fail later."""
        if _has_nul(value):
            raise ValueError("NUL characters are not supported")
        return value

    @model_validator(mode="after")
    def prompt_xor_input_ids(self) -> JobCreate:
        if (self.prompt is None) == (self.input_ids is None):
            raise ValueError("give exactly one of `prompt` or `input_ids`")
        return self


def _has_nul(value) -> bool:
    if isinstance(value, str):
        return "\x00" in value
    if isinstance(value, list):
        return any(map(_has_nul, value))
    if isinstance(value, dict):
        return any(_has_nul(k) or _has_nul(v) for k, v in value.items())
    return False
