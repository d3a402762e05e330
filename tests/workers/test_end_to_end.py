"""Jobs through the API, Redis, a real worker and Postgres give what Engine.generate() gives offline."""

from __future__ import annotations

import random
import time
import uuid
from datetime import datetime

import pytest

from batching import SamplingParams
from jobstore import jobs
from tests.conftest import job_request
from tests.workers.conftest import worker_stack
from workers.reconciler import reconcile

PARAMS = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "ignore_eos")


def mixed_jobs(n: int) -> list[dict]:
    """Greedy and seeded-sampling jobs with text and token-id prompts, stop strings and all priorities."""
    rng = random.Random(20)
    bodies = []
    for i in range(n):
        body = {
            "max_tokens": rng.randint(4, 32),
            "priority": rng.randint(0, 9),
            "seed": 1000 + i,
            "temperature": 0.0 if i % 2 == 0 else rng.choice([0.7, 1.0]),
            "top_p": rng.choice([1.0, 0.9]),
            "top_k": rng.choice([0, 0, 40]),
        }
        if i % 5 == 4:
            body["input_ids"] = [1] + [rng.randint(3, 258) for _ in range(rng.randint(1, 30))]
        else:
            body["prompt"] = f"Job {i}: " + " ".join(
                rng.choice(["tea", "cat", "sky", "mud"]) for _ in range(i)
            )
        if i % 4 == 1:
            body["stop"] = ["a", "\n"]
        bodies.append(body)
    return bodies


def expected_outputs(engine, bodies):
    params = [SamplingParams(**{k: b[k] for k in PARAMS if k in b}) for b in bodies]
    return engine.generate([b.get("prompt", b.get("input_ids")) for b in bodies], params)


def assert_output_is(job: dict, expected, body: dict) -> None:
    """The job succeeded with exactly `expected`'s (a RequestOutput's) text, tokens and finish reason."""
    assert job["status"] == "succeeded", job
    assert job["output"] == {
        "text": expected.text,
        "token_ids": expected.token_ids,
        "finish_reason": expected.finish_reason,
    }, body


def test_twenty_mixed_priority_jobs_equal_offline_generate(wide, offline_engine):
    bodies = mixed_jobs(20)
    ids = [wide.submit(**body) for body in bodies]
    results = [wide.wait(job_id) for job_id in ids]
    for body, job, expected in zip(bodies, results, expected_outputs(offline_engine, bodies), strict=True):
        assert_output_is(job, expected, body)
        assert job["usage"] == {
            "prompt_tokens": len(expected.prompt_token_ids),
            "completion_tokens": len(expected.token_ids),
        }
        times = [
            datetime.fromisoformat(job[k])
            for k in ("created_at", "started_at", "first_token_at", "finished_at")
        ]
        assert times == sorted(times), job
    assert {b["priority"] for b in bodies} >= {0, 9}


def test_progress_is_visible_while_running(wide):
    # 2,000 tokens (cancelled below): a fast CPU runs 300 in a few tenths of a second, before a poll sees them
    job_id = wide.submit(prompt="A long story", max_tokens=2000, temperature=0.0)
    running = wide.wait(job_id, until=lambda j: j["status"] == "running" and j["output"]["token_ids"])
    assert 0 < len(running["output"]["token_ids"]) < 2000 and running["first_token_at"]
    assert running["usage"]["completion_tokens"] == len(running["output"]["token_ids"])
    wide.client.post(f"/jobs/{job_id}/cancel", headers=wide.headers)


def test_reconciler_sends_jobs_that_never_reached_redis(wide, sessions):
    job_id = wide.submit(prompt="unsent", max_tokens=4, temperature=0.0)
    wide.wait(job_id)  # the submitted one runs; now one that the API committed but never sent:
    tenant_id = _tenant_of(sessions, job_id)
    with sessions.begin() as s:
        job, _ = jobs.create_job(
            s,
            tenant_id,
            job_request(prompt="lost", max_tokens=4),
        )
    time.sleep(wide.settings.enqueue_grace_seconds)
    assert reconcile(sessions, wide.celery, wide.settings)["sent"] >= 1
    assert wide.wait(str(job.id))["status"] == "succeeded"


def test_expired_lease_is_redispatched_and_resumes_from_persisted_tokens(wide, sessions, offline_engine):
    body = {"prompt": "Resume me", "max_tokens": 24, "temperature": 0.8, "seed": 99}
    [expected] = expected_outputs(offline_engine, [body])
    tenant_id = _tenant_of(sessions, wide.submit(prompt="x", max_tokens=1))
    with sessions.begin() as s:  # a worker claimed it, saved 10 tokens, and died (its lease lapsed)
        job, _ = jobs.create_job(
            s, tenant_id, dict(input_ids=None, top_p=1.0, top_k=0, stop=[], priority=5, metadata={}, **body)
        )
        jobs.mark_enqueued(s, [job.id])
    with sessions.begin() as s:
        jobs.claim_job(s, job.id, "dead-worker", lease_seconds=-1)
        jobs.save_progress(s, [jobs.Output(job.id, "dead-worker", 0, expected.token_ids[:10], 0, b"")], -1)
    assert reconcile(sessions, wide.celery, wide.settings)["requeued"] >= 1
    done = wide.wait(str(job.id))
    assert done["status"] == "succeeded" and done["output"]["token_ids"] == expected.token_ids
    # the whole log: other tests' jobs (the reconciler may requeue theirs too) can push the line out of the tail
    assert f"job {job.id} claimed: priority 5, attempt 2, resuming after 10 tokens" in wide.log.read_text()


def _tenant_of(sessions, job_id: str) -> uuid.UUID:
    with sessions.begin() as s:
        return jobs.get_job(s, uuid.UUID(job_id)).tenant_id


@pytest.fixture(scope="module")
def async_worker(settings, new_key, tmp_path_factory, redis_client):
    """A worker whose engine schedules each step while the last one's tokens are still on their way to the
    host (ASYNC_SCHEDULING, the default on CUDA), here on the CPU."""
    with worker_stack(
        settings.replace(async_scheduling=True), new_key, tmp_path_factory.mktemp("workers"), max_num_seqs=8
    ) as stack:
        yield stack


def test_an_async_scheduling_worker_gives_what_generate_gives(async_worker, offline_engine):
    bodies = mixed_jobs(16)
    ids = [async_worker.submit(**body) for body in bodies]
    cancelled = async_worker.submit(prompt="a long one", max_tokens=1500, ignore_eos=True, temperature=0)
    async_worker.wait(cancelled, until=lambda job: len((job["output"] or {}).get("token_ids", [])) >= 3)
    assert (
        async_worker.client.post(f"/jobs/{cancelled}/cancel", headers=async_worker.headers).status_code == 200
    )
    results = [async_worker.wait(job_id) for job_id in ids]
    for body, job, expected in zip(bodies, results, expected_outputs(offline_engine, bodies), strict=True):
        assert_output_is(job, expected, body)
    stopped = async_worker.wait(cancelled)
    (alone,) = offline_engine.generate(
        ["a long one"], SamplingParams(max_tokens=1500, ignore_eos=True, temperature=0)
    )
    assert stopped["status"] == "cancelled"
    kept = stopped["output"]["token_ids"]
    assert kept == alone.token_ids[: len(kept)], "a cancelled job keeps only tokens it was given"
    assert async_worker.engine_stats()["num_overlapped_steps"] > 0
