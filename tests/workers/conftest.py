"""A real worker (`celery -A workers worker --pool threads ... -Q generate`) in a subprocess, with the API
in front of it. Each stack has its own Redis key prefix, so its worker sees only its own messages."""

from __future__ import annotations

import collections
import dataclasses
import os
import signal
import socket
import subprocess
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path

import openai
import pytest
import requests
from celery import Celery
from prometheus_client.parser import text_string_to_metric_families

from contract.dispatch import make_celery
from contract.settings import Settings
from tests.conftest import ROOT, free_port, serve_api, settings_env, worker_command
from workers.outcomes import Outcome

FINISHED = ("succeeded", "failed", "cancelled")


@dataclasses.dataclass
class Stack:
    settings: Settings
    client: object  # Flask test client of an app sending to this stack's queue
    headers: dict[str, str]
    celery: Celery
    log: Path
    node: str  # the worker's Celery node name, e.g. w8-1a2b3c@host
    metrics_url: str  # the worker's own Prometheus metrics (WORKER_METRICS_PORT)

    def submit(self, **body) -> str:
        r = self.client.post("/jobs", json=body, headers=self.headers)
        assert r.status_code == 202, r.json
        return r.json["id"]

    def job(self, job_id: str) -> dict:
        return self.client.get(f"/jobs/{job_id}", headers=self.headers).json

    def wait(self, job_id: str, until=lambda job: job["status"] in FINISHED, timeout: float = 120) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            job = self.job(job_id)
            if until(job):
                return job
            time.sleep(0.05)
        raise AssertionError(
            f"job {job_id} still {job['status']} after {timeout}s; worker log:\n{self.log_text()}"
        )

    def engine_stats(self) -> dict:
        replies = self.celery.control.broadcast("engine_stats", reply=True, timeout=5, limit=1)
        assert len(replies) == 1, replies
        return next(iter(replies[0].values()))

    def log_text(self) -> str:
        return self.log.read_text()[-5000:]

    def outcomes(self) -> collections.Counter:
        """How the worker's holds on jobs ended so far: workers.outcomes.Outcome value -> count (all
        priorities), from its genq_worker_jobs_total counter."""
        counts = collections.Counter()
        for family in text_string_to_metric_families(requests.get(self.metrics_url, timeout=5).text):
            for sample in family.samples:
                if sample.name == "genq_worker_jobs_total":
                    counts[Outcome(sample.labels["outcome"])] += int(sample.value)
        return counts


