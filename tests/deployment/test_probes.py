"""/livez and /readyz (webapi/ops.py): liveness touches nothing, readiness is /healthz."""

from __future__ import annotations

from webapi import create_app


def test_live_and_ready_while_postgres_and_redis_answer(client):
    assert client.get("/livez").json == {"status": "ok"}
    ready, health = client.get("/readyz"), client.get("/healthz")
    assert ready.status_code == health.status_code == 200 and ready.json == health.json


def test_a_process_whose_dependencies_are_down_is_alive_and_not_ready(settings):
    app = create_app(
        settings.replace(
            database_url="postgresql://postgres@127.0.0.1:1/genq", redis_url="redis://127.0.0.1:1/0"
        )
    )
    client = app.test_client()
    live, ready = client.get("/livez"), client.get("/readyz")
    app.extensions["genq"].close()
    assert live.status_code == 200 and live.json == {"status": "ok"}
    assert ready.status_code == 503 and ready.headers["Retry-After"] == "5"
    assert ready.json["error"] == {"code": "unavailable", "message": "database unavailable"}


def test_probes_need_no_key_and_stay_out_of_the_openapi_document(client):
    assert client.get("/livez").status_code == 200  # no Authorization header
    paths = client.get("/openapi.json").json["paths"]
    assert "/livez" not in paths and "/readyz" not in paths and "/healthz" in paths
