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

    .venv/bin/python bench/batch_client.py --jobs 2000
    .venv/bin/python bench/batch_client.py --rounds 4          # the verdict: 10,000 jobs, alternating
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import requests

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.bulk_submit import batch_file, conversations  # noqa: E402
from bench.harness import markdown_table, run_info, write_result  # noqa: E402
from bench.stack import bench_settings, local_stack  # noqa: E402

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


def run_client(url: str, key: str, convs: list, max_tokens: int, workdir: Path) -> dict:
    """genq-batch on the same requests: its wall time, and the calls it reports."""
    lines = [
        {"custom_id": f"r{i}", "messages": c, "max_tokens": max_tokens, "temperature": 0, "priority": 8}
        for i, c in enumerate(convs)
    ]
    (workdir / "in.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    command = [sys.executable, "-m", "batchclient", "submit", str(workdir / "in.jsonl"), "--url", url]
    command += ["--key", key, "--out", str(workdir / "out.jsonl"), "--no-progress"]
    t0 = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, timeout=3600)
    elapsed = time.perf_counter() - t0
    if done.returncode != 0:
        raise RuntimeError(f"genq-batch failed: {done.stderr[-3000:]}")
    rows = [json.loads(line) for line in (workdir / "out.jsonl").read_text().splitlines()]
    if len(rows) != len(lines) or any(row["status"] != "succeeded" for row in rows):
        raise RuntimeError(f"genq-batch: {len(rows)} rows, not all succeeded: {done.stderr[-2000:]}")
    calls = re.search(r"(\d+) POST and (\d+) GET calls, (\d+) answered 429", done.stderr)
    posts, gets, throttled = (int(x) for x in calls.groups())
    return {"client_s": elapsed, "posts": posts, "gets": gets, "answered_429": throttled}


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
        for i in range(args.rounds):
            client_first = args.client_first != (i % 2 == 1)
            order = ("client", "batch") if client_first else ("batch", "client")
            for run_now in order:
                if run_now == "batch":
                    batch_s = run_batch_api(stack.url, stack.headers, batch_file(convs, args.max_tokens), n)
                    print(f"round {i + 1}: Batch API: {batch_s:.1f} s")
                else:
                    with tempfile.TemporaryDirectory() as workdir:
                        result = run_client(stack.url, key, convs, args.max_tokens, Path(workdir))
                    print(f"round {i + 1}: genq-batch: {result['client_s']:.1f} s")
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
