"""GET /jobs/<id>/events' server-sent events, rendered from a follower's events (webapi/following.py).

    retry: 1000
    id: <tokens>.<chars>  event: status | delta | result  data: <JSON>

Each event's id is the position in the job's output after it, so a client that reconnects with
Last-Event-ID goes on from there with nothing sent twice.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

from contract.deltas import Delta, Position
from contract.token_events import Status
from webapi.following import Ended, JobFollower
from webapi.schemas import JobOut
from webapi.sse import FLUSH, HEARTBEAT, Flush


def job_event_pieces(follower: JobFollower, since: Position) -> Iterator[bytes | Flush]:
    """The events of the follower's job beyond `since`: its status changes, a delta event per step, and the
    result last; a HEARTBEAT when nothing came for a tick."""
    yield b"retry: 1000\n\n"
    for item in follower.events(since=since):
        if isinstance(item, Delta):
            yield delta_event(item)
        elif isinstance(item, Status):
            yield sse("status", {"status": item.status}, follower.held())
        elif isinstance(item, Ended):
            yield sse("result", JobOut.from_job(item.job).model_dump(mode="json"), follower.held())
            return
        elif item is FLUSH:
            yield FLUSH
        else:
            yield HEARTBEAT


def delta_event(item: Delta) -> bytes:
    """A delta as its server-sent event: its tokens, text, finish and per-token fields; its id the position
    after it."""
    data = {"token_ids": item.token_ids, "text": item.text, "finish_reason": item.finish_reason}
    return sse("delta", data | (item.fields or {}), item.end)


def sse(event: str, data: dict, position: Position) -> bytes:
    """One server-sent event; its id is the position in the output after it (resume with Last-Event-ID)."""
    return f"id: {position.id}\nevent: {event}\ndata: {json.dumps(data)}\n\n".encode()
