"""What the API shares across requests: settings, the database, the broker. Built in create_app()."""

from __future__ import annotations

from dataclasses import dataclass

from celery import Celery
from flask import Flask, current_app, g
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


def init_extensions(app: Flask, settings: Settings) -> None:
    engine = make_engine(settings.database_url, settings.db_connect_timeout)
    app.extensions["genq"] = Services(settings, engine, make_session_factory(engine), make_celery(settings))
    app.teardown_appcontext(_close_session)


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
