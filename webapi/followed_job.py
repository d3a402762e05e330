"""One job as one call follows it (webapi/following.py): its inbox at the hub, how much of its output the
caller holds, and the two ways output reaches the caller besides the events themselves.

- The row's catch-up: what the job's row in Postgres holds beyond the caller, then the events held back
  because they started beyond the caller, as far as they go on from there without a gap.
- The hub's direct write: while the follower waits with nothing queued, a delta without a finish that goes
  on exactly where the caller is is rendered (`plain`) and written to the socket by the hub's put itself
  (webapi/gevent_worker.DirectWriter); anything else wakes the follower, which goes on from the position
  the direct writes reached.

Positions are absolute (contract/deltas.py): `trim` gives the caller exactly what it lacks of a delta, or
Gap when the delta starts beyond it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from contract.deltas import Delta, Gap, Position, trim
from jobstore.models import Job, JobStatus
from webapi.hub import Inbox

START = Position()


class FollowedJob:
    """One job as one call follows it: its subscription, and how far the caller holds its output."""

    __slots__ = (
        "job",
        "inbox",
        "first_row",
        "held",
        "finished",
        "ended",
        "cancelled",
        "heard_at",
        "written_at",
        "resync",
        "first_resync",
        "plain",
        "writer",
    )

    def __init__(self, job: Job, inbox: Inbox, row: Job | None):
        self.job, self.inbox = job, inbox
        self.first_row = row  # the row as read after subscribing (not read again to start), or None
        self.held = START  # what the caller holds of the output
        self.finished = False  # a delta with the finish was given out
        self.ended = False  # Ended was given out
        self.cancelled = False  # cancelled by this call
        self.heard_at = 0.0  # when something last came (the row is reread after a quiet while)
        self.written_at = 0.0  # when the hub last wrote a delta directly
        self.resync = self.first_resync = 0.0  # the quiet while before the row is reread: now, and at first
        # the hub's direct writes (JobFollower.stream): a plain step's delta rendered, and the stream's writer
        self.plain: Callable[[Delta], bytes | None] | None = None
        self.writer = None

    @property
    def over(self) -> bool:
        """The job's end was given out, or this call cancelled it: nothing left to cancel."""
        return self.finished or self.ended or self.cancelled

    def from_row(self, job: Job, pending: list[Delta]) -> Iterator[Delta]:
        """What the row holds beyond the caller, then the held-back events as far as they go on from there."""
        if len(job.output_token_ids) >= self.held.tokens and len(job.output_text or "") >= self.held.chars:
            ended = JobStatus(job.status).finished
            output = Delta(
                0, list(job.output_token_ids), 0, job.output_text or "", job.finish_reason if ended else None
            )
            if (new := self._took(output)) is not None:
                yield new
        while pending:
            try:
                new = self._took(pending[0])
            except Gap:
                return
            pending.pop(0)
            if new is not None:
                yield new

    def _took(self, delta: Delta) -> Delta | None:
        """What the caller lacks of `delta`, counted as held (Gap when it starts beyond the caller)."""
        new = trim(delta, self.held, self.finished)
        if new is not None:
            self.held = new.end
            self.finished = self.finished or new.finish_reason is not None
        return new

    def write_directly(self, event) -> bool:
        """The hub's put while the follower waits (GreenInbox.direct): a delta without a finish that goes on
        exactly where the caller is, rendered and written now; False leaves the event to the follower."""
        held = self.held
        if (
            type(event) is not Delta
            or event.finish_reason is not None
            or self.finished
            or event.start != held.tokens
            or event.text_start != held.chars
        ):
            return False
        data = self.plain(event)  # type: ignore[misc]
        if data is None or (data and not self.writer.write(data)):  # type: ignore[attr-defined]
            return False
        self.held = event.end
        self.heard_at = self.written_at = time.monotonic()
        self.resync = self.first_resync
        return True
