"""The operator's commands on the job store: `genq keys ...`, `genq tenants ...` and `genq db ...` (webapi/cli.py gathers them;
`flask --app webapi keys ...` runs the same `keys`). They read StoreSettings (DATABASE_URL) from the environment."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import click
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session

from contract.settings import StoreSettings
from jobstore.db import create_database_if_missing, make_engine, make_session_factory, normalize_url
from jobstore.keys import create_key, list_keys, revoke_key
from jobstore.tenant_policy import POLICY_FIELDS, list_policies, set_policy


@contextmanager
def _transaction() -> Iterator[Session]:
    settings = StoreSettings.from_env()
    engine = make_engine(settings.database_url, settings.db_connect_timeout)
    try:
        with make_session_factory(engine).begin() as session:
            yield session
    finally:
        engine.dispose()


@click.group("keys", help="Manage API keys.")
def keys() -> None:
    pass


@keys.command("create")
@click.argument("tenant")
def create(tenant: str) -> None:
    """Create an API key for TENANT (the tenant is created if new); the key is the last line printed."""
    with _transaction() as session:
        key = create_key(session, tenant)
    click.echo(f"API key for tenant {tenant!r} (shown once; only its hash is stored):")
    click.echo(key)


@keys.command("list")
@click.option("--tenant", help="only this tenant's keys")
def list_(tenant: str | None) -> None:
    """List keys: prefix, tenant, created, revoked (keys themselves are never stored)."""
    with _transaction() as session:
        rows = [
            (
                key.prefix,
                name,
                f"{key.created_at:%Y-%m-%d %H:%M}",
                f"{key.revoked_at:%Y-%m-%d %H:%M}" if key.revoked_at else "-",
            )
            for key, name in list_keys(session, tenant)
        ]
    widths = [
        max(len(row[i]) for row in [("PREFIX", "TENANT", "CREATED", "REVOKED"), *rows]) for i in range(4)
    ]
    for row in [("PREFIX", "TENANT", "CREATED", "REVOKED"), *rows]:
        click.echo("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())


@keys.command("revoke")
@click.argument("key_or_prefix")
def revoke(key_or_prefix: str) -> None:
    """Revoke a key, given whole or by its prefix from `keys list`.

    The API refuses it (401) at its next lookup: at once in API processes that have not seen it lately,
    within AUTH_CACHE_SECONDS (5 s) in those that have."""
    try:
        with _transaction() as session:
            key = revoke_key(session, key_or_prefix)
            prefix = key.prefix
    except LookupError as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(
        f"revoked {prefix}: refused at once, or within AUTH_CACHE_SECONDS by API processes that cached it"
    )


@click.group("db", help="The job database.")
def db() -> None:
    pass


@db.command("create")
def create_database() -> None:
    """Create the database named in DATABASE_URL if it is missing (then: alembic upgrade head)."""
    url = StoreSettings.from_env().database_url
    created = create_database_if_missing(url)
    click.echo(f"database {make_url(normalize_url(url)).database}: {'created' if created else 'exists'}")


@click.group("tenants", help="Tenants and their policies (limits); unset values take the API's defaults.")
def tenants() -> None:
    pass


def _policy_value(text: str | None, convert):
    """An option's value: None (not given), DEFAULT (back to the API's default), or the converted value."""
    if text is None:
        return None
    if text == "default":
        return DEFAULT
    try:
        return convert(text)
    except ValueError:
        raise click.BadParameter(f"{text!r}: give a number, or `default`") from None


DEFAULT = object()


@tenants.command("set")
@click.argument("tenant")
@click.option("--top-priority", help="the most urgent priority its keys may use, 0-9 (default 0: any)")
@click.option("--sync-priority", help="priority of its /v1 calls that name none, 0-9 (default 0)")
@click.option("--max-queued", help="queued jobs at most (default MAX_QUEUED_PER_TENANT)")
@click.option("--rate-limit", help="each key's rate limit, e.g. '10/second;500/minute' (default RATE_LIMIT)")
@click.option("--token-budget", help="tokens per period (prompt + completion; default: no budget)")
@click.option("--budget-period", help="the budget's period in seconds, aligned on the epoch (default 86400)")
def set_(tenant: str, **options: str | None) -> None:
    """Set TENANT's policy; a value `default` returns that limit to the API's default."""
    converters = dict(
        top_priority=int,
        sync_priority=int,
        max_queued=int,
        rate_limit=str,
        token_budget=int,
        budget_period_seconds=int,
    )
    options["budget_period_seconds"] = options.pop("budget_period")
    values = {}
    for name, text in options.items():
        value = _policy_value(text, converters[name])
        if value is not None:
            values[name] = None if value is DEFAULT else value
    if not values:
        raise click.UsageError("give at least one limit to set (see --help)")
    try:
        with _transaction() as session:
            stored = set_policy(session, tenant, values)
    except (LookupError, ValueError) as exc:
        raise click.ClickException(str(exc)) from None
    shown = ", ".join(f"{name}={getattr(stored, name)}" for name in POLICY_FIELDS)
    click.echo(f"tenant {tenant!r}: {shown} (API processes apply it within AUTH_CACHE_SECONDS)")


@tenants.command("list")
def list_tenants() -> None:
    """List tenants with their stored policy (`-`: the API's default)."""
    header = (
        "TENANT",
        "TOP_PRIORITY",
        "SYNC_PRIORITY",
        "MAX_QUEUED",
        "RATE_LIMIT",
        "TOKEN_BUDGET",
        "PERIOD_S",
    )
    with _transaction() as session:
        rows = [
            (
                name,
                *(
                    "-" if policy is None or getattr(policy, f) is None else str(getattr(policy, f))
                    for f in POLICY_FIELDS
                ),
            )
            for _, name, policy in list_policies(session)
        ]
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        click.echo("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())
