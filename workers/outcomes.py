"""How a worker's hold on a job ended: a value the metrics count and the logs print."""

from __future__ import annotations

import enum


class Outcome(str, enum.Enum):
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    STOPPED = "stopped"  # cancelled, or the lease was lost: the engine request was aborted
    PREEMPTED = "preempted"  # handed back to the queue for a more urgent job (tokens kept)
    HANDED_BACK = "handed_back"  # handed back at shutdown (tokens kept)
    # handed back, not running, for a worker with free slots that found the queue empty (tokens kept; workers/intake.py)
    REBALANCED = "rebalanced"
    ENGINE_LOST = "engine_lost"  # handed back: the engine process died (tokens kept); a new one starts
    LEFT = "left"  # the engine stopped first: the lease lapses and the reconciler re-sends it
    DISCARDED = "discarded"  # finished, but the job was no longer this worker's: result not written
    DROPPED = "dropped"  # a message for a job that was not queued (finished, cancelled, taken)
    DECLINED = "declined"  # taken as the intake stopped (paused, shutting down): message sent back unclaimed
