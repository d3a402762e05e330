"""The Batch API's files and batches over the real app, Postgres and Redis (no worker: jobs stay queued,
or are ended here by writing their rows as a worker would)."""

from __future__ import annotations

import io
import json
import uuid

from sqlalchemy import text

from batching.tokenizer import load_tokenizer
from contract.dispatch import QUEUE

CHAT = "/v1/chat/completions"


def chat_line(i: int, **body) -> dict:
    body = {
        "model": "tiny-llama",
        "messages": [{"role": "user", "content": f"Question {i}?"}],
        "max_tokens": 5,
        **body,
    }
    return {"custom_id": f"req-{i}", "method": "POST", "url": CHAT, "body": body}


def jsonl(lines) -> bytes:
    return b"".join(
        (line if isinstance(line, bytes) else json.dumps(line).encode()) + b"\n" for line in lines
    )


def upload(client, headers, content: bytes, name: str = "in.jsonl"):
    return client.post(
        "/v1/files",
        data={"purpose": "batch", "file": (io.BytesIO(content), name)},
        headers=headers,
        content_type="multipart/form-data",
    )


def create(client, headers, file_id: str, endpoint: str = CHAT, **extra):
    body = {"input_file_id": file_id, "endpoint": endpoint, "completion_window": "24h", **extra}
    return client.post("/v1/batches", json=body, headers=headers)


def batch_jobs(sessions, batch_id: str) -> list:
    with sessions() as s:
        return s.execute(
            text("SELECT * FROM jobs WHERE batch_id = :b ORDER BY batch_index"), {"b": batch_id}
        ).all()


def test_file_upload_read_content_and_delete(client, auth):
    headers = auth()
    content = jsonl(chat_line(i) for i in range(3)) + b"\n  \n"  # blank lines are not requests
    r = upload(client, headers, content)
    assert r.status_code == 200, r.json
    file = r.json
    assert file["object"] == "file" and file["purpose"] == "batch" and file["filename"] == "in.jsonl"
    assert file["bytes"] == len(content) and file["id"].startswith("file-")
    assert client.get(f"/v1/files/{file['id']}", headers=headers).json == file
    body = client.get(f"/v1/files/{file['id']}/content", headers=headers)
    assert body.status_code == 200 and body.data == content
    gone = client.delete(f"/v1/files/{file['id']}", headers=headers)
    assert gone.json == {"id": file["id"], "object": "file", "deleted": True}
    missing = client.get(f"/v1/files/{file['id']}", headers=headers)
    assert missing.status_code == 404 and missing.json["error"]["type"] == "invalid_request_error"


def test_upload_limits_are_named(settings, database, redis_client, new_key):

    from webapi import create_app

    app = create_app(settings.replace(max_batch_requests=2, max_file_bytes=4000))
    try:
        client, headers = app.test_client(), {"Authorization": f"Bearer {new_key()}"}
        r = upload(client, headers, jsonl(chat_line(i) for i in range(3)))
        assert r.status_code == 400 and "more than 2 requests" in r.json["error"]["message"]
        assert r.json["error"]["code"] == "too_many_batch_requests"  # not the 429's too_many_requests
        r = upload(client, headers, b'{"x": "' + b"y" * 5000 + b'"}\n')
        assert r.status_code in (400, 413) and "4,000 bytes" in r.json["error"]["message"]
        r = client.post(
            "/v1/files", data={"purpose": "fine-tune"}, headers=headers, content_type="multipart/form-data"
        )
        assert r.status_code == 400 and r.json["error"]["param"] == "purpose"
    finally:
        app.extensions["genq"].close()


