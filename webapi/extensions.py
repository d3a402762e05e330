"""What the API shares across requests: settings, the database, the broker. Built in create_app()."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from celery import Celery
from flask import Flask, current_app, g, request
from flask_limiter import Limiter
from sqlalchemy import Engine
from sqlalchemy.orm import Session, sessionmaker

from jobstore.db import make_engine, make_session_factory
from jobstore.dispatch import make_celery
from jobstore.settings import Settings


@dataclass
class Services:
    settings: Settings
    engine: Engine
    sessions: sessionmaker[Session]
    celery: Celery  # sends jobs only; workers/celery.py is the consuming app
    limiter: Limiter  # per-key rate limits on /jobs, counted in Redis


def init_extensions(app: Flask, settings: Settings) -> None:
    engine = make_engine(settings.database_url, settings.db_connect_timeout)
    limiter = Limiter(
        rate_limit_key, app=app, storage_uri=settings.redis_url, key_prefix=f"{settings.redis_key_prefix}ratelimit",
        default_limits=[settings.rate_limit], default_limits_exempt_when=lambda: request.blueprint != "jobs",
        storage_options={"socket_timeout": 2, "socket_connect_timeout": 2},
        headers_enabled=True,  # X-RateLimit-* and Retry-After on a 429
        swallow_errors=True, in_memory_fallback_enabled=True,  # Redis down: count in memory, never a 500
    )
    app.extensions["genq"] = Services(settings, engine, make_session_factory(engine), make_celery(settings), limiter)
    app.teardown_appcontext(_close_session)


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
