"""Database engine and sessions (SQLAlchemy 2 over psycopg 3), and the Postgres connections a deployment
opens (its processes x their pools), checked against the server's max_connections at start-up.

PgBouncer: a DATABASE_URL ending in `?pgbouncer=true` goes through PgBouncer in transaction mode, where
consecutive transactions of one client run on different server connections: psycopg's automatic prepared
statements (prepared on one server connection, then run by name) are turned off there.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

from sqlalchemy import URL, Connection, Engine, create_engine, event, text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import InvalidatePoolError
from sqlalchemy.orm import Session, sessionmaker

from contract.cpus import available_cpus

if TYPE_CHECKING:
    from contract.settings import Settings


def normalize_url(url: str) -> str:
    """DATABASE_URL as SQLAlchemy wants it: `postgres://` and `postgresql://` use the psycopg 3 driver."""
    for scheme in ("postgres://", "postgresql://"):
        if url.startswith(scheme):
            return "postgresql+psycopg://" + url[len(scheme) :]
    return url


PGBOUNCER = "pgbouncer"  # DATABASE_URL's query parameter: `?pgbouncer=true` (Prisma's name for the same)
# make_engine's pool unless its caller sets one (SQLAlchemy's QueuePool defaults, named so that the
# connection plan below counts what the worker and beat, which keep them, open at most)
POOL_SIZE = 5
MAX_OVERFLOW = 10
API_MAX_OVERFLOW = 0  # the API's pool: DB_POOL_SIZE and no overflow (webapi/extensions.py)
# gunicorn processes of one API instance unless API_WORKERS says: 2 per CPU (gunicorn.conf.py), at most this
# many, so that one host's API, worker and beat fit Postgres' default max_connections (100, 3 reserved):
# 6 x DB_POOL_SIZE 10 + 15 + 15 = 90. A gevent process holds thousands of waiting calls; more processes buy
# CPU for the API's own work, which a GPU host's engine does not wait on.
API_WORKERS_CAP = 6


def engine_url(url: str) -> tuple[URL, bool]:
    """DATABASE_URL as SQLAlchemy takes it, and whether it goes through PgBouncer (`?pgbouncer=true`,
    removed from the URL: libpq knows no such parameter)."""
    parsed = make_url(normalize_url(url))
    flag = parsed.query.get(PGBOUNCER, "false")
    if flag not in ("true", "false"):
        raise ValueError(f"DATABASE_URL: ?{PGBOUNCER}= must be true or false, not {flag!r}")
    return parsed.difference_update_query([PGBOUNCER]), flag == "true"


def make_engine(
    url: str, connect_timeout: float = 3.0, *, ping_idle_seconds: float | None = None, **kwargs
) -> Engine:
    """A pooled engine that checks connections before use (Postgres may have restarted) and gives up
    connecting after `connect_timeout` seconds, so a down database is an error at once, never a hang.

    With `ping_idle_seconds`, only a connection that waited in the pool longer than that is checked (a
    `SELECT 1` round trip), not every one (pool_pre_ping): a busy API reuses its connections within
    milliseconds and pays no ping per request. Should Postgres go away in that window, the statement fails
    on its dead connection and SQLAlchemy empties the pool (its "optimistic" handling).

    Through PgBouncer (`?pgbouncer=true`) psycopg prepares no statement (prepare_threshold=None): in
    transaction mode a statement prepared on one server connection would be run by name on another one
    ("prepared statement _pg3_0 does not exist"), or prepared twice on one ("... already exists")."""
    parsed, through_pgbouncer = engine_url(url)
    kwargs.setdefault("pool_timeout", max(connect_timeout, 1.0))
    kwargs.setdefault("pool_pre_ping", ping_idle_seconds is None)
    if "poolclass" not in kwargs:
        kwargs.setdefault("pool_size", POOL_SIZE)
        kwargs.setdefault("max_overflow", MAX_OVERFLOW)
    connect_args: dict = {"connect_timeout": max(1, round(connect_timeout))}
    if through_pgbouncer:
        connect_args["prepare_threshold"] = None
    engine = create_engine(parsed, connect_args=connect_args, **kwargs)
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
    name = engine_url(url)[0].database
    with _server_connection(url) as conn:
        exists = conn.scalar(text("SELECT 1 FROM pg_database WHERE datname = :name"), {"name": name})
        if not exists:
            conn.execute(text(f'CREATE DATABASE "{name}"'))
    return not exists


def drop_database(url: str) -> None:
    """Drop the database named in `url`, disconnecting its sessions (tests use this)."""
    name = engine_url(url)[0].database
    with _server_connection(url) as conn:
        conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


@contextmanager
def _server_connection(url: str) -> Iterator[Connection]:
    """An autocommit connection to the same server's `postgres` database."""
    server_url = engine_url(url)[0].set(database="postgres")
    engine = create_engine(server_url, isolation_level="AUTOCOMMIT")
    try:
        with engine.connect() as conn:
            yield conn
    finally:
        engine.dispose()


