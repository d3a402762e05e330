"""Fault-injection fixtures: worker subprocesses we can kill -9, SIGTERM and restart, a reconciler
loop, a private Redis we can wipe, and a JSON file of the figures each scenario measured
(bench/out/reliability.json, quoted in RELIABILITY.md)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import text as sql

from contract.dispatch import make_celery
from contract.settings import Settings
from tests.conftest import BIN, ROOT, free_port, settings_env, worker_command
from workers.reconciler import reconcile

FINISHED = ("succeeded", "failed", "cancelled")
FIGURES = ROOT / "bench" / "out" / "reliability.json"
# What a recovery test allows beyond a bound RELIABILITY.md documents: the reconciler's run itself (its SQL
# and Redis reads, tens of ms idle, more on 2 shared cores) and the test's poll (50-100 ms). A reconciler
# running at half its pace misses it.
MARGIN_S = 0.5
# The API records the sends of its jobs (jobs.enqueued_at) in batches this often (webapi/sent_marks.py): a
# job whose message is taken before its send is recorded is not yet seen as sent by the reconciler
SENT_MARKS_INTERVAL_S = 0.5


@pytest.fixture(autouse=True)
def no_leftover_jobs(sessions) -> None:
    """Every test starts with no live job in the session's database: earlier tests leave queued or
    running jobs whose workers are gone, and a test's reconciler would otherwise send them to its
    own worker (taking its slots). Only this test session's private database is touched."""
    with sessions.begin() as s:
        s.execute(
            sql(
                "UPDATE jobs SET status = 'cancelled', finished_at = now(), lease_expires_at = NULL "
                "WHERE status IN ('queued', 'running')"
            )
        )


class Worker:
    """`celery -A workers worker --pool threads` in its own process group; start, kill -9, SIGTERM, restart."""

    def __init__(self, settings: Settings, log_dir: Path, concurrency: int):
        self.settings, self.log_dir, self.concurrency = settings, log_dir, concurrency
        self.proc: subprocess.Popen | None = None
        self.logs: list[Path] = []
        self.node = ""  # this worker's Celery node name (new at each start)

    def start(self, timeout: float = 180) -> float:
        """Start a worker and wait until it is ready; returns the seconds that took."""
        log = self.log_dir / f"worker-{len(self.logs)}-{uuid.uuid4().hex[:6]}.log"
        self.logs.append(log)
        started = time.monotonic()
        self.node = f"rel-{uuid.uuid4().hex[:6]}@{socket.gethostname()}"
        with log.open("w") as out:
            self.proc = subprocess.Popen(
                worker_command(self.node, self.concurrency),
                cwd=ROOT,
                env=settings_env(self.settings),
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        while " ready." not in log.read_text():
            assert self.proc.poll() is None, f"worker exited:\n{log.read_text()[-5000:]}"
            assert time.monotonic() - started < timeout, f"worker not ready:\n{log.read_text()[-5000:]}"
            time.sleep(0.1)
        return time.monotonic() - started

    def engine_stats(self, celery) -> dict:
        """This worker's engine.stats(). Other workers of the test session share the broker, so the
        request is addressed to this node only (and returns at its reply, not after the timeout)."""
        replies = celery.control.broadcast(
            "engine_stats", reply=True, timeout=5, limit=1, destination=[self.node]
        )
        assert replies, f"no engine_stats reply from {self.node}"
        return replies[0][self.node]

    def kill9(self) -> None:
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)

    def terminate(self, timeout: float = 60) -> float:
        """SIGTERM (Celery's warm shutdown); returns the seconds until the process exited."""
        started = time.monotonic()
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(timeout)
        return time.monotonic() - started

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(10)

    def log_text(self) -> str:
        """Every log of this worker (all its restarts), in full."""
        return "\n".join(f"--- {p.name}\n{p.read_text()}" for p in self.logs)


