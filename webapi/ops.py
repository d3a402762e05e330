"""Operations endpoints: /healthz (and vLLM's /health), /livez, /readyz, /version, /metrics and
/openapi.json. No API key needed.

Probes: /livez answers 200 while the process serves requests and touches nothing else, so a database or
Redis outage never restarts an API process (Kubernetes' livenessProbe, compose's healthcheck); /readyz is
/healthz (Postgres and Redis answer), for taking a process out of a load balancer until they do
(readinessProbe). Like /metrics they are plain routes, outside the OpenAPI document."""

from __future__ import annotations

import importlib.metadata
import logging

from flask import Blueprint, Response, current_app
from prometheus_client import CONTENT_TYPE_LATEST
from sqlalchemy import text

from contract.redis_client import redis_client
from webapi.errors import APIError
from webapi.extensions import db, services
from webapi.metrics import exposition
from webapi.schemas import Health, Version
from webapi.spec import endpoint, openapi

log = logging.getLogger(__name__)
bp = Blueprint("ops", __name__)


@bp.get("/healthz")
@bp.get("/health")
@endpoint(responses={200: Health}, errors=(503,), auth=False)
def healthz():
    """Liveness and readiness: 200 when Postgres and Redis answer, else 503 (/health: vLLM's name)."""
    for name, check in (("database", check_database), ("broker", check_broker)):
        try:
            check()
        except Exception as exc:  # any failure of a dependency means "not ready", never a 500
            log.warning("healthz: %s unavailable: %s", name, exc)
            raise APIError(503, "unavailable", f"{name} unavailable", {"Retry-After": "5"}) from None
    return Health(status="ok", database="ok", broker="ok").model_dump()


@bp.get("/livez")
def livez():
    """Liveness: 200 while this process answers requests; checks no dependency."""
    return {"status": "ok"}


@bp.get("/readyz")
def readyz():
    """Readiness: /healthz's checks and answers (200 when Postgres and Redis answer, else 503)."""
    return healthz()


@bp.get("/version")
@endpoint(responses={200: Version}, auth=False)
def version():
    """genq's version (vLLM's /version)."""
    return Version(version=importlib.metadata.version("genq")).model_dump()


@bp.get("/metrics")
def metrics():
    """Prometheus metrics (of every API process, when gunicorn runs several)."""
    return Response(exposition(db(), services().settings), mimetype=CONTENT_TYPE_LATEST)


@bp.get("/openapi.json")
def openapi_json():
    """The OpenAPI document, generated from the request and response schemas."""
    return openapi(current_app, title="genq", version="1")


def check_database() -> None:
    db().execute(text("SELECT 1"))


def check_broker() -> None:
    client = redis_client(services().settings.redis_url, timeout=2)
    try:
        client.ping()
    finally:
        client.close()
