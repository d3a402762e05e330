"""Bulk submission through the Batch API against the same jobs one POST /jobs each (issue 13).

A fresh stack (bench/stack.py: its own database and Redis keys, gunicorn, one Celery worker). N chat
requests (default 10,000; short questions, greedy, `--max-tokens` 8) are submitted two ways, alternately:

1. Submission rate. The worker's consumers are cancelled, so submitted jobs wait in Redis and the
   worker takes no CPU. Batch: upload the JSONL file (POST /v1/files), create the batch (POST
   /v1/batches), which returns once every job is committed and its message is in Redis (checked: the
   Redis lists hold N more messages). /jobs: the same requests as POST /jobs bodies (`messages`, so the
   server renders the same chat template), sent by a lean asyncio client (bench/http_load.py's raw
   keep-alive connections, `--connections` 16 at once). Target: the batch >= 5,000 jobs/s. Between
   rounds the queued jobs are cancelled and the Redis lists emptied.
2. End to end (`--skip-e2e` to leave out): consumers on; from the first byte sent to the batch
   `completed` (GET /v1/batches/<id>, which includes writing the output file), against POST /jobs for
   every request and then until every job has ended (read from Postgres, which costs a real client
   more: it would poll each job).

Rate limits and queued-job caps are lifted for the bench (bench_settings): with the defaults (50
requests/s per key, 1,000 queued jobs per tenant) 10,000 POST /jobs take at least 200 s, while a batch
is one request and its jobs do not count towards the cap.

    .venv/bin/python bench/bulk_submit.py --quick       # 2,000 requests, submission only, ~1 min
    .venv/bin/python bench/bulk_submit.py --repeat 3 --wait-quiet 120   # 10,000 requests, median of 3, end to end
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from pathlib import Path

import requests
from sqlalchemy import text

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.harness import markdown_table, pct, run_info, wait_for_quiet, write_result  # noqa: E402
from bench.http_load import _Connection, build_request  # noqa: E402
from bench.stack import bench_settings, local_stack  # noqa: E402
from contract.dispatch import PRIORITIES, QUEUE, queue_key  # noqa: E402

OUT = Path(__file__).resolve().parent / "out"
WORDS = "the tea cat sky mud river stone light song road".split()
TARGET_JOBS_PER_S = 5000


def conversations(n: int, seed: int = 13) -> list[list[dict]]:
    rng = random.Random(seed)
    return [
        [
            {
                "role": "user",
                "content": f"Q{i}: why is the {' '.join(rng.choices(WORDS, k=rng.randint(3, 9)))}?",
            }
        ]
        for i in range(n)
    ]


def batch_file(convs: list[list[dict]], max_tokens: int) -> bytes:
    return b"".join(
        json.dumps(
            {
                "custom_id": f"r{i}",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {"messages": c, "max_tokens": max_tokens, "temperature": 0},
            }
        ).encode()
        + b"\n"
        for i, c in enumerate(convs)
    )


class Bench:
    def __init__(self, stack, convs: list[list[dict]], max_tokens: int, connections: int):
        self.stack, self.convs, self.max_tokens, self.connections = stack, convs, max_tokens, connections
        self.content = batch_file(convs, max_tokens)
        self.http = requests.Session()
        self.http.headers.update(stack.headers)
        self.client = stack.client

    def submit_batch(self) -> tuple[str, float, float]:
        """(batch id, upload seconds, create seconds)."""
        t0 = time.perf_counter()
        r = self.http.post(
            self.stack.url + "/v1/files",
            files={"file": ("bench.jsonl", self.content)},
            data={"purpose": "batch"},
            timeout=600,
        )
        r.raise_for_status()
        t1 = time.perf_counter()
        body = {
            "input_file_id": r.json()["id"],
            "endpoint": "/v1/chat/completions",
            "completion_window": "24h",
        }
        r = self.http.post(self.stack.url + "/v1/batches", json=body, timeout=600)
        r.raise_for_status()
        if r.json()["status"] != "in_progress":
            raise RuntimeError(f"batch not accepted: {r.text[:2000]}")
        return r.json()["id"], t1 - t0, time.perf_counter() - t1

    def submit_jobs(self, limit: int | None = None) -> float:
        """POST /jobs for every request (or the first `limit`) over `connections` keep-alive connections;
        seconds taken."""
        raws = []
        for conv in self.convs[:limit]:
            body = {"messages": conv, "max_tokens": self.max_tokens, "temperature": 0, "priority": 8}
            host, port, raw = build_request(self.stack.url, "/jobs", body, self.stack.headers)
            raws.append(raw)

        async def run() -> list[int]:
            pending = iter(raws)
            statuses: list[int] = []

            async def worker() -> None:
                conn = _Connection(host, port)
                for raw in pending:
                    statuses.append(await conn.request(raw))
                conn.close()

            await asyncio.gather(*(worker() for _ in range(self.connections)))
            return statuses

        t0 = time.perf_counter()
        statuses = asyncio.run(run())
        elapsed = time.perf_counter() - t0
        refused = [s for s in statuses if s != 202]
        if refused:
            raise RuntimeError(f"{len(refused)} POST /jobs refused, e.g. {refused[0]}")
        return elapsed

    def clear(self) -> None:
        """Cancel every queued job and empty the Redis lists (between submission rounds)."""
        with self.client.sessions.begin() as s:
            s.execute(
                text("UPDATE jobs SET status = 'cancelled', finished_at = now() WHERE status = 'queued'")
            )
            s.execute(text("UPDATE batches SET status = 'cancelling' WHERE status = 'in_progress'"))
        self.client.redis.delete(*(queue_key(self.stack.settings, QUEUE, p) for p in PRIORITIES))

    def submission_round(self, wait_quiet: float, baseline: int | None) -> dict:
        waited = wait_for_quiet(wait_quiet) if wait_quiet else 0.0
        load = os.getloadavg()[0]
        before = self.client.depth()
        batch_id, upload_s, create_s = self.submit_batch()
        queued = self.client.depth() - before
        batch_s = upload_s + create_s
        self.clear()
        n, m = len(self.convs), min(baseline or len(self.convs), len(self.convs))
        jobs_s = self.submit_jobs(m) * n / m  # at the rate measured on the first m
        queued_jobs = self.client.depth()
        self.clear()
        return {
            "waited_for_quiet_s": waited,
            "load_average_before": load,
            "batch_upload_s": upload_s,
            "batch_create_s": create_s,
            "batch_s": batch_s,
            "batch_jobs_per_s": n / batch_s,
            "batch_in_redis": queued,
            "jobs_s": jobs_s,
            "jobs_jobs_per_s": n / jobs_s,
            "jobs_in_redis": queued_jobs,
            "jobs_timed": m,
            "speedup": jobs_s / batch_s,
        }

    def end_to_end(self) -> dict:
        t0 = time.perf_counter()
        batch_id, _, _ = self.submit_batch()
        while (status := self.http.get(f"{self.stack.url}/v1/batches/{batch_id}", timeout=600).json())[
            "status"
        ] not in ("completed", "failed", "cancelled"):
            time.sleep(0.5)
        batch_s = time.perf_counter() - t0
        if status["request_counts"]["completed"] != len(self.convs):
            raise RuntimeError(f"batch ended {status['status']}: {status['request_counts']}")
        t0 = time.perf_counter()
        self.submit_jobs()
        while self.client.active():
            time.sleep(0.5)
        jobs_s = time.perf_counter() - t0
        return {"batch_s": batch_s, "jobs_s": jobs_s, "ratio": jobs_s / batch_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=10_000)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=1, help="submission rounds; the median is reported")
    parser.add_argument("--connections", type=int, default=16, help="POST /jobs connections at once")
    parser.add_argument(
        "--baseline-requests",
        type=int,
        help="submission rounds: time POST /jobs on the first N requests only (its rate is steady; default all)",
    )
    parser.add_argument("--skip-e2e", action="store_true", help="submission rate only")
    parser.add_argument(
        "--wait-quiet",
        type=float,
        default=0,
        help="before each batch submission, wait up to this many seconds for other processes to go quiet",
    )
    parser.add_argument("--quick", action="store_true", help="2,000 requests, submission only")
    args = parser.parse_args()
    n = 2000 if args.quick else args.requests
    run = run_info()
    print(f"{run['machine']}; load average {run['load_avg'][0]:.2f}; {n} requests")
    result: dict = {"requests": n, "max_tokens": args.max_tokens, "rounds": []}
    with local_stack(bench_settings(), log_dir=OUT / "bulk-logs") as stack:
        bench = Bench(stack, conversations(n), args.max_tokens, args.connections)
        stack.pause_intake()
        for i in range(args.repeat):
            row = bench.submission_round(args.wait_quiet, args.baseline_requests)
            result["rounds"].append(row)
            print(
                f"round {i + 1}: batch {row['batch_s']:.2f} s (upload {row['batch_upload_s']:.2f} + create "
                f"{row['batch_create_s']:.2f}) = {row['batch_jobs_per_s']:.0f} jobs/s, {row['batch_in_redis']} "
                f"in Redis; POST /jobs {row['jobs_s']:.2f} s = {row['jobs_jobs_per_s']:.0f} jobs/s; "
                f"batch {row['speedup']:.1f}x faster (load average {row['load_average_before']:.1f} "
                f"after waiting {row['waited_for_quiet_s']:.0f} s for quiet)"
            )
        median = pct((r["batch_jobs_per_s"] for r in result["rounds"]), 50)
        result["batch_jobs_per_s_median"] = median
        result["jobs_jobs_per_s_median"] = pct((r["jobs_jobs_per_s"] for r in result["rounds"]), 50)
        result["speedup_median"] = pct((r["speedup"] for r in result["rounds"]), 50)
        print(
            f"batch submission: median {median:.0f} jobs/s (target >= {TARGET_JOBS_PER_S}: "
            f"{'met' if median >= TARGET_JOBS_PER_S else 'NOT met'}); "
            f"{result['speedup_median']:.1f}x POST /jobs"
        )
        if not (args.skip_e2e or args.quick):
            stack.resume_intake()
            row = result["end_to_end"] = bench.end_to_end()
            print(
                f"end to end: batch {row['batch_s']:.1f} s, POST /jobs {row['jobs_s']:.1f} s "
                f"({row['ratio']:.2f}x the batch's time)"
            )
    rows = [
        [
            "batch, upload to all queued (median of rounds)",
            f"**{result['batch_jobs_per_s_median']:.0f} jobs/s**",
            f"POST /jobs {result['jobs_jobs_per_s_median']:.0f} jobs/s ({result['speedup_median']:.1f}x)",
            f">= {TARGET_JOBS_PER_S} jobs/s: {'met' if median >= TARGET_JOBS_PER_S else 'not met'}",
        ]
    ]
    if "end_to_end" in result:
        e2e = result["end_to_end"]
        rows.append(
            [
                "end to end, first byte to the batch completed",
                f"**{e2e['batch_s']:.1f} s**",
                f"POST /jobs {e2e['jobs_s']:.1f} s ({e2e['ratio']:.2f}x)",
                "none",
            ]
        )
    table = markdown_table(["measure", "figure", "baseline, same run", "target"], rows)
    write_result("bulk_submit", result, table, run=run)


if __name__ == "__main__":
    main()
