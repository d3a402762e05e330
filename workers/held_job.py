"""HeldJob: one claimed job in a worker, from its claim to its end, and the one record of it.

It is the engine's request (an EngineRequest: the output so far, the engine's news), the job's row as claimed,
its lease, what the row holds of its output, and what admission (workers/admission.py) weighs when a more
urgent job wants its place. The job book (workers/job_book.py) keeps them; the engine host's reader thread
writes their transcripts; the book's writer thread reads them to write rows.
"""

from __future__ import annotations

import time
from datetime import datetime, timezone

from batching import SamplingParams
from contract.deltas import Delta, Position, Transcript
from jobstore import jobs
from jobstore.job_events import EventKind, event
from jobstore.models import Job
from workers.engine_host import EngineRequest
from workers.engine_protocol import RequestNews


class HeldJob(EngineRequest):
    __slots__ = (
        "job",
        "lease",
        "key",
        "kept",
        "kept_bytes",
        "claimed_at",
        "created_at",
        "handbacks",
        "events",
        "kept_events",
        "row_events",
        "ran_at",
    )

    def __init__(self, job: Job, lease: str):
        text = job.output_text or ""
        # one engine request per attempt: a stale attempt still in the engine never blocks a new one
        super().__init__(f"{job.id}/{job.attempts}", job.priority, Transcript(job.output_token_ids, text))
        self.job = job
        self.lease = lease  # the worker_id its row carries: one per claim
        self.key = job.id.hex  # the job's name in token events
        self.kept = self.transcript.position  # output tokens and characters the row holds
        self.kept_bytes = len(text.encode())  # the UTF-8 bytes of those characters
        self.claimed_at = time.monotonic()
        self.created_at, self.handbacks = job.created_at, job.handbacks  # what admission weighs
        # the row's events as claimed, and those this hold records (preempted, resumed: jobstore/job_events.py),
        # the first `kept_events` of them written; appended by the reader thread, written by the writer's
        self.row_events = len(job.events or ())
        self.events: list[dict] = []
        self.kept_events = 0
        self.ran_at = time.time()  # when it last made tokens (until the first: its claim)

    @property
    def prompt(self) -> str | list[int]:
        return self.job.prompt if self.job.prompt is not None else list(self.job.input_ids)

    @property
    def resume_token_ids(self) -> list[int] | None:
        """The tokens its row holds (a resumed job's), prefilled and continued from."""
        return list(self.job.output_token_ids) or None

    def sampling_params(self) -> SamplingParams:
        job, options = self.job, self.job.options or {}
        return SamplingParams(
            max_tokens=job.max_tokens,
            min_tokens=options.get("min_tokens", 0),
            temperature=job.temperature,
            top_p=job.top_p,
            top_k=job.top_k,
            seed=job.seed,
            stop=list(job.stop),
            stop_token_ids=list(options.get("stop_token_ids", ())),
            ignore_eos=options.get("ignore_eos", False),
            include_stop_str_in_output=options.get("include_stop_str_in_output", False),
            skip_special_tokens=options.get("skip_special_tokens", True),
            min_p=options.get("min_p", 0.0),
            presence_penalty=options.get("presence_penalty", 0.0),
            frequency_penalty=options.get("frequency_penalty", 0.0),
            repetition_penalty=options.get("repetition_penalty", 1.0),
            logit_bias={int(token): bias for token, bias in options.get("logit_bias", {}).items()},
            logprobs=options.get("logprobs"),
            prompt_logprobs=options.get("prompt_logprobs"),
            json_schema=options.get("json_schema"),
        )

    def apply(self, delta: Delta, news: RequestNews | None) -> Delta | None:
        """The engine's report of a step (EngineRequest.apply), and the job's events it tells of: the engine
        counts preemptions without saying when, so a preemption is placed at the job's last step with tokens
        and its resume at its first step with tokens after (an aborted request reports its count as it leaves,
        with no resume)."""
        before = self.num_preemptions
        new = super().apply(delta, news)
        if self.num_preemptions > before:  # rare: the cost of a step is the line below
            count = self.num_preemptions - before
            self.events.append(event(EventKind.PREEMPTED, _utc(self.ran_at), count=count))
            if delta.token_ids:
                self.events.append(event(EventKind.RESUMED, _utc(time.time())))
        if delta.token_ids:
            self.ran_at = time.time()
        return new

    def unwritten_events(self) -> list[dict]:
        """The events this hold recorded that the row does not hold yet."""
        return self.events[self.kept_events :]

    def resumable(self) -> Position | None:
        """How much of its output a later run may resume from: all of it so far, or None once the engine ended
        it (a stop or its length): its last tokens (an EOS, which a resumed run would go past) belong with its
        result only."""
        at = self.transcript.position  # read first: the reader thread sets finish_reason, then position
        return None if self.transcript.finish_reason in ("stop", "length") else at

    def output(self, *, final: bool = False) -> tuple[jobs.Output, Position]:
        """What to write beyond what the row holds (with nothing new, it only renews the lease), and the
        position the row will then hold. A progress write (not `final`) holds nothing a resumed run could go
        past: a job the engine ended in the meantime only renews its lease until its result is written."""
        transcript = self.transcript
        upto = transcript.position if final else self.resumable() or self.kept
        token_ids = transcript.token_ids[self.kept.tokens : upto.tokens]
        text = transcript.text_since(self.kept.chars, upto.chars)
        output = jobs.Output(
            self.job.id,
            self.lease,
            self.kept.tokens,
            token_ids,
            self.kept_bytes,
            text.encode(),
            self.first_token_at,
            transcript.finish_reason if final else None,
            len(self.prompt_token_ids) if final else None,
            self.logprobs() if final else None,
            self.row_events + self.kept_events,
            self.unwritten_events(),
        )
        return output, upto

    def saved(self, output: jobs.Output, position: Position) -> None:
        """The row now holds `output` (written by save_progress)."""
        self.kept, self.kept_bytes = position, self.kept_bytes + len(output.text_tail)
        self.kept_events += len(output.new_events)

    def logprobs(self) -> dict | None:
        """The job's `logprobs` column, when it asked: {"prompt": [...] or None, "tokens": [...] or None},
        each entry [token_id, logprob, [[id, logprob], ...]]."""
        options = self.job.options or {}
        if options.get("logprobs") is None and options.get("prompt_logprobs") is None:
            return None
        tokens = self.transcript.fields.get("logprobs")
        return {
            "prompt": self.prompt_logprobs if options.get("prompt_logprobs") is not None else None,
            "tokens": tokens[: self.transcript.position.tokens]
            if options.get("logprobs") is not None
            else None,
        }

    def event(self, delta: Delta) -> Delta:
        """A step's new output as a token event: an abort is no end for readers (the job is cancelled, or
        resumes), and the first (from the output's start) carries the prompt's log probabilities when the job
        asked (a streamed echo's first chunk)."""
        if delta.finish_reason == "abort":
            delta = delta._replace(finish_reason=None)
        if delta.start == 0 and delta.token_ids and self.prompt_logprobs is not None:
            delta = delta._replace(fields={**(delta.fields or {}), "prompt_logprobs": self.prompt_logprobs})
        return delta


def _utc(seconds: float) -> datetime:
    return datetime.fromtimestamp(seconds, timezone.utc)
