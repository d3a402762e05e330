"""The API keys an API process has looked up lately, so that a client submitting or polling in a loop
costs no database query per request for its key.

A key stays trusted for `seconds` after its lookup (AUTH_CACHE_SECONDS, 5 by default): a key revoked
in the database stops working after at most that long. Unknown keys are never remembered.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable
from typing import NamedTuple

from cachetools import TTLCache


class Caller(NamedTuple):
    """The tenant a request acts for."""

    id: uuid.UUID
    name: str


class KeyCache:
    """key hash -> Caller for `seconds` (0: nothing is remembered) of `timer`; thread-safe."""

    def __init__(self, seconds: float, size: int = 10_000, timer: Callable[[], float] = time.monotonic):
        self._cache = TTLCache(maxsize=size, ttl=seconds, timer=timer) if seconds > 0 else None
        self._lock = threading.Lock()

    def get(self, key_hash: str) -> Caller | None:
        if self._cache is None:
            return None
        with self._lock:
            return self._cache.get(key_hash)

    def put(self, key_hash: str, caller: Caller) -> None:
        if self._cache is not None:
            with self._lock:
                self._cache[key_hash] = caller
