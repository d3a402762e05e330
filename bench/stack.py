"""A throw-away genq stack for benchmarks: a fresh database, the API under gunicorn, one or more Celery workers.

    with local_stack(bench_settings(), log_dir=Path("bench/out/logs")) as stack:
        requests.post(stack.url + "/jobs", json=..., headers=stack.headers)
        requests.get(stack.worker_metrics_url)
        seen = stack.run_job({"prompt": "Hi", "max_tokens": 8})  # timed as its client sees it

`Stack.run_job` is how a latency bench times a job: from the client's send of `POST /jobs` to the first
token it receives on the job's event stream (`GET /jobs/<id>/events`), and to the result event; the
job rows' own timestamps (created_at, first_token_at) leave out the HTTP round trips and the delivery.

Everything listens on 127.0.0.1 only; the database (genq_bench_<random>) and the Redis keys (a random
prefix) are removed at the end. Uses the local Postgres and Redis (`make services`), as the tests do.
`private_redis()` starts a redis-server of a bench's own instead (its CPU is then the stack's alone),
and `wait_for` waits for a server the bench started to answer.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from pathlib import Path

import redis
import requests
from sqlalchemy import func, select

from contract.dispatch import PRIORITIES, QUEUE, make_celery, queue_key
from contract.redis_client import redis_client
from contract.settings import Settings
from jobstore.db import create_database_if_missing, drop_database, make_engine, make_session_factory
from jobstore.keys import create_key
from jobstore.models import Job, JobStatus
from tests.conftest import BIN, POSTGRES, REDIS, ROOT, free_port, settings_env, worker_command


@dataclasses.dataclass
class ClientTimes:
    """A job as its client saw it: seconds from sending `POST /jobs` to the first streamed token and to
    the result, and the job as the result event carried it (GET /jobs/<id>'s body)."""

    first_token_s: float | None  # None: the job ended without a token
    latency_s: float
    job: dict


@dataclasses.dataclass
class Stack:
    settings: Settings
    url: str
    key: str
    worker_metrics_urls: list[str]
    log_dir: Path
    workers: list[subprocess.Popen]
    api_pid: int = 0  # gunicorn's master; its workers share its session id (bench/job_cpu.py)
    client: StackClient = dataclasses.field(init=False, repr=False)  # set by local_stack, closed at its end

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.key}"}

    @property
    def worker_metrics_url(self) -> str:
        return self.worker_metrics_urls[0]

    def run_job(
        self, body: dict, session: requests.Session | None = None, timeout: float = 600
    ) -> ClientTimes:
        """Submit `body` with POST /jobs and follow the job's server-sent events to its result, timing both
        from the moment the request is sent. Pass a `session` per thread to reuse its connection."""
        http = session or requests.Session()
        sent = time.perf_counter()
        r = http.post(self.url + "/jobs", json=body, headers=self.headers, timeout=30)
        if r.status_code != 202:
            raise RuntimeError(f"POST /jobs answered {r.status_code}: {r.text}")
        first = None
        events = http.get(
            f"{self.url}/jobs/{r.json()['id']}/events", headers=self.headers, stream=True, timeout=timeout
        )
        with events:
            events.raise_for_status()
            name, data = None, []
            for line in events.iter_lines(chunk_size=None, decode_unicode=True):
                if line.startswith("event:"):
                    name = line[6:].strip()
                elif line.startswith("data:"):
                    data.append(line[5:].strip())
                elif line == "":  # an event ends at a blank line
                    if name == "delta" and first is None and json.loads("\n".join(data))["token_ids"]:
                        first = time.perf_counter() - sent
                    elif name == "result":
                        return ClientTimes(first, time.perf_counter() - sent, json.loads("\n".join(data)))
                    name, data = None, []
        raise RuntimeError(f"the event stream of job {r.json()['id']} ended without a result")

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
    app: str = "webapi:create_app()",
) -> Iterator[Stack]:
    """Build the database, start gunicorn (gunicorn.conf.py, unless `api_workers` / `api_threads` say
    otherwise) and `workers` Celery workers (each its own engine, metrics port and `-n` name; `worker_env`
    is added to their environment), wait until all answer; tear all down after."""
    log_dir.mkdir(parents=True, exist_ok=True)
    if threading.current_thread() is threading.main_thread():  # a SIGTERM (timeout, kill) still cleans up
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    api_port = free_port()
    env = {**settings_env(settings), "PYTHONPATH": str(ROOT)}  # this tree's code, whatever the venv installed
    with ExitStack() as cleanup:
        key = bench_database(settings, env, cleanup)
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
                app,
            ],
            {**env, "API_ACCESS_LOG": "-" if access_log else ""},
            log_dir / "api.log",
        )
        cleanup.callback(_stop, api)
        stack = Stack(settings, f"http://127.0.0.1:{api_port}", key, [], log_dir, [], api.pid)
        stack.client = StackClient(stack)
        cleanup.callback(stack.client.close)
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
        wait_for(stack.url + "/healthz", api, log_dir / "api.log")
        for i, (url, worker) in enumerate(zip(stack.worker_metrics_urls, stack.workers)):
            wait_for(url, worker, log_dir / f"worker{i}.log")
        _wait_until_engine_ready(stack)
        yield stack


FINISHED = (JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.CANCELLED)


