"""Fixtures of the HTTP tests that need a real server."""

from __future__ import annotations

import subprocess
import time

import pytest
import requests

from tests.conftest import BIN, ROOT, free_port, settings_env


@pytest.fixture(scope="module")
def server(settings, database):
    """`gunicorn "webapi:create_app()"` on a free port, as in the Procfile."""
    port = free_port()
    proc = subprocess.Popen(
        [BIN / "gunicorn", "--bind", f"127.0.0.1:{port}", "webapi:create_app()"],
        cwd=ROOT,
        env=settings_env(settings),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(100):
            try:
                if requests.get(f"{url}/healthz", timeout=5).status_code == 200:
                    break
            except requests.RequestException:  # not listening yet, or its workers are still starting
                time.sleep(0.1)
        else:
            pytest.fail("gunicorn did not answer /healthz")
        yield url
    finally:
        proc.terminate()
        proc.communicate(timeout=10)
