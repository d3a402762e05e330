"""Process settings for a long-lived engine process (the worker).

Before the engine process starts, its environment (`engine_environment()`): OpenMP threads that wait for
work asleep, not spinning (`OMP_WAIT_POLICY=PASSIVE`). torch's intra-op threads and genq's C++ passes share
libgomp's pool, which by default spins a waiting thread for ~300,000 rounds before it sleeps. On a CPU whose
cores other processes also use (the worker's own API, Postgres and Redis on a `make run` host; a test run),
a spinning thread holds the core its partner needs, and every parallel region of a step waits for a
scheduler tick: bench/engine_throughput.py's record workload in bfloat16, two threads on the 2-core Intel
Xeon at load ~5, made 80-97 tok/s with libgomp's default against 569-581 with PASSIVE (one thread: 551;
`GOMP_SPINCOUNT=10000`: 445; threads bound to cores: 158). A step has ~10 regions a layer, so sleeping costs
a few microseconds a region (a fraction of a percent of a step on any real model) where nothing competes.
A value the user set wins; libgomp reads it once, when it loads, so it must be in place before the process
imports torch.

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


# what an engine process's environment holds unless the user set it (see the module's docstring)
ENGINE_ENVIRONMENT = {"OMP_WAIT_POLICY": "PASSIVE"}


def engine_environment(environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """The variables to add to `environ` for a new engine process: ENGINE_ENVIRONMENT's, less those set."""
    return {name: value for name, value in ENGINE_ENVIRONMENT.items() if name not in environ}


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
