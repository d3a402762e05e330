"""A job's engine phases as OpenTelemetry spans, made in the worker from what its job book already knows: the
claim, each step's report of the job (first token time, preemption count) and the end of its hold. Nothing is
asked of the engine for them. Off (no tracing: contract/tracing.py), each hook is one test of a global.

Each hold of a job (an attempt: a job handed back or recovered is held again) is a genq.job span whose parent is
the API request that created the job (its row's traceparent, contract/tracing.py), so the request and every hold
of its job are one trace; a job without one (created with tracing off, or outside a request) starts a trace of
its own per hold:

    genq.job            created (or last sent to the queue) -> the hold ended; attributes: job id, tenant,
                        priority, attempt, outcome, tokens
      queued            created (or last sent) -> claimed by this worker
      prefill           claimed and submitted to the engine -> its first token (the engine's clock)
      preempted         the job's last step with tokens before a preemption -> its first step with tokens after
                        it (the engine reports how many times it was preempted, not when)
    events on genq.job: admitted (claimed and submitted), first_token, preempted, resumed, finished
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from contract.tracing import parent_context

_spans: JobSpans | None = None  # set by start() in a worker whose tracing is on


@dataclass(slots=True)
class _Hold:
    root: Any  # the genq.job span
    context: Any  # a context whose current span is root
    prefill: Any  # open until the first token
    preemptions: int
    last_step_ns: int


class JobSpans:
    """The spans of the jobs a worker holds, by engine request id (one per hold)."""

    def __init__(self, tracer: Any):
        from opentelemetry.trace import set_span_in_context

        self._tracer, self._in_context = tracer, set_span_in_context
        self._lock = threading.Lock()
        self._holds: dict[str, _Hold] = {}

    def claimed(self, held: Any) -> None:
        now = time.time_ns()
        job = held.job
        queued_ns = min(_ns(job.enqueued_at or job.created_at, now), now)
        root = self._tracer.start_span(
            "genq.job",
            context=parent_context(job.traceparent),  # the request that created the job, if traced
            start_time=queued_ns,
            attributes={
                "genq.job_id": str(job.id),
                "genq.tenant": str(job.tenant_id),
                "genq.priority": job.priority,
                "genq.attempt": job.attempts,
                "genq.resumed_tokens": len(job.output_token_ids or ()),
            },
        )
        context = self._in_context(root)
        self._tracer.start_span("queued", context=context, start_time=queued_ns).end(end_time=now)
        root.add_event("admitted", timestamp=now)
        prefill = self._tracer.start_span("prefill", context=context, start_time=now)
        with self._lock:
            self._holds[held.request_id] = _Hold(root, context, prefill, held.num_preemptions, now)

    def stepped(self, added: list) -> None:
        """One engine step's new output, (held job, delta) pairs."""
        now = time.time_ns()
        with self._lock:
            holds = [(held, self._holds.get(held.request_id)) for held, _ in added]
        for held, hold in holds:
            if hold is None:
                continue
            if hold.prefill is not None and held.first_token_at is not None:
                first = min(_ns(held.first_token_at, now), now)
                hold.prefill.end(end_time=first)
                hold.prefill = None
                hold.root.add_event("first_token", timestamp=first)
            if held.num_preemptions > hold.preemptions:
                attributes = {"genq.preemptions": held.num_preemptions}
                hold.root.add_event("preempted", timestamp=hold.last_step_ns, attributes=attributes)
                span = self._tracer.start_span(
                    "preempted", context=hold.context, start_time=hold.last_step_ns, attributes=attributes
                )
                span.end(end_time=now)
                hold.root.add_event("resumed", timestamp=now)
                hold.preemptions = held.num_preemptions
            hold.last_step_ns = now

    def done(self, held: Any, outcome: Any) -> None:
        """The worker's hold on the job ended (succeeded, failed, handed back, ...)."""
        with self._lock:
            hold = self._holds.pop(held.request_id, None)
        if hold is None:
            return
        now = time.time_ns()
        if hold.prefill is not None:
            hold.prefill.end(end_time=now)
        hold.root.set_attribute("genq.outcome", outcome.value)
        hold.root.set_attribute("genq.tokens", len(held.transcript.token_ids))
        hold.root.set_attribute("genq.preemptions", held.num_preemptions)
        hold.root.add_event("finished", timestamp=now, attributes={"genq.outcome": outcome.value})
        hold.root.end(end_time=now)


def start(tracer: Any) -> JobSpans | None:
    """Spans for this process's jobs from now on, with `tracer` (None: off)."""
    global _spans
    _spans = None if tracer is None else JobSpans(tracer)
    return _spans


def claimed(held: Any) -> None:
    if _spans is not None:
        _spans.claimed(held)


def stepped(added: list) -> None:
    if _spans is not None:
        _spans.stepped(added)


def done(held: Any, outcome: Any) -> None:
    if _spans is not None:
        _spans.done(held, outcome)


def _ns(moment: datetime | None, default: int) -> int:
    return default if moment is None else int(moment.timestamp() * 1_000_000_000)