class Reconciler:
    """The reconciler every `interval` seconds in a thread (as beat would run it); failures are counted."""

    def __init__(self, sessions, settings: Settings, interval: float = 0.5):
        self.sessions, self.settings, self.interval = sessions, settings, interval
        self.celery = make_celery(settings)
        self.stop_event = threading.Event()
        self.errors = 0
        self.totals = {"requeued": 0, "unclaimed": 0, "sent": 0, "resent": 0}
        self.thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        while not self.stop_event.wait(self.interval):
            try:
                counts = reconcile(self.sessions, self.celery, self.settings)
            except Exception:  # Redis or Postgres down: try again next interval, as beat would
                self.errors += 1
                continue
            for k in self.totals:
                self.totals[k] += counts.get(k, 0)

    def __enter__(self) -> Reconciler:
        self.thread.start()
        return self

    def __exit__(self, *_) -> None:
        self.stop_event.set()
        self.thread.join(10)
        self.celery.close()


class Beat:
    """`celery -A workers beat` (the reconciler, run in the beat process) in its own process group."""

    def __init__(self, settings: Settings, log: Path):
        self.log = log
        with log.open("w") as out:
            self.proc = subprocess.Popen(
                [BIN / "celery", "-A", "workers", "beat", "--loglevel", "INFO"],
                cwd=ROOT,
                env=settings_env(settings),
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)


@pytest.fixture()
def beat(tmp_path) -> Iterator:
    """`beat(settings)` -> a running Beat for that stack; stopped at the end."""
    started: list[Beat] = []

    def start(settings: Settings) -> Beat:
        started.append(Beat(settings, tmp_path / f"beat-{len(started)}.log"))
        return started[-1]

    yield start
    for b in started:
        b.stop()


@pytest.fixture()
def make_worker(tmp_path) -> Iterator:
    """`make_worker(settings, concurrency)` -> a Worker (not started); every one is killed at the end."""
    made: list[Worker] = []

    def make(settings: Settings, concurrency: int = 8) -> Worker:
        worker = Worker(settings, tmp_path, concurrency)
        made.append(worker)
        return worker

    yield make
    for worker in made:
        worker.stop()


def stack_settings(settings: Settings, **overrides) -> Settings:
    """This session's settings with a Redis key prefix of its own (so only our worker sees our messages)."""
    prefix = f"{settings.redis_key_prefix}rel-{uuid.uuid4().hex[:6]}:"
    return settings.replace(redis_key_prefix=prefix, **overrides)


@pytest.fixture()
def api(database, redis_client):
    """`api(settings)` -> a Flask test client of an app sending to that stack; apps are closed at the end."""
    from webapi import create_app

    apps = []

    def make(settings: Settings):
        app = create_app(settings)
        apps.append(app)
        return app.test_client()

    yield make
    for app in apps:
        app.extensions["genq"].close()
        app.extensions["genq"].celery.close()


@pytest.fixture(scope="session")
def figures() -> Iterator[dict]:
    """Scenario -> figures; merged into bench/out/reliability.json at the end of the session."""
    measured: dict = {}
    yield measured
    if measured:
        FIGURES.parent.mkdir(parents=True, exist_ok=True)
        old = json.loads(FIGURES.read_text()) if FIGURES.exists() else {}
        old.update(measured)
        FIGURES.write_text(json.dumps(old, indent=2, sort_keys=True) + "\n")


@pytest.fixture()
def private_redis(tmp_path) -> Iterator:
    """A redis-server of our own on a free port, keeping nothing on disk; `.restart()` wipes it."""
    server = shutil.which("redis-server")
    if server is None:
        pytest.skip("redis-server is not installed")

    class PrivateRedis:
        port = free_port()
        url = f"redis://127.0.0.1:{port}/0"
        proc: subprocess.Popen | None = None

        def start(self) -> None:
            self.proc = subprocess.Popen(
                [
                    server,
                    "--port",
                    str(self.port),
                    "--bind",
                    "127.0.0.1",
                    "--save",
                    "",
                    "--appendonly",
                    "no",
                    "--dir",
                    str(tmp_path),
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
            )
            import redis

            for _ in range(100):
                try:
                    if redis.Redis.from_url(self.url).ping():
                        return
                except redis.ConnectionError:
                    time.sleep(0.05)
            raise AssertionError("private redis-server did not start")

        def kill(self) -> None:
            """SIGKILL: no shutdown save (and nothing on disk anyway)."""
            if self.proc is not None and self.proc.poll() is None:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)

    r = PrivateRedis()
    r.start()
    yield r
    r.kill()


