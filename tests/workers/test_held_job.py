"""workers/held_job.py: what a held job writes to its row, and what a later run may resume from."""

from __future__ import annotations

import uuid
from datetime import datetime, timezone

from contract.deltas import Delta, Position
from jobstore.models import Job
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
