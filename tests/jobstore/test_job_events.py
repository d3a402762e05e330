"""A job's events (jobs.events, jobstore/job_events.py) as the statements that write its row append them:
re-claims, the worker's preemptions and resumes (with its progress, result, failure or hand-back writes),
hand-backs and lease expiries; each in order, with its time, and a write sent twice leaves the row the same."""

from __future__ import annotations

import uuid
from datetime import datetime, timedelta, timezone

import pytest

from jobstore import jobs
from jobstore.job_events import EventKind, event, job_events
from jobstore.keys import create_key
from tests.conftest import tenant_of
from tests.jobstore.test_jobs import LEASE, create, progress


@pytest.fixture()
def tenant_id(sessions):
    with sessions.begin() as s:
        return tenant_of(s, create_key(s, f"t-{uuid.uuid4().hex[:8]}")).id


def stored(sessions, job_id):
    with sessions.begin() as s:
        return jobs.get_job(s, job_id)


def kinds(job) -> list[str]:
    return [e.kind.value for e in job_events(job.events)]


def with_events(output: jobs.Output, kept: int, new: list[dict]) -> jobs.Output:
    return jobs.Output(
        output.job_id,
        output.worker_id,
        output.kept_tokens,
        output.new_tokens,
        output.kept_text_bytes,
        output.text_tail,
        kept_events=kept,
        new_events=new,
    )


def test_a_job_that_runs_straight_through_has_none(sessions, tenant_id):
    job_id = create(sessions, tenant_id)
    with sessions.begin() as s:
        assert jobs.claim_job(s, job_id, "w1", LEASE).events is None  # the first claim is started_at
        assert jobs.save_progress(s, [progress(job_id, "w1", [1, 2], "ab")], LEASE)
        assert jobs.finish_job(
            s, job_id, "w1", token_ids=[1, 2], text="ab", finish_reason="length", prompt_tokens=3
        )
    assert stored(sessions, job_id).events is None


def test_preemptions_hand_backs_and_re_claims_in_order_each_with_its_time(sessions, tenant_id):
    job_id = create(sessions, tenant_id)
    t0 = datetime.now(timezone.utc)
    preempted = event(EventKind.PREEMPTED, t0, count=1)
    resumed = event(EventKind.RESUMED, t0 + timedelta(milliseconds=5))
    with sessions.begin() as s:
        jobs.claim_job(s, job_id, "w1#a", LEASE)
    with sessions.begin() as s:  # the worker's events ride on a progress write
        written = with_events(progress(job_id, "w1#a", [1, 2], "ab"), 0, [preempted, resumed])
        assert jobs.save_progress(s, [written], LEASE) == {(job_id, "w1#a")}
    with sessions.begin() as s:  # the same write again (its reply was lost): the row is the same
        assert jobs.save_progress(s, [written], LEASE) == {(job_id, "w1#a")}
    assert kinds(stored(sessions, job_id)) == ["preempted", "resumed"]
    with sessions.begin() as s:  # then two more, sent with the row's two kept; and a retry of that one
        later = [event(EventKind.PREEMPTED, t0 + timedelta(seconds=1), count=2)]
        for _ in range(2):
            assert jobs.save_progress(s, [with_events(progress(job_id, "w1#a", [], ""), 2, later)], LEASE)
    assert kinds(stored(sessions, job_id)) == ["preempted", "resumed", "preempted"]
    with sessions.begin() as s:  # handed back with an event not yet written
        unwritten = [event(EventKind.RESUMED, t0 + timedelta(seconds=2))]
        assert jobs.release_job(
            s,
            job_id,
            "w1#a",
            token_ids=[1, 2],
            text="ab",
            preempted=True,
            reason="preempted",
            events=unwritten,
        )
    with sessions.begin() as s:
        again = jobs.claim_job(s, job_id, "w2#b", LEASE)
    with sessions.begin() as s:
        jobs.claim_job(s, job_id, "w2#c", lease_seconds=-1)  # a stale message: not queued, nothing written
    job = stored(sessions, job_id)
    found = job_events(job.events)
    assert [e.kind.value for e in found] == [
        "preempted",
        "resumed",
        "preempted",
        "resumed",
        "handed_back",
        "claimed",
    ]
    assert found[0].fields == {"count": 1} and found[2].fields == {"count": 2}
    assert found[4].fields == {"reason": "preempted", "tokens": 2, "worker": "w1#a"}
    assert found[5].fields == {"attempt": 2, "worker": "w2#b"}
    assert job_events(again.events) == found  # the claim returns the row with its event
    assert [e.at for e in found[:4]] == sorted(e.at for e in found[:4])
    assert job.started_at <= found[4].at <= found[5].at  # the database's clock
    assert (job.handbacks, job.attempts) == (1, 2)


def test_a_lease_that_expires_and_a_hand_back_at_shutdown(sessions, tenant_id):
    job_id = create(sessions, tenant_id)
    with sessions.begin() as s:
        jobs.claim_job(s, job_id, "dead-worker", lease_seconds=-1)
    with sessions.begin() as s:
        assert (job_id, 5) in jobs.requeue_expired(s)
    with sessions.begin() as s:
        jobs.claim_job(s, job_id, "w2", LEASE)
        assert jobs.release_job(s, job_id, "w2", token_ids=[], text="", reason="handed_back")
    found = job_events(stored(sessions, job_id).events)
    assert [(e.kind, e.fields.get("worker")) for e in found] == [
        (EventKind.LEASE_EXPIRED, "dead-worker"),
        (EventKind.CLAIMED, "w2"),
        (EventKind.HANDED_BACK, "w2"),
    ]
    assert found[2].fields["reason"] == "handed_back" and stored(sessions, job_id).handbacks == 0


def test_a_result_or_a_failure_brings_the_events_not_yet_written(sessions, tenant_id):
    ok, bad = create(sessions, tenant_id), create(sessions, tenant_id)
    resumed = event(EventKind.RESUMED, datetime.now(timezone.utc))
    with sessions.begin() as s:
        jobs.claim_jobs(s, [(ok, "w1"), (bad, "w1")], LEASE)
        final = jobs.Output(ok, "w1", 0, [3], 0, b"c", None, "stop", 2, None, 0, [resumed])
        assert jobs.finish_jobs(s, [final]) == {(ok, "w1")}
        assert jobs.fail_job(s, bad, "w1", code="engine_error", message="boom", events=[resumed])
    for job_id in (ok, bad):
        assert kinds(stored(sessions, job_id)) == ["resumed"]


def test_an_unknown_kind_is_left_out_when_read():
    at = datetime.now(timezone.utc).isoformat()
    assert [e.kind for e in job_events([{"kind": "later", "at": at}, {"kind": "resumed", "at": at}])] == [
        EventKind.RESUMED
    ]
    assert job_events(None) == []
