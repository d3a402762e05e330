"""Prometheus metrics of the API and of a real worker (`--pool threads`), scraped over HTTP while it runs."""

from __future__ import annotations

import logging
import socket
import threading
import time
from types import SimpleNamespace

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from tests.workers.conftest import worker_stack
from workers import metrics as worker_metrics
from workers.outcomes import Outcome


def parse(text: str) -> dict:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(scraped: dict, name: str, **labels) -> float:
    return scraped.get((name, tuple(sorted(labels.items()))), 0.0)


@pytest.fixture(scope="module")
def metered(settings, new_key, tmp_path_factory, redis_client):
    """A worker with a small KV pool (20 blocks of 16 tokens, 40 host blocks) serving metrics on its own port."""
    small = settings.replace(block_size=16, num_device_blocks=20, num_host_blocks=40, max_model_len=256)
    with worker_stack(small, new_key, tmp_path_factory.mktemp("metered"), max_num_seqs=2) as stack:
        yield stack


def scrape_worker(stack) -> dict:
    """The worker's samples by their labels besides `model`, which every one of them carries: the name of the
    model the worker serves (one value a worker, workers/metrics.py)."""
    scraped = parse(requests.get(stack.metrics_url, timeout=5).text)
    model = ("model", stack.settings.served_model_name())
    unlabelled = [key for key in scraped if model not in key[1]]
    assert not unlabelled, unlabelled[:5]
    return {
        (name, tuple(label for label in labels if label != model)): v for (name, labels), v in scraped.items()
    }


def scrape_api(stack) -> dict:
    r = stack.client.get("/metrics")
    assert r.status_code == 200
    return parse(r.text)


def test_worker_metrics_count_jobs_tokens_and_a_preemption(metered):
    before_w, before_api = scrape_worker(metered), scrape_api(metered)
    seen = {"running": 0.0, "kv": 0.0}
    stop = threading.Event()

    def sample():  # the worker's endpoint answers while jobs run
        while not stop.is_set():
            now = scrape_worker(metered)
            seen["running"] = max(seen["running"], value(now, "genq_engine_running_sequences"))
            seen["kv"] = max(seen["kv"], value(now, "genq_engine_device_kv_usage"))
            time.sleep(0.05)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        # two 160-token prompts fill the 320-token pool: at the first new block a decode needs, the bulk
        # job is preempted and swapped out while the urgent one goes on
        bulk = metered.submit(
            input_ids=[(7 * i) % 200 + 3 for i in range(160)], max_tokens=80, priority=9, temperature=0.0
        )
        # the urgent job is sent once the bulk one runs in the engine: had both waited there at once, the urgent
        # one would start first and the bulk one wait for its blocks, preempting nothing (seen on a loaded machine)
        # (read from the worker's metrics, an HTTP get: the engine's stats, a Celery broadcast round trip, were
        # once slower than the bulk job's 80 tokens on a fast CPU)
        deadline = time.monotonic() + 30
        while not value(scrape_worker(metered), "genq_engine_running_sequences"):
            assert time.monotonic() < deadline, metered.job(bulk)
            time.sleep(0.01)
        urgent = metered.submit(
            input_ids=[(11 * i) % 200 + 3 for i in range(160)], max_tokens=80, priority=0, temperature=0.0
        )
        jobs = {9: metered.wait(bulk), 0: metered.wait(urgent)}
    finally:
        stop.set()
        sampler.join()
    after_w, after_api = scrape_worker(metered), scrape_api(metered)
    stats = metered.engine_stats()

    def delta(name, **labels):
        return value(after_w, name, **labels) - value(before_w, name, **labels)

    for priority, job in jobs.items():
        p = str(priority)
        assert job["status"] == "succeeded"
        assert delta("genq_worker_jobs_total", priority=p, outcome="succeeded") == 1
        assert delta("genq_job_latency_seconds_count", priority=p) == 1
        assert delta("genq_job_ttft_seconds_count", priority=p) == 1
        assert (
            delta("genq_job_time_between_tokens_seconds_count", priority=p)
            == job["usage"]["completion_tokens"] - 1
        )
        assert (
            value(after_api, "genq_jobs_submitted_total", priority=p)
            - value(before_api, "genq_jobs_submitted_total", priority=p)
            == 1
        )
    assert delta("genq_engine_generated_tokens_total") == sum(
        j["usage"]["completion_tokens"] for j in jobs.values()
    )
    # the worker's counters are the engine's own, and the preemption happened
    assert stats["num_preemptions"] >= 1 and stats["num_blocks_swapped_out"] >= 1
    for name, key in (
        ("genq_engine_preemptions_total", "num_preemptions"),
        ("genq_engine_swapped_out_blocks_total", "num_blocks_swapped_out"),
        ("genq_engine_swapped_in_blocks_total", "num_blocks_swapped_in"),
        ("genq_engine_recomputed_tokens_total", "num_recomputed_tokens"),
        ("genq_engine_steps_total", "num_steps"),
    ):
        assert value(after_w, name) == stats[key], name
    assert value(after_w, "genq_engine_step_seconds_count") == stats["num_steps"]
    # gauges moved during the run and are back to idle after it
    assert seen["running"] >= 1 and seen["kv"] > 0
    assert value(after_w, "genq_engine_running_sequences") == 0
    assert value(after_w, "genq_engine_swapped_sequences") == 0
    assert value(after_w, "genq_engine_device_kv_usage") == 0
    # which attention path the engine runs: the C++ kernels on this CPU, not the slower fallback
    assert value(after_w, "genq_engine_attention_path", path="cpu_kernel") == 1
    assert value(after_w, "genq_engine_attention_path", path="torch") == 0


