"""What the API checks against the model a request names (issue 40), over the real app, Postgres and Redis, with a
second model announced as a worker announces it (contract/fleet.py) and no worker: `wide`, a tokenizer of its own
with 266 ids (tiny-llama's has 259) and a context of 128 tokens.

- logit_bias's token ids are checked against the named model's vocabulary on POST /jobs, /jobs/bulk, /v1 and batch
  lines: an id `wide` has and tiny-llama lacks is accepted for `wide` and refused for tiny-llama (the default);
- one Batch API file mixes models: each line is counted with its model's tokenizer and checked against its model's
  context and vocabulary, its job names its model and goes to that model's queue, and the output file's lines name
  each request's model (a line naming a model nobody serves fails alone: tests/webapi/test_batch_model.py);
- one POST /jobs/bulk call mixes models: each item's job goes to its own model's queue, an item naming a model
  nobody serves is answered 404 alone.
"""

from __future__ import annotations

import io
import json
import time
import uuid

import pytest
from sqlalchemy import text

from batching.tokenizer import byte_level_tokenizer, load_tokenizer
from contract.dispatch import queue_key
from contract.fleet import Announcement, announce

WIDE = "wide"
MERGES = [("o", "n"), ("h", "e"), ("Ġ", "t"), ("Ġt", "he"), ("Ġ", "a"), ("e", "r"), ("O", "n")]
WIDE_LEN = 128
TINY_VOCAB = len(load_tokenizer("tiny-llama"))
WIDE_VOCAB = TINY_VOCAB + len(MERGES)
ONLY_WIDE = {str(TINY_VOCAB + 3): 5.0}  # a token id `wide` has and tiny-llama lacks
COMPLETIONS = "/v1/completions"


@pytest.fixture(scope="module")
def wide_model(tmp_path_factory) -> str:
    """The second model's checkpoint as far as the API reads one: a directory with its tokenizer."""
    directory = tmp_path_factory.mktemp("wide-tokenizer")
    byte_level_tokenizer(MERGES).save_pretrained(directory)
    return str(directory)


@pytest.fixture()
def fleet(settings, database, redis_client, wide_model):
    """An app of a fleet of its own (its own Redis prefix): tiny-llama the default, `wide` announced by a worker."""
    from webapi import create_app

    own = settings.replace(redis_key_prefix=f"{settings.redis_key_prefix}named-{uuid.uuid4().hex[:6]}:")
    worker = Announcement(
        worker=f"host:{uuid.uuid4().hex[:6]}",
        name=WIDE,
        model=wide_model,
        max_model_len=WIDE_LEN,
        capacity=4,
        held=0,
        heartbeat=time.time(),
    )
    announce(redis_client, own.redis_key_prefix, worker, heartbeat_seconds=60)
    app = create_app(own)
    yield app, own
    app.extensions["genq"].close()
    keys = list(redis_client.scan_iter(match=f"{own.redis_key_prefix}*"))
    if keys:
        redis_client.delete(*keys)


def line(i: int, **body) -> dict:
    return {
        "custom_id": f"req-{i}",
        "method": "POST",
        "url": COMPLETIONS,
        "body": {"prompt": "Once upon a time", "max_tokens": 8, **body},
    }


def create_batch(client, headers, lines) -> dict:
    content = b"".join(json.dumps(item).encode() + b"\n" for item in lines)
    upload = client.post(
        "/v1/files",
        data={"purpose": "batch", "file": (io.BytesIO(content), "in.jsonl")},
        headers=headers,
        content_type="multipart/form-data",
    )
    assert upload.status_code == 200, upload.json
    body = {"input_file_id": upload.json["id"], "endpoint": COMPLETIONS, "completion_window": "24h"}
    created = client.post("/v1/batches", json=body, headers=headers)
    assert created.status_code == 200, created.json
    return created.json


