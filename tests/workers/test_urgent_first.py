"""Urgent-first through the whole system: with a backlog ten times what the worker holds waiting in Redis,
urgent jobs neither wait behind it in Redis nor in the engine."""

from __future__ import annotations

import time
import uuid

from sqlalchemy import select

from jobstore.models import Job
from tests.workers.conftest import worker_stack

# greedy tiny-llama runs this chat 1,500 tokens without an EOS: every backlog job stays long (with prompts
# "backlog {i}", 49 of 60 ended within 45-1,166 tokens, and on an idle machine the backlog ran out)
NO_EOS_CHAT = [
    {"role": "system", "content": "Answer in one word."},
    {"role": "user", "content": "What comes after 3?"},
]


def timings(sessions, ids) -> dict[str, dict]:
    with sessions.begin() as s:
        rows = s.execute(
            select(
                Job.id, Job.status, Job.created_at, Job.started_at, Job.first_token_at, Job.handbacks
            ).where(Job.id.in_([uuid.UUID(i) for i in ids]))
        ).all()
    return {str(r.id): r._asdict() for r in rows}


def test_urgent_jobs_overtake_a_backlog_ten_times_what_the_worker_holds(
    settings, sessions, new_key, tmp_path
):
    settings = settings.replace(rate_limit="1000/second")  # the backlog is submitted at once
    with worker_stack(settings, new_key, tmp_path, max_num_seqs=4, reserve=2) as stack:  # holds 6 jobs
        backlog = [
            stack.submit(messages=NO_EOS_CHAT, max_tokens=1500, priority=9, temperature=0.0)
            for _ in range(60)
        ]
        stack.wait(backlog[0], until=lambda j: len(j["output"]["token_ids"]) > 0)
        deadline = time.monotonic() + 30
        while stack.engine_stats()["worker_held_jobs"] < 6:  # full: the first urgent job must take a place
            assert time.monotonic() < deadline, stack.log_text()
            time.sleep(0.05)
        urgent = []
        for i in range(3):
            urgent.append(stack.submit(prompt=f"urgent {i}", max_tokens=8, priority=0, temperature=0.0))
            assert stack.wait(urgent[-1])["status"] == "succeeded"
        seen = timings(sessions, backlog + urgent)
        stats = stack.engine_stats()
        for job_id in backlog:
            stack.client.post(f"/jobs/{job_id}/cancel", headers=stack.headers)
    assert stats["worker_capacity"] == 6 and stats["worker_held_jobs"] <= 6
    last = max(seen[i]["created_at"] for i in urgent)
    waiting = [i for i in backlog if seen[i]["started_at"] is None or seen[i]["started_at"] > last]
    assert len(waiting) >= 50, "the backlog ran out before the last urgent job: the test needs longer jobs"
    for job_id in urgent:
        u = seen[job_id]
        # no backlog job waiting in Redis when the urgent one arrived started before it (a claim already in
        # flight at that moment, the worker's intake's last pull, may land first)
        late = [
            i
            for i in backlog
            if seen[i]["started_at"] is not None and u["created_at"] < seen[i]["started_at"] < u["started_at"]
        ]
        assert len(late) <= 2, (u, [seen[i] for i in late])
        # its first token within a generous wall time (idle: tens of ms), not after a backlog job's whole run
        assert (u["first_token_at"] - u["created_at"]).total_seconds() < 3.0, u
    # the first took a held backlog job's place: that job went back to the queue with its tokens (a hand-back);
    # a later one may find a place that a finished urgent job left before a backlog claim filled it
    assert sum(seen[i]["handbacks"] for i in backlog) >= 1
