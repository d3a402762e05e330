"""/healthz, /metrics and /openapi.json."""

from __future__ import annotations

from webapi import create_app
from webapi.schemas import JobCreate


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
    assert set(doc["paths"]) == {"/jobs", "/jobs/{job_id}", "/jobs/{job_id}/cancel", "/healthz"}
    create = doc["paths"]["/jobs"]["post"]
    assert create["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith("/JobCreate")
    assert {"202", "400", "401", "413", "415", "422"} <= set(create["responses"])
    assert create["security"] == [{"bearer": []}] and "security" not in doc["paths"]["/healthz"]["get"]
    schema = doc["components"]["schemas"]["JobCreate"]
    assert schema == JobCreate.model_json_schema(ref_template="#/components/schemas/{model}")
    assert schema["additionalProperties"] is False
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
