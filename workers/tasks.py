"""A worker process's parts, built when Celery starts the worker, and the signals that drive them (the
reconciler runs in beat: workers/beat.py).

Each worker process has one engine (built before it takes jobs, and run in a process of its own:
workers/engine_host.py), one job book (the jobs it holds and their writer thread), one intake (the thread that
takes jobs from Redis: workers/intake.py), one database pool and one worker id, which names its leases.

`celery -A workers worker ... -Q generate` gives the `generate` queue to the intake: Celery's own consumer
does not consume it (it would take one message per task thread, with kombu's bookkeeping for each), so no
`generate` task runs in Celery's pool; each job is still one task in Flower (workers/job_tasks.py).
"""

from __future__ import annotations

import logging
import multiprocessing.util
import os
import signal
import socket
import threading
import uuid
from collections.abc import Callable
from functools import cache

import redis
from celery.signals import worker_init, worker_ready, worker_shutdown, worker_shutting_down
from sqlalchemy import Connection

from contract.dispatch import QUEUE, model_queue, send_to_head
from contract.redis_client import redis_client
from contract.token_events import EventPublisher
from contract.tracing import instrument_engine
from jobstore.db import make_engine
from workers.announce import Announcer
from workers.celery import app, settings
from workers.engine_host import EngineHost
from workers.intake import Intake
from workers.job_book import JobBook
from workers.job_tasks import JobTasks
from workers.startup import check_services

log = logging.getLogger(__name__)
ENGINE_STATS_WAIT_SECONDS = 2.0  # how long `inspect engine_stats` waits for the engine's counters
WORKER_ID = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
_lock = threading.Lock()
_host: EngineHost | None = None
_book: JobBook | None = None
_intake: Intake | None = None
_engine_stopped = False  # _stop_engine ran (a warm shutdown, or the process exiting)
_announcer: Announcer | None = None
# this worker's model's queue (`generate` for the fleet's default model, else `generate.<MODEL_NAME>`): its
# intake takes it, and its hand-backs go back to it. `-Q generate` or `-Q <this queue>` gives it to the intake
JOB_QUEUE = model_queue(settings, settings.served_model_name())
_tasks = JobTasks()
_takes_generate = False  # the worker was told to consume `generate` (-Q): its intake does, once it is ready


def send_back(job_id: uuid.UUID, priority: int) -> None:
    """Send a job to the queue at its priority (a hand-back or a declined message), at the head of its
    priority's list: it was taken before the jobs of its priority still waiting, and stays ahead of them."""
    if not send_to_head(app, _redis(), settings, job_id, priority, JOB_QUEUE):
        log.warning("job %s sent back to the tail of its queue (Redis failed to move it)", job_id)


@cache
def _redis() -> redis.Redis:
    return redis_client(settings.redis_url, timeout=5)


@cache
def job_sessions() -> Callable[[], Connection]:
    """A running job's writes: each is one statement (jobstore.jobs), so they run on Core connections in
    autocommit mode, with no ORM session, no BEGIN and COMMIT round trips, and no ping before each use (a
    claim and a result write each cost one statement): a connection Postgres dropped fails its statement,
    the pool is emptied, and the write is retried (intake's and the job book's retries)."""
    engine = make_engine(settings.database_url, settings.db_connect_timeout, pool_pre_ping=False)
    instrument_engine(engine)  # TRACING: its statements' spans (contract/tracing.py)
    return engine.execution_options(isolation_level="AUTOCOMMIT").connect


def engine_host() -> EngineHost:
    """This process's EngineHost (its engine runs in a process of its own), built on first use."""
    global _host
    with _lock:
        if _host is None:
            from batching import EngineConfig

            config = EngineConfig(**settings.engine_options())
            log.info("building the engine (worker %s): %s", WORKER_ID, config)
            _host = EngineHost(config, threads=settings.engine_thread_count(), on_give_up=_shut_down).start()
            # Celery sends worker_shutdown on a warm shutdown only: after a cold one (SIGQUIT) the interpreter's
            # exit waited for the engine process for good. multiprocessing's exit runs finalizers of priority
            # >= 0 before it joins the child processes.
            multiprocessing.util.Finalize(None, _stop_engine, exitpriority=10)
        return _host


def _shut_down() -> None:
    """The engine process keeps dying: a warm shutdown hands the held jobs back, and whoever runs the
    worker (Docker's restart policy, systemd) starts a fresh one."""
    log.critical("worker %s shutting down: its engine cannot run", WORKER_ID)
    os.kill(os.getpid(), signal.SIGTERM)


