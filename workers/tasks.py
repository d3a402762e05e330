"""Thin tasks taking ids; the work is in workers/runner.py and workers/reconciler.py.

Each worker process has one engine (built when the worker starts, before it takes jobs), one
database pool and one worker id, which names its leases.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import uuid
from functools import cache

from celery.signals import worker_init, worker_shutdown, worker_shutting_down
from celery.worker.control import inspect_command
from sqlalchemy.orm import Session, sessionmaker

from jobstore import jobs
from jobstore.db import make_engine, make_session_factory
from jobstore.dispatch import DEFAULT_PRIORITY, send_job
from workers.celery import app, settings
from workers.engine_host import EngineHost
from workers.reconciler import reconcile
from workers.runner import DRAINING, Draining, run_job

log = logging.getLogger(__name__)
WORKER_ID = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
_host_lock = threading.Lock()
_host: EngineHost | None = None


@app.task(name="generate", bind=True)
def generate(self, job_id: str) -> str:
    """Run job `job_id` on this process's engine; a job that is not queued is left alone."""
    try:
        return run_job(uuid.UUID(job_id), worker_id=WORKER_ID, host=engine_host(), sessions=job_sessions(),
                       settings=settings, hand_back=hand_back)
    except Draining:  # taken while shutting down: back to the queue, untouched
        priority = (self.request.delivery_info or {}).get("priority")
        send_job(app, uuid.UUID(job_id), DEFAULT_PRIORITY if priority is None else priority)
        return "not started: the worker is shutting down; sent back to the queue"


def hand_back(job_id: uuid.UUID, priority: int) -> None:
    """Send a job handed back at shutdown to the queue, and record that it was sent."""
    send_job(app, job_id, priority)
    with job_sessions().begin() as session:
        jobs.mark_enqueued(session, [job_id])


@app.task(name="reconcile")
def reconcile_jobs() -> dict[str, int]:
    """Requeue jobs of dead workers and send jobs that never reached Redis."""
    return reconcile(sessions(), app, settings)


@cache
def _engine():
    return make_engine(settings.database_url, settings.db_connect_timeout)


@cache
def sessions() -> sessionmaker[Session]:
    """Transactions (the reconciler's several statements under one lock)."""
    return make_session_factory(_engine())


@cache
def job_sessions() -> sessionmaker[Session]:
    """A running job's writes: each is one statement (jobstore.jobs), so they run in autocommit mode,
    with no BEGIN and COMMIT round trips (a claim and a result write each cost one statement)."""
    return make_session_factory(_engine().execution_options(isolation_level="AUTOCOMMIT"))


def engine_host() -> EngineHost:
    """This process's EngineHost, built on first use."""
    global _host
    with _host_lock:
        if _host is None:
            from batching import Engine, EngineConfig  # torch is imported by workers only

            config = EngineConfig(**settings.engine_options())
            log.info("building the engine (worker %s): %s", WORKER_ID, config)
            _host = EngineHost(lambda: Engine(config)).start()
        return _host


class _HideRoutineReconciles(logging.Filter):
    """Celery logs every task it receives and finishes; for the reconciler, every few seconds, that
    is noise (it logs itself when it does something). Its failures still show."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno > logging.INFO or getattr(record, "data", {}).get("name") != "reconcile"


for _logger in ("celery.worker.strategy", "celery.app.trace"):
    logging.getLogger(_logger).addFilter(_HideRoutineReconciles())


@worker_init.connect
def _build_engine_before_taking_jobs(**_) -> None:
    engine_host()


@worker_shutting_down.connect
def _hand_back_running_jobs(**_) -> None:
    """Warm shutdown: stop starting jobs, and have each running job save its tokens and go back to the queue."""
    log.info("worker %s shutting down: handing running jobs back", WORKER_ID)
    DRAINING.set()


@worker_shutdown.connect
def _stop_engine(**_) -> None:
    if _host is not None:
        _host.stop()


@inspect_command()
def engine_stats(state) -> dict:
    """`celery -A workers inspect engine_stats`: the engine's running / waiting / swapped counts and more."""
    return engine_host().stats() if _host is not None else {}
