"""One validation contract (contract/fields.py, webapi/validation.py): the same value gets the same verdict,
in the same words, on POST /jobs, POST /v1/completions (and /v1/chat/completions for the sampling fields)
and in a line of a /v1/completions batch, over the real app, Postgres and Redis (no worker).

A refused value answers 422 on /jobs and 400 on /v1 (OpenAI's status), with a message that starts with the
field as OpenAI writes it (`stop[0]`), `param` set on /v1, and the same words after the field everywhere;
a batch line reports it under `body.<field>`."""

from __future__ import annotations

import io
import json
import typing

import pytest
from prometheus_client import REGISTRY

from batching.tokenizer import load_tokenizer

PROMPT = "Once upon"
PROMPT_TOKENS = len(PROMPT) + 1  # tiny-llama: one token a byte, and BOS
VOCAB = len(load_tokenizer("tiny-llama"))
SAMPLING = {
    "max_tokens",
    "temperature",
    "top_p",
    "seed",
    "stop",
    "logit_bias",
    "min_tokens",
}  # the fields chat shares too
TOKEN_IDS = ("input_ids", "prompt")  # token ids: `input_ids` on /jobs, `prompt` on /v1/completions

# (field on /jobs and /v1, or (on /jobs, on /v1); value; what follows the field's name; the problem)
BAD = [
    ("max_tokens", "8", "", 'expected an integer, got a string ("8")'),
    ("max_tokens", 8.5, "", "expected an integer, got a number (8.5)"),
    ("max_tokens", 8.0, "", "expected an integer, got a number (8.0)"),
    ("max_tokens", True, "", "expected an integer, got a boolean (true)"),
    ("max_tokens", 0, "", "must be at least 1, got 0"),
    (
        "max_tokens",
        10**9,
        "",
        f"1000000000 tokens to generate + {PROMPT_TOKENS} prompt tokens is more than max_model_len 2048 "
        f"(MAX_MODEL_LEN); with this prompt, ask for at most {2048 - PROMPT_TOKENS}",
    ),
    ("temperature", "0.5", "", 'expected a number, got a string ("0.5")'),
    ("temperature", -0.5, "", "must be at least 0.0, got -0.5"),
    ("temperature", 2.5, "", "must be at most 2.0, got 2.5"),
    ("top_p", 0, "", "must be more than 0.0, got 0"),
    ("top_p", [1], "", "expected a number, got an array"),
    ("seed", -3, "", "must be at least 0, got -3"),
    ("seed", "7", "", 'expected an integer, got a string ("7")'),
    ("seed", 2**63, "", f"must be at most {2**63 - 1}, got {2**63}"),
    ("stop", 5, "", "expected a string or an array, got an integer (5)"),
    ("stop", {"a": 1}, "", "expected a string or an array, got an object"),
    ("stop", "", "", "must not be empty"),
    ("stop", ["a", ""], "[1]", "must not be empty"),
    ("stop", ["x" * 129], "[0]", "must be at most 128 characters, got 129"),
    ("stop", ["a\x00"], "[0]", "NUL characters are not supported"),
    ("stop", ["a"] * 9, "", "must hold at most 8 items, got 9"),
    ("prompt", "", "", "must not be empty"),
    (TOKEN_IDS, [], "", "must hold at least 1 item, got 0"),
    (TOKEN_IDS, [1, -1], "[1]", "must be at least 0, got -1"),
    (TOKEN_IDS, [1, 2**31], "[1]", f"must be less than {2**31}, got {2**31}"),
    (TOKEN_IDS, [1, "2"], "[1]", 'expected an integer, got a string ("2")'),
    (TOKEN_IDS, [1, VOCAB], "", f"token ids must be below {VOCAB}, the vocabulary size of tiny-llama"),
    (
        TOKEN_IDS,
        [1] * 2048,
        "",
        "prompt too long for the model: its 2048 tokens leave no room to generate within max_model_len 2048 "
        "(MAX_MODEL_LEN)",
    ),
    ("min_tokens", -1, "", "must be at least 0, got -1"),
    ("min_tokens", 5, "", "must be at most max_tokens (4), got 5"),
    ("logit_bias", {"abc": 1}, "", 'keys are token ids as decimal strings, such as "50256"; got "abc"'),
    ("logit_bias", {"5": 101}, ".5", "must be at most 100.0, got 101"),
    ("logit_bias", {"5": "1"}, ".5", 'expected a number, got a string ("1")'),
    (
        "logit_bias",
        {str(VOCAB): 1},
        "",
        f"token id {VOCAB} is outside the vocabulary of the model `tiny-llama`: ids are below {VOCAB}",
    ),
    ("logit_bias", {str(i): 1 for i in range(301)}, "", "must hold at most 300 items"),
    (
        "colour",
        "red",
        "",
        "not a field genq takes here (genq refuses what it cannot honour rather than ignore it)",
    ),
]
# genq's `priority` is a field of /jobs and of a synchronous /v1 call; a batch line has none (its batch's)
BAD_PRIORITY = [
    ("priority", 10, "", "must be at most 9, got 10"),
    ("priority", "1", "", 'expected an integer, got a string ("1")'),
    ("priority", 1.0, "", "expected an integer, got a number (1.0)"),
]
# accepted everywhere: an integer is a number, stop may be one string, null is the default, NUL in a prompt
GOOD = [
    ("temperature", 1),
    ("top_p", 1),
    ("stop", "x"),
    ("stop", []),
    ("max_tokens", None),
    ("temperature", None),
    ("seed", None),
    ("seed", 0),
    ("prompt", "nul\x00inside"),
    (TOKEN_IDS, [0, VOCAB - 1]),
    ("logit_bias", {"5": -100, "0": 100, str(VOCAB - 1): 0.5}),
    ("logit_bias", {}),
    ("min_tokens", 4),
]


