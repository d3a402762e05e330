"""The Redis priority emulation as configured: 0 is taken first, and Flower shows each priority's length."""

from __future__ import annotations

import subprocess
import time
import uuid

import pytest
import requests
from kombu import Exchange, Queue

from contract.dispatch import QUEUE, make_celery, send_job
from tests.conftest import BIN, ROOT, free_port, settings_env

PRIORITIES = [9, 5, 9, 0, 3, 0]  # in the order sent


@pytest.fixture()
def queued(settings, redis_client):
    """Messages for PRIORITIES sent to a fresh key prefix (no worker listens there)."""
    settings = settings.replace(redis_key_prefix=f"{settings.redis_key_prefix}prio-{uuid.uuid4().hex[:6]}:")
    app = make_celery(settings)
    ids = [uuid.uuid4() for _ in PRIORITIES]
    for job_id, priority in zip(ids, PRIORITIES, strict=True):
        send_job(app, job_id, priority)
    yield settings, app, ids
    app.close()


def test_priority_0_is_taken_first_then_fifo_within_a_priority(queued, redis_client):
    settings, app, ids = queued
    prefix = settings.redis_key_prefix
    assert redis_client.llen(f"{prefix}{QUEUE}") == 2  # priority 0 is the bare queue name
    assert redis_client.llen(f"{prefix}{QUEUE}:9") == 2 and redis_client.llen(f"{prefix}{QUEUE}:5") == 1
    with app.connection_for_read() as conn:
        queue = Queue(QUEUE, Exchange(QUEUE), routing_key=QUEUE)(conn.default_channel)
        taken = []
        while (message := queue.get(no_ack=True)) is not None:
            args, _kwargs, _embed = message.decode()  # Celery's message protocol 2
            taken.append(uuid.UUID(args[0]))
    order = sorted(range(len(ids)), key=lambda i: (PRIORITIES[i], i))
    assert taken == [ids[i] for i in order]


@pytest.mark.parametrize(
    "conf", [["--conf=workers/flowerconfig.py"], []], ids=["procfile", "contract-command"]
)
def test_flower_requires_a_login_and_shows_lengths_per_priority(queued, conf):
    """Both the Procfile's command and the plain contract command `celery -A workers flower`."""
    settings, _, _ = queued
    port = free_port()
    env = {**settings_env(settings), "FLOWER_PORT": str(port), "FLOWER_BASIC_AUTH": "ops:secret"}
    flower = subprocess.Popen(
        [BIN / "celery", "-A", "workers", "flower", *conf],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    url = f"http://127.0.0.1:{port}/api/queues/length"
    try:
        for _ in range(150):
            try:
                anonymous = requests.get(url, timeout=2)
                break
            except requests.ConnectionError:
                assert flower.poll() is None, flower.stderr.read()
                time.sleep(0.1)
        assert anonymous.status_code == 401
        lengths = requests.get(url, auth=("ops", "secret"), timeout=5).json()["active_queues"]
    finally:
        flower.terminate()
        flower.communicate(timeout=10)
    by_name = {q["name"]: q["messages"] for q in lengths}
    assert by_name[QUEUE] == len(PRIORITIES)
    assert {p: by_name[f"{QUEUE} priority {p}"] for p in range(10)} == {
        p: PRIORITIES.count(p) for p in range(10)
    }
