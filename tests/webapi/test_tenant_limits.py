"""Each per-tenant limit over the real app, Postgres and Redis (no worker: jobs stay queued here): the
refusal names the limit and, where it has one, when it resets."""

from __future__ import annotations

import uuid

import pytest

from jobstore.tenant_policy import set_policy

JOB = {"prompt": "Once upon a time", "max_tokens": 8}  # 17 prompt tokens (bytes + BOS)


@pytest.fixture()
def tenant_with(sessions, new_key):
    """`tenant_with(**policy)`: headers of a new tenant with that stored policy."""

    def make(**policy) -> dict:
        name = f"lim-{uuid.uuid4().hex[:8]}"
        key = new_key(name)
        with sessions.begin() as session:
            set_policy(session, name, policy)
        return {"Authorization": f"Bearer {key}"}

    return make


def test_top_priority_refuses_more_urgent_work_on_every_path(client, tenant_with):
    headers = tenant_with(top_priority=5)
    r = client.post("/jobs", json={**JOB, "priority": 2}, headers=headers)
    assert r.status_code == 403 and r.json["error"] == {
        "code": "priority_not_allowed",
        "message": "priority: 2 is more urgent than this tenant's top_priority 5 allows (5 to 9; 0 is the most urgent)",
    }
    assert client.post("/jobs", json={**JOB, "priority": 5}, headers=headers).status_code == 202
    bulk = client.post("/jobs/bulk", json={"jobs": [{**JOB, "priority": 0}, JOB]}, headers=headers).json
    assert [x["status"] for x in bulk["results"]] == [403, 202]
    r = client.post(
        "/v1/chat/completions",
        json={"model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}], "priority": 1},
        headers=headers,
    )
    assert r.status_code == 403 and r.json["error"]["type"] == "permission_error"


def test_max_queued_is_the_tenants_own(client, tenant_with):
    headers = tenant_with(max_queued=2)
    assert [client.post("/jobs", json=JOB, headers=headers).status_code for _ in range(2)] == [202, 202]
    r = client.post("/jobs", json=JOB, headers=headers)
    assert r.status_code == 429 and r.json["error"]["code"] == "too_many_queued_jobs"
    assert r.json["error"]["message"].startswith("max_queued: you have 2 jobs queued")
    assert client.get("/jobs/ended", headers=headers).json["queue"]["max_queued"] == 2


def test_rate_limit_is_the_tenants_own(client, tenant_with, auth):
    headers = tenant_with(rate_limit="3/minute")
    answers = [client.get("/jobs", headers=headers) for _ in range(4)]
    assert [r.status_code for r in answers] == [200, 200, 200, 429]
    message = answers[-1].json["error"]["message"]
    assert message.startswith("rate_limit: exceeded 3 per 1 minute for this key; it resets in ")
    assert 1 <= int(answers[-1].headers["Retry-After"]) <= 61
    other = auth()  # a tenant without a policy keeps RATE_LIMIT
    assert all(client.get("/jobs", headers=other).status_code == 200 for _ in range(5))


def test_token_budget_counts_prompt_and_max_tokens_and_says_when_it_resets(client, tenant_with):
    headers = tenant_with(token_budget=70, budget_period_seconds=3600)
    assert client.post("/jobs", json={**JOB, "max_tokens": 30}, headers=headers).status_code == 202  # 47
    r = client.post("/jobs", json=JOB, headers=headers)  # 47 + 25 > 70
    assert r.status_code == 429 and r.json["error"]["code"] == "token_budget_exceeded"
    assert r.json["error"]["message"].startswith(
        "token_budget: 47 of this tenant's 70 tokens are used or reserved this period, and this request needs up to 25"
    )
    assert ":00:00+00:00" in r.json["error"]["message"]  # the next hour, UTC
    assert 1 <= int(r.headers["Retry-After"]) <= 3600
    bulk = client.post("/jobs/bulk", json={"jobs": [{**JOB, "max_tokens": 1}, JOB]}, headers=headers).json
    assert [x["status"] for x in bulk["results"]] == [202, 429]  # 18 fits in the 23 left, 25 more does not


def test_defaults_keep_todays_behaviour(client, auth):
    headers = auth()
    assert client.post("/jobs", json={**JOB, "priority": 0}, headers=headers).status_code == 202


@pytest.fixture(scope="module")
def narrow_worker(settings, new_key, tmp_path_factory, redis_client):
    """A worker whose engine runs 2 sequences at once (and holds 2 more): a backlog forms at once."""
    from tests.workers.conftest import worker_stack

    with worker_stack(
        settings, new_key, tmp_path_factory.mktemp("limits"), max_num_seqs=2, reserve=2
    ) as stack:
        yield stack


def _jobs_of(sessions, headers) -> list:
    from sqlalchemy import select

    from jobstore.keys import hash_key
    from jobstore.models import ApiKey, Job

    key_hash = hash_key(headers["Authorization"].removeprefix("Bearer "))
    with sessions() as session:
        tenant_id = session.scalar(select(ApiKey.tenant_id).where(ApiKey.key_hash == key_hash))
        return list(session.scalars(select(Job).where(Job.tenant_id == tenant_id)))


def _wait_all_ended(sessions, *tenants, timeout: float = 120) -> None:
    import time

    deadline = time.monotonic() + timeout
    while any(j.status in ("queued", "running") for h in tenants for j in _jobs_of(sessions, h)):
        assert time.monotonic() < deadline, "jobs still live"
        time.sleep(0.2)


def test_a_tenant_capped_at_priority_5_cannot_displace_another_tenants_work(
    narrow_worker, tenant_with, auth, sessions
):
    """Under a backlog of tenant B's priority-3 jobs, capped tenant A's jobs (POST /jobs at 5, and a /v1 call
    naming no priority, which runs at A's sync_priority) all start after every one of B's; the control, an
    uncapped tenant's priority-0 job under the same backlog, jumps ahead of it."""
    import threading

    client = narrow_worker.client
    backlog = {"prompt": "A long story about", "max_tokens": 24, "temperature": 0.0, "priority": 3}

    b, a = auth(), tenant_with(top_priority=5, sync_priority=0)
    for _ in range(10):
        assert client.post("/jobs", json=backlog, headers=b).status_code == 202
    assert client.post("/jobs", json={**backlog, "priority": 0}, headers=a).status_code == 403
    for _ in range(3):
        assert client.post("/jobs", json={**backlog, "priority": 5}, headers=a).status_code == 202
    sync = threading.Thread(
        target=lambda: client.post(
            "/v1/completions", json={"model": "tiny-llama", "prompt": "Hi", "max_tokens": 4}, headers=a
        )
    )
    sync.start()
    sync.join(timeout=120)
    _wait_all_ended(sessions, a, b)
    b_jobs, a_jobs = _jobs_of(sessions, b), _jobs_of(sessions, a)
    assert len(a_jobs) == 4 and {j.priority for j in a_jobs} == {5}  # the /v1 call ran at 5, not 0
    assert all(j.status == "succeeded" for j in a_jobs + b_jobs)
    assert min(j.started_at for j in a_jobs) >= max(j.started_at for j in b_jobs)
    assert all(j.handbacks == 0 for j in b_jobs)

    # the control: the same backlog, and an uncapped tenant's urgent job goes ahead of it
    b2, c = auth(), auth()
    for _ in range(10):
        client.post("/jobs", json=backlog, headers=b2)
    assert client.post("/jobs", json={**backlog, "priority": 0}, headers=c).status_code == 202
    _wait_all_ended(sessions, b2, c)
    [urgent] = _jobs_of(sessions, c)
    assert urgent.started_at < max(j.started_at for j in _jobs_of(sessions, b2))
