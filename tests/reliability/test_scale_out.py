"""Two workers (two processes, two engines) on one Redis and one Postgres: both take from the backlog, an
urgent job overtakes it on either, and kill -9 of one mid-run loses nothing: every job ends once, exactly
as an uninterrupted run ends it."""

from __future__ import annotations

import time
import uuid
from datetime import datetime

from sqlalchemy import select

from jobstore.models import Job
from tests.reliability.conftest import FINISHED, Reconciler, job_rows, stack_settings, submit, wait_for
from tests.reliability.test_worker_faults import bodies, expected, not_ended_once


def timings(sessions, ids) -> dict[str, dict]:
    with sessions.begin() as s:
        rows = s.execute(
            select(Job.id, Job.created_at, Job.started_at, Job.first_token_at, Job.handbacks).where(
                Job.id.in_([uuid.UUID(i) for i in ids])
            )
        ).all()
    return {str(r.id): r._asdict() for r in rows}


def process_of(lease: str) -> str:
    """The worker process a lease names (`host:pid:uuid#claim`)."""
    return lease.split("#", 1)[0]


def test_two_workers_share_a_backlog_urgent_first_and_survive_a_kill_9(
    settings, sessions, new_key, api, make_worker, figures
):
    st = stack_settings(
        settings,
        lease_seconds=2.0,
        progress_interval=0.2,
        max_num_seqs=3,
        worker_reserve=1,
        reconcile_interval=0.5,
    )  # each worker holds 4 jobs
    client, headers = api(st), {"Authorization": f"Bearer {new_key()}"}
    first, second = make_worker(st, concurrency=2), make_worker(st, concurrency=2)
    first.start()
    second.start()
    backlog = bodies(20, 0, max_tokens=300)
    ids = submit(client, headers, backlog)
    wait_for(
        lambda: (
            len(
                {
                    process_of(r["worker_id"])
                    for r in job_rows(sessions, ids).values()
                    if r["status"] == "running"
                }
            )
            == 2
        ),
        60,
        "both workers running backlog jobs",
    )

    # urgent jobs overtake the backlog on whichever worker takes them
    urgent_bodies = [
        {"prompt": f"urgent {i}", "max_tokens": 8, "priority": 0, "temperature": 0.0} for i in range(2)
    ]
    urgent = []
    for body in urgent_bodies:
        [job_id] = submit(client, headers, [body])
        urgent.append(job_id)
        wait_for(lambda i=job_id: job_rows(sessions, [i])[i]["status"] in FINISHED, 60, "urgent job done")
    seen = timings(sessions, ids + urgent)
    for job_id in urgent:
        u = seen[job_id]
        overtaken = [
            i for i in ids if seen[i]["started_at"] is None or seen[i]["started_at"] > u["created_at"]
        ]
        assert overtaken, "the backlog ran out before the urgent job: make it longer"
        # backlog jobs that had not started when the urgent job arrived start after it (the claims of a pull
        # already in flight at that moment, one per worker, may still land first)
        late = [
            i
            for i in overtaken
            if seen[i]["started_at"] is not None and seen[i]["started_at"] < u["started_at"]
        ]
        assert len(late) <= 4, (u, [seen[i] for i in late])
        assert (u["first_token_at"] - u["created_at"]).total_seconds() < 5.0, u

    # kill -9 one worker while it holds jobs; the other worker and the reconciler finish everything
    rows = job_rows(sessions, ids)
    victim_process = next(process_of(r["worker_id"]) for r in rows.values() if r["status"] == "running")
    pid = int(victim_process.split(":")[1])
    killed = next(w for w in (first, second) if w.proc.pid == pid)
    held_at_kill = [
        i
        for i, r in rows.items()
        if r["status"] == "running" and process_of(r["worker_id"]) == victim_process
    ]
    killed.kill9()
    killed_at = time.monotonic()
    with Reconciler(sessions, st, interval=0.5):
        done = wait_for(
            lambda: (
                (rows := job_rows(sessions, ids + urgent))
                and all(r["status"] in FINISHED for r in rows.values())
                and rows
            ),
            240,
            "all jobs finished",
        )
    recovery_s = time.monotonic() - killed_at
    logs = first.log_text() + second.log_text()
    assert all(r["status"] == "succeeded" for r in done.values()), done
    assert not_ended_once(logs, done, (victim_process,)) == {}  # each ended once
    for i, tokens in zip(ids + urgent, expected(st, backlog + urgent_bodies), strict=True):
        assert done[i]["tokens"] == tokens, i
    by_process = {}
    for r in done.values():
        by_process[process_of(r["worker_id"])] = by_process.get(process_of(r["worker_id"]), 0) + 1
    # both did work (both ran backlog jobs at once, waited for above); the killed one's jobs were resumed and
    # finished by the survivor
    assert held_at_kill and all(done[i]["attempts"] >= 2 for i in held_at_kill), held_at_kill
    assert not any(process_of(done[i]["worker_id"]) == victim_process for i in held_at_kill)
    figures["two_workers_kill_9"] = {
        "jobs": len(ids) + len(urgent),
        "held_by_killed_worker": len(held_at_kill),
        "finished_by_process": sorted(by_process.values()),
        "duplicates": 0,
        "exact_vs_offline": True,
        "urgent_ttft_s": [
            round((seen[u]["first_token_at"] - seen[u]["created_at"]).total_seconds(), 3) for u in urgent
        ],
        "all_done_after_kill_s": round(recovery_s, 2),
        "at": datetime.now().isoformat(timespec="seconds"),
    }
