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
    assert {"ix_jobs_tenant_created", "ix_jobs_running_lease", "ix_jobs_queued_unsent"} <= set(indexes)
