"""Job state transitions against the real schema."""

from __future__ import annotations

import uuid

import pytest
from sqlalchemy import select
from sqlalchemy import text as sql

from jobstore import jobs
from jobstore.keys import create_key, hash_key
from jobstore.models import ApiKey, JobStatus, Tenant
from tests.conftest import job_request, tenant_of

REQUEST = job_request(metadata={"run": 1})
LEASE = 30.0


@pytest.fixture()
def tenant_id(sessions):
    with sessions.begin() as s:
        key = create_key(s, f"t-{uuid.uuid4().hex[:8]}")
        return tenant_of(s, key).id


def progress(
    job_id, worker: str, tokens: list[int], text: str, kept: int = 0, kept_text: str = ""
) -> jobs.Output:
    """An Output appending `tokens` / `text` after the first `kept` tokens and `kept_text`."""
    return jobs.Output(job_id, worker, kept, tokens, len(kept_text.encode()), text.encode())


def create(sessions, tenant_id, **changes):
    with sessions.begin() as s:
        job, created = jobs.create_job(s, tenant_id, {**REQUEST, **changes}, prompt_tokens=10)
        assert created
        return job.id


def test_claim_jobs_claims_the_queued_ones_each_under_its_own_lease_in_one_statement(sessions, tenant_id):
    first, second, taken = (create(sessions, tenant_id, priority=p) for p in (1, 2, 3))
    with sessions.begin() as s:
        assert jobs.claim_job(s, taken, "w0", LEASE) is not None
        claimed = jobs.claim_jobs(s, [(first, "w1#a"), (taken, "w1#b"), (second, "w1#c")], LEASE)
        assert {(j.id, j.worker_id, j.status, j.attempts) for j in claimed} == {
            (first, "w1#a", JobStatus.RUNNING, 1),
            (second, "w1#c", JobStatus.RUNNING, 1),
        }  # the job another lease holds is left alone
        assert all(j.lease_expires_at > j.started_at and j.metadata_ == {"run": 1} for j in claimed)
        for j in claimed:  # every column in its own attribute, whatever the table's physical column order
            stored = jobs.get_job(s, j.id)
            assert {a: getattr(j, a) for a in jobs._ATTRIBUTE.values()} == {
                a: getattr(stored, a) for a in jobs._ATTRIBUTE.values()
            }
        assert jobs.claim_jobs(s, [(first, "w2")], LEASE) == []
        assert jobs.get_job(s, first).worker_id == "w1#a"


def test_create_claim_progress_finish(sessions, tenant_id):
    job_id = create(sessions, tenant_id)
    with sessions.begin() as s:
        job = jobs.claim_job(s, job_id, "w1", LEASE)
        assert job.status == JobStatus.RUNNING and job.worker_id == "w1" and job.attempts == 1
        assert job.started_at is not None and job.lease_expires_at > job.started_at
        assert jobs.claim_job(s, job_id, "w2", LEASE) is None  # a second message for the job is dropped
    with sessions.begin() as s:
        assert not jobs.save_progress(s, [progress(job_id, "w2", [9], "x")], LEASE)  # not w2's lease
        assert jobs.save_progress(s, [progress(job_id, "w1", [5, 6], "ab")], LEASE) == {(job_id, "w1")}
        assert jobs.save_progress(s, [progress(job_id, "w1", [], "", 2, "ab")], LEASE) == {
            (job_id, "w1")
        }  # lease only
    with sessions.begin() as s:
        assert jobs.get_job(s, job_id).output_token_ids == [5, 6]
        assert jobs.finish_job(
            s, job_id, "w1", token_ids=[5, 6, 7], text="abc", finish_reason="length", prompt_tokens=3
        )
    with sessions.begin() as s:
        job = jobs.get_job(s, job_id)
        assert (job.status, job.output_text, job.finish_reason, job.prompt_tokens) == (
            JobStatus.SUCCEEDED,
            "abc",
            "length",
            3,
        )
        assert job.finished_at is not None and job.lease_expires_at is None
        assert not jobs.save_progress(s, [progress(job_id, "w1", [1], "z")], LEASE)  # finished is final


