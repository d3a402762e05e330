"""Urgent-first and a fed batch through the whole stack (issue 11): HTTP, Redis, the worker(s), Postgres.

Each section runs a fresh stack (bench/stack.py: its own database and Redis keys, gunicorn, real
Celery workers) and compares it with a baseline measured in the same run:

1. Urgent TTFT under a backlog. Default settings (MAX_NUM_SEQS unset: the engine's 256, so a worker holds
   288 jobs). Idle:
   priority-0 jobs one at a time on the empty stack. Backlog: `--backlog-factor` (10) + 3 times what the
   workers hold in priority-9 jobs (so that >= 10x still waits in Redis once the workers are full), then the same priority-0 jobs one at a time while the backlog waits
   in Redis. TTFT as the client sees it: from sending POST /jobs to the first token on the job's event
   stream (`Stack.run_job`; the job rows' created_at -> first_token_at is reported beside it). Target:
   backlog p99 <= 2x idle p99 + 100 ms. The priority-9 depth in Redis at each urgent arrival is recorded: it shows the backlog
   was really there.
2. Tokens/s of the stack against the engine alone on the same jobs and settings, at batch widths
   (MAX_NUM_SEQS) 32, 128 and 256: 2x width jobs per worker wait in Redis (submitted while the workers'
   consumers are cancelled, so the API's cost is not counted: bench/e2e.py measures it), then the
   workers take them; the engine alone (batching.Engine in this process, the same EngineConfig and the
   same torch threads as the worker's engine process: ENGINE_THREADS, cores - 1 by default) gets the
   same jobs at once and generates, for each, as many tokens as the stack did (`ignore_eos`). Stack
   tokens/s = tokens / (consumers added -> last finished_at). Target: >= 0.9x at every width. Also
   printed: the stack against the engine alone on every core (what the machine could do with no
   stack around the engine).
3. Both again with two workers (each its own engine process, with `--threads-per-worker` torch
   threads), against one engine alone on every core.
4. An idle stack's latency of short jobs (32 tokens), one at a time, as the client sees it (POST /jobs
   sent -> the result event), and the first job after the worker started (its row's created_at ->
   finished_at). Target: max <= 3x p50.

    .venv/bin/python bench/backlog.py --quick      # smoke run, ~3 min
    .venv/bin/python bench/backlog.py              # full run, ~15 min on 2 cores; copies the plot to bench/

JSON goes to bench/out/backlog.json (its headline table to backlog.md), the plot to bench/out/backlog.png
(and bench/backlog.png).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import random
import shutil
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import requests
from sqlalchemy import select

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from batching.config import EngineConfig  # noqa: E402
from bench.harness import markdown_table, pct, run_info, write_result  # noqa: E402
from bench.stack import bench_settings, local_stack  # noqa: E402
from jobstore.models import Job, JobStatus  # noqa: E402

OUT = Path(__file__).resolve().parent / "out"
WORDS = "the tea cat sky mud river stone light song road".split()
CORES = len(os.sched_getaffinity(0))


def engine_default(name: str):
    """An EngineConfig field's default: what the worker's engine takes when the setting is unset."""
    return next(f.default for f in dataclasses.fields(EngineConfig) if f.name == name)


def prompt(rng: random.Random, tag: str) -> str:
    return f"{tag}: " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 40)))


def seconds(a, b) -> float:
    """Seconds from a to b: datetimes, or ISO strings as the API gives them."""
    if isinstance(a, str):
        a, b = datetime.fromisoformat(a), datetime.fromisoformat(b)
    return (b - a).total_seconds()


# --- 1. urgent TTFT, idle and under a backlog -----------------------------------------------------------


def urgent_ttft(workers: int, n_urgent: int, backlog_factor: int, worker_env: dict, seed: int = 11) -> dict:
    rng = random.Random(seed)
    settings = bench_settings()  # defaults: MAX_NUM_SEQS and WORKER_RESERVE unset
    capacity = settings.worker_capacity(settings.max_num_seqs or engine_default("max_num_seqs")) * workers

    def urgent_body(i: int) -> dict:
        return {"prompt": prompt(rng, f"urgent {i}"), "max_tokens": 8, "priority": 0, "temperature": 0.0}

    with local_stack(settings, workers=workers, worker_env=worker_env, log_dir=OUT / "backlog-logs") as stack:
        client = stack.client
        session = requests.Session()
        idle = []
        for i in range(n_urgent):
            idle.append(stack.run_job(urgent_body(i), session))
            time.sleep(0.05)
        bodies = [
            {"prompt": prompt(rng, f"backlog {i}"), "max_tokens": 1024, "priority": 9, "temperature": 0.0}
            for i in range((backlog_factor + 3) * capacity)
        ]  # the workers take `capacity` of them
        started = time.monotonic()
        backlog = client.submit_all(bodies)
        print(f"  {len(backlog)} priority-9 jobs submitted in {time.monotonic() - started:.1f}s")
        client.wait_held(capacity)
        loaded, depths = [], []
        for i in range(n_urgent):
            depths.append(client.depth(9))
            loaded.append(stack.run_job(urgent_body(n_urgent + i), session))
            time.sleep(0.05)
        backlog_rows = client.rows(backlog)
        client.cancel_all(backlog)
    idle_ttft = [s.first_token_s for s in idle]
    loaded_ttft = [s.first_token_s for s in loaded]
    if None in idle_ttft + loaded_ttft:
        raise RuntimeError("an urgent job ended without a token")
    loaded_rows = [seconds(s.job["created_at"], s.job["first_token_at"]) for s in loaded]
    bound = 2 * pct(idle_ttft, 99) + 0.1
    return {
        "workers": workers,
        "capacity": capacity,
        "backlog_jobs": len(backlog),
        "idle_ttft_s": idle_ttft,
        "backlog_ttft_s": loaded_ttft,
        "idle_p50_s": pct(idle_ttft, 50),
        "idle_p99_s": pct(idle_ttft, 99),
        "backlog_p50_s": pct(loaded_ttft, 50),
        "backlog_p99_s": pct(loaded_ttft, 99),
        "backlog_job_row_p50_s": pct(loaded_rows, 50),
        "backlog_job_row_p99_s": pct(loaded_rows, 99),
        "bound_s": bound,
        "met": pct(loaded_ttft, 99) <= bound,
        "redis_depth_at_arrival": depths,
        "min_depth_over_capacity": min(depths) / capacity,
        "handbacks": sum(r["handbacks"] for r in backlog_rows),
    }


# --- 2. tokens/s: the stack against the engine alone ------------------------------------------------------


def stack_throughput(
    width: int, workers: int, worker_env: dict, tokens: int, concurrency: int = 8, seed: int = 5
) -> dict:
    rng = random.Random(seed + width)
    settings = bench_settings(max_num_seqs=width)
    bodies = [
        {"prompt": prompt(rng, f"job {i}"), "max_tokens": tokens, "priority": 5, "temperature": 0.0}
        for i in range(2 * width * workers)
    ]
    with local_stack(
        settings,
        workers=workers,
        worker_env=worker_env,
        concurrency=concurrency,
        log_dir=OUT / "backlog-logs",
    ) as stack:
        client = stack.client
        stack.pause_intake()
        ids = client.submit_all(bodies)
        started = datetime.now(timezone.utc)
        stack.resume_intake()
        rows = client.wait(ids, poll=0.2)
    made = sum(r["tokens"] for r in rows)
    span = seconds(started, max(r["finished_at"] for r in rows))
    return {
        "settings": settings,
        "bodies": bodies,
        "lengths": [r["tokens"] for r in rows],
        "tokens": made,
        "seconds": span,
        "tokens_per_s": made / span,
        "failed": sum(r["status"] != JobStatus.SUCCEEDED for r in rows),
    }


def engine_throughput(settings, bodies: list[dict], lengths: list[int], threads: int) -> dict:
    """The same jobs into one Engine with the worker's EngineConfig and `threads` torch threads, all at once,
    each to its stack length."""
    import torch

    from batching import Engine, EngineConfig, SamplingParams

    torch.set_num_threads(threads)
    engine = Engine(EngineConfig(**settings.engine_options()))
    started = time.perf_counter()
    for i, (body, n) in enumerate(zip(bodies, lengths)):
        engine.add_request(
            str(i),
            body["prompt"],
            SamplingParams(max_tokens=max(n, 1), temperature=0.0, ignore_eos=True),
            priority=body["priority"],
        )
    made = 0
    while engine.has_unfinished_requests():
        made += sum(len(out.token_ids) for out in engine.step() if out.finished)
    span = time.perf_counter() - started
    del engine
    return {"tokens": made, "seconds": span, "tokens_per_s": made / span, "threads": threads}


def worker_threads(settings, worker_env: dict) -> int:
    """The torch threads of a worker's engine process (workers/engine_host.py, Settings.engine_thread_count)."""
    if worker_env.get("OMP_NUM_THREADS"):
        return int(worker_env["OMP_NUM_THREADS"])
    return settings.engine_threads or max(1, CORES - 1)


