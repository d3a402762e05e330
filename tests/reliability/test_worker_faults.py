"""A worker killed with kill -9 mid-generation, a worker shut down with SIGTERM, and a worker's engine
process killed: every job ends exactly once, resumes from its persisted tokens, and ends with the tokens
an uninterrupted run gives."""

from __future__ import annotations

import os
import re
import signal
import time

from batching import Engine, EngineConfig, SamplingParams
from tests.reliability.conftest import FINISHED, Reconciler, job_rows, stack_settings, submit, wait_for

# long enough that jobs are still running when the test kills or stops the worker, however fast the machine
LONG_JOB_TOKENS = 800


def bodies(n_low: int, n_urgent: int, max_tokens: int) -> list[dict]:
    """Greedy and seeded jobs: `n_low` at priority 9, then `n_urgent` at priority 0 (they preempt)."""
    out = []
    for i in range(n_low + n_urgent):
        body = {
            "prompt": f"Job {i}: the {'cat' if i % 2 else 'sky'} over the mud {i * 7}",
            "max_tokens": max_tokens,
            "priority": 9 if i < n_low else 0,
        }
        body.update(
            {"temperature": 0.0} if i % 2 == 0 else {"temperature": 0.9, "top_p": 0.95, "seed": 500 + i}
        )
        out.append(body)
    return out


def expected(settings, jobs: list[dict]):
    """What an uninterrupted run gives: Engine.generate offline, same engine config as the worker."""
    engine = Engine(EngineConfig(**settings.engine_options()))
    params = [
        SamplingParams(**{k: b[k] for k in ("max_tokens", "temperature", "top_p", "seed") if k in b})
        for b in jobs
    ]
    return [o.token_ids for o in engine.generate([b["prompt"] for b in jobs], params)]


def succeeded_lines(logs: str, job_id: str) -> int:
    return len(re.findall(rf"job {job_id} succeeded", logs))


def not_ended_once(logs: str, rows: dict[str, dict], sigkilled: tuple[str, ...]) -> dict[str, int]:
    """The jobs (id -> success lines) that did not end exactly once: logged as succeeded twice or more, or
    never, unless the worker that wrote the result (its lease, in the row, names the process: `host:pid:`)
    was killed with SIGKILL, which can land between the result's commit and its log line."""
    lines = {i: succeeded_lines(logs, i) for i in rows}
    return {
        i: n
        for i, n in lines.items()
        if n > 1 or (n == 0 and not (rows[i]["worker_id"] or "").startswith(sigkilled or ("-",)))
    }


def test_kill_9_mid_generation_resumes_every_job_exactly_once(
    settings, sessions, new_key, api, make_worker, figures
):
    # jobs long enough to be in flight at the kill on a fast, idle machine too; 6 sequences growing to
    # ~815 tokens need ~300 blocks of 16, the pool has 200: they preempt each other as well as for urgent jobs
    st = stack_settings(
        settings,
        lease_seconds=2.0,
        progress_interval=0.2,
        max_num_seqs=6,
        block_size=16,
        num_device_blocks=200,
        num_host_blocks=1024,
        reconcile_interval=0.5,
    )
    client, headers = api(st), {"Authorization": f"Bearer {new_key()}"}
    worker = make_worker(st, concurrency=10)
    worker.start()
    jobs = bodies(6, 4, max_tokens=LONG_JOB_TOKENS)
    ids = submit(client, headers, jobs[:6])
    wait_for(
        lambda: sum(bool(r["tokens"]) for r in job_rows(sessions, ids).values()) >= 6, 60, "6 jobs decoding"
    )
    ids += submit(client, headers, jobs[6:])  # urgent: they preempt (swap out) low-priority ones
    celery = client.application.extensions["genq"].celery
    stats = wait_for(
        lambda: (s := worker.engine_stats(celery)).get("num_preemptions", 0) >= 2 and s, 60, "preemptions"
    )
    # the urgent jobs' first progress writes land within a progress interval of their first tokens
    wait_for(
        lambda: sum(bool(r["tokens"]) for r in job_rows(sessions, ids).values()) >= 8,
        30,
        "8 jobs with tokens",
    )
    worker.kill9()
    killed_at = time.monotonic()
    at_kill = job_rows(sessions, ids)
    interrupted = [i for i in ids if at_kill[i]["status"] == "running"]
    assert len(interrupted) >= 6, at_kill

    with Reconciler(sessions, st, interval=0.5):
        restart_s = worker.start()
        # recovery: every interrupted job claimed again by the new worker (lease 2 s, not Redis' 1 h)
        wait_for(
            lambda: all(r["attempts"] >= 2 for i, r in job_rows(sessions, interrupted).items()),
            60,
            "interrupted jobs claimed again",
        )
        recovery_s = time.monotonic() - killed_at
        done = wait_for(
            lambda: (
                (rows := job_rows(sessions, ids))
                and all(r["status"] in FINISHED for r in rows.values())
                and rows
            ),
            240,
            "all jobs finished",
        )
        new_stats = worker.engine_stats(celery)
    logs = worker.log_text()
    assert all(r["status"] == "succeeded" for r in done.values()), (done, logs)
    for i in interrupted:  # resumed from the persisted tokens, not from the start
        assert done[i]["tokens"][: len(at_kill[i]["tokens"])] == at_kill[i]["tokens"]
        if at_kill[i]["tokens"]:
            assert (
                f"job {i} claimed: priority" in logs
                and f"resuming after {len(at_kill[i]['tokens'])} tokens" in logs
            )
    # the new engine generated only what was missing
    unfinished = [i for i in ids if at_kill[i]["status"] not in FINISHED]  # running, or still queued
    missing = sum(len(done[i]["tokens"]) - len(at_kill[i]["tokens"]) for i in unfinished)
    # the new engine generated what was missing, far less than starting over (a lease lapsing under CPU
    # starvation may re-run a few tokens after the last progress write, hence not exact equality)
    from_scratch = sum(len(done[i]["tokens"]) for i in unfinished)
    assert missing <= new_stats["num_generated_tokens"] < from_scratch, (new_stats, missing, from_scratch)
    duplicates = sum(succeeded_lines(logs, i) > 1 for i in ids)
    assert duplicates == 0
    for i, tokens in zip(ids, expected(st, jobs), strict=True):
        assert done[i]["tokens"] == tokens, i
    assert recovery_s < restart_s + 3 * st.lease_seconds + 5, (recovery_s, restart_s)
    figures["kill_9"] = {
        "jobs": len(ids),
        "in_flight_at_kill": len(interrupted),
        "tokens_persisted_at_kill": sum(len(at_kill[i]["tokens"]) for i in interrupted),
        "preemptions_before_kill": stats["num_preemptions"],
        "swapped_blocks_before_kill": stats["num_blocks_swapped_out"],
        "completed": sum(r["status"] == "succeeded" for r in done.values()),
        "duplicates": duplicates,
        "tokens_regenerated_after_restart": new_stats["num_generated_tokens"],
        "tokens_missing_at_kill": missing,
        "tokens_if_started_over": from_scratch,
        "max_attempts": max(r["attempts"] for r in done.values()),
        "worker_restart_s": round(restart_s, 2),
        "recovery_s": round(recovery_s, 2),
        "lease_s": st.lease_seconds,
        "exact_vs_offline": True,
    }


