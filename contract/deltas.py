"""A job's output as it grows, and the one place that knows "the text so far + the new piece".

    engine ──Delta per request per step──▶ worker: Transcript per job ──▶ Postgres (progress, result)
                                                       └──▶ token events (Redis) ──▶ API: Transcript per caller

A `Delta` is what one engine step added to one output: the token ids from index `start` on and the text
from character `text_start` on. The text is *stable* text: while a job runs, the engine holds back the
characters a stop string could still cut (batching's output_kind="delta"), so text is only ever appended.
Offsets are absolute, so whoever holds a prefix of the output from elsewhere (the job's row in Postgres, an
SSE client's Last-Event-ID) takes from a delta exactly what it lacks: `Transcript.add` trims what it holds
already (no duplicate) and refuses a delta that starts beyond it (`Gap`: read the row again).

A position in the output is `(tokens, chars)`; `Position.id` is its text form, the SSE event id.
"""

from __future__ import annotations

import bisect
from typing import NamedTuple


class Delta(NamedTuple):
    """What one step added to one output."""

    start: int  # tokens of the output before this delta
    token_ids: list[int]
    text_start: int  # characters of the (stable) text before this delta
    text: str
    finish_reason: str | None = None  # set in the output's last delta: "stop", "length" or "abort"
    # per-token values aligned with token_ids (e.g. log probabilities), by name; they ride along untouched
    fields: dict[str, list] | None = None

    @property
    def end(self) -> Position:
        # tuple.__new__ (C) rather than Position(...) (the named tuple's __new__ is Python): every delta's end
        # is taken by each of its holders
        return tuple.__new__(Position, (self.start + len(self.token_ids), self.text_start + len(self.text)))


class Position(NamedTuple):
    """How much of an output someone holds: tokens and characters of text."""

    tokens: int = 0
    chars: int = 0

    @property
    def id(self) -> str:
        return f"{self.tokens}.{self.chars}"

    @classmethod
    def parse(cls, text: str | None) -> Position | None:
        """The position of an event id (Last-Event-ID); None when it is not one this server gave out."""
        try:
            tokens, chars = (int(part) for part in (text or "").split("."))
        except ValueError:
            return None
        return cls(tokens, chars) if tokens >= 0 and chars >= 0 else None


class Gap(Exception):
    """A delta starts beyond what the transcript holds: something in between was missed."""


def trim(delta: Delta, held: Position, finished: bool = False) -> Delta | None:
    """The part of `delta` beyond `held` (None when it adds nothing); Gap when it starts beyond `held`.
    `finished`: the holder has the end already (a repeated finish adds nothing)."""
    if delta.start > held.tokens or delta.text_start > held.chars:
        raise Gap(f"a delta from {Position(delta.start, delta.text_start)} reached a holder at {held}")
    skip, skip_chars = held.tokens - delta.start, held.chars - delta.text_start
    reason = None if finished else delta.finish_reason
    if not (skip or skip_chars) and (delta.token_ids or delta.text or reason is not None):
        return delta if reason == delta.finish_reason else delta._replace(finish_reason=reason)
    tokens, text = delta.token_ids[skip:], delta.text[skip_chars:]
    if not tokens and not text and reason is None:
        return None
    fields = {name: values[skip:] for name, values in delta.fields.items()} if delta.fields else None
    return Delta(held.tokens, tokens, held.chars, text, reason, fields)


class Transcript:
    """An output as far as it is known: its token ids and text, appended to by deltas.

    One thread adds; others may read: `position` is replaced in one assignment after the lists grew, so a
    reader slicing up to `position` sees one consistent prefix."""

    __slots__ = ("token_ids", "_parts", "_ends", "position", "finish_reason", "fields")

    def __init__(self, token_ids=(), text: str = "", finish_reason: str | None = None):
        self.token_ids: list[int] = list(token_ids)
        self._parts: list[str] = [text] if text else []
        self._ends: list[int] = [len(text)] if text else []  # characters up to the end of each part
        self.finish_reason = finish_reason
        self.fields: dict[str, list] = {}
        self.position = Position(len(self.token_ids), len(text))

    @property
    def text(self) -> str:
        return self.text_since(0)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def add(self, delta: Delta) -> Delta | None:
        """Take from `delta` what this transcript lacks; returns that part (None when it adds nothing).
        Raises Gap when the delta starts beyond what is held."""
        held = self.position
        if (  # nearly every delta: the next step's, where the transcript ends: all of it is new (no trim)
            delta.start == held.tokens
            and delta.text_start == held.chars
            and self.finish_reason is None
            and not delta.fields
            and (delta.token_ids or delta.text)
        ):
            new = delta
        else:
            new = trim(delta, held, self.finish_reason is not None)
            # a resumed job's saved tokens come without fields: each fills up to where it is known
            if delta.fields:
                for name, values in delta.fields.items():
                    kept = self.fields.setdefault(name, [])
                    if delta.start <= len(kept) < delta.start + len(values):
                        kept.extend(values[len(kept) - delta.start :])
            if new is None:
                return None
        self.token_ids.extend(new.token_ids)
        if new.text:
            self._parts.append(new.text)
            self._ends.append(held.chars + len(new.text))
        if new.finish_reason is not None:
            self.finish_reason = new.finish_reason
        self.position = new.end
        return new

    def text_since(self, chars: int, upto: int | None = None) -> str:
        """The text from character `chars` to `upto` (default: all held)."""
        upto = self.position.chars if upto is None else upto
        if chars >= upto:
            return ""
        first = bisect.bisect_right(self._ends, chars)
        last = bisect.bisect_left(self._ends, upto)
        start = self._ends[first - 1] if first else 0
        joined = "".join(self._parts[first : last + 1])
        return joined[chars - start : upto - start]

    def since(self, position: Position) -> Delta:
        """What was added after `position`, as one delta (up to the position held now)."""
        now = self.position
        return Delta(
            position.tokens,
            self.token_ids[position.tokens : now.tokens],
            position.chars,
            self.text_since(position.chars, now.chars),
            self.finish_reason,
        )
