"""Celery workers that run jobs on the batching engine. The app is in workers/celery.py."""

from workers.celery import app

__all__ = ["app"]
