"""`genq`: the one command line of the project, on click.

genq batch submit prompts.jsonl --out results.jsonl   # the batch client (also installed as genq-batch)
genq keys create|list|revoke                          # API keys (also `flask --app webapi keys ...`)
genq tenants set|list                                 # tenants' policies: priority cap, limits, token budget
genq db create                                        # the database named in DATABASE_URL
"""

from __future__ import annotations

import click

from batchclient.cli import main as batch
from jobstore.cli import db, keys, tenants

__all__ = ["genq", "keys"]

genq = click.Group(
    "genq", help="genq: asynchronous text-generation jobs.", commands=[batch, keys, tenants, db]
)
