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

from jobstore.tenant_policy import StoredPolicy


class Caller(NamedTuple):
    """The tenant a request acts for, and its stored policy (None: the defaults)."""

    id: uuid.UUID
    name: str
    policy: StoredPolicy | None = None


class KeyCache:
    """key hash -> Caller for `seconds` (0: nothing is remembered) of `timer`; thread-safe."""

    def __init__(self, seconds: float, size: int = 10_000, timer: Callable[[], float] = time.monotonic):
        self._cache = TTLCache(maxsize=size, ttl=seconds, timer=timer) if seconds > 0 else None
        self._lock = threading.Lock()
        self._loading: dict[str, threading.Event] = {}  # keys being looked up now

    def get(self, key_hash: str) -> Caller | None:
        if self._cache is None:
            return None
        with self._lock:
            return self._cache.get(key_hash)

    def get_or_load(self, key_hash: str, load: Callable[[], Caller | None]) -> Caller | None:
        """The cached caller, or `load()`'s (remembered unless None). Concurrent misses of one key wait for
        the first one's load instead of each querying: a burst of a client's first calls (a thousand streams
        opened at once) costs one query, not a thousand connections waiting on the pool."""
        caller = self.get(key_hash)
        if caller is not None or self._cache is None:
            return caller if caller is not None else load()
        with self._lock:
            loading = self._loading.get(key_hash)
            first = loading is None
            if first:
                loading = self._loading[key_hash] = threading.Event()
        if not first:
            loading.wait(10)
            caller = self.get(key_hash)
            return caller if caller is not None else load()  # its load failed or found nothing: our own
        try:
            caller = load()
            if caller is not None:
                self.put(key_hash, caller)
            return caller
        finally:
            with self._lock:
                del self._loading[key_hash]
            loading.set()

    def put(self, key_hash: str, caller: Caller) -> None:
        if self._cache is not None:
            with self._lock:
                self._cache[key_hash] = caller
