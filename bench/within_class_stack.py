"""Scheduling within a priority class through the whole stack (issue 44): API, worker, Postgres and Redis, the
same jobs under SCHEDULING_POLICY=fcfs and =predicted in one run.

bench/within_class.py measures the engine alone; here the jobs go through `POST /jobs`, wait in Redis (the worker
holds max_num_seqs + its reserve; the rest wait in its queue, where the intake's window orders them:
workers/queue_order.py) and in the engine, and end by themselves. Workload (seeded), as within_class.py's:

- One priority. Tenants "chat" (2% long), "agent" (15% long), "writer" (50% long) send 60% / 30% / 10% of the
  jobs; short jobs make 16-64 tokens, long ones 1,000-2,000.
- Every job asks max_tokens 2,000, greedy, and stops at its end of sequence: its prompt is one whose greedy
  output on the model ends there, found beforehand with the engine alone (random token-id prompts of 8-32,
  generated once; cached in bench/out/within_class_prompts.json). The predictor never sees the length: only
  the tenant's history, 32 jobs drawn from its mix, written into the database before the run as jobs that
  ended an hour before.
- A share of the jobs (`--deadline-share`) carry a deadline: sent + 3x the time the job takes alone + a second.
- Arrivals: Poisson at `--load` x the worker's capacity (output tokens per second of a full batch, measured by a
  pilot of max_num_seqs long jobs through the stack) / the workload's mean length: by default a burst at 1.5x
  what the worker can do, then the queue drains.

Each pass is a fresh stack (its own database and Redis keys) with one worker; passes alternate
fcfs, predicted, predicted, fcfs (`--passes 2`). A job's latency is its row's finished_at - created_at; throughput
is the output tokens over the first creation to the last finish. Every job's output length is checked against
the engine alone (greedy: the same whatever the order). The policy's times are the defaults (cost 0.02 s a token,
aging 30 s), as a deployment runs them. Prints per policy: mean, p50, p99, throughput, deadlines met, the machine's
CPU others used; then predicted / fcfs ratios against the issue's targets (mean <= 0.6x, p99 <= 1.2x,
throughput >= 0.97x).

    .venv/bin/python bench/within_class_stack.py           # about 5 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import requests  # noqa: E402
from sqlalchemy import text as sql  # noqa: E402

from bench.harness import (  # noqa: E402
    OUT,
    Interference,
    pct,
    run_info,
    tree_cpu_seconds,
    wait_for_quiet,
    write_result,
)
from bench.stack import bench_settings, local_stack  # noqa: E402
from bench.within_class import policy_ratios, ratio_rows  # noqa: E402
from jobstore.output_length import RECENT_JOBS  # noqa: E402

MAX_TOKENS = 2000
TENANTS = {"chat": (0.6, 0.02), "agent": (0.3, 0.15), "writer": (0.1, 0.5)}  # share of jobs, share long
SHORT, LONG = (16, 64), (1000, 2000)


@dataclass
class Job:
    tenant: str
    arrival: float  # seconds after the pass starts
    prompt: list[int]
    length: int  # its greedy output's length (it ends there)
    deadline: float | None  # seconds after its send


def find_prompts(args) -> dict[str, list[tuple[list[int], int]]]:
    """Prompts whose greedy output ends after SHORT and LONG tokens: (prompt, output length) of each class."""
    cache = OUT / "within_class_prompts.json"
    key = f"{args.model}:{args.seed}"
    if cache.exists() and key in (saved := json.loads(cache.read_text())):
        return saved[key]
    from batching import Engine, EngineConfig, SamplingParams

    engine = Engine(EngineConfig(model=args.model, dtype="float32", device="cpu", max_num_seqs=64))
    rng = random.Random(args.seed)
    found: dict[str, list[tuple[list[int], int]]] = {"short": [], "long": []}
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0)
    for round_ in range(40):
        prompts = [[rng.randrange(3, 259) for _ in range(rng.randint(8, 32))] for _ in range(64)]
        for prompt, out in zip(prompts, engine.generate(prompts, params), strict=True):
            n = len(out.token_ids)
            if out.finish_reason == "stop" and SHORT[0] <= n <= SHORT[1]:
                found["short"].append((prompt, n))
            elif out.finish_reason == "stop" and LONG[0] <= n <= LONG[1]:
                found["long"].append((prompt, n))
        print(f"prompt search, round {round_ + 1}: {len(found['short'])} short, {len(found['long'])} long")
        if len(found["short"]) >= args.prompts and len(found["long"]) >= args.prompts // 4:
            break
    if not found["short"] or not found["long"]:
        raise SystemExit(f"no prompts end in {SHORT} and {LONG} tokens on {args.model}: {found}")
    saved = json.loads(cache.read_text()) if cache.exists() else {}
    saved[key] = found
    cache.parent.mkdir(parents=True, exist_ok=True)
    cache.write_text(json.dumps(saved))
    return found


def workload(args, prompts, rate: float, step_seconds: float) -> list[Job]:
    rng = random.Random(args.seed + 1)
    names, weights = list(TENANTS), [share for share, _ in TENANTS.values()]
    jobs, now = [], 0.0
    for _ in range(args.jobs):
        now += rng.expovariate(rate)
        tenant = rng.choices(names, weights)[0]
        prompt, length = rng.choice(prompts["long" if rng.random() < TENANTS[tenant][1] else "short"])
        deadline = 3 * length * step_seconds + 1.0 if rng.random() < args.deadline_share else None
        jobs.append(Job(tenant, now, prompt, length, deadline))
    return jobs


def history(seed: int) -> dict[str, list[int]]:
    """Each tenant's past: RECENT_JOBS output lengths drawn from its mix."""
    rng = random.Random(seed + 2)

    def length(long_share: float) -> int:
        return rng.randint(*LONG) if rng.random() < long_share else rng.randint(*SHORT)

    return {t: [length(long) for _ in range(RECENT_JOBS)] for t, (_, long) in TENANTS.items()}