def test_a_batch_queues_one_job_per_line_at_low_priority_in_one_go(
    client, auth, sessions, redis_client, settings
):
    headers = auth()
    lines = [chat_line(i, temperature=0, seed=i, stop=["\n"]) for i in range(5)]
    file_id = upload(client, headers, jsonl(lines)).json["id"]
    key = f"{settings.redis_key_prefix}{QUEUE}:8"
    before = redis_client.llen(key)
    r = create(client, headers, file_id, metadata={"run": "nightly"})
    assert r.status_code == 200, r.json
    batch = r.json
    assert batch["object"] == "batch" and batch["status"] == "in_progress" and batch["errors"] is None
    assert batch["request_counts"] == {"total": 5, "completed": 0, "failed": 0}
    assert batch["in_progress_at"] and batch["expires_at"] - batch["created_at"] == 24 * 3600
    assert batch["metadata"] == {"run": "nightly"} and batch["input_file_id"] == file_id
    assert redis_client.llen(key) == before + 5  # default batch priority 8
    rows = batch_jobs(sessions, batch["id"])
    tokenizer = load_tokenizer("tiny-llama")
    for i, row in enumerate(rows):
        expected = tokenizer.apply_chat_template(
            [{"role": "user", "content": f"Question {i}?"}], add_generation_prompt=True, return_dict=True
        )["input_ids"]
        assert row.input_ids == expected and row.prompt_tokens == len(expected)
        assert (row.priority, row.max_tokens, row.temperature, row.seed, row.stop) == (8, 5, 0.0, i, ["\n"])
        assert row.metadata == {"batch_id": batch["id"], "custom_id": f"req-{i}"} and row.batch_index == i
        assert row.enqueued_at is not None  # recorded as sent: the reconciler leaves them be
    urgent = create(client, headers, file_id, metadata={"priority": "2"}).json
    assert {row.priority for row in batch_jobs(sessions, urgent["id"])} == {2}
    listed = client.get("/v1/batches", query_string={"limit": 1}, headers=headers).json
    assert [b["id"] for b in listed["data"]] == [urgent["id"]] and listed["has_more"]
    after = client.get("/v1/batches", query_string={"after": listed["last_id"]}, headers=headers).json
    assert [b["id"] for b in after["data"]] == [batch["id"]] and not after["has_more"]


def test_a_malformed_file_fails_validation_with_every_bad_line_and_queues_nothing(
    client, auth, sessions, redis_client, settings
):
    headers = auth()
    lines = [
        chat_line(0),
        b"{not json",
        {"method": "POST", "url": CHAT, "body": {}},  # no custom_id
        chat_line(0),  # custom_id used above
        chat_line(4, n=2),
        dict(chat_line(5), url="/v1/completions"),
        chat_line(6, messages=[{"role": "user", "content": "x" * 5000}]),  # too long for max_model_len
        chat_line(7, logit_bias={"1": 500}),  # beyond 100
        chat_line(8),
    ]
    file_id = upload(client, headers, jsonl(lines)).json["id"]
    queued_before = sum(redis_client.llen(f"{settings.redis_key_prefix}{QUEUE}:{p}") for p in range(1, 10))
    r = create(client, headers, file_id)
    assert r.status_code == 200
    batch = r.json
    assert batch["status"] == "failed" and batch["failed_at"] and batch["request_counts"]["total"] == 0
    errors = {e["line"]: e for e in batch["errors"]["data"]}
    assert sorted(errors) == [2, 3, 4, 5, 6, 7, 8]
    assert errors[2]["code"] == "invalid_json_line"
    assert errors[3]["param"] == "custom_id"
    assert errors[4]["code"] == "duplicate_custom_id"
    assert errors[5]["param"] == "body.n" and "a batch line makes one choice" in errors[5]["message"]
    assert errors[6]["code"] == "mismatched_endpoint"
    assert errors[7]["code"] == "context_length_exceeded" and "max_model_len" in errors[7]["message"]
    assert errors[8]["param"] == "body.logit_bias.1" and "at most 100" in errors[8]["message"]
    assert batch_jobs(sessions, batch["id"]) == []
    queued_after = sum(redis_client.llen(f"{settings.redis_key_prefix}{QUEUE}:{p}") for p in range(1, 10))
    assert queued_after == queued_before


def test_batch_lines_carry_response_format_to_their_jobs(client, auth, sessions):
    headers = auth()
    schema = {"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"]}
    lines = [
        chat_line(0, response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}),
        chat_line(1, response_format={"type": "json_object"}),
        chat_line(2, response_format={"type": "text"}),
    ]
    batch = create(client, headers, upload(client, headers, jsonl(lines)).json["id"]).json
    assert batch["status"] == "in_progress", batch
    options = [row.options.get("json_schema") for row in batch_jobs(sessions, batch["id"])]
    assert [json.loads(o) if o else None for o in options] == [schema, {"type": "object"}, None]
    bad = [
        chat_line(0, response_format={"type": "json_schema", "json_schema": {"schema": {"type": "strin"}}})
    ]
    failed = create(client, headers, upload(client, headers, jsonl(bad)).json["id"]).json
    assert failed["status"] == "failed" and failed["errors"]["data"][0]["param"] == "body.response_format"


