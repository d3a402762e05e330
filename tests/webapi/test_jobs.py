"""/jobs over the real app, Postgres and Redis (no worker: jobs stay queued here)."""

from __future__ import annotations

import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest

from contract.dispatch import QUEUE
from jobstore import jobs

JOB = {
    "prompt": "Once upon a time",
    "max_tokens": 16,
    "temperature": 0.0,
    "priority": 3,
    "metadata": {"a": 1},
}


def submit(client, headers, body=None, **extra_headers):
    return client.post("/jobs", json=body or JOB, headers={**headers, **extra_headers})


def test_submit_answers_202_with_location_and_queues_by_priority(client, auth, redis_client, settings):
    headers = auth()
    key = f"{settings.redis_key_prefix}{QUEUE}:3"
    before = redis_client.llen(key)
    r = submit(client, headers)
    assert r.status_code == 202
    job = r.json
    assert r.headers["Location"] == f"/jobs/{job['id']}"
    assert job["status"] == "queued" and job["priority"] == 3 and job["metadata"] == {"a": 1}
    assert job["usage"] == {
        "prompt_tokens": len("Once upon a time") + 1,
        "completion_tokens": 0,
    }  # bytes + BOS
    assert job["output"] == {"text": "", "token_ids": [], "finish_reason": None} and job["error"] is None
    assert redis_client.llen(key) == before + 1  # filed under priority 3's list
    polled = client.get(r.headers["Location"], headers=headers)
    assert polled.status_code == 200 and polled.json == job


def test_input_ids_prompt(client, auth):
    r = submit(client, auth(), {"input_ids": [1, 80, 81, 82], "max_tokens": 4})
    assert r.status_code == 202 and r.json["usage"]["prompt_tokens"] == 4 and r.json["priority"] == 5


def test_list_paginates_newest_first_and_filters(client, auth):
    headers = auth()
    ids = [submit(client, headers).json["id"] for _ in range(5)]
    seen, cursor = [], None
    while True:
        page = client.get(
            "/jobs", query_string={"limit": 2, **({"cursor": cursor} if cursor else {})}, headers=headers
        ).json
        seen.append([j["id"] for j in page["jobs"]])
        cursor = page["next_cursor"]
        if cursor is None:
            break
    assert seen == [ids[::-1][0:2], ids[::-1][2:4], ids[::-1][4:]]
    client.post(f"/jobs/{ids[1]}/cancel", headers=headers)
    cancelled = client.get("/jobs?status=cancelled", headers=headers).json
    queued = client.get("/jobs?status=queued", headers=headers).json
    assert [j["id"] for j in cancelled["jobs"]] == [ids[1]]
    assert [j["id"] for j in queued["jobs"]] == [i for i in ids[::-1] if i != ids[1]]


def test_cancel(client, auth, sessions):
    headers = auth()
    job_id = submit(client, headers).json["id"]
    r = client.post(f"/jobs/{job_id}/cancel", headers=headers)
    assert r.status_code == 200 and r.json["status"] == "cancelled" and r.json["finished_at"]
    assert client.post(f"/jobs/{job_id}/cancel", headers=headers).status_code == 200  # again: same answer
    done = submit(client, headers).json["id"]
    with sessions.begin() as s:
        jobs.claim_job(s, uuid.UUID(done), "w", 30)
        jobs.finish_job(
            s, uuid.UUID(done), "w", token_ids=[5], text="x", finish_reason="stop", prompt_tokens=3
        )
    r = client.post(f"/jobs/{done}/cancel", headers=headers)
    assert r.status_code == 409 and "succeeded" in r.json["error"]["message"]


def test_tenants_see_only_their_own_jobs(client, auth):
    alice, bob = auth(), auth()
    job_id = submit(client, alice).json["id"]
    for method, url in [("get", f"/jobs/{job_id}"), ("post", f"/jobs/{job_id}/cancel")]:
        r = getattr(client, method)(url, headers=bob)
        assert r.status_code == 404 and r.json == {"error": {"code": "not_found", "message": "no such job"}}
    assert client.get("/jobs", headers=bob).json["jobs"] == []
    assert client.get(f"/jobs/{job_id}", headers=alice).json["status"] == "queued"  # bob's cancel did nothing


def test_idempotency_key(client, auth):
    headers = auth()
    first = submit(client, headers, **{"Idempotency-Key": "order-1"})
    again = submit(client, headers, **{"Idempotency-Key": "order-1"})
    assert first.status_code == again.status_code == 202 and first.json["id"] == again.json["id"]
    other = submit(client, headers, {**JOB, "max_tokens": 3}, **{"Idempotency-Key": "order-1"})
    assert other.status_code == 422 and "Idempotency-Key" in other.json["error"]["message"]
    assert len(client.get("/jobs", headers=headers).json["jobs"]) == 1
    assert (
        submit(client, auth(), **{"Idempotency-Key": "order-1"}).json["id"] != first.json["id"]
    )  # per tenant


TOO_LONG = "x" * 2048  # 2048 bytes + BOS: over tiny-llama's 2048 tokens with any max_tokens


