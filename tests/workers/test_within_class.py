"""Within a priority class, through a real worker (issue 44): under SCHEDULING_POLICY=predicted a job predicted
short overtakes a long one sent before it, both where jobs wait in Redis (the intake's window,
workers/queue_order.py) and where they wait in the engine (the worker gives the engine each job's created_at and
prediction: AddRequest's arrival_time and predicted_output_tokens); under fcfs they keep their order. A worker
restarted while jobs wait takes them in the order their rows give, as the one before it would have."""

from __future__ import annotations

import dataclasses
import signal
import subprocess
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from contract.dispatch import make_celery
from contract.settings import Settings
from jobstore import jobs
from tests.conftest import ROOT, free_port, settings_env, worker_command
from tests.workers.conftest import Stack

LONG = {"prompt": "A long story", "temperature": 0.0, "ignore_eos": True}  # runs to max_tokens


def finished(job: dict) -> datetime:
    return datetime.fromisoformat(job["finished_at"])


@contextmanager
def worker(settings: Settings, log: Path, metrics_port: int = 0) -> Iterator[subprocess.Popen]:
    """A worker for `settings`, ready; stopped with a warm shutdown (SIGTERM: held jobs handed back). It serves
    its metrics on `metrics_port` (0: none)."""
    with workers(settings, log, metrics_port=metrics_port) as (process,):
        yield process


@contextmanager
def workers(settings: Settings, *logs: Path, metrics_port: int = 0) -> Iterator[list[subprocess.Popen]]:
    """A worker for `settings` per log, started side by side and all ready (a start is mostly CPU: loading
    torch and the model, 15-30 s each on a busy 2-core machine); stopped side by side the same way."""
    started = []
    try:
        for log in logs:
            offset = log.stat().st_size if log.exists() else 0
            with log.open("a") as out:
                process = subprocess.Popen(
                    worker_command(f"wc-{uuid.uuid4().hex[:6]}@%h", 2),
                    cwd=ROOT,
                    env={**settings_env(settings), "WORKER_METRICS_PORT": str(metrics_port)},
                    stdout=out,
                    stderr=subprocess.STDOUT,
                )
            started.append((process, log, offset))
        deadline = time.monotonic() + 180
        for process, log, offset in started:
            while " ready." not in log.read_text()[offset:]:
                assert process.poll() is None, f"worker exited:\n{log.read_text()[-5000:]}"
                assert time.monotonic() < deadline, f"worker not ready:\n{log.read_text()[-5000:]}"
                time.sleep(0.2)
        yield [process for process, _, _ in started]
    finally:
        for process, _, _ in started:
            process.send_signal(signal.SIGTERM)
        for process, _, _ in started:
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


@contextmanager
def api(settings: Settings, new_key, log: Path, policy: str, max_num_seqs: int, reserve: int):
    """The settings of a stack of its own (a Redis key prefix: its own queue) and a client of its API."""
    from webapi import create_app

    settings = settings.replace(
        redis_key_prefix=f"{settings.redis_key_prefix}wc-{uuid.uuid4().hex[:6]}:",
        max_num_seqs=max_num_seqs,
        worker_reserve=reserve,
        scheduling_policy=policy,
    )
    app, celery = create_app(settings), make_celery(settings)
    headers = {"Authorization": f"Bearer {new_key()}"}
    try:
        yield Stack(settings, app.test_client(), headers, celery, log, "", "")
    finally:
        app.extensions["genq"].close()
        celery.close()


@pytest.mark.parametrize("policy", ["predicted", "fcfs"])
def test_short_jobs_waiting_in_redis_overtake_a_long_one_sent_before_them(
    policy, settings, new_key, sessions, redis_client, tmp_path
):
    """A worker holding one job (the rest wait in Redis). Behind a running job, a long job is sent, then three
    short ones of the same priority: under predicted the intake takes the short ones first; under fcfs the long
    one first."""
    log = tmp_path / "worker.log"
    with api(settings, new_key, log, policy, max_num_seqs=1, reserve=0) as stack, worker(stack.settings, log):
        # 1,500 tokens: 300 took 0.53 s at 1.7 ms a step, ending before the four jobs behind it were sent
        blocker = stack.submit(**LONG, max_tokens=1500)
        stack.wait(blocker, until=lambda j: j["status"] == "running" and j["output"]["token_ids"])
        long = stack.submit(**LONG, max_tokens=200)
        shorts = [stack.submit(**LONG, max_tokens=4) for _ in range(3)]
        assert stack.job(blocker)["status"] == "running", (
            "the blocker ended before the jobs behind it were sent"
        )
        done = {job_id: stack.wait(job_id) for job_id in [blocker, long, *shorts]}
    assert all(job["status"] == "succeeded" for job in done.values()), done
    ends = {job_id: finished(job) for job_id, job in done.items()}
    if policy == "predicted":
        assert max(ends[s] for s in shorts) < ends[long], ends
    else:
        assert ends[long] < min(ends[s] for s in shorts), ends


