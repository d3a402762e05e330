"""genq-batch's submitting half: the input file's requests, sent in bulk (POST /jobs/bulk), never more at
once than the key's queued-job cap has room for, each accepted one recorded in the state file."""

from __future__ import annotations

import json
import threading
from collections import deque
from pathlib import Path

from batchclient.api import BatchError, Client, error_of
from batchclient.follow import Follower
from batchclient.run_state import State

MAX_BULK_BYTES = 900_000  # of a bulk call's body: under the API's MAX_BODY_BYTES default (1 MiB)
RETRIED_CODES = ("too_many_queued_jobs", "overloaded")  # an item refused for now: sent again later
# a call waits until the cap has room for this many (or all that is left, or a quarter of what the client
# fills of the cap): at the cap, room frees a few jobs at a time, and a call per few jobs cost the API more
MIN_BULK = 100
STOP_CHECK_SECONDS = 0.2  # how often a submitter waiting for room looks whether the run is stopping


def read_requests(path: Path) -> list[dict]:
    """The input lines, checked: each an object with a unique string custom_id."""
    items, seen = [], set()
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as exc:
            raise BatchError(f"{path}:{n}: not JSON: {exc}") from None
        custom_id = item.get("custom_id") if isinstance(item, dict) else None
        if not isinstance(custom_id, str) or not custom_id:
            raise BatchError(f"{path}:{n}: each line needs a non-empty string custom_id")
        if custom_id in seen:
            raise BatchError(f"{path}:{n}: custom_id {custom_id!r} appears twice")
        seen.add(custom_id)
        items.append(item)
    return items


class Submitter:
    """Sends the requests the state file lacks; runs in a thread of its own while the follower reads what
    ended. `done` is set when it stops; `error` says why, if it failed."""

    def __init__(self, client: Client, state: State, items: list[dict], follower: Follower, bulk_size: int):
        self.client, self.state, self.follower, self.bulk_size = client, state, follower, bulk_size
        self.todo = deque(item for item in items if item["custom_id"] not in state.entries)
        self.done = threading.Event()
        self.error: BatchError | None = None

    def run(self) -> None:
        try:
            while self.todo and not self.client.stopping.is_set():
                if self.follower.no_room_ever():
                    raise BatchError("the API allows this key no queued job (its tenant's max_queued is 0)")
                # woken as soon as an answer shows the room (a timeout only to look at `stopping` again)
                room = self.follower.wait_for_room(self.enough, STOP_CHECK_SECONDS)
                if not self.enough(room, self.follower.fill()):
                    continue
                self.send(self.take(min(room, self.bulk_size)))
        except BatchError as exc:
            if not self.client.stopping.is_set():
                self.error = exc
                self.client.stopping.set()
        finally:
            self.done.set()

    def enough(self, room: int, fill: int) -> bool:
        """Whether `room` is worth a bulk call: MIN_BULK, or all that is left, or a quarter of `fill`."""
        return room >= min(MIN_BULK, self.bulk_size, len(self.todo), max(1, fill // 4))

    def take(self, count: int) -> list[tuple[dict, bytes]]:
        """Up to `count` requests from the front of the queue, their bodies together under MAX_BULK_BYTES."""
        chunk, size = [], 0
        while self.todo and len(chunk) < count:
            item = self.todo[0]
            body = {k: v for k, v in item.items() if k != "custom_id"}
            body["idempotency_key"] = self.state.idempotency_key(item["custom_id"])
            encoded = json.dumps(body).encode()
            if chunk and size + len(encoded) + 1 > MAX_BULK_BYTES:
                break
            chunk.append((self.todo.popleft(), encoded))
            size += len(encoded) + 1
        return chunk

    def send(self, chunk: list[tuple[dict, bytes]]) -> None:
        """One POST /jobs/bulk; accepted and refused requests recorded, those refused for now queued again."""
        data = b'{"jobs": [' + b", ".join(encoded for _, encoded in chunk) + b"]}"
        r = self.client.request("POST", "/jobs/bulk", data=data, headers={"Content-Type": "application/json"})
        if r.status_code == 401:
            raise BatchError("the API key was refused (401)")
        if r.status_code == 413 and len(chunk) == 1:
            self.record([(chunk[0][0], {"job_id": None, "error": error_of(r)})])
            return
        if r.status_code != 200:
            raise BatchError(f"POST /jobs/bulk answered {r.status_code}: {error_of(r)['message']}")
        answer = r.json()
        entries, again = [], []
        for (item, _), result in zip(chunk, answer["results"], strict=True):
            if result["status"] == 202:
                job = result["job"]
                entries.append((item, {"job_id": job["id"], "created_at": job["created_at"]}))
            elif result["error"]["code"] in RETRIED_CODES:
                again.append(item)
            else:
                entries.append((item, {"job_id": None, "error": result["error"]}))
        self.todo.extendleft(reversed(again))
        self.record(entries)
        self.follower.queue_seen(answer["queue"])
        if again:
            self.client.stopping.wait(1.0)

    def record(self, entries: list[tuple[dict, dict]]) -> None:
        rows = [{"custom_id": item["custom_id"], **entry} for item, entry in entries]
        self.state.record(rows)
        self.follower.submitted(rows)
