"""Tenants and their API keys. A key is shown once, at creation; only its SHA-256 is stored."""

from __future__ import annotations

import hashlib
import secrets

from sqlalchemy import select
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.orm import Session

from jobstore.models import ApiKey, Tenant

KEY_PREFIX = "gq_"


def hash_key(key: str) -> str:
    """The stored form of a key. Keys carry 256 random bits, so a plain SHA-256 cannot be brute-forced."""
    return hashlib.sha256(key.encode()).hexdigest()


def create_key(session: Session, tenant_name: str) -> str:
    """A new key for `tenant_name` (the tenant is created if needed); returns the key itself."""
    session.execute(insert(Tenant).values(name=tenant_name).on_conflict_do_nothing(index_elements=["name"]))
    tenant = session.scalars(select(Tenant).where(Tenant.name == tenant_name)).one()
    key = KEY_PREFIX + secrets.token_urlsafe(32)
    session.add(ApiKey(tenant_id=tenant.id, key_hash=hash_key(key), prefix=key[:10]))
    session.flush()
    return key


def tenant_for_key(session: Session, key: str) -> Tenant | None:
    """The tenant owning `key`, or None when the key is unknown or revoked."""
    return tenant_for_key_hash(session, hash_key(key))


def tenant_for_key_hash(session: Session, key_hash: str) -> Tenant | None:
    """The tenant owning the key whose `hash_key` is `key_hash`, or None when unknown or revoked."""
    return session.scalars(
        select(Tenant)
        .join(ApiKey, ApiKey.tenant_id == Tenant.id)
        .where(ApiKey.key_hash == key_hash, ApiKey.revoked_at.is_(None))
    ).one_or_none()
