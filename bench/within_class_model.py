"""What the order within a class can buy on a workload, with nothing else in the way: an ideal worker (issue 44).

The same jobs (arrival, tenant, output length, deadline) through a model of a worker: `slots` sequences run at
once, each making one token a step of `step_seconds`; a job starts when a slot is free, and then runs to its
end (nothing preempts it, as in the engine within a class); nothing else costs time (no prefill, no Redis, no
database, no claim). The waiting jobs start in the order of the policy:

- fcfs: by arrival;
- predicted: as batching/admission_order.py orders them, with its formulas (`place`, `at_risk`): a deadline at
  risk first, earliest first; then by arrival + predicted output x cost_seconds_per_token, moved back by at
  most the aging bound. The prediction is jobstore/output_length.py's statistic: the mean output of the
  tenant's last RECENT_JOBS jobs created and finished before the job arrived (its history, then this run's);
  or, `oracle`, the job's own length.

- preemptive: predicted, and within a class the least attained service runs (multi-level feedback, as in
  FastServe; `simulate_preemptive`): a job that has waited to start, or to resume, takes the slot of a running
  job of its class that has made more tokens (a higher level: levels at quantum x 1, 2, 4, ... tokens made)
  and has run its own quantum since it last started (quantum x 2^k after k preemptions); the one preempted
  resumes later where it stopped (its KV swapped, nothing recomputed). Time is in steps there (a job starts at
  a step's start), and the engine sees at most `held` jobs (the worker's max_num_seqs + reserve; None: all).

bench/within_class_stack.py runs it on its own workload: the ratios a stack without overheads would reach,
beside the ratios the stack reached. The gap between the two is what the stack loses; the model's own ratio is
what the policy and its predictor can give on that workload at all. `python bench/within_class_model.py`
runs the stack bench's workload (its seeds, short lengths drawn at 16-64) through every policy here.
"""

from __future__ import annotations

import argparse
import heapq
import math
import random
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field

from batching.admission_order import at_risk, place
from jobstore.output_length import RECENT_JOBS, predict_output_tokens


@dataclass(frozen=True)
class ModelJob:
    tenant: str
    arrival: float  # seconds
    length: int  # output tokens: steps once started
    deadline: float | None = None  # seconds (same origin as arrival)


@dataclass
class ModelRun:
    latencies: list[float] = field(default_factory=list)  # in the order of the jobs
    met: list[bool] = field(default_factory=list)  # of the jobs with a deadline, in their order
    tokens: int = 0
    span: float = 0.0  # first arrival to last finish, seconds
    preemptions: int = 0  # in-class preemptions (simulate_preemptive)


def finished_run(jobs, finished_at: dict[int, float]) -> ModelRun:
    """Each job's latency and deadline kept, the tokens made and the span, from when each job finished."""
    run = ModelRun()
    for i, job in enumerate(jobs):
        run.latencies.append(finished_at[i] - job.arrival)
        if job.deadline is not None:
            run.met.append(finished_at[i] <= job.deadline)
    run.tokens = sum(j.length for j in jobs)
    run.span = max(finished_at.values()) - min(j.arrival for j in jobs)
    return run


def job_prediction(
    job,
    history: dict[str, list[int]],
    done: dict[str, list[tuple[float, float, int]]],
    max_tokens: int,
    oracle: bool,
) -> int:
    """The output `job` is predicted to make: its own length (`oracle`), else the statistic of its tenant's
    history and of the jobs that had finished (done: arrival, finish, length) when it arrived."""
    if oracle:
        return job.length
    recent = [n for a, f, n in done.get(job.tenant, []) if a < job.arrival and f < job.arrival]
    return predict_output_tokens(max_tokens, (history.get(job.tenant, []) + recent)[-RECENT_JOBS:])