def throughput(width: int, workers: int, worker_env: dict, tokens: int, concurrency: int = 8) -> dict:
    """The stack with `workers` workers against one engine alone on the same jobs, twice: with the settings of
    a worker's engine (its torch threads: cores - 1 by default) and on the whole machine (every core). With
    two workers, both baselines are one engine: what they do together against what one engine does."""
    system = stack_throughput(width, workers, worker_env, tokens, concurrency)
    same_threads = worker_threads(system["settings"], worker_env) if workers == 1 else CORES
    same = engine_throughput(system["settings"], system["bodies"], system["lengths"], same_threads)
    whole = (
        same
        if same_threads == CORES
        else engine_throughput(system["settings"], system["bodies"], system["lengths"], CORES)
    )
    return {
        "width": width,
        "workers": workers,
        "jobs": len(system["bodies"]),
        "tokens": system["tokens"],
        "failed": system["failed"],
        "stack_tokens_per_s": system["tokens_per_s"],
        "engine_threads": same_threads,
        "engine_tokens_per_s": same["tokens_per_s"],
        "ratio": system["tokens_per_s"] / same["tokens_per_s"],
        "engine_all_cores_tokens_per_s": whole["tokens_per_s"],
        "ratio_all_cores": system["tokens_per_s"] / whole["tokens_per_s"],
        "met": system["tokens_per_s"] >= 0.9 * same["tokens_per_s"],
    }


