"""Fault injection: two and three real workers share a backlog while processes die at random moments.

Each run draws its schedule from a seed, printed (and set with GENQ_CHAOS_SEED to replay a failure):
waves of jobs (greedy and seeded, priorities 0/5/9, long prompts that prefill in chunks, an engine pool
small enough to swap), and between them kill -9 of a whole worker (its engine process with it), kill -9 of
a worker's engine process alone, kill -9 right after a wave (messages being taken and claimed) and one
SIGTERM; each worker comes back in the background. What a kill leaves behind is noted from Postgres and
Redis at that moment: jobs claimed by the dead worker (in its engine: waiting, prefilling, decoding or
swapped out; in a hand-back or a result write), and jobs whose message had left Redis unclaimed. Each must
be back in the queue (or on a live worker) within LEASE + 2 x RECONCILE_INTERVAL of the kill; at the end
every job succeeded once, token-identical to an uninterrupted run. The real beat runs the reconciler."""

from __future__ import annotations

import os
import random
import signal
import socket
import threading
import time
from datetime import datetime

import pytest
import redis

from batching import Engine, EngineConfig, SamplingParams
from contract.dispatch import waiting_jobs
from tests.reliability.conftest import (
    FINISHED,
    MARGIN_S,
    SENT_MARKS_INTERVAL_S,
    job_rows,
    stack_settings,
    submit,
    wait_for,
)
from tests.reliability.test_worker_faults import not_ended_once
from workers.reconciler import last_run


def job_bodies(rng: random.Random, n: int, start: int) -> list[dict]:
    """`n` jobs: priorities 0/5/9, greedy or seeded, short or long prompts (long ones prefill in chunks)."""
    out = []
    for i in range(start, start + n):
        words = " ".join(
            rng.choice(("mud", "sky", "cat", "rain", "stone", "river")) for _ in range(rng.choice((3, 60)))
        )
        body = {
            "prompt": f"Job {i}: {words}",
            "max_tokens": rng.randint(32, 192),
            "priority": rng.choice((0, 5, 9, 9)),
        }
        if rng.random() < 0.5:
            body["temperature"] = 0.0
        else:
            body.update(temperature=0.9, top_p=0.95, seed=rng.randint(0, 10**6))
        out.append(body)
    return out


BLOCK_SIZE = 16
# float64: in float32 the oneDNN products round differently with the batch's shape (batching/cpu_linear.py),
# so over thousands of sampled tokens a near tie between two candidates can fall either way between the
# workers' small swapping batches and the reference's one roomy batch. float64 leaves no such tie: a
# mismatch here is a recovery bug, never rounding.
DTYPE = "float64"


@pytest.fixture(scope="module")
def uninterrupted(settings):
    """`uninterrupted(bodies)`: what an uninterrupted run gives, Engine.generate offline with the workers' model
    and block size, all jobs in one batch. Outputs do not depend on the batch, the budget or preemptions (the
    engine's contract), and one roomy batch takes seconds where the workers' small, swapping pool would take
    minutes. One engine for the module: building it costs seconds too."""
    options = {
        k: v for k, v in settings.engine_options().items() if k in ("model", "device", "max_model_len")
    }
    engine = Engine(EngineConfig(**options, dtype=DTYPE, block_size=BLOCK_SIZE, max_num_seqs=128))

    def generate(bodies: list[dict]) -> list[list[int]]:
        params = [
            SamplingParams(**{k: b[k] for k in ("max_tokens", "temperature", "top_p", "seed") if k in b})
            for b in bodies
        ]
        return [o.token_ids for o in engine.generate([b["prompt"] for b in bodies], params)]

    return generate


