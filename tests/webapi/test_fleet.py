"""The fleet as the API sees it (webapi/fleet.py), over the real app, Postgres and Redis, with workers' announcements
written as a worker writes them (contract/fleet.py) and no worker: a model a live worker announces is served, its
jobs go to its own queue; a configured model with no live worker is accepted and waits; an announcement that
stops is gone within three heartbeats; any other model is 404 naming the served ones."""

from __future__ import annotations

import re
import time
import uuid

import pytest

from contract.dispatch import PRIORITIES, queue_key
from contract.fleet import Announcement, announce, live_workers, withdraw


@pytest.fixture()
def fleet_app(settings, database, redis_client):
    """An app of a fleet of its own (its own Redis prefix): tiny-llama the default, `waiting` configured."""
    from webapi import create_app

    own = settings.replace(
        redis_key_prefix=f"{settings.redis_key_prefix}fleet-{uuid.uuid4().hex[:6]}:",
        served_models="waiting=tiny-llama",
    )
    app = create_app(own)
    yield app, own
    app.extensions["genq"].close()
    keys = list(redis_client.scan_iter(match=f"{own.redis_key_prefix}*"))
    if keys:
        redis_client.delete(*keys)


def worker_of(name: str, max_model_len: int = 512) -> Announcement:
    return Announcement(
        worker=f"host:{uuid.uuid4().hex[:6]}",
        name=name,
        model="tiny-llama",
        max_model_len=max_model_len,
        capacity=9,
        held=1,
        heartbeat=time.time(),
    )


def models_of(client, headers) -> dict:
    return {m["id"]: m for m in client.get("/models", headers=headers).json["models"]}


def test_a_model_a_live_worker_announces_is_served_on_its_own_queue(fleet_app, auth, redis_client):
    app, settings = fleet_app
    client, headers = app.test_client(), auth()
    other = worker_of("other")
    announce(redis_client, settings.redis_key_prefix, other, heartbeat_seconds=30)
    time.sleep(1.1)  # an API process reads the announcements at most once a second
    listed = models_of(client, headers)
    assert list(listed) == ["tiny-llama", "other", "waiting"]  # the default first
    assert listed["other"]["status"] == "ready" and listed["other"]["queue"] == "generate.other"
    assert listed["other"]["capacity"] == 9 and [w["id"] for w in listed["other"]["workers"]] == [
        other.worker
    ]
    assert listed["other"]["max_model_len"] == 512 and not listed["other"]["default"]
    assert listed["tiny-llama"]["default"] and listed["tiny-llama"]["queue"] == "generate"

    job = client.post("/jobs", json={"prompt": "hi", "model": "other", "priority": 4}, headers=headers)
    assert job.status_code == 202 and job.json["model"] == "other"
    assert redis_client.llen(queue_key(settings, "generate.other", 4)) == 1
    assert redis_client.llen(queue_key(settings, "generate", 4)) == 0
    assert models_of(client, headers)["other"]["queued"]["4"] == 1
    # the model's own context: its worker announced 512 tokens
    long = client.post("/jobs", json={"prompt": "hi", "model": "other", "max_tokens": 600}, headers=headers)
    assert long.status_code == 422 and "max_model_len 512" in long.json["error"]["message"]
    default = client.post("/jobs", json={"prompt": "hi"}, headers=headers)
    assert default.status_code == 202 and default.json["model"] == "tiny-llama"
    card = client.get("/v1/models/other", headers=headers)
    assert card.status_code == 200 and card.json["max_model_len"] == 512
    metrics = client.get("/metrics").get_data(as_text=True)
    assert re.search(r'genq_queue_depth\{model="other",priority="4"\} 1\.0', metrics)
    assert re.search(r'genq_model_live_workers\{model="other"\} 1\.0', metrics)

    withdraw(redis_client, settings.redis_key_prefix, other.worker)
    time.sleep(1.1)
    gone = client.post("/jobs", json={"prompt": "hi", "model": "other"}, headers=headers)
    assert gone.status_code == 404 and gone.json["error"]["code"] == "model_not_found"
    assert "`tiny-llama`" in gone.json["error"]["message"] and "`waiting`" in gone.json["error"]["message"]


def test_a_configured_model_with_no_live_worker_is_accepted_and_waits(fleet_app, auth, redis_client):
    app, settings = fleet_app
    client, headers = app.test_client(), auth()
    job = client.post("/jobs", json={"prompt": "hi", "model": "waiting", "priority": 2}, headers=headers)
    assert job.status_code == 202 and job.json["status"] == "queued"
    waiting = models_of(client, headers)["waiting"]
    assert waiting["status"] == "no_live_worker" and waiting["workers"] == [] and waiting["capacity"] == 0
    assert waiting["queued"]["2"] == 1
    metrics = client.get("/metrics").get_data(as_text=True)
    assert re.search(r'genq_model_live_workers\{model="waiting"\} 0\.0', metrics)
    assert sum(redis_client.llen(queue_key(settings, "generate.waiting", p)) for p in PRIORITIES) == 1


def test_an_unknown_model_is_404_naming_the_served_ones_on_every_surface(fleet_app, auth):
    app, _ = fleet_app
    client, headers = app.test_client(), auth()
    for path, body in (
        ("/jobs", {"prompt": "hi", "model": "nope"}),
        ("/jobs/bulk", {"jobs": [{"prompt": "hi", "model": "nope"}]}),
        ("/v1/completions", {"prompt": "hi", "model": "nope"}),
    ):
        r = client.post(path, json=body, headers=headers)
        error = r.json["results"][0]["error"] if path == "/jobs/bulk" else r.json["error"]
        assert (r.json["results"][0]["status"] if path == "/jobs/bulk" else r.status_code) == 404, (
            path,
            r.json,
        )
        assert error["code"] == "model_not_found", path
        assert "`tiny-llama`" in error["message"] and "`waiting`" in error["message"], path
    missing = client.get("/v1/models/nope", headers=headers)
    assert missing.status_code == 404 and missing.json["error"]["code"] == "model_not_found"


def test_an_announcement_that_stops_is_gone_within_three_heartbeats(settings, redis_client):
    prefix = f"{settings.redis_key_prefix}beats-{uuid.uuid4().hex[:6]}:"
    worker = worker_of("brief")
    announce(redis_client, prefix, worker, heartbeat_seconds=0.2)
    assert live_workers(redis_client, prefix) == [worker]
    time.sleep(0.7)
    assert live_workers(redis_client, prefix) == []
    assert redis_client.zcard(f"{prefix}genq:workers") == 0  # the stale id is removed by the reader
