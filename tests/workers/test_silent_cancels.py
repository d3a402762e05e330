"""A job cancelled where no event is published (a batch's cancel or expiry writes the rows, nothing more):
the worker stops it at its next progress write and says so in the token events, so a caller following the
job hears of the end at once, not at its own reread of the row (EVENTS_RESYNC_SECONDS, 30 s +-25%)."""

from __future__ import annotations

import json
import time
import uuid

import requests
from sqlalchemy import func, update

from jobstore.models import Job, JobStatus


def test_a_follower_hears_at_once_of_a_job_cancelled_without_an_event(wide, api_url, sessions):
    job_id = wide.submit(prompt="A long story", max_tokens=1500, temperature=0, ignore_eos=True)
    with requests.get(f"{api_url}/jobs/{job_id}/events", headers=wide.headers, stream=True, timeout=60) as r:
        assert r.status_code == 200
        lines = r.iter_lines(decode_unicode=True)
        assert any(line == "event: delta" for line in lines)  # it runs, and the caller follows it live
        with sessions.begin() as session:  # as jobstore.batches cancels a batch's jobs: the row only
            session.execute(
                update(Job)
                .where(Job.id == uuid.UUID(job_id))
                .values(status=JobStatus.CANCELLED, finished_at=func.now(), lease_expires_at=None)
            )
        cancelled_at = time.monotonic()
        event, result = None, None
        for line in lines:
            if line == "event: result":
                event = "result"
            elif event == "result" and line.startswith("data: "):
                result = json.loads(line.removeprefix("data: "))
                break
        waited = time.monotonic() - cancelled_at
    assert result is not None and result["status"] == "cancelled"
    assert waited < 10, f"the follower heard of the cancel after {waited:.1f} s"
