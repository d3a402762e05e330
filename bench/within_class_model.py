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

bench/within_class_stack.py runs it on its own workload: the ratios a stack without overheads would reach,
beside the ratios the stack reached. The gap between the two is what the stack loses; the model's own ratio is
what the policy and its predictor can give on that workload at all.
"""

from __future__ import annotations

import heapq
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
        job = jobs[i]
        if oracle:
            return job.length
        recent = [n for a, f, n in done.get(job.tenant, []) if a < job.arrival and f < job.arrival]
        return predict_output_tokens(max_tokens, (history.get(job.tenant, []) + recent)[-RECENT_JOBS:])

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
    run = ModelRun()
    for i, job in enumerate(jobs):
        run.latencies.append(finished_at[i] - job.arrival)
        if job.deadline is not None:
            run.met.append(finished_at[i] <= job.deadline)
    run.tokens = sum(j.length for j in jobs)
    run.span = max(finished_at.values()) - min(j.arrival for j in jobs)
    return run
