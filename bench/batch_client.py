"""genq-batch against the Batch API: the same N jobs, first byte to every result on disk (issue 41).

A fresh stack (bench/stack.py: its own database and Redis keys, gunicorn, one Celery worker) with the
API's default rate limit (50/s, 2,000/min per key) and queued-job cap (1,000 per tenant). N chat requests
(default 10,000; short questions, greedy, `--max-tokens` 8, priority 8 as a batch's) run two ways, one
after the other:

1. The Batch API: upload the file (POST /v1/files), create the batch, poll it until `completed`, download
   its output file.
2. genq-batch (`python -m batchclient submit`, a process of its own): bulk submissions within the cap,
   results followed with GET /jobs/ended, each written as it ends, the file in input order at the end.

Before both, `--warm-up` (500) other requests run as a batch, untimed: the first jobs on a fresh stack pay
for loading and compiling (tokenizer, chat template, the CPU attention kernels), and whichever way ran
first was 1.5-2x slower without it. `--client-first` runs genq-batch first. `--rounds R` runs both ways R
times on the same stack, the order alternating (a second run of the same prompts finds what the first left
in the engine's prefix cache, and a machine that warms up favours whichever runs later).

Reported, each round: both wall times and their ratio, the client's calls (POST, GET) and how many were
answered 429; the verdict: the median ratio (target: genq-batch within 1.5x the Batch API) and no 429.

With `--timeline`, each way also prints where its time went: the CPU seconds of the API's processes, the
worker's (its engine's apart), the Postgres backends of the stack's database and the client, and its jobs'
timeline from their rows, in bins of `--bin` seconds (created, claimed and ended in the bin, and queued and
held at its end), so a phase that stretches (submitting, or the worker idling for want of queued jobs) shows.
With `--profile DIR`, py-spy samples the API's, the worker's, the engine's and genq-batch's processes during
each way (DIR/<way>-<part>.top: the functions with the most samples; the profiler's cost makes those runs'
times higher).

    .venv/bin/python bench/batch_client.py --jobs 2000
    .venv/bin/python bench/batch_client.py --rounds 4          # the verdict: 10,000 jobs, alternating
    .venv/bin/python bench/batch_client.py --timeline --profile bench/out/batch-client-profile
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from functools import partial
from pathlib import Path

import requests
from sqlalchemy import text

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.bulk_submit import batch_file, conversations  # noqa: E402
from bench.harness import markdown_table, proc_stat, run_info, session_cpu, write_result  # noqa: E402
from bench.job_cpu import top_functions  # noqa: E402
from bench.stack import Stack, bench_settings, local_stack  # noqa: E402

OUT = Path(__file__).resolve().parent / "out"
TARGET_RATIO = 1.5
DEFAULT_LIMITS = dict(rate_limit="50/second;2000/minute", max_queued_per_tenant=1000, max_queued_jobs=20000)


def run_batch_api(url: str, headers: dict, content: bytes, n: int) -> float:
    """Seconds from the upload's first byte to the batch's output file downloaded."""
    http = requests.Session()
    http.headers.update(headers)
    t0 = time.perf_counter()
    r = http.post(
        url + "/v1/files", files={"file": ("in.jsonl", content)}, data={"purpose": "batch"}, timeout=600
    )
    r.raise_for_status()
    body = {"input_file_id": r.json()["id"], "endpoint": "/v1/chat/completions", "completion_window": "24h"}
    batch = http.post(url + "/v1/batches", json=body, timeout=600).json()
    while batch["status"] not in ("completed", "failed", "cancelled", "expired"):
        time.sleep(0.5)
        batch = http.get(f"{url}/v1/batches/{batch['id']}", timeout=600).json()
    if batch["request_counts"]["completed"] != n:
        raise RuntimeError(f"batch ended {batch['status']}: {batch['request_counts']}")
    lines = http.get(f"{url}/v1/files/{batch['output_file_id']}/content", timeout=600).content.count(b"\n")
    if lines != n:
        raise RuntimeError(f"the output file holds {lines} lines, not {n}")
    return time.perf_counter() - t0


def run_client(
    url: str,
    key: str,
    convs: list,
    max_tokens: int,
    workdir: Path,
    started: Callable[[int], None] = lambda pid: None,
) -> dict:
    """genq-batch on the same requests: its wall time, its CPU seconds, and the calls it reports.
    `started` is given the client's pid as soon as it runs (the profiler's hook)."""
    lines = [
        {"custom_id": f"r{i}", "messages": c, "max_tokens": max_tokens, "temperature": 0, "priority": 8}
        for i, c in enumerate(convs)
    ]
    (workdir / "in.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    command = [sys.executable, "-m", "batchclient", "submit", str(workdir / "in.jsonl"), "--url", url]
    command += ["--key", key, "--out", str(workdir / "out.jsonl"), "--no-progress"]
    t0 = time.perf_counter()
    with (workdir / "stderr").open("w+") as err:
        client = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=err, text=True)
        started(client.pid)
        _, status, usage = os.wait4(client.pid, 0)  # its own rusage (not the profiler's, also a child)
        client.returncode = os.waitstatus_to_exitcode(status)
        elapsed = time.perf_counter() - t0
        err.seek(0)
        stderr = err.read()
    if client.returncode != 0:
        raise RuntimeError(f"genq-batch failed: {stderr[-3000:]}")
    rows = [json.loads(line) for line in (workdir / "out.jsonl").read_text().splitlines()]
    if len(rows) != len(lines) or any(row["status"] != "succeeded" for row in rows):
        raise RuntimeError(f"genq-batch: {len(rows)} rows, not all succeeded: {stderr[-2000:]}")
    calls = re.search(r"(\d+) POST and (\d+) GET calls, (\d+) answered 429", stderr)
    posts, gets, throttled = (int(x) for x in calls.groups())
    return {
        "client_s": elapsed,
        "client_cpu_s": usage.ru_utime + usage.ru_stime,
        "posts": posts,
        "gets": gets,
        "answered_429": throttled,
    }


class Probe:
    """Where a way's time went (--timeline, --profile): the CPU seconds of the stack's parts, its jobs'
    timeline from their rows, and py-spy's samples of its processes."""

    def __init__(self, stack: Stack, bin_s: float, profile_dir: Path | None):
        self.stack, self.bin_s, self.profile_dir = stack, bin_s, profile_dir
        self.conn = stack.client.db.connect().execution_options(isolation_level="AUTOCOMMIT")
        self.own_backend = self.conn.scalar(text("SELECT pg_backend_pid()"))
        self.spies: list[tuple[str, Path, subprocess.Popen]] = []

    def cpu(self) -> dict[str, dict[int, float]]:
        """part -> pid -> CPU seconds so far: the API's processes, the worker's, its engine's, and the
        Postgres backends serving the stack's database (this probe's own apart)."""
        parts: dict[str, dict[int, float]] = {"api": {}, "worker": {}, "engine": {}, "postgres": {}}
        for pid, (_, seconds) in session_cpu(self.stack.api_pid).items():
            parts["api"][pid] = seconds
        for worker in self.stack.workers:
            for pid, (comm, seconds) in session_cpu(worker.pid).items():
                parts["engine" if comm == "genq-engine" else "worker"][pid] = seconds
        backends = self.conn.execute(
            text("SELECT pid FROM pg_stat_activity WHERE datname = current_database() AND pid <> :me"),
            {"me": self.own_backend},
        )
        for (pid,) in backends:
            if (stat := proc_stat(pid)) is not None:
                parts["postgres"][pid] = stat.cpu_s
        return parts

    @contextmanager
    def way(self, name: str) -> Iterator[dict]:
        """Measures the way run inside; the dict it yields is filled with its figures at the end."""
        figures: dict = {}
        before, t0 = self.cpu(), time.time()
        self.spy(name, "api", *self.cpu()["api"])
        self.spy(name, "worker", *self.cpu()["worker"])
        self.spy(name, "engine", *self.cpu()["engine"])
        yield figures
        t1, after = time.time(), self.cpu()
        self.stop_spies(name)
        figures["cpu_s"] = {
            part: round(sum(s - before[part].get(pid, 0.0) for pid, s in pids.items()), 2)
            for part, pids in after.items()
        }
        figures["timeline"] = self.timeline(t0, t1)
        print(describe(name, figures, t1 - t0, self.bin_s))

    def spy(self, way: str, part: str, *pids: int) -> None:
        """py-spy record on `pids` until the way ends (with --profile)."""
        if self.profile_dir is None:
            return
        self.profile_dir.mkdir(parents=True, exist_ok=True)
        spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
        for pid in pids:
            out = self.profile_dir / f"{slug(way)}-{part}-{pid}.txt"
            command = [
                spy,
                "record",
                "-p",
                str(pid),
                "-r",
                "100",
                "--nonblocking",
                "-f",
                "raw",
                "-o",
                str(out),
            ]
            process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            self.spies.append((part, out, process))

    def stop_spies(self, way: str) -> None:
        for _, _, process in self.spies:
            if process.poll() is None:
                process.send_signal(signal.SIGINT)
        by_part: dict[str, list[Path]] = {}
        for part, out, process in self.spies:
            process.wait()
            by_part.setdefault(part, []).append(out)
        for part, outs in by_part.items():
            (self.profile_dir / f"{slug(way)}-{part}.top").write_text(top_functions(outs))  # type: ignore[operator]
        self.spies = []

    def timeline(self, t0: float, t1: float) -> list[dict]:
        """The jobs created between t0 and t1 (epoch seconds), by bin of `bin_s` from t0: created, claimed
        and ended in the bin; queued and held (claimed, not ended) at its end."""
        rows = self.conn.execute(
            text(
                "SELECT extract(epoch FROM created_at), extract(epoch FROM started_at), "
                "extract(epoch FROM finished_at) FROM jobs "
                "WHERE created_at BETWEEN to_timestamp(:t0) AND to_timestamp(:t1)"
            ),
            {"t0": t0, "t1": t1},
        ).all()
        bins = [dict(created=0, claimed=0, ended=0) for _ in range(max(1, math.ceil((t1 - t0) / self.bin_s)))]
        for row in rows:
            for what, at in zip(("created", "claimed", "ended"), row, strict=True):
                if at is not None:
                    bins[min(len(bins) - 1, max(0, int((float(at) - t0) / self.bin_s)))][what] += 1
        created = claimed = ended = 0
        for b in bins:
            created, claimed, ended = created + b["created"], claimed + b["claimed"], ended + b["ended"]
            b.update(queued=created - claimed, held=claimed - ended)
        return bins


def slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "-", name).strip("-")


def describe(name: str, figures: dict, seconds: float, bin_s: float) -> str:
    """A way's CPU by part and its timeline, as printed lines."""
    cpu = figures["cpu_s"]
    lines = [
        f"{name}: {seconds:.1f} s; CPU s: "
        + ", ".join(f"{part} {s:.1f}" for part, s in cpu.items())
        + (f", client {figures['client_cpu_s']:.1f}" if "client_cpu_s" in figures else "")
        + f" (the machine had {(os.cpu_count() or 1) * seconds:.0f} core-s)"
    ]
    for i, b in enumerate(figures["timeline"]):
        lines.append(
            f"  {i * bin_s:5.0f}-{(i + 1) * bin_s:4.0f} s: created {b['created']:5d} claimed {b['claimed']:5d} "
            f"ended {b['ended']:5d} | queued {b['queued']:5d} held {b['held']:4d}"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=10_000)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--client-first", action="store_true", help="run genq-batch before the Batch API")
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="rounds of both ways, the order alternating from one round to the next; the verdict is the median ratio",
    )
    parser.add_argument("--warm-up", type=int, default=500, help="untimed requests run first, as a batch")
    parser.add_argument(
        "--timeline", action="store_true", help="each way's CPU by part and its jobs' timeline"
    )
    parser.add_argument("--bin", type=float, default=5.0, help="seconds per line of --timeline")
    parser.add_argument(
        "--profile", type=Path, help="py-spy each way's processes into this folder (implies --timeline)"
    )
    args = parser.parse_args()
    run, n = run_info(), args.jobs
    print(f"{run['machine']}; load average {run['load_avg'][0]:.2f}; {n} jobs")
    convs = conversations(n)
    rounds = []
    with local_stack(bench_settings(**DEFAULT_LIMITS), log_dir=OUT / "batch-client-logs") as stack:
        key = stack.headers["Authorization"].removeprefix("Bearer ")
        if args.warm_up:
            warm = conversations(args.warm_up, seed=99)
            print(
                f"warm-up: {run_batch_api(stack.url, stack.headers, batch_file(warm, args.max_tokens), args.warm_up):.1f} s"
            )
        probe = Probe(stack, args.bin, args.profile) if args.timeline or args.profile else None
        for i in range(args.rounds):
            client_first = args.client_first != (i % 2 == 1)
            order = ("client", "batch") if client_first else ("batch", "client")
            for run_now in order:
                way = f"round {i + 1}: {'genq-batch' if run_now == 'client' else 'Batch API'}"
                with probe.way(way) if probe else nullcontext({}) as figures:
                    if run_now == "batch":
                        content = batch_file(convs, args.max_tokens)
                        batch_s = run_batch_api(stack.url, stack.headers, content, n)
                        print(f"{way}: {batch_s:.1f} s")
                        batch_figures = figures
                    else:
                        with tempfile.TemporaryDirectory() as workdir:
                            result = run_client(
                                stack.url,
                                key,
                                convs,
                                args.max_tokens,
                                Path(workdir),
                                started=partial(probe.spy, way, "client") if probe else lambda pid: None,
                            )
                        figures["client_cpu_s"] = result["client_cpu_s"]
                        print(f"{way}: {result['client_s']:.1f} s")
                        client_figures = figures
            if probe:
                result.update(client_probe=client_figures, batch_probe=batch_figures)
            result.update(
                batch_s=batch_s,
                ratio=result["client_s"] / batch_s,
                first="genq-batch" if client_first else "Batch API",
                load_avg=os.getloadavg()[0],
            )
            rounds.append(result)
            print(
                f"round {i + 1} ({result['first']} first, load average {result['load_avg']:.2f}): genq-batch "
                f"{result['client_s']:.1f} s, {result['ratio']:.2f}x the Batch API's {batch_s:.1f} s; "
                f"{result['posts']} POST and {result['gets']} GET calls, {result['answered_429']} answered 429"
            )
    ratio = statistics.median(r["ratio"] for r in rounds)
    throttled = sum(r["answered_429"] for r in rounds)
    summary = dict(
        warm_up=args.warm_up,
        jobs=n,
        max_tokens=args.max_tokens,
        rounds=rounds,
        ratio=ratio,
        answered_429=throttled,
    )
    met = ratio <= TARGET_RATIO and throttled == 0
    print(
        f"genq-batch / Batch API, median of {len(rounds)} round(s): {ratio:.2f}x (target <= {TARGET_RATIO}x); "
        f"{throttled} answered 429 (target 0): {'met' if met else 'NOT met'}"
    )
    table = markdown_table(
        [
            "round",
            "genq-batch, first byte to every result written",
            "Batch API, same run",
            "ratio",
            "ran first",
        ],
        [
            [
                str(i + 1),
                f"**{r['client_s']:.1f} s** ({r['posts']} POST, {r['gets']} GET, {r['answered_429']} x 429)",
                f"{r['batch_s']:.1f} s",
                f"{r['ratio']:.2f}x",
                r["first"],
            ]
            for i, r in enumerate(rounds)
        ],
    )
    table += (
        f"\n\n{n} jobs; median ratio **{ratio:.2f}x**, {throttled} x 429 (target <= {TARGET_RATIO}x, no 429): "
        f"{'met' if met else 'NOT met'}"
    )
    write_result("batch_client", summary, table, run=run)


if __name__ == "__main__":
    main()
