"""jobstore.db: engines and their pools, against the real server."""

from __future__ import annotations

import time

from sqlalchemy import text

from jobstore.db import make_engine


def test_an_idle_connection_postgres_dropped_is_pinged_and_replaced(database):
    """With ping_idle_seconds, a pooled connection that sat idle longer is checked before use: one the server
    closed meanwhile is replaced, and the caller never sees it. One reused at once keeps its backend."""
    engine = make_engine(database, ping_idle_seconds=0.2, pool_size=1, max_overflow=0)
    other = make_engine(database)
    try:
        with engine.connect() as conn:
            first = conn.scalar(text("SELECT pg_backend_pid()"))
        with engine.connect() as conn:  # back in the pool just now: the same connection, used as it is
            assert conn.scalar(text("SELECT pg_backend_pid()")) == first
        with other.connect() as admin:
            assert admin.scalar(text("SELECT pg_terminate_backend(:pid)"), {"pid": first})
        time.sleep(0.3)
        with engine.connect() as conn:
            assert conn.scalar(text("SELECT pg_backend_pid()")) != first
    finally:
        engine.dispose()
        other.dispose()