def test_batch_lines_carry_vllms_sampling_controls_to_their_jobs(client, auth, sessions):
    """logit_bias, min_tokens, include_stop_str_in_output and skip_special_tokens reach the jobs' options."""
    headers = auth()
    controls = {
        "logit_bias": {"65": -100, "7": 2.5},
        "min_tokens": 3,
        "include_stop_str_in_output": True,
        "skip_special_tokens": False,
    }
    lines = [chat_line(0, **controls), chat_line(1)]
    batch = create(client, headers, upload(client, headers, jsonl(lines)).json["id"]).json
    assert batch["status"] == "in_progress", batch
    options = [row.options for row in batch_jobs(sessions, batch["id"])]
    assert options[0] == {**controls, "logit_bias": {"65": -100.0, "7": 2.5}} and options[1] == {}


def test_another_tenant_sees_no_file_and_no_batch(client, auth):
    alice, bob = auth(), auth()
    file_id = upload(client, alice, jsonl([chat_line(0)])).json["id"]
    batch_id = create(client, alice, file_id).json["id"]
    for path in (f"/v1/files/{file_id}", f"/v1/files/{file_id}/content", f"/v1/batches/{batch_id}"):
        r = client.get(path, headers=bob)
        assert r.status_code == 404 and r.json["error"]["code"] == "not_found", path
    assert client.delete(f"/v1/files/{file_id}", headers=bob).status_code == 404
    assert client.post(f"/v1/batches/{batch_id}/cancel", headers=bob).status_code == 404
    assert create(client, bob, file_id).status_code == 404
    assert client.get("/v1/batches", headers=bob).json["data"] == []
    assert client.get(f"/v1/batches/{batch_id}", headers=alice).status_code == 200


def test_finalizing_writes_output_and_error_files_in_openai_shape(client, auth, sessions):
    headers = auth()
    file_id = upload(client, headers, jsonl(chat_line(i) for i in range(3))).json["id"]
    batch = create(client, headers, file_id).json
    rows = batch_jobs(sessions, batch["id"])
    with sessions.begin() as s:  # as the worker writes results: two succeed, one fails
        for row in rows[:2]:
            s.execute(
                text(
                    "UPDATE jobs SET status = 'succeeded', output_token_ids = '{72,105}', output_text = :t, "
                    "finish_reason = 'length', finished_at = now() WHERE id = :id"
                ),
                {"t": b"Hi", "id": row.id},
            )
        s.execute(
            text(
                "UPDATE jobs SET status = 'failed', error_code = 'engine_error', error_message = 'boom', "
                "finished_at = now() WHERE id = :id"
            ),
            {"id": rows[2].id},
        )
    done = client.get(f"/v1/batches/{batch['id']}", headers=headers).json
    assert done["status"] == "completed" and done["completed_at"] and done["finalizing_at"]
    assert done["request_counts"] == {"total": 3, "completed": 2, "failed": 1}
    output = client.get(f"/v1/files/{done['output_file_id']}/content", headers=headers).data.decode()
    lines = [json.loads(line) for line in output.splitlines()]
    assert [line["custom_id"] for line in lines] == ["req-0", "req-1"]
    body = lines[0]["response"]["body"]
    assert lines[0]["response"]["status_code"] == 200 and lines[0]["error"] is None
    assert body["object"] == "chat.completion" and body["model"] == "tiny-llama"
    assert body["choices"] == [
        {
            "index": 0,
            "message": {"role": "assistant", "content": "Hi"},
            "logprobs": None,
            "finish_reason": "length",
        }
    ]
    assert body["usage"] == {
        "prompt_tokens": rows[0].prompt_tokens,
        "completion_tokens": 2,
        "total_tokens": rows[0].prompt_tokens + 2,
    }
    errors = client.get(f"/v1/files/{done['error_file_id']}/content", headers=headers).data.decode()
    [failed] = [json.loads(line) for line in errors.splitlines()]
    assert failed["custom_id"] == "req-2" and failed["response"] is None
    assert failed["error"] == {"code": "engine_error", "message": "boom"}
    assert client.get(f"/v1/batches/{batch['id']}", headers=headers).json == done  # finalized once


