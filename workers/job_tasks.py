"""Each job as one Celery task, for Flower and `celery events`: its task id is the job's id.

The worker's intake takes jobs without Celery's consumer (workers/intake.py), so Celery runs no task for them;
this module sends the task events Celery would, from what the jobs do: `task-received` and `task-started` when a
job is claimed, and when the worker's hold on it ends, the event of its outcome:

    succeeded                                      task-succeeded
    failed                                         task-failed (its error code)
    stopped (cancelled, or its lease was lost)     task-revoked
    handed back, lost with its engine, left        task-retried (it is back in the queue, and runs again)

So Flower shows a job once, in the state the job is in, and nothing active on an idle worker. The events go
through the worker's own event dispatcher, which sends task events only while someone asked for them (Flower
turns them on, `celery control enable_events`): unwatched, a job costs one attribute check here.
"""

from __future__ import annotations

import logging

from contract.dispatch import TASK
from jobstore.models import Job
from workers.outcomes import Outcome

log = logging.getLogger(__name__)
BACK_IN_THE_QUEUE = (
    Outcome.PREEMPTED,
    Outcome.HANDED_BACK,
    Outcome.REBALANCED,
    Outcome.ENGINE_LOST,
    Outcome.LEFT,
)


class JobTasks:
    def __init__(self) -> None:
        self.consumer = None  # Celery's consumer, once the worker is ready: its event dispatcher sends

    def _dispatcher(self):
        """The worker's event dispatcher when it sends task events now, else None."""
        dispatcher = getattr(self.consumer, "event_dispatcher", None)
        if dispatcher is None or not dispatcher.enabled:
            return None
        if dispatcher.groups and "task" not in dispatcher.groups:
            return None
        return dispatcher

    def started(self, job: Job) -> None:
        """The job was claimed: its task is received and started."""
        if (dispatcher := self._dispatcher()) is None:  # unwatched: nothing built (every claim comes here)
            return
        task = str(job.id)
        self._send(
            dispatcher,
            ("task-received", dict(name=TASK, args=repr([task]), kwargs="{}", retries=job.attempts - 1)),
            ("task-started", {}),
            task=task,
        )

    def ended(
        self, job: Job, outcome: Outcome, error: str | None = None, runtime: float | None = None
    ) -> None:
        """The worker's hold on the job ended with `outcome` (`error`: a failure's code)."""
        if (
            dispatcher := self._dispatcher()
        ) is None:  # unwatched: nothing built (every job's end comes here)
            return
        if outcome is Outcome.SUCCEEDED:
            event = ("task-succeeded", dict(result=repr(outcome.value), runtime=runtime))
        elif outcome is Outcome.FAILED:
            event = ("task-failed", dict(exception=repr(error or "failed"), traceback=None))
        elif outcome is Outcome.STOPPED:
            event = ("task-revoked", dict(terminated=False, signum=None, expired=False))
        elif outcome in BACK_IN_THE_QUEUE:
            event = ("task-retried", dict(exception=repr(outcome.value), traceback=None))
        else:  # discarded: the job is another attempt's, which tells
            return
        self._send(dispatcher, event, task=str(job.id))

    @staticmethod
    def _send(dispatcher, *events: tuple[str, dict], task: str) -> None:
        """Send task `task`'s events through `dispatcher`. A failure to send is logged, never raised: jobs do
        not depend on it."""
        try:
            for kind, fields in events:
                dispatcher.send(kind, uuid=task, **fields)
        except Exception as exc:
            log.warning("task events of job %s not sent (%s: %s)", task, exc.__class__.__name__, exc)
