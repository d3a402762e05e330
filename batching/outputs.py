"""What the engine reports about a request after a step."""

from __future__ import annotations

from typing import NamedTuple

from batching.logprobs import TokenLogprob


class RequestOutput(NamedTuple):
    """A NamedTuple: the engine makes one per request per step, and a tuple built in C (`tuple.__new__`, as
    engine.py builds delta outputs) costs a fraction of a class's __init__ of 13 fields."""

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
    prompt_logprobs: list[TokenLogprob] | None = None
