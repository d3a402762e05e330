"""A batch's `model` (OpenAI's Batch object) is the model of its requests, over the real app, Postgres and Redis
with a second model announced (tests/webapi/test_named_model.py's fleet): the model every line names, the fleet's
default when the lines name none, and null when the file mixes models (OpenAI takes one model a file; here each
output line names its own). Created, read back and listed alike.

A line naming a model nobody serves fails alone, as the request alone would (404 model_not_found), in the batch's
error file; the rest of the file runs on its models' queues, and the batch's `model` is the one they run on.
"""

from __future__ import annotations

import json

import pytest
from sqlalchemy import text

from contract.dispatch import queue_key
from tests.webapi.test_named_model import WIDE, create_batch, fleet, line, wide_model  # noqa: F401

FILES = {
    "one named model": ([line(0, model=WIDE), line(1, model=WIDE)], WIDE),
    "none named: the default": ([line(0), line(1)], "tiny-llama"),
    "the default, named or not": ([line(0, model="tiny-llama"), line(1)], "tiny-llama"),
    "mixed": ([line(0, model=WIDE), line(1), line(2, model=WIDE)], None),
}


@pytest.mark.parametrize("lines, model", FILES.values(), ids=FILES.keys())
def test_a_batch_names_the_model_of_its_requests(fleet, auth, lines, model):  # noqa: F811
    app, _ = fleet
    client, headers = app.test_client(), auth()
    created = create_batch(client, headers, lines)
    assert created["status"] == "in_progress", created["errors"]
    assert created["model"] == model
    assert client.get(f"/v1/batches/{created['id']}", headers=headers).json["model"] == model
    listed = client.get("/v1/batches", headers=headers).json["data"]
    assert [b["model"] for b in listed if b["id"] == created["id"]] == [model]


def test_a_failed_batch_names_the_model_of_its_valid_lines(fleet, auth):  # noqa: F811
    app, _ = fleet
    client, headers = app.test_client(), auth()
    created = create_batch(client, headers, [line(0, model=WIDE), line(1, model=WIDE, max_tokens=0)])
    assert created["status"] == "failed" and created["errors"]["data"][0]["line"] == 2
    assert created["model"] == WIDE


def file_lines(client, headers, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    content = client.get(f"/v1/files/{file_id}/content", headers=headers).data.decode()
    return [json.loads(item) for item in content.splitlines()]


def test_a_line_naming_an_unserved_model_fails_alone(fleet, auth, sessions, redis_client):  # noqa: F811
    app, settings = fleet
    client, headers = app.test_client(), auth()
    created = create_batch(
        client,
        headers,
        [
            line(0, model=WIDE),
            line(1, model="nope", logit_bias={"999999": 1}),
            line(2, model=WIDE, prompt=[5, 6]),
        ],
    )
    assert created["status"] == "in_progress" and created["errors"] is None, created
    assert created["request_counts"] == {"total": 3, "completed": 0, "failed": 1}
    assert created["model"] == WIDE  # the model its runnable lines run on
    with sessions() as s:
        rows = s.execute(
            text("SELECT * FROM jobs WHERE batch_id = :b ORDER BY batch_index"), {"b": created["id"]}
        ).all()
    assert [(r.status, r.model) for r in rows] == [("queued", WIDE), ("failed", "nope"), ("queued", WIDE)]
    refused = rows[1]
    assert refused.error_code == "model_not_found" and refused.finished_at is not None
    assert refused.enqueued_at is None  # never sent
    priority = rows[0].priority
    assert redis_client.llen(queue_key(settings, f"generate.{WIDE}", priority)) == 2
    assert redis_client.llen(queue_key(settings, "generate.nope", priority)) == 0
    assert redis_client.llen(queue_key(settings, "generate", priority)) == 0

    with sessions.begin() as s:  # the runnable lines ended as a worker would end them
        s.execute(
            text(
                "UPDATE jobs SET status = 'succeeded', output_token_ids = '{72,105}', output_text = :t, "
                "finish_reason = 'length', finished_at = now() WHERE batch_id = :b AND status = 'queued'"
            ),
            {"t": b"Hi", "b": created["id"]},
        )
    done = client.get(f"/v1/batches/{created['id']}", headers=headers).json
    assert done["status"] == "completed", done
    assert done["request_counts"] == {"total": 3, "completed": 2, "failed": 1}
    assert [x["custom_id"] for x in file_lines(client, headers, done["output_file_id"])] == ["req-0", "req-2"]
    [error_line] = file_lines(client, headers, done["error_file_id"])
    assert error_line["custom_id"] == "req-1"
    message = f"model: the model `nope` does not exist here; this server serves `tiny-llama`, `{WIDE}`"
    assert error_line["error"] == {"code": "model_not_found", "message": message}
    assert error_line["response"] == {  # what POST /v1/completions answers for that request alone
        "status_code": 404,
        "request_id": str(refused.id),
        "body": {
            "error": {
                "message": message,
                "type": "invalid_request_error",
                "param": "model",
                "code": "model_not_found",
            }
        },
    }
    alone = client.post("/v1/completions", json={"prompt": "hi", "model": "nope"}, headers=headers)
    assert alone.status_code == 404 and alone.json == error_line["response"]["body"]


def test_a_file_naming_no_served_model_completes_with_every_line_failed(fleet, auth):  # noqa: F811
    app, _ = fleet
    client, headers = app.test_client(), auth()
    created = create_batch(client, headers, [line(0, model="nope"), line(1, model="other")])
    assert created["status"] == "in_progress" and created["model"] is None, created
    done = client.get(f"/v1/batches/{created['id']}", headers=headers).json
    assert done["status"] == "completed" and done["output_file_id"] is None, done
    assert done["request_counts"] == {"total": 2, "completed": 0, "failed": 2}
    errors = file_lines(client, headers, done["error_file_id"])
    assert [(e["custom_id"], e["response"]["status_code"]) for e in errors] == [
        ("req-0", 404),
        ("req-1", 404),
    ]
