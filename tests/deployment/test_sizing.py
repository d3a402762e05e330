"""The Postgres connections a deployment opens (processes x pools), checked against the real server's
max_connections, and gunicorn refusing to start when they do not fit."""

from __future__ import annotations

import subprocess

import pytest
import requests

from jobstore.db import (
    API_WORKERS_CAP,
    TooManyConnections,
    check_connections,
    check_deployment_connections,
    connection_plan,
    default_api_workers,
    make_engine,
    server_connection_limit,
)
from tests.conftest import BIN, ROOT, free_port, serve_api, settings_env


def test_the_defaults_of_a_64_core_host_fit_postgres_default_max_connections():
    """API (6 processes x DB_POOL_SIZE 10) + one worker (5 + 10) + beat (5 + 10) = 90 <= 100 - 3 reserved."""
    assert default_api_workers(64) == API_WORKERS_CAP == 6 and default_api_workers(1) == 2
    plan = connection_plan(
        api_instances=1, api_workers=default_api_workers(64), api_pool_size=10, worker_instances=1
    )
    assert [(u.name, u.connections) for u in plan] == [("API", 60), ("worker", 15), ("beat", 15)]
    assert sum(u.connections for u in plan) == 90 <= 100 - 3


def test_the_pools_counted_are_the_pools_opened(database):
    """make_engine's own pool (the worker's and beat's) holds what the plan counts for them."""
    engine = make_engine(database)
    try:
        plan = {
            u.name: u
            for u in connection_plan(api_instances=1, api_workers=1, api_pool_size=1, worker_instances=1)
        }
        assert engine.pool.size() + engine.pool._max_overflow == plan["worker"].connections == 15
    finally:
        engine.dispose()


def test_the_check_reads_the_servers_limit_and_names_the_settings(database, settings):
    max_connections, reserved = server_connection_limit(database)
    assert max_connections > reserved >= 0
    fits = check_deployment_connections(settings.replace(api_instances=1, worker_instances=1), api_workers=2)
    assert fits is not None and fits.fits and fits.planned == 2 * settings.db_pool_size + 30
    assert (fits.max_connections, fits.reserved) == (max_connections, reserved)
    too_many = connection_plan(
        api_instances=1, api_workers=1, api_pool_size=max_connections - reserved - 30 + 1, worker_instances=1
    )
    with pytest.raises(TooManyConnections) as error:
        check_connections(database, too_many)
    message = str(error.value)
    assert f"{max_connections - reserved + 1} Postgres connections planned" in message
    for name in ("API_WORKERS", "DB_POOL_SIZE", "API_INSTANCES", "WORKER_INSTANCES", "max_connections"):
        assert name in message
    assert (
        check_deployment_connections(settings.replace(db_check_connections=False, api_instances=1000), 4)
        is None
    )


def test_gunicorn_stops_at_start_when_the_deployment_would_exhaust_postgres(database, settings):
    """The start hook's check in a real gunicorn: a clear error and exit status 1, before any worker starts."""
    env = {**settings_env(settings), "API_INSTANCES": "50", "API_ACCESS_LOG": ""}
    ran = subprocess.run(
        [BIN / "gunicorn", "--bind", f"127.0.0.1:{free_port()}", "--workers", "2", "webapi:create_app()"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert ran.returncode == 1, ran.stderr[-2000:]
    assert "Postgres connections planned: API 100 x 10 = 1000" in ran.stderr and "API_INSTANCES" in ran.stderr
    assert "Booting worker" not in ran.stderr


def test_gunicorn_starts_when_it_fits_and_answers_the_probes(database, settings):
    with serve_api(settings, workers=1) as url:
        assert requests.get(f"{url}/livez", timeout=5).json() == {"status": "ok"}
        assert requests.get(f"{url}/readyz", timeout=5).status_code == 200