def test_a_stale_attempt_of_the_same_worker_is_told_apart_by_its_lease(sessions, tenant_id):
    # the job's lease lapsed under attempt "w1#a" and the same worker claimed it again as "w1#b": in one
    # write of both, only the current attempt's output lands and is reported as still leased
    job_id = create(sessions, tenant_id)
    with sessions.begin() as s:
        jobs.claim_job(s, job_id, "w1#a", LEASE)
        s.execute(sql("UPDATE jobs SET status = 'queued', worker_id = NULL WHERE id = :id"), {"id": job_id})
        jobs.claim_job(s, job_id, "w1#b", LEASE)
    with sessions.begin() as s:
        both = [progress(job_id, "w1#a", [1, 2, 3], "123"), progress(job_id, "w1#b", [7], "7")]
        assert jobs.save_progress(s, both, LEASE) == {(job_id, "w1#b")}
        assert jobs.finish_jobs(s, [progress(job_id, "w1#a", [4], "4")]) == set()
    with sessions.begin() as s:
        assert jobs.get_job(s, job_id).output_token_ids == [7]


def test_a_finish_retried_after_its_commit_landed_is_still_the_workers_and_changes_nothing(
    sessions, tenant_id
):
    # the database went away mid-commit: the first finish was stored but its answer lost, and the worker writes
    # it again. That claim's result is its own success (not "no longer this worker's"); the row stays as the
    # first write left it. A job another claim finished, or one cancelled, is still not this claim's.
    mine, taken, cancelled = (create(sessions, tenant_id) for _ in range(3))
    with sessions.begin() as s:
        jobs.claim_jobs(s, [(mine, "w1#a"), (taken, "w1#b"), (cancelled, "w1#c")], LEASE)
        s.execute(sql("UPDATE jobs SET status = 'queued', worker_id = NULL WHERE id = :id"), {"id": taken})
        jobs.claim_job(s, taken, "w2#a", LEASE)
        assert jobs.finish_jobs(s, [progress(taken, "w2#a", [4], "4")]) == {(taken, "w2#a")}
        jobs.cancel_job(s, cancelled, tenant_id)
    write = [
        progress(mine, "w1#a", [1, 2], "12"),
        progress(taken, "w1#b", [5], "5"),
        progress(cancelled, "w1#c", [6], "6"),
    ]
    with sessions.begin() as s:
        assert jobs.finish_jobs(s, write) == {(mine, "w1#a")}
        first = jobs.get_job(s, mine)
    with sessions.begin() as s:
        assert jobs.finish_jobs(s, write) == {(mine, "w1#a")}  # the retry
        again = jobs.get_job(s, mine)
    assert (again.status, again.output_token_ids, again.output_text) == (JobStatus.SUCCEEDED, [1, 2], "12")
    assert again.finished_at == first.finished_at and again.updated_at == first.updated_at
    with sessions.begin() as s:
        assert jobs.get_job(s, taken).output_token_ids == [4]


def test_progress_of_many_jobs_appends_in_one_idempotent_statement(sessions, tenant_id):
    ids = [create(sessions, tenant_id) for _ in range(3)]
    with sessions.begin() as s:
        for job_id in ids:
            jobs.claim_job(s, job_id, "w1", LEASE)
        jobs.cancel_job(s, ids[2], tenant_id)  # taken away from the worker
    first = [
        progress(ids[0], "w1", [1, 2], "12"),
        progress(ids[1], "w1", [], ""),
        progress(ids[2], "w1", [7], "7"),
    ]
    then = [progress(ids[0], "w1", [3], "3é", 2, "12"), progress(ids[1], "w1", [8, 9], "89")]
    with sessions.begin() as s:
        assert jobs.save_progress(s, first, LEASE) == {(i, "w1") for i in ids[:2]}
    for _ in range(2):  # a retry after a lost reply writes the same rows again, duplicating nothing
        with sessions.begin() as s:
            assert jobs.save_progress(s, then, LEASE) == {(i, "w1") for i in ids[:2]}
    with sessions.begin() as s:
        rows = [jobs.get_job(s, job_id) for job_id in ids]
        assert [(j.output_token_ids, j.output_text) for j in rows] == [
            ([1, 2, 3], "123é"),
            ([8, 9], "89"),
            ([], ""),
        ]
    final = [
        jobs.Output(ids[0], "w1", 3, [4], len("123é".encode()), b"4", None, "length", 10),
        jobs.Output(ids[1], "w1", 1, [5], 1, b"5", None, "stop", 11),
    ]  # a shorter output replaces the tail
    with sessions.begin() as s:
        assert jobs.finish_jobs(s, final) == {(i, "w1") for i in ids[:2]}
        # finished is final: written again (a retry) it is still this claim's, and the row stays as it was
        assert jobs.finish_jobs(s, final) == {(i, "w1") for i in ids[:2]}
    with sessions.begin() as s:
        rows = [jobs.get_job(s, job_id) for job_id in ids[:2]]
        assert [
            (j.status, j.output_token_ids, j.output_text, j.finish_reason, j.prompt_tokens) for j in rows
        ] == [
            (JobStatus.SUCCEEDED, [1, 2, 3, 4], "123é4", "length", 10),
            (JobStatus.SUCCEEDED, [8, 5], "85", "stop", 11),
        ]


