"""Job transitions through a real PgBouncer in transaction mode (Debian's package; scripts/services.sh
installs it), with DATABASE_URL's `?pgbouncer=true` turning psycopg's prepared statements off."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from sqlalchemy import text
from sqlalchemy.exc import DBAPIError

from jobstore import jobs
from jobstore.db import check_deployment_connections, engine_url, make_engine, make_session_factory
from jobstore.keys import create_key
from jobstore.models import JobStatus
from tests.conftest import free_port, job_request, tenant_of

PGBOUNCER = Path("/usr/sbin/pgbouncer")
SERVER_CONNECTIONS = 2  # PgBouncer's pool: every client below shares these two Postgres connections


@pytest.fixture(scope="module")
def pgbouncer(database: str) -> Iterator[str]:
    """A PgBouncer in transaction mode on a free port in front of the test database; yields its DATABASE_URL."""
    url = engine_url(database)[0]
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="genq-pgbouncer-") as where:
        yield from _serve(url, port, Path(where))


def _serve(url, port: int, where: Path) -> Iterator[str]:
    (where / "users.txt").write_text(f'"{url.username}" ""\n')
    (where / "pgbouncer.ini").write_text(
        f"""[databases]
* = host={url.host} port={url.port}
[pgbouncer]
listen_addr = 127.0.0.1
listen_port = {port}
unix_socket_dir =
auth_type = trust
auth_file = {where}/users.txt
pool_mode = transaction
default_pool_size = {SERVER_CONNECTIONS}
max_client_conn = 100
logfile = {where}/pgbouncer.log
"""
    )
    user = []
    if os.geteuid() == 0:  # PgBouncer refuses to run as root: it drops to the postgres user (-u)
        shutil.chown(where, "postgres")  # its log file
        os.chmod(where, 0o755)
        user = ["-u", "postgres"]
    proc = subprocess.Popen([PGBOUNCER, *user, str(where / "pgbouncer.ini")], stderr=subprocess.PIPE)
    bouncer_url = url.set(port=port).update_query_dict({"pgbouncer": "true"})
    probe = make_engine(bouncer_url.render_as_string(hide_password=False), pool_size=1, max_overflow=0)
    try:
        for _ in range(100):
            try:
                with probe.connect() as conn:
                    conn.execute(text("SELECT 1"))
                break
            except DBAPIError:
                assert proc.poll() is None, proc.stderr.read().decode()
                time.sleep(0.1)
        else:
            raise AssertionError((where / "pgbouncer.log").read_text())
        yield bouncer_url.render_as_string(hide_password=False)
    finally:
        probe.dispose()
        proc.terminate()
        proc.communicate(timeout=10)


def test_the_url_parameter_is_read_and_removed(pgbouncer):
    url, through = engine_url(pgbouncer)
    assert through and "pgbouncer" not in url.query
    assert engine_url(pgbouncer.replace("?pgbouncer=true", ""))[1] is False
    with pytest.raises(ValueError, match="pgbouncer"):
        engine_url(pgbouncer.replace("=true", "=yes"))


def test_without_the_parameter_prepared_statements_break_on_a_shared_server_connection(pgbouncer):
    """The control: psycopg prepares a statement run 5 times (prepare_threshold), under the same name on
    every client connection; two clients whose transactions run on one server connection collide."""
    engine = make_engine(pgbouncer.replace("?pgbouncer=true", ""), pool_size=2, max_overflow=0)
    first, second = engine.connect(), engine.connect()
    try:
        with pytest.raises(DBAPIError, match="prepared statement"):
            for _ in range(10):
                for conn in (first, second):
                    conn.execute(text("SELECT count(*) FROM jobs WHERE priority = :p"), {"p": 1})
                    conn.commit()
    finally:
        first.close()
        second.close()
        engine.dispose()


def test_jobs_live_their_lives_through_pgbouncer(pgbouncer, database):
    """Eight clients on two server connections: each submits jobs under the tenant cap (a transaction-level
    advisory lock), claims them on an autocommit connection as the worker does, writes progress, finishes
    some and cancels the others, every statement run many times over."""
    engine = make_engine(pgbouncer, pool_size=8, max_overflow=0)
    sessions = make_session_factory(engine)
    autocommit = engine.execution_options(isolation_level="AUTOCOMMIT")
    with sessions.begin() as s:
        tenant = tenant_of(s, create_key(s, f"bouncer-{uuid.uuid4().hex[:8]}")).id

    def life(client: int) -> list[uuid.UUID]:
        ids = []
        for i in range(8):
            with sessions.begin() as s:
                job, created = jobs.create_job(
                    s, tenant, job_request(priority=i % 10), prompt_tokens=3, max_queued=1000
                )
                assert created
                ids.append(job.id)
        worker = f"w{client}"
        with autocommit.connect() as conn:
            claimed = jobs.claim_jobs(conn, [(j, worker) for j in ids], 30.0)
            assert {j.id for j in claimed} == set(ids)
            for step in range(6):
                outputs = [jobs.Output(j, worker, step, [step], step, b"x") for j in ids]
                assert jobs.save_progress(conn, outputs, 30.0) == {(j, worker) for j in ids}
            finished = [jobs.Output(j, worker, 6, [6], 6, b"y", None, "length", 3) for j in ids[:4]]
            assert jobs.finish_jobs(conn, finished) == {(j, worker) for j in ids[:4]}
        for job_id in ids[4:]:
            with sessions.begin() as s:
                assert jobs.cancel_job(s, job_id, tenant)[1]
        return ids

    try:
        with ThreadPoolExecutor(8) as pool:
            ids = [job_id for run in pool.map(life, range(8)) for job_id in run]
        with sessions() as s:
            stored = {job_id: jobs.get_job(s, job_id) for job_id in ids}
    finally:
        engine.dispose()
    done = [j for j in stored.values() if j.status == JobStatus.SUCCEEDED]
    assert len(done) == 32 and all(j.output_token_ids == [0, 1, 2, 3, 4, 5, 6] for j in done)
    assert all(j.output_text == "xxxxxxy" and j.finish_reason == "length" for j in done)
    assert sum(j.status == JobStatus.CANCELLED for j in stored.values()) == 32


def test_the_connection_check_is_skipped_through_pgbouncer(pgbouncer, settings):
    """PgBouncer's pools bound the server's connections, not the clients' pools."""
    assert (
        check_deployment_connections(settings.replace(database_url=pgbouncer, api_instances=1000), 4) is None
    )
