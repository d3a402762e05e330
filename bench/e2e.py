"""End-to-end load benchmark: the real stack over HTTP against the engine alone, and the API's top rate.

1. Workload: jobs arrive at a fixed rate (Poisson) with a priority mix (20% priority 0, 50% 5, 30% 9)
   and are POSTed to the API (gunicorn) of a fresh stack (bench/stack.py: its own database, one worker);
   each client then follows its job's event stream. Latency and TTFT are timed as the client sees them:
   from its send of POST /jobs to the first streamed token and to the result event (`Stack.run_job`).
   The job rows' own timestamps (created_at -> first_token_at / finished_at) are reported beside them.
   The worker's and the API's /metrics are sampled every 0.5 s (KV usage, sequences, queue depth).
2. Engine alone: the same jobs (same prompts, priorities, arrival times and output lengths) replayed
   into batching.Engine in this process; per-job latency = finish - arrival. The system's overhead
   (HTTP + Redis + Postgres + the worker + the event stream) is the median per-job difference between
   the client's latency and the engine's.
3. Submission rate: with the worker stopped, POST /jobs (max_tokens 1) is offered at rising rates by a
   lean asyncio client (bench/http_load.py: it shares the 2 cores with the API, so it must cost little);
   the highest rate accepted with < 1% errors (and >= 95% of it actually answered) is reported.

    .venv/bin/python bench/e2e.py --quick          # smoke run, ~1.5 min
    .venv/bin/python bench/e2e.py                  # full run, ~5 min on 2 cores; copies the PNGs to bench/

Only 127.0.0.1 is contacted. Plots go to bench/out/e2e_*.png, JSON to bench/out/e2e.json.
"""

from __future__ import annotations

import argparse
import random
import shutil
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from pathlib import Path

import requests

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import http_load  # noqa: E402
from bench.harness import markdown_table, pct, run_info, write_result  # noqa: E402
from bench.stack import ClientTimes, bench_settings, local_stack  # noqa: E402

OUT = Path(__file__).resolve().parent / "out"
PRIORITY_MIX = ((0, 0.2), (5, 0.5), (9, 0.3))
WORDS = "the tea cat sky mud river stone light song road".split()


def workload(n: int, rate: float, seed: int = 7) -> list[dict]:
    """n jobs: Poisson arrivals at `rate`/s, the priority mix, short text prompts, 8-32 tokens, greedy."""
    rng = random.Random(seed)
    t, jobs = 0.0, []
    for i in range(n):
        t += rng.expovariate(rate)
        priority = rng.choices([p for p, _ in PRIORITY_MIX], [w for _, w in PRIORITY_MIX])[0]
        prompt = f"Job {i}: " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 40)))
        jobs.append(
            {
                "at": t,
                "body": {
                    "prompt": prompt,
                    "max_tokens": rng.randint(8, 32),
                    "priority": priority,
                    "temperature": 0.0,
                },
            }
        )
    return jobs


# --- 1. the stack under the workload ------------------------------------------------------------------


def sample_metrics(stack, stop: threading.Event, samples: list[dict], t0: float) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    session = requests.Session()
    while not stop.wait(0.5):
        row = {"t": time.monotonic() - t0}
        for url in (stack.worker_metrics_url, stack.url + "/metrics"):
            try:
                text = session.get(url, timeout=2).text
            except requests.RequestException:
                continue
            for family in text_string_to_metric_families(text):
                for s in family.samples:
                    if s.name.startswith("genq_engine_") and not s.labels:
                        row[s.name] = s.value
                    elif s.name == "genq_queue_depth":
                        row[f"queue_{s.labels['priority']}"] = s.value
        samples.append(row)


def run_workload(stack, jobs: list[dict]) -> tuple[list[ClientTimes], list[dict]]:
    """Send each job at its arrival time and follow it to its result as its client; what each client saw
    (in the order of `jobs`) and the metric samples."""
    local = threading.local()

    def run(i: int) -> ClientTimes:
        if not hasattr(local, "session"):
            local.session = requests.Session()
        return stack.run_job(jobs[i]["body"], local.session)

    samples: list[dict] = []
    stop = threading.Event()
    t0 = time.monotonic()
    sampler = threading.Thread(target=sample_metrics, args=(stack, stop, samples, t0), daemon=True)
    sampler.start()
    with ThreadPoolExecutor(64) as pool:  # a client per job in flight, so none waits for a free thread
        futures = []
        for i, job in enumerate(jobs):
            time.sleep(max(0.0, t0 + job["at"] - time.monotonic()))
            futures.append(pool.submit(run, i))
        seen = [f.result() for f in futures]
    stop.set()
    sampler.join()
    return seen, samples


# --- 2. the engine alone ------------------------------------------------------------------------------