def test_logit_bias_is_checked_against_the_named_models_vocabulary(fleet, auth):
    app, _ = fleet
    client, headers = app.test_client(), auth()
    accepted = client.post(
        "/jobs", json={"prompt": "hi", "model": WIDE, "logit_bias": ONLY_WIDE}, headers=headers
    )
    assert accepted.status_code == 202, accepted.json
    assert accepted.json["model"] == WIDE
    tiny_refusal = (
        f"logit_bias: token id {TINY_VOCAB + 3} is outside the vocabulary of the model `tiny-llama`: ids are "
        f"below {TINY_VOCAB}"
    )
    for body in (
        {"prompt": "hi", "logit_bias": ONLY_WIDE},  # the default model's
        {"prompt": "hi", "model": "tiny-llama", "logit_bias": ONLY_WIDE},
    ):
        refused = client.post("/jobs", json=body, headers=headers)
        assert refused.status_code == 422 and refused.json["error"]["message"] == tiny_refusal, refused.json
    past = client.post(
        "/jobs", json={"prompt": "hi", "model": WIDE, "logit_bias": {str(WIDE_VOCAB): 1}}, headers=headers
    )
    assert past.status_code == 422
    assert past.json["error"]["message"] == (
        f"logit_bias: token id {WIDE_VOCAB} is outside the vocabulary of the model `wide`: ids are below "
        f"{WIDE_VOCAB}"
    )
    bulk = client.post(
        "/jobs/bulk",
        json={
            "jobs": [
                {"prompt": "hi", "model": WIDE, "logit_bias": ONLY_WIDE},
                {"prompt": "hi", "logit_bias": ONLY_WIDE},
            ]
        },
        headers=headers,
    )
    assert [r["status"] for r in bulk.json["results"]] == [202, 422], bulk.json
    assert bulk.json["results"][1]["error"]["message"] == tiny_refusal
    # /v1 refuses before any job is made (an accepted synchronous call would wait for a worker)
    for model, bias, vocab in (
        ("tiny-llama", ONLY_WIDE, TINY_VOCAB),
        (WIDE, {str(WIDE_VOCAB): 1}, WIDE_VOCAB),
    ):
        v1 = client.post(
            COMPLETIONS,
            json={"prompt": "hi", "model": model, "max_tokens": 2, "logit_bias": bias},
            headers=headers,
        )
        assert v1.status_code == 400 and v1.json["error"]["param"] == "logit_bias", v1.json
        assert f"vocabulary of the model `{model}`: ids are below {vocab}" in v1.json["error"]["message"]
    for job in [accepted.json, bulk.json["results"][0]["job"]]:
        assert client.post(f"/jobs/{job['id']}/cancel", headers=headers).status_code == 200


def test_a_batch_file_mixes_models(fleet, auth, sessions, redis_client):
    app, settings = fleet
    client, headers = app.test_client(), auth()
    prompt = "Once upon a time"
    batch = create_batch(
        client,
        headers,
        [
            line(0, model="tiny-llama"),
            line(1, model=WIDE, logit_bias=ONLY_WIDE),
            line(2),  # no model: the fleet's default
            line(3, model=WIDE, max_tokens=WIDE_LEN - 20),
        ],
    )
    assert batch["status"] == "in_progress" and batch["request_counts"]["total"] == 4, batch["errors"]
    with sessions() as s:
        rows = s.execute(
            text("SELECT * FROM jobs WHERE batch_id = :b ORDER BY batch_index"), {"b": batch["id"]}
        ).all()
    assert [r.model for r in rows] == ["tiny-llama", WIDE, "tiny-llama", WIDE]
    # each prompt counted with its own model's tokenizer: the merges make `wide`'s shorter
    wide_tokens = len(byte_level_tokenizer(MERGES)(prompt)["input_ids"])
    assert [r.prompt_tokens for r in rows] == [len(prompt) + 1, wide_tokens, len(prompt) + 1, wide_tokens]
    assert wide_tokens < len(prompt) + 1
    assert rows[1].options["logit_bias"] == ONLY_WIDE
    # each job in its own model's queue, at the batch's priority
    priority = rows[0].priority
    assert redis_client.llen(queue_key(settings, "generate", priority)) == 2
    assert redis_client.llen(queue_key(settings, f"generate.{WIDE}", priority)) == 2

    # ended as a worker would end them: each output line names its request's model
    with sessions.begin() as s:
        s.execute(
            text(
                "UPDATE jobs SET status = 'succeeded', output_token_ids = '{72,105}', output_text = :t, "
                "finish_reason = 'length', finished_at = now() WHERE batch_id = :b"
            ),
            {"t": b"Hi", "b": batch["id"]},
        )
    done = client.get(f"/v1/batches/{batch['id']}", headers=headers).json
    assert done["status"] == "completed", done
    output = client.get(f"/v1/files/{done['output_file_id']}/content", headers=headers).data.decode()
    lines = [json.loads(item) for item in output.splitlines()]
    assert [item["response"]["body"]["model"] for item in lines] == ["tiny-llama", WIDE, "tiny-llama", WIDE]
    assert [item["response"]["body"]["usage"]["prompt_tokens"] for item in lines] == [
        r.prompt_tokens for r in rows
    ]