def job_rows(sessions, ids) -> dict[str, dict]:
    """id -> the columns the tests check, read straight from Postgres."""
    from sqlalchemy import select

    from jobstore.models import Job

    with sessions.begin() as s:
        rows = s.execute(
            select(
                Job.id, Job.status, Job.attempts, Job.output_token_ids, Job.worker_id, Job.enqueued_at
            ).where(Job.id.in_([uuid.UUID(i) for i in ids]))
        ).all()
    return {
        str(r.id): {
            "status": str(getattr(r.status, "value", r.status)),
            "attempts": r.attempts,
            "tokens": list(r.output_token_ids),
            "worker_id": r.worker_id,
            "enqueued_at": r.enqueued_at,
        }
        for r in rows
    }


def wait_for(predicate, timeout: float, what: str, every: float = 0.1):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


class TcpProxy:
    """A TCP relay on 127.0.0.1:<free port> to `target`, which the test can cut (every connection closed,
    new ones refused: nothing listens) and restore (listening again on the same port): Postgres going
    away and coming back, as the stack sees it, without touching the machine's Postgres."""

    def __init__(self, target: tuple[str, int]):
        self.target, self.port = target, free_port()
        self._lock = threading.Lock()
        self._conns: set[socket.socket] = set()
        self._listener: socket.socket | None = None
        self._threads: list[threading.Thread] = []

    def start(self) -> TcpProxy:
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(64)
        self._listener = listener
        self._spawn(self._accept, listener)
        return self

    def cut(self) -> None:
        """Refuse new connections and close every open one (both sides)."""
        listener, self._listener = self._listener, None
        if listener is not None:
            listener.close()
        with self._lock:
            conns, self._conns = list(self._conns), set()
        for conn in conns:
            for how in (lambda c: c.shutdown(socket.SHUT_RDWR), lambda c: c.close()):
                try:
                    how(conn)
                except OSError:
                    pass

    restore = start

    def close(self) -> None:
        self.cut()
        for t in self._threads:
            t.join(5)

    def _spawn(self, fn, *args) -> None:
        t = threading.Thread(target=fn, args=args, daemon=True)
        self._threads.append(t)
        t.start()

    def _accept(self, listener: socket.socket) -> None:
        listener.settimeout(0.2)
        while self._listener is listener:
            try:
                client, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            try:
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError:
                client.close()
                continue
            upstream.settimeout(None)
            with self._lock:
                if self._listener is not listener:  # cut meanwhile
                    client.close(), upstream.close()
                    return
                self._conns.update((client, upstream))
            self._spawn(self._pump, client, upstream)
            self._spawn(self._pump, upstream, client)

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        for sock in (src, dst):
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


@pytest.fixture()
def pg_proxy(database) -> Iterator[TcpProxy]:
    """A cuttable TCP proxy in front of this session's Postgres server."""
    from sqlalchemy.engine import make_url

    url = make_url(database)
    proxy = TcpProxy((url.host or "127.0.0.1", url.port or 5432)).start()
    yield proxy
    proxy.close()


def through(proxy: TcpProxy, database_url: str) -> str:
    """`database_url` rewritten to connect through `proxy`."""
    from sqlalchemy.engine import make_url

    return make_url(database_url).set(host="127.0.0.1", port=proxy.port).render_as_string(hide_password=False)


def submit(client, headers, bodies: list[dict]) -> list[str]:
    """POST each body to /jobs (each must be accepted); the new jobs' ids in order."""
    ids = []
    for body in bodies:
        r = client.post("/jobs", json=body, headers=headers)
        assert r.status_code == 202, r.json
        ids.append(r.json["id"])
    return ids