def simulate(
    jobs: Sequence[ModelJob],
    history: dict[str, list[int]],
    policy: str,
    *,
    slots: int,
    step_seconds: float,
    max_tokens: int,
    cost_seconds_per_token: float,
    aging_seconds: float,
    margin_seconds: float,
    oracle: bool = False,
) -> ModelRun:
    """Each job's latency (finish - arrival) when `jobs` go through the ideal worker. `oracle`: the prediction
    is the job's own length (the bound a better predictor could reach), not the tenant statistic."""
    order = sorted(range(len(jobs)), key=lambda i: jobs[i].arrival)
    finished_at: dict[int, float] = {}
    done: dict[str, list[tuple[float, float, int]]] = {t: [] for t in history}  # (arrival, finish, length)
    predicted: dict[int, int] = {}
    waiting: list[int] = []
    running: list[tuple[float, int]] = []  # (finish, job) heap
    now, nxt = min(j.arrival for j in jobs), 0

    def prediction(i: int) -> int:
        return job_prediction(jobs[i], history, done, max_tokens, oracle)

    def rank(i: int) -> tuple:
        job = jobs[i]
        if policy == "fcfs":
            return (1, job.arrival, job.arrival)
        left = predicted[i]
        if job.deadline is not None and at_risk(job.deadline, now, left * step_seconds, margin_seconds):
            return (0, job.deadline, job.arrival)
        return (1, place(job.arrival, left, cost_seconds_per_token, aging_seconds), job.arrival)

    while nxt < len(order) or waiting or running:
        while nxt < len(order) and jobs[order[nxt]].arrival <= now + 1e-9:
            i = order[nxt]
            predicted[i] = prediction(i)
            waiting.append(i)
            nxt += 1
        if waiting and len(running) < slots:
            waiting.sort(key=rank)
            while waiting and len(running) < slots:
                i = waiting.pop(0)
                heapq.heappush(running, (now + jobs[i].length * step_seconds, i))
        events = [running[0][0]] if running else []
        if nxt < len(order):
            events.append(jobs[order[nxt]].arrival)
        now = min(events)
        while running and running[0][0] <= now + 1e-9:
            end, i = heapq.heappop(running)
            finished_at[i] = end
            done.setdefault(jobs[i].tenant, []).append((jobs[i].arrival, end, jobs[i].length))
    return finished_run(jobs, finished_at)


def level(made: int, quantum: int) -> int:
    """A job's level by the tokens it has made: 0 below `quantum`, then one more at each doubling."""
    return 0 if made < quantum else int(math.log2(made / quantum)) + 1


def simulate_preemptive(
    jobs: Sequence[ModelJob],
    history: dict[str, list[int]],
    *,
    slots: int,
    step_seconds: float,
    max_tokens: int,
    cost_seconds_per_token: float,
    aging_seconds: float,
    margin_seconds: float,
    quantum: int = 64,
    held: int | None = None,
    oracle: bool = False,
    preempt: bool = True,
) -> ModelRun:
    """Each job's latency under "preemptive" (the module's doc), stepped: a step makes a token of each running
    job. The jobs the engine does not hold wait in the queue in the order of "predicted" and are taken as it
    has room (`held`). In the engine, a job not running ranks as under "predicted" (deadlines at risk first,
    then by place), by level before place: a job preempted aging_seconds ago or more is aged, at level 0 with
    the place its stop + aging_seconds (as if it arrived then). It takes a free slot, else the slot of the running job of
    the highest level above its own (the latest place among equals) that has run its quantum since it started
    and whose deadline is not at risk. `preempt=False`: no job
    yields (the same stepped model under "predicted")."""
    order = sorted(range(len(jobs)), key=lambda i: jobs[i].arrival)
    made = [0] * len(jobs)
    started_at_made = [0] * len(jobs)  # tokens made when it last started running
    times_preempted = [0] * len(jobs)
    stopped = [0.0] * len(jobs)  # when it arrived or was last preempted
    finished_at: dict[int, float] = {}
    done: dict[str, list[tuple[float, float, int]]] = {t: [] for t in history}
    predicted: dict[int, int] = {}
    queued: list[int] = []  # in the queue (Redis)
    waiting: list[int] = []  # held by the engine, not running
    running: list[int] = []
    now, nxt = min(j.arrival for j in jobs), 0

    def prediction(i: int) -> int:
        return job_prediction(jobs[i], history, done, max_tokens, oracle)

    def rank(i: int) -> tuple:
        job = jobs[i]
        left = max(1, predicted[i] - made[i])
        if job.deadline is not None and at_risk(job.deadline, now, left * step_seconds, margin_seconds):
            return (0, job.deadline, job.arrival)
        return (1, place(job.arrival, predicted[i], cost_seconds_per_token, aging_seconds), job.arrival)

    def engine_rank(i: int) -> tuple:
        """A deadline at risk first; then by level; within a level by place, an aged job's place its stop +
        aging_seconds (as if it arrived then, with the longest shift)."""
        at_risk_or_place = rank(i)
        if at_risk_or_place[0] == 0:
            return at_risk_or_place
        if times_preempted[i] and now - stopped[i] >= aging_seconds:
            return (1, 0, stopped[i] + aging_seconds, jobs[i].arrival)
        return (1, engine_level(i), *at_risk_or_place[1:])

    def engine_level(i: int) -> int:
        """Level 0 when aged or its deadline is at risk."""
        if now - stopped[i] >= aging_seconds or rank(i)[0] == 0:
            return 0
        return level(made[i], quantum)

    def start(i: int) -> None:
        waiting.remove(i)
        running.append(i)
        started_at_made[i] = made[i]

    while nxt < len(order) or queued or waiting or running:
        if not (queued or waiting or running):
            now = max(now, jobs[order[nxt]].arrival)
        while nxt < len(order) and jobs[order[nxt]].arrival <= now + 1e-9:
            i = order[nxt]
            predicted[i] = prediction(i)
            stopped[i] = jobs[i].arrival
            queued.append(i)
            nxt += 1
        room = len(queued) if held is None else held - len(waiting) - len(running)
        if queued and room > 0:
            queued.sort(key=rank)
            waiting.extend(queued[:room])
            del queued[:room]
        waiting.sort(key=engine_rank)
        while waiting and len(running) < slots:
            start(waiting[0])
        while preempt and waiting:
            w = waiting[0]
            victims = [
                r
                for r in running
                if made[r] - started_at_made[r] >= quantum * 2 ** times_preempted[r]
                and rank(r)[0] != 0  # its deadline is not at risk
                and level(made[r], quantum) > engine_level(w)
            ]
            if not victims:
                break
            r = max(victims, key=lambda r: (level(made[r], quantum), rank(r)))
            running.remove(r)
            times_preempted[r] += 1
            stopped[r] = now
            start(w)
            waiting.append(r)
            waiting.sort(key=engine_rank)
        now += step_seconds
        for i in list(running):
            made[i] += 1
            if made[i] == jobs[i].length:
                running.remove(i)
                finished_at[i] = now
                done.setdefault(jobs[i].tenant, []).append((jobs[i].arrival, now, jobs[i].length))
    run = finished_run(jobs, finished_at)
    run.preemptions = sum(times_preempted)
    return run


