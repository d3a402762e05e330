"""`alembic upgrade head` builds the schema the models describe, from nothing and back."""

from __future__ import annotations

import subprocess
import sys

from sqlalchemy import text

from jobstore.db import create_database_if_missing, drop_database, make_engine
from tests.conftest import ROOT, settings_env


def alembic(settings, *args: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "alembic", *args],
        cwd=ROOT,
        env=settings_env(settings),
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout + done.stderr


def test_models_match_migrations(settings, database):
    assert "No new upgrade operations detected" in alembic(settings, "check")


def test_downgrade_to_nothing_and_up_again(settings):
    other = settings.replace(database_url=settings.database_url + "_updown")
    create_database_if_missing(other.database_url)
    try:
        alembic(other, "upgrade", "head")
        alembic(other, "downgrade", "base")
        alembic(other, "upgrade", "head")
        assert "(head)" in alembic(other, "current")
    finally:
        drop_database(other.database_url)


def test_constraint_names_follow_the_convention(database):
    engine = make_engine(database)
    try:
        with engine.connect() as conn:
            names = conn.scalars(
                text(
                    "SELECT conname FROM pg_constraint c JOIN pg_class t ON t.oid = c.conrelid "
                    "WHERE t.relname IN ('jobs', 'tenants', 'api_keys')"
                )
            ).all()
            indexes = conn.scalars(text("SELECT indexname FROM pg_indexes WHERE tablename = 'jobs'")).all()
    finally:
        engine.dispose()
    assert names and all(n.split("_")[0] in {"pk", "fk", "ck", "uq"} for n in names), names
    assert {"ck_jobs_priority_range", "ck_jobs_status", "fk_jobs_tenant_id_tenants", "pk_jobs"} <= set(names)
    assert {"ix_jobs_tenant_created", "ix_jobs_running_worker", "ix_jobs_queued_unsent"} <= set(indexes)


def test_a_progress_write_is_a_heap_only_update(database, sessions):
    """A running job's progress write (new tokens, a renewed lease) touches no index: Postgres writes the row's
    new version on its page (HOT), instead of an entry in each of the table's indexes (migration 0008)."""
    from contract.requests import JobCreate
    from jobstore import jobs
    from jobstore.keys import create_key

    with sessions.begin() as session:
        create_key(session, "hot-updates")
        tenant = session.execute(text("SELECT id FROM tenants WHERE name = 'hot-updates'")).scalar_one()
        request = JobCreate.model_validate({"prompt": "Once upon a time", "max_tokens": 64}).model_dump()
        job, _ = jobs.create_job(session, tenant, request)
        assert job is not None
        jobs.claim_jobs(session, [(job.id, "hot-worker")], 60)
    engine = make_engine(database)
    try:
        with engine.connect() as conn, conn.begin():  # the transaction's own counts of the table's updates
            for step in range(3):
                output = jobs.Output(job.id, "hot-worker", step * 4, [1, 2, 3, 4], step * 4, b"abcd")
                # a lease renewed to another expiry each time, as a write in a transaction of its own renews it
                assert jobs.save_progress(conn, [output], 60 + step) == {(job.id, "hot-worker")}
            updated, heap_only = conn.execute(
                text(
                    "SELECT pg_stat_get_xact_tuples_updated('jobs'::regclass), "
                    "pg_stat_get_xact_tuples_hot_updated('jobs'::regclass)"
                )
            ).one()
            tokens = conn.scalar(text("SELECT output_token_ids FROM jobs WHERE id = :id"), {"id": job.id})
    finally:
        engine.dispose()
    assert tokens == [1, 2, 3, 4] * 3
    assert (updated, heap_only) == (3, 3)