def intake() -> Intake:
    """This process's intake and job book, built (with the engine) on first use."""
    global _book, _intake, _announcer
    host = engine_host()
    with _lock:
        if _intake is None:
            events = EventPublisher(_redis(), settings.redis_key_prefix, settings.events_retention_seconds)
            _book = JobBook(host, job_sessions(), settings, send_back, events.start(), _tasks).start()
            capacity = settings.worker_capacity(host.config.max_num_seqs)
            slots = host.config.max_num_seqs
            _intake = Intake(
                _book,
                job_sessions(),
                settings,
                WORKER_ID,
                send_back,
                capacity,
                _tasks,
                base_capacity=settings.worker_base_capacity(slots),
                slots=slots,
            ).start()
            _announcer = Announcer(
                _redis(), settings, WORKER_ID, host.config.max_model_len, capacity, lambda: len(_book)
            ).start()
            log.info(
                "worker %s holds up to %d jobs (engine max_num_seqs %d)",
                WORKER_ID,
                capacity,
                host.config.max_num_seqs,
            )
        return _intake


@worker_init.connect
def _build_engine_before_taking_jobs(sender=None, **_) -> None:
    """Build the engine and the intake, and give the `generate` queue to the intake: taken out of the queues
    Celery's consumer consumes (`sender`, the WorkController, selected them from -Q) before that consumer
    starts."""
    global _takes_generate
    check_services("worker")  # exits, naming the settings, before the engine is built
    intake()
    queues = sender.app.amqp.queues if sender is not None else None
    for name in {QUEUE, JOB_QUEUE}:
        if queues is not None and name in queues.consume_from:
            queues.deselect(name)
            _takes_generate = True


@worker_ready.connect
def _start_taking_jobs(sender=None, **_) -> None:
    """The engine is built in worker_init, before Celery sets up logging (what is logged there is lost):
    say here, once the log works, what this worker runs. Then the intake takes jobs, and their task events go
    through Celery's consumer (`sender`)."""
    if _host is not None and _intake is not None:
        log.info(
            "worker %s runs %s as model %r from queue %s; holds up to %d jobs",
            WORKER_ID,
            _host.describe(),
            settings.served_model_name(),
            JOB_QUEUE,
            _intake.capacity,
        )
        _tasks.consumer = sender
        if _takes_generate:
            _intake.resume()


def consume_generate(consume: bool) -> None:
    """`celery control add_consumer generate` (True) / `cancel_consumer generate` (False): resume or pause the
    intake (workers/control.py)."""
    global _takes_generate
    _takes_generate = consume
    if _intake is not None and consume:
        _intake.resume()
    elif _intake is not None:
        _intake.pause()


def consumes_generate() -> bool:
    """Whether this worker takes `generate` jobs now (`celery inspect active_queues`)."""
    return _intake is not None and _intake.consuming


@worker_shutting_down.connect
def _hand_back_held_jobs(**_) -> None:
    """Warm shutdown: take no more jobs, and hand each held job back (tokens saved) to the queue."""
    log.info("worker %s shutting down: handing held jobs back", WORKER_ID)
    if _announcer is not None:
        _announcer.close()
    if _intake is not None:
        _intake.close()
        _book.close()


@worker_shutdown.connect
def _stop_engine(**_) -> None:
    """Wait for the job book's hand-backs, then stop the engine process; once, on whichever comes first of a
    warm shutdown's worker_shutdown and the process's exit."""
    global _engine_stopped
    with _lock:
        if _engine_stopped:
            return
        _engine_stopped = True
    if _book is not None:
        _book.join(timeout=30)
    if _host is not None:
        _host.stop()


def engine_report() -> dict:
    """What `celery -A workers inspect engine_stats` answers (workers/control.py): engine.stats() and more."""
    if _host is None:
        return {}
    try:
        # within a control reply's usual 5 s: right after an engine process dies, before the host has seen it,
        # a stats request waits on a pipe nobody reads
        stats = _host.stats(timeout=ENGINE_STATS_WAIT_SECONDS)
    except TimeoutError as exc:  # a new engine process is being built, or no answer in time (a step longer
        # than the wait, or a process that died before its host saw it)
        stats = {"engine": str(exc) or "not answering"}
    stats.update(engine_pid=_host.pid, engine_restarts=len(_host.losses), **_host.info)
    if _intake is not None:
        stats.update(worker_held_jobs=len(_book), worker_capacity=_intake.capacity)
    return stats