def fields(field) -> tuple[str, str]:
    return field if isinstance(field, tuple) else (field, field)


def jobs_body(field, value) -> dict:
    name = fields(field)[0]
    body = {"max_tokens": 4, name: value}
    return body if name == "input_ids" else {"prompt": PROMPT, **body}


def v1_body(field, value) -> dict:
    return {"model": "tiny-llama", "prompt": PROMPT, "max_tokens": 4, fields(field)[1]: value}


def chat_body(field, value) -> dict:
    return {
        "model": "tiny-llama",
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 4,
        field: value,
    }


def line(i: int, body: dict) -> bytes:
    return json.dumps(
        {"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions", "body": body}
    ).encode()


def batch(client, headers, bodies: list[dict]) -> dict:
    """A /v1/completions batch of these bodies, created: in_progress, or failed with its lines' errors."""
    content = b"\n".join(line(i, body) for i, body in enumerate(bodies)) + b"\n"
    file = client.post(
        "/v1/files",
        data={"purpose": "batch", "file": (io.BytesIO(content), "in.jsonl")},
        headers=headers,
        content_type="multipart/form-data",
    ).json
    r = client.post(
        "/v1/batches",
        json={"input_file_id": file["id"], "endpoint": "/v1/completions", "completion_window": "24h"},
        headers=headers,
    )
    assert r.status_code == 200, r.json
    return r.json


@pytest.fixture(scope="module")
def app(settings, database, redis_client):
    """The API with a short completion timeout: no worker runs, so an accepted /v1 call times out (503)."""
    from webapi import create_app

    app = create_app(
        settings.replace(
            completion_timeout_seconds=0.05,
            model_aliases="gpt-4o-mini, genq",
            rate_limit="100000/second",
        )
    )
    yield app
    app.extensions["genq"].close()


@pytest.fixture(scope="module")
def headers(new_key) -> dict:
    return {"Authorization": f"Bearer {new_key()}"}


@pytest.fixture(scope="module")
def batch_errors(app, headers) -> dict[int, dict]:
    """The errors of one batch holding every bad row of BAD as a line (line n: row n - 1)."""
    created = batch(app.test_client(), headers, [v1_body(field, value) for field, value, _, _ in BAD])
    assert created["status"] == "failed"
    return {e["line"]: e for e in created["errors"]["data"]}


