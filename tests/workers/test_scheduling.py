"""A worker holding one job at a time: Redis priority order, and cancellation of running and queued jobs."""

from __future__ import annotations

from datetime import datetime

LONG = {"prompt": "A long story", "temperature": 0.0}  # greedy: runs to max_tokens, never hits EOS early


def started(job: dict) -> datetime:
    return datetime.fromisoformat(job["started_at"])


def test_priority_0_starts_before_earlier_queued_priority_9(narrow):
    blocker = narrow.submit(**LONG, max_tokens=120)
    narrow.wait(blocker, until=lambda j: j["status"] == "running")  # the worker is now full
    low = [narrow.submit(prompt=f"low {i}", max_tokens=2, priority=9) for i in range(3)]
    high = [narrow.submit(prompt=f"high {i}", max_tokens=2, priority=0) for i in range(2)]
    low_jobs, high_jobs = [narrow.wait(i) for i in low], [narrow.wait(i) for i in high]
    assert narrow.wait(blocker)["output"]["finish_reason"] == "length"  # it really held the worker throughout
    assert max(map(started, high_jobs)) < min(map(started, low_jobs)), (high_jobs, low_jobs)


def test_cancel_running_job_frees_its_slot(narrow):
    long = narrow.submit(**LONG, max_tokens=1500)
    narrow.wait(long, until=lambda j: j["status"] == "running" and j["output"]["token_ids"])
    waiting = narrow.submit(prompt="next", max_tokens=2)
    cancel = narrow.client.post(f"/jobs/{long}/cancel", headers=narrow.headers)
    assert cancel.status_code == 200 and cancel.json["status"] == "cancelled"
    nxt = narrow.wait(waiting)
    assert nxt["status"] == "succeeded"
    # the engine's one slot went to the next job within about a second of the cancel
    assert (started(nxt) - datetime.fromisoformat(cancel.json["finished_at"])).total_seconds() < 2.0
    stats = narrow.engine_stats()
    assert stats["num_running"] == stats["num_waiting"] == stats["num_swapped"] == 0
    assert stats["num_aborted"] >= 1
    final = narrow.job(long)
    assert final["status"] == "cancelled" and len(final["output"]["token_ids"]) < 1500


def test_cancel_queued_job_never_runs(narrow):
    blocker = narrow.submit(**LONG, max_tokens=80)
    narrow.wait(blocker, until=lambda j: j["status"] == "running")
    queued = narrow.submit(prompt="never", max_tokens=2)
    assert narrow.client.post(f"/jobs/{queued}/cancel", headers=narrow.headers).json["status"] == "cancelled"
    after = narrow.submit(prompt="after", max_tokens=2)  # same priority: its message comes after queued's
    assert narrow.wait(after)["status"] == "succeeded"
    job = narrow.job(queued)
    assert job["status"] == "cancelled" and job["started_at"] is None and job["output"]["token_ids"] == []
    assert f"job {queued} dropped (cancelled)" in narrow.log_text()
