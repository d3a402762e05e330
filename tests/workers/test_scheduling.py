"""A worker holding one job at a time: queue-level preemption, Redis priority order, and cancellation."""

from __future__ import annotations

import time
import uuid
from datetime import datetime

from jobstore import jobs
from tests.workers.test_end_to_end import expected_outputs
from workers.outcomes import Outcome

LONG = {"prompt": "A long story", "temperature": 0.0}  # greedy: runs to max_tokens, never hits EOS early


def started(job: dict) -> datetime:
    return datetime.fromisoformat(job["started_at"])


def finished(job: dict) -> datetime:
    return datetime.fromisoformat(job["finished_at"])


def test_priority_0_takes_the_place_of_a_running_job_which_resumes_token_identical(
    narrow, sessions, offline_engine
):
    """The worker holds one job. Urgent jobs do not wait in Redis behind it: the running priority-5 job is
    handed back (tokens kept), the urgent ones run, then it resumes and ends as if never interrupted;
    priority-9 jobs queued before the urgent ones start after all of them."""
    # seeded sampling resumes exactly too; ignore_eos: a draw of the end token must not end it before the urgent jobs come
    body = {**LONG, "max_tokens": 400, "seed": 5, "temperature": 0.9, "ignore_eos": True}
    blocker = narrow.submit(**body)
    narrow.wait(blocker, until=lambda j: j["status"] == "running" and len(j["output"]["token_ids"]) >= 8)
    low = [narrow.submit(prompt=f"low {i}", max_tokens=2, priority=9) for i in range(3)]
    high = [narrow.submit(prompt=f"high {i}", max_tokens=2, priority=0) for i in range(2)]
    low_jobs, high_jobs = [narrow.wait(i) for i in low], [narrow.wait(i) for i in high]
    done = narrow.wait(blocker)
    [expected] = expected_outputs(offline_engine, [body])
    assert done["output"]["token_ids"] == expected.token_ids and done["output"]["text"] == expected.text
    with sessions.begin() as s:
        row = jobs.get_job(s, uuid.UUID(blocker))
    # handed back for the urgent jobs, at most once for each, and each time claimed again (no attempt lost).
    # Twice happens: the first urgent job may be done before the second is sent, and the handed-back job, at
    # the head of its list, takes the free place again, until the second urgent job takes it once more.
    assert 1 <= row.handbacks <= len(high) and row.attempts == row.handbacks + 1, (
        row.handbacks,
        row.attempts,
    )
    assert max(map(started, high_jobs)) < min(map(started, low_jobs)), (high_jobs, low_jobs)
    assert max(finished(j) for j in high_jobs) < finished(done)


def test_a_full_worker_takes_no_job_less_urgent_than_it_holds(narrow):
    """The worker holds one job. A less urgent job submitted while it runs waits in Redis until it ends: the
    intake of a full worker looks only at more urgent lists. Each round starts from an idle worker, whose
    intake waits in a BLMPOP on every list when the blocker comes (the next message must not be taken with
    the room the blocker filled). A round whose blocker ends within the wait (a fast CPU runs 2,000 tokens of the
    tiny model in about 2 s) shows nothing and is run again: 4 rounds that show it, at least 2."""
    shown = 0
    for round_ in range(8):
        blocker = narrow.submit(**LONG, max_tokens=2000, ignore_eos=True)  # (the model's context: 2,048)
        narrow.wait(blocker, until=lambda j: j["status"] == "running")
        low = narrow.submit(prompt=f"low {round_}", max_tokens=2, priority=9)
        time.sleep(1.5)  # longer than a BLMPOP's timeout (1 s): a pull in flight has ended
        low_then = narrow.job(low)
        if narrow.job(blocker)["status"] == "running":  # (read after the low job's: it ran all that time)
            assert low_then["status"] == "queued", (round_, low_then)
            shown += 1
        narrow.client.post(f"/jobs/{blocker}/cancel", headers=narrow.headers)
        assert narrow.wait(low)["status"] == "succeeded"
        if shown == 4:
            break
    assert shown >= 2, f"the blocker ended within 1.5 s in {round_ + 1 - shown} of {round_ + 1} rounds"


def test_cancel_running_job_frees_its_slot(narrow):
    generated_before = narrow.engine_stats()["num_generated_tokens"]
    long = narrow.submit(**LONG, max_tokens=1500)
    narrow.wait(long, until=lambda j: j["status"] == "running" and j["output"]["token_ids"])
    waiting = narrow.submit(prompt="next", max_tokens=2)
    cancel = narrow.client.post(f"/jobs/{long}/cancel", headers=narrow.headers)
    assert cancel.status_code == 200 and cancel.json["status"] == "cancelled"
    nxt = narrow.wait(waiting)
    assert nxt["status"] == "succeeded"
    # the engine's one slot went to the next job before the long one ran to its end: had the cancel
    # not left the engine, its 1500 tokens would have come first
    stats = narrow.engine_stats()
    assert stats["num_generated_tokens"] - generated_before < 1500 + 2
    assert stats["num_running"] == stats["num_waiting"] == stats["num_swapped"] == 0
    assert stats["num_aborted"] >= 1
    final = narrow.job(long)
    assert final["status"] == "cancelled" and len(final["output"]["token_ids"]) < 1500


def test_cancel_queued_job_never_runs(narrow):
    outcomes_before = narrow.outcomes()
    # runs on while `queued` is submitted and cancelled (2,000 tokens: a fast CPU runs 400 in a few tenths of a second)
    blocker = narrow.submit(**LONG, max_tokens=2000)
    narrow.wait(blocker, until=lambda j: j["status"] == "running")
    queued = narrow.submit(prompt="never", max_tokens=2)
    assert narrow.client.post(f"/jobs/{queued}/cancel", headers=narrow.headers).json["status"] == "cancelled"
    after = narrow.submit(prompt="after", max_tokens=2)  # same priority: its message comes after queued's
    assert narrow.wait(after)["status"] == "succeeded"
    job = narrow.job(queued)
    assert job["status"] == "cancelled" and job["started_at"] is None and job["output"]["token_ids"] == []
    # its message was taken and dropped, never claimed: one hold ended as DROPPED, and only one
    ended = narrow.outcomes() - outcomes_before
    assert ended[Outcome.DROPPED] == 1 and ended[Outcome.SUCCEEDED] >= 2, ended