@pytest.mark.parametrize(
    ("body", "status", "names"),
    [
        (b'{"prompt": "hi", ', 400, "JSON"),
        (b'{"prompt": "hi", "temperature": NaN}', 422, "temperature"),
        (b'["prompt"]', 422, "body"),
        ({"prompt": 5}, 422, "prompt"),
        ({"prompt": "hi", "max_tokens": "8"}, 422, "max_tokens"),
        ({"prompt": "hi", "priority": 1.5}, 422, "priority"),
        ({"prompt": "hi", "temperature": "hot"}, 422, "temperature"),
        ({"prompt": "hi", "stop": 5}, 422, "stop"),
        ({"prompt": "hi", "colour": "red"}, 422, "colour"),
        ({"max_tokens": 4}, 422, "prompt"),
        ({"prompt": "hi", "input_ids": [1]}, 422, "input_ids"),
        ({"prompt": ""}, 422, "prompt"),
        ({"prompt": "hi", "max_tokens": 0}, 422, "max_tokens"),
        ({"prompt": "hi", "max_tokens": 4096}, 422, "max_model_len"),
        ({"prompt": TOO_LONG, "max_tokens": 1}, 422, "max_model_len"),
        ({"input_ids": [1] * 2040, "max_tokens": 16}, 422, "max_model_len"),
        ({"input_ids": [1, 300]}, 422, "input_ids"),
        ({"input_ids": [1, -1]}, 422, "input_ids"),
        ({"prompt": "hi", "priority": 10}, 422, "priority"),
        ({"prompt": "hi", "priority": -1}, 422, "priority"),
        ({"prompt": "hi", "top_p": 0}, 422, "top_p"),
        ({"prompt": "hi", "temperature": -0.5}, 422, "temperature"),
        ({"prompt": "hi", "seed": -3}, 422, "seed"),
        ({"prompt": "hi", "stop": ["a\x00"]}, 422, "stop"),
        ({"prompt": "hi", "metadata": {"nested": {"a": 1}}}, 422, "metadata"),
        ({"prompt": "hi", "metadata": {f"k{i}": i for i in range(17)}}, 422, "metadata"),
    ],
)
def test_bad_input_is_4xx_naming_the_field_and_creates_no_job(client, auth, body, status, names):
    headers = auth()
    if isinstance(body, bytes):
        r = client.post("/jobs", data=body, headers={**headers, "Content-Type": "application/json"})
    else:
        r = client.post("/jobs", json=body, headers=headers)
    assert r.status_code == status, r.json
    assert set(r.json) == {"error"} and set(r.json["error"]) == {"code", "message"}
    assert names in r.json["error"]["message"]
    assert client.get("/jobs", headers=headers).json["jobs"] == []


def test_body_over_the_limit_is_413(client, auth, settings):
    headers = auth()
    r = client.post("/jobs", json={"prompt": "x" * settings.max_body_bytes}, headers=headers)
    assert r.status_code == 413 and r.json["error"]["code"] == "request_entity_too_large"
    assert client.get("/jobs", headers=headers).json["jobs"] == []


def test_body_must_be_json(client, auth):
    r = client.post(
        "/jobs", data="prompt=hi", headers={**auth(), "Content-Type": "application/x-www-form-urlencoded"}
    )
    assert r.status_code == 415 and "application/json" in r.json["error"]["message"]


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer nope"}, {"Authorization": "Basic YTpi"}])
def test_missing_or_wrong_key_is_401(client, headers):
    for method, url in [("post", "/jobs"), ("get", "/jobs"), ("get", f"/jobs/{uuid.uuid4()}")]:
        r = getattr(client, method)(url, json=JOB, headers=headers)
        assert r.status_code == 401 and r.json["error"]["code"] == "unauthorized"
        assert r.headers["WWW-Authenticate"].startswith("Bearer")


def test_unknown_id_is_404(client, auth):
    headers = auth()
    for url in [f"/jobs/{uuid.uuid4()}", "/jobs/not-a-uuid", "/nowhere"]:
        r = client.get(url, headers=headers)
        assert r.status_code == 404 and set(r.json["error"]) == {"code", "message"}


@pytest.mark.parametrize(
    ("query", "name"),
    [
        ("status=done", "status"),
        ("limit=0", "limit"),
        ("limit=ten", "limit"),
        ("limit=101", "limit"),
        ("cursor=garbage", "cursor"),
        ("colour=red", "colour"),
        ("limit=1&limit=2", "limit"),
    ],
)
def test_bad_list_query_is_422(client, auth, query, name):
    r = client.get(f"/jobs?{query}", headers=auth())
    assert r.status_code == 422 and name in r.json["error"]["message"]


def test_job_survives_redis_being_down(settings, sessions, auth):
    """The job is committed first; if Redis cannot take it, it stays queued for the reconciler."""
    from webapi import create_app

    app = create_app(settings.replace(redis_url="redis://127.0.0.1:1/0"))
    r = submit(app.test_client(), auth())
    app.extensions["genq"].close()
    assert r.status_code == 202 and r.json["status"] == "queued"
    with sessions.begin() as s:
        assert jobs.get_job(s, uuid.UUID(r.json["id"])).enqueued_at is None  # left for the reconciler


