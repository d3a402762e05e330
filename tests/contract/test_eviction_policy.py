"""contract.redis_client.warn_unless_noeviction against real redis-servers: one that may evict keys (a
warning naming its policy), one with noeviction (nothing), one that refuses CONFIG (noted, no failure)."""

from __future__ import annotations

import logging

import pytest
import redis

from contract.redis_client import warn_unless_noeviction
from tests.conftest import free_port
from tests.contract.test_redis_client import redis_server, stop, wait_for

LOG = logging.getLogger("genq-test-eviction")


@pytest.mark.parametrize(
    "args, policy, level",
    [
        (("--maxmemory-policy", "allkeys-lru"), "allkeys-lru", logging.WARNING),
        (("--maxmemory-policy", "noeviction"), "noeviction", None),
        (("--rename-command", "CONFIG", ""), None, logging.INFO),  # managed services often do this
    ],
)
def test_a_server_that_may_evict_keys_is_named_at_start(tmp_path, caplog, args, policy, level):
    port = free_port()
    proc = redis_server(tmp_path, port, *args)
    try:
        with redis.Redis(port=port) as client:
            wait_for(client.ping, what="redis-server")
        with caplog.at_level(logging.INFO, logger=LOG.name):
            assert warn_unless_noeviction(f"redis://127.0.0.1:{port}/0", LOG) == policy
    finally:
        stop(proc)
    records = [r for r in caplog.records if r.name == LOG.name]
    assert [r.levelno for r in records] == ([level] if level else [])
    if policy == "allkeys-lru":
        assert "allkeys-lru" in records[0].getMessage() and "noeviction" in records[0].getMessage()
