"""Process settings for a long-lived engine process (the worker), applied once its engine is built.

Both keep engine steps even; neither changes what they compute:

- The heap built so far (Celery, SQLAlchemy, transformers, the model) is frozen out of the garbage
  collector's sight, so a full collection does not walk it: bench/serving.py saw such walks pause steps
  for up to 250 ms.
- glibc malloc keeps freed memory for reuse instead of returning it to the kernel. Each step frees
  and reallocates megabytes of activations; with glibc's defaults these come and go as mmap/munmap
  with fresh page faults, and the p99 step time during bench/serving.py's bursts was 22 ms against
  18-19 ms with the memory kept (two runs each, median full step 13-14 ms). The cost is memory held
  at its high-water mark.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import logging

log = logging.getLogger(__name__)

# mallopt(3) parameters
M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3
MMAP_THRESHOLD = 32 << 20  # glibc's largest: blocks below this come from the reusable heap
TRIM_THRESHOLD = 1 << 30  # give memory back only when this much is free at the top
TOP_PAD = 64 << 20  # grow the heap in steps this large


def settle_for_serving() -> None:
    _keep_freed_memory()
    gc.collect()
    gc.freeze()


def _keep_freed_memory() -> bool:
    """True when glibc took all three settings."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):  # not glibc (musl, macOS): nothing to tune
        return False
    ok = all(
        mallopt(param, value) == 1
        for param, value in (
            (M_MMAP_THRESHOLD, MMAP_THRESHOLD),
            (M_TRIM_THRESHOLD, TRIM_THRESHOLD),
            (M_TOP_PAD, TOP_PAD),
        )
    )
    if not ok:
        log.warning("malloc tuning was refused; engine steps may be less even")
    return ok
