"""Python's cyclic garbage collector paused while a request builds many objects at once (a batch's jobs).

Validating, rendering and inserting a 10,000-line batch allocates hundreds of thousands of objects that
stay alive until the request ends; each allocation burst triggers collections, and each full collection
walks every object built so far. Measured in-process on bench/bulk_submit.py's 10,000-line file, with
the start-up objects frozen as gunicorn.conf.py does: upload + create 1.20 -> 1.13 s of CPU (load ~3.7,
noisy). Where many objects are alive and not frozen the collector costs far more (parsing the 10,000
lines with pydantic while an earlier 10,000 parsed lines were alive: 0.4 s on, 0.05 s off). Reference
counting still frees whatever the request drops; only cycles wait for the collector, which runs again
once the last pausing request ends.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from contextlib import contextmanager

_lock = threading.Lock()
_pausers = 0  # requests of this process (gthread workers run several) inside gc_paused()
_was_enabled = True  # the collector's state when the first of them paused it


@contextmanager
def gc_paused() -> Iterator[None]:
    """The collector off until the last request that paused it is done; then as it was before."""
    global _pausers, _was_enabled
    with _lock:
        if _pausers == 0:
            _was_enabled = gc.isenabled()
        _pausers += 1
        gc.disable()
    try:
        yield
    finally:
        with _lock:
            _pausers -= 1
            if _pausers == 0 and _was_enabled:
                gc.enable()
