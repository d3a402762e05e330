"""Queued jobs, per tenant and in all, as one API process sees them: for the caps of POST /jobs.

Counting queued jobs on every submission costs each POST a scan of the tenant's queue (and of the
whole queue for MAX_QUEUED_JOBS). Here each process counts with one GROUP BY at most every `max_age`
seconds and adds the jobs it accepted since; other processes' recent submissions are seen at the
next count. The global guard is coarse by nature and uses this estimate alone. The per-tenant cap
stays exact where it matters: a tenant whose estimate is at least half its cap has each submission
checked by the INSERT itself (jobstore.jobs.create_job's `max_queued`); below half, the count is
skipped (other processes would have to accept half a cap of its jobs within `max_age` to overshoot).
"""

from __future__ import annotations

import threading
import time
import uuid
from collections import Counter

from sqlalchemy import Engine

from jobstore import jobs


class QueueSize:
    def __init__(self, engine: Engine, max_age: float = 1.0):
        self.engine, self.max_age = engine, max_age
        self._by_tenant: Counter[uuid.UUID] = Counter()
        self._counted_at = float("-inf")
        self._lock = threading.Lock()
        self._counting = False

    def total(self) -> int:
        """All tenants' queued jobs (counted within `max_age` seconds, plus this process's since)."""
        self._refresh()
        with self._lock:
            return self._by_tenant.total()

    def of(self, tenant_id: uuid.UUID) -> int:
        """The tenant's queued jobs (counted within `max_age` seconds, plus this process's since)."""
        self._refresh()
        with self._lock:
            return self._by_tenant[tenant_id]

    def accepted(self, tenant_id: uuid.UUID) -> None:
        """One more job of `tenant_id` queued by this process."""
        with self._lock:
            self._by_tenant[tenant_id] += 1

    def _refresh(self) -> None:
        """Count again if the count is stale; one caller counts, the others meanwhile use the stale count
        (a burst of calls never queues for connections to count the same thing)."""
        with self._lock:
            if self._counting or time.monotonic() - self._counted_at < self.max_age:
                return
            self._counting = True
        try:
            with self.engine.connect() as conn:
                counts = Counter(jobs.queued_by_tenant(conn))
            with self._lock:
                self._by_tenant, self._counted_at = counts, time.monotonic()
        finally:
            self._counting = False
