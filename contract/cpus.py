"""How many CPUs this process may use: its affinity, capped by a container's CPU quota (cgroup).

`os.cpu_count()` is the host's count: in a container limited to 4 CPUs on a 64-core host it says 64,
and sizing gunicorn or torch threads from it starts 16 times too many. This reads the quota the
container runtime set (`docker run --cpus`, compose `cpus:`, a Kubernetes limit).
"""

from __future__ import annotations

import math
import os
from pathlib import Path

CGROUP_V2 = Path("/sys/fs/cgroup/cpu.max")  # "max 100000" or "<quota> <period>"
CGROUP_V1 = Path("/sys/fs/cgroup/cpu/cpu.cfs_quota_us"), Path("/sys/fs/cgroup/cpu/cpu.cfs_period_us")


def available_cpus() -> int:
    """CPUs this process may run on, at most the cgroup quota rounded up; at least 1."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    quota = cgroup_quota()
    return max(1, min(cpus, math.ceil(quota)) if quota else cpus)


def cgroup_quota(v2: Path = CGROUP_V2, v1: tuple[Path, Path] = CGROUP_V1) -> float | None:
    """The CPU quota in CPUs (e.g. 2.5), or None when there is none or no cgroup file to read."""
    try:
        quota, period = v2.read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        quota_us, period_us = (int(path.read_text()) for path in v1)
        return None if quota_us <= 0 else quota_us / period_us
    except (OSError, ValueError):
        return None
