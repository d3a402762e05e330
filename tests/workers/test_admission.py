"""The admission rule of queue-level preemption (workers/admission.py): pure, so checked exhaustively."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta, timezone

from hypothesis import given
from hypothesis import strategies as st

from workers.admission import admit, admitted_below

T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)
MAX = 3


@dataclass(frozen=True)
class Held:
    """A held job as the rule sees it (workers.admission.Held), named by `key`."""

    key: str
    priority: int
    created_at: datetime
    handbacks: int


def held(key, priority, age=0, handbacks=0) -> Held:
    return Held(key, priority, T0 + timedelta(seconds=age), handbacks)


def test_room_takes_anything():
    assert admit([held("a", 0)], 9, capacity=2, max_handbacks=MAX).take


def test_full_takes_only_strictly_more_urgent_and_hands_back_the_least_urgent_latest():
    full = [held("a", 9, age=1), held("b", 9, age=2), held("c", 5, age=3)]
    assert not admit(full, 9, capacity=3, max_handbacks=MAX).take  # equal: never preempts
    decision = admit(full, 5, capacity=3, max_handbacks=MAX)
    assert decision.take and decision.victim.key == "b"  # least urgent, latest created
    assert admit(full, 0, capacity=3, max_handbacks=MAX).victim.key == "b"


def test_a_job_at_its_bound_is_not_handed_back_and_does_not_block_urgent_work():
    full = [held("a", 9, handbacks=MAX), held("b", 5, handbacks=MAX - 1)]
    decision = admit(full, 7, capacity=2, max_handbacks=MAX)
    assert decision.take and decision.victim is None  # "a" rides along, uncounted
    decision = admit(full, 0, capacity=2, max_handbacks=MAX)
    assert decision.take and decision.victim is None
    assert not admit(full, 9, capacity=2, max_handbacks=MAX).take  # not more urgent than "a"


jobs = st.lists(st.tuples(st.integers(0, 9), st.integers(0, 5), st.integers(0, MAX)), max_size=12)


@given(jobs, st.integers(0, 9), st.integers(1, 8))
def test_the_rule_keeps_its_promises(rows, priority, capacity):
    slots = [held(i, p, age, hb) for i, (p, age, hb) in enumerate(rows)]
    decision = admit(slots, priority, capacity=capacity, max_handbacks=MAX)
    counted = [h for h in slots if h.handbacks < MAX or h.priority <= priority]
    if decision.victim is not None:
        victim = decision.victim
        assert victim in slots
        assert decision.take and len(counted) >= capacity
        assert victim.priority > priority and victim.handbacks < MAX
        # no other candidate is less urgent, or as urgent and newer
        assert all(
            (h.priority, h.created_at) <= (victim.priority, victim.created_at)
            for h in counted
            if h.priority > priority
        )
    elif decision.take:
        assert len(counted) < capacity
    else:  # declined: the worker holds `capacity` jobs it counts, none of them both less urgent and movable
        assert len(counted) >= capacity
        assert all(h.priority <= priority for h in counted)


@given(jobs, st.integers(1, 8))
def test_the_priorities_a_worker_looks_for_are_those_the_rule_takes(rows, capacity):
    """A full worker's intake looks in the lists below admitted_below: exactly the priorities admit() takes."""
    slots = [held(i, p, age, hb) for i, (p, age, hb) in enumerate(rows)]
    below = admitted_below(slots, capacity=capacity, max_handbacks=MAX)
    assert [admit(slots, p, capacity=capacity, max_handbacks=MAX).take for p in range(10)] == [
        p < below for p in range(10)
    ]
