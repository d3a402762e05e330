"""Scheduling within a priority class through the whole stack (issue 44): API, worker, Postgres and Redis, the
same jobs under SCHEDULING_POLICY=fcfs, =predicted and =preemptive (the default) in one run (`--policies`: fcfs
first, each other against it).

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

Each pass is a fresh stack (its own database and Redis keys) with one worker. By default (`--together`) each
round runs every policy at once, a stack each, the same jobs sent at the same moments: whatever else the
shared machine runs weighs on both alike (one after the other, passes of one policy differed 1.5-3.8x in mean
as others' load came and went). `--no-together` alternates them, fcfs, predicted, predicted, fcfs. A job's
latency is its row's finished_at - created_at; throughput is the output tokens over the first creation to the
last finish. Every job's output length is checked against the engine alone (greedy: the same whatever the
order). The policy's times are the defaults (cost 0.02 s a token, aging 30 s), as a deployment runs them.

Prints each pass (mean, p50, p99, tok/s, deadlines met, the load average before and after, the CPU others
used); per policy: mean, p50, p99, throughput, deadlines met; predicted / fcfs ratios against the issue's
targets (mean <= 0.6x, p99 <= 1.2x, throughput >= 0.97x), pooled and per round; per tenant and kind of job
(short, long): the mean latency and where it went (in Redis: created to claimed; held by the worker before its
first token: the reserve, the engine's waiting list, the prefill; running); and the ratios an ideal worker
gives on the same jobs (bench/within_class_model.py: the slots and nothing else), what the policy and its
predictor can buy on this workload at all.

    .venv/bin/python bench/within_class_stack.py --jobs 160 --load 2.0 --passes 3
"""

from __future__ import annotations

import argparse
import json
import os
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

from batching.config import EngineConfig  # noqa: E402
from batching.scheduler import QUANTUM_TOKENS  # noqa: E402
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
from bench.within_class_model import ModelJob, simulate, simulate_preemptive  # noqa: E402
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
    ignore_eos: bool = False  # a long job of `--long max`: it runs to max_tokens


def find_prompts(args) -> dict[str, list[tuple[list[int], int]]]:
    """Prompts whose greedy output ends after SHORT tokens, and long ones: (prompt, output length) of each class.
    `--long eos`: prompts whose greedy output ends after LONG tokens (a search of 64 prompts run to 2,000
    tokens a round: an hour on a busy 2-core machine); `--long max`: any prompt, the job run to max_tokens
    with ignore_eos (every job asks the same max_tokens, so nothing of its length reaches the predictor)."""
    cache = OUT / "within_class_prompts.json"
    key = f"{args.model}:{args.seed}" + (":max" if args.long == "max" else "")
    if cache.exists() and key in (saved := json.loads(cache.read_text())):
        return saved[key]
    from batching import Engine, EngineConfig, SamplingParams

    engine = Engine(EngineConfig(model=args.model, dtype="float32", device="cpu", max_num_seqs=64))
    rng = random.Random(args.seed)
    found: dict[str, list[tuple[list[int], int]]] = {"short": [], "long": []}
    longest = MAX_TOKENS if args.long == "eos" else SHORT[1]  # `max` searches short prompts only
    params = SamplingParams(max_tokens=longest, temperature=0)
    for round_ in range(40):
        prompts = [[rng.randrange(3, 259) for _ in range(rng.randint(8, 32))] for _ in range(64)]
        for prompt, out in zip(prompts, engine.generate(prompts, params), strict=True):
            n = len(out.token_ids)
            if out.finish_reason == "stop" and SHORT[0] <= n <= SHORT[1]:
                found["short"].append((prompt, n))
            elif out.finish_reason == "stop" and LONG[0] <= n <= LONG[1]:
                found["long"].append((prompt, n))
            elif args.long == "max" and len(found["long"]) < args.prompts // 4:
                found["long"].append((prompt, MAX_TOKENS))
        print(
            f"prompt search, round {round_ + 1}: {len(found['short'])} short, {len(found['long'])} long",
            flush=True,
        )
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
        jobs.append(Job(tenant, now, prompt, length, deadline, args.long == "max" and length > SHORT[1]))
    return jobs


