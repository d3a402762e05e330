"""Process settings for a long-lived engine process (the worker).

Before the engine process starts, its environment (`engine_environment()`): OpenMP threads that spin a
short while for work, then sleep (`GOMP_SPINCOUNT=10000`). torch's intra-op threads and genq's C++ passes share
libgomp's pool, which by default spins a waiting thread ~300,000 rounds before it sleeps. On a CPU whose cores
other processes also use (the worker's own API, Postgres and Redis on a `make run` host; a test run), a spinning
thread holds the core its partner needs, and every parallel region of a step waits for a scheduler tick.
bench/engine_throughput.py's record workload in bfloat16, two threads, on the 2-core Intel Xeon:

| libgomp setting | at load ~5 (tok/s) | quiet (tok/s) |
| --- | --- | --- |
| default (spin ~300,000) | 80-97 | 1,388-1,506 |
| `GOMP_SPINCOUNT=10000` | 445 | 1,278-1,280 |
| `OMP_WAIT_POLICY=PASSIVE` (sleep at once) | 569-581 | 1,070-1,130 |

A short spin gives up a tenth where nothing competes and gains 4.6x where something does. A user who sets
either variable keeps their choice. libgomp reads them once, when it loads, so they must be in place before the
process imports torch.

Once its engine is built, the process's memory (`settle_for_serving()`). Both keep engine steps even;
neither changes what they compute:

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
import os
from collections.abc import Mapping

log = logging.getLogger(__name__)

# mallopt(3) parameters
M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3
MMAP_THRESHOLD = 32 << 20  # glibc's largest: blocks below this come from the reusable heap
TRIM_THRESHOLD = 1 << 30  # give memory back only when this much is free at the top
TOP_PAD = 64 << 20  # grow the heap in steps this large


# what an engine process's environment holds unless the user chose how OpenMP threads wait (the docstring)
ENGINE_ENVIRONMENT = {"GOMP_SPINCOUNT": "10000"}
WAIT_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")


def engine_environment(environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """The variables to add to `environ` for a new engine process: none where it sets how threads wait."""
    if any(name in environ for name in WAIT_VARIABLES):
        return {}
    return dict(ENGINE_ENVIRONMENT)


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