@pytest.mark.parametrize("policy", ["predicted", "fcfs"])
def test_in_the_engine_a_job_its_tenants_history_predicts_short_goes_first(
    policy, settings, new_key, sessions, redis_client, tmp_path
):
    """A worker running one sequence and holding three more, which wait in its engine. Tenant Y's jobs made 2
    tokens each so far; behind a running job, tenant X sends a job of 100 tokens, then Y one of max_tokens 200
    (it makes 200). Under predicted the engine starts Y's first: its prediction (2 tokens) reached the engine;
    with max_tokens alone, or under fcfs, X's goes first."""
    log = tmp_path / "worker.log"
    with api(settings, new_key, log, policy, max_num_seqs=1, reserve=3) as stack, worker(stack.settings, log):
        y = dataclasses.replace(stack, headers={"Authorization": f"Bearer {new_key()}"})  # another tenant
        history = [y.submit(**LONG, max_tokens=2) for _ in range(3)]
        for job_id in history:
            y.wait(job_id)
        blocker = stack.submit(**LONG, max_tokens=1500)  # as above: long enough to outlast the sends
        stack.wait(blocker, until=lambda j: j["status"] == "running" and j["output"]["token_ids"])
        x_job = stack.submit(**LONG, max_tokens=100)
        y_job = y.submit(**LONG, max_tokens=200)
        y.wait(y_job, until=lambda j: j["status"] == "running")  # held: both wait in the engine
        assert stack.job(blocker)["status"] == "running", (
            "the blocker ended before the jobs behind it were held"
        )
        x_done, y_done = stack.wait(x_job), y.wait(y_job)
    assert x_done["status"] == y_done["status"] == "succeeded"
    assert len(y_done["output"]["token_ids"]) == 200
    if policy == "predicted":
        assert finished(y_done) < finished(x_done)
    else:
        assert finished(x_done) < finished(y_done)


def test_a_restarted_worker_takes_the_waiting_jobs_in_the_order_of_their_rows(
    settings, new_key, sessions, redis_client, tmp_path
):
    """A worker holding one job is restarted (warm shutdown: its running job is handed back to the head of
    the queue with its tokens) while a long job and two short ones wait behind it. The new worker takes them
    by the places their rows give (creation + predicted cost, at most 30 s later): the short ones, then the
    handed-back job (created first), then the long one, as the first worker would have taken the waiting ones."""
    log = tmp_path / "worker.log"
    with api(settings, new_key, log, "predicted", max_num_seqs=1, reserve=0) as stack:
        with worker(stack.settings, log):
            # 2,000 tokens (the model's context: 2,048): a fast CPU runs 300 in a quarter of a second, before
            # the wait below sees it running
            blocker = stack.submit(**LONG, max_tokens=2000)
            stack.wait(blocker, until=lambda j: j["status"] == "running" and j["output"]["token_ids"])
            long = stack.submit(**LONG, max_tokens=2000)  # as long as the blocker: it goes after it
            shorts = [stack.submit(**LONG, max_tokens=4) for _ in range(2)]
        assert stack.job(blocker)["status"] == "queued", "the blocker was not handed back at the restart"
        with worker(stack.settings, log):
            done = {job_id: stack.wait(job_id) for job_id in [blocker, long, *shorts]}
    assert all(job["status"] == "succeeded" for job in done.values()), done
    order = sorted(done, key=lambda job_id: finished(done[job_id]))
    assert order == [*shorts, blocker, long], order
    with sessions.begin() as s:
        row = jobs.get_job(s, uuid.UUID(blocker))
    assert row.attempts == 2 and len(row.output_token_ids) == 2000  # resumed after the restart


def test_the_worker_counts_the_deadlines_of_the_jobs_it_ends(
    settings, new_key, sessions, redis_client, tmp_path
):
    """genq_job_deadlines_total{model,outcome}: a job that ends by its deadline is met; one that waits behind a
    running job past its deadline is missed (it still runs: a deadline reorders jobs, it cancels none), as their
    deadline_status says. A job without a deadline is not counted."""
    log, port = tmp_path / "worker.log", free_port()
    with (
        api(settings, new_key, log, "predicted", max_num_seqs=1, reserve=0) as stack,
        worker(stack.settings, log, metrics_port=port),
    ):
        # 2,000 tokens take the width-1 engine seconds (a step is a millisecond or more), the late job's
        # deadline half a second: it cannot start before it (with 400 tokens, a quiet machine met it)
        blocker = stack.submit(**LONG, max_tokens=2000)
        stack.wait(blocker, until=lambda j: j["status"] == "running" and j["output"]["token_ids"])
        now = datetime.now(timezone.utc)
        late = stack.submit(**LONG, max_tokens=4, deadline=(now + timedelta(seconds=0.5)).isoformat())
        on_time = stack.submit(**LONG, max_tokens=4, deadline=(now + timedelta(seconds=600)).isoformat())
        done = [stack.wait(job_id) for job_id in (blocker, late, on_time)]
        text = requests.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    assert [job["status"] for job in done] == ["succeeded"] * 3
    assert [job["deadline_status"] for job in done] == [None, "missed", "met"]
    counted = {
        (sample.labels["model"], sample.labels["outcome"]): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "genq_job_deadlines_total"
    }
    assert counted == {
        (stack.settings.served_model_name(), "missed"): 1,
        (stack.settings.served_model_name(), "met"): 1,
    }
