"""All tenants' queued jobs, for the API's overload guard (MAX_QUEUED_JOBS).

Counting every queued job on every submission would cost each POST a scan of the whole queue. The
guard is coarse by nature, so each API process counts at most once every `max_age` seconds and
adds the jobs it accepted since; other processes' recent submissions are seen at the next count.
"""

from __future__ import annotations

import threading
import time

from sqlalchemy import Engine

from jobstore import jobs


class QueueSize:
    def __init__(self, engine: Engine, max_age: float = 1.0):
        self.engine, self.max_age = engine, max_age
        self._count, self._counted_at = 0, float("-inf")
        self._lock = threading.Lock()

    def get(self) -> int:
        """Queued jobs of all tenants, counted within the last `max_age` seconds (plus this process's since)."""
        with self._lock:
            if time.monotonic() - self._counted_at < self.max_age:
                return self._count
        with self.engine.connect() as conn:
            count = jobs.queued_total(conn)
        with self._lock:
            self._count, self._counted_at = count, time.monotonic()
            return count

    def accepted(self) -> None:
        """One more job queued by this process."""
        with self._lock:
            self._count += 1
