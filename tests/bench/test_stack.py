"""bench/stack.py's pieces that benches use on their own: a private redis-server, waiting for a server."""

import subprocess
import sys

import pytest
import redis

from bench.harness import proc_stat
from bench.stack import private_redis, wait_for


def test_a_private_redis_answers_on_its_port_and_is_gone_after():
    with private_redis() as server:
        client = redis.Redis.from_url(server.url)
        assert client.ping() and client.dbsize() == 0  # a server of its own: no one else's keys
        stat = proc_stat(server.pid)
        assert stat is not None and stat.comm == "redis-server"
        client.close()
    assert proc_stat(server.pid) is None


def test_wait_for_reports_a_server_that_exits_with_the_end_of_its_log(tmp_path):
    log = tmp_path / "server.log"
    with log.open("w") as out:
        process = subprocess.Popen(
            [sys.executable, "-c", "print('cannot bind: address in use'); raise SystemExit(3)"], stdout=out
        )
    with pytest.raises(RuntimeError, match="exited:\n.*cannot bind: address in use"):
        wait_for("http://127.0.0.1:9/", process, log, timeout=30)
    process.wait()
