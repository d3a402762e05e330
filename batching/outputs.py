"""What the engine reports about a request after a step."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]  # generated so far
    text: str  # decoded generated text (stop string excluded)
    finished: bool
    finish_reason: str | None  # "stop", "length", "abort" or None while running
    num_preemptions: int
    arrival_time: float  # time.time() seconds
    first_token_time: float | None
    finish_time: float | None
    priority: int = 5
