"""The Celery app.

    celery -A workers worker --pool threads --concurrency N -Q generate   # runs jobs on one engine
    celery -A workers beat                                                # runs the reconciler (workers/beat.py)
    celery -A workers flower                                              # dashboard (workers/flowerconfig.py)

The broker settings every process shares (Redis priority emulation: ten steps, `generate:N` lists,
0 first; default priority 5) come from contract.dispatch, so the API files messages exactly where
workers look. A worker's intake (workers/intake.py), not Celery's consumer, takes the `generate` queue's
messages. This module imports no torch: beat and Flower load it too.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from celery import Celery
from celery.signals import after_setup_logger, after_setup_task_logger

from contract import log_setup
from contract.dispatch import celery_config
from contract.settings import WorkerSettings
from contract.tracing import setup_tracing, tracer
from workers import job_spans

settings = WorkerSettings.from_env()  # the worker's settings, read once for the process

# `celery -A workers flower` reads workers/flowerconfig.py (basic auth always, queue lengths per priority)
# from any directory, without --conf: Flower takes its options from FLOWER_* variables, read after the
# app module is imported. An explicit --conf or FLOWER_CONF still wins.
os.environ.setdefault("FLOWER_CONF", str(Path(__file__).with_name("flowerconfig.py")))

app = Celery("genq", include=["workers.tasks"])
app.conf.update(
    celery_config(settings),
    # Task events let Flower show each job as a task (workers/job_tasks.py). They are off until Flower,
    # while it runs, turns them on (it broadcasts enable_events every few seconds): unwatched, a job costs
    # no event messages. Those are Python work in the worker, taking the GIL from its other threads.
    worker_send_task_events=False,
    # beat runs recovery in its own process (workers/beat.py), where no backlog of jobs can delay it
    beat_scheduler="workers.beat:RecoveryScheduler",
    beat_schedule={
        "recover": {"task": "genq.recover", "schedule": settings.reconcile_interval},
        "maintain": {"task": "genq.maintain", "schedule": settings.reconcile_interval},
    },
)


if settings.log_format == "json":  # lines logged before Celery sets up logging (worker_init's) too
    log_setup.configure("beat" if "beat" in sys.argv else "worker", "json")
# TRACING / OTEL_EXPORTER_OTLP_ENDPOINT: Celery, SQLAlchemy and Redis spans, and each job's (workers/job_spans.py)
if setup_tracing("beat" if "beat" in sys.argv else "worker", settings) is not None:
    job_spans.start(tracer("genq.worker"))


@after_setup_logger.connect
@after_setup_task_logger.connect
def _log_format(logger=None, **_) -> None:
    """Celery's handlers (worker and beat) get the job context filter and, with LOG_FORMAT=json, JSON lines
    (contract/log_setup.py)."""
    service = "beat" if "beat" in sys.argv else "worker"
    for handler in logger.handlers if logger is not None else ():
        log_setup.install(handler, service, settings.log_format)
