"""Database engine and sessions (SQLAlchemy 2 over psycopg 3)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from sqlalchemy import Connection, Engine, create_engine, text
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session, sessionmaker


def normalize_url(url: str) -> str:
    """DATABASE_URL as SQLAlchemy wants it: `postgres://` and `postgresql://` use the psycopg 3 driver."""
    for scheme in ("postgres://", "postgresql://"):
        if url.startswith(scheme):
            return "postgresql+psycopg://" + url[len(scheme) :]
    return url


def make_engine(url: str, connect_timeout: float = 3.0, **kwargs) -> Engine:
    """A pooled engine that checks connections before use (Postgres may have restarted) and gives up
    connecting after `connect_timeout` seconds, so a down database is an error at once, never a hang."""
    kwargs.setdefault("pool_timeout", max(connect_timeout, 1.0))
    return create_engine(
        normalize_url(url),
        pool_pre_ping=True,
        connect_args={"connect_timeout": max(1, round(connect_timeout))},
        **kwargs,
    )


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