@contextmanager
def worker_stack(
    settings: Settings,
    new_key,
    log_dir: Path,
    *,
    max_num_seqs: int,
    reserve: int | None = None,
    concurrency: int = 2,
) -> Iterator[Stack]:
    """A worker whose engine runs `max_num_seqs` sequences and holds `reserve` jobs more; `concurrency` is
    its Celery pool's threads (`--concurrency`: no job runs in them, the worker's intake takes jobs)."""
    from webapi import create_app

    name = f"w{max_num_seqs}-{uuid.uuid4().hex[:6]}"
    settings = settings.replace(
        redis_key_prefix=f"{settings.redis_key_prefix}{name}:",
        max_num_seqs=max_num_seqs,
        worker_reserve=reserve,
    )
    log = log_dir / f"{name}.log"
    metrics_port = int(os.environ.get("WORKER_METRICS_PORT") or free_port())
    with log.open("w") as out:
        worker = subprocess.Popen(
            worker_command(f"{name}@%h", concurrency),
            cwd=ROOT,
            env={**settings_env(settings), "WORKER_METRICS_PORT": str(metrics_port)},
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    app = create_app(settings)
    celery = make_celery(settings)
    try:
        deadline = time.monotonic() + 180
        while " ready." not in log.read_text():
            assert worker.poll() is None, f"worker exited:\n{log.read_text()}"
            assert time.monotonic() < deadline, f"worker not ready:\n{log.read_text()}"
            time.sleep(0.2)
        headers = {"Authorization": f"Bearer {new_key()}"}
        node = f"{name}@{socket.gethostname()}"
        metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
        yield Stack(settings, app.test_client(), headers, celery, log, node, metrics_url)
    finally:
        worker.send_signal(signal.SIGQUIT)  # cold shutdown: do not wait for jobs left running
        try:
            worker.wait(timeout=20)
        except subprocess.TimeoutExpired:
            worker.kill()
            worker.wait()
        app.extensions["genq"].close()
        celery.close()


@pytest.fixture(scope="session")
def wide(settings, new_key, tmp_path_factory, redis_client) -> Iterator[Stack]:
    """A worker running 8 sequences at once (engine max_num_seqs 8) and holding 2 more."""
    with worker_stack(settings, new_key, tmp_path_factory.mktemp("workers"), max_num_seqs=8) as stack:
        yield stack


@pytest.fixture(scope="session")
def narrow(settings, new_key, tmp_path_factory, redis_client) -> Iterator[Stack]:
    """A worker holding one job at a time: the rest wait in Redis, in priority order."""
    with worker_stack(
        settings, new_key, tmp_path_factory.mktemp("workers"), max_num_seqs=1, reserve=0
    ) as stack:
        yield stack


@pytest.fixture(scope="session")
def offline_engine(settings):
    """The same engine the worker runs, used offline (Engine.generate) for the expected outputs."""
    from batching import Engine, EngineConfig

    return Engine(EngineConfig(**settings.engine_options()))


@pytest.fixture(scope="module")
def api_url(wide) -> Iterator[str]:
    """gunicorn serving the app that sends to the `wide` worker's queue (its settings, its Redis prefix)."""
    with serve_api(wide.settings) as url:
        yield url


@pytest.fixture(scope="module")
def openai_client(wide, api_url) -> Iterator[openai.OpenAI]:
    """The official `openai` client against `api_url`, with the `wide` stack's key (no retries: a 429 or 5xx
    fails the test). Named apart from the Flask test client `client` (tests/conftest.py)."""
    with openai.OpenAI(
        base_url=f"{api_url}/v1", api_key=wide.headers["Authorization"].split()[1], max_retries=0, timeout=120
    ) as client:
        yield client


def timed(items) -> list[tuple[float, object]]:
    """Each item of a stream with the time.monotonic() at which the caller got it."""
    return [(time.monotonic(), item) for item in items]


def generation_seconds(url: str, headers: dict, job_id: str) -> float:
    """How long the worker took to make an ended job's tokens: its first token to its end, as the worker
    recorded them. Measured by the worker itself, so a loaded machine slows it as it slows the stream."""
    # The stream's last piece can come before the worker has written the job's end to Postgres: wait for it.
    deadline = time.monotonic() + 30
    while True:
        job = requests.get(f"{url}/jobs/{job_id}", headers=headers, timeout=30).json()
        if (job.get("first_token_at") and job.get("finished_at")) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert job.get("first_token_at") and job.get("finished_at"), (
        f"job {job_id} has no recorded end in 30 s: {job}"
    )
    first, finished = (
        datetime.fromisoformat(job[k].replace("Z", "+00:00")) for k in ("first_token_at", "finished_at")
    )
    return (finished - first).total_seconds()


def assert_streamed_as_made(started: float, arrivals: list[float], generation_s: float) -> None:
    """The pieces of a stream came as the worker made them, not held back and sent together at the end.

    `started`: when the call was made; `arrivals`: when each piece of text came; `generation_s`: the worker's
    time from the job's first token to its end (`generation_seconds`). The first piece must come before half
    the call's time has gone, and the pieces must be spread over at least a quarter of the worker's time (room for the hops of a loaded 2-core machine). A worker
    that held a job's deltas until its end fails both: its first piece comes with its last."""
    first, last = arrivals[0] - started, arrivals[-1] - started
    assert first < last / 2, f"first piece at {first:.3f} s of {last:.3f} s: not sent as made"
    assert last - first > generation_s / 4, (
        f"{len(arrivals)} pieces within {last - first:.3f} s, the worker made them in {generation_s:.3f} s: a burst"
    )
