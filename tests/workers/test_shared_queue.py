"""Several workers on one queue share its work under SCHEDULING_POLICY=preemptive, where a worker holds 3x its
engine's slots (workers/intake.py): a worker with free slots that finds the queue empty says so, and a worker
holding jobs beyond its base (slots + the small reserve) that are not running hands them back to it."""

from __future__ import annotations

import re
import time
import uuid

from contract.dispatch import QUEUE
from jobstore import jobs
from tests.workers.test_within_class import LONG, api, worker, workers

TOKENS = (
    2000  # long enough that the first worker still holds jobs when the second starts (the context: 2,048)
)
PREFIX = 64  # tokens B's jobs make before the first test compares them and cancels every job


def holders(sessions, ids: list[str]) -> dict[str, int | None]:
    """Job id -> the pid of the worker process that holds (or last held) it, from its row's lease."""
    with sessions() as s:
        rows = {i: jobs.get_job(s, uuid.UUID(i)) for i in ids}
    return {i: int(r.worker_id.split(":")[1]) if r.worker_id else None for i, r in rows.items()}


def six_held_by(stack, sessions, worker) -> list[str]:
    """Six long jobs sent, once `worker` (the only one taking jobs) holds them all: their ids."""
    ids = [stack.submit(**LONG, max_tokens=TOKENS) for _ in range(6)]
    deadline = time.monotonic() + 60
    while set(holders(sessions, ids).values()) != {worker.pid}:
        assert time.monotonic() < deadline, holders(sessions, ids)
        time.sleep(0.1)
    return ids


def test_a_worker_that_starts_idle_gets_jobs_another_holds_beyond_its_slots(
    settings, new_key, sessions, redis_client, tmp_path, offline_engine
):
    """Worker A (2 slots, holding up to 6) takes 6 long jobs while worker B's intake is paused. B resumes: within
    seconds it runs 2 of them, handed back by A (its jobs beyond slots + 2 that were waiting in its engine), while
    A runs the others; each job's tokens are a run alone's, B's from their first. Without the hand-back B would
    idle until A had run all 6: A claimed all 6 before B resumed, so every job B runs is one A handed back (its
    log). The jobs are cancelled once B's have made PREFIX tokens (run to their end, the test took 3.5 minutes on
    a 2-core machine; what it checks is settled by then)."""
    with api(settings, new_key, tmp_path / "a.log", "preemptive", max_num_seqs=2, reserve=None) as stack:
        assert stack.settings.worker_capacity(2) == 6 and stack.settings.worker_base_capacity(2) == 4
        with worker(stack.settings, tmp_path / "b.log") as b:
            stack.celery.control.cancel_consumer(
                QUEUE, reply=True, timeout=5
            )  # B alone on this stack's queue
            with worker(stack.settings, tmp_path / "a.log") as a:
                ids = six_held_by(stack, sessions, a)
                stack.celery.control.add_consumer(QUEUE, reply=True, timeout=5)  # B takes jobs again
                deadline = time.monotonic() + 15
                while b.pid not in holders(sessions, ids).values():
                    assert time.monotonic() < deadline, "worker B got none of A's waiting jobs"
                    time.sleep(0.1)
                time.sleep(2)  # a second word from B, were it to ask for more (it has two slots)
                ran_by_b = {i for i, pid in holders(sessions, ids).items() if pid == b.pid}
                done = {
                    i: stack.wait(i, until=lambda j: len(j["output"]["token_ids"]) >= PREFIX, timeout=120)
                    for i in ran_by_b
                }
                for job_id in ids:
                    stack.client.post(f"/jobs/{job_id}/cancel", headers=stack.headers)
                rows = {i: stack.job(i) for i in ids}
    # the jobs B ran are jobs A handed back for it (not jobs A left, nor ran: A had claimed all 6 first)
    handed = re.findall(r"handed back for a worker with free slots: (.*)", (tmp_path / "a.log").read_text())
    moved = {m for line in handed for m in re.findall(r"[0-9a-f]{8}-[0-9a-f-]{27}", line)}
    assert ran_by_b <= moved, (ran_by_b, handed)
    for i in ran_by_b:  # and its record says why
        reasons = [e.get("reason") for e in done[i]["events"] if e["kind"] == "handed_back"]
        assert "rebalanced" in reasons, done[i]["events"]
    assert len(ran_by_b) == 2, ran_by_b  # B's two free slots
    longest = max(len(job["output"]["token_ids"]) for job in [*done.values(), *rows.values()])
    [alone] = offline_engine.generate([LONG["prompt"]], offline_params(longest))
    for job in [*done.values(), *rows.values()]:  # B's from their first token; A's as far as they got
        made = job["output"]["token_ids"]
        assert made == alone.token_ids[: len(made)], job["id"]


