"""jobstore/output_length.py under a backlog, against the real schema: a job's history is the last RECENT_JOBS of
its tenant's jobs to finish before it was created, found through the index of the tenant's jobs in the order
they ended, however many jobs created before it were still queued or running then (genq-batch keeps ~1,000 of a
tenant's jobs queued: walked in creation order, the query read that whole backlog for each job)."""

from __future__ import annotations

from sqlalchemy import text as sql

from jobstore.output_length import _HISTORY, RECENT_JOBS, predicted_output_tokens
from tests.jobstore.test_output_length import finished_job, shape, tenant  # noqa: F401


def test_the_history_is_the_last_jobs_to_finish_before_it_was_created(sessions, tenant):  # noqa: F811
    for i in range(RECENT_JOBS):  # created long ago, finished just before the job at 1000
        finished_job(sessions, tenant, i, 900 + i, 10)
    for i in range(50):  # created after those, just before it; still running when it was created
        finished_job(sessions, tenant, 500 + i, 1100 + i, 4000)
    with sessions() as s:
        assert predicted_output_tokens(s, [shape(tenant, 1000)]) == [10]


def test_the_history_walks_no_backlog(sessions, tenant):  # noqa: F811
    for i in range(RECENT_JOBS):
        finished_job(sessions, tenant, i, 10 + i, 10)
    for i in range(300):  # a backlog: created before the job at 100, ended after it
        finished_job(sessions, tenant, 50 + i * 0.1, 200 + i, 20)
    with sessions() as s:
        plan = "\n".join(
            row[0]
            for row in s.execute(
                sql("EXPLAIN (ANALYZE, COSTS OFF, TIMING OFF, SUMMARY OFF) " + _HISTORY.text).bindparams(
                    *_HISTORY._bindparams.values()  # the typed arrays of the query
                ),
                {
                    "tenants": [tenant],
                    "created": [shape(tenant, 100).created_at],
                    "models": [None],
                    "limit": 32,
                },
            )
        )
    assert "Rows Removed by Filter" not in plan, plan  # the 300 jobs of the backlog are not read
    assert "Sort" not in plan, plan  # read in the order of an index