def accepted_by_v1(r) -> bool:
    """Past validation: the call made its job and waited for it (503 timeout: no worker runs here)."""
    return r.status_code == 503 and r.json["error"]["code"] == "timeout"


@pytest.mark.parametrize(("field", "value", "where", "problem"), BAD, ids=lambda v: repr(v)[:30])
def test_a_bad_value_gets_one_verdict_in_the_same_words_on_every_surface(
    app, headers, batch_errors, field, value, where, problem
):
    client = app.test_client()
    on_jobs, on_v1 = (name + where for name in fields(field))
    r = client.post("/jobs", json=jobs_body(field, value), headers=headers)
    assert r.status_code == 422 and r.json["error"]["message"] == f"{on_jobs}: {problem}", r.json
    r = client.post("/v1/completions", json=v1_body(field, value), headers=headers)
    assert r.status_code == 400, r.json
    assert r.json["error"]["message"] == f"{on_v1}: {problem}" and r.json["error"]["param"] == on_v1
    assert r.json["error"]["type"] == "invalid_request_error"
    if fields(field)[1] in SAMPLING or field == "colour":
        r = client.post("/v1/chat/completions", json=chat_body(fields(field)[1], value), headers=headers)
        assert r.status_code == 400 and r.json["error"]["param"] == on_v1, r.json
        if "prompt tokens" in problem:  # the chat's rendered prompt has more tokens
            assert "max_model_len 2048 (MAX_MODEL_LEN)" in r.json["error"]["message"]
        else:
            assert r.json["error"]["message"] == f"{on_v1}: {problem}"
    error = batch_errors[BAD.index((field, value, where, problem)) + 1]
    assert error["message"] == f"body.{on_v1}: {problem}" and error["param"] == f"body.{on_v1}", error


@pytest.mark.parametrize(("field", "value", "where", "problem"), BAD_PRIORITY, ids=repr)
def test_priority_gets_one_verdict_on_jobs_and_v1(app, headers, field, value, where, problem):
    client = app.test_client()
    r = client.post("/jobs", json=jobs_body(field, value), headers=headers)
    assert r.status_code == 422 and r.json["error"]["message"] == f"priority: {problem}", r.json
    for path, body in (
        ("/v1/completions", v1_body(field, value)),
        ("/v1/chat/completions", chat_body(field, value)),
    ):
        r = client.post(path, json=body, headers=headers)
        assert r.status_code == 400 and r.json["error"]["param"] == "priority", r.json
        assert r.json["error"]["message"] == f"priority: {problem}"


def test_good_values_are_accepted_on_every_surface(app, headers):
    client = app.test_client()
    for field, value in GOOD:
        r = client.post("/jobs", json=jobs_body(field, value), headers=headers)
        assert r.status_code == 202, (field, value, r.json)
        assert accepted_by_v1(client.post("/v1/completions", json=v1_body(field, value), headers=headers)), (
            field,
            value,
        )
    created = batch(client, headers, [v1_body(field, value) for field, value in GOOD])
    assert created["status"] == "in_progress" and created["request_counts"]["total"] == len(GOOD), created


def test_the_body_as_a_whole_and_unions_inside_messages(app, headers):
    client = app.test_client()
    r = client.post("/jobs", json=["prompt"], headers=headers)
    assert r.status_code == 422 and r.json["error"]["message"] == "body: expected an object, got an array"
    r = client.post("/v1/completions", json={"model": "tiny-llama", "prompt": 123}, headers=headers)
    assert r.json["error"]["message"] == "prompt: expected a string or an array, got an integer (123)"
    assert r.json["error"]["param"] == "prompt"  # not "prompt.constrained-str"
    bad = {"messages": [{"role": "user", "content": {"text": "hi"}}], "max_tokens": 4}
    for path in ("/jobs", "/v1/chat/completions"):
        r = client.post(path, json=bad, headers=headers)
        assert (
            r.json["error"]["message"] == "messages[0].content: expected a string or an array, got an object"
        )
    bad = {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}], "max_tokens": 4}
    r = client.post("/v1/chat/completions", json=bad, headers=headers)
    assert r.json["error"]["param"] == "messages[0].content[0].text", r.json
    assert r.json["error"]["message"].endswith(": expected a string, got an integer (5)")
    r = client.post("/jobs", json={"prompt": "x", "metadata": {"nested": {"a": 1}}}, headers=headers)
    assert r.json["error"]["message"] == (
        "metadata.nested: expected a string, an integer, a number or a boolean, got an object"
    )