def history(seed: int, long: tuple[int, int]) -> dict[str, list[int]]:
    """Each tenant's past: RECENT_JOBS output lengths drawn from its mix (long ones from `long`)."""
    rng = random.Random(seed + 2)

    def length(long_share: float) -> int:
        return rng.randint(*long) if rng.random() < long_share else rng.randint(*SHORT)

    return {t: [length(long) for _ in range(RECENT_JOBS)] for t, (_, long) in TENANTS.items()}


def tenant_keys(stack, past: dict[str, list[int]]) -> dict[str, str]:
    """A key per tenant, and its history written as jobs that succeeded an hour ago, on the model the API names
    in the jobs it stores (the predictor reads a tenant's jobs on the job's model only: history rows with no
    model, as this wrote them before, were invisible to it, and the stack ran the policy without them)."""
    from jobstore.jobs import create_job
    from jobstore.keys import create_key, hash_key, tenant_for_key_hash

    keys = {}
    ago = datetime.now(timezone.utc) - timedelta(hours=1)
    with stack.client.sessions.begin() as s:
        for tenant, lengths in past.items():
            keys[tenant] = create_key(s, tenant)
            tenant_id = tenant_for_key_hash(s, hash_key(keys[tenant])).id
            for i, n in enumerate(lengths):
                request = dict(
                    prompt="past", input_ids=None, max_tokens=MAX_TOKENS, temperature=0.0, top_p=1.0, top_k=0,
                    seed=None, stop=[], priority=5, metadata={}, model=stack.settings.served_model_name(),
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
    if job.ignore_eos:
        out["ignore_eos"] = True
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
    """(output tokens per second, seconds per step) of a worker kept full: max_num_seqs long jobs together. With
    --together, as many such stacks at once as there are policies (as the passes run), their mean."""
    if args.together:
        names = [chr(ord("a") + i) for i in range(len(args.policies))]
        start = threading.Barrier(len(names), timeout=900)
        with ThreadPoolExecutor(len(names)) as pool:
            rates = list(pool.map(lambda name: pilot_rate(args, prompts, name, start), names))
    else:
        rates = [pilot_rate(args, prompts, "a", None)]
    rate = sum(rates) / len(rates)
    return rate, args.max_num_seqs / rate


def pilot_rate(args, prompts, name: str, start: threading.Barrier | None) -> float:
    settings = bench_settings(max_num_seqs=args.max_num_seqs, engine_threads=args.threads)
    longs = [prompts["long"][i % len(prompts["long"])] for i in range(args.max_num_seqs)]
    with local_stack(settings, log_dir=OUT / "logs" / f"within_class_stack_pilot_{name}") as stack:
        if start is not None:
            start.wait()
        ids = stack.client.submit_all(
            [
                {
                    "input_ids": p,
                    "max_tokens": MAX_TOKENS,
                    "temperature": 0.0,
                    "ignore_eos": args.long == "max",
                }
                for p, _ in longs
            ]
        )
        rows = stack.client.wait(ids)
    span = (max(r["finished_at"] for r in rows) - min(r["created_at"] for r in rows)).total_seconds()
    return sum(r["tokens"] for r in rows) / span


def one_pass(
    args,
    policy: str,
    jobs: list[Job],
    past: dict[str, list[int]],
    start: threading.Barrier | None = None,
    workers: list | None = None,
) -> dict:
    """One policy's pass on a fresh stack. With `start` (passes run together), every pass's stack is built
    before any sends; `workers` (shared by those passes) counts every pass's worker as the measured system."""
    settings = bench_settings(
        max_num_seqs=args.max_num_seqs, engine_threads=args.threads, scheduling_policy=policy
    )
    workers = [] if workers is None else workers
    with local_stack(settings, log_dir=OUT / "logs" / f"within_class_stack_{policy}") as stack:
        keys = tenant_keys(stack, past)
        workers.extend(stack.workers)
        own = lambda: sum(filter(None, (tree_cpu_seconds(w.pid) for w in workers)))  # noqa: E731
        if start is not None:
            start.wait()
        load_before = os.getloadavg()[0]
        with Interference(own) as load:
            sent = send_all(stack, keys, jobs)
            rows = stack.client.wait([job_id for job_id, _ in sent])
        load_after = os.getloadavg()[0]
    wrong = [(j.length, r["tokens"]) for j, r in zip(jobs, rows, strict=True) if r["tokens"] != j.length]
    if wrong or any(r["status"].value != "succeeded" for r in rows):
        raise SystemExit(f"{policy}: jobs ended otherwise than alone (length expected, made): {wrong[:10]}")
    latencies = [(r["finished_at"] - r["created_at"]).total_seconds() for r in rows]
    span = (max(r["finished_at"] for r in rows) - min(r["created_at"] for r in rows)).total_seconds()
    met = [r["finished_at"] <= deadline for (_, deadline), r in zip(sent, rows, strict=True) if deadline]
    return {
        "policy": policy,
        "latencies": latencies,
        "waits": [job_waits(r) for r in rows],
        "tokens": sum(r["tokens"] for r in rows),
        "span_s": span,
        "met": met,
        "handbacks": sum(r["handbacks"] for r in rows),
        "others_cpu_share": load.share,
        "loadavg": (load_before, load_after),
    }


def job_waits(row: dict) -> tuple[float, float, float]:
    """Where a job's time went (seconds): in Redis (created to claimed), held by the worker before its first
    token (the reserve and the engine's waiting list, and its prefill), and running (first token to last)."""
    return (
        (row["started_at"] - row["created_at"]).total_seconds(),
        (row["first_token_at"] - row["started_at"]).total_seconds(),
        (row["finished_at"] - row["first_token_at"]).total_seconds(),
    )


def run_passes(args, jobs: list[Job], past: dict[str, list[int]]) -> dict[str, list[dict]]:
    """The passes, `args.passes` of each policy. --together: each round runs every policy at once, a stack
    each, sending the same jobs at the same moments (the machine's load, whatever it is, the same for all);
    otherwise one after the other, fcfs predicted, predicted fcfs, ..."""
    passes: dict[str, list[dict]] = {policy: [] for policy in args.policies}
    for round_ in range(args.passes):
        wait_for_quiet(args.wait_quiet)
        if args.together:
            start, workers = threading.Barrier(len(args.policies), timeout=900), []
            with ThreadPoolExecutor(len(args.policies)) as pool:
                running = {
                    policy: pool.submit(one_pass, args, policy, jobs, past, start, workers)
                    for policy in args.policies
                }
                results = {policy: future.result() for policy, future in running.items()}
        else:
            order = args.policies if round_ % 2 == 0 else args.policies[::-1]
            results = {}
            for policy in order:
                wait_for_quiet(args.wait_quiet)
                results[policy] = one_pass(args, policy, jobs, past)
        for policy in args.policies:
            result = results[policy]
            passes[policy].append(result)
            print(f"round {round_ + 1} {policy}: {pass_line(result)}", flush=True)
    return passes


def pass_line(result: dict) -> str:
    lat = result["latencies"]
    others = result["others_cpu_share"]
    return (
        f"mean {sum(lat) / len(lat):.2f} s, p50 {pct(lat, 50):.2f}, p99 {pct(lat, 99):.2f}, "
        f"{result['tokens'] / result['span_s']:.0f} tok/s, deadlines met {sum(result['met'])}/{len(result['met'])}, "
        f"load {result['loadavg'][0]:.1f}-{result['loadavg'][1]:.1f}, others' CPU "
        f"{'?' if others is None else f'{others:.0%}'}"
    )


def round_ratios(passes: dict[str, list[dict]], policy: str = "predicted") -> list[dict[str, float]]:
    """`policy` / fcfs of each round's passes (run together, or one after the other)."""
    return [
        policy_ratios(figures([fcfs]), figures([other]))
        for fcfs, other in zip(passes["fcfs"], passes[policy], strict=True)
    ]


def breakdown(args, jobs: list[Job], passes: dict[str, list[dict]]) -> list[str]:
    """Per tenant and kind of job (short, long): mean latency and where it went, per policy."""
    rows = [
        "",
        "| tenant, jobs | policy | mean latency s | in Redis s | held before first token s | running s |",
        "|---|---|---|---|---|---|",
    ]
    for tenant in TENANTS:
        for kind, long_ in (("short", False), ("long", True)):
            which = [i for i, j in enumerate(jobs) if j.tenant == tenant and (j.length >= LONG[0]) == long_]
            if not which:
                continue
            for policy, runs in passes.items():
                lat = [p["latencies"][i] for p in runs for i in which]
                waits = [p["waits"][i] for p in runs for i in which]
                mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
                rows.append(
                    f"| {tenant}, {len(which)} {kind} | {policy} | {mean(lat):.2f} | {mean([w[0] for w in waits]):.2f} "
                    f"| {mean([w[1] for w in waits]):.2f} | {mean([w[2] for w in waits]):.2f} |"
                )
    return rows


def model_ratios(
    args,
    jobs: list[Job],
    past: dict[str, list[int]],
    step_seconds: float,
    oracle: bool = False,
    policy: str = "predicted",
) -> dict:
    """The ratios `policy` / fcfs an ideal worker (bench/within_class_model.py) gives on these jobs, at the
    pilot's step time and the policy's default times; `oracle`: predicting each job's own length. Under
    preemptive the engine holds what the worker holds (worker_capacity)."""
    defaults = EngineConfig()
    model_jobs = [
        ModelJob(j.tenant, j.arrival, j.length, None if j.deadline is None else j.arrival + j.deadline)
        for j in jobs
    ]
    times = dict(
        slots=args.max_num_seqs,
        step_seconds=step_seconds,
        max_tokens=MAX_TOKENS,
        cost_seconds_per_token=defaults.cost_seconds_per_token,
        aging_seconds=defaults.aging_seconds,
        margin_seconds=defaults.deadline_margin_seconds,
        oracle=oracle,
    )
    runs = {"fcfs": simulate(model_jobs, past, "fcfs", **times)}
    if policy == "preemptive":
        held = bench_settings(scheduling_policy=policy).worker_capacity(args.max_num_seqs)
        runs[policy] = simulate_preemptive(model_jobs, past, quantum=QUANTUM_TOKENS, held=held, **times)
    else:
        runs[policy] = simulate(model_jobs, past, policy, **times)
    out = {
        policy: {
            "mean_latency_s": sum(r.latencies) / len(r.latencies),
            "p50_latency_s": pct(r.latencies, 50),
            "p99_latency_s": pct(r.latencies, 99),
            "throughput_tok_s": r.tokens / r.span,
            "deadlines_met": sum(r.met) / len(r.met) if r.met else None,
        }
        for policy, r in runs.items()
    }
    return {**policy_ratios(out["fcfs"], out[policy]), "figures": out}


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
    parser.add_argument("--passes", type=int, default=2, help="rounds: a pass of each policy per round")
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
    parser.add_argument(
        "--policies",
        nargs="+",
        choices=["fcfs", "predicted", "preemptive"],
        default=["fcfs", "predicted", "preemptive"],
        help="fcfs and the policies to measure against it (each / fcfs)",
    )
    parser.add_argument(
        "--long",
        choices=["max", "eos"],
        default="max",
        help="long jobs: run to max_tokens (2,000) with ignore_eos (max), or prompts whose greedy output ends at "
        "1,000-2,000 tokens (eos: a long search first)",
    )
    parser.add_argument(
        "--together",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="each round runs both policies at once, a stack each (the same load for both); --no-together: one "
        "after the other, fcfs predicted, predicted fcfs",
    )
    args = parser.parse_args()
    info = run_info()
    prompts = find_prompts(args)
    capacity, step_seconds = pilot(args, prompts)
    past = history(args.seed, LONG if args.long == "eos" else (MAX_TOKENS, MAX_TOKENS))
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
    if args.policies[0] != "fcfs" or len(set(args.policies)) != len(args.policies):
        raise SystemExit("--policies: fcfs first, then the policies measured against it, each once")
    passes = run_passes(args, jobs, past)
    results = {policy: figures(runs) for policy, runs in passes.items()}
    others = args.policies[1:]
    ratios = {policy: policy_ratios(results["fcfs"], results[policy]) for policy in others}
    rows = [
        "| policy | mean latency s (per pass) | p50 s | p99 s | throughput tok/s | deadlines met | others' CPU |",
        "|---|---|---|---|---|---|---|",
    ]
    for policy, f in results.items():
        met = f"{f['deadlines_met']:.0%} of {f['num_deadlines']}" if f["deadlines_met"] is not None else "-"
        others_cpu = f"{f['others_cpu_share']:.0%}" if f["others_cpu_share"] is not None else "?"
        each = ", ".join(f"{m:.1f}" for m in f["per_pass_mean_s"])
        rows.append(
            f"| {policy} | {f['mean_latency_s']:.2f} ({each}) | {f['p50_latency_s']:.2f} | {f['p99_latency_s']:.2f} "
            f"| {f['throughput_tok_s']:.0f} | {met} | {others_cpu} |"
        )
    each_round, ideal, oracle = {}, {}, {}
    for policy in others:
        table = ratio_rows(ratios[policy])
        table[1] = table[1].replace("predicted / fcfs", f"{policy} / fcfs")
        rows += table
        each_round[policy] = round_ratios(passes, policy)
        rows += ["", f"| round: {policy} / fcfs | mean | p99 | throughput |", "|---|---|---|---|"]
        for i, r in enumerate(each_round[policy]):
            rows.append(
                f"| {i + 1} | {r['mean_latency']:.2f}x | {r['p99_latency']:.2f}x | {r['throughput']:.2f}x |"
            )
        ideal[policy] = model_ratios(args, jobs, past, step_seconds, policy=policy)
        oracle[policy] = model_ratios(args, jobs, past, step_seconds, oracle=True, policy=policy)
    rows += breakdown(args, jobs, passes)
    step_ms = step_seconds * 1000
    rows += [
        "",
        f"An ideal worker (bench/within_class_model.py: {args.max_num_seqs} slots, {step_ms:.1f} ms a step, "
        "nothing else costing time) on these jobs:",
    ]
    for policy in others:
        i, o = ideal[policy], oracle[policy]
        rows.append(
            f"- {policy} / fcfs mean {i['mean_latency']:.2f}x, p99 {i['p99_latency']:.2f}x, throughput "
            f"{i['throughput']:.2f}x (fcfs p50 {i['figures']['fcfs']['p50_latency_s']:.2f} s); predicting each "
            f"job's own length: mean {o['mean_latency']:.2f}x, p99 {o['p99_latency']:.2f}x, throughput "
            f"{o['throughput']:.2f}x."
        )
    write_result(
        "within_class_stack",
        {
            "capacity_tok_s": capacity,
            "step_seconds": step_seconds,
            "rate": rate,
            "figures": results,
            "ratios": ratios,
            "round_ratios": each_round,
            "ideal": ideal,
            "ideal_oracle": oracle,
            "passes": passes,
            "args": vars(args),
        },
        "\n".join(rows),
        run=info,
    )


if __name__ == "__main__":
    main()