def test_release_keeps_tokens_and_counts_preemptions(sessions, tenant_id):
    job_id = create(sessions, tenant_id)
    with sessions.begin() as s:
        jobs.claim_job(s, job_id, "w1", LEASE)
        assert not jobs.release_job(s, job_id, "w2", token_ids=[1], text="a", preempted=True)  # not w2's
        assert jobs.release_job(s, job_id, "w1", token_ids=[1, 2], text="ab", preempted=True)
    with sessions.begin() as s:
        job = jobs.get_job(s, job_id)
        assert (job.status, job.worker_id, job.output_token_ids, job.handbacks) == (
            JobStatus.QUEUED,
            None,
            [1, 2],
            1,
        )
        jobs.claim_job(s, job_id, "w2", LEASE)
        assert jobs.release_job(s, job_id, "w2", token_ids=[1, 2, 3], text="abc")  # at shutdown: not counted
    with sessions.begin() as s:
        assert jobs.get_job(s, job_id).handbacks == 1


def test_fail(sessions, tenant_id):
    job_id = create(sessions, tenant_id)
    with sessions.begin() as s:
        jobs.claim_job(s, job_id, "w1", LEASE)
        assert jobs.fail_job(s, job_id, "w1", code="invalid_request", message="prompt: too long")
    with sessions.begin() as s:
        job = jobs.get_job(s, job_id)
        assert (job.status, job.error_code, job.error_message) == (
            JobStatus.FAILED,
            "invalid_request",
            "prompt: too long",
        )


def test_cancel_queued_then_claim_is_dropped(sessions, tenant_id):
    job_id = create(sessions, tenant_id)
    with sessions.begin() as s:
        job, cancelled = jobs.cancel_job(s, job_id, tenant_id)
        assert cancelled and job.status == JobStatus.CANCELLED
        assert jobs.cancel_job(s, job_id, tenant_id)[1] is False  # already cancelled: not again
    with sessions.begin() as s:
        assert jobs.claim_job(s, job_id, "w1", LEASE) is None
        assert jobs.get_job(s, job_id).started_at is None


def test_cancel_running_takes_the_job_from_its_worker(sessions, tenant_id):
    job_id = create(sessions, tenant_id)
    with sessions.begin() as s:
        jobs.claim_job(s, job_id, "w1", LEASE)
    with sessions.begin() as s:
        job, cancelled = jobs.cancel_job(s, job_id, tenant_id)
        assert cancelled and (job.status, job.finish_reason) == (JobStatus.CANCELLED, "abort")
    with sessions.begin() as s:
        assert not jobs.save_progress(s, [progress(job_id, "w1", [1], "a")], LEASE)
        assert not jobs.finish_job(
            s, job_id, "w1", token_ids=[1], text="a", finish_reason="stop", prompt_tokens=1
        )


def test_cancel_finished_or_foreign(sessions, tenant_id):
    job_id = create(sessions, tenant_id)
    with sessions.begin() as s:
        jobs.claim_job(s, job_id, "w1", LEASE)
        jobs.finish_job(s, job_id, "w1", token_ids=[1], text="a", finish_reason="stop", prompt_tokens=1)
    with sessions.begin() as s:
        assert jobs.cancel_job(s, job_id, tenant_id)[0].status == JobStatus.SUCCEEDED  # unchanged
        assert jobs.cancel_job(s, job_id, tenant_id)[1] is False
        assert jobs.cancel_job(s, job_id, uuid.uuid4()) == (None, False)  # another tenant: not found


def test_expired_lease_is_requeued_keeping_its_tokens(sessions, tenant_id):
    job_id = create(sessions, tenant_id)
    with sessions.begin() as s:
        jobs.claim_job(s, job_id, "dead-worker", lease_seconds=-1)  # already expired
        jobs.save_progress(s, [progress(job_id, "dead-worker", [4, 5], "45")], -1)
    with sessions.begin() as s:
        assert (job_id, 5) in jobs.requeue_expired(s)
    with sessions.begin() as s:
        job = jobs.get_job(s, job_id)
        assert (job.status, job.worker_id, job.output_token_ids) == (JobStatus.QUEUED, None, [4, 5])
        assert job_id in [i for i, _ in jobs.unsent_jobs(s, grace_seconds=0)]
        assert jobs.claim_job(s, job_id, "w2", LEASE).attempts == 2
    with sessions.begin() as s:
        assert not jobs.save_progress(s, [progress(job_id, "dead-worker", [0], "")], LEASE)