def test_cancel_cancels_every_job_then_the_batch_ends_cancelled(client, auth, sessions):
    headers = auth()
    file_id = upload(client, headers, jsonl(chat_line(i) for i in range(4))).json["id"]
    batch = create(client, headers, file_id).json
    r = client.post(f"/v1/batches/{batch['id']}/cancel", headers=headers)
    assert (
        r.status_code == 200 and r.json["status"] in ("cancelling", "cancelled") and r.json["cancelling_at"]
    )
    assert {row.status for row in batch_jobs(sessions, batch["id"])} == {"cancelled"}
    done = client.get(f"/v1/batches/{batch['id']}", headers=headers).json
    assert done["status"] == "cancelled" and done["cancelled_at"] and done["output_file_id"] is None
    assert done["request_counts"] == {"total": 4, "completed": 0, "failed": 4}
    errors = client.get(f"/v1/files/{done['error_file_id']}/content", headers=headers).data.decode()
    assert [json.loads(line)["error"]["code"] for line in errors.splitlines()] == ["batch_cancelled"] * 4
    again = client.post(f"/v1/batches/{batch['id']}/cancel", headers=headers)
    assert again.status_code == 200 and again.json["status"] == "cancelled"


def test_v1_errors_take_openai_shape(client, auth):
    headers = auth()
    r = client.post(
        "/v1/batches", json={"input_file_id": "file-x", "endpoint": "/v1/embeddings"}, headers=headers
    )
    assert r.status_code == 400
    assert set(r.json["error"]) == {"message", "type", "param", "code"}
    assert r.json["error"]["type"] == "invalid_request_error" and r.json["error"]["param"] == "endpoint"
    r = client.get("/v1/batches", headers={"Authorization": "Bearer nope"})
    assert r.status_code == 401 and r.json["error"]["type"] == "authentication_error"
    r = client.get(f"/v1/batches/batch_{uuid.uuid4().hex}", headers=headers)
    assert r.status_code == 404 and r.json["error"]["message"].startswith("no such batch")


def test_the_reconciler_finalizes_a_batch_nobody_polls(client, auth, sessions, settings):
    from workers.reconciler import finalize_batches

    headers = auth()
    file_id = upload(client, headers, jsonl(chat_line(i) for i in range(2))).json["id"]
    batch = create(client, headers, file_id).json
    finalize_batches(sessions, settings)  # other tests' batches may be ready: finalize them first
    with sessions.begin() as s:
        s.execute(
            text(
                "UPDATE jobs SET status = 'succeeded', output_text = :t, finish_reason = 'stop', "
                "finished_at = now() WHERE batch_id = :b"
            ),
            {"t": b"ok", "b": batch["id"]},
        )
    assert finalize_batches(sessions, settings) >= 1
    with sessions() as s:
        status, output = s.execute(
            text("SELECT status, output_file_id FROM batches WHERE id = :b"), {"b": batch["id"]}
        ).one()
    assert status == "completed" and output is not None
    assert finalize_batches(sessions, settings) == 0  # nothing left to do: finalized once


def test_redis_down_at_submission_leaves_the_batch_for_the_reconciler(settings, database, new_key, sessions):

    from tests.conftest import free_port
    from webapi import create_app

    down = settings.replace(redis_url=f"redis://127.0.0.1:{free_port()}/0")  # nothing listens
    app = create_app(down)
    try:
        client, headers = app.test_client(), {"Authorization": f"Bearer {new_key()}"}
        file_id = upload(client, headers, jsonl(chat_line(i) for i in range(3))).json["id"]
        batch = create(client, headers, file_id).json
        assert batch["status"] == "in_progress" and batch["request_counts"]["total"] == 3
        rows = batch_jobs(sessions, batch["id"])
        # committed and marked unsent: the reconciler's unsent_jobs picks them up
        assert [(r.status, r.enqueued_at) for r in rows] == [("queued", None)] * 3
    finally:
        app.extensions["genq"].close()


