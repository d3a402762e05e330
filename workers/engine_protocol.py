"""The messages between a worker (workers/engine_host.py) and its engine process (workers/engine_process.py).

Each message is a NamedTuple of its own, named by a `Kind`: pickled, a tuple of plain values plus a reference
to its class, the cheapest object to send through a multiprocessing pipe every step (vLLM's engine core speaks
the same way: an enum of request types and one class per message). Who sends what:

    worker ──AddRequest | AbortRequest | StatsRequest | Stop──▶ engine process
    worker ◀──Ready | StartFailed | StepReport | Refused | StepFailed | StatsReply── engine process

A `StepReport` is one engine step, by columns: a list per Delta field rather than an object per request (a
step of 256 requests unpickles in about a third of the time; the worker's reader thread decodes one every
step).

This module imports neither torch nor batching's engine: the worker process imports it.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator
from itertools import repeat
from typing import Any, NamedTuple

from contract.deltas import Delta


class Kind(enum.Enum):
    # worker -> engine process
    ADD = "add"
    ABORT = "abort"
    STATS = "stats"
    STOP = "stop"
    # engine process -> worker
    READY = "ready"
    START_FAILED = "start_failed"
    STEP = "step"
    REFUSED = "refused"
    STEP_FAILED = "step_failed"
    STATS_REPLY = "stats_reply"


# --- worker -> engine process --------------------------------------------------------------------------


class AddRequest(NamedTuple):
    """Engine.add_request's arguments; the engine process runs it with output_kind="delta"."""

    request_id: str
    prompt: str | list[int]
    params: Any  # batching.SamplingParams
    priority: int
    resume_token_ids: list[int] | None
    # its place within its priority class (batching/admission_order.py): when its job was created, the
    # output its tenant's recent jobs predict for it, and its deadline (seconds since the epoch)
    arrival_time: float | None = None
    predicted_output_tokens: int | None = None
    deadline: float | None = None
    # the worker makes its text from the reported token ids (batching.detokenizer.OutputText): the engine
    # runs it with detokenize=False and reports no text for it
    text_in_worker: bool = False

    @property
    def kind(self) -> Kind:
        return Kind.ADD


class AbortRequest(NamedTuple):
    request_id: str

    @property
    def kind(self) -> Kind:
        return Kind.ABORT


class StatsRequest(NamedTuple):
    ticket: int  # named again by the StatsReply

    @property
    def kind(self) -> Kind:
        return Kind.STATS


class Stop(NamedTuple):
    @property
    def kind(self) -> Kind:
        return Kind.STOP


# --- engine process -> worker --------------------------------------------------------------------------


class Ready(NamedTuple):
    """The engine is built: its resolved config and what it runs on (device, dtype, KV blocks, attention)."""

    config: Any  # batching.EngineConfig
    info: dict

    @property
    def kind(self) -> Kind:
        return Kind.READY


class StartFailed(NamedTuple):
    error: str  # the exception and its traceback

    @property
    def kind(self) -> Kind:
        return Kind.START_FAILED


class Refused(NamedTuple):
    """Engine.add_request refused the request (a ValueError)."""

    request_id: str
    error: str

    @property
    def kind(self) -> Kind:
        return Kind.REFUSED


class StepFailed(NamedTuple):
    """A step raised: every request that was in the engine failed with it."""

    request_ids: list[str]
    value_error: bool  # the step raised a ValueError (the requests' own fault), else another error
    error: str

    @property
    def kind(self) -> Kind:
        return Kind.STEP_FAILED


class StatsReply(NamedTuple):
    ticket: int
    stats: dict

    @property
    def kind(self) -> Kind:
        return Kind.STATS_REPLY


class RequestNews(NamedTuple):
    """What else changed for one request: sent with its first update, and when one of these changed."""

    num_preemptions: int
    first_token_time: float | None  # time.time() of the request's first token in this engine
    prompt_token_ids: list[int] | None  # in the request's first update only
    # in the first update, when the request asked: one [token, logprob, top] per prompt token, the first
    # token's logprob None (nothing comes before it)
    prompt_logprobs: list | None = None


class StepReport(NamedTuple):
    """One engine step: the requests that changed, a list per Delta field, `news` for the few whose other facts
    changed, and the step's stats."""

    request_ids: list[str]
    starts: list[int]
    token_ids: list[list[int]]
    text_starts: list[int]
    texts: list[str]
    finish_reasons: list[str | None]
    # None when no request of the step has per-token fields (log probabilities)
    fields: list[dict | None] | None
    news: dict[str, RequestNews]
    stats: dict
    step_time: float

    @property
    def kind(self) -> Kind:
        return Kind.STEP

    def deltas(self) -> Iterator[tuple[str, Delta]]:
        """(request id, its Delta) for each request that changed."""
        fields = self.fields or repeat(None)
        for row in zip(
            self.request_ids,
            self.starts,
            self.token_ids,
            self.text_starts,
            self.texts,
            self.finish_reasons,
            fields,
        ):
            yield row[0], tuple.__new__(Delta, row[1:])  # built in C: Delta(...) runs Python, per token