# --- how many connections a deployment opens ----------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PoolUse:
    """The Postgres connections one kind of process opens at most: processes x (pool_size + max_overflow)."""

    name: str
    processes: int
    pool_size: int
    max_overflow: int
    settings: str  # the settings behind the count, named in the error

    @property
    def connections(self) -> int:
        return self.processes * (self.pool_size + self.max_overflow)


@dataclass(frozen=True, slots=True)
class ConnectionCheck:
    """The plan's connections against what the server lets clients open (max_connections less the
    connections it keeps for superusers and for roles with pg_use_reserved_connections)."""

    plan: tuple[PoolUse, ...]
    max_connections: int
    reserved: int

    @property
    def planned(self) -> int:
        return sum(use.connections for use in self.plan)

    @property
    def available(self) -> int:
        return self.max_connections - self.reserved

    @property
    def fits(self) -> bool:
        return self.planned <= self.available

    def describe(self) -> str:
        parts = " + ".join(
            f"{u.name} {u.processes} x {u.pool_size + u.max_overflow} = {u.connections} ({u.settings})"
            for u in self.plan
        )
        return (
            f"{self.planned} Postgres connections planned: {parts}; the server allows {self.available} "
            f"(max_connections {self.max_connections} less {self.reserved} reserved)"
        )


class TooManyConnections(RuntimeError):
    """The deployment would open more Postgres connections than the server allows."""


def default_api_workers(cpus: int) -> int:
    """gunicorn processes per API instance when API_WORKERS is unset: 2 per CPU, at most API_WORKERS_CAP."""
    return max(1, min(2 * cpus, API_WORKERS_CAP))


def connection_plan(
    *,
    api_instances: int,
    api_workers: int,
    api_pool_size: int,
    worker_instances: int,
    beat_instances: int = 1,
) -> tuple[PoolUse, ...]:
    """What every process of a deployment keeps open at most against one Postgres server."""
    return (
        PoolUse(
            "API",
            api_instances * api_workers,
            api_pool_size,
            API_MAX_OVERFLOW,
            "API_INSTANCES x API_WORKERS gunicorn processes, DB_POOL_SIZE each",
        ),
        PoolUse("worker", worker_instances, POOL_SIZE, MAX_OVERFLOW, "WORKER_INSTANCES Celery workers"),
        PoolUse("beat", beat_instances, POOL_SIZE, MAX_OVERFLOW, "celery beat"),
    )


def server_connection_limit(url: str, connect_timeout: float = 3.0) -> tuple[int, int]:
    """(max_connections, connections reserved for superusers and pg_use_reserved_connections)."""
    engine = make_engine(url, connect_timeout, pool_size=1, max_overflow=0)
    try:
        with engine.connect() as conn:
            row = conn.execute(
                text(
                    "SELECT current_setting('max_connections')::int, "
                    "current_setting('superuser_reserved_connections')::int, "
                    "coalesce(current_setting('reserved_connections', true), '0')::int"  # Postgres 16+
                )
            ).one()
    finally:
        engine.dispose()
    return row[0], row[1] + row[2]


def check_connections(url: str, plan: Sequence[PoolUse], connect_timeout: float = 3.0) -> ConnectionCheck:
    """The plan against the server's max_connections; TooManyConnections naming the settings if it does not fit."""
    max_connections, reserved = server_connection_limit(url, connect_timeout)
    check = ConnectionCheck(tuple(plan), max_connections, reserved)
    if not check.fits:
        raise TooManyConnections(
            f"{check.describe()}. Lower API_WORKERS or DB_POOL_SIZE, run PgBouncer in front of Postgres "
            f"(DATABASE_URL ...?{PGBOUNCER}=true), or raise the server's max_connections; API_INSTANCES and "
            "WORKER_INSTANCES say how many API instances and Celery workers share this server "
            "(DB_CHECK_CONNECTIONS=false skips this check)."
        )
    return check


def check_deployment_connections(
    settings: Settings, api_workers: int | None = None
) -> ConnectionCheck | None:
    """check_connections for the deployment `settings` describe (DATABASE_URL, API_INSTANCES, WORKER_INSTANCES,
    DB_POOL_SIZE, DB_CHECK_CONNECTIONS), whose API instances run `api_workers` gunicorn processes each (None:
    API_WORKERS, else default_api_workers of this host's CPUs). None when not checked: DB_CHECK_CONNECTIONS=false,
    or through PgBouncer (its pools, not these, bound the server's connections). gunicorn.conf.py calls it
    when the API starts; a Celery worker can call it with `Settings.from_env()` when it starts."""
    if not settings.db_check_connections or engine_url(settings.database_url)[1]:
        return None
    if api_workers is None:
        api_workers = int(os.environ.get("API_WORKERS") or default_api_workers(available_cpus()))
    plan = connection_plan(
        api_instances=settings.api_instances,
        api_workers=api_workers,
        api_pool_size=settings.db_pool_size,
        worker_instances=settings.worker_instances,
    )
    return check_connections(settings.database_url, plan, settings.db_connect_timeout)
