"""Scheduling within a priority class (issue 44): the same jobs under `fcfs` and `predicted`, in one run.

The engine alone (batching.Engine, the built-in tiny-llama on the CPU by default), jobs of one priority
arriving over time. Workload (seeded):

- Output lengths long-tailed: most jobs 16-64 new tokens, a tail of 1,000-2,000. Prompts of 8-32 token ids.
- Jobs come from tenants whose mixes differ: "chat" (2% long), "agent" (15% long), "writer" (50% long),
  sending 60% / 30% / 10% of the jobs (about 11% long in all).
- Every job asks max_tokens 2,000 (a loose bound, as clients send), greedy; its length is where it stops:
  the bench ends it at its drawn length (as an end of sequence would; its latency is that step's).
- The prediction the engine gets (`predicted_output_tokens`) is jobstore.output_length's statistic: the
  mean output of the tenant's last 32 jobs that finished before it arrived, capped by max_tokens (the
  tenant's history starts with 32 jobs drawn from its mix). It knows the tenant, never the job's length
  (`--predictor oracle` gives it the length: the bound a better predictor could reach).
- A share of the jobs (`--deadline-share`, 30%) carry a deadline: arrival + 3x the time the job takes
  alone (its length in steps) + a second.
- Arrivals: Poisson, the rate `--load` x the engine's capacity (a token per sequence per step, with
  max_num_seqs 8 so that jobs wait in the engine) / the mean job length. The default, 2.0, is a burst of
  about 40 s at twice what the engine can do, then the queue drains: at 1.3 or less queues stay short
  and the order within the class hardly matters (the two policies come out within 1%).

Time (`--clock`): by default a step's worth of time passes per engine step, `--step-ms` (20 ms, a GPU step
of a small model, what the policy's defaults assume): arrivals, deadlines, latencies and the scheduler's own
clock are in that time, so a pass gives the same figures on a busy machine (the engine runs its real
steps; only the clock is the steps'), and one pass per policy is enough. `--clock wall` runs in real time
instead: the capacity from a pilot pass, the policy's times (cost_seconds_per_token, aging_seconds,
deadline_margin_seconds) the defaults scaled by (its step time / 20 ms), two passes per policy in the
order fcfs, predicted, predicted, fcfs; there the figures move with what else the machine runs, so each
pass's CPU taken by others is printed (`--wait-quiet S` waits for an idle machine first). "real step ms"
is the engine's own time per step, the policy's host cost included.

Prints, per policy: mean, p50 and p99 job latency (arrival to last token), throughput (output tokens per
second from the first arrival to the last token) and the share of deadlines met; then predicted / fcfs
ratios against the issue's targets (mean <= 0.6x, p99 <= 1.2x, throughput >= 0.97x).

    .venv/bin/python bench/within_class.py            # about a minute on 2 cores
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.harness import Interference, pct, run_info, wait_for_quiet, write_result  # noqa: E402
from jobstore.output_length import RECENT_JOBS, predict_output_tokens  # noqa: E402

MAX_TOKENS = 2000
TENANTS = {"chat": (0.6, 0.02), "agent": (0.3, 0.15), "writer": (0.1, 0.5)}  # share of jobs, share long
DEFAULT_STEP_SECONDS = 0.02  # what EngineConfig's policy defaults assume a step takes


TARGETS = {"mean_latency": ("<=", 0.6), "p99_latency": ("<=", 1.2), "throughput": (">=", 0.97)}  # issue 44's


def policy_ratios(fcfs: dict, predicted: dict) -> dict[str, float]:
    """predicted / fcfs of the figures issue 44 sets targets on (from `figures()` of each policy's passes)."""
    return {
        "mean_latency": predicted["mean_latency_s"] / fcfs["mean_latency_s"],
        "p99_latency": predicted["p99_latency_s"] / fcfs["p99_latency_s"],
        "throughput": predicted["throughput_tok_s"] / fcfs["throughput_tok_s"],
    }


def ratio_rows(ratios: dict[str, float]) -> list[str]:
    """The ratios against TARGETS, as markdown table rows."""
    rows = ["", "| predicted / fcfs | ratio | target | met |", "|---|---|---|---|"]
    for name, ratio in ratios.items():
        op, bound = TARGETS[name]
        ok = ratio <= bound if op == "<=" else ratio >= bound
        rows.append(f"| {name} | {ratio:.2f}x | {op} {bound}x | {'yes' if ok else 'NO'} |")
    return rows


@dataclass
class Job:
    name: str
    tenant: str
    arrival: float  # seconds after the run starts
    prompt: list[int]
    length: int
    deadline: float | None  # seconds after the run starts


@dataclass
class Outcome:
    """One pass of the workload under one policy."""

    policy: str
    latencies: list[float] = field(default_factory=list)
    met: list[bool] = field(default_factory=list)  # of the jobs with a deadline
    tokens: int = 0
    span: float = 0.0  # seconds from the first arrival to the last token
    preemptions: int = 0
    steps: int = 0
    step_time: float = 0.0  # seconds in engine steps
    others_share: float | None = None  # the share of the CPU other processes took during the pass


def figures(passes: list[Outcome]) -> dict:
    """A policy's figures over its passes: latencies and deadlines pooled, throughput over their total span."""
    lat = [x for o in passes for x in o.latencies]
    met = [x for o in passes for x in o.met]
    shares = [o.others_share for o in passes if o.others_share is not None]
    return {
        "mean_latency_s": sum(lat) / len(lat),
        "p50_latency_s": pct(lat, 50),
        "p99_latency_s": pct(lat, 99),
        "throughput_tok_s": sum(o.tokens for o in passes) / sum(o.span for o in passes),
        "deadlines_met": sum(met) / len(met) if met else None,
        "num_deadlines": len(met),
        "preemptions": sum(o.preemptions for o in passes),
        # the passes' mean step time: policies compare only when the machine was as fast for both
        "step_seconds": sum(o.step_time for o in passes) / sum(o.steps for o in passes),
        "others_cpu_share": max(shares) if shares else None,
    }


def output_length(rng: random.Random, long_share: float) -> int:
    return rng.randint(1000, 2000) if rng.random() < long_share else rng.randint(16, 64)


def workload(args, rate: float, step_seconds: float) -> tuple[list[Job], dict[str, list[int]]]:
    rng = random.Random(args.seed)
    names, weights = list(TENANTS), [share for share, _ in TENANTS.values()]
    history = {t: [output_length(rng, TENANTS[t][1]) for _ in range(RECENT_JOBS)] for t in TENANTS}
    jobs, now = [], 0.0
    for i in range(args.jobs):
        now += rng.expovariate(rate)
        tenant = rng.choices(names, weights)[0]
        length = output_length(rng, TENANTS[tenant][1])
        prompt = [rng.randrange(3, 259) for _ in range(rng.randint(8, 32))]
        deadline = None
        if rng.random() < args.deadline_share:
            deadline = now + 3 * length * step_seconds + 1.0
        jobs.append(Job(f"j{i}", tenant, now, prompt, length, deadline))
    return jobs, history


def make_engine(args, policy: str, step_seconds: float):
    from batching import Engine, EngineConfig

    scale = step_seconds / DEFAULT_STEP_SECONDS
    defaults = EngineConfig()
    return Engine(
        EngineConfig(
            model=args.model,
            dtype="float32",
            device=args.device,
            max_num_seqs=args.max_num_seqs,
            scheduling_policy=policy,
            cost_seconds_per_token=defaults.cost_seconds_per_token * scale,
            aging_seconds=(args.aging_seconds if args.aging_seconds is not None else defaults.aging_seconds)
            * scale,
            deadline_margin_seconds=defaults.deadline_margin_seconds * scale,
        )
    )


def measure_capacity(args) -> tuple[float, float]:
    """(output tokens per second, seconds per step) of the engine kept full: a pilot pass, as the runs go (the
    loop reading outputs, a job ended at its length), of max_num_seqs jobs of 1,000 tokens together. Most of
    the workload's tokens are the long jobs' (about 86%), so a step's contexts are long: as long here."""
    rng = random.Random(args.seed + 1)
    pilot = [
        Job(f"p{i}", "chat", 0.0, [rng.randrange(3, 259) for _ in range(20)], 1000, None)
        for i in range(args.max_num_seqs)
    ]
    outcome = run(args, "fcfs", pilot, {"chat": []}, DEFAULT_STEP_SECONDS, steps_clock=False)
    return outcome.tokens / outcome.span, outcome.span / outcome.steps


class StepClock:
    """Time that advances by one step's duration per engine step (--clock steps): a pass is the same whatever
    else the machine runs, and its times are those of an engine whose steps take `step_seconds`."""

    def __init__(self, step_seconds: float):
        self.now, self.step_seconds = time.time(), step_seconds

    def __call__(self) -> float:
        return self.now


def run(
    args, policy: str, jobs: list[Job], history: dict[str, list[int]], step_seconds: float, steps_clock: bool
) -> Outcome:
    from batching import SamplingParams

    engine = make_engine(args, policy, step_seconds)
    clock = StepClock(step_seconds) if steps_clock else time.time
    if isinstance(clock, StepClock):
        engine.scheduler.order.clock = clock  # the scheduler's deadlines and step times in that time
    history = {t: list(h) for t, h in history.items()}
    by_name = {j.name: j for j in jobs}
    pending = sorted(jobs, key=lambda j: j.arrival)
    outcome = Outcome(policy)
    finished: set[str] = set()
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    start = clock()
    while pending or engine.has_unfinished_requests():
        now = clock() - start
        while pending and pending[0].arrival <= now + 1e-6:  # (start + arrival) - start rounds
            job = pending.pop(0)
            predicted = (
                job.length
                if args.predictor == "oracle"
                else predict_output_tokens(MAX_TOKENS, history[job.tenant][-RECENT_JOBS:])
            )
            engine.add_request(
                job.name,
                job.prompt,
                params,
                arrival_time=start + job.arrival,
                predicted_output_tokens=predicted,
                deadline=None if job.deadline is None else start + job.deadline,
            )
        if not engine.has_unfinished_requests():
            if isinstance(clock, StepClock):
                clock.now = start + pending[0].arrival
            else:
                time.sleep(max(0.0, min(0.01, pending[0].arrival - now)))
            continue
        outputs = engine.step()
        if isinstance(clock, StepClock):
            clock.now += step_seconds
        for out in outputs:
            job = by_name[out.request_id]
            if len(out.token_ids) >= job.length and job.name not in finished:
                if not out.finished:
                    engine.abort(job.name)  # its end: as an end of sequence would stop it here
                done = clock() - start
                finished.add(job.name)
                outcome.latencies.append(done - job.arrival)
                outcome.tokens += job.length
                outcome.span = done
                history[job.tenant].append(job.length)
                if job.deadline is not None:
                    outcome.met.append(done <= job.deadline)
    stats = engine.stats()
    outcome.preemptions = stats["num_preemptions"]
    outcome.steps, outcome.step_time = stats["num_steps"], stats["step_time_s"]
    return outcome


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--jobs", type=int, default=160)
    parser.add_argument(
        "--passes",
        type=int,
        default=None,
        help="passes per policy (fcfs predicted, predicted fcfs, ...); default 1 with --clock steps (a pass is the "
        "same every time), 2 with --clock wall",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--load",
        type=float,
        default=2.0,
        help="arrival rate x mean job length / capacity: 2.0 is a burst at twice what the engine can do (about "
        "40 s of arrivals), then the queue drains; at 1.3 or less queues stay short and the order hardly matters",
    )
    parser.add_argument("--max-num-seqs", type=int, default=8)
    parser.add_argument("--deadline-share", type=float, default=0.3)
    parser.add_argument("--model", default="tiny-llama")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--clock",
        choices=["steps", "wall"],
        default="steps",
        help="steps: time advances --step-ms per engine step (the same figures on a busy machine); wall: real "
        "time, the step time measured by a pilot pass",
    )
    parser.add_argument("--step-ms", type=float, default=20.0, help="--clock steps: one step's time")
    parser.add_argument(
        "--predictor",
        choices=["tenant", "oracle"],
        default="tenant",
        help="tenant: jobstore.output_length's statistic; oracle: each job's own length (the bound)",
    )
    parser.add_argument(
        "--aging-seconds", type=float, default=None, help="the aging bound (default: EngineConfig's, 30 s)"
    )
    parser.add_argument(
        "--wait-quiet", type=float, default=0.0, help="wait up to this many seconds for an idle machine first"
    )
    args = parser.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    info = run_info()
    if args.clock == "steps":
        step_seconds = args.step_ms / 1000
        capacity = args.max_num_seqs / step_seconds  # a full batch: a token per sequence per step
    else:
        capacity, step_seconds = measure_capacity(args)
    mean_length = sum(
        share * (long * 1500 + (1 - long) * 40) for share, long in TENANTS.values()
    )  # the mixes' mean output
    rate = args.load * capacity / mean_length
    jobs, history = workload(args, rate, step_seconds)
    print(
        f"capacity {capacity:.0f} tokens/s, a step {step_seconds * 1000:.1f} ms with {args.max_num_seqs} sequences; "
        f"{len(jobs)} jobs at "
        f"{rate:.2f}/s over {jobs[-1].arrival:.0f} s, {sum(j.length >= 1000 for j in jobs)} long, "
        f"{sum(j.deadline is not None for j in jobs)} with deadlines"
    )
    if args.passes is None:
        args.passes = 1 if args.clock == "steps" else 2
    passes: dict[str, list[Outcome]] = {"fcfs": [], "predicted": []}
    order = [("fcfs", "predicted") if i % 2 == 0 else ("predicted", "fcfs") for i in range(args.passes)]
    for policy in [
        p for pair in order for p in pair
    ]:  # ABBA: a machine slowing down or speeding up evens out
        wait_for_quiet(args.wait_quiet)
        with Interference() as load:
            outcome = run(args, policy, jobs, history, step_seconds, steps_clock=args.clock == "steps")
        outcome.others_share = load.share
        passes[policy].append(outcome)
    results = {policy: figures(runs) for policy, runs in passes.items()}
    fcfs, predicted = results["fcfs"], results["predicted"]
    ratios = policy_ratios(fcfs, predicted)
    rows = [
        "| policy | mean latency s | p50 s | p99 s | throughput tok/s | deadlines met | real step ms | others' CPU |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for policy, f in results.items():
        met = f"{f['deadlines_met']:.0%} of {f['num_deadlines']}" if f["deadlines_met"] is not None else "-"
        others = f"{f['others_cpu_share']:.0%}" if f["others_cpu_share"] is not None else "?"
        rows.append(
            f"| {policy} | {f['mean_latency_s']:.2f} | {f['p50_latency_s']:.2f} | {f['p99_latency_s']:.2f} "
            f"| {f['throughput_tok_s']:.0f} | {met} | {f['step_seconds'] * 1000:.1f} | {others} |"
        )
    rows += ratio_rows(ratios)
    speeds = predicted["step_seconds"] / fcfs["step_seconds"]
    if args.clock == "wall" and not 1 / 1.15 < speeds < 1.15:
        rows += [
            "",
            f"The runs' mean step times differ by {speeds:.2f}x: the machine was not as fast for both (others' "
            "CPU above), so the ratios compare more than the policies. Rerun on a quiet machine (--wait-quiet).",
        ]
    write_result(
        "within_class",
        {
            "step_seconds": step_seconds,
            "capacity_tok_s": capacity,
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
