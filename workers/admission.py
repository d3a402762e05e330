"""Which jobs a full worker takes: the rule of queue-level preemption. Pure; no I/O, no clock.

A worker holds up to `capacity` jobs (its engine's `max_num_seqs` plus a small reserve). When it is
full, a job offered to it is taken only if it is **strictly more urgent** than a held job that may still
be handed back; the least urgent of those (the latest created among equals, which has done the least
work) goes back to the queue to make room. Equal priorities never preempt each other (no thrashing).

A job handed back `max_handbacks` times is never handed back again: it keeps its place, and it does not
count against a more urgent newcomer either (the worker takes the newcomer beside it). So a job pays for
at most `max_handbacks` preemptions, and an urgent job is never left in Redis behind it. The overshoot
is bounded: such jobs are at most the `capacity` jobs held when they reached the bound.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from typing import Protocol


class Held(Protocol):
    """What the rule needs to know of a held job (workers/held_job.py's HeldJob)."""

    @property
    def priority(self) -> int: ...  # 0 most urgent
    @property
    def created_at(self) -> datetime: ...
    @property
    def handbacks(self) -> int: ...  # times it was handed back for more urgent work so far


@dataclass(frozen=True, slots=True)
class Admission:
    take: bool
    victim: Held | None = None  # the held job to hand back to make room


def admit(held: Iterable[Held], priority: int, *, capacity: int, max_handbacks: int) -> Admission:
    """Whether a worker holding `held` takes a job of `priority`, and which held job it hands back for it."""
    counted = [h for h in held if h.handbacks < max_handbacks or h.priority <= priority]
    if len(counted) < capacity:
        return Admission(True)
    less_urgent = [h for h in counted if h.priority > priority]  # each below its bound
    if not less_urgent:
        return Admission(False)
    return Admission(True, max(less_urgent, key=lambda h: (h.priority, h.created_at)))


def admitted_below(held: Iterable[Held], *, capacity: int, max_handbacks: int, levels: int = 10) -> int:
    """The priorities `admit` takes, in one pass: those below the returned one (of `levels` priorities). A job is
    taken when fewer than `capacity` held jobs count against it (every movable one, and those at their bound
    that are at least as urgent as it), or when a movable held job is less urgent than it (to go back)."""
    movable: list[int] = []
    bound: list[int] = []
    for h in held:
        (movable if h.handbacks < max_handbacks else bound).append(h.priority)
    below = max(movable, default=0)
    room = capacity - len(movable)  # for jobs at their bound, counted against the more urgent newcomers
    if room > 0:
        bound.sort()
        below = max(below, bound[room - 1] if len(bound) >= room else levels)
    return below
