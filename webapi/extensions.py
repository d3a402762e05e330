"""What the API shares across requests: settings, the database, the broker. Built in create_app()."""

from __future__ import annotations

import hashlib
import math
import threading
import time
from dataclasses import dataclass

from celery import Celery
from flask import Flask, current_app, g, request
from flask_limiter import Limiter, RateLimitExceeded
from sqlalchemy import Engine
from sqlalchemy.orm import Session, sessionmaker

from contract.dispatch import BulkSender, bounded_redis, make_celery
from contract.redis_client import limiter_storage
from contract.settings import ApiSettings
from contract.tracing import instrument_engine
from jobstore.db import API_MAX_OVERFLOW, make_engine, make_session_factory
from webapi.errors import error_response
from webapi.fleet import Fleet
from webapi.hub import Hub
from webapi.key_cache import KeyCache
from webapi.queue_size import QueueSize
from webapi.sent_marks import SentMarks

LIMITED_BLUEPRINTS = (
    "jobs",
    "bulk_jobs",  # a bulk submission is one call
    "ended_jobs",
    "usage",
    "files",
    "batches",
    "completions",
)  # RATE_LIMIT counts their calls (a batch is one)


@dataclass
class Services:
    settings: ApiSettings
    engine: Engine
    sessions: sessionmaker[Session]
    celery: Celery  # sends jobs only; workers/celery.py is the consuming app
    limiter: Limiter  # per-key rate limits on /jobs, counted in Redis
    autocommit: Engine  # the same pool, each statement its own transaction (POST /jobs' single insert)
    key_cache: KeyCache  # API keys looked up in the last few seconds
    sent_marks: SentMarks  # jobs sent to Redis, recorded in Postgres in batches
    queue_size: QueueSize  # queued jobs per tenant and in all, counted at most once a second
    bulk_sender: BulkSender  # jobs to Redis: one LPUSH for POST /jobs, pipelines for a batch's
    completion_slots: threading.BoundedSemaphore | None  # calls waiting on a job in this process
    hub: Hub  # this process's reader of token events (webapi/hub.py)
    fleet: Fleet  # the models the fleet serves, read from the workers' announcements (webapi/fleet.py)

    def close(self) -> None:
        """Record the pending "sent" marks, then close every database connection (tests, shutdown)."""
        self.sent_marks.close()
        self.bulk_sender.close()
        self.engine.dispose()


def init_extensions(app: Flask, settings: ApiSettings) -> None:
    # a gevent process serves thousands of calls at once: in a burst they wait their turn for a connection,
    # as long as it takes (on 2 busy cores, 1,000 streams opened at once waited over 30 s); a database that
    # is down is found by the connection attempt (DB_CONNECT_TIMEOUT), not by this wait. A connection idle
    # over a second is pinged before use; one reused at once is not (a round trip a request). No overflow:
    # SQLAlchemy's default (5 kept, 10 more opened under load and closed when handed back) made a burst
    # open and close a connection, and start and stop a Postgres backend, every few calls
    engine = make_engine(
        settings.database_url,
        settings.db_connect_timeout,
        pool_size=settings.db_pool_size,
        max_overflow=API_MAX_OVERFLOW,  # what jobstore.db's connection plan counts
        pool_timeout=120,
        ping_idle_seconds=1.0,
    )
    instrument_engine(engine)  # TRACING: its statements' spans (contract/tracing.py)
    storage_uri, storage_options = limiter_storage(settings.redis_url)
    if not storage_options:  # a bounded pool, waited on: a burst of calls shares a few connections
        storage_options = {"connection_pool": bounded_redis(settings.redis_url, timeout=2).connection_pool}
    limiter = Limiter(  # Sentinel: limits' own Sentinel storage, which takes no connection_pool
        rate_limit_key,
        app=app,
        storage_uri=storage_uri,
        key_prefix=f"{settings.redis_key_prefix}ratelimit",
        default_limits=[
            _rate_limit_of_caller
        ],  # the key's tenant's (webapi/tenant_limits.py), else RATE_LIMIT
        default_limits_exempt_when=lambda: request.blueprint not in LIMITED_BLUEPRINTS,
        storage_options=storage_options,
        headers_enabled=False,  # X-RateLimit-* on every answer would cost a second Redis call per request
        swallow_errors=True,
        in_memory_fallback_enabled=True,  # Redis down: count in memory, never a 500
    )
    sessions = make_session_factory(engine)
    celery = make_celery(settings)
    app.extensions["genq"] = Services(
        settings,
        engine,
        sessions,
        celery,
        limiter,
        engine.execution_options(isolation_level="AUTOCOMMIT"),
        KeyCache(settings.auth_cache_seconds),
        SentMarks(sessions),
        QueueSize(engine),
        BulkSender(celery, settings),
        threading.BoundedSemaphore(settings.completion_slots) if settings.completion_slots else None,
        Hub(
            settings.redis_url, settings.redis_key_prefix, retention_seconds=settings.events_retention_seconds
        ),
        Fleet(settings, bounded_redis(settings.redis_url, timeout=2, max_connections=4)),
    )
    app.teardown_appcontext(_close_session)
    app.register_error_handler(RateLimitExceeded, _rate_limited)


def _rate_limit_of_caller() -> str:
    from webapi.tenant_limits import rate_limit_of_caller  # it imports this module

    return rate_limit_of_caller()


def _rate_limited(exc: RateLimitExceeded):
    """429 naming the limit, with Retry-After: the seconds until the limit's window resets."""
    try:
        retry_after = max(1, math.ceil(services().limiter.current_limit.reset_at - time.time()))
    except Exception:  # noqa: BLE001 - Redis just went away: any sensible wait will do
        retry_after = 1
    return error_response(
        429,
        "too_many_requests",
        f"rate_limit: exceeded {exc.description} for this key; it resets in {retry_after} s",
        {"Retry-After": str(retry_after)},
    )


def rate_limit_key() -> str:
    """Rate limits count per API key; the key itself is never stored, only a hash of the header."""
    auth = request.headers.get("Authorization", "")
    if auth:
        return "key:" + hashlib.sha256(auth.encode("utf-8", "surrogateescape")).hexdigest()[:32]
    return "addr:" + (request.remote_addr or "unknown")


def services() -> Services:
    return current_app.extensions["genq"]


def db() -> Session:
    """This request's database session (closed when the request ends)."""
    if "db" not in g:
        g.db = services().sessions()
    return g.db


def _close_session(_exc: BaseException | None) -> None:
    session = g.pop("db", None)
    if session is not None:
        session.close()
