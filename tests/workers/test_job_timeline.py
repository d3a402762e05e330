"""A job's timeline with a real worker: a job preempted inside the engine by an urgent one, and a job handed back
to the queue by a full worker, show these moments (GET /jobs/<id>'s `events`, and the admin page's timeline),
each with its time, in the order they happened."""

from __future__ import annotations

import re
import uuid
from contextlib import contextmanager
from datetime import datetime

from tests.workers.test_scheduling import LONG

ADMIN_KEY = "admin-" + uuid.uuid4().hex


def at(value: str) -> datetime:
    return datetime.fromisoformat(value)


def moments(job: dict) -> list[tuple[str, datetime]]:
    """The job's own times and its events, in the order the body lists them (columns first, then events)."""
    columns = [(name, job[f"{name}_at"]) for name in ("created", "started", "first_token")]
    events = [(e["kind"], e["at"]) for e in job["events"]]
    return [(name, at(when)) for name, when in columns + events + [("finished", job["finished_at"])]]


def assert_in_order(job: dict) -> None:
    found = moments(job)
    assert [when for _, when in found] == sorted(when for _, when in found), found


@contextmanager
def admin_client(stack):
    from webapi import create_app

    app = create_app(stack.settings.replace(admin_key=ADMIN_KEY))
    try:
        yield app.test_client()
    finally:
        app.extensions["genq"].close()


def admin_timeline(stack, job_id: str) -> list[tuple[str, datetime]]:
    """The admin page's timeline rows of the job that have a time: (data-event, data-at), in the page's order.
    Left out: `queued`, the row's last send to Redis, written just after the send, so a worker may claim the job
    before it is (and after a hand-back, a claim first leaves it unset)."""
    with admin_client(stack) as client:
        r = client.get(f"/admin/jobs/{job_id}", headers={"Authorization": f"Bearer {ADMIN_KEY}"})
    assert r.status_code == 200
    rows = re.findall(r'<tr data-event="([a-z_]+)" data-at="([^"]*)">', r.get_data(as_text=True))
    timed = [(kind, at(when)) for kind, when in rows if when]
    assert [when for _, when in timed] == sorted(when for _, when in timed), rows
    assert all(when for kind, when in rows if kind != "queued"), rows  # it ended: nothing else is to come
    return [(kind, when) for kind, when in timed if kind != "queued"]


def test_a_job_preempted_in_the_engine_by_an_urgent_one(wide):
    """The worker's engine runs 8 sequences and holds 2 jobs more: 8 priority-9 jobs decoding, a priority-0 job
    takes one's place in the batch (the engine preempts it) and, once the urgent job ends, it resumes."""
    # 2,000 tokens (the model's context: 2,048): a fast CPU ran 400 before the waits below saw each running
    body = {**LONG, "max_tokens": 2000, "ignore_eos": True, "priority": 9}
    low = [wide.submit(**body) for _ in range(8)]
    for job_id in low:
        wide.wait(job_id, until=lambda j: j["status"] == "running" and len(j["output"]["token_ids"]) >= 2)
    urgent = wide.wait(wide.submit(prompt="urgent", max_tokens=4, priority=0))
    ended = [wide.wait(job_id) for job_id in low]
    assert urgent["status"] == "succeeded" and all(j["status"] == "succeeded" for j in ended)
    assert urgent["events"] == []  # it ran straight through
    preempted = [j for j in ended if j["events"]]
    assert preempted, "no job was preempted"
    for job in preempted:
        kinds = [e["kind"] for e in job["events"]]
        assert kinds[:2] == ["preempted", "resumed"] and set(kinds) <= {"preempted", "resumed"}, kinds
        assert job["events"][0]["count"] >= 1 and "worker" not in job["events"][0]
        assert_in_order(job)
        # it was out of the batch while the urgent job ran: taken out before its end, resumed after its claim
        assert at(job["events"][0]["at"]) < at(urgent["finished_at"])
        assert at(job["events"][1]["at"]) > at(urgent["started_at"])
        assert job["usage"]["completion_tokens"] == body["max_tokens"]
    page = admin_timeline(wide, preempted[0]["id"])
    events = [e["kind"] for e in preempted[0]["events"]]
    assert [kind for kind, _ in page] == ["created", "first_claim", "first_token", *events, "ended"], page


def test_a_job_handed_back_by_a_full_worker_and_claimed_again(narrow):
    """The worker holds one job: an urgent job takes the place of the running one, which goes back to the queue
    with its tokens and is claimed again once the urgent job ends."""
    # 2,000 tokens (the model's context: 2,048): with faster attention kernels the fresh-clone run on a Zen 4 ran
    # 400 before the urgent job reached the worker, and nothing was handed back
    blocker = narrow.submit(**LONG, max_tokens=2000, ignore_eos=True, priority=5)
    narrow.wait(blocker, until=lambda j: j["status"] == "running" and len(j["output"]["token_ids"]) >= 8)
    urgent = narrow.wait(narrow.submit(prompt="urgent", max_tokens=2, priority=0))
    job = narrow.wait(blocker)
    assert job["status"] == "succeeded" and job["usage"]["completion_tokens"] == 2000
    # the engine may also have preempted it, if the urgent job reached it before the blocker's abort
    queue_moves = [e for e in job["events"] if e["kind"] != "preempted"]
    assert [e["kind"] for e in queue_moves] == ["handed_back", "claimed"], job["events"]
    handed_back, claimed = queue_moves
    assert handed_back["reason"] == "preempted" and handed_back["tokens"] >= 8
    assert claimed["attempt"] == 2
    assert_in_order(job)
    # handed back for the urgent job once that was claimed, and claimed again after it (the database's clock)
    assert at(urgent["started_at"]) <= at(handed_back["at"]) <= at(claimed["at"])
    page = admin_timeline(narrow, blocker)
    kinds = [kind for kind, _ in page if kind != "preempted"]
    assert kinds == ["created", "first_claim", "first_token", "handed_back", "claimed", "ended"], page