def run_engine_alone(settings, jobs: list[dict], results: list[dict]) -> list[dict]:
    """Replay the jobs into an Engine at their arrival times, each generating what the system generated."""
    from batching import Engine, EngineConfig, SamplingParams

    engine = Engine(EngineConfig(**settings.engine_options()))
    timings: dict[str, dict] = {}
    t0, next_job = time.time(), 0
    while next_job < len(jobs) or engine.has_unfinished_requests():
        now = time.time() - t0
        while next_job < len(jobs) and jobs[next_job]["at"] <= now:
            job, n = jobs[next_job], results[next_job]["usage"]["completion_tokens"]
            engine.add_request(
                str(next_job),
                job["body"]["prompt"],
                SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True),
                priority=job["body"]["priority"],
                arrival_time=t0 + job["at"],
            )
            next_job += 1
        if not engine.has_unfinished_requests():
            time.sleep(min(0.002, max(0.0, jobs[next_job]["at"] - now)))
            continue
        for out in engine.step():
            if out.finished:
                timings[out.request_id] = {
                    "latency": out.finish_time - out.arrival_time,
                    "ttft": out.first_token_time - out.arrival_time,
                    "tokens": len(out.token_ids),
                    "finish": out.finish_time - t0,
                }
    return [timings[str(i)] for i in range(len(jobs))]


# --- 3. the API's submission rate ---------------------------------------------------------------------


def offer(stack, rate: float, seconds: float) -> dict:
    """Open loop: POST /jobs `rate` times a second for `seconds`, from bench/http_load.py's lean client."""
    return http_load.offer(
        stack.url,
        "/jobs",
        {"prompt": "rate test", "max_tokens": 1, "priority": 5},
        stack.headers,
        rate=rate,
        seconds=seconds,
    )


def ramp(stack, rates: list[float], seconds: float) -> tuple[list[dict], float]:
    steps, best = [], 0.0
    for rate in rates:
        step = offer(stack, rate, seconds)
        steps.append(step)
        ok = step["errors"] <= 0.01 * step["sent"] and step["accepted_per_s"] >= 0.95 * rate
        print(
            f"  offered {rate:5.0f}/s: accepted {step['accepted_per_s']:6.1f}/s, errors {step['errors']}, "
            f"p50 {step['p50_ms']:.0f} ms, p99 {step['p99_ms']:.0f} ms{'' if ok else '  <- not sustained'}"
        )
        if not ok:
            break
        best = rate
    return steps, best


# --- report and plots ---------------------------------------------------------------------------------


def seconds_between(job: dict, a: str, b: str) -> float:
    return (datetime.fromisoformat(job[b]) - datetime.fromisoformat(job[a])).total_seconds()


def summarise(jobs, seen: list[ClientTimes], alone) -> dict:
    results = [s.job for s in seen]
    by_priority = {}
    for p, _ in PRIORITY_MIX:
        idx = [i for i, j in enumerate(jobs) if j["body"]["priority"] == p]
        ttft = [seen[i].first_token_s for i in idx if seen[i].first_token_s is not None]
        lat = [seen[i].latency_s for i in idx]
        row_ttft = [seconds_between(results[i], "created_at", "first_token_at") for i in idx]
        eng = [alone[i]["latency"] for i in idx]
        by_priority[p] = {
            "jobs": len(idx),
            "latency_p50_s": pct(lat, 50),
            "latency_p99_s": pct(lat, 99),
            "ttft_p50_s": pct(ttft, 50),
            "ttft_p99_s": pct(ttft, 99),
            "job_row_ttft_p50_s": pct(row_ttft, 50),
            "job_row_ttft_p99_s": pct(row_ttft, 99),
            "engine_latency_p50_s": pct(eng, 50),
            "engine_latency_p99_s": pct(eng, 99),
        }
    lat = [s.latency_s for s in seen]
    diffs = [s - a["latency"] for s, a in zip(lat, alone, strict=True)]
    row_lat = [seconds_between(r, "created_at", "finished_at") for r in results]
    tokens = sum(r["usage"]["completion_tokens"] for r in results)
    created = [datetime.fromisoformat(r["created_at"]) for r in results]
    done = [datetime.fromisoformat(r["finished_at"]) for r in results]
    span = (max(done) - min(created)).total_seconds()
    engine_span = max(a["finish"] for a in alone) - jobs[0]["at"]
    return {
        "by_priority": by_priority,
        "tokens": tokens,
        "system_tokens_per_s": tokens / span,
        "engine_tokens_per_s": tokens / engine_span,
        "overhead_median_ms": 1000 * statistics.median(diffs),
        "overhead_p90_ms": 1000 * pct(diffs, 90),
        # the same from the job rows' timestamps: without the client's HTTP round trips and the event stream
        "job_row_overhead_median_ms": 1000
        * statistics.median(r - a["latency"] for r, a in zip(row_lat, alone, strict=True)),
        # where a job's time goes: created -> claimed by the worker (HTTP commit to Redis to the task thread
        # to the claim's UPDATE), then claimed -> finished (the engine, plus the final write)
        "dispatch_median_ms": 1000
        * statistics.median(seconds_between(r, "created_at", "started_at") for r in results),
        "run_minus_engine_median_ms": 1000
        * statistics.median(
            seconds_between(r, "started_at", "finished_at") - a["latency"]
            for r, a in zip(results, alone, strict=True)
        ),
        "system_latency_median_ms": 1000 * statistics.median(lat),
        "engine_latency_median_ms": 1000 * statistics.median(a["latency"] for a in alone),
        "failed_jobs": sum(r["status"] != "succeeded" for r in results),
    }


