"""Flower's default config file, read from the working directory by the plain contract command
`celery -A workers flower`: the same settings as workers/flowerconfig.py (basic auth always on,
queue lengths per priority), so starting Flower without `--conf` never serves it unauthenticated."""

from workers.flowerconfig import *  # noqa: F401,F403
