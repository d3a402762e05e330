"""`python -m jobstore createdb`, kept for scripts: the same as `genq db create`."""

import click

from jobstore.cli import create_database

click.Group("python -m jobstore", commands={"createdb": create_database})()