def test_two_idle_workers_share_one_push_of_many_jobs(settings, new_key, sessions, redis_client, tmp_path):
    """Two idle workers (2 slots, holding up to 6 each) and 6 jobs sent in one push (POST /jobs/bulk: one LPUSH):
    each worker asks for its base (4) at most, so the one served first takes 4 and the other 2, and no job is
    handed back or run twice. A pull asking for all it may hold took all 6: the other worker idled until it said
    so and got 2 of them back."""
    with api(settings, new_key, tmp_path / "a.log", "preemptive", max_num_seqs=2, reserve=None) as stack:
        with workers(stack.settings, tmp_path / "a.log", tmp_path / "b.log") as (a, b):
            time.sleep(1.5)  # both waiting in their pulls
            r = stack.client.post(
                "/jobs/bulk", json={"jobs": [{**LONG, "max_tokens": TOKENS}] * 6}, headers=stack.headers
            )
            assert r.status_code == 200, r.json
            ids = [item["job"]["id"] for item in r.json["results"]]
            deadline = time.monotonic() + 30
            while None in (by := holders(sessions, ids)).values():
                assert time.monotonic() < deadline, by
                time.sleep(0.1)
            time.sleep(3)  # time for an idle worker to say so and get jobs back (IDLE_AFTER + PULL_WAIT)
            by = holders(sessions, ids)
            with sessions() as s:
                rows = [jobs.get_job(s, uuid.UUID(i)) for i in ids]
            for job_id in ids:
                stack.client.post(f"/jobs/{job_id}/cancel", headers=stack.headers)
    assert sorted(list(by.values()).count(pid) for pid in (a.pid, b.pid)) == [2, 4], by
    assert [(row.attempts, row.handbacks) for row in rows] == [(1, 0)] * 6, [
        (r.attempts, r.events) for r in rows
    ]


def test_a_worker_does_not_answer_its_own_word(settings, new_key, sessions, redis_client, tmp_path):
    """A worker's word that it has free slots names it, and the worker never answers it itself. It says so when
    a pull finds nothing; if messages come within the word's three seconds (the reconciler sending again what
    a Redis failover lost) and take it beyond its base, answering its own word would hand those jobs back to
    itself, each then claimed a second time for nothing. A word naming another worker it answers."""
    with api(settings, new_key, tmp_path / "a.log", "preemptive", max_num_seqs=2, reserve=None) as stack:
        with worker(stack.settings, tmp_path / "a.log") as a:
            ids = six_held_by(stack, sessions, a)

            def handbacks() -> list[int]:  # per job, its handed_back events (`handbacks` counts preemptions)
                with sessions() as s:
                    rows = [jobs.get_job(s, uuid.UUID(i)) for i in ids]
                return [sum(e["kind"] == "handed_back" for e in row.events or ()) for row in rows]

            with sessions() as s:
                own = jobs.get_job(s, uuid.UUID(ids[0])).worker_id.split("#")[0]  # a lease: <worker>#<claim>
            hungry = f"{stack.settings.redis_key_prefix}{QUEUE}:hungry"
            deadline = time.monotonic() + 3  # three looks for a word (one every PULL_WAIT)
            while time.monotonic() < deadline:
                redis_client.set(hungry, f"2 {own}", px=3000)
                time.sleep(0.2)
            assert handbacks() == [0] * 6, "the worker answered its own word"
            redis_client.set(hungry, "2 another-worker", px=3000)
            deadline = time.monotonic() + 15
            while sum(handbacks()) < 2:
                assert time.monotonic() < deadline, "the worker did not answer another's word"
                time.sleep(0.1)
            for job_id in ids:
                stack.client.post(f"/jobs/{job_id}/cancel", headers=stack.headers)


def offline_params(max_tokens: int = TOKENS):
    from batching import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
