"""Bearer API keys: each key belongs to one tenant, and a tenant sees only its own jobs."""

from __future__ import annotations

from flask import g, request

from jobstore.keys import tenant_for_key
from jobstore.models import Tenant
from webapi.errors import APIError
from webapi.extensions import db

CHALLENGE = {"WWW-Authenticate": 'Bearer realm="genq"'}


def require_api_key() -> None:
    """before_request hook: 401 unless `Authorization: Bearer <key>` names a live key; sets g.tenant."""
    scheme, _, key = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not key.strip():
        raise APIError(401, "unauthorized", "missing API key: send `Authorization: Bearer <key>`", CHALLENGE)
    tenant = tenant_for_key(db(), key.strip())
    if tenant is None:
        raise APIError(401, "unauthorized", "unknown or revoked API key", CHALLENGE)
    g.tenant = tenant


def current_tenant() -> Tenant:
    return g.tenant
