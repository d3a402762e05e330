"""Celery workers that run jobs on the batching engine. The app is in workers/celery.py."""

from workers import control  # noqa: F401  (registers `celery -A workers inspect engine_stats`)
from workers.celery import app

__all__ = ["app"]