def test_sigterm_hands_running_jobs_back_and_another_worker_resumes_them(
    settings, sessions, new_key, api, make_worker, figures
):
    # a long lease and no reconciler: resumption must not wait for the lease to lapse
    st = stack_settings(settings, lease_seconds=60.0, progress_interval=0.2, max_num_seqs=6)
    client, headers = api(st), {"Authorization": f"Bearer {new_key()}"}
    first = make_worker(st, concurrency=6)
    first.start()
    jobs = bodies(8, 0, max_tokens=LONG_JOB_TOKENS)
    ids = submit(client, headers, jobs)
    wait_for(
        lambda: sum(bool(r["tokens"]) for r in job_rows(sessions, ids).values()) >= 6, 60, "6 jobs decoding"
    )
    stop_s = first.terminate()
    after_stop = job_rows(sessions, ids)
    handed_back = [i for i in ids if after_stop[i]["tokens"] and after_stop[i]["status"] == "queued"]
    assert not any(r["status"] == "running" for r in after_stop.values()), (after_stop, first.log_text())
    assert len(handed_back) >= 5, (after_stop, first.log_text())
    assert all(after_stop[i]["enqueued_at"] is not None for i in handed_back)  # sent back to Redis at once
    assert stop_s < 15, stop_s

    second = make_worker(st, concurrency=6)
    ready_s = second.start()
    started = time.monotonic()
    wait_for(
        lambda: all(r["attempts"] >= 2 for r in job_rows(sessions, handed_back).values()),
        60,
        "handed-back jobs claimed by the new worker",
    )
    resumed_s = time.monotonic() - started
    done = wait_for(
        lambda: (
            (rows := job_rows(sessions, ids)) and all(r["status"] in FINISHED for r in rows.values()) and rows
        ),
        240,
        "all jobs finished",
    )
    finish_s = time.monotonic() - started
    assert all(r["status"] == "succeeded" for r in done.values()), done
    logs = first.log_text() + second.log_text()
    for i in handed_back:
        assert (
            done[i]["attempts"] == 2
            and done[i]["tokens"][: len(after_stop[i]["tokens"])] == after_stop[i]["tokens"]
        )
        assert f"resuming after {len(after_stop[i]['tokens'])} tokens" in second.log_text()
    duplicates = sum(succeeded_lines(logs, i) > 1 for i in ids)
    assert duplicates == 0
    for i, tokens in zip(ids, expected(st, jobs), strict=True):
        assert done[i]["tokens"] == tokens, i
    assert resumed_s < st.lease_seconds / 4, resumed_s  # taken at once, not after the lease lapsed
    figures["sigterm"] = {
        "jobs": len(ids),
        "handed_back": len(handed_back),
        "tokens_kept": sum(len(after_stop[i]["tokens"]) for i in handed_back),
        "worker_exit_s": round(stop_s, 2),
        "new_worker_ready_s": round(ready_s, 2),
        "all_resumed_after_ready_s": round(resumed_s, 2),
        "all_done_after_ready_s": round(finish_s, 2),
        "lease_s": st.lease_seconds,
        "completed": sum(r["status"] == "succeeded" for r in done.values()),
        "duplicates": duplicates,
    }


