"""Celery workers that run jobs on the batching engine. The app is in workers/celery.py.

`workers.app` (what `celery -A workers ...` looks up) is loaded on first use, with the remote-control commands
(workers/control.py, registered for `celery -A workers inspect engine_stats`): a process that imports only a
submodule, the engine process above all (workers/engine_process.py), builds no Celery app. Importing them with
the package took ~0.5 s of every engine process's start.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from celery import Celery

    app: Celery

__all__ = ["app"]


def __getattr__(name: str):
    if name != "app":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from workers import control  # noqa: F401  (registers `celery -A workers inspect engine_stats`)
    from workers.celery import app

    globals()["app"] = app
    return app