def tenant_keys(stack, past: dict[str, list[int]]) -> dict[str, str]:
    """A key per tenant, and its history written as jobs that succeeded an hour ago."""
    from jobstore.jobs import create_job
    from jobstore.keys import create_key, tenant_for_key

    keys = {}
    ago = datetime.now(timezone.utc) - timedelta(hours=1)
    with stack.client.sessions.begin() as s:
        for tenant, lengths in past.items():
            keys[tenant] = create_key(s, tenant)
            tenant_id = tenant_for_key(s, keys[tenant]).id
            for i, n in enumerate(lengths):
                request = dict(
                    prompt="past", input_ids=None, max_tokens=MAX_TOKENS, temperature=0.0, top_p=1.0, top_k=0,
                    seed=None, stop=[], priority=5, metadata={},
                )  # fmt: skip
                job, _ = create_job(s, tenant_id, request, prompt_tokens=4)
                s.execute(
                    sql(
                        "UPDATE jobs SET status = 'succeeded', created_at = :at, finished_at = :at, "
                        "output_token_ids = array_fill(7, ARRAY[:n]) WHERE id = :id"
                    ),
                    dict(at=ago + timedelta(seconds=i), n=n, id=job.id),
                )
    return keys


def body(job: Job, sent: datetime) -> dict:
    out = {"input_ids": job.prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0, "priority": 5}
    if job.deadline is not None:
        out["deadline"] = (sent + timedelta(seconds=job.deadline)).isoformat()
    return out


