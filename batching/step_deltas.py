"""A step's changes by columns: what each request that changed adds to what it reported before.

`Engine.step()` returns a `RequestOutput` per request that changed; a service that streams every step's
deltas to another process (workers/engine_process.py) wants them by columns instead, a list per field, and
no object per request: `Engine.step_deltas()` returns a `StepDeltas`, built in one loop over the step's
changed sequences (`report`). The engine's delta outputs (SamplingParams(output_kind="delta")) are made from
the same columns, so both say the same.

Each request's offsets live on its Sequence (what it reported so far: tokens, characters, and the facts of
`StepNews`), so a consumer needs no per-request state of its own to place a delta.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from batching.logprobs import TokenLogprob
from batching.sequence import FINISH_REASONS, Sequence, SequenceStatus


class StepNews(NamedTuple):
    """What else changed for one request: in its first report, and when a fact here changed since."""

    request_id: str
    num_preemptions: int
    first_token_time: float | None
    prompt_token_ids: list[int] | None  # in its first report only
    # in its first report, when it asked: the log probabilities of its prompt's tokens but the first
    prompt_logprobs: list[TokenLogprob] | None


@dataclass(slots=True)
class StepDeltas:
    """One step's changes, a list per field, a row per request that changed (new tokens, finished, aborted).

    Row i: request `request_ids[i]` adds `token_ids[i]` at output token `token_starts[i]` (its output tokens
    reported before) and `texts[i]` at character `text_starts[i]`; `finish_reasons[i]` is "stop", "length",
    "abort" or None while it runs. Until a request ends, its text's last `holdback` characters wait (a stop
    string may cut them), as delta outputs do."""

    request_ids: list[str] = field(default_factory=list)
    token_starts: list[int] = field(default_factory=list)
    token_ids: list[list[int]] = field(default_factory=list)
    text_starts: list[int] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    finish_reasons: list[str | None] = field(default_factory=list)
    # the new tokens' log probabilities, per row (None for a row that did not ask); None: no row asked
    logprobs: list[list[TokenLogprob] | None] | None = None
    news: list[StepNews] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.request_ids)


def report(seqs: list[Sequence]) -> StepDeltas:
    """The rows of `seqs` (the step's changed sequences, in order); each one's reported offsets advance.

    One loop, every step's changed sequences: the engine's per-request cost of reporting, kept flat."""
    out = StepDeltas()
    ids, starts, tokens, text_starts = out.request_ids, out.token_starts, out.token_ids, out.text_starts
    texts, reasons, news = out.texts, out.finish_reasons, out.news
    add_id, add_start, add_tokens = ids.append, starts.append, tokens.append
    add_text_start, add_text, add_reason = text_starts.append, texts.append, reasons.append
    ended, aborted = SequenceStatus.FINISHED_STOPPED, SequenceStatus.FINISHED_ABORTED
    logprob_rows: list[int] = []
    for seq in seqs:
        p, status, text = seq.params, seq.status, seq.text
        reported_tokens, reported_chars = seq.num_reported_tokens, seq.num_reported_chars
        new = seq.token_ids[seq.num_prompt_tokens + reported_tokens :]
        seq.num_reported_tokens = reported_tokens + len(new)
        end = len(text)  # without stop strings the text only grows: all of it is reported
        # with stop strings: while it runs (or once aborted) one may still cut its last `holdback` characters
        if p.stop:
            held = p.holdback if status < ended or status == aborted else 0
            end = max(reported_chars, end - held)
        seq.num_reported_chars = end
        add_id(seq.req_id)
        add_start(reported_tokens)
        add_tokens(new)
        add_text_start(reported_chars)
        add_text(text[reported_chars:end])
        add_reason(None if status < ended else FINISH_REASONS[status])
        if p.logprobs is not None:
            logprob_rows.append(len(ids) - 1)
        # (num_preemptions, first_token_time) as last reported: news when either changed (no tuple a row)
        facts = seq.reported_facts
        if facts is None or facts[0] != seq.num_preemptions or facts[1] != seq.first_token_time:
            news.append(
                StepNews(
                    seq.req_id,
                    seq.num_preemptions,
                    seq.first_token_time,
                    seq.token_ids[: seq.num_prompt_tokens] if facts is None else None,
                    list(seq.prompt_logprobs) if facts is None and p.prompt_logprobs is not None else None,
                )
            )
            seq.reported_facts = (seq.num_preemptions, seq.first_token_time)
    if logprob_rows:
        rows: list[list[TokenLogprob] | None] = [None] * len(ids)
        for i in logprob_rows:
            rows[i] = seqs[i].logprobs[starts[i] :]
        out.logprobs = rows
    return out
