"""genq-batch's following half: reads what ended (GET /jobs/ended, one call a poll whatever the number of
jobs waiting, a page after another while more ended), writes each of the run's results as it ends, keeps
the progress bar, and knows how much room the key's queued-job cap leaves for the submitter."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from tqdm import tqdm

from batchclient.api import BatchError, Client, error_of
from batchclient.run_state import Results, State

CAP_SHARE = 0.9  # of the key's queued-job cap this client fills: room for the cap's count being a second old
FAILED = ("failed", "cancelled", "rejected")
# GET /jobs/ended's cursor trails the API's clock by a second, so a job whose end commits later than that
# after its end was timed is passed over. With nothing ending for this long while jobs are pending, the
# follower lists again from the creation of the oldest pending job (no job ends before it was created)
RELIST_AFTER_SECONDS = 30.0


class Follower:
    def __init__(
        self,
        client: Client,
        state: State,
        results: Results,
        bar: tqdm,
        relist_after: float = RELIST_AFTER_SECONDS,
    ):
        self.client, self.state, self.results, self.bar = client, state, results, bar
        self.relist_after, self._progress_at = relist_after, time.monotonic()
        self._lock = threading.Lock()
        self._room_changed = threading.Condition(self._lock)  # the submitter waits on it for room
        self.pending: dict[str, str] = {}  # job id -> custom_id, submitted and not yet ended
        self.ended_unknown: dict[str, dict] = {}  # ended jobs seen before their submission was recorded
        self.failed = sum(1 for row in results.rows.values() if row["status"] in FAILED)
        self._room: int | None = None  # None until the API said
        self._fill = 0
        started = [e for e in state.entries.values() if e["custom_id"] not in results.rows]
        self.submitted(started)
        times = [e["created_at"] for e in started if e.get("job_id") and e.get("created_at")]
        old = any(e.get("job_id") and not e.get("created_at") for e in started)  # an older state file
        self.since: str | None = "1970-01-01T00:00:00Z" if old else min(times, default=None)

    def room(self) -> int:
        """How many more requests the submitter may send now (0 until the API said how many are queued)."""
        with self._lock:
            return self._room or 0

    def no_room_ever(self) -> bool:
        """The API said the key's queued-job cap is 0: nothing can be submitted."""
        with self._lock:
            return self._room is not None and self._fill == 0

    def fill(self) -> int:
        """How many of the key's queued jobs this client fills the cap up to (0 until the API said)."""
        with self._lock:
            return self._fill

    def wait_for_room(self, enough: Callable[[int, int], bool], timeout: float) -> int:
        """The room (as room()) once `enough(room, fill)` holds, or after `timeout` seconds: woken by the
        answer that shows the room (a look at what ended, a bulk call's), not by a timer."""
        with self._room_changed:
            self._room_changed.wait_for(lambda: enough(self._room or 0, self._fill), timeout)
            return self._room or 0

    def queue_seen(self, queue: dict) -> None:
        """The API's count of the key's queued jobs, against its cap."""
        with self._lock:
            self._fill = int(queue["max_queued"] * CAP_SHARE)
            self._room = self._fill - queue["queued"]
            self._room_changed.notify_all()

    def submitted(self, entries: list[dict]) -> None:
        """Recorded submissions: their jobs are followed; a request the API refused is a result at once."""
        with self._lock:
            for entry in entries:
                if self._room is not None:
                    self._room -= 1
                if entry.get("job_id") is None:
                    self._write(entry["custom_id"], None, entry.get("error"))
                elif (job := self.ended_unknown.pop(entry["job_id"], None)) is not None:
                    self._write(entry["custom_id"], job)
                else:
                    self.pending[entry["job_id"]] = entry["custom_id"]

    def run(self, all_submitted: threading.Event, poll_interval: float) -> None:
        """Until every request has its result, once `all_submitted` is set (or Ctrl-C, or a failure)."""
        while not self.client.stopping.is_set():
            with self._lock:
                finished = all_submitted.is_set() and not self.pending
            if finished:
                return
            more = self.poll()
            self.bar.set_postfix(failed=self.failed, submitted=len(self.state.entries), refresh=False)
            if not more:
                if time.monotonic() - self._progress_at > self.relist_after:
                    self._relist()
                self.client.stopping.wait(poll_interval)

    def poll(self) -> bool:
        """One look at what ended; whether more is waiting to be read at once."""
        r = self.client.request("GET", "/jobs/ended", params={"since": self.since} if self.since else {})
        if r.status_code == 401:
            raise BatchError("the API key was refused (401)")
        if r.status_code != 200:
            raise BatchError(f"GET /jobs/ended answered {r.status_code}: {error_of(r)['message']}")
        page = r.json()
        with self._lock:
            for job in page["jobs"]:
                custom_id = self.pending.pop(job["id"], None)
                if custom_id is not None:
                    self._write(custom_id, job)
                elif job["id"] not in self.results.rows:
                    self.ended_unknown[job["id"]] = job
        self.since = page["next_cursor"]
        self.queue_seen(page["queue"])  # counted within a second, and never less than the truth

        return page["more"]

    def _relist(self) -> None:
        """Nothing ended for `relist_after` seconds: look again from the oldest pending job's creation, so a
        job whose end was recorded behind the cursor is found (the jobs seen again are skipped)."""
        with self._lock:
            pending = list(self.pending.values())
            created = [self.state.entries[c].get("created_at") for c in pending if c in self.state.entries]
            self._progress_at = time.monotonic()
        if pending and created and all(created):
            self.since = min(created)

    def _write(self, custom_id: str, job: dict | None, error: dict | None = None) -> None:
        row = result_row(custom_id, job, error)
        if custom_id in self.results.rows:
            return
        self._progress_at = time.monotonic()
        self.results.write(row)
        self.failed += row["status"] in FAILED
        self.bar.update(1)


def result_row(custom_id: str, job: dict | None, error: dict | None = None) -> dict:
    if job is None:
        return {
            "custom_id": custom_id,
            "job_id": None,
            "status": "rejected",
            "output": None,
            "usage": None,
            "error": error,
        }
    return {
        "custom_id": custom_id,
        "job_id": job["id"],
        "status": job["status"],
        "output": job.get("output"),
        "usage": job.get("usage"),
        "error": job.get("error"),
    }
