"""`celery -A workers beat` runs the reconciler itself, in the beat process.

Recovery does not go through a queue: a task on the `generate` queue would wait behind every job of its
priority and, under a backlog, run late or expire unrun, so crash recovery and batch finalization would stop
exactly when the system is busy. Beat's scheduler (RecoveryScheduler, the `beat_scheduler` of
workers/celery.py) runs the entries named in LOCAL here, each in a thread of its own, so recovery never
waits for batch files to be written; a run still going when its next turn comes skips that
turn. Beat needs Postgres and Redis, never a worker.

Several beats may run at once (a spare): recovery takes a Postgres advisory lock, batch finalization is
idempotent, and the retention purge runs once an hour whoever does it.

    python -m workers.beat --check    # exit status 1 unless recovery ran lately (docker-compose's health check)
"""

from __future__ import annotations

import argparse
import logging
import threading
import time
from collections.abc import Callable
from functools import cache

import redis
from celery.beat import ScheduleEntry, Scheduler
from sqlalchemy.exc import InterfaceError, OperationalError
from sqlalchemy.orm import Session, sessionmaker

from contract.tracing import instrument_engine
from jobstore.db import make_engine, make_session_factory
from workers import reconciler
from workers.celery import app, settings
from workers.startup import check_services

log = logging.getLogger(__name__)
UNAVAILABLE = (OperationalError, InterfaceError, redis.RedisError)  # Postgres or Redis down: next turn


@cache
def _sessions() -> sessionmaker[Session]:
    engine = make_engine(settings.database_url, settings.db_connect_timeout)
    instrument_engine(engine)  # TRACING: its statements' spans (contract/tracing.py)
    return make_session_factory(engine)


LOCAL: dict[str, Callable[[], dict[str, int]]] = {
    "genq.recover": lambda: reconciler.recover(_sessions(), app, settings),
    "genq.maintain": lambda: reconciler.maintain(_sessions(), settings),
}


class RecoveryScheduler(Scheduler):
    """Celery's in-memory scheduler, running the entries of LOCAL in this process instead of sending them."""

    def __init__(self, *args, **kwargs):
        check_services("beat")  # exits, naming the settings, when Postgres cannot hold the plan
        self._threads: dict[str, threading.Thread] = {}
        super().__init__(*args, **kwargs)

    def apply_entry(self, entry: ScheduleEntry, producer=None) -> None:
        run = LOCAL.get(entry.task)
        if run is None:
            super().apply_entry(entry, producer=producer)
            return
        busy = self._threads.get(entry.name)
        if busy is not None and busy.is_alive():
            log.warning("beat: %s is still running from its last turn; this turn is skipped", entry.name)
            return
        thread = threading.Thread(target=_run, args=(entry.name, run), name=f"genq-{entry.name}", daemon=True)
        self._threads[entry.name] = thread
        thread.start()

    def close(self) -> None:
        for thread in self._threads.values():  # a run cut short is redone by the next beat's first
            thread.join(timeout=10)
        super().close()


def _run(name: str, run: Callable[[], dict[str, int]]) -> None:
    try:
        counts = run()
    except UNAVAILABLE as exc:
        log.warning("beat: %s failed (%s: %s); trying again at its next turn", name, type(exc).__name__, exc)
        return
    except Exception:
        log.exception("beat: %s failed; trying again at its next turn", name)
        return
    log.debug("beat: %s: %s", name, counts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m workers.beat", description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 unless recovery ran lately")
    args = parser.parse_args(argv)
    if not args.check:
        parser.error("nothing to do: pass --check (beat itself is `celery -A workers beat`)")
    limit = max(3 * settings.reconcile_interval, 30.0)
    ran = reconciler.last_run(settings)
    if ran is None or time.time() - ran > limit:
        print(f"recovery has not run in the last {limit:g} s (last run: {ran})")
        return 1
    print(f"recovery ran {time.time() - ran:.1f} s ago")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