# --- 4. an idle stack's short jobs ------------------------------------------------------------------------


def idle_latency(n: int, seed: int = 3) -> dict:
    rng = random.Random(seed)
    with local_stack(bench_settings(), log_dir=OUT / "backlog-logs") as stack:
        client = stack.client
        with client.sessions() as s:  # bench/stack.py's warm-up job: the first after the worker started
            first = s.execute(select(Job.created_at, Job.finished_at).order_by(Job.created_at).limit(1)).one()
        session, latency = requests.Session(), []
        for i in range(n):
            body = {"prompt": prompt(rng, f"short {i}"), "max_tokens": 32, "priority": 5, "temperature": 0.0}
            latency.append(stack.run_job(body, session).latency_s)
            time.sleep(0.1)
    p50 = pct(latency, 50)
    return {
        "latency_s": latency,
        "p50_s": p50,
        "p99_s": pct(latency, 99),
        "max_s": max(latency),
        "max_over_p50": max(latency) / p50,
        "met": max(latency) <= 3 * p50,
        "first_job_s": seconds(first.created_at, first.finished_at),
    }


# --- report -----------------------------------------------------------------------------------------------


def headline(result: dict) -> str:
    """The figures bench/RESULTS.md keeps, one markdown table per section that ran."""
    tables = []
    if result["urgent"]:
        tables.append(
            markdown_table(
                ["workers", "idle p50 / p99", "under the backlog p50 / p99", "target p99", "met"],
                [
                    [
                        r["workers"],
                        f"{1000 * r['idle_p50_s']:.0f} / {1000 * r['idle_p99_s']:.0f} ms",
                        f"{1000 * r['backlog_p50_s']:.0f} / **{1000 * r['backlog_p99_s']:.0f} ms**",
                        f"<= {1000 * r['bound_s']:.0f} ms",
                        "met" if r["met"] else "not met",
                    ]
                    for r in result["urgent"]
                ],
            )
        )
    if result["throughput"]:
        tables.append(
            markdown_table(
                ["width", "workers", "stack / engine alone, same threads", "stack / engine on every core"],
                [
                    [r["width"], r["workers"], f"**{r['ratio']:.2f}x**", f"{r['ratio_all_cores']:.2f}x"]
                    for r in result["throughput"]
                ],
            )
        )
    if "idle" in result:
        r = result["idle"]
        tables.append(
            markdown_table(
                ["idle short jobs p50", "max", "max / p50 (<= 3x)", "first job after start"],
                [
                    [
                        f"{1000 * r['p50_s']:.0f} ms",
                        f"{1000 * r['max_s']:.0f} ms",
                        f"{r['max_over_p50']:.2f}x ({'met' if r['met'] else 'not met'})",
                        f"{1000 * r['first_job_s']:.0f} ms",
                    ]
                ],
            )
        )
    return "\n\n".join(tables)