def test_a_bulk_call_mixes_models(fleet, auth, redis_client):
    app, settings = fleet
    client, headers = app.test_client(), auth()
    items = [
        {"prompt": "hi", "model": WIDE, "priority": 3},
        {"prompt": "hi", "priority": 3},  # the default
        {"prompt": "hi", "model": "nope", "priority": 3},
        {"input_ids": [1, TINY_VOCAB + 3], "model": WIDE, "priority": 3},  # an id only `wide` has
    ]
    bulk = client.post("/jobs/bulk", json={"jobs": items}, headers=headers)
    results = bulk.json["results"]
    assert [r["status"] for r in results] == [202, 202, 404, 202], results
    assert [r["job"]["model"] for r in results if r["job"]] == [WIDE, "tiny-llama", WIDE]
    assert results[2]["error"]["code"] == "model_not_found" and f"`{WIDE}`" in results[2]["error"]["message"]
    assert redis_client.llen(queue_key(settings, f"generate.{WIDE}", 3)) == 2
    assert redis_client.llen(queue_key(settings, "generate", 3)) == 1
    assert redis_client.llen(queue_key(settings, "generate.nope", 3)) == 0
    for result in results:
        if result["job"]:
            assert client.post(f"/jobs/{result['job']['id']}/cancel", headers=headers).status_code == 200


def test_a_batch_line_is_refused_by_its_own_models_limits(fleet, auth, sessions):
    """`wide`'s 128-token context and tiny-llama's vocabulary each refuse a line that the other model would take;
    the file fails whole, each invalid line reported (a line naming a model nobody serves is not invalid: it
    fails alone, the file runs; test_batch_model.py)."""
    app, _ = fleet
    client, headers = app.test_client(), auth()
    batch = create_batch(
        client,
        headers,
        [
            line(0, model=WIDE, max_tokens=200),  # tiny-llama's 2048 would take it
            line(1, model="tiny-llama", max_tokens=200),
            line(2, logit_bias=ONLY_WIDE),  # the default, tiny-llama
            line(3, model=WIDE, logit_bias=ONLY_WIDE),
        ],
    )
    assert batch["status"] == "failed", batch
    errors = {e["line"]: e for e in batch["errors"]["data"]}
    assert sorted(errors) == [1, 3], errors
    assert (
        errors[1]["code"] == "context_length_exceeded" and f"max_model_len {WIDE_LEN}" in errors[1]["message"]
    )
    assert errors[3]["param"] == "body.logit_bias"
    assert f"vocabulary of the model `tiny-llama`: ids are below {TINY_VOCAB}" in errors[3]["message"]
    with sessions() as s:
        assert s.scalar(text("SELECT count(*) FROM jobs WHERE batch_id = :b"), {"b": batch["id"]}) == 0


def test_a_model_whose_tokenizer_the_api_cannot_load_is_503_not_500(fleet, auth, redis_client, tmp_path):
    """A worker announces a checkpoint absent from the API's host: the request is not at fault (503 naming the
    checkpoint, Retry-After), and nothing is queued."""
    app, settings = fleet
    gone = Announcement(
        worker=f"host:{uuid.uuid4().hex[:6]}",
        name="gone",
        model=str(tmp_path / "not-here"),
        max_model_len=WIDE_LEN,
        capacity=4,
        held=0,
        heartbeat=time.time(),
    )
    announce(redis_client, settings.redis_key_prefix, gone, heartbeat_seconds=60)
    client, headers = app.test_client(), auth()
    time.sleep(1.1)  # the API reads the announcements at most once a second
    refused = client.post("/jobs", json={"prompt": "hi", "model": "gone"}, headers=headers)
    assert refused.status_code == 503, refused.json
    assert refused.json["error"]["code"] == "tokenizer_unavailable"
    assert "not-here" in refused.json["error"]["message"] and refused.headers["Retry-After"] == "30"
    v1 = client.post(COMPLETIONS, json={"prompt": "hi", "model": "gone", "max_tokens": 2}, headers=headers)
    assert v1.status_code == 503 and v1.json["error"]["code"] == "tokenizer_unavailable", v1.json
    bulk = client.post("/jobs/bulk", json={"jobs": [{"prompt": "hi", "model": "gone"}]}, headers=headers)
    assert bulk.json["results"][0]["status"] == 503, bulk.json
    assert redis_client.llen(queue_key(settings, "generate.gone", 5)) == 0
