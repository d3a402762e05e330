"""Bearer API keys: each key belongs to one tenant, and a tenant sees only its own jobs."""

from __future__ import annotations

from flask import g, request

from jobstore.keys import hash_key, tenant_for_key_hash
from webapi.errors import APIError
from webapi.extensions import services
from webapi.key_cache import Caller

CHALLENGE = {"WWW-Authenticate": 'Bearer realm="genq"'}


def require_api_key() -> None:
    """before_request hook: 401 unless `Authorization: Bearer <key>` names a live key; sets g.tenant.

    A key found in the last AUTH_CACHE_SECONDS is trusted without a query (webapi/key_cache.py)."""
    scheme, _, key = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not key.strip():
        raise APIError(401, "unauthorized", "missing API key: send `Authorization: Bearer <key>`", CHALLENGE)
    key_hash = hash_key(key.strip())
    cache = services().key_cache
    caller = cache.get(key_hash)
    if caller is None:
        with services().sessions() as session:  # its own short session: the connection goes back at once
            tenant = tenant_for_key_hash(session, key_hash)
            caller = tenant and Caller(tenant.id, tenant.name)
        if caller is None:
            raise APIError(401, "unauthorized", "unknown or revoked API key", CHALLENGE)
        cache.put(key_hash, caller)
    g.tenant = caller


def current_tenant() -> Caller:
    return g.tenant
