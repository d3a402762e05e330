"""What the engine reports about a request after a step."""

from __future__ import annotations

from dataclasses import dataclass, field

from batching.logprobs import TokenLogprob


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    # generated so far and its decoded text (stop string excluded); with SamplingParams(output_kind="delta"),
    # only what this output adds to the request's earlier ones (and prompt_token_ids only in its first)
    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None  # "stop", "length", "abort" or None while running
    num_preemptions: int
    arrival_time: float  # time.time() seconds
    first_token_time: float | None
    finish_time: float | None
    priority: int = 5
    # with SamplingParams.logprobs: token_ids' log probabilities, one each (in a delta, the new ones'); with
    # prompt_logprobs: those of the prompt's tokens but the first, where prompt_token_ids is given
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob] | None = field(default=None)