def plot(jobs, seen: list[ClientTimes], alone, samples, steps, out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = [s.job for s in seen]
    t_first = min(datetime.fromisoformat(r["created_at"]) for r in results)
    colors = {0: "tab:red", 5: "tab:blue", 9: "tab:gray"}
    paths = []

    fig, ax = plt.subplots(figsize=(8, 4))
    for p, _ in PRIORITY_MIX:
        idx = [i for i, j in enumerate(jobs) if j["body"]["priority"] == p]
        ax.scatter(
            [(datetime.fromisoformat(results[i]["finished_at"]) - t_first).total_seconds() for i in idx],
            [seen[i].latency_s for i in idx],
            s=10,
            color=colors[p],
            label=f"priority {p} (system)",
        )
        ax.scatter(
            [alone[i]["finish"] - jobs[0]["at"] for i in idx],
            [alone[i]["latency"] for i in idx],
            s=10,
            marker="x",
            color=colors[p],
            alpha=0.4,
            label=f"priority {p} (engine alone)",
        )
    ax.set(xlabel="time (s)", ylabel="job latency (s)", title="Job latency as clients saw it, per priority")
    ax.legend(fontsize=7, ncol=2)
    paths.append(_save(fig, out / "e2e_latency.png"))

    ts = [s["t"] for s in samples]
    fig, ax = plt.subplots(figsize=(8, 3.5))
    ax.stackplot(
        ts,
        *[[s.get(f"queue_{p}", 0) for s in samples] for p, _ in PRIORITY_MIX],
        labels=[f"priority {p}" for p, _ in PRIORITY_MIX],
        colors=[colors[p] for p, _ in PRIORITY_MIX],
    )
    ax.plot(
        ts,
        [s.get("genq_engine_waiting_sequences", 0) for s in samples],
        color="k",
        lw=1,
        label="waiting in the engine",
    )
    ax.set(xlabel="time (s)", ylabel="jobs", title="Queue depth in Redis per priority (API /metrics)")
    ax.legend(fontsize=7)
    paths.append(_save(fig, out / "e2e_queue.png"))

    fig, ax = plt.subplots(figsize=(8, 3.5))
    ax.plot(ts, [s.get("genq_engine_device_kv_usage", 0) for s in samples], label="device KV usage")
    ax.plot(ts, [s.get("genq_engine_host_kv_usage", 0) for s in samples], label="host KV usage (swap)")
    ax2 = ax.twinx()
    ax2.plot(
        ts,
        [s.get("genq_engine_running_sequences", 0) for s in samples],
        color="tab:green",
        lw=0.8,
        label="running sequences",
    )
    ax.set(
        xlabel="time (s)",
        ylabel="fraction of blocks",
        title="KV cache usage and batch size (worker /metrics)",
    )
    ax2.set_ylabel("running sequences")
    fig.legend(fontsize=7, loc="upper right")
    paths.append(_save(fig, out / "e2e_kv.png"))

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot([s["offered"] for s in steps], [s["accepted_per_s"] for s in steps], "o-", label="accepted")
    ax.plot([s["offered"] for s in steps], [s["offered"] for s in steps], "k:", lw=0.8, label="offered")
    ax.set(xlabel="offered POST /jobs per s", ylabel="accepted per s", title="API submission rate")
    ax.legend(fontsize=7)
    paths.append(_save(fig, out / "e2e_ramp.png"))
    return paths


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: fewer jobs, shorter ramp")
    parser.add_argument("--rate", type=float, default=1.0, help="job arrivals per second (default 1)")
    parser.add_argument("--jobs", type=int, help="jobs in the workload (default 120; --quick 20)")
    parser.add_argument("--api-workers", type=int, help="gunicorn workers (default: gunicorn.conf.py's)")
    parser.add_argument("--max-num-seqs", type=int, default=8, help="the engine's batch width (MAX_NUM_SEQS)")
    parser.add_argument("--ramp", default=None, help="offered submission rates, e.g. 100,200,300,400")
    parser.add_argument("--ramp-seconds", type=float, default=None, help="seconds per ramp step (default 4)")
    args = parser.parse_args()
    n = args.jobs or (20 if args.quick else 120)
    rates = [
        float(r) for r in (args.ramp or ("100,300" if args.quick else "50,100,200,300,400,600")).split(",")
    ]
    ramp_seconds = args.ramp_seconds or (2.0 if args.quick else 4.0)
    run = run_info()
    print(
        f"{run['machine']}; load average {run['load_avg'][0]:.2f}; {n} jobs at {args.rate}/s, "
        f"gunicorn x{args.api_workers or 'gunicorn.conf.py'}, MAX_NUM_SEQS {args.max_num_seqs}"
    )

    jobs = workload(n, args.rate)
    settings = bench_settings(max_num_seqs=args.max_num_seqs)
    with local_stack(settings, api_workers=args.api_workers, log_dir=OUT / "e2e-logs") as stack:
        started = time.monotonic()
        seen, samples = run_workload(stack, jobs)
        print(f"workload: {len(seen)} jobs in {time.monotonic() - started:.1f}s")
        stack.stop_worker()
        print("submission rate (worker stopped):")
        steps, best = ramp(stack, rates, ramp_seconds)
    alone = run_engine_alone(settings, jobs, [s.job for s in seen])
    summary = summarise(jobs, seen, alone)
    summary.update(max_accepted_rate=best, ramp=steps, jobs=n, rate=args.rate, quick=args.quick)

    print(
        f"\n{'priority':>8} {'jobs':>5} {'lat p50':>8} {'lat p99':>8} {'TTFT p50':>9} {'TTFT p99':>9} "
        f"{'row TTFT p50':>13} {'p99':>6} {'engine p50':>10} {'engine p99':>10}   (s; latency and TTFT as "
        "the clients saw them, row TTFT from the job rows)"
    )
    for p, row in summary["by_priority"].items():
        print(
            f"{p:>8} {row['jobs']:>5} {row['latency_p50_s']:8.3f} {row['latency_p99_s']:8.3f} "
            f"{row['ttft_p50_s']:9.3f} {row['ttft_p99_s']:9.3f} {row['job_row_ttft_p50_s']:13.3f} "
            f"{row['job_row_ttft_p99_s']:6.3f} {row['engine_latency_p50_s']:10.3f} {row['engine_latency_p99_s']:10.3f}"
        )
    print(
        f"throughput: system {summary['system_tokens_per_s']:.0f} tokens/s, engine alone "
        f"{summary['engine_tokens_per_s']:.0f} tokens/s ({summary['tokens']} tokens)"
    )
    overhead_met = summary["overhead_median_ms"] < 20
    print(
        f"overhead over the engine alone, as the clients saw it: median {summary['overhead_median_ms']:.1f} ms "
        f"per job (p90 {summary['overhead_p90_ms']:.1f} ms; from the job rows {summary['job_row_overhead_median_ms']:.1f} "
        f"ms: created -> claimed median {summary['dispatch_median_ms']:.1f} ms, claimed -> finished minus the "
        f"engine alone {summary['run_minus_engine_median_ms']:.1f} ms); target < 20 ms: "
        f"{'met' if overhead_met else 'NOT met'}"
    )
    print(
        f"API: highest submission rate sustained with < 1% errors: {best:.0f} jobs/s; target >= 300: "
        f"{'met' if best >= 300 else 'NOT met'}"
    )
    table = markdown_table(
        ["priority", "jobs", "latency p50 / p99", "TTFT p50 / p99 (client)", "engine alone p50 / p99"],
        [
            [
                p,
                row["jobs"],
                f"{row['latency_p50_s']:.3f} / {row['latency_p99_s']:.3f} s",
                f"{row['ttft_p50_s']:.3f} / {row['ttft_p99_s']:.3f} s",
                f"{row['engine_latency_p50_s']:.3f} / {row['engine_latency_p99_s']:.3f} s",
            ]
            for p, row in summary["by_priority"].items()
        ],
    )
    table += "\n\n" + markdown_table(
        ["measure", "figure", "target", "met"],
        [
            [
                "overhead over the engine alone, median per job (client)",
                f"{summary['overhead_median_ms']:.1f} ms",
                "< 20 ms",
                "met" if overhead_met else "not met",
            ],
            [
                "highest POST /jobs rate sustained",
                f"{best:.0f}/s",
                ">= 300/s",
                "met" if best >= 300 else "not met",
            ],
        ],
    )
    write_result("e2e", summary, table, run=run)
    paths = plot(jobs, seen, alone, samples, steps, OUT)
    if not args.quick:
        for path in paths:
            shutil.copy(path, Path(__file__).resolve().parent / path.name)
    print("plots: " + ", ".join(str(p) for p in paths))


if __name__ == "__main__":
    main()
