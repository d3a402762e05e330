"""The whole stack on a Sentinel-managed Redis: a master, its replica and a redis-sentinel on loopback (the
fixture of tests/contract/test_redis_client.py), the API (real gunicorn), a real worker and beat, all with
REDIS_URL=redis+sentinel://... Jobs are submitted, the master is killed while they run and wait, Sentinel
promotes the replica, and every job ends once: succeeded, claimed once (attempts 1), with the output every
other run of the same greedy request gives."""

from __future__ import annotations

import os
import signal
import subprocess
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import requests
from redis.sentinel import Sentinel
from sqlalchemy import select

from jobstore.keys import create_key
from jobstore.models import Job
from tests.conftest import BIN, ROOT, serve_api, settings_env, worker_command
from tests.contract.test_redis_client import SERVICE, wait_for
from tests.contract.test_redis_client import sentinel_set as sentinel_set  # a fixture

pytestmark = pytest.mark.slow

JOBS = 16
# long enough that most jobs still wait in Redis when the first ones run (4 at a time)
BODY = {"prompt": "Once upon a time", "max_tokens": 160, "ignore_eos": True, "temperature": 0.0}


@contextmanager
def process(
    argv: list, env: dict[str, str], log: Path, ready: str | None = None, stdout: Path | None = None
) -> Iterator[subprocess.Popen]:
    """`argv` running with `env`, its output in `log` (its stdout in `stdout` if given); waits for `ready` in
    the log; SIGTERM (a worker: SIGQUIT), then kill."""
    with log.open("w") as out, (stdout or Path(os.devnull)).open("w") as printed:
        proc = subprocess.Popen(
            argv, cwd=ROOT, env=env, stdout=out if stdout is None else printed, stderr=out
        )
    try:
        deadline = time.monotonic() + 120
        while ready is not None and ready not in log.read_text():
            assert proc.poll() is None, f"{argv[3]} exited:\n{log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"{argv[3]} not ready:\n{log.read_text()[-3000:]}"
            time.sleep(0.2)
        yield proc
    finally:
        proc.send_signal(signal.SIGQUIT if argv[3] == "worker" else signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_no_job_is_lost_or_run_twice_when_the_redis_master_fails_over(
    settings, database, sessions, sentinel_set, tmp_path
):
    stack = settings.replace(
        redis_url=sentinel_set["url"],
        redis_key_prefix=f"genq-sentinel-{uuid.uuid4().hex[:8]}:",
        max_num_seqs=4,  # most jobs wait in Redis while the master dies
        reconcile_interval=1.0,
        resend_after_seconds=10.0,  # a message the replica never got is sent again (the reconciler's net)
        events_resync_seconds=1.0,
    )
    env = settings_env(stack)
    with sessions.begin() as session:
        headers = {"Authorization": f"Bearer {create_key(session, f'sentinel-{uuid.uuid4().hex[:8]}')}"}
    worker = worker_command(f"sentinel-{uuid.uuid4().hex[:6]}@%h", 2)
    beat = [BIN / "celery", "-A", "workers", "beat", "--loglevel", "INFO", "-s", str(tmp_path / "schedule")]
    with (
        process(worker, env, tmp_path / "worker.log", ready=" ready."),
        process(beat, env, tmp_path / "beat.log"),
        serve_api(stack, workers=1) as api,
    ):
        ids = []
        for _ in range(JOBS):
            r = requests.post(f"{api}/jobs", json=BODY, headers=headers, timeout=10)
            assert r.status_code == 202, r.text
            ids.append(r.json()["id"])

        def statuses() -> list[str]:
            with sessions() as session:
                rows = session.execute(select(Job.status).where(Job.id.in_(ids))).scalars().all()
            return [status.value for status in rows]

        wait_for(lambda: "running" in statuses(), seconds=60, what="a first job runs")
        live = statuses()
        assert "queued" in live, f"every job ran before the failover: {live}"

        killed = time.monotonic()
        sentinel_set["master"].kill()
        sentinels = Sentinel([("127.0.0.1", sentinel_set["sentinel_port"])])
        wait_for(
            lambda: sentinels.discover_master(SERVICE)[1] == sentinel_set["replica_port"],
            seconds=30,
            what="Sentinel promotes the replica",
        )
        promoted = time.monotonic() - killed
        log = (tmp_path / "worker.log").read_text
        wait_for(
            lambda: statuses().count("succeeded") == JOBS,
            seconds=60,
            what=f"every job succeeds after the failover:\n{log()[-3000:]}",
        )
        print(  # RELIABILITY.md's figures
            f"at the kill: {live.count('running')} running, {live.count('queued')} queued, "
            f"{live.count('succeeded')} succeeded; replica promoted after {promoted:.2f} s, "
            f"every job succeeded {time.monotonic() - killed:.2f} s after the kill"
        )
        for job_id in ids:  # the API, through the promoted master's Sentinel, answers too
            assert (
                requests.get(f"{api}/jobs/{job_id}", headers=headers, timeout=10).json()["status"]
                == "succeeded"
            )
        r = requests.post(f"{api}/jobs", json=BODY, headers=headers, timeout=10)
        assert r.status_code == 202, r.text
        ids.append(r.json()["id"])
        wait_for(
            lambda: statuses() == ["succeeded"] * (JOBS + 1), seconds=30, what="a job sent after it runs"
        )

    with sessions() as session:
        rows = session.execute(select(Job).where(Job.id.in_(ids))).scalars().all()
    assert len(rows) == JOBS + 1
    twice = {str(row.id): row.events for row in rows if row.attempts != 1}
    assert not twice, f"a job was claimed twice: {twice}\n{(tmp_path / 'worker.log').read_text()[-6000:]}"
    outputs = {(tuple(row.output_token_ids), row.output_text, row.finish_reason) for row in rows}
    assert len(outputs) == 1, outputs  # the same greedy request: one output, whatever happened around it
    assert len(next(iter(outputs))[0]) == BODY["max_tokens"]
