"""jobstore/output_length.py against the real schema: the prediction from a tenant's recent jobs."""

from __future__ import annotations

import uuid
from datetime import datetime, timedelta, timezone

import pytest
from sqlalchemy import text as sql

from jobstore import jobs
from jobstore.keys import create_key
from jobstore.output_length import RECENT_JOBS, JobShape, predict_output_tokens, predicted_output_tokens
from tests.conftest import job_request, tenant_of

T0 = datetime(2026, 11, 1, tzinfo=timezone.utc)


@pytest.fixture()
def tenant(sessions):
    with sessions.begin() as s:
        return tenant_of(s, create_key(s, f"t-{uuid.uuid4().hex[:8]}")).id


def finished_job(
    sessions, tenant_id, created: float, finished: float, tokens: int, status="succeeded", model=None
):
    """A job of `tenant_id` (on `model`; None: the default) created and finished at T0 + those seconds, with
    `tokens` output tokens."""
    with sessions.begin() as s:
        job, _ = jobs.create_job(s, tenant_id, job_request(max_tokens=4000), prompt_tokens=3)
        s.execute(
            sql(
                "UPDATE jobs SET status = :status, created_at = :created, finished_at = :finished, "
                "output_token_ids = array_fill(7, ARRAY[:n]), model = :model WHERE id = :id"
            ),
            dict(
                status=status,
                created=T0 + timedelta(seconds=created),
                finished=T0 + timedelta(seconds=finished),
                n=tokens,
                model=model,
                id=job.id,
            ),
        )


def shape(tenant_id, at: float, max_tokens: int = 4000, model=None) -> JobShape:
    return JobShape(tenant_id, T0 + timedelta(seconds=at), max_tokens, model)


def test_the_statistic_is_the_mean_capped_by_max_tokens_and_max_tokens_without_history():
    assert predict_output_tokens(500, []) == 500
    assert predict_output_tokens(500, [10, 20, 31]) == 21  # rounded up
    assert predict_output_tokens(15, [10, 20, 31]) == 15


def test_a_tenants_recent_succeeded_jobs_finished_before_it_predict_its_output(sessions, tenant):
    other = None
    with sessions.begin() as s:
        other = tenant_of(s, create_key(s, f"o-{uuid.uuid4().hex[:8]}")).id
    finished_job(sessions, tenant, 0, 10, 100)
    finished_job(sessions, tenant, 1, 11, 300)
    finished_job(sessions, tenant, 2, 12, 5000, status="failed")  # not a success: not history
    finished_job(sessions, tenant, 3, 50, 900)  # still running at 20: not history then
    finished_job(sessions, other, 0, 5, 7)  # another tenant's
    with sessions() as s:
        got = predicted_output_tokens(
            s,
            [
                shape(tenant, 20),  # (100 + 300) / 2
                shape(tenant, 20, max_tokens=150),  # capped
                shape(tenant, 60),  # (100 + 300 + 900) / 3, rounded up
                shape(tenant, 5, max_tokens=64),  # nothing finished yet: max_tokens
                shape(other, 6),
            ],
        )
    assert got == [200, 150, 434, 64, 7]
    with sessions() as s:
        assert predicted_output_tokens(s, []) == []


def test_the_history_is_bounded_to_the_last_recent_jobs(sessions, tenant):
    for i in range(RECENT_JOBS):
        finished_job(sessions, tenant, 100 + i, 200 + i, 10)
    finished_job(sessions, tenant, 50, 60, 100_000)  # older than the last RECENT_JOBS: left out
    with sessions() as s:
        assert predicted_output_tokens(s, [shape(tenant, 1000)]) == [10]


def test_the_same_job_gets_the_same_prediction_after_more_jobs_finish(sessions, tenant):
    """A restarted worker that predicts again gets the same value: later jobs never enter a job's history."""
    finished_job(sessions, tenant, 0, 1, 40)
    with sessions() as s:
        before = predicted_output_tokens(s, [shape(tenant, 2)])
    finished_job(sessions, tenant, 1.5, 3, 4000)  # created before it, finished after it was created
    finished_job(sessions, tenant, 5, 6, 4000)  # created after it
    with sessions() as s:
        assert predicted_output_tokens(s, [shape(tenant, 2)]) == before == [40]


def test_a_models_history_predicts_its_jobs_only(sessions, tenant):
    """The same tenant's jobs on another model answer at other lengths: each model's jobs predict its own."""
    finished_job(sessions, tenant, 0, 10, 100)  # the default model
    finished_job(sessions, tenant, 1, 11, 900, model="big")
    with sessions() as s:
        got = predicted_output_tokens(
            s, [shape(tenant, 20), shape(tenant, 20, model="big"), shape(tenant, 20, 64, "x")]
        )
    assert got == [100, 900, 64]
