"""Recording "sent to Redis" (jobs.enqueued_at) in batches, off the request path.

A submission commits the job, then sends its message. Recording the send took a second
transaction per request (an UPDATE and a commit), about a third of POST /jobs' database work.
Here each process keeps the ids it sent and a daemon thread records them every `interval`
seconds with one UPDATE. If the process dies before a flush, those jobs keep enqueued_at NULL and
the reconciler sends them again after its grace period: a duplicate message, which is harmless
(a claim only succeeds on a queued job). Nothing is lost either way: the job row was committed
before its message was sent.
"""

from __future__ import annotations

import logging
import os
import threading
import uuid

from sqlalchemy.orm import Session, sessionmaker

from jobstore import jobs

log = logging.getLogger(__name__)


class SentMarks:
    def __init__(self, sessions: sessionmaker[Session], interval: float = 0.5, give_up_after: int = 10):
        self.sessions, self.interval, self.give_up_after = sessions, interval, give_up_after
        self._pending: list[uuid.UUID] = []
        self._lock = threading.Lock()
        self._flusher: tuple[int, threading.Thread] | None = (
            None  # (pid, thread): gunicorn forks after create_app
        )
        self._closed = threading.Event()
        self._failures = 0

    def add(self, job_id: uuid.UUID) -> None:
        """Record, within about `interval` seconds, that `job_id`'s message went to Redis."""
        with self._lock:
            self._pending.append(job_id)
            if (self._flusher is None or self._flusher[0] != os.getpid()) and not self._closed.is_set():
                thread = threading.Thread(target=self._run, name="genq-sent-marks", daemon=True)
                self._flusher = (os.getpid(), thread)
                thread.start()

    def flush(self) -> int:
        """Record every pending mark now; how many. On a database error they are kept for the next try,
        up to `give_up_after` tries in a row (then dropped: the reconciler sends those jobs again)."""
        with self._lock:
            batch, self._pending = self._pending, []
        if not batch:
            return 0
        try:
            with self.sessions.begin() as session:
                jobs.mark_enqueued(session, batch)
        except Exception as exc:  # noqa: BLE001 - the marks only spare the reconciler a duplicate send
            self._failures += 1
            keep = self._failures < self.give_up_after and not self._closed.is_set()
            log.warning(
                "could not record %d jobs as sent (%s): %s",
                len(batch),
                "will retry" if keep else "giving up; the reconciler sends them again",
                exc,
            )
            if keep:
                with self._lock:
                    self._pending[:0] = batch
            return 0
        self._failures = 0
        return len(batch)

    def close(self) -> None:
        """Stop the flusher and record what is pending (before the app's engine is disposed)."""
        self._closed.set()
        with self._lock:
            flusher, self._flusher = self._flusher, None
        if flusher is not None and flusher[0] == os.getpid():
            flusher[1].join()
        self.flush()

    def _run(self) -> None:
        """Flush every `interval` seconds (every second after a failure); end once nothing is pending."""
        while not self._closed.wait(self.interval if not self._failures else 1.0):
            with self._lock:
                if not self._pending:
                    self._flusher = None
                    return
            self.flush()