def test_a_dead_engine_process_hands_its_jobs_back_and_a_new_one_finishes_them(
    settings, sessions, new_key, api, make_worker, figures
):
    """The engine process killed with kill -9 (as the kernel's OOM killer would): the worker hands its jobs
    back with their tokens at once (no lease to wait for: 60 s here, and no reconciler), starts a new engine
    process, and every job ends once, token-identical to an uninterrupted run."""
    st = stack_settings(settings, lease_seconds=60.0, progress_interval=0.2, max_num_seqs=6)
    client, headers = api(st), {"Authorization": f"Bearer {new_key()}"}
    worker = make_worker(st, concurrency=4)
    worker.start()
    celery = client.application.extensions["genq"].celery
    first_engine = worker.engine_stats(celery)["engine_pid"]
    jobs = bodies(8, 0, max_tokens=LONG_JOB_TOKENS)
    ids = submit(client, headers, jobs)
    wait_for(
        lambda: sum(bool(r["tokens"]) for r in job_rows(sessions, ids).values()) >= 6, 60, "6 jobs decoding"
    )
    os.kill(first_engine, signal.SIGKILL)
    killed_at = time.monotonic()
    stats = wait_for(
        lambda: (s := worker.engine_stats(celery)).get("engine_restarts") == 1 and s.get("engine_pid") and s,
        60,
        "a new engine process",
    )
    done = wait_for(
        lambda: (
            (rows := job_rows(sessions, ids)) and all(r["status"] in FINISHED for r in rows.values()) and rows
        ),
        240,
        "all jobs finished",
    )
    finished_s = time.monotonic() - killed_at
    logs = worker.log_text()
    assert stats["engine_pid"] != first_engine and worker.proc.poll() is None
    assert all(r["status"] == "succeeded" for r in done.values()), (done, logs)
    lost = re.findall(r"job (\S+) handed back \(engine_lost\) after (\d+) tokens", logs)
    assert len(lost) >= 6, logs  # every job in the engine went back with what it had made
    resumed = [i for i, n in lost if int(n) > 0 and f"resuming after {n} tokens" in logs]
    assert len(resumed) >= 5, (lost, logs)
    assert sum(succeeded_lines(logs, i) > 1 for i in ids) == 0
    for i, tokens in zip(ids, expected(st, jobs), strict=True):
        assert done[i]["tokens"] == tokens, i
    assert finished_s < st.lease_seconds, finished_s  # not after a lease lapsed: there is no reconciler
    figures["engine_process_killed"] = {
        "jobs": len(ids),
        "handed_back": len(lost),
        "tokens_kept": sum(int(n) for _, n in lost),
        "all_done_after_kill_s": round(finished_s, 2),
    }


def test_a_cold_shutdown_stops_the_engine_process_and_exits(settings, sessions, new_key, api, make_worker):
    """SIGQUIT (Celery's cold shutdown: running jobs are not waited for) while jobs decode: the worker stops its
    engine process and exits within seconds (Celery sends worker_shutdown on a warm shutdown only; before, the
    interpreter's exit waited for the engine process for good), and the jobs it held are not lost: they are
    handed back with their tokens, and another worker finishes them, each once."""
    st = stack_settings(settings, lease_seconds=60.0, progress_interval=0.2, max_num_seqs=4)
    client, headers = api(st), {"Authorization": f"Bearer {new_key()}"}
    worker = make_worker(st, concurrency=4)
    worker.start()
    engine = worker.engine_stats(client.application.extensions["genq"].celery)["engine_pid"]
    ids = submit(client, headers, bodies(4, 0, max_tokens=LONG_JOB_TOKENS))
    wait_for(
        lambda: sum(bool(r["tokens"]) for r in job_rows(sessions, ids).values()) >= 2, 60, "2 jobs decoding"
    )
    started = time.monotonic()
    worker.proc.send_signal(signal.SIGQUIT)
    worker.proc.wait(30)  # raises TimeoutExpired if the exit waits for the engine process
    exited_s = time.monotonic() - started

    def engine_gone() -> bool:  # not left behind (once its parent is gone, init reaps it)
        try:
            os.kill(engine, 0)
        except ProcessLookupError:
            return True
        return False

    wait_for(engine_gone, 10, "the engine process gone")
    assert exited_s < 20, exited_s
    worker.start()
    done = wait_for(
        lambda: (
            (rows := job_rows(sessions, ids)) and all(r["status"] in FINISHED for r in rows.values()) and rows
        ),
        240,
        "all jobs finished by the next worker",
    )
    assert all(r["status"] == "succeeded" for r in done.values()), (done, worker.log_text())
    assert sum(succeeded_lines(worker.log_text(), i) > 1 for i in ids) == 0