def test_unsent_jobs_wait_for_the_grace_period(sessions, tenant_id):
    job_id = create(sessions, tenant_id, priority=2)
    with sessions.begin() as s:
        assert job_id not in [i for i, _ in jobs.unsent_jobs(s, grace_seconds=3600)]
        assert (job_id, 2) in jobs.unsent_jobs(s, grace_seconds=0)
        jobs.mark_enqueued(s, [job_id])
    with sessions.begin() as s:
        assert job_id not in [i for i, _ in jobs.unsent_jobs(s, grace_seconds=0)]


def test_idempotency_key(sessions, tenant_id):
    with sessions.begin() as s:
        first, created = jobs.create_job(s, tenant_id, REQUEST, idempotency_key="k1")
        again, created_again = jobs.create_job(s, tenant_id, dict(REQUEST), idempotency_key="k1")
        assert created and not created_again and again.id == first.id
        with pytest.raises(jobs.IdempotencyConflict):
            jobs.create_job(s, tenant_id, {**REQUEST, "max_tokens": 9}, idempotency_key="k1")


def test_list_newest_first_with_keyset(sessions, tenant_id):
    ids = [create(sessions, tenant_id, priority=i % 10) for i in range(5)]
    with sessions.begin() as s:
        page = jobs.list_jobs(s, tenant_id, limit=3)
        assert [j.id for j in page] == ids[::-1][:3]
        rest = jobs.list_jobs(s, tenant_id, limit=3, before=(page[-1].created_at, page[-1].id))
        assert [j.id for j in rest] == ids[::-1][3:]
        assert jobs.list_jobs(s, tenant_id, status=JobStatus.RUNNING) == []


def test_nul_characters_survive(sessions, tenant_id):
    job_id = create(sessions, tenant_id, prompt="a\x00b")
    with sessions.begin() as s:
        jobs.claim_job(s, job_id, "w1", LEASE)
        jobs.finish_job(s, job_id, "w1", token_ids=[3], text="\x00", finish_reason="length", prompt_tokens=4)
    with sessions.begin() as s:
        job = jobs.get_job(s, job_id)
        assert (job.prompt, job.output_text) == ("a\x00b", "\x00")


def test_keys_are_stored_hashed(sessions):
    with sessions.begin() as s:
        key = create_key(s, "hashed-tenant")
        stored = s.scalars(select(ApiKey).join(Tenant).where(Tenant.name == "hashed-tenant")).one()
        assert stored.key_hash == hash_key(key) and key not in (stored.key_hash, stored.prefix)
        assert tenant_of(s, key).name == "hashed-tenant"
        assert tenant_of(s, key + "x") is None
        assert tenant_of(s, create_key(s, "hashed-tenant")).id == stored.tenant_id  # second key, same tenant


def test_live_deadline_counts_the_queued_and_running_jobs_past_or_near_their_deadline(sessions, tenant_id):
    from datetime import datetime, timedelta, timezone

    def before() -> dict:
        with sessions() as s:
            return jobs.live_deadline_counts(s, margin_seconds=60)

    start = before()
    now = datetime.now(timezone.utc)
    create(sessions, tenant_id, deadline=now - timedelta(seconds=5))  # missed, queued
    create(sessions, tenant_id, deadline=now + timedelta(seconds=30))  # at risk, queued
    create(sessions, tenant_id, deadline=now + timedelta(hours=1))  # on track: not counted
    create(sessions, tenant_id)  # no deadline
    running = create(sessions, tenant_id, deadline=now - timedelta(seconds=1))
    done = create(sessions, tenant_id, deadline=now - timedelta(seconds=1))
    with sessions.begin() as s:
        assert jobs.claim_job(s, running, "w1", LEASE) is not None
        assert jobs.claim_job(s, done, "w1", LEASE) is not None
        assert jobs.cancel_job(s, done, tenant_id) is not None  # ended: not counted
        assert jobs.get_job(s, running).deadline == now - timedelta(seconds=1)
    grown = {key: n - start[key] for key, n in before().items()}
    assert grown == {
        (JobStatus.QUEUED, "missed"): 1,
        (JobStatus.QUEUED, "at_risk"): 1,
        (JobStatus.RUNNING, "missed"): 1,
        (JobStatus.RUNNING, "at_risk"): 0,
    }
