"""The contract commands as a user runs them: `flask --app webapi keys create`, and gunicorn serving the app."""

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


def create_key(settings, tenant: str) -> str:
    done = subprocess.run(
        [BIN / "flask", "--app", "webapi", "keys", "create", tenant],
        cwd=ROOT,
        env=settings_env(settings),
        capture_output=True,
        text=True,
        check=True,
    )
    return done.stdout.strip().splitlines()[-1]


def test_cli_key_is_the_last_line_and_works(server, settings):
    key = create_key(settings, "cli-tenant")
    assert key.startswith("gq_")
    r = requests.get(f"{server}/jobs", headers={"Authorization": f"Bearer {key}"}, timeout=5)
    assert r.status_code == 200 and r.json() == {"jobs": [], "next_cursor": None}


def test_submit_poll_cancel_over_http(server, settings):
    headers = {"Authorization": f"Bearer {create_key(settings, 'http-tenant')}"}
    r = requests.post(
        f"{server}/jobs", json={"prompt": "Hello", "max_tokens": 8, "priority": 0}, headers=headers, timeout=5
    )
    assert r.status_code == 202 and r.headers["Location"] == f"/jobs/{r.json()['id']}"
    assert (
        requests.get(server + r.headers["Location"], headers=headers, timeout=5).json()["status"] == "queued"
    )
    cancel = requests.post(f"{server}{r.headers['Location']}/cancel", headers=headers, timeout=5)
    assert cancel.status_code == 200 and cancel.json()["status"] == "cancelled"
    big = requests.post(
        f"{server}/jobs",
        data=b"x" * (settings.max_body_bytes + 1),
        timeout=5,
        headers={**headers, "Content-Type": "application/json"},
    )
    assert big.status_code == 413 and big.json()["error"]["code"] == "request_entity_too_large"
