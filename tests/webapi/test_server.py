"""The contract commands as a user runs them: `flask --app webapi keys create`, and gunicorn serving the app."""

from __future__ import annotations

import collections
import os
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import BIN, ROOT, serve_api, settings_env


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


@pytest.fixture
def three_process_server(settings, database, tmp_path):
    """gunicorn with 3 sync worker processes, logging the pid of the process that answered each request.
    Its metrics directory holds counts of an earlier run, which gunicorn must drop when it starts."""
    access_log = tmp_path / "access.log"
    metrics_dir = tmp_path / "metrics"
    metrics_dir.mkdir()
    earlier_run = "from webapi.metrics import HTTP_REQUESTS; HTTP_REQUESTS.labels('GET', '/openapi.json', '200').inc(1000)"
    subprocess.run(
        [BIN / "python", "-c", earlier_run],
        cwd=ROOT,
        env={**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(metrics_dir)},
        check=True,
    )
    assert list(metrics_dir.glob("counter_*.db"))
    with serve_api(
        settings,
        workers=3,
        args=["--access-logfile", str(access_log), "--access-logformat", "%(p)s %(U)s"],
        env={"PROMETHEUS_MULTIPROC_DIR": str(metrics_dir)},
    ) as url:
        yield url, access_log


def answered_by(access_log, path: str) -> collections.Counter:
    """pid -> requests to `path` that process answered (gunicorn's access log, `%(p)s` is its pid)."""
    pids = collections.Counter()
    for line in access_log.read_text().splitlines():
        pid, _, url = line.partition(" ")
        if url == path:
            pids[pid.strip("<>")] += 1
    return pids


def scraped(url: str, sample: str, **labels) -> float:
    text = requests.get(f"{url}/metrics", timeout=5).text
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    return 0.0


def test_one_scrape_counts_the_requests_of_every_gunicorn_process(three_process_server):
    url, access_log = three_process_server
    sent = 0
    with ThreadPoolExecutor(6) as pool:  # concurrent requests keep several processes busy at once
        while len(answered_by(access_log, "/openapi.json")) < 3 and sent < 3000:
            statuses = list(
                pool.map(lambda _: requests.get(f"{url}/openapi.json", timeout=10).status_code, range(60))
            )
            assert statuses == [200] * 60
            sent += 60
    time.sleep(0.5)  # gunicorn writes its access log line after the answer
    by_process = answered_by(access_log, "/openapi.json")
    assert len(by_process) == 3 and sum(by_process.values()) == sent, by_process
    count = dict(sample="genq_http_requests_total", method="GET", endpoint="/openapi.json", status="200")
    for _ in range(3):  # whichever process answers the scrape, it shows every process's count
        assert scraped(url, **count) == sent
    assert scraped(url, "genq_http_request_duration_seconds_count", endpoint="/openapi.json") == sent

    # a worker process that dies takes nothing with it: what it counted stays in the sum
    os.kill(int(next(iter(by_process))), signal.SIGKILL)
    time.sleep(1)
    assert scraped(url, **count) == sent
