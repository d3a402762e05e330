"""Fixtures shared by the service tests: a throw-away Postgres database and Redis namespace per session.

Everything is real: Postgres at 127.0.0.1:5432 (user postgres, trust auth) and Redis at
127.0.0.1:6379 (`make services` starts both). Each test session creates its own database (random
name, built with `alembic upgrade head`) and its own Redis key prefix on a random Redis database
number, and removes both at the end, so parallel runs and other people's data are never touched.
"""

from __future__ import annotations

import os
import random
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import pytest
import redis
import requests

from contract.settings import Settings
from jobstore.db import create_database_if_missing, drop_database, make_engine, make_session_factory
from jobstore.keys import create_key, hash_key, tenant_for_key_hash
from jobstore.models import Tenant

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent  # the virtual environment's commands: celery, gunicorn, flask
POSTGRES = os.environ.get("GENQ_TEST_POSTGRES", "postgresql+psycopg://postgres@127.0.0.1:5432")
REDIS = os.environ.get("GENQ_TEST_REDIS", "redis://127.0.0.1:6379")


def worker_command(node: str, concurrency: int, loglevel: str = "INFO") -> list:
    """The Celery worker of the Procfile (threads pool, the `generate` queue) as node `node`, quiet on
    the cluster chatter a test or bench does not need."""
    return [
        BIN / "celery",
        "-A",
        "workers",
        "worker",
        "--pool",
        "threads",
        "--concurrency",
        str(concurrency),
        "-Q",
        "generate",
        "--loglevel",
        loglevel,
        "--without-mingle",
        "--without-gossip",
        "-n",
        node,
    ]


def tenant_of(session, key: str) -> Tenant | None:
    """The tenant owning the API key `key` (None if unknown or revoked), as the API's auth finds it."""
    return tenant_for_key_hash(session, hash_key(key))


def job_request(**fields) -> dict:
    """A request as jobstore.jobs.create_job takes it once the API has validated it: greedy, 8 tokens,
    priority 5; `fields` override."""
    request = dict(
        prompt="Once upon",
        input_ids=None,
        max_tokens=8,
        temperature=0.0,
        top_p=1.0,
        top_k=0,
        seed=None,
        stop=[],
        priority=5,
        metadata={},
    )
    return request | fields


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def settings_env(settings: Settings) -> dict[str, str]:
    """The environment that makes a subprocess (alembic, worker, gunicorn) read `settings`."""
    env = dict(os.environ)
    # the values unlike their defaults, and those the environment names (a test's value equal to the default
    # would otherwise lose to an environment naming another); the rest: as the environment says (not every value:
    # some defaults are worked out where they are read, as the API's completion slots from its worker class)
    changed = settings.model_dump(exclude_defaults=True)
    for name, value in settings.model_dump().items():
        if value is not None and (name in changed or name.upper() in os.environ):
            env[name.upper()] = str(value)
    return env


@contextmanager
def serve_api(
    settings: Settings, workers: int = 2, args: Sequence[str] = (), env: dict[str, str] | None = None
) -> Iterator[str]:
    """`gunicorn "webapi:create_app()"` for `settings` on a free port, as in the Procfile; yields its URL.
    `args` are more gunicorn options, `env` more environment."""
    port = free_port()
    # its log to a file, not a pipe nobody reads while it serves: a busy API's warnings would fill a pipe's
    # 64 KiB and block its processes mid-request
    log = tempfile.TemporaryFile()
    proc = subprocess.Popen(
        [
            BIN / "gunicorn",
            "--bind",
            f"127.0.0.1:{port}",
            "--workers",
            str(workers),
            *args,
            "webapi:create_app()",
        ],
        cwd=ROOT,
        env={**settings_env(settings), "API_ACCESS_LOG": "", **(env or {})},
        stdout=subprocess.DEVNULL,
        stderr=log,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(300):
            try:
                if requests.get(f"{url}/healthz", timeout=5).status_code == 200:
                    break
            except requests.RequestException:  # not listening yet, or its workers are still starting
                time.sleep(0.1)
        else:
            log.seek(0)
            raise AssertionError(f"gunicorn did not answer /healthz: {log.read().decode()[-3000:]}")
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=20)
        log.close()


@pytest.fixture(scope="session")
def settings() -> Settings:
    """Settings naming this session's database and Redis namespace; tiny-llama in float32 on the CPU."""
    run = uuid.uuid4().hex[:10]
    return Settings(
        database_url=f"{POSTGRES}/genq_test_{run}",
        redis_url=f"{REDIS}/{random.randint(1, 15)}",
        redis_key_prefix=f"genq-test-{run}:",
        model="tiny-llama",
        dtype="float32",
        device="cpu",
        lease_seconds=5.0,
        progress_interval=0.25,
        enqueue_grace_seconds=1.0,
    )


@pytest.fixture(scope="session")
def database(settings: Settings) -> Iterator[str]:
    """A fresh database built by `alembic upgrade head`, dropped at the end of the session."""
    create_database_if_missing(settings.database_url)
    try:
        subprocess.run(
            [sys.executable, "-m", "alembic", "upgrade", "head"],
            cwd=ROOT,
            env=settings_env(settings),
            check=True,
            capture_output=True,
            text=True,
        )
        yield settings.database_url
    finally:
        drop_database(settings.database_url)


@pytest.fixture(scope="session")
def redis_client(settings: Settings) -> Iterator[redis.Redis]:
    """A client on this session's Redis database; this session's keys are deleted at the end."""
    client = redis.Redis.from_url(settings.redis_url)
    yield client
    keys = list(client.scan_iter(match=f"{settings.redis_key_prefix}*"))
    if keys:
        client.delete(*keys)
    client.close()


@pytest.fixture(scope="session")
def sessions(database: str):
    engine = make_engine(database)
    yield make_session_factory(engine)
    engine.dispose()


@pytest.fixture(scope="session")
def new_key(sessions):
    """Make an API key for a new tenant: `new_key()` returns the key; each call is another tenant."""

    def make(tenant: str | None = None) -> str:
        with sessions.begin() as session:
            return create_key(session, tenant or f"tenant-{uuid.uuid4().hex[:8]}")

    return make


@pytest.fixture()
def auth(new_key):
    """`auth()`: Authorization headers for a new tenant."""
    return lambda: {"Authorization": f"Bearer {new_key()}"}


@pytest.fixture(scope="session")
def app(settings: Settings, database: str, redis_client):
    from webapi import create_app

    app = create_app(settings)
    yield app
    app.extensions["genq"].close()


@pytest.fixture()
def client(app):
    return app.test_client()


def gunicorn_conf() -> dict:
    """gunicorn.conf.py executed as gunicorn does, its names; what it writes to os.environ (COMPLETION_SLOTS) is
    undone after, so no later process of the test run inherits it."""
    import runpy
    from unittest import mock

    with mock.patch.dict(os.environ):
        return runpy.run_path(str(ROOT / "gunicorn.conf.py"))
