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
    """A report's rows when all are running and listed once, and some are steady: reported whole (no stop
    strings that hold text back, no log probabilities, no text made by the engine: SamplingParams.detokenize
    off). While the next calls have the same rows in the same epoch (none has ended or been preempted since),
    each steady one with exactly one token more than it reported, their columns are: that token, the offsets one
    further, the same text offsets and no text, no finish, no news (its facts, reported, have not changed). The
    others (`others`) are reported as `_report` reports them."""

    seqs: list[Sequence]
    epoch: int
    rows: list[int]  # the steady ones
    others: list[int]
    request_ids: list[str]
    text_starts: list[int]  # the steady ones' (the others': anything, replaced)
    lead: list[int]  # of the steady ones: prompt tokens + 1, their tokens less those reported, a token later

    @staticmethod
    def of(seqs: list[Sequence], epoch: int) -> _SteadyRows | None:
        rows: list[int] = []
        others: list[int] = []
        running = SequenceStatus.RUNNING
        for i, seq in enumerate(seqs):
            p = seq.params
            if seq.status != running:
                return None
            if p.stop or p.logprobs is not None or p.detokenize or seq.text:
                others.append(i)
            else:
                rows.append(i)
        if not rows or len(set(map(id, seqs))) < len(seqs):
            return None
        return _SteadyRows(
            list(seqs),
            epoch,
            rows,
            others,
            [seq.req_id for seq in seqs],
            [seq.num_reported_chars for seq in seqs],
            [seqs[i].num_prompt_tokens + 1 for i in rows],
        )

    def report(self) -> StepDeltas | None:
        """This step's rows, or None (and nothing changed) if a steady one has not exactly one new token."""
        seqs, others = self.seqs, self.others
        n = len(seqs)
        if not others:
            starts: list[int] = []
            tokens: list[list[int]] = []
            add_start, add_tokens = starts.append, tokens.append
            for seq, lead in zip(seqs, self.lead):
                ids, reported = seq.token_ids, seq.num_reported_tokens
                if len(ids) - reported != lead:  # not exactly one new token: the rows done so far are undone
                    for done, start in zip(seqs, starts):
                        done.num_reported_tokens = start
                    return None
                add_start(reported)
                seq.num_reported_tokens = reported + 1
                add_tokens([ids[-1]])
            return StepDeltas(
                list(self.request_ids), starts, tokens, list(self.text_starts), [""] * n, [None] * n, None, []
            )
        rows = self.rows
        if [len(seqs[i].token_ids) - seqs[i].num_reported_tokens for i in rows] != self.lead:
            return None
        starts = [0] * n
        tokens = [[]] * n  # (the others' replaced below)
        for i in rows:
            seq = seqs[i]
            starts[i] = seq.num_reported_tokens
            seq.num_reported_tokens += 1
            tokens[i] = [seq.token_ids[-1]]
        theirs = _report([seqs[i] for i in others])
        text_starts, texts = list(self.text_starts), [""] * n
        reasons: list[str | None] = [None] * n
        for k, i in enumerate(others):
            starts[i], tokens[i] = theirs.token_starts[k], theirs.token_ids[k]
            text_starts[i], texts[i], reasons[i] = (
                theirs.text_starts[k],
                theirs.texts[k],
                theirs.finish_reasons[k],
            )
        logprobs: list[list[TokenLogprob] | None] | None = None
        if theirs.logprobs is not None:
            logprobs = [None] * n
            for k, i in enumerate(others):
                logprobs[i] = theirs.logprobs[k]
        # (news: the others' only, in row order)
        return StepDeltas(
            list(self.request_ids), starts, tokens, text_starts, texts, reasons, logprobs, theirs.news
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
