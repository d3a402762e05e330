"""A job's events: what it lived that its row's columns keep no time of (jobs.events, migration 0013).

The columns hold one time each: created, last sent to Redis, first claimed, first token, ended. A job that is
preempted inside the engine, handed back to the queue or re-claimed lives some of these more than once; each
such moment is an entry of `jobs.events`, appended by a statement that writes the row anyway (jobstore/jobs.py),
so recording them costs no extra write:

    claimed        a claim after the first (the first is started_at): `attempt`, `worker`   (the claim, DB clock)
    preempted      the engine took it out of the batch for more urgent work, `count` times since it last ran; at
                   its last step with new tokens before (the engine reports how many times, not when)
                   (the worker's clock, written with its next progress, result or hand-back write)
    resumed        its first new token after a preemption                                    (likewise)
    handed_back    its worker gave it back to the queue with its tokens: `reason` (preempted: for more urgent
                   work; handed_back: shutting down; rebalanced: for an idle worker with free slots;
                   engine_lost: its engine process died), `tokens` kept,
                   `worker`                                                                   (the hand-back, DB clock)
    lease_expired  its worker stopped renewing its lease; the reconciler sent it back to the queue: `worker`

Each entry is a JSON object {"kind", "at" (ISO 8601 with its offset), ...the kind's fields}.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from datetime import datetime, timezone


class EventKind(str, enum.Enum):
    CLAIMED = "claimed"
    PREEMPTED = "preempted"
    RESUMED = "resumed"
    HANDED_BACK = "handed_back"
    LEASE_EXPIRED = "lease_expired"


# the fields a job's owner sees (GET /jobs/<id>); `worker` names the operator's machines, shown on /admin only
PUBLIC_FIELDS = ("attempt", "count", "reason", "tokens")


@dataclass(frozen=True, slots=True)
class JobEvent:
    kind: EventKind
    at: datetime
    fields: dict = field(default_factory=dict)

    def public(self) -> dict:
        return {
            "kind": self.kind.value,
            "at": self.at,
            **{k: self.fields[k] for k in PUBLIC_FIELDS if k in self.fields},
        }


def event(kind: EventKind, at: datetime, **fields) -> dict:
    """An entry as the worker records it (preempted, resumed), ready to be appended to the row."""
    return {"kind": kind.value, "at": at.isoformat(), **fields}


def job_events(stored: list | None) -> list[JobEvent]:
    """The row's entries, parsed (times in UTC), in the order they were appended (an unknown kind is left out)."""
    kinds: dict[object, EventKind] = {k.value: k for k in EventKind}
    found = []
    for entry in stored or ():
        kind = kinds.get(entry.get("kind")) if isinstance(entry, dict) else None
        if kind is None or not isinstance(entry.get("at"), str):
            continue
        fields = {k: v for k, v in entry.items() if k not in ("kind", "at")}
        found.append(JobEvent(kind, datetime.fromisoformat(entry["at"]).astimezone(timezone.utc), fields))
    return found