def test_a_send_is_recorded_in_batches_and_flushed_on_close(settings, sessions, auth):
    """enqueued_at is written by the per-process flusher within about a second; close() writes what is left."""
    from webapi import create_app

    app = create_app(settings)
    client, headers = app.test_client(), auth()
    first = uuid.UUID(submit(client, headers).json["id"])
    wait = 0.0
    while wait < 5.0:
        with sessions.begin() as s:
            if jobs.get_job(s, first).enqueued_at is not None:
                break
        time.sleep(0.05)
        wait += 0.05
    assert wait < 5.0, "the flusher did not record the send"
    second = uuid.UUID(submit(client, headers).json["id"])
    app.extensions["genq"].close()  # at once, without waiting for the flusher's next round
    with sessions.begin() as s:
        assert jobs.get_job(s, second).enqueued_at is not None


def test_a_revoked_key_stops_working_after_the_auth_cache_time(settings, sessions, new_key):
    from sqlalchemy import func, update

    from jobstore.keys import hash_key
    from jobstore.models import ApiKey
    from webapi import create_app
    from webapi.key_cache import KeyCache

    app = create_app(settings.replace(auth_cache_seconds=5))
    now = [1000.0]  # the cache's clock, moved by the test
    app.extensions["genq"].key_cache = KeyCache(5, timer=lambda: now[0])
    client, key = app.test_client(), new_key()
    headers = {"Authorization": f"Bearer {key}"}
    assert client.get("/jobs", headers=headers).status_code == 200
    with sessions.begin() as s:
        s.execute(update(ApiKey).where(ApiKey.key_hash == hash_key(key)).values(revoked_at=func.now()))
    now[0] += 4.9
    assert client.get("/jobs", headers=headers).status_code == 200  # still trusted: looked up < 5 s ago
    now[0] += 0.2
    assert client.get("/jobs", headers=headers).status_code == 401
    uncached = create_app(settings.replace(auth_cache_seconds=0))
    assert uncached.test_client().get("/jobs", headers=headers).status_code == 401
    app.extensions["genq"].close()
    uncached.extensions["genq"].close()


def test_a_request_looks_its_key_up_once(settings, new_key, monkeypatch):
    """The rate limiter asks for the key's tenant before the key check does: one lookup serves both (with no
    cache, each lookup is a query)."""
    from webapi import auth, create_app

    lookups = []
    look_up = auth._look_up
    monkeypatch.setattr(auth, "_look_up", lambda key_hash: lookups.append(key_hash) or look_up(key_hash))
    app = create_app(settings.replace(auth_cache_seconds=0))
    client, headers = app.test_client(), {"Authorization": f"Bearer {new_key()}"}
    try:
        assert client.post("/jobs", json=JOB, headers=headers).status_code == 202
        assert client.get("/jobs", headers=headers).status_code == 200
        assert len(lookups) == 2 and lookups[0] == lookups[1]  # one a request
    finally:
        app.extensions["genq"].close()


def test_the_per_tenant_cap_is_checked_inside_the_insert(settings, auth):
    """At the cap nothing is inserted, even for submissions racing each other: near its cap a tenant's
    count and insert run under its advisory lock; other tenants go on."""
    from webapi import create_app

    app = create_app(settings.replace(max_queued_per_tenant=6))
    client, headers = app.test_client(), auth()
    codes = [submit(client, headers).status_code for _ in range(3)]  # half the cap: checked from here on
    assert codes == [202] * 3
    start = threading.Barrier(12)

    def racing(_):
        racer = app.test_client()  # one client a thread
        start.wait()
        return submit(racer, headers).status_code

    with ThreadPoolExecutor(12) as pool:  # 12 submissions at once, 3 places left
        codes = sorted(pool.map(racing, range(12)))
    assert codes == [202] * 3 + [429] * 9, codes
    listed = client.get("/jobs?status=queued&limit=100", headers=headers).json["jobs"]
    assert len(listed) == 6
    assert submit(client, auth()).status_code == 202
    app.extensions["genq"].close()


def test_a_wait_rereads_the_row_every_events_resync_seconds(settings, database, redis_client, auth, sessions):
    """A job that ends without an event reaching the API (here: cancelled in the row alone) ends a
    `?wait=` within about EVENTS_RESYNC_SECONDS (the follower rereads its row), not at the wait's end."""
    from webapi import create_app

    app = create_app(settings.replace(events_resync_seconds=0.4))
    try:
        client, headers = app.test_client(), auth()
        job_id = uuid.UUID(submit(client, headers).json["id"])

        def cancel_in_the_row_alone():
            time.sleep(0.3)
            with sessions.begin() as s:
                jobs.cancel_job(s, job_id, jobs.get_job(s, job_id).tenant_id)

        threading.Thread(target=cancel_in_the_row_alone).start()
        started = time.monotonic()
        r = client.get(f"/jobs/{job_id}?wait=8", headers=headers)
        waited = time.monotonic() - started
    finally:
        app.extensions["genq"].close()
    assert r.status_code == 200 and r.json["status"] == "cancelled"
    assert waited < 2.5, f"answered after {waited:.1f} s"