def test_prefix_cache_metrics_count_a_shared_prompt(metered):
    """The second job with the same 64-token prompt reuses the KV of its first 3 blocks of 16."""
    before = scrape_worker(metered)
    prompt = [(13 * i) % 200 + 3 for i in range(64)]
    for _ in range(2):
        job = metered.wait(metered.submit(input_ids=prompt, max_tokens=4, priority=3, temperature=0.0))
        assert job["status"] == "succeeded"
    after = scrape_worker(metered)
    stats = metered.engine_stats()
    assert (
        value(after, "genq_engine_prefix_cache_hit_tokens_total")
        - value(before, "genq_engine_prefix_cache_hit_tokens_total")
        == 48
    )
    assert (
        value(after, "genq_engine_prefix_cache_queried_tokens_total")
        - value(before, "genq_engine_prefix_cache_queried_tokens_total")
        == 128
    )
    for name, key in (
        ("genq_engine_prefix_cache_hit_tokens_total", "num_prefix_cache_hit_tokens"),
        ("genq_engine_prefix_cache_queried_tokens_total", "num_prefix_cache_queried_tokens"),
        ("genq_engine_prefix_cache_evictions_total", "num_prefix_cache_evictions"),
        ("genq_engine_prefix_cache_hit_rate", "prefix_cache_hit_rate"),
        ("genq_engine_prefix_cache_device_blocks", "num_cached_device_blocks"),
        ("genq_engine_prefix_cache_host_blocks", "num_cached_host_blocks"),
        ("genq_engine_prefix_cache_offloaded_blocks_total", "num_prefix_cache_offloaded_blocks"),
        ("genq_engine_prefix_cache_host_hit_tokens_total", "num_prefix_cache_host_hit_tokens"),
    ):
        assert value(after, name) == pytest.approx(stats[key]), name
    assert value(after, "genq_engine_prefix_cache_device_blocks") >= 4


def test_cancelling_a_running_job_counts_as_stopped(metered):
    before = scrape_worker(metered)
    job_id = metered.submit(prompt="cancel me", max_tokens=240, priority=4, temperature=0.0)
    metered.wait(job_id, until=lambda j: j["status"] == "running")
    assert metered.client.post(f"/jobs/{job_id}/cancel", headers=metered.headers).status_code == 200
    deadline = time.monotonic() + 30
    while (
        value(scrape_worker(metered), "genq_worker_jobs_total", priority="4", outcome="stopped")
        - value(before, "genq_worker_jobs_total", priority="4", outcome="stopped")
        != 1
    ):
        assert time.monotonic() < deadline, metered.log_text()
        time.sleep(0.05)


def test_api_queue_depth_jobs_by_priority_and_cancellations(client, auth):
    """No worker listens on this app's queue: submitted jobs wait in Redis, at their priority."""
    headers = auth()
    before = parse(client.get("/metrics").text)
    ids = [
        client.post("/jobs", json={"prompt": "wait", "max_tokens": 2, "priority": 3}, headers=headers).json[
            "id"
        ]
        for _ in range(3)
    ]
    queued = parse(client.get("/metrics").text)
    for name, labels in (
        ("genq_queue_depth", {"model": "tiny-llama", "priority": "3"}),  # the default model's lists
        ("genq_jobs_by_priority", {"status": "queued", "priority": "3"}),
        ("genq_jobs", {"status": "queued"}),
    ):
        assert value(queued, name, **labels) - value(before, name, **labels) == 3, name
    for job_id in ids:
        assert client.post(f"/jobs/{job_id}/cancel", headers=headers).status_code == 200
    after = parse(client.get("/metrics").text)
    assert (
        value(after, "genq_jobs_cancelled_total", priority="3")
        - value(before, "genq_jobs_cancelled_total", priority="3")
        == 3
    )
    assert value(after, "genq_jobs_by_priority", status="queued", priority="3") == value(
        before, "genq_jobs_by_priority", status="queued", priority="3"
    )


def test_failed_jobs_are_counted_by_code():
    job = SimpleNamespace(
        priority=6,
        created_at=worker_metrics.datetime.now(worker_metrics.timezone.utc),
        output_token_ids=[],
        deadline=None,
    )
    counter = worker_metrics.FAILURES.labels("6", "engine_error")
    before = counter._value.get()
    worker_metrics.job_done(job, None, Outcome.FAILED, error_code="engine_error")
    assert counter._value.get() == before + 1


def test_metrics_port_in_use_is_logged_clearly(caplog):
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with caplog.at_level(logging.ERROR, logger="workers.metrics"):
            assert worker_metrics.start_server(port) is None
    assert f"port {port} is unavailable" in caplog.text and "WORKER_METRICS_PORT" in caplog.text