def test_a_model_not_served_is_404_model_not_found(app, headers):
    client = app.test_client()
    for path, body in (
        ("/v1/completions", {"model": "gpt-4", "prompt": PROMPT, "max_tokens": 4}),
        ("/v1/chat/completions", {"model": "gpt-4", "messages": [{"role": "user", "content": "Hi"}]}),
        ("/v1/completions", {"model": "gpt-4", "prompt": PROMPT, "max_tokens": "8"}),  # the model first
    ):
        r = client.post(path, json=body, headers=headers)
        assert r.status_code == 404, r.json
        assert r.json["error"] == {
            "message": "model: the model `gpt-4` does not exist here; this server serves `genq`, `gpt-4o-mini`, "
            "`tiny-llama`",
            "type": "invalid_request_error",
            "param": "model",
            "code": "model_not_found",
        }
    for model in ("tiny-llama", "gpt-4o-mini", "genq", None):  # MODEL, its aliases, or left out
        body = {"model": model, "prompt": PROMPT, "max_tokens": 4}
        assert accepted_by_v1(client.post("/v1/completions", json=body, headers=headers)), model
    created = batch(
        client, headers, [{"model": "tiny-llama", "prompt": PROMPT}, {"model": "gpt-4", "prompt": PROMPT}]
    )  # a batch line naming it fails alone, in the error file (tests/webapi/test_batch_model.py)
    assert created["status"] == "in_progress" and created["errors"] is None, created
    assert created["request_counts"] == {"total": 2, "completed": 0, "failed": 1}


def test_a_body_over_the_limit_names_the_limit_and_its_setting(app, headers, settings):
    client = app.test_client()
    for path in ("/jobs", "/v1/completions"):
        r = client.post(path, json={"prompt": "x" * settings.max_body_bytes}, headers=headers)
        assert r.status_code == 413, r.json
        message = r.json["error"]["message"]
        assert f"{settings.max_body_bytes:,} bytes" in message and "MAX_BODY_BYTES" in message, message


@pytest.mark.parametrize("path", ["/jobs", "/v1/completions"])
def test_another_authorization_scheme_is_told_to_use_bearer(app, new_key, path):
    client, key = app.test_client(), new_key()
    for header, says in (
        (f"Token {key}", "use the Bearer scheme"),
        (f"Basic {key}", "use the Bearer scheme"),
        (key, "use the Bearer scheme"),  # the key alone: not echoed back
        ("Bearer ", "missing API key"),
        ("", "missing API key"),
    ):
        r = client.post(path, json={"prompt": "x"}, headers={"Authorization": header} if header else {})
        assert r.status_code == 401 and says in r.json["error"]["message"], (header, r.json)
        assert key not in r.json["error"]["message"]
        assert r.headers["WWW-Authenticate"].startswith("Bearer")


def test_a_repeated_cancel_is_counted_once(app, headers):
    client = app.test_client()
    job = client.post("/jobs", json={"prompt": PROMPT, "max_tokens": 4, "priority": 7}, headers=headers).json

    def cancelled() -> float:
        return REGISTRY.get_sample_value("genq_jobs_cancelled_total", {"priority": "7"}) or 0.0

    before = cancelled()
    for _ in range(3):
        r = client.post(f"/jobs/{job['id']}/cancel", headers=headers)
        assert r.status_code == 200 and r.json["status"] == "cancelled"
    assert cancelled() == before + 1