class StackClient:
    """A bench's hands on a stack besides timing jobs: submitting and cancelling many over HTTP (a session
    per thread), and reading what the stack holds: the job rows (Postgres), the queue depth (Redis), the
    jobs the workers hold (their /metrics)."""

    def __init__(self, stack: Stack):
        self.stack = stack
        self.db = make_engine(stack.settings.database_url)
        self.sessions = make_session_factory(self.db)
        self.redis = redis_client(stack.settings.redis_url)  # any REDIS_URL the stack takes (Sentinel too)
        self.local = threading.local()

    def close(self) -> None:
        self.db.dispose()
        self.redis.close()

    def http(self) -> requests.Session:
        if not hasattr(self.local, "session"):
            self.local.session = requests.Session()
        return self.local.session

    def submit(self, body: dict) -> str:
        r = self.http().post(self.stack.url + "/jobs", json=body, headers=self.stack.headers, timeout=30)
        if r.status_code != 202:
            raise RuntimeError(f"POST /jobs answered {r.status_code}: {r.text}")
        return r.json()["id"]

    def submit_all(self, bodies: list[dict]) -> list[str]:
        with ThreadPoolExecutor(8) as pool:
            return list(pool.map(self.submit, bodies))

    def cancel_all(self, ids: list[str]) -> None:
        def cancel(job_id: str) -> None:
            self.http().post(f"{self.stack.url}/jobs/{job_id}/cancel", headers=self.stack.headers, timeout=30)

        with ThreadPoolExecutor(8) as pool:
            list(pool.map(cancel, ids))

    def rows(self, ids: list[str]) -> list[dict]:
        """The jobs' rows (status, timestamps, hand-backs, output tokens), in the order of `ids`."""
        wanted = [uuid.UUID(i) for i in ids]
        with self.sessions() as s:
            found = {
                r.id: r._asdict()
                for r in s.execute(
                    select(
                        Job.id,
                        Job.status,
                        Job.created_at,
                        Job.started_at,
                        Job.first_token_at,
                        Job.finished_at,
                        Job.handbacks,
                        func.cardinality(Job.output_token_ids).label("tokens"),
                    ).where(Job.id.in_(wanted))
                )
            }
        return [found[i] for i in wanted]

    def wait(self, ids: list[str], timeout: float = 1800, poll: float = 0.01) -> list[dict]:
        """The rows of `ids` once every one has ended."""
        deadline = time.monotonic() + timeout
        wanted = [uuid.UUID(i) for i in ids]
        while True:
            with self.sessions() as s:
                left = s.scalar(select(func.count()).where(Job.id.in_(wanted), Job.status.not_in(FINISHED)))
            if not left:
                return self.rows(ids)
            if time.monotonic() > deadline:
                raise RuntimeError(f"{left} of {len(ids)} jobs not finished after {timeout}s")
            time.sleep(poll)

    def active(self) -> int:
        """Jobs queued or running, of every tenant."""
        with self.sessions() as s:
            return s.scalar(select(func.count()).select_from(Job).where(Job.status.not_in(FINISHED)))

    def depth(self, priority: int | None = None) -> int:
        """Messages waiting in Redis at `priority`, or at every priority."""
        priorities = PRIORITIES if priority is None else [priority]
        return sum(self.redis.llen(queue_key(self.stack.settings, QUEUE, p)) for p in priorities)

    def held(self) -> int:
        """Jobs the workers hold (claimed, in their engines or reserve), from their gauges."""
        total = 0
        for url in self.stack.worker_metrics_urls:
            found = re.search(  # {model="..."}: every worker sample carries its model (workers/metrics.py)
                r"^genq_worker_held_jobs(?:\{[^}]*\})? (\S+)", self.http().get(url, timeout=5).text, re.M
            )
            total += int(float(found.group(1))) if found else 0
        return total

    def wait_held(self, at_least: int, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while self.held() < at_least:
            if time.monotonic() > deadline:
                raise RuntimeError(f"the workers hold {self.held()} jobs, not {at_least}, after {timeout}s")
            time.sleep(0.05)


def bench_database(settings, env: dict, cleanup: ExitStack) -> str:
    """The stack's own database, migrated to head (dropped with its Redis keys by `cleanup`); returns an API key
    of a tenant "bench"."""
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
    return key


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


def wait_for(url: str, process: subprocess.Popen, log: Path, timeout: float = 180) -> None:
    """Until GET `url` answers 200; raises with the end of `log` if `process` exits or time runs out."""
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


@dataclasses.dataclass(frozen=True)
class PrivateRedis:
    port: int
    pid: int

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"


@contextmanager
def private_redis() -> Iterator[PrivateRedis]:
    """A redis-server of the bench's own on a free port, keeping nothing on disk, stopped at the end."""
    port, folder = free_port(), tempfile.mkdtemp(prefix="genq-bench-redis-")
    server = subprocess.Popen(
        [shutil.which("redis-server") or "redis-server", "--port", str(port), "--save", "", "--appendonly", "no",
         "--dir", folder],
        stdout=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        client = redis_client(f"redis://127.0.0.1:{port}/0")
        for _ in range(100):
            try:
                client.ping()
                break
            except redis.ConnectionError:
                time.sleep(0.05)
        client.close()
        yield PrivateRedis(port, server.pid)
    finally:
        server.terminate()
        server.wait()
        shutil.rmtree(folder, ignore_errors=True)


def _wait_until_engine_ready(stack: Stack, timeout: float = 180) -> None:
    """The metrics server starts before the engine is built: wait until each worker reports its capacity
    (its intake exists, so its engine is built); one tiny job then proves the stack takes jobs."""
    deadline = time.monotonic() + timeout
    for url in stack.worker_metrics_urls:
        while not re.search(
            r"^genq_worker_capacity(?:\{[^}]*\})? [1-9]", requests.get(url, timeout=5).text, re.M
        ):
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
    client = redis_client(settings.redis_url)
    keys = list(client.scan_iter(match=f"{settings.redis_key_prefix}*"))
    if keys:
        client.delete(*keys)
    client.close()
