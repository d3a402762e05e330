"""contract/redis_client.py against real servers: a private redis-server over TCP, a Unix socket and TLS, and a
master, its replica and a redis-sentinel (Debian's, scripts/services.sh installs it) on loopback, where the
master is killed, Sentinel promotes the replica, and clients made from one URL carry on: the redis-py client
(plain and bounded), Celery's broker (kombu: a message sent before the failover is received after it) and
Flask-Limiter's storage (limits: the count goes on)."""

from __future__ import annotations

import shutil
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from kombu import Connection
from limits.storage import storage_from_string
from redis.sentinel import Sentinel

from contract.redis_client import (
    DRIVER_OPTIONS,
    SentinelBlockingConnectionPool,
    celery_broker,
    limiter_storage,
    redis_client,
    sentinel_service,
)
from tests.conftest import free_port

SERVICE = "genq-test"


def wait_for(check, seconds: float = 20.0, what: str = "") -> None:
    deadline = time.monotonic() + seconds
    while True:
        try:
            if check():
                return
        except (redis.RedisError, OSError):
            pass
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {seconds} s: {what}")
        time.sleep(0.1)


def start(argv: list, where: Path, name: str) -> subprocess.Popen:
    log = open(where / f"{name}.log", "w")  # noqa: SIM115 - closed with the process
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=where)
    proc.log = log  # type: ignore[attr-defined]
    return proc


def stop(*procs: subprocess.Popen) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=10)
        proc.log.close()  # type: ignore[attr-defined]


def redis_server(where: Path, port: int, *extra: str) -> subprocess.Popen:
    argv = [
        shutil.which("redis-server"),
        "--port",
        str(port),
        "--bind",
        "127.0.0.1",
        "--save",
        "",
        "--appendonly",
    ]
    return start([*argv, "no", "--dir", str(where), *extra], where, f"redis-{port}")


def openssl(where: Path, *args: str) -> None:
    subprocess.run(["openssl", *args], cwd=where, check=True, capture_output=True)


@pytest.fixture()
def private_redis(tmp_path) -> Iterator[dict[str, str]]:
    """A redis-server of this test's own on a free port, a Unix socket and a TLS port (a certificate for
    127.0.0.1 signed by a CA made here): a URL for each scheme."""
    openssl(
        tmp_path,
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-subj",
        "/CN=genq-test-ca",
        "-days",
        "1",
        "-keyout",
        "ca.key",
        "-out",
        "ca.crt",
    )
    openssl(
        tmp_path,
        "req",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-subj",
        "/CN=127.0.0.1",
        "-keyout",
        "tls.key",
        "-out",
        "tls.csr",
    )
    (tmp_path / "san.cnf").write_text("subjectAltName=IP:127.0.0.1\n")
    openssl(
        tmp_path,
        "x509",
        "-req",
        "-in",
        "tls.csr",
        "-CA",
        "ca.crt",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-days",
        "1",
        "-extfile",
        "san.cnf",
        "-out",
        "tls.crt",
    )
    port, tls_port, sock = free_port(), free_port(), tmp_path / "redis.sock"
    proc = redis_server(
        tmp_path,
        port,
        *("--unixsocket", str(sock), "--unixsocketperm", "700", "--tls-port", str(tls_port)),
        *("--tls-cert-file", "tls.crt", "--tls-key-file", "tls.key", "--tls-ca-cert-file", "ca.crt"),
        *("--tls-auth-clients", "no"),
    )
    try:
        wait_for(lambda: redis.Redis(port=port).ping(), what="redis-server")
        yield {
            "redis": f"redis://127.0.0.1:{port}/2",
            "unix": f"unix://{sock}?db=3",
            "rediss": f"rediss://127.0.0.1:{tls_port}/4?ssl_ca_certs={tmp_path / 'ca.crt'}",
        }
    finally:
        stop(proc)


@pytest.fixture()
def sentinel_set(tmp_path) -> Iterator[dict]:
    """A master, its replica and one sentinel (quorum 1) watching them, all on loopback free ports."""
    master_port, replica_port, sentinel_port = free_port(), free_port(), free_port()
    procs = [redis_server(tmp_path, master_port)]
    procs.append(redis_server(tmp_path, replica_port, "--replicaof", "127.0.0.1", str(master_port)))
    config = tmp_path / "sentinel.conf"
    config.write_text(
        f"port {sentinel_port}\nbind 127.0.0.1\ndir {tmp_path}\n"
        f"sentinel monitor {SERVICE} 127.0.0.1 {master_port} 1\n"
        f"sentinel down-after-milliseconds {SERVICE} 500\n"
        f"sentinel failover-timeout {SERVICE} 5000\n"
    )
    procs.append(start([shutil.which("redis-sentinel"), str(config)], tmp_path, "sentinel"))
    try:
        replica = redis.Redis(port=replica_port)
        wait_for(
            lambda: replica.info("replication")["master_link_status"] == "up", what="the replica in sync"
        )
        sentinel = redis.Redis(port=sentinel_port)
        wait_for(lambda: sentinel.sentinel_slaves(SERVICE), what="the sentinel sees the replica")
        yield {
            "url": f"redis+sentinel://127.0.0.1:{sentinel_port}/{SERVICE}/1",
            "master": procs[0],
            "master_port": master_port,
            "replica_port": replica_port,
            "sentinel_port": sentinel_port,
        }
    finally:
        stop(*procs)


