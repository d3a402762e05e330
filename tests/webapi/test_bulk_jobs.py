"""POST /jobs/bulk over the real app, Postgres and Redis (no worker: jobs stay queued here)."""

from __future__ import annotations

import pytest

from contract.dispatch import QUEUE

JOB = {"prompt": "Once upon a time", "max_tokens": 8, "temperature": 0.0, "priority": 4}


def bulk(client, headers, jobs):
    return client.post("/jobs/bulk", json={"jobs": jobs}, headers=headers)


def test_each_item_is_answered_as_post_jobs_would(client, auth, redis_client, settings):
    headers = auth()
    queue = f"{settings.redis_key_prefix}{QUEUE}:4"
    before = redis_client.llen(queue)
    r = bulk(
        client,
        headers,
        [
            {**JOB, "idempotency_key": "a"},
            {**JOB, "max_tokens": "8"},
            {**JOB, "prompt": "Another", "idempotency_key": "b"},
            {**JOB, "idempotency_key": "a"},  # the same key and body again in the same call: the same job
            {**JOB, "prompt": "changed", "idempotency_key": "a"},
        ],
    )
    assert r.status_code == 200
    results = r.json["results"]
    assert [x["status"] for x in results] == [202, 422, 202, 202, 422]
    assert results[1]["error"] == {
        "code": "invalid_request",
        "message": 'max_tokens: expected an integer, got a string ("8")',
    }
    assert results[4]["error"]["code"] == "idempotency_key_reused"
    assert results[0]["created"] and results[2]["created"] and not results[3]["created"]
    assert results[3]["job"]["id"] == results[0]["job"]["id"]
    assert redis_client.llen(queue) == before + 2  # each new job sent once
    assert r.json["queue"] == {"queued": 2, "max_queued": settings.max_queued_per_tenant}

    again = bulk(client, headers, [{**JOB, "idempotency_key": "a"}]).json["results"][0]  # a retry
    assert again["status"] == 202 and not again["created"] and again["job"]["id"] == results[0]["job"]["id"]
    # the key is the tenant's, whichever path used it: POST /jobs answers the bulk's job
    single = client.post("/jobs", json=JOB, headers={**headers, "Idempotency-Key": "b"})
    assert single.status_code == 422  # "b" was used with another prompt
    same = client.post("/jobs", json=JOB, headers={**headers, "Idempotency-Key": "a"})
    assert same.status_code == 202 and same.json["id"] == results[0]["job"]["id"]


def test_items_beyond_the_queued_cap_answer_429_naming_it(settings, database, redis_client, new_key):
    from webapi import create_app

    app = create_app(settings.replace(max_queued_per_tenant=3))
    try:
        headers = {"Authorization": f"Bearer {new_key()}"}
        results = bulk(app.test_client(), headers, [JOB] * 5).json
        assert [x["status"] for x in results["results"]] == [202, 202, 202, 429, 429]
        assert results["results"][3]["error"]["code"] == "too_many_queued_jobs"
        assert results["results"][3]["error"]["message"].startswith("max_queued: you have 3 jobs queued")
        assert results["queue"] == {"queued": 3, "max_queued": 3}
    finally:
        app.extensions["genq"].close()


@pytest.mark.parametrize(
    "body, message",
    [
        ({"jobs": []}, "jobs: must hold at least 1 item"),
        ({"jobs": [JOB], "extra": 1}, "extra: unknown field"),
    ],
)
def test_the_body_itself_is_checked(client, auth, body, message):
    r = client.post("/jobs/bulk", json=body, headers=auth())
    assert r.status_code == 422 and r.json["error"]["message"].startswith(message.split(":")[0])


def test_an_integer_beyond_64_bits_is_named_not_a_500(client, auth):
    """orjson cannot write an integer the body's parser took (2**64): the item is refused naming its field."""
    r = bulk(client, auth(), [{**JOB, "max_tokens": 2**64}, {**JOB, "extra": [-(2**70)]}])
    assert r.status_code == 200
    first, second = r.json["results"]
    assert first["status"] == 422 and first["error"]["message"].startswith("max_tokens:")
    assert second["status"] == 422 and "extra" in second["error"]["message"]