def send_all(stack, keys: dict[str, str], jobs: list[Job]) -> list[tuple[str, datetime | None]]:
    """Each job sent at its arrival (open loop): (job id, its deadline) in the order of `jobs`. A connection the
    API reset (a keep-alive it closed as the client reused it) is sent again, with the same Idempotency-Key."""
    local, run = threading.local(), uuid.uuid4().hex[:8]

    def send(index: int) -> tuple[str, datetime | None]:
        job = jobs[index]
        time.sleep(max(0.0, start + job.arrival - time.monotonic()))
        sent = datetime.now(timezone.utc)
        payload = body(job, sent)
        headers = {"Authorization": f"Bearer {keys[job.tenant]}", "Idempotency-Key": f"{run}-{index}"}
        for attempt in range(3):
            http = getattr(local, "http", None) or requests.Session()
            local.http = http
            try:
                r = http.post(stack.url + "/jobs", json=payload, headers=headers, timeout=30)
                break
            except requests.ConnectionError:
                local.http = None
                if attempt == 2:
                    raise
        if r.status_code != 202:
            raise RuntimeError(f"POST /jobs answered {r.status_code}: {r.text}")
        deadline = payload.get("deadline")
        return r.json()["id"], None if deadline is None else datetime.fromisoformat(deadline)

    start = time.monotonic()
    with ThreadPoolExecutor(16) as pool:
        return list(pool.map(send, range(len(jobs))))


def pilot(args, prompts) -> tuple[float, float]:
    """(output tokens per second, seconds per step) of a worker kept full: max_num_seqs long jobs together."""
    settings = bench_settings(max_num_seqs=args.max_num_seqs, engine_threads=args.threads)
    longs = [prompts["long"][i % len(prompts["long"])] for i in range(args.max_num_seqs)]
    with local_stack(settings, log_dir=OUT / "logs" / "within_class_stack") as stack:
        ids = stack.client.submit_all(
            [{"input_ids": p, "max_tokens": MAX_TOKENS, "temperature": 0.0} for p, _ in longs]
        )
        rows = stack.client.wait(ids)
    span = (max(r["finished_at"] for r in rows) - min(r["created_at"] for r in rows)).total_seconds()
    rate = sum(r["tokens"] for r in rows) / span
    return rate, args.max_num_seqs / rate


def one_pass(args, policy: str, jobs: list[Job], past: dict[str, list[int]]) -> dict:
    settings = bench_settings(
        max_num_seqs=args.max_num_seqs, engine_threads=args.threads, scheduling_policy=policy
    )
    with local_stack(settings, log_dir=OUT / "logs" / "within_class_stack") as stack:
        keys = tenant_keys(stack, past)
        own = lambda: sum(filter(None, (tree_cpu_seconds(w.pid) for w in stack.workers)))  # noqa: E731
        with Interference(own) as load:
            sent = send_all(stack, keys, jobs)
            rows = stack.client.wait([job_id for job_id, _ in sent])
    wrong = [(j.length, r["tokens"]) for j, r in zip(jobs, rows, strict=True) if r["tokens"] != j.length]
    if wrong or any(r["status"].value != "succeeded" for r in rows):
        raise SystemExit(f"{policy}: jobs ended otherwise than alone (length expected, made): {wrong[:10]}")
    latencies = [(r["finished_at"] - r["created_at"]).total_seconds() for r in rows]
    span = (max(r["finished_at"] for r in rows) - min(r["created_at"] for r in rows)).total_seconds()
    met = [r["finished_at"] <= deadline for (_, deadline), r in zip(sent, rows, strict=True) if deadline]
    return {
        "policy": policy,
        "latencies": latencies,
        "tokens": sum(r["tokens"] for r in rows),
        "span_s": span,
        "met": met,
        "handbacks": sum(r["handbacks"] for r in rows),
        "others_cpu_share": load.share,
    }


