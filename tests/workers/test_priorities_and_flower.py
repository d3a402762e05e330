"""The Redis priority emulation as configured: 0 is taken first; Flower shows each priority's length, and each
job as one task that ended as the job did."""

from __future__ import annotations

import subprocess
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import requests
from kombu import Exchange, Queue
from sqlalchemy import text as sql

from contract.dispatch import QUEUE, make_celery, send_job
from tests.conftest import BIN, ROOT, free_port, settings_env
from tests.workers.conftest import worker_stack

AUTH = ("ops", "secret")

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


@contextmanager
def flower(settings, conf: list[str]) -> Iterator[str]:
    """`celery -A workers flower` on a free port, with a login; its URL once it answers."""
    port = free_port()
    env = {**settings_env(settings), "FLOWER_PORT": str(port), "FLOWER_BASIC_AUTH": ":".join(AUTH)}
    process = subprocess.Popen(
        [BIN / "celery", "-A", "workers", "flower", *conf],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(150):
            try:
                requests.get(url, timeout=2)
                break
            except requests.ConnectionError:
                assert process.poll() is None, process.stderr.read()
                time.sleep(0.1)
        yield url
    finally:
        process.terminate()
        process.communicate(timeout=10)


@pytest.mark.parametrize(
    "conf", [["--conf=workers/flowerconfig.py"], []], ids=["procfile", "contract-command"]
)
def test_flower_requires_a_login_and_shows_lengths_per_priority(queued, conf):
    """Both the Procfile's command and the plain contract command `celery -A workers flower`."""
    settings, _, _ = queued
    with flower(settings, conf) as url:
        assert requests.get(f"{url}/api/queues/length", timeout=5).status_code == 401
        lengths = requests.get(f"{url}/api/queues/length", auth=AUTH, timeout=5).json()["active_queues"]
    by_name = {q["name"]: q["messages"] for q in lengths}
    assert by_name[QUEUE] == len(PRIORITIES)
    assert {p: by_name[f"{QUEUE} priority {p}"] for p in range(10)} == {
        p: PRIORITIES.count(p) for p in range(10)
    }


def until(condition, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while not (found := condition()):
        assert time.monotonic() < deadline, what
        time.sleep(0.2)
    return found


def worker_view(url: str, node: str) -> dict | None:
    """Flower's worker page's row of `node` (its counts of task events, and the worker's heartbeat fields)."""
    views = requests.get(f"{url}/workers?json=1", auth=AUTH, timeout=5).json()["data"]
    return next((view for view in views if view.get("hostname") == node), None)


def test_flower_shows_each_job_as_one_task_ended_as_the_job_ended(settings, sessions, new_key, tmp_path):
    """A worker and Flower, a handful of jobs: Flower's task list holds each job once (its id the job's), in
    the state the job ended in (succeeded, failed, cancelled: SUCCESS, FAILURE, REVOKED); its worker views
    count them so, and list nothing active once the worker is idle."""
    with (
        worker_stack(settings, new_key, tmp_path, max_num_seqs=4) as stack,
        flower(stack.settings, []) as url,
    ):
        # Flower hears the worker's heartbeats (its event receiver runs), and the worker sends task events
        until(lambda: worker_view(url, stack.node), 30, "Flower saw no heartbeat of the worker")
        stack.celery.control.enable_events(reply=True, destination=[stack.node])
        succeeded = [stack.submit(prompt=f"job {i}", max_tokens=4) for i in range(4)]
        # a job whose row is made invalid behind the API's back while the intake is paused: it fails
        paused = stack.celery.control.cancel_consumer(
            QUEUE, reply=True, destination=[stack.node], timeout=10, limit=1
        )
        assert paused, "the worker did not confirm its intake's pause"
        failed = stack.submit(prompt="broken", max_tokens=4)
        with sessions.begin() as s:
            s.execute(sql("UPDATE jobs SET temperature = 'NaN' WHERE id = :id"), {"id": uuid.UUID(failed)})
        stack.celery.control.add_consumer(QUEUE, reply=True, destination=[stack.node])
        cancelled = stack.submit(prompt="A long story", max_tokens=1500, temperature=0.0, ignore_eos=True)
        stack.wait(cancelled, until=lambda j: j["status"] == "running")
        stack.client.post(f"/jobs/{cancelled}/cancel", headers=stack.headers)
        ended = {job_id: stack.wait(job_id)["status"] for job_id in [*succeeded, failed, cancelled]}
        assert ended == {**dict.fromkeys(succeeded, "succeeded"), failed: "failed", cancelled: "cancelled"}

        want = {**dict.fromkeys(succeeded, "SUCCESS"), failed: "FAILURE", cancelled: "REVOKED"}

        def tasks():
            found = requests.get(f"{url}/api/tasks", auth=AUTH, timeout=5).json()
            states = {task_id: task["state"] for task_id, task in found.items()}
            return found if states == want else None

        try:
            found = until(tasks, 30, "Flower's tasks are not the jobs")
        except AssertionError:
            raise AssertionError(requests.get(f"{url}/api/tasks", auth=AUTH, timeout=5).json()) from None
        assert {task["name"] for task in found.values()} == {"generate"}
        assert {task["worker"] for task in found.values()} == {stack.node}

        inspected = requests.get(
            f"{url}/api/workers", params={"refresh": 1, "workername": stack.node}, auth=AUTH, timeout=10
        ).json()[stack.node]
        assert inspected["active"] == [], inspected  # `celery inspect active`: nothing on an idle worker
        assert [q["name"] for q in inspected["active_queues"]] == [QUEUE], inspected

        view = until(
            lambda: (v := worker_view(url, stack.node)) and v.get("task-succeeded") == 4 and v,
            10,
            f"Flower's worker view did not count the jobs: {worker_view(url, stack.node)}",
        )
        assert not view["active"], view  # the heartbeat's count of tasks running in Celery's pool: none
        assert (view["task-received"], view["task-failed"], view.get("task-retried", 0)) == (6, 1, 0), view
