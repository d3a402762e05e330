"""The Celery app.

    celery -A workers worker --pool threads --concurrency N -Q generate   # runs jobs on one engine
    celery -A workers beat                                                # schedules the reconciler
    celery -A workers flower --conf=workers/flowerconfig.py               # dashboard

The broker settings every process shares (Redis priority emulation: ten steps, `generate:N` lists,
0 first; default priority 5) come from jobstore.dispatch, so the API files messages exactly where
workers look. The settings below concern consuming. This module imports no torch: beat and Flower
load it too.
"""

from __future__ import annotations

import os
import tempfile

from celery import Celery

from jobstore.dispatch import QUEUE, celery_config
from jobstore.settings import WorkerSettings

settings = WorkerSettings.from_env()  # the worker's settings, read once for the process

app = Celery("genq", include=["workers.tasks"])
app.conf.update(
    celery_config(settings),
    # A job's message is acknowledged when its task ends, and a worker holds no more messages than it
    # has task threads: the rest wait in Redis, where priority 0 is taken first.
    task_acks_late=True,
    worker_prefetch_multiplier=1,
    # Task events let Flower show tasks as they happen. They are off until Flower, while it runs,
    # turns them on (it broadcasts enable_events every few seconds): unwatched, a job costs no event
    # messages. Those are Python work in the worker, taking the GIL from the engine thread: with them
    # on, a 128-wide tiny-llama batch through the stack ran ~10% fewer tokens/s on 2 cores.
    worker_send_task_events=False,
    task_send_sent_event=True,
    beat_schedule={
        "reconcile": {
            "task": "reconcile",
            "schedule": settings.reconcile_interval,
            # most urgent, so it overtakes waiting jobs; a run not started in time is dropped
            "options": {"queue": QUEUE, "priority": 0, "expires": settings.reconcile_interval},
        },
    },
    # the schedule is a fixed interval: nothing worth keeping in the working directory
    beat_schedule_filename=os.path.join(tempfile.gettempdir(), "genq-celerybeat-schedule"),
)
