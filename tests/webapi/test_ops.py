"""/healthz, /metrics and /openapi.json."""

from __future__ import annotations

import importlib.metadata

from webapi import create_app
from webapi.schemas import JobSubmit


def test_healthz_ok(client):
    r = client.get("/healthz")
    assert r.status_code == 200 and r.json == {"status": "ok", "database": "ok", "broker": "ok"}


def test_healthz_and_api_answer_503_when_postgres_is_down(settings, auth):
    app = create_app(settings.replace(database_url="postgresql://postgres@127.0.0.1:1/genq"))
    client = app.test_client()
    health = client.get("/healthz")
    jobs = client.get("/jobs", headers={"Authorization": "Bearer gq_whatever"})
    app.extensions["genq"].close()
    assert health.status_code == 503 and health.json["error"] == {
        "code": "unavailable",
        "message": "database unavailable",
    }
    assert jobs.status_code == 503 and jobs.headers["Retry-After"]


def test_healthz_503_when_redis_is_down(settings, database):
    app = create_app(settings.replace(redis_url="redis://127.0.0.1:1/0"))
    r = app.test_client().get("/healthz")
    app.extensions["genq"].close()
    assert r.status_code == 503 and r.json["error"]["message"] == "broker unavailable"


def test_metrics(client, auth):
    client.post("/jobs", json={"prompt": "hi", "priority": 7}, headers=auth())
    r = client.get("/metrics")
    assert r.status_code == 200 and r.mimetype == "text/plain"
    text = r.get_data(as_text=True)
    assert 'genq_jobs_submitted_total{priority="7"}' in text
    assert 'genq_jobs{status="queued"}' in text
    assert 'genq_http_requests_total{endpoint="/jobs",method="POST",status="202"}' in text


def test_openapi_is_generated_from_the_schemas(client, app):
    doc = client.get("/openapi.json").json
    assert doc["openapi"].startswith("3.1")
    assert set(doc["paths"]) == {
        "/jobs",
        "/jobs/bulk",
        "/jobs/ended",
        "/usage",
        "/jobs/{job_id}",
        "/jobs/{job_id}/events",
        "/jobs/{job_id}/cancel",
        "/healthz",
        "/health",
        "/version",
        "/tokenize",
        "/detokenize",
        "/tokenizer_info",
        "/v1/models",
        "/v1/models/{model_id}",
        "/models",
        "/v1/files",
        "/v1/files/{file_id}",
        "/v1/files/{file_id}/content",
        "/v1/batches",
        "/v1/batches/{batch_id}",
        "/v1/batches/{batch_id}/cancel",
        "/v1/chat/completions",
        "/v1/completions",
    }
    chat = doc["paths"]["/v1/chat/completions"]["post"]
    assert chat["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith(
        "/ChatCompletionCreate"
    )
    assert chat["responses"]["200"]["content"]["application/json"]["schema"]["$ref"].endswith(
        "/ChatCompletion"
    )
    assert "Retry-After" in chat["responses"]["429"]["headers"]
    listing = doc["paths"]["/v1/files"]["get"]
    assert {p["name"] for p in listing["parameters"]} == {"purpose", "limit", "order", "after"}
    create = doc["paths"]["/jobs"]["post"]
    assert create["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith("/JobSubmit")
    assert {"202", "400", "401", "413", "415", "422", "429", "503"} <= set(create["responses"])
    for path, method in (("/jobs", "post"), ("/jobs", "get"), ("/jobs/{job_id}", "get")):
        for status in ("429", "503"):  # rate limit, queue caps, database down: each says when to retry
            answer = doc["paths"][path][method]["responses"][status]
            assert answer["headers"]["Retry-After"]["schema"] == {"type": "integer"}, (path, status)
    assert "429" not in doc["paths"]["/healthz"]["get"]["responses"]
    assert create["security"] == [{"bearer": []}] and "security" not in doc["paths"]["/healthz"]["get"]
    schema = doc["components"]["schemas"]["JobSubmit"]
    expected = JobSubmit.model_json_schema(ref_template="#/components/schemas/{model}")
    assert schema == {k: v for k, v in expected.items() if k != "$defs"}  # nested models are components
    assert schema["additionalProperties"] is False
    upload = doc["paths"]["/v1/files"]["post"]["requestBody"]["content"]
    assert upload["multipart/form-data"]["schema"]["$ref"].endswith("/FileUpload")
    batch_errors = doc["paths"]["/v1/batches"]["post"]["responses"]["400"]["content"]["application/json"]
    assert batch_errors["schema"]["$ref"].endswith("/OpenAIError")  # /v1 answers errors in OpenAI's shape
    listing = {p["name"] for p in doc["paths"]["/jobs"]["get"]["parameters"]}
    assert listing == {"status", "limit", "cursor"}
    for ref in _refs(doc):
        assert ref.removeprefix("#/components/schemas/") in doc["components"]["schemas"], ref


def _refs(node):
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "$ref":
                yield value
            else:
                yield from _refs(value)
    elif isinstance(node, list):
        for value in node:
            yield from _refs(value)


def test_vllms_health_version_and_models(client, auth, settings):
    assert client.get("/health").status_code == 200
    version = client.get("/version")
    assert version.status_code == 200 and version.json["version"] == importlib.metadata.version("genq")
    models = client.get("/v1/models", headers=auth())
    assert models.status_code == 200 and models.json["object"] == "list"
    [card] = models.json["data"]
    assert card["id"] == card["root"] == settings.model and card["object"] == "model"
    assert card["max_model_len"] == settings.max_model_len
    assert client.get("/v1/models").status_code == 401