def main() -> None:
    """The stack bench's workload (bench/within_class_stack.py: its tenants, seeds, arrivals and deadlines; short
    lengths drawn at 16-64 in place of its prompt search) through each policy: ratios to fcfs per seed."""
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from bench.harness import pct
    from bench.within_class_stack import MAX_TOKENS, SHORT, TENANTS, history, workload

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--jobs", type=int, default=160)
    parser.add_argument("--load", type=float, default=2.0)
    parser.add_argument("--seeds", type=int, default=8)
    parser.add_argument("--slots", type=int, default=8)
    parser.add_argument("--step-ms", type=float, default=70.0, help="a step of 8 sequences on the stack")
    parser.add_argument("--quantum", type=int, nargs="+", default=[64])
    parser.add_argument("--held", type=int, nargs="+", default=[0], help="jobs the engine holds (0: all)")
    parser.add_argument("--aging", type=float, default=30.0)
    parser.add_argument("--deadline-share", type=float, default=0.3)
    args = parser.parse_args()
    step = args.step_ms / 1000
    times = dict(
        slots=args.slots, step_seconds=step, max_tokens=MAX_TOKENS, cost_seconds_per_token=0.02,
        aging_seconds=args.aging, margin_seconds=5.0,
    )  # fmt: skip

    def figures(run: ModelRun) -> tuple[float, float, float]:
        return sum(run.latencies) / len(run.latencies), pct(run.latencies, 99), run.tokens / run.span

    def ratio(run: ModelRun, base: ModelRun) -> str:
        (m, p, t), (bm, bp, bt) = figures(run), figures(base)
        return f"{m / bm:.2f}/{p / bp:.2f}/{t / bt:.2f}"

    print("seed: policy mean/p99/throughput as ratios to fcfs (fcfs mean s)")
    pooled: dict[str, list[float]] = {}
    for seed in range(args.seeds):
        rng = random.Random(seed + 100)
        shorts = [([], rng.randint(*SHORT)) for _ in range(24)]
        prompts = {"short": shorts, "long": [([], MAX_TOKENS)]}
        mean = {k: sum(n for _, n in v) / len(v) for k, v in prompts.items()}
        mix = sum(s * (lg * mean["long"] + (1 - lg) * mean["short"]) for s, lg in TENANTS.values())
        ns = argparse.Namespace(seed=seed, jobs=args.jobs, deadline_share=args.deadline_share, long="max")
        jobs = [
            ModelJob(j.tenant, j.arrival, j.length, None if j.deadline is None else j.arrival + j.deadline)
            for j in workload(ns, prompts, args.load * args.slots / step / mix, step)
        ]
        past = history(seed, (MAX_TOKENS, MAX_TOKENS))
        fcfs = simulate(jobs, past, "fcfs", **times)
        runs = {
            "predicted": simulate(jobs, past, "predicted", **times),
            "oracle": simulate(jobs, past, "predicted", oracle=True, **times),
        }
        for q in args.quantum:
            for h in args.held:
                runs[f"las q{q} h{h or 'all'}"] = simulate_preemptive(
                    jobs, past, quantum=q, held=h or None, **times
                )
        line = [f"{seed}: fcfs {figures(fcfs)[0]:.1f} s"]
        for name, run in runs.items():
            line.append(f"{name} {ratio(run, fcfs)} ({run.preemptions} pre)")
            pooled.setdefault(name, []).append(figures(run)[0] / figures(fcfs)[0])
        print("; ".join(line), flush=True)
    for name, ratios in pooled.items():
        ratios.sort()
        print(f"{name}: mean ratio median {ratios[len(ratios) // 2]:.2f} ({ratios[0]:.2f}-{ratios[-1]:.2f})")


if __name__ == "__main__":
    main()