def test_a_batch_past_its_window_expires_keeping_what_finished(
    settings, database, redis_client, new_key, sessions
):
    import time

    from webapi import create_app
    from workers.reconciler import expire_batches

    app = create_app(settings.replace(batch_window_seconds=3.0))
    try:
        client, headers = app.test_client(), {"Authorization": f"Bearer {new_key()}"}
        file_id = upload(client, headers, jsonl(chat_line(i) for i in range(4))).json["id"]
        r = create(client, headers, file_id, completion_window="1h")
        assert r.status_code == 400 and r.json["error"]["param"] == "completion_window", r.json
        batch = create(client, headers, file_id).json
        assert batch["expires_at"] - batch["created_at"] in (3, 4) and batch["expired_at"] is None
        rows = batch_jobs(sessions, batch["id"])
        with sessions.begin() as s:  # as a worker would: one request done, one running, two still queued
            s.execute(
                text(
                    "UPDATE jobs SET status = 'succeeded', output_token_ids = '{72}', output_text = :t, "
                    "finish_reason = 'length', finished_at = now() WHERE id = :id"
                ),
                {"t": b"H", "id": rows[0].id},
            )
            s.execute(
                text(
                    "UPDATE jobs SET status = 'running', worker_id = 'w', output_token_ids = '{72}', "
                    "lease_expires_at = now() + interval '1 minute' WHERE id = :id"
                ),
                {"id": rows[1].id},
            )
        assert expire_batches(sessions, settings) == 0  # not due yet: nothing happens
        assert client.get(f"/v1/batches/{batch['id']}", headers=headers).json["status"] == "in_progress"
        time.sleep(max(0.0, batch["expires_at"] + 1 - time.time()) + 0.1)  # Unix seconds, rounded down
        assert expire_batches(sessions, settings) == 1
        assert expire_batches(sessions, settings) == 0  # expired once
        done = client.get(f"/v1/batches/{batch['id']}", headers=headers).json
        assert done["status"] == "expired" and done["expired_at"] >= done["expires_at"] - 1
        assert done["completed_at"] is None and done["cancelled_at"] is None
        assert done["request_counts"] == {"total": 4, "completed": 1, "failed": 3}
        assert [(r.status, r.error_code) for r in batch_jobs(sessions, batch["id"])] == [
            ("succeeded", None),
            *[("cancelled", "batch_expired")] * 3,
        ]
        output = client.get(f"/v1/files/{done['output_file_id']}/content", headers=headers).data.decode()
        [line] = [json.loads(x) for x in output.splitlines()]
        assert (
            line["custom_id"] == "req-0"
            and line["response"]["body"]["choices"][0]["message"]["content"] == "H"
        )
        errors = client.get(f"/v1/files/{done['error_file_id']}/content", headers=headers).data.decode()
        lines = [json.loads(x) for x in errors.splitlines()]
        assert [x["custom_id"] for x in lines] == ["req-1", "req-2", "req-3"]
        assert {x["error"]["code"] for x in lines} == {"batch_expired"}
        r = client.post(f"/v1/batches/{batch['id']}/cancel", headers=headers)
        assert r.status_code == 409 and "expired" in r.json["error"]["message"]
    finally:
        app.extensions["genq"].close()


def test_list_files_pages_filters_and_orders_as_openai_does(client, auth):
    headers, other = auth(), auth()
    ids = [upload(client, headers, jsonl([chat_line(i)]), name=f"f{i}.jsonl").json["id"] for i in range(5)]
    upload(client, other, jsonl([chat_line(9)]))  # another tenant's: never listed
    page = client.get("/v1/files", query_string={"limit": 2}, headers=headers).json
    assert page["object"] == "list" and [f["id"] for f in page["data"]] == ids[:2:-1][:2]
    assert page["has_more"] and (page["first_id"], page["last_id"]) == (ids[4], ids[3])
    rest = client.get("/v1/files", query_string={"after": page["last_id"]}, headers=headers).json
    assert [f["id"] for f in rest["data"]] == ids[2::-1] and not rest["has_more"]
    oldest = client.get("/v1/files", query_string={"order": "asc", "limit": 3}, headers=headers).json
    assert [f["id"] for f in oldest["data"]] == ids[:3] and oldest["has_more"]
    after = client.get("/v1/files", query_string={"order": "asc", "after": ids[3]}, headers=headers).json
    assert [f["id"] for f in after["data"]] == ids[4:] and not after["has_more"]
    assert client.get("/v1/files", query_string={"purpose": "batch_output"}, headers=headers).json == {
        "object": "list",
        "data": [],
        "first_id": None,
        "last_id": None,
        "has_more": False,
    }
    for query, param in (({"limit": 0}, "limit"), ({"order": "up"}, "order"), ({"after": "x y"}, "after")):
        r = client.get("/v1/files", query_string=query, headers=headers)
        assert r.status_code == 400 and r.json["error"]["param"] == param, r.json


