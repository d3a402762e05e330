"""A throw-away genq stack for benchmarks: a fresh database, the API under gunicorn, one or more Celery workers.

    with local_stack(bench_settings(), log_dir=Path("bench/out/logs")) as stack:
        requests.post(stack.url + "/jobs", json=..., headers=stack.headers)
        requests.get(stack.worker_metrics_url)

Everything listens on 127.0.0.1 only; the database (genq_bench_<random>) and the Redis keys (a random
prefix) are removed at the end. Uses the local Postgres and Redis (`make services`), as the tests do.
"""

from __future__ import annotations

import dataclasses
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import redis
import requests

from jobstore.db import create_database_if_missing, drop_database, make_engine, make_session_factory
from jobstore.dispatch import make_celery
from jobstore.keys import create_key
from jobstore.settings import Settings
from tests.conftest import BIN, POSTGRES, REDIS, ROOT, free_port, settings_env, worker_command


@dataclasses.dataclass
class Stack:
    settings: Settings
    url: str
    key: str
    worker_metrics_urls: list[str]
    log_dir: Path
    workers: list[subprocess.Popen]

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.key}"}

    @property
    def worker_metrics_url(self) -> str:
        return self.worker_metrics_urls[0]

    def pause_intake(self) -> None:
        """The workers stop taking messages (Celery's cancel_consumer): submitted jobs wait in Redis."""
        self._control("cancel_consumer")

    def resume_intake(self) -> None:
        self._control("add_consumer")

    def _control(self, command: str) -> None:
        app = make_celery(self.settings)
        try:
            replies = getattr(app.control, command)("generate", reply=True, timeout=10)
        finally:
            app.close()
        if len(replies) != len(self.workers):
            raise RuntimeError(
                f"{command}: {len(replies)} of {len(self.workers)} workers answered: {replies}"
            )

    def stop_worker(self) -> None:
        """Stop the workers now (cold shutdown), e.g. to measure the API alone."""
        while self.workers:
            _stop(self.workers.pop())


def bench_settings(**overrides) -> Settings:
    run = uuid.uuid4().hex[:10]
    values = dict(
        database_url=f"{POSTGRES}/genq_bench_{run}",
        redis_url=f"{REDIS}/0",
        redis_key_prefix=f"genq-bench-{run}:",
        model="tiny-llama",
        dtype="float32",
        device="cpu",
        rate_limit="1000000/second",
        max_queued_per_tenant=10**7,
        max_queued_jobs=10**7,
        log_level="WARNING",
    )
    values.update(overrides)
    return Settings(**values)


@contextmanager
def local_stack(
    settings: Settings,
    *,
    api_workers: int | None = None,
    api_threads: int | None = None,
    access_log: bool = False,
    workers: int = 1,
    concurrency: int = 8,
    worker_env: dict | None = None,
    log_dir: Path,
) -> Iterator[Stack]:
    """Build the database, start gunicorn (gunicorn.conf.py, unless `api_workers` / `api_threads` say
    otherwise) and `workers` Celery workers (each its own engine, metrics port and `-n` name; `worker_env`
    is added to their environment), wait until all answer; tear all down after."""
    log_dir.mkdir(parents=True, exist_ok=True)
    api_port = free_port()
    env = settings_env(settings)
    with ExitStack() as cleanup:
        create_database_if_missing(settings.database_url)
        cleanup.callback(drop_database, settings.database_url)
        cleanup.callback(_delete_keys, settings)
        subprocess.run(
            [sys.executable, "-m", "alembic", "upgrade", "head"],
            cwd=ROOT,
            env=env,
            check=True,
            capture_output=True,
        )
        engine = make_engine(settings.database_url)
        with make_session_factory(engine).begin() as session:
            key = create_key(session, "bench")
        engine.dispose()
        sizes = [
            *(["--workers", str(api_workers)] if api_workers else []),
            *(["--threads", str(api_threads)] if api_threads else []),
        ]
        api = _start(
            [
                BIN / "gunicorn",
                "--bind",
                f"127.0.0.1:{api_port}",
                *sizes,
                "--log-level",
                "warning",
                "webapi:create_app()",
            ],
            {**env, "API_ACCESS_LOG": "-" if access_log else ""},
            log_dir / "api.log",
        )
        cleanup.callback(_stop, api)
        stack = Stack(settings, f"http://127.0.0.1:{api_port}", key, [], log_dir, [])
        cleanup.callback(stack.stop_worker)
        for i in range(workers):
            port = free_port()
            stack.worker_metrics_urls.append(f"http://127.0.0.1:{port}/metrics")
            stack.workers.append(
                _start(
                    worker_command(f"bench{i}-{uuid.uuid4().hex[:6]}@%h", concurrency, "WARNING"),
                    {
                        **env,
                        **(worker_env or {}),
                        "WORKER_METRICS_PORT": str(port),
                        "WORKER_METRICS_ADDRESS": "127.0.0.1",
                    },
                    log_dir / f"worker{i}.log",
                )
            )
        _wait_for(stack.url + "/healthz", api, log_dir / "api.log")
        for i, (url, worker) in enumerate(zip(stack.worker_metrics_urls, stack.workers)):
            _wait_for(url, worker, log_dir / f"worker{i}.log")
        _wait_until_engine_ready(stack)
        yield stack


def _start(command: list, env: dict, log: Path) -> subprocess.Popen:
    with log.open("w") as out:
        return subprocess.Popen(
            [str(c) for c in command],
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def _stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGQUIT if "celery" in str(process.args) else signal.SIGTERM)
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def _wait_for(url: str, process: subprocess.Popen, log: Path, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{process.args[0]} exited:\n{log.read_text()[-3000:]}")
        try:
            if requests.get(url, timeout=2).status_code == 200:
                return
        except requests.RequestException:  # not listening yet, or still importing
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} did not answer in {timeout}s:\n{log.read_text()[-3000:]}")


def _wait_until_engine_ready(stack: Stack, timeout: float = 180) -> None:
    """The metrics server starts before the engine is built: wait until each worker reports its capacity
    (its intake exists, so its engine is built); one tiny job then proves the stack takes jobs."""
    deadline = time.monotonic() + timeout
    for url in stack.worker_metrics_urls:
        while not re.search(r"^genq_worker_capacity [1-9]", requests.get(url, timeout=5).text, re.M):
            if time.monotonic() > deadline:
                raise RuntimeError(f"{url}: the worker's engine was not built in {timeout}s")
            time.sleep(0.2)
    r = requests.post(stack.url + "/jobs", json={"prompt": "warm up", "max_tokens": 1}, headers=stack.headers)
    r.raise_for_status()
    while (
        requests.get(stack.url + r.headers["Location"], headers=stack.headers).json()["status"] != "succeeded"
    ):
        if time.monotonic() > deadline:
            raise RuntimeError("the worker did not run the warm-up job")
        time.sleep(0.1)


def _delete_keys(settings: Settings) -> None:
    client = redis.Redis.from_url(settings.redis_url)
    keys = list(client.scan_iter(match=f"{settings.redis_key_prefix}*"))
    if keys:
        client.delete(*keys)
    client.close()
