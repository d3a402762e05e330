"""Which waiting messages a worker takes from a priority's list: the order the engine would give their jobs.

Between priorities the intake is strict (workers/intake.py: the most urgent non-empty list first). Within a
list, under SCHEDULING_POLICY=predicted, the worker looks at the `WINDOW` messages at its head without taking
them (contract.dispatch.peek_head), places each job as the engine places a waiting sequence
(batching/admission_order.py: a deadline at risk first, earliest first; then by its place, arrival + its
predicted cost x cost_seconds_per_token, moved back by at most the aging bound) and takes the first ones where
they stand (contract.dispatch.take_jobs). So a short job sent behind long ones of its class is taken before
them, and aging bounds how long a job is passed over: only by jobs created less than the aging bound after it.

The place is derived from the job's row (created_at, prompt tokens, saved tokens, deadline, and the tenant's
history before it: jobstore/output_length.py), never from the message or a worker's memory, so a worker that
restarts, or another worker, takes the same jobs in the same order. What a window's jobs cost is read in one
query and kept while they wait (a job taken is forgotten: back in the queue, its saved tokens changed it).

Why a window at the head of kombu's lists rather than lists or sorted sets of genq's own: the lists stay what
kombu, Flower, the queue-depth metric, hand-backs to the head and the reconciler read, and a sender needs no
prediction. The cost: a job beyond the window is not seen until the jobs ahead of it leave (a backlog deeper
than the window is first come, first served in runs of the window), and one query per window of new jobs.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import uuid
from collections.abc import Callable

from sqlalchemy.orm import Session, sessionmaker

from batching.admission_order import at_risk, place
from batching.config import EngineConfig
from contract.settings import WorkerSettings
from jobstore.output_length import QueuedCost, queued_costs

log = logging.getLogger(__name__)

WINDOW = 256  # messages looked at, at the head of a list
_REMEMBERED = 20_000  # costs kept at most (of jobs waiting in windows); beyond this, forgotten all at once
# the seconds a token costs in a place, and a step's time for deadlines: the engine's own starting estimate
_SECONDS_PER_TOKEN = next(
    f.default for f in dataclasses.fields(EngineConfig) if f.name == "cost_seconds_per_token"
)

Rank = tuple[int, float, float]
NOT_QUEUED, AT_RISK, IN_PLACE = 0, 1, 2  # a message for a job not queued is taken first (and dropped)


class QueueOrder:
    def __init__(
        self,
        settings: WorkerSettings,
        sessions: sessionmaker[Session],
        clock: Callable[[], float] = time.time,
    ):
        self.aging_seconds = settings.scheduling_aging_seconds
        self.margin = settings.deadline_margin_seconds
        self.seconds_per_token = float(_SECONDS_PER_TOKEN)  # type: ignore[arg-type]
        self._sessions, self._clock = sessions, clock
        self._costs: dict[uuid.UUID, QueuedCost] = {}

    def choose(self, named: list[uuid.UUID], count: int) -> list[uuid.UUID] | None:
        """The `count` jobs of `named` (a window's, next first) to take now, first first; None if their costs
        could not be read (take the head, first come first served)."""
        unknown = [job_id for job_id in named if job_id not in self._costs]
        if unknown:
            try:
                with self._sessions() as session:
                    found = queued_costs(session, unknown)
            except Exception:  # noqa: BLE001 - the order is advisory: the head is taken instead
                log.warning("intake: no costs for %d waiting jobs", len(unknown), exc_info=True)
                return None
            if len(self._costs) + len(found) > _REMEMBERED:
                self._costs.clear()
            self._costs.update(found)
        now = self._clock()
        chosen = sorted(named, key=lambda job_id: self.rank(self._costs.get(job_id), now))[:count]
        self.forget(chosen)
        return chosen

    def rank(self, cost: QueuedCost | None, now: float) -> Rank:
        """A waiting job's rank in its class (smaller first), as batching.admission_order ranks a sequence."""
        if cost is None:
            return (NOT_QUEUED, 0.0, 0.0)
        created = cost.created_at.timestamp()
        if cost.deadline is not None:
            deadline = cost.deadline.timestamp()
            if at_risk(deadline, now, self.seconds_to_finish(cost), self.margin):
                return (AT_RISK, deadline, created)
        return (
            IN_PLACE,
            place(created, cost.tokens_left, self.seconds_per_token, self.aging_seconds),
            created,
        )

    def seconds_to_finish(self, cost: QueuedCost) -> float:
        """Its predicted time if it started now: a step per predicted output token, at the engine's starting
        estimate of a step (the engine refines it on its own steps once the job is held)."""
        return cost.output_left * self.seconds_per_token

    def forget(self, job_ids) -> None:
        """Jobs taken: a job back in the queue is read again (its saved tokens change its cost)."""
        for job_id in job_ids:
            self._costs.pop(job_id, None)