class Tracker:
    """What each kill left behind, and when each of those jobs was back in the queue or on a live worker
    (watched every 0.1 s by a thread of its own, so nothing the test waits for delays the measure)."""

    def __init__(self, sessions, settings, ids: list[str]):
        self.sessions, self.settings, self.ids = sessions, settings, ids
        self.redis = redis.Redis.from_url(settings.redis_url)
        self.pending: list[dict] = []  # {kill, job, place, before, at}
        self.recovered: list[dict] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def waiting(self) -> set[str]:
        return {
            str(i) for _, found in waiting_jobs(self.redis, self.settings, 10_000).values() for i in found
        }

    def note(self, kill: int, process: str) -> dict[str, int]:
        """Before a kill of `process` (how its leases start): the jobs it leaves behind."""
        rows, waiting = job_rows(self.sessions, self.ids), self.waiting()
        places: dict[str, int] = {}
        for job_id, row in rows.items():
            if row["status"] == "running" and row["worker_id"].startswith(process):
                place = "claimed, with tokens saved" if row["tokens"] else "claimed, no token saved yet"
            elif row["status"] == "queued" and row["enqueued_at"] is not None and job_id not in waiting:
                place = "message taken, not claimed yet"
            else:
                continue
            places[place] = places.get(place, 0) + 1
            with self._lock:
                self.pending.append(dict(kill=kill, job=job_id, place=place, before=row, at=time.monotonic()))
        return places

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)
        self._poll()

    def _watch(self) -> None:
        while not self._stop.wait(0.1):
            try:
                self._poll()
            except Exception:  # noqa: BLE001 - a failed look is retried; the test fails on what stays pending
                continue

    def _poll(self) -> None:
        with self._lock:
            pending = list(self.pending)
        if not pending:
            return
        rows = job_rows(self.sessions, [p["job"] for p in pending])
        waiting = self.waiting()
        now = time.monotonic()
        for p in pending:
            row, before = rows[p["job"]], p["before"]
            back = (
                row["status"] in FINISHED
                or row["attempts"] > before["attempts"]
                or (
                    row["status"] == "queued"
                    and (p["job"] in waiting or row["enqueued_at"] not in (None, before["enqueued_at"]))
                )
            )
            if back:
                with self._lock:
                    self.pending.remove(p)
                    self.recovered.append({**p, "after_s": now - p["at"]})


def process_of(worker) -> str:
    """How the leases of a worker's claims start: `host:pid:`."""
    return f"{socket.gethostname()}:{worker.proc.pid}:"


