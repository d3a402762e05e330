"""workers/held_job.py: what a held job writes to its row, and what a later run may resume from."""

from __future__ import annotations

import time
import uuid
from datetime import datetime, timezone

import pytest

from contract.deltas import Delta, Position
from jobstore.job_events import EventKind, job_events
from jobstore.models import Job
from workers.engine_protocol import RequestNews
from workers.held_job import HeldJob


def held(output_token_ids=(), output_text="") -> HeldJob:
    job = Job(
        id=uuid.uuid4(),
        priority=5,
        attempts=1,
        handbacks=0,
        created_at=datetime.now(timezone.utc),
        prompt="Once",
        max_tokens=16,
        output_token_ids=list(output_token_ids),
        output_text=output_text,
        options={},
    )
    return HeldJob(job, lease="worker#1")


def test_a_resumed_job_writes_only_what_its_row_lacks():
    h = held([7, 8], "ab")
    assert h.request_id.endswith("/1") and h.resume_token_ids == [7, 8] and h.kept == Position(2, 2)
    h.transcript.add(Delta(2, [9], 2, "c"))
    output, upto = h.output()
    assert (output.new_tokens, output.text_tail, upto) == ([9], b"c", Position(3, 3))
    h.saved(output, upto)
    assert h.output()[0].new_tokens == [] and h.kept_bytes == 3


def test_what_the_engine_ended_is_written_with_the_result_only():
    """The step that ends a job (its EOS) may reach the job before its result is written: a progress write or
    a hand-back then must not save that end, or a run resumed from it would go on past it."""
    h = held()
    h.transcript.add(Delta(0, [4, 5], 0, "xy"))
    assert h.resumable() == Position(2, 2)
    h.transcript.add(Delta(2, [2], 2, "", finish_reason="stop"))  # 2: the end token, no text
    assert h.resumable() is None
    progress, upto = h.output()
    assert progress.new_tokens == [] and progress.finish_reason is None and upto == Position()
    h.saved(progress, upto)
    result, _ = h.output(final=True)
    assert (result.new_tokens, result.finish_reason) == ([4, 5, 2], "stop")


def test_an_abort_ends_nothing_a_resumed_run_would_go_past():
    h = held()
    h.transcript.add(Delta(0, [4, 5], 0, "xy", finish_reason="abort"))  # handed back: the engine aborted it
    assert h.resumable() == Position(2, 2)


def test_the_engines_preemptions_become_events_written_once():
    """The engine counts preemptions without saying when: a job's count going up in a step's report is a
    preemption at its last step with tokens and, when that report brings tokens, its resume then. The events
    ride on the next write of the row, once."""
    h = held()
    h.apply(Delta(0, [4], 0, "a"), RequestNews(0, 100.0, [1, 2, 3]))
    last_step = h.ran_at
    time.sleep(0.01)
    assert h.apply(Delta(1, [5], 1, "b"), RequestNews(1, 100.0, None)) is not None
    preempted, resumed = job_events(h.unwritten_events())
    assert (preempted.kind, resumed.kind) == (EventKind.PREEMPTED, EventKind.RESUMED)
    assert preempted.fields == {"count": 1} and preempted.at.timestamp() == pytest.approx(last_step)
    assert resumed.at > preempted.at
    output, upto = h.output()
    assert (output.kept_events, list(output.new_events)) == (0, h.events)
    h.saved(output, upto)
    assert h.output()[0].new_events == [] and h.output()[0].kept_events == 2
    # preempted again, then aborted (handed back) before it ran: its count comes with the abort, no resume
    h.apply(Delta(2, [], 2, "", finish_reason="abort"), RequestNews(2, 100.0, None))
    assert [e["kind"] for e in h.unwritten_events()] == ["preempted"]


def test_a_re_claimed_job_keeps_the_events_its_row_holds():
    h = held()
    h.job.events = [
        {"kind": "handed_back", "at": "2026-11-27T03:00:00+00:00"},
        {"kind": "claimed", "at": "x"},
    ]
    h = HeldJob(h.job, "worker#2")
    h.apply(Delta(0, [4], 0, "a"), RequestNews(1, 100.0, [1]))
    assert h.output()[0].kept_events == 2  # the row's two stay; the new one follows them
