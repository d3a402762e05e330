"""What the benches share, apart from starting a stack (bench/stack.py does that).

- `pct`: the percentile every bench reports (linear between the two nearest samples, as numpy's default).
- `wait_for_quiet` and `Interference`: on a shared machine, wait until other processes leave the CPU idle,
  and measure the share of the CPU they took while a pass ran (and the cores the measured system used).
- CPU accounting from /proc: `own_seconds` (this process), `proc_stat` (one process: its name, session and
  CPU seconds), `session_cpu` (every process of a session, as a stack started with `start_new_session`
  runs: gunicorn's master and workers, a Celery worker and its engine process) and `tree_cpu_seconds`
  (a process and its descendants: a system in processes of its own).
- `run_info` and `write_result`: a run's date, machine (CPU model, GPU), command and code commit, written
  with its figures to bench/out/<name>.json, and its headline figures as a markdown table
  (bench/out/<name>.md) ready for bench/RESULTS.md.

This module imports neither torch nor the job system: engine benches and stack benches both use it.
"""

from __future__ import annotations

import json
import math
import os
import resource
import shlex
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench" / "out"


# --- percentiles ------------------------------------------------------------------------------------


def pct(values: Iterable[float], q: float) -> float | None:
    """The q-th percentile (0-100) of `values`, linear between the nearest two; None when there are none."""
    xs = sorted(values)
    if not xs:
        return None
    k = (len(xs) - 1) * q / 100
    lo = math.floor(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


# --- a shared machine -------------------------------------------------------------------------------

TICK = os.sysconf("SC_CLK_TCK")  # /proc's unit of CPU time


def busy_seconds() -> float | None:
    """CPU seconds the whole machine has spent busy since boot (/proc/stat); None where it is missing."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return (sum(fields[:8]) - idle) / TICK


def own_seconds() -> float:
    """CPU seconds of this process, all its threads (getrusage: microseconds, not os.times()'s clock ticks)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


class ProcStat(NamedTuple):
    """A process as /proc/PID/stat has it."""

    comm: str  # its name (15 characters at most)
    session: int  # its session id
    cpu_s: float  # user + system CPU seconds, every thread
    ppid: int


def proc_stat(pid: int) -> ProcStat | None:
    """/proc/`pid`/stat, None if the process is gone (or there is no /proc)."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    comm = raw[raw.index("(") + 1 : raw.rindex(")")]
    fields = raw[
        raw.rindex(")") + 2 :
    ].split()  # after "pid (comm) ": state ppid pgrp session ... utime stime
    return ProcStat(comm, int(fields[3]), (int(fields[11]) + int(fields[12])) / TICK, int(fields[1]))


def all_procs() -> dict[int, ProcStat]:
    """Every live process, by pid."""
    stats = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (stat := proc_stat(int(entry))) is not None:
            stats[int(entry)] = stat
    return stats


def session_cpu(sid: int) -> dict[int, tuple[str, float]]:
    """pid -> (comm, CPU seconds) of every live process of session `sid`."""
    return {pid: (stat.comm, stat.cpu_s) for pid, stat in all_procs().items() if stat.session == sid}


def tree_cpu_seconds(root_pid: int) -> float | None:
    """User + system CPU seconds of `root_pid` and its live descendants, every thread (/proc/PID/stat)."""
    stats = all_procs()
    if root_pid not in stats:
        return None
    children: dict[int, list[int]] = {}
    for pid, stat in stats.items():
        children.setdefault(stat.ppid, []).append(pid)
    seconds, stack = 0.0, [root_pid]
    while stack:
        pid = stack.pop()
        seconds += stats[pid].cpu_s
        stack.extend(children.get(pid, ()))
    return seconds


class Interference:
    """CPU use while a pass ran: `share`, the share of the machine's CPU time that other processes used,
    and `own_cores`, the cores the measured system kept busy on average. `own` returns the CPU seconds of
    the measured system (default: this process); one in processes of its own passes `tree_cpu_seconds`."""

    def __init__(self, own: Callable[[], float | None] | None = None):
        self.own = own or own_seconds
        self.share: float | None = None
        self.own_cores: float | None = None

    def __enter__(self) -> Interference:
        self.t0, self.busy0, self.own0 = time.perf_counter(), busy_seconds(), self.own()
        return self

    def __exit__(self, *exc) -> None:
        wall = time.perf_counter() - self.t0
        busy, own = busy_seconds(), self.own()
        if wall > 0 and own is not None and self.own0 is not None:
            self.own_cores = (own - self.own0) / wall
            if busy is not None and self.busy0 is not None:
                others = max(0.0, (busy - self.busy0) - (own - self.own0))
                self.share = others / (wall * (os.cpu_count() or 1))


def wait_for_quiet(max_wait: float, threshold: float = 0.15, window: float = 3.0) -> float:
    """Wait (at most max_wait seconds) until other processes use < threshold of the CPU over two windows
    in a row. Returns the seconds waited. A no-op where /proc/stat is missing or max_wait is 0."""
    t0, quiet = time.perf_counter(), 0
    while quiet < 2 and time.perf_counter() - t0 < max_wait:
        with Interference() as load:
            time.sleep(window)
        if load.share is None:
            break
        quiet = quiet + 1 if load.share < threshold else 0
    return time.perf_counter() - t0


def wait_until_idle(
    meters: list[Callable[[], float | None]],
    threshold: float = 0.03,
    window: float = 0.5,
    max_wait: float = 20.0,
) -> float:
    """Wait (at most max_wait seconds) until every meter (CPU seconds of a process or tree) rises by less than
    `threshold` cores over a window: a system that was just measured has stopped spinning (vLLM's processes
    keep ~0.2 cores busy for a few seconds after a pass; OpenMP threads spin after their last region). Returns
    the seconds waited."""
    t0 = time.perf_counter()
    while meters and time.perf_counter() - t0 < max_wait:
        before = [meter() for meter in meters]
        time.sleep(window)
        after = [meter() for meter in meters]
        if all(a is None or b is None or (b - a) / window < threshold for a, b in zip(before, after)):
            break
    return time.perf_counter() - t0


# --- what a run was ---------------------------------------------------------------------------------


def _git(*args: str) -> str | None:
    try:
        done = subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def code_version() -> dict:
    """The commit the figures belong to: HEAD, the last commit touching batching/, uncommitted changes."""
    return dict(
        head=_git("rev-parse", "--short", "HEAD"),
        batching_commit=_git("log", "-1", "--format=%h", "--", "batching"),
        batching_dirty=bool(_git("status", "--porcelain", "--", "batching")),
        dirty=bool(_git("status", "--porcelain", "--untracked-files=no")),
    )


def machine() -> str:
    """The CPU (model, family/model, the vector extensions that matter here), its cores, and the GPU when
    torch is already imported and sees one."""
    info: dict[str, str] = {}
    flags: set[str] = set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if key in ("model name", "cpu family", "model") and key not in info:
                info[key] = value.strip()
            elif key == "flags" and not flags:
                flags = set(value.split())
    except OSError:
        pass
    extensions = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags]
    cpu = info.get("model name", "unknown CPU")
    if "cpu family" in info:
        cpu += f" (family {info['cpu family']} model {info.get('model', '?')})"
    text = f"{cpu}, {len(os.sched_getaffinity(0))} cores" + (
        f", {' '.join(extensions)}" if extensions else ""
    )
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        text += "; GPU " + ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
    return text


def run_info() -> dict:
    """Date (UTC), machine, the command as typed, the code, and the load average at this moment."""
    return dict(
        date=datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        machine=machine(),
        command=shlex.join(["python", os.path.relpath(sys.argv[0], ROOT), *sys.argv[1:]]),
        code=code_version(),
        load_avg=os.getloadavg(),
    )


# --- writing a run's figures ------------------------------------------------------------------------


def markdown_table(header: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join("---" for _ in header) + " |"]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def write_result(
    name: str, figures: dict, table: str | None = None, path: str | Path | None = None, *, run: dict
) -> Path:
    """Write `figures` with the run's `run_info()` (taken when the run began) to `path` (default
    bench/out/<name>.json); print `table` (the headline figures, markdown) under a line naming the run,
    and save both beside the JSON as <name>.md. Returns the JSON's path."""
    path = Path(path) if path else OUT / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"run": run, **figures}, indent=2, default=str) + "\n")
    print(f"wrote {path}")
    if table:
        code = run["code"]
        head = f"{code['head']}{' + uncommitted changes' if code.get('dirty') else ''}"
        text = f"`{run['command']}`, {run['date']}, {run['machine']}, code {head}\n\n{table}\n"
        print("\n" + text)
        path.with_suffix(".md").write_text(text)
    return path
