"""`flask --app webapi keys create TENANT`: make an API key (printed once, as the last line)."""

from __future__ import annotations

import click
from flask.cli import AppGroup

from jobstore.keys import create_key
from webapi.extensions import services

keys = AppGroup("keys", help="Manage API keys.")


@keys.command("create")
@click.argument("tenant")
def create(tenant: str) -> None:
    """Create an API key for TENANT (the tenant is created if new). Only a hash is stored."""
    with services().sessions.begin() as session:
        key = create_key(session, tenant)
    click.echo(f"API key for tenant {tenant!r} (shown once; only its hash is stored):")
    click.echo(key)
