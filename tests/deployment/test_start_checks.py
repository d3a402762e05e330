"""A Celery worker and beat check the deployment's Postgres connections when they start (workers/startup.py,
as gunicorn.conf.py does for the API): a plan that does not fit stops them, naming the settings."""

from __future__ import annotations

import subprocess

import pytest

from tests.conftest import BIN, ROOT, settings_env, worker_command


@pytest.mark.parametrize("process", ["worker", "beat"])
def test_a_deployment_too_big_for_postgres_stops_the_process(settings, database, tmp_path, process):
    argv = (
        worker_command("start-check@%h", 1)
        if process == "worker"
        else [BIN / "celery", "-A", "workers", "beat", "-s", str(tmp_path / "schedule")]
    )
    env = settings_env(settings) | {"API_INSTANCES": "1000", "API_WORKERS": "4"}
    done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    output = done.stdout + done.stderr
    assert done.returncode != 0, output[-3000:]
    assert "TooManyConnections" in output and "API_WORKERS" in output, output[-3000:]
    assert "building the engine" not in output  # the worker stopped before its engine was built
