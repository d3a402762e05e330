"""webapi/key_cache.py: API keys looked up lately."""

from __future__ import annotations

import threading
import time
import uuid

from webapi.key_cache import Caller, KeyCache


def test_concurrent_misses_of_one_key_cost_one_lookup():
    cache, caller, calls = KeyCache(5), Caller(uuid.uuid4(), "t"), []

    def load() -> Caller:
        calls.append(1)
        time.sleep(0.2)  # the query, while the others arrive
        return caller

    got: list = []
    threads = [threading.Thread(target=lambda: got.append(cache.get_or_load("k", load))) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == [caller] * 8 and len(calls) == 1
    assert cache.get_or_load("k", lambda: None) == caller  # remembered


def test_an_unknown_key_is_looked_up_each_time_and_never_remembered():
    cache, calls = KeyCache(5), []
    assert cache.get_or_load("k", lambda: calls.append(1)) is None
    assert cache.get_or_load("k", lambda: calls.append(1)) is None
    assert len(calls) == 2
