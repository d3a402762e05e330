"""LOG_FORMAT=json (contract/log_setup.py) on a real gunicorn API, a real Celery worker and beat: every line they log
is a JSON object, the API's lines about a request carry its request id (the caller's X-Request-ID, echoed), its
tenant and the job it made, and the worker's lines about that job carry the job's id and tenant."""

from __future__ import annotations

import json
import re
import uuid
from pathlib import Path

import pytest
import requests
from sqlalchemy import select

from jobstore.keys import create_key
from jobstore.models import Job
from tests.conftest import BIN, free_port, settings_env, worker_command
from tests.deployment.test_sentinel_failover import process


def json_lines(path: Path) -> list[dict]:
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    assert lines, f"nothing logged in {path.name}"
    parsed = []
    for line in lines:
        try:
            parsed.append(json.loads(line))
        except json.JSONDecodeError:
            raise AssertionError(f"{path.name}: not a JSON line: {line!r}") from None
    return parsed


@pytest.mark.slow  # about a minute on 2 busy cores: three processes start
def test_api_and_worker_log_json_lines_with_request_job_and_tenant(settings, database, sessions, tmp_path):
    stack = settings.replace(redis_key_prefix=f"{settings.redis_key_prefix}json-{uuid.uuid4().hex[:6]}:")
    env = settings_env(stack) | {"LOG_FORMAT": "json", "PYTHONWARNINGS": "ignore"}
    tenant_name = f"json-{uuid.uuid4().hex[:8]}"
    with sessions.begin() as session:
        headers = {"Authorization": f"Bearer {create_key(session, tenant_name)}"}
    port = free_port()
    api = [BIN / "gunicorn", "--bind", f"127.0.0.1:{port}", "--workers", "1", "webapi:create_app()"]
    url = f"http://127.0.0.1:{port}"
    request_id = f"client-{uuid.uuid4().hex}"
    beat = [BIN / "celery", "-A", "workers", "beat", "--loglevel", "INFO", "-s", str(tmp_path / "schedule")]
    worker = worker_command(f"json-{uuid.uuid4().hex[:6]}@%h", 1)  # its banner goes to stdout, not a log line
    with (
        process(worker, env, tmp_path / "worker.log", ready=" ready.", stdout=tmp_path / "banner.txt"),
        process(api, env, tmp_path / "api.log", ready="Booting worker", stdout=tmp_path / "api.out"),
        process(beat, env, tmp_path / "beat.log", ready="beat: Starting", stdout=tmp_path / "beat.out"),
    ):
        for _ in range(100):
            try:
                if requests.get(f"{url}/readyz", timeout=5).ok:
                    break
            except requests.ConnectionError:
                pass
        r = requests.post(
            f"{url}/jobs",
            json={"prompt": "Once upon", "max_tokens": 8},
            headers=headers | {"X-Request-ID": request_id},
            timeout=10,
        )
        assert r.status_code == 202, r.text
        assert r.headers["X-Request-ID"] == request_id
        job_id = r.json()["id"]
        done = requests.get(f"{url}/jobs/{job_id}?wait=60", headers=headers, timeout=70)
        assert done.json()["status"] == "succeeded", done.text
        assert re.fullmatch(r"[0-9a-f]{32}", done.headers["X-Request-ID"])  # made up when not sent
        nonsense = requests.get(f"{url}/livez", headers={"X-Request-ID": "x" * 500}, timeout=10)
        assert re.fullmatch(r"[0-9a-f]{32}", nonsense.headers["X-Request-ID"])
    with sessions() as session:
        tenant = str(session.execute(select(Job.tenant_id).where(Job.id == uuid.UUID(job_id))).scalar_one())

    api_lines = json_lines(tmp_path / "api.log")
    assert {line["service"] for line in api_lines} == {"api"}
    posted = [line for line in api_lines if line.get("request_id") == request_id]
    assert posted and all(line["job_id"] == job_id and line["tenant"] == tenant for line in posted), posted
    assert any(line.get("method") == "POST" and line.get("status") == 202 for line in posted), posted
    waited = [line for line in api_lines if line.get("path") == f"/jobs/{job_id}"]
    assert (
        waited and waited[0]["job_id"] == job_id and waited[0]["request_id"] == done.headers["X-Request-ID"]
    )

    beat_lines = json_lines(tmp_path / "beat.log")
    assert {line["service"] for line in beat_lines} == {"beat"}
    assert any(line["logger"] == "workers.startup" for line in beat_lines)  # its start-up check, logged too

    worker_lines = json_lines(tmp_path / "worker.log")
    about_job = [line for line in worker_lines if line.get("job_id") == job_id]
    messages = " | ".join(line["message"] for line in about_job)
    assert "claimed" in messages and "succeeded" in messages, messages
    assert all(line["tenant"] == tenant and line["service"] == "worker" for line in about_job)
    assert all(job_id in line["message"] for line in about_job)  # no line names another job under its id


def test_a_request_id_is_echoed_in_text_mode_too(client):
    sent = client.get("/livez", headers={"X-Request-ID": "abc-123"})
    assert sent.headers["X-Request-ID"] == "abc-123"
    made = client.get("/livez")
    assert re.fullmatch(r"[0-9a-f]{32}", made.headers["X-Request-ID"])
