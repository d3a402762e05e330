"""Bearer API keys: each key belongs to one tenant, and a tenant sees only its own jobs."""

from __future__ import annotations

from flask import g, request

from jobstore.keys import hash_key, tenant_for_key_hash
from jobstore.tenant_policy import stored_policy
from webapi.errors import APIError
from webapi.extensions import services
from webapi.key_cache import Caller

CHALLENGE = {"WWW-Authenticate": 'Bearer realm="genq"'}


def require_api_key() -> None:
    """before_request hook: 401 unless `Authorization: Bearer <key>` names a live key; sets g.tenant.

    A key found in the last AUTH_CACHE_SECONDS is trusted without a query (webapi/key_cache.py)."""
    header = request.headers.get("Authorization", "").strip()
    scheme, _, key = header.partition(" ")
    if not header:
        raise APIError(401, "unauthorized", "missing API key: send `Authorization: Bearer <key>`", CHALLENGE)
    if scheme.lower() != "bearer":  # the scheme is not echoed: a key sent alone would be
        raise APIError(
            401,
            "unauthorized",
            "Authorization: use the Bearer scheme, `Authorization: Bearer <key>`",
            CHALLENGE,
            param=None,
        )
    if not key.strip():
        raise APIError(
            401,
            "unauthorized",
            "missing API key after `Bearer`: send `Authorization: Bearer <key>`",
            CHALLENGE,
        )
    caller = caller_of_key(key.strip())
    if caller is None:
        raise APIError(401, "unauthorized", "unknown or revoked API key", CHALLENGE)
    g.tenant = caller


def caller_of_key(key: str) -> Caller | None:
    """The caller of API key `key`, or None: hashed and looked up once a request (the rate limiter asks for
    it before the key check does)."""
    asked = g.get("caller_of_key")
    if asked is not None and asked[0] == key:
        return asked[1]
    caller = look_up_caller(hash_key(key))
    g.caller_of_key = (key, caller)
    return caller


def look_up_caller(key_hash: str) -> Caller | None:
    """The caller of the key whose hash is `key_hash` (cached), or None for an unknown or revoked key."""
    return services().key_cache.get_or_load(key_hash, lambda: _look_up(key_hash))


def _look_up(key_hash: str) -> Caller | None:
    with services().sessions() as session:  # its own short session: the connection goes back at once
        tenant = tenant_for_key_hash(session, key_hash)
        return tenant and Caller(tenant.id, tenant.name, stored_policy(session, tenant.id))


def current_tenant() -> Caller:
    return g.tenant
