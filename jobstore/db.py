"""Database engine and sessions (SQLAlchemy 2 over psycopg 3)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

from sqlalchemy import Connection, Engine, create_engine, event, text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import InvalidatePoolError
from sqlalchemy.orm import Session, sessionmaker


def normalize_url(url: str) -> str:
    """DATABASE_URL as SQLAlchemy wants it: `postgres://` and `postgresql://` use the psycopg 3 driver."""
    for scheme in ("postgres://", "postgresql://"):
        if url.startswith(scheme):
            return "postgresql+psycopg://" + url[len(scheme) :]
    return url


def make_engine(
    url: str, connect_timeout: float = 3.0, *, ping_idle_seconds: float | None = None, **kwargs
) -> Engine:
    """A pooled engine that checks connections before use (Postgres may have restarted) and gives up
    connecting after `connect_timeout` seconds, so a down database is an error at once, never a hang.

    With `ping_idle_seconds`, only a connection that waited in the pool longer than that is checked (a
    `SELECT 1` round trip), not every one (pool_pre_ping): a busy API reuses its connections within
    milliseconds and pays no ping per request. Should Postgres go away in that window, the statement fails
    on its dead connection and SQLAlchemy empties the pool (its "optimistic" handling)."""
    kwargs.setdefault("pool_timeout", max(connect_timeout, 1.0))
    kwargs.setdefault("pool_pre_ping", ping_idle_seconds is None)
    engine = create_engine(
        normalize_url(url),
        connect_args={"connect_timeout": max(1, round(connect_timeout))},
        **kwargs,
    )
    if ping_idle_seconds is not None:
        _ping_when_idle(engine, ping_idle_seconds)
    return engine


def _ping_when_idle(engine: Engine, seconds: float) -> None:
    """SQLAlchemy's custom pessimistic disconnect handling (a `checkout` listener), for idle connections."""

    @event.listens_for(engine, "checkin")
    def _checked_in(dbapi_connection, record) -> None:
        record.info["idle_since"] = time.monotonic()  # `info` goes with the DBAPI connection

    @event.listens_for(engine, "checkout")
    def _checked_out(dbapi_connection, record, proxy) -> None:
        since = record.info.pop("idle_since", None)
        if since is None or time.monotonic() - since < seconds:  # new, or back in the pool just now
            return
        try:
            engine.dialect.do_ping(dbapi_connection)
        except engine.dialect.loaded_dbapi.Error as exc:  # the pool reconnects, as pool_pre_ping does
            raise InvalidatePoolError() from exc


def make_session_factory(engine: Engine) -> sessionmaker[Session]:
    """Sessions whose objects stay readable after commit (views serialize them afterwards)."""
    return sessionmaker(engine, expire_on_commit=False)


def create_database_if_missing(url: str) -> bool:
    """Create the database named in `url`; True if it was missing."""
    name = make_url(normalize_url(url)).database
    with _server_connection(url) as conn:
        exists = conn.scalar(text("SELECT 1 FROM pg_database WHERE datname = :name"), {"name": name})
        if not exists:
            conn.execute(text(f'CREATE DATABASE "{name}"'))
    return not exists


def drop_database(url: str) -> None:
    """Drop the database named in `url`, disconnecting its sessions (tests use this)."""
    name = make_url(normalize_url(url)).database
    with _server_connection(url) as conn:
        conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


@contextmanager
def _server_connection(url: str) -> Iterator[Connection]:
    """An autocommit connection to the same server's `postgres` database."""
    server_url = make_url(normalize_url(url)).set(database="postgres")
    engine = create_engine(server_url, isolation_level="AUTOCOMMIT")
    try:
        with engine.connect() as conn:
            yield conn
    finally:
        engine.dispose()