def figures(passes: list[dict]) -> dict:
    lat = [x for p in passes for x in p["latencies"]]
    met = [x for p in passes for x in p["met"]]
    shares = [p["others_cpu_share"] for p in passes if p["others_cpu_share"] is not None]
    return {
        "mean_latency_s": sum(lat) / len(lat),
        "p50_latency_s": pct(lat, 50),
        "p99_latency_s": pct(lat, 99),
        "throughput_tok_s": sum(p["tokens"] for p in passes) / sum(p["span_s"] for p in passes),
        "deadlines_met": sum(met) / len(met) if met else None,
        "num_deadlines": len(met),
        "others_cpu_share": max(shares) if shares else None,
        "per_pass_mean_s": [sum(p["latencies"]) / len(p["latencies"]) for p in passes],
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--jobs", type=int, default=80)
    parser.add_argument(
        "--passes", type=int, default=2, help="passes per policy: fcfs predicted, predicted fcfs"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--load", type=float, default=1.5)
    parser.add_argument("--max-num-seqs", type=int, default=8)
    parser.add_argument("--deadline-share", type=float, default=0.3)
    parser.add_argument("--model", default="tiny-llama")
    parser.add_argument("--threads", type=int, default=1, help="the worker's engine threads (ENGINE_THREADS)")
    parser.add_argument(
        "--prompts", type=int, default=24, help="short prompts to find (a quarter as many long)"
    )
    parser.add_argument("--wait-quiet", type=float, default=0.0)
    args = parser.parse_args()
    info = run_info()
    prompts = find_prompts(args)
    capacity, step_seconds = pilot(args, prompts)
    past = history(args.seed)
    mean = {kind: sum(n for _, n in found) / len(found) for kind, found in prompts.items()}
    mix_mean = sum(
        share * (long * mean["long"] + (1 - long) * mean["short"]) for share, long in TENANTS.values()
    )
    rate = args.load * capacity / mix_mean
    jobs = workload(args, prompts, rate, step_seconds)
    print(
        f"capacity {capacity:.0f} tokens/s (a step {step_seconds * 1000:.1f} ms with {args.max_num_seqs} "
        f"sequences); {len(jobs)} jobs at {rate:.2f}/s over {jobs[-1].arrival:.0f} s, "
        f"{sum(j.length >= LONG[0] for j in jobs)} long, {sum(j.deadline is not None for j in jobs)} with deadlines"
    )
    passes: dict[str, list[dict]] = {"fcfs": [], "predicted": []}
    order = [("fcfs", "predicted") if i % 2 == 0 else ("predicted", "fcfs") for i in range(args.passes)]
    for policy in [p for pair in order for p in pair]:
        wait_for_quiet(args.wait_quiet)
        result = one_pass(args, policy, jobs, past)
        print(f"{policy}: mean {sum(result['latencies']) / len(result['latencies']):.2f} s")
        passes[policy].append(result)
    results = {policy: figures(runs) for policy, runs in passes.items()}
    fcfs, predicted = results["fcfs"], results["predicted"]
    ratios = policy_ratios(fcfs, predicted)
    rows = [
        "| policy | mean latency s (per pass) | p50 s | p99 s | throughput tok/s | deadlines met | others' CPU |",
        "|---|---|---|---|---|---|---|",
    ]
    for policy, f in results.items():
        met = f"{f['deadlines_met']:.0%} of {f['num_deadlines']}" if f["deadlines_met"] is not None else "-"
        others = f"{f['others_cpu_share']:.0%}" if f["others_cpu_share"] is not None else "?"
        each = ", ".join(f"{m:.1f}" for m in f["per_pass_mean_s"])
        rows.append(
            f"| {policy} | {f['mean_latency_s']:.2f} ({each}) | {f['p50_latency_s']:.2f} | {f['p99_latency_s']:.2f} "
            f"| {f['throughput_tok_s']:.0f} | {met} | {others} |"
        )
    rows += ratio_rows(ratios)
    write_result(
        "within_class_stack",
        {
            "capacity_tok_s": capacity,
            "step_seconds": step_seconds,
            "rate": rate,
            "figures": results,
            "ratios": ratios,
            "args": vars(args),
        },
        "\n".join(rows),
        run=info,
    )


if __name__ == "__main__":
    main()