def test_the_openai_client_lists_files_and_sees_only_its_own(server, new_key):
    import openai

    alice, bob = (
        openai.OpenAI(base_url=f"{server}/v1", api_key=new_key(), max_retries=0, timeout=30) for _ in range(2)
    )
    mine = [
        alice.files.create(file=(f"a{i}.jsonl", jsonl([chat_line(i)])), purpose="batch") for i in range(3)
    ]
    theirs = bob.files.create(file=("b.jsonl", jsonl([chat_line(0)])), purpose="batch")
    listed = alice.files.list()
    assert [f.id for f in listed.data] == [f.id for f in reversed(mine)]
    assert listed.data[0].filename == "a2.jsonl" and listed.data[0].purpose == "batch"
    # the client pages by itself: `after` the last id of each page, while has_more
    assert [f.id for f in alice.files.list(limit=1, order="asc")] == [f.id for f in mine]
    assert [f.id for f in bob.files.list(purpose="batch")] == [theirs.id]


def test_an_invalid_line_after_the_first_group_still_queues_nothing(
    client, auth, sessions, redis_client, settings
):
    """The first 1,000 lines are COPYed before line 1,201 is read: the savepoint undoes them."""
    headers = auth()
    lines = [chat_line(i) for i in range(1300)]
    lines[1200] = chat_line(1200, temperature=7)
    file_id = upload(client, headers, jsonl(lines)).json["id"]
    queued_before = sum(redis_client.llen(f"{settings.redis_key_prefix}{QUEUE}:{p}") for p in range(1, 10))
    batch = create(client, headers, file_id).json
    assert batch["status"] == "failed" and [(e["line"], e["param"]) for e in batch["errors"]["data"]] == [
        (1201, "body.temperature")
    ]
    assert batch_jobs(sessions, batch["id"]) == []
    queued_after = sum(redis_client.llen(f"{settings.redis_key_prefix}{QUEUE}:{p}") for p in range(1, 10))
    assert queued_after == queued_before
    ok = create(client, headers, upload(client, headers, jsonl(lines[:1200])).json["id"]).json
    assert ok["status"] == "in_progress" and len(batch_jobs(sessions, ok["id"])) == 1200


def test_job_rows_survive_copys_text_format(client, auth, sessions):
    """job_row writes COPY's text format itself: values with its delimiters and escapes (tab, newline,
    backslash, quotes, braces, commas, non-ASCII) come back from Postgres exactly as sent."""
    headers = auth()
    nasty = 'a\tb\nc\\d"e{f}g,h \\N é漢字\r'
    lines = [
        {
            "custom_id": nasty,
            "method": "POST",
            "url": "/v1/completions",
            "body": {
                "prompt": nasty,
                "stop": [nasty, "\n", "\\", '"', "{}", "NULL"],
                "seed": 2**63 - 1,
                "top_p": 0.25,
            },
        },
        {
            "custom_id": "ids",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"prompt": [1, 2, 258], "max_tokens": 3, "temperature": 1e-05},
        },
    ]
    file_id = upload(client, headers, jsonl(lines)).json["id"]
    batch = create(client, headers, file_id, endpoint="/v1/completions").json
    assert batch["status"] == "in_progress", batch
    first, second = batch_jobs(sessions, batch["id"])
    assert bytes(first.prompt).decode() == nasty and first.input_ids is None
    assert first.stop == [nasty, "\n", "\\", '"', "{}", "NULL"]
    assert first.metadata == {"batch_id": batch["id"], "custom_id": nasty}
    assert (first.seed, first.top_p, first.max_tokens, first.top_k) == (2**63 - 1, 0.25, 16, 0)
    assert bytes(first.output_text) == b"" and first.output_token_ids == [] and first.attempts == 0
    assert second.prompt is None and second.input_ids == [1, 2, 258] and second.temperature == 1e-05
    assert second.stop == [] and second.seed is None and second.batch_index == 1