def test_every_request_body_is_a_strict_request_body(app):
    """A model any request body holds (a new /v1 field's own object included) takes the one rule: it derives
    from RequestBody, strict and refusing unknown fields. Query strings stay lax: their values are text."""
    from pydantic import BaseModel

    from contract.fields import RequestBody
    from webapi.openai_schemas import ChatBatchLine, CompletionBatchLine

    def models_in(annotation) -> list[type[BaseModel]]:
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            return [annotation]
        return [m for arg in typing.get_args(annotation) for m in models_in(arg)]

    bodies = [getattr(view, "operation", None) for view in app.view_functions.values()]
    todo = [op.body for op in bodies if op is not None and op.body is not None]
    todo += [ChatBatchLine, CompletionBatchLine]
    assert len(todo) >= 5
    seen: set[type[BaseModel]] = set()
    while todo:
        model = todo.pop()
        if model not in seen:
            seen.add(model)
            todo += [m for f in model.model_fields.values() for m in models_in(f.annotation)]
    lax = [
        m.__name__
        for m in seen
        if not issubclass(m, RequestBody)
        or not m.model_config.get("strict")
        or m.model_config.get("extra") != "forbid"
    ]
    assert not lax and len(seen) >= 10, (lax, sorted(m.__name__ for m in seen))


EXAMPLE_TIME = '"2026-11-27T01:00:00Z"'
BAD_DEADLINES = [
    (5, f"expected an RFC 3339 date-time such as {EXAMPLE_TIME}, got 5"),
    ("tomorrow", f'expected an RFC 3339 date-time such as {EXAMPLE_TIME}, got "tomorrow"'),
    ("2030-01-01", f'expected an RFC 3339 date-time such as {EXAMPLE_TIME}, got "2030-01-01"'),
    (
        "2030-01-01T10:00:00",
        f'give the time\'s offset from UTC (Z or +hh:mm), as in {EXAMPLE_TIME}; got "2030-01-01T10:00:00"',
    ),
    ("2001-01-01T10:00:00Z", "must be in the future; got 2001-01-01T10:00:00+00:00, and it is "),
]


@pytest.mark.parametrize(("value", "problem"), BAD_DEADLINES, ids=repr)
def test_a_bad_deadline_is_refused_naming_the_field(app, headers, value, problem):
    r = app.test_client().post("/jobs", json=jobs_body("deadline", value), headers=headers)
    assert r.status_code == 422 and r.json["error"]["message"].startswith(f"deadline: {problem}"), r.json


def test_a_deadline_is_stored_and_the_job_says_where_it_stands(app, headers):
    from datetime import datetime, timedelta, timezone

    client = app.test_client()
    margin = app.extensions["genq"].settings.deadline_margin_seconds
    for offset, seconds, status in (("+02:00", 3600, "on_track"), ("Z", margin / 2 + 1, "at_risk")):
        when = datetime.now(timezone.utc) + timedelta(seconds=seconds)
        text = when.astimezone(timezone(timedelta(hours=2)) if offset == "+02:00" else timezone.utc)
        r = client.post(
            "/jobs", json=jobs_body("deadline", text.isoformat().replace("+00:00", "Z")), headers=headers
        )
        assert r.status_code == 202, r.json
        got = client.get(f"/jobs/{r.json['id']}", headers=headers).json
        assert datetime.fromisoformat(got["deadline"]) == when
        assert got["deadline_status"] == status
    r = client.post("/jobs", json=jobs_body("max_tokens", 4), headers=headers)
    assert r.json["deadline"] is None and r.json["deadline_status"] is None
    spec = client.get("/openapi.json").json
    assert "deadline" in str(spec)


def test_a_batch_s_jobs_have_the_end_of_its_completion_window_as_their_deadline(app, headers, settings):
    from sqlalchemy import select

    from jobstore.models import Job

    created = batch(app.test_client(), headers, [v1_body("max_tokens", 4), v1_body("max_tokens", 5)])
    assert created["status"] == "in_progress"
    window = created["expires_at"] - created["created_at"]
    assert abs(window - settings.batch_window_seconds) <= 2
    with app.extensions["genq"].sessions() as s:
        deadlines = s.scalars(select(Job.deadline).where(Job.batch_id == created["id"])).all()
    assert len(deadlines) == 2 and {int(d.timestamp()) for d in deadlines} == {created["expires_at"]}
