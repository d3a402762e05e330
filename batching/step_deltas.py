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


class ReportMemo:
    """What `report` keeps from one call to the next (the engine holds one): the last call's rows, when each was
    a steady row (`_SteadyRows`)."""

    __slots__ = ("rows",)

    def __init__(self) -> None:
        self.rows: _SteadyRows | None = None


def report(seqs: list[Sequence], memo: ReportMemo | None = None, epoch: int | None = None) -> StepDeltas:
    """The rows of `seqs` (the step's changed sequences, in order); each one's reported offsets advance.

    One loop, every step's changed sequences: the engine's per-request cost of reporting, kept flat. With a
    `memo` and an `epoch` (a number that changes whenever a sequence's status or num_preemptions may have: the
    scheduler's queues' version), the steady step (the same sequences as the last call, each steady:
    `_SteadyRows`, and the same epoch) is built by columns instead, in one short pass over the rows."""
    if memo is None or epoch is None:
        return _report(seqs)
    steady, memo.rows = memo.rows, None
    if steady is not None and steady.epoch == epoch and steady.seqs == seqs:  # (by identity, one by one)
        out = steady.report()
        if out is not None:
            memo.rows = steady
            return out
    out = _report(seqs)
    memo.rows = _SteadyRows.of(seqs, epoch)
    return out


@dataclass(slots=True)
class _SteadyRows:
    """A report's rows when each is steady: running, reported whole (no stop strings that hold text back, no
    log probabilities, no text made by the engine: SamplingParams.detokenize off) and listed once. While the
    next calls have the same rows in the same epoch (none has ended or been preempted since), each with exactly
    one token more than it reported, their columns are: that token, the offsets one further, the same text
    offsets and no text, no finish, no news (its facts, reported, have not changed)."""

    seqs: list[Sequence]
    epoch: int
    request_ids: list[str]
    text_starts: list[int]
    lead: list[int]  # each one's prompt tokens + 1: its tokens less those it reported, one token later

    @staticmethod
    def of(seqs: list[Sequence], epoch: int) -> _SteadyRows | None:
        if not seqs:
            return None
        running = SequenceStatus.RUNNING
        for seq in seqs:
            p = seq.params
            if seq.status != running or p.stop or p.logprobs is not None or p.detokenize or seq.text:
                return None
        if len(set(map(id, seqs))) < len(seqs):
            return None
        return _SteadyRows(
            list(seqs),
            epoch,
            [seq.req_id for seq in seqs],
            [seq.num_reported_chars for seq in seqs],
            [seq.num_prompt_tokens + 1 for seq in seqs],
        )

    def report(self) -> StepDeltas | None:
        """This step's rows, or None (and nothing changed) if one of them has not exactly one new token."""
        seqs = self.seqs
        if [len(seq.token_ids) - seq.num_reported_tokens for seq in seqs] != self.lead:
            return None
        starts: list[int] = []
        tokens: list[list[int]] = []
        add_start, add_tokens = starts.append, tokens.append
        for seq in seqs:
            n = seq.num_reported_tokens
            add_start(n)
            seq.num_reported_tokens = n + 1
            add_tokens([seq.token_ids[-1]])
        n = len(seqs)
        return StepDeltas(
            list(self.request_ids), starts, tokens, list(self.text_starts), [""] * n, [None] * n, None, []
        )


def _report(seqs: list[Sequence]) -> StepDeltas:
    """`report`, one row at a time."""
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
