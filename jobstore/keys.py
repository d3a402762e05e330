"""Tenants and their API keys. A key is shown once, at creation; only its SHA-256 is stored."""

from __future__ import annotations

import hashlib
import secrets
from datetime import datetime, timezone

from sqlalchemy import select
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.orm import Session

from jobstore.models import ApiKey, Tenant

KEY_PREFIX = "gq_"
PREFIX_LENGTH = 10  # characters of a key stored and shown in clear (`keys list`), enough to name it


def hash_key(key: str) -> str:
    """The stored form of a key. Keys carry 256 random bits, so a plain SHA-256 cannot be brute-forced."""
    return hashlib.sha256(key.encode()).hexdigest()


def create_key(session: Session, tenant_name: str) -> str:
    """A new key for `tenant_name` (the tenant is created if needed); returns the key itself."""
    session.execute(insert(Tenant).values(name=tenant_name).on_conflict_do_nothing(index_elements=["name"]))
    tenant = session.scalars(select(Tenant).where(Tenant.name == tenant_name)).one()
    key = KEY_PREFIX + secrets.token_urlsafe(32)
    session.add(ApiKey(tenant_id=tenant.id, key_hash=hash_key(key), prefix=key[:PREFIX_LENGTH]))
    session.flush()
    return key


def tenant_for_key_hash(session: Session, key_hash: str) -> Tenant | None:
    """The tenant owning the key whose `hash_key` is `key_hash`, or None when unknown or revoked."""
    return session.scalars(
        select(Tenant)
        .join(ApiKey, ApiKey.tenant_id == Tenant.id)
        .where(ApiKey.key_hash == key_hash, ApiKey.revoked_at.is_(None))
    ).one_or_none()


def list_keys(session: Session, tenant_name: str | None = None) -> list[tuple[ApiKey, str]]:
    """Every key (or `tenant_name`'s) with its tenant's name, oldest first; revoked keys included."""
    query = (
        select(ApiKey, Tenant.name).join(Tenant, ApiKey.tenant_id == Tenant.id).order_by(ApiKey.created_at)
    )
    if tenant_name is not None:
        query = query.where(Tenant.name == tenant_name)
    return [(key, name) for key, name in session.execute(query)]


def revoke_key(session: Session, key_or_prefix: str) -> ApiKey:
    """Revoke the key given whole or by the prefix `keys list` shows; LookupError unless exactly one matches.

    A revoked key is refused by the next lookup; an API process that looked it up within the last
    AUTH_CACHE_SECONDS goes on trusting it until then (webapi/key_cache.py)."""
    whole = len(key_or_prefix) > PREFIX_LENGTH
    match = ApiKey.key_hash == hash_key(key_or_prefix) if whole else ApiKey.prefix == key_or_prefix
    matches = session.scalars(select(ApiKey).where(match)).all()
    if len(matches) != 1:
        found = "no key" if not matches else f"{len(matches)} keys"
        raise LookupError(
            f"{found} matches {key_or_prefix!r}: give the whole prefix `keys list` shows, or the key"
        )
    key = matches[0]
    if key.revoked_at is None:
        key.revoked_at = datetime.now(timezone.utc)
    return key