@pytest.mark.slow
@pytest.mark.parametrize("n_workers", [2, 3])
def test_random_kills_across_workers_sharing_a_backlog(
    n_workers, settings, sessions, new_key, api, make_worker, beat, uninterrupted, figures, request
):
    seed = int(os.environ.get("GENQ_CHAOS_SEED") or random.SystemRandom().randrange(10**6))
    print(f"chaos seed {seed}: replay with GENQ_CHAOS_SEED={seed}")
    rng = random.Random(seed * 10 + n_workers)
    st = stack_settings(
        settings,
        dtype=DTYPE,
        lease_seconds=2.0,
        progress_interval=0.2,
        reconcile_interval=0.5,
        max_num_seqs=4,
        worker_reserve=1,
        block_size=BLOCK_SIZE,
        num_device_blocks=40,  # 4 sequences of up to ~300 tokens do not fit: they swap out and back
        num_host_blocks=256,
        max_num_batched_tokens=64,  # a long prompt prefills in several chunks
        rate_limit="1000/second",
    )
    client, headers = api(st), {"Authorization": f"Bearer {new_key()}"}
    celery = client.application.extensions["genq"].celery
    workers = [make_worker(st, concurrency=3) for _ in range(n_workers)]
    beat(st)
    t0 = time.monotonic()
    starting = [threading.Thread(target=w.start) for w in workers]
    for t in starting:
        t.start()
    for t in starting:
        t.join()
    wait_for(lambda: last_run(st) is not None, 60, "beat's first recovery run")

    bodies: list[dict] = []
    ids: list[str] = []
    tracker = Tracker(sessions, st, ids)
    request.addfinalizer(tracker.close)

    def add_jobs(n: int) -> None:
        more = job_bodies(rng, n, len(bodies))
        ids.extend(submit(client, headers, more))
        bodies.extend(more)

    def top_up() -> None:
        """A backlog twice what the workers hold, whatever the machine's speed: every fault finds work."""
        unfinished = sum(r["status"] not in FINISHED for r in job_rows(sessions, ids).values())
        add_jobs(max(0, 2 * n_workers * (st.max_num_seqs + st.worker_reserve) - unfinished))

    top_up()
    actions = ["kill -9"] * 3 + ["engine kill -9", "kill -9 after a wave", "SIGTERM"]
    rng.shuffle(actions)
    ready = {w: threading.Event() for w in workers}
    for w in workers:
        ready[w].set()
    restarts: list[threading.Thread] = []
    kills = []

    def restart(w, kill: dict | None) -> None:
        """Start `w` again once it is dead (after a warm shutdown for `kill`, a SIGTERM)."""
        if kill is not None:
            kill["exit_s"] = round(w.terminate(timeout=60), 2)
        w.start()
        ready[w].set()

    time.sleep(rng.uniform(2.0, 4.0))  # every worker busy first
    phases = {"workers_ready_s": round(time.monotonic() - t0, 1)}
    for k, action in enumerate(actions):
        top_up()
        while not (up := sorted((w for w in workers if ready[w].is_set()), key=workers.index)):
            time.sleep(0.2)  # every worker dead: wait for one to come back
        busy = {
            r["worker_id"].split("#")[0] for r in job_rows(sessions, ids).values() if r["status"] == "running"
        }
        victim = rng.choice([w for w in up if any(b.startswith(process_of(w)) for b in busy)] or up)
        try:
            stats = victim.engine_stats(celery)
        except AssertionError:  # busy: no reply in time
            stats = {}
        if action == "kill -9 after a wave":  # messages being taken and claimed as it dies
            add_jobs(6)
            time.sleep(rng.uniform(0.0, 0.05))
        places = tracker.note(k, process_of(victim))
        kills.append(
            {
                "action": action,
                "process": process_of(victim),
                "left_behind": places,
                "engine_at_kill": {
                    key: stats.get(key)
                    for key in ("num_running", "num_waiting", "num_swapped", "num_preemptions")
                },
            }
        )
        if action == "engine kill -9":
            if stats.get("engine_pid"):
                os.kill(stats["engine_pid"], signal.SIGKILL)  # the worker hands its jobs back, starts another
            else:
                kills[-1]["action"] = "none (the worker did not say its engine's pid)"
        else:
            ready[victim].clear()
            if action != "SIGTERM":
                victim.kill9()
            restarts.append(
                threading.Thread(target=restart, args=(victim, kills[-1] if action == "SIGTERM" else None))
            )
            restarts[-1].start()
        top_up()  # more work arriving while the dead are being recovered
        time.sleep(rng.uniform(1.0, 3.5))

    phases["kills_done_s"] = round(time.monotonic() - t0, 1)
    restarted_by = time.monotonic() + 180
    while any(t.is_alive() for t in restarts):  # still watching what the last faults left behind
        assert time.monotonic() < restarted_by, f"seed {seed}: a worker did not come back"
        time.sleep(0.2)
    deadline = time.monotonic() + 120
    while unfinished := {i: r for i, r in job_rows(sessions, ids).items() if r["status"] not in FINISHED}:
        assert time.monotonic() < deadline, (seed, unfinished, tracker.waiting(), tracker.pending)
        time.sleep(0.5)
    tracker.close()
    phases["all_done_s"] = round(time.monotonic() - t0, 1)
    done = job_rows(sessions, ids)
    logs = "".join(w.log_text() for w in workers)
    # a job taken unclaimed by a killed worker just after it was submitted: from its send's record
    bound = st.lease_seconds + 2 * st.reconcile_interval + SENT_MARKS_INTERVAL_S
    assert not tracker.pending, (seed, [(p["kill"], p["place"], p["job"]) for p in tracker.pending])
    assert all(r["status"] == "succeeded" for r in done.values()), (seed, done)
    sigkilled = tuple(k["process"] for k in kills if k["action"].startswith("kill -9"))
    assert not_ended_once(logs, done, sigkilled) == {}, seed
    for i, tokens in zip(ids, uninterrupted(bodies), strict=True):
        assert done[i]["tokens"] == tokens, (seed, i)
    phases["checked_s"] = round(time.monotonic() - t0, 1)
    slowest = max((r["after_s"] for r in tracker.recovered), default=0.0)
    worst = sorted(tracker.recovered, key=lambda r: -r["after_s"])[:3]
    assert slowest < bound + MARGIN_S, (
        seed,
        [(r["kill"], r["place"], round(r["after_s"], 2), r["job"]) for r in worst],
    )
    by_place: dict[str, list[float]] = {}
    for r in tracker.recovered:
        by_place.setdefault(f"{kills[r['kill']]['action']}: {r['place']}", []).append(r["after_s"])
    figures[f"chaos_{n_workers}_workers"] = {
        "seed": seed,
        "phases": phases,
        "jobs": len(ids),
        "kills": kills,
        "jobs_left_behind": len(tracker.recovered),
        "max_back_in_queue_s_by_place": {k: round(max(v), 2) for k, v in sorted(by_place.items())},
        "bound_s": bound,
        "max_attempts": max(r["attempts"] for r in done.values()),
        "duplicates": 0,
        "exact_vs_offline": True,
        "at": datetime.now().isoformat(timespec="seconds"),
    }