def plot(result: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
    ax = axes[0]
    labels, data = [], []
    for row in result["urgent"]:
        labels += [
            f"idle\n{row['workers']} worker(s)",
            f"backlog {row['backlog_jobs']}\n{row['workers']} worker(s)",
        ]
        data += [[1000 * t for t in row["idle_ttft_s"]], [1000 * t for t in row["backlog_ttft_s"]]]
    ax.boxplot(data, whis=(0, 100))
    ax.set_xticks(range(1, len(labels) + 1), labels)
    for i, row in enumerate(result["urgent"]):
        ax.hlines(
            1000 * row["bound_s"],
            2 * i + 1.6,
            2 * i + 2.4,
            colors="r",
            linestyles="--",
            label="target: 2x idle p99 + 100 ms" if i == 0 else None,
        )
    ax.set_ylabel("priority-0 TTFT (ms)")
    ax.set_title("urgent TTFT: idle vs a backlog >= 10x what the workers hold")
    ax.legend(fontsize=8, loc="upper left")

    ax = axes[1]
    rows = result["throughput"]
    groups = sorted({r["workers"] for r in rows})
    widths = sorted({r["width"] for r in rows})
    bars = [(workers, key) for workers in groups for key in ("ratio", "ratio_all_cores")]
    bar = 0.8 / len(bars)
    for g, (workers, key) in enumerate(bars):
        ratios = [
            next((r[key] for r in rows if r["width"] == w and r["workers"] == workers), 0) for w in widths
        ]
        against = "its engine's threads" if key == "ratio" and workers == 1 else "all cores"
        if key == "ratio_all_cores" and workers > 1:
            continue  # with two workers both baselines are one engine on every core
        ax.bar(
            [i + g * bar for i in range(len(widths))],
            ratios,
            bar,
            label=f"{workers} worker(s) / engine alone, {against}",
            alpha=1.0 if key == "ratio" else 0.45,
        )
    ax.axhline(0.9, color="r", ls="--", label="target 0.9x")
    ax.set_xticks([i + bar * (len(bars) - 1) / 2 for i in range(len(widths))], [str(w) for w in widths])
    ax.set_xlabel("batch width (MAX_NUM_SEQS)")
    ax.set_ylabel("stack tokens/s / engine alone")
    ax.set_title("a wide batch kept fed")
    ax.legend(fontsize=8)

    ax = axes[2]
    idle = result["idle"]
    ax.plot([1000 * t for t in idle["latency_s"]], "o-", ms=3, label="32-token job, created -> finished")
    ax.axhline(1000 * idle["p50_s"], color="k", lw=0.8, label="p50")
    ax.axhline(3000 * idle["p50_s"], color="r", ls="--", label="target max: 3x p50")
    ax.set_xlabel("job (one at a time)")
    ax.set_ylabel("latency (ms)")
    ax.set_ylim(bottom=0)
    ax.set_title(f"idle stack (first job after start: {1000 * idle['first_job_s']:.0f} ms)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: width 32 only, fewer jobs")
    parser.add_argument("--urgent", type=int, help="priority-0 jobs per phase (default 40; --quick 10)")
    parser.add_argument(
        "--backlog-factor", type=int, default=10, help="backlog = this x what the workers hold"
    )
    parser.add_argument("--widths", help="batch widths for tokens/s (default 32,128,256; --quick 32)")
    parser.add_argument("--tokens", type=int, default=128, help="max_tokens of a throughput job")
    parser.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="tokens/s: run stack and engine alone this many "
        "times each, alternately, and report the median ratio (the VM's speed drifts)",
    )
    parser.add_argument("--short-jobs", type=int, help="idle short jobs (default 60; --quick 20)")
    parser.add_argument(
        "--threads-per-worker",
        type=int,
        default=max(1, CORES // 2),
        help="OMP_NUM_THREADS of each of two workers (one worker uses the default)",
    )
    parser.add_argument(
        "--torch-threads",
        type=int,
        help="OMP_NUM_THREADS of one worker, and so of its engine alone "
        "(default: the worker's default, ENGINE_THREADS = cores - 1)",
    )
    parser.add_argument(
        "--skip", default="", help="comma list of sections to skip: urgent,throughput,two,idle"
    )
    args = parser.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    n_urgent = args.urgent or (10 if args.quick else 40)
    widths = [int(w) for w in (args.widths or ("32" if args.quick else "32,128,256")).split(",")]
    run = run_info()
    print(f"{run['machine']}; load average {run['load_avg'][0]:.2f}")
    two = {"OMP_NUM_THREADS": str(args.threads_per_worker)}
    one = {"OMP_NUM_THREADS": str(args.torch_threads)} if args.torch_threads else {}
    setups = [(1, one)] + ([] if "two" in skip else [(2, two)])
    result: dict = {"urgent": [], "throughput": [], "quick": args.quick}

    if "urgent" not in skip:
        for workers, env in setups:
            print(f"urgent TTFT, {workers} worker(s):")
            row = urgent_ttft(workers, n_urgent, args.backlog_factor, env)
            result["urgent"].append(row)
            print(
                f"  idle p50 {1000 * row['idle_p50_s']:.0f} ms p99 {1000 * row['idle_p99_s']:.0f} ms; backlog of "
                f"{row['backlog_jobs']} (capacity {row['capacity']}, >= {row['min_depth_over_capacity']:.1f}x "
                f"waiting in Redis at each arrival): p50 {1000 * row['backlog_p50_s']:.0f} ms p99 "
                f"{1000 * row['backlog_p99_s']:.0f} ms; target p99 <= {1000 * row['bound_s']:.0f} ms: "
                f"{'met' if row['met'] else 'NOT met'}; {row['handbacks']} hand-backs"
            )
    if "throughput" not in skip:
        for workers, env in setups:
            for width in widths:
                tries = sorted(
                    (throughput(width, workers, env, args.tokens) for _ in range(args.repeat)),
                    key=lambda r: r["ratio"],
                )
                row = dict(
                    tries[len(tries) // 2],
                    ratios=[r["ratio"] for r in tries],
                    ratios_all_cores=[r["ratio_all_cores"] for r in tries],
                )
                result["throughput"].append(row)
                print(
                    f"tokens/s, width {width}, {workers} worker(s): stack {row['stack_tokens_per_s']:.0f}, engine "
                    f"alone with {row['engine_threads']} threads {row['engine_tokens_per_s']:.0f} ({row['jobs']} jobs, "
                    f"{row['tokens']} tokens, {row['failed']} failed): {row['ratio']:.2f}x; target >= 0.9x: "
                    f"{'met' if row['met'] else 'NOT met'}; against the engine alone on all {CORES} cores "
                    f"({row['engine_all_cores_tokens_per_s']:.0f}): {row['ratio_all_cores']:.2f}x"
                    + (
                        f"; median of {args.repeat}: {', '.join(f'{r:.2f}' for r in row['ratios'])}"
                        if args.repeat > 1
                        else ""
                    )
                )
    if "idle" not in skip:
        row = result["idle"] = idle_latency(args.short_jobs or (20 if args.quick else 60))
        print(
            f"idle short jobs: p50 {1000 * row['p50_s']:.0f} ms p99 {1000 * row['p99_s']:.0f} ms max "
            f"{1000 * row['max_s']:.0f} ms ({row['max_over_p50']:.2f}x p50; target <= 3x: "
            f"{'met' if row['met'] else 'NOT met'}); first job after start {1000 * row['first_job_s']:.0f} ms"
        )
    write_result("backlog", result, headline(result), run=run)
    if result["urgent"] and result["throughput"] and "idle" in result:
        path = plot(result, OUT / "backlog.png")
        if not args.quick:
            shutil.copy(path, Path(__file__).resolve().parent / path.name)
        print(f"plot: {path}")


if __name__ == "__main__":
    main()