def test_sentinel_urls_are_parsed_and_refused_when_wrong():
    service = sentinel_service("rediss+sentinel://u:p%40ss@h1:26379,h2/mymaster/3?sentinel_password=s")
    assert service is not None
    assert service.sentinels == (("h1", 26379), ("h2", 26379)) and service.service == "mymaster"
    assert (service.db, service.username, service.password, service.sentinel_password, service.ssl) == (
        3,
        "u",
        "p@ss",
        "s",
        True,
    )
    assert sentinel_service("redis://h:6379/0") is None
    for bad in ("redis+sentinel://h:26379/", "redis+sentinel://h:26379/m/0?oops=1"):
        with pytest.raises(ValueError, match="REDIS_URL"):
            sentinel_service(bad)


@pytest.mark.parametrize("scheme, db", [("redis", 2), ("unix", 3), ("rediss", 4)])
def test_one_url_serves_redis_py_celery_and_the_limiter(private_redis, scheme, db):
    url = private_redis[scheme]
    client, bounded = redis_client(url, timeout=2), redis_client(url, timeout=2, max_connections=2)
    key = f"k-{uuid.uuid4().hex}"
    client.set(key, "v")
    assert bounded.get(key) == b"v" and client.connection_pool.connection_kwargs["db"] == db
    assert isinstance(bounded.connection_pool, redis.BlockingConnectionPool)
    assert bounded.connection_pool.max_connections == 2
    reader = redis_client(url, timeout=10, connect_timeout=1)
    assert reader.connection_pool.connection_kwargs["socket_connect_timeout"] == 1 and reader.get(key) == b"v"
    # redis-py 7: every connection told the library's version once (else each new one looks it up: ~0.3 ms)
    for pool in (client.connection_pool, bounded.connection_pool):
        if DRIVER_OPTIONS:
            assert pool.make_connection().driver_info is DRIVER_OPTIONS["driver_info"]
    broker, options = celery_broker(url)
    with Connection(broker, transport_options=options) as conn:
        queue = conn.SimpleQueue(f"queue-{key}")
        queue.put({"job": scheme})
        message = queue.get(timeout=5)
        assert message.payload == {"job": scheme}
        message.ack()
        queue.close()
    uri, storage_options = limiter_storage(url)
    storage = storage_from_string(uri, **storage_options)
    assert storage.incr(key, 60) == 1 and storage.incr(key, 60) == 2
    assert client.get(f"LIMITS:{key}") == b"2"  # the limiter counts in the same database


def test_clients_from_one_sentinel_url_carry_on_after_the_master_dies(sentinel_set):
    url = sentinel_set["url"]
    client, bounded = redis_client(url, timeout=2), redis_client(url, timeout=2, max_connections=4)
    client.set("job", "1")
    broker, options = celery_broker(url)
    with Connection(broker, transport_options=options) as conn:
        conn.SimpleQueue("generate-test").put({"job": 1})
    uri, storage_options = limiter_storage(url)
    storage = storage_from_string(uri, **storage_options)
    assert storage.incr("tenant", 60) == 1
    assert client.wait(1, 5000) == 1  # the replica has it all before the master dies
    tight = redis_client(url, timeout=0.5, max_connections=1)  # bounded: a second caller waits, then gives up
    held = tight.connection_pool.get_connection()
    with pytest.raises(redis.ConnectionError, match="No connection available"):
        tight.connection_pool.get_connection()
    tight.connection_pool.release(held)
    assert tight.get("job") == b"1"

    sentinel_set["master"].kill()
    sentinels = Sentinel([("127.0.0.1", sentinel_set["sentinel_port"])])
    wait_for(
        lambda: sentinels.discover_master(SERVICE)[1] == sentinel_set["replica_port"],
        seconds=30,
        what="Sentinel promotes the replica",
    )
    assert isinstance(bounded.connection_pool, SentinelBlockingConnectionPool)
    wait_for(lambda: client.set("after", "2"), seconds=10, what="the client writes to the new master")
    assert client.get("job") == b"1" and bounded.get("after") == b"2"
    assert client.connection_pool.get_master_address()[1] == sentinel_set["replica_port"]
    wait_for(lambda: storage.incr("tenant", 60) == 2, seconds=10, what="the limiter counts on")
    with Connection(broker, transport_options=options) as conn:
        queue = conn.SimpleQueue("generate-test")
        message = queue.get(timeout=10)  # sent before the failover, received from the promoted replica
        assert message.payload == {"job": 1}
        message.ack()
        queue.close()


def test_a_bounded_clients_callers_wait_for_a_connection_up_to_its_pool_timeout(settings):
    """All connections busy: a caller waits for one up to `pool_timeout` (the API's sender: a busy pool is its
    own back-pressure, not Redis failing), and up to the reply's `timeout` when none is given."""
    quick = redis_client(settings.redis_url, timeout=0.3, max_connections=1)
    patient = redis_client(settings.redis_url, timeout=0.3, max_connections=1, pool_timeout=5.0)
    for client in (quick, patient):
        held = client.connection_pool.get_connection()  # the pool's only connection, busy for 1 s
        threading.Timer(1.0, client.connection_pool.release, args=(held,)).start()
        started = time.monotonic()
        if client is quick:
            with pytest.raises(redis.ConnectionError, match="No connection available"):
                client.ping()
            assert time.monotonic() - started < 0.9
        else:
            assert client.ping() and 0.9 < time.monotonic() - started < 5.0
        time.sleep(1.1)  # the connection is back before the next client's turn
