"""Serving latency under open-loop load: priorities, preemption (swap vs recompute), chunked prefill.

One seeded trace is replayed against four engine configurations. Requests arrive as a Poisson
process (no HTTP): the driver is a single loop that, between `engine.step()` calls, adds every
request whose arrival time has passed (the simulated clock is the real `time.perf_counter()`), so a
request that arrives during a step waits for that step, as it would in a server. Trace:

- short requests, Poisson at `--rate` per second (default 8): random token-id prompts of 32-256
  tokens, 16-128 output tokens, greedy with `ignore_eos`; 10% urgent (priority 0), 90% bulk
  (priority 9);
- bursts of long prompts: every `--burst-every` seconds (default 5), 4 prompts of ~1500 tokens
  (1400-1600), 16 output tokens, priority 9.

Configurations (same model, block size 16, budget 256 tokens (`--budget`; 512 gave a 4.3x urgent
TTFT ratio against 2.3x at 256 on the same trace), 64 sequences, a device pool of 192
blocks (3072 tokens: half a burst) so that saturation forces preemption, a host pool of 2048
blocks, enough for every swapped sequence):

- fcfs:          every request at priority 5 (no priority preemption), swap mode;
- prio_recompute: real priorities, `preemption_mode="recompute"`, no host pool;
- prio_swap:     real priorities, `preemption_mode="swap"`;
- prio_swap_nochunk: as prio_swap with `enable_chunked_prefill=False`;
- prio_swap_nocache: as prio_swap with `enable_prefix_caching=False` (only when named in `--configs`:
  the trace's prompts share nothing, so it shows what caching costs when it cannot help).

Per request we record its arrival (trace time), the time of the step output that carried each of
its tokens, its priority and `num_preemptions`, plus the RequestOutput timing fields. TTFT = first
token - arrival, as the engine's caller sees it: the request's arrival to the end of the step whose
output carried its first token (this bench measures the scheduler; bench/e2e.py and bench/backlog.py
time a client over HTTP, from its send to the first streamed token). TBT = the gaps between consecutive tokens of a request; a gap during which the
request was preempted (its `num_preemptions` grew) is a "resume gap": it is reported apart and left
out of TBT (it measures preemption, not batching). "During bursts" = gaps that overlap a burst
window, from the burst's arrival to the first token of its last long prompt.

Threads: by default the engine gets one core less than the machine has (1 of 2 here). A step's
intra-op threads meet at a barrier after every op, so one that loses its core for a moment (to the
trace driver, the OS, another tenant) stretches the whole step; with a core left over, step times are
steadier. The trace is open-loop and the engine keeps up with it either way (the same ~555 tok/s with
1 or 2 threads); `--threads 2` gives the all-cores figures.

Each run also records the share of the machine's CPU used by other processes while it ran
("others" column; near 0% = undisturbed): the machine these run on may be shared. `--wait-quiet S`
waits (up to S seconds) before each run until other processes leave the CPU idle.

Reference times: the urgent class's idle TTFT (its own prompts, run one at a time on an idle
engine, best of 3 tries each), and the median time of a full-budget step (steps of the prio_swap
run that scheduled at least 95% of the token budget; an idle-engine prefill-only figure is
reported beside it). With attention-aware chunks (the engine's default) a chunk deep in a long
prompt takes the whole budget with fewer tokens, by design: such steps cost about as much as a
full-budget step near position 0, which is what the reference measures.

Targets (issue 3): prio_swap urgent p99 TTFT <= 2x idle p99 TTFT (same prompts; fcfs's ratio is
reported too); with chunked prefill the p99 TBT during bursts <= 1.25x the median full-budget step
and >= 3x lower than with chunking off.

Model: a seeded random Llama, by default 4 layers, hidden 256, 4 heads / 2 KV heads, intermediate
704, vocab 8192 (the issue-2 model with `--model-size issue2`), so a full run stays under ~6 minutes
on a 2-core CPU. Output: a table per configuration, target checks, `--json`, and a PNG of the
latency distributions in bench/out/serving.png (copied to bench/serving.png for the README).

    python bench/serving.py              # full run
    python bench/serving.py --quick      # smoke run (~1 minute)
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere without installing

from batching import Engine, EngineConfig, SamplingParams  # noqa: E402
from bench.engine_throughput import build_model_dir  # noqa: E402
from bench.harness import Interference, markdown_table, pct, run_info, wait_for_quiet, write_result  # noqa: E402
from workers.process_tuning import settle_for_serving  # noqa: E402

BENCH_DIR = Path(__file__).resolve().parent
DEFAULT_PNG = str(BENCH_DIR / "out" / "serving.png")
MODEL_SIZES = {
    "small": dict(
        hidden_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=704,
    ),
    "issue2": dict(
        hidden_size=512,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
        intermediate_size=1408,
    ),
}
BUDGET = 256
BLOCK_SIZE = 16
MAX_NUM_SEQS = 64
CONFIGS = {
    "fcfs": dict(preemption_mode="swap", fcfs=True),
    "prio_recompute": dict(preemption_mode="recompute", num_host_blocks=0),
    "prio_swap": dict(preemption_mode="swap"),
    "prio_swap_nochunk": dict(preemption_mode="swap", enable_chunked_prefill=False),
    "prio_swap_nocache": dict(preemption_mode="swap", enable_prefix_caching=False),  # not in the default set
}
DEFAULT_CONFIGS = ("fcfs", "prio_recompute", "prio_swap", "prio_swap_nochunk")
CLASSES = ("urgent", "bulk", "long")  # priority 0 short, priority 9 short, priority 9 long prompt


# --- the trace --------------------------------------------------------------------------------------


@dataclass(slots=True)
class Arrival:
    t: float  # seconds after the start of the run
    prompt: list[int]
    max_tokens: int
    priority: int
    cls: str  # one of CLASSES
    burst: int | None = None


def make_trace(
    duration: float,
    rate: float,
    burst_every: float,
    seed: int,
    vocab: int = 8192,
    burst_size: int = 4,
    long_len=(1400, 1600),
    urgent_share: float = 0.1,
) -> list[Arrival]:
    rng = random.Random(seed)

    def prompt(n):
        return [rng.randrange(3, vocab) for _ in range(n)]

    trace = []
    t = rng.expovariate(rate)
    while t < duration:
        urgent = rng.random() < urgent_share
        trace.append(
            Arrival(
                t,
                prompt(rng.randint(32, 256)),
                rng.randint(16, 128),
                0 if urgent else 9,
                "urgent" if urgent else "bulk",
            )
        )
        t += rng.expovariate(rate)
    burst, t = 0, burst_every / 2
    while t < duration:
        for k in range(burst_size):
            trace.append(Arrival(t + 0.001 * k, prompt(rng.randint(*long_len)), 16, 9, "long", burst))
        burst, t = burst + 1, t + burst_every
    return sorted(trace, key=lambda a: a.t)


# --- driving the engine -----------------------------------------------------------------------------


@dataclass(slots=True)
class Record:
    arrival: Arrival
    token_times: list[float] = field(default_factory=list)  # trace time of the step output of each token
    resume_gap: list[bool] = field(default_factory=list)  # per gap: the request was preempted during it
    num_preemptions: int = 0
    finished: bool = False
    engine_times: dict = field(default_factory=dict)  # RequestOutput timing fields, trace seconds


@dataclass(slots=True)
class Step:
    start: float  # trace seconds
    end: float
    num_tokens: int  # stats()["last_step_num_tokens"]
    budget_used: int  # stats()["last_step_budget_used"]: tokens priced by the step's cost (decodes, context)
    kv_usage: float
    num_waiting: int
    num_swapped: int
    blocks_copied: int  # blocks swapped out + in during this step

    @property
    def seconds(self) -> float:
        return self.end - self.start


def make_engine(model_dir, device, num_device_blocks, num_host_blocks, **overrides) -> Engine:
    kw = dict(
        model=model_dir,
        dtype="float32",
        device=device,
        block_size=BLOCK_SIZE,
        num_device_blocks=num_device_blocks,
        num_host_blocks=num_host_blocks,
        max_num_seqs=MAX_NUM_SEQS,
        max_num_batched_tokens=BUDGET,
        max_model_len=2048,
    )
    kw.update(overrides)
    return Engine(EngineConfig(**kw))


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def warm_up(engine: Engine, vocab: int) -> None:
    """A few short requests and one prompt of several chunks, so every code path has run once."""
    rng = random.Random(1)
    prompts = [[rng.randrange(3, vocab) for _ in range(n)] for n in (40, 90, 700)]
    engine.generate(prompts, [greedy(4), greedy(4), greedy(2)])


def drive(engine: Engine, trace: list[Arrival], fcfs: bool, time_cap: float, label: str):
    """Replay `trace` in real time. Returns (records by id, step log, last stats)."""
    records: dict[str, Record] = {}
    steps: list[Step] = []
    swapped_blocks = 0
    t0, wall0 = time.perf_counter(), time.time()
    i = 0
    bar = tqdm(total=len(trace), desc=f"{label:<18}", unit="req")
    while True:
        now = time.perf_counter() - t0
        while i < len(trace) and trace[i].t <= now:
            a = trace[i]
            rid = f"{label}-{i}"
            engine.add_request(rid, a.prompt, greedy(a.max_tokens), priority=5 if fcfs else a.priority)
            records[rid] = Record(a)
            i += 1
        if not engine.has_unfinished_requests():
            if i == len(trace):
                break
            time.sleep(max(0.0, trace[i].t - now))
            continue
        if now > time_cap:
            for rid, rec in records.items():
                if not rec.finished:
                    engine.abort(rid)
            engine.step()
            break
        start = time.perf_counter() - t0
        outs = engine.step()
        end = time.perf_counter() - t0
        st = engine.stats()
        moved = st["num_blocks_swapped_out"] + st["num_blocks_swapped_in"]
        steps.append(
            Step(
                start,
                end,
                st["last_step_num_tokens"],
                st["last_step_budget_used"],
                st["device_kv_usage"],
                st["num_waiting"],
                st["num_swapped"],
                moved - swapped_blocks,
            )
        )
        swapped_blocks = moved
        for out in outs:
            rec = records.get(out.request_id)
            if rec is None:
                continue
            new = len(out.token_ids) - len(rec.token_times)
            for _ in range(max(new, 0)):
                if rec.token_times:
                    rec.resume_gap.append(out.num_preemptions > rec.num_preemptions)
                rec.token_times.append(end)
                rec.num_preemptions = out.num_preemptions
            rec.num_preemptions = out.num_preemptions
            if out.finished:
                rec.finished = out.finish_reason == "length"
                rec.engine_times = {
                    k: (getattr(out, k) - wall0 if getattr(out, k) is not None else None)
                    for k in ("arrival_time", "first_token_time", "finish_time")
                }
                bar.update(1)
    bar.close()
    return records, steps, engine.stats()


def idle_ttft(engine: Engine, prompts: list[list[int]], rounds: int = 3) -> list[float]:
    """TTFT of each prompt run alone on an idle engine, priority 0: the best of `rounds` tries, so a
    spell of background load does not inflate the reference."""
    best = [float("inf")] * len(prompts)
    for r in range(rounds):
        for k, prompt in enumerate(prompts):
            rid = f"idle-{r}-{k}"
            engine.block_manager.reset_prefix_cache()  # a try after the first must not reuse its KV
            t = time.perf_counter()
            engine.add_request(rid, prompt, greedy(2), priority=0)
            while engine.has_unfinished_requests():
                for o in engine.step():
                    if o.request_id == rid and len(o.token_ids) == 1:
                        best[k] = min(best[k], time.perf_counter() - t)
    return best


def idle_full_steps(engine: Engine, vocab: int, n_chunks: int = 3) -> list[float]:
    """Step times of a prompt of n_chunks x budget tokens alone: prefill-only full-budget steps."""
    rng = random.Random(2)
    engine.add_request("idle-full", [rng.randrange(3, vocab) for _ in range(n_chunks * BUDGET)], greedy(1))
    times = []
    while engine.has_unfinished_requests():
        t = time.perf_counter()
        engine.step()
        # a full-budget step by the scheduler's own pricing (tokens + attention + context, step_cost.py)
        if engine.stats()["last_step_budget_used"] >= 0.95 * BUDGET:
            times.append(time.perf_counter() - t)
    return times


# --- analysis ---------------------------------------------------------------------------------------


def burst_windows(records) -> list[tuple[float, float]]:
    windows: dict[int, list[float]] = {}
    for rec in records.values():
        a = rec.arrival
        if a.burst is None:
            continue
        end = rec.token_times[0] if rec.token_times else float("inf")
        w = windows.setdefault(a.burst, [a.t, a.t])
        w[0], w[1] = min(w[0], a.t), max(w[1], end)
    return sorted(tuple(w) for w in windows.values())


def analyse(records, steps, stats, budget=BUDGET) -> dict:
    windows = burst_windows(records)
    ttft = {c: [] for c in CLASSES}
    tbt = {c: [] for c in CLASSES}
    resume = {c: [] for c in CLASSES}
    burst_tbt, burst_tbt_with_resume = [], []
    unfinished = {c: 0 for c in CLASSES}
    for rec in records.values():
        c = rec.arrival.cls
        if not rec.finished:
            unfinished[c] += 1
        if rec.token_times:
            ttft[c].append(rec.token_times[0] - rec.arrival.t)
        times = rec.token_times
        for k in range(1, len(times)):
            gap, was_preempted = times[k] - times[k - 1], rec.resume_gap[k - 1]
            (resume if was_preempted else tbt)[c].append(gap)
            if any(times[k] > ws and times[k - 1] < we for ws, we in windows):
                burst_tbt_with_resume.append(gap)
                if not was_preempted:
                    burst_tbt.append(gap)
    full = [st.seconds for st in steps if 0.95 * budget <= st.budget_used <= budget]
    copying = [st.seconds for st in steps if st.blocks_copied]
    span = steps[-1].end - steps[0].start if steps else 0.0
    tokens = sum(len(r.token_times) for r in records.values())
    return dict(
        ttft={c: dict(n=len(v), p50=pct(v, 50), p99=pct(v, 99)) for c, v in ttft.items()},
        tbt={c: dict(n=len(v), p50=pct(v, 50), p99=pct(v, 99)) for c, v in tbt.items()},
        resume_gaps={c: dict(n=len(v), p50=pct(v, 50), max=max(v) if v else None) for c, v in resume.items()},
        burst_tbt=dict(n=len(burst_tbt), p50=pct(burst_tbt, 50), p99=pct(burst_tbt, 99)),
        burst_tbt_with_resume=dict(n=len(burst_tbt_with_resume), p99=pct(burst_tbt_with_resume, 99)),
        full_step=dict(n=len(full), median=pct(full, 50), p99=pct(full, 99)),
        swap_step=dict(n=len(copying), median=pct(copying, 50), p99=pct(copying, 99)),
        step=dict(
            n=len(steps),
            median=pct([st.seconds for st in steps], 50),
            p99=pct([st.seconds for st in steps], 99),
            max=max((st.seconds for st in steps), default=None),
            max_tokens=max((st.num_tokens for st in steps), default=0),
        ),
        kv_usage_mean=float(np.mean([st.kv_usage for st in steps])) if steps else None,
        max_waiting=max((st.num_waiting for st in steps), default=0),
        max_swapped=max((st.num_swapped for st in steps), default=0),
        unfinished=unfinished,
        tokens=tokens,
        tok_s=tokens / span if span else None,
        preemptions=stats.get("num_preemptions"),
        blocks_swapped_out=stats.get("num_blocks_swapped_out"),
        recomputed_tokens=stats.get("num_recomputed_tokens"),
        windows=windows,
        _raw=dict(ttft=ttft, tbt=tbt, burst_tbt=burst_tbt),
        requests=[
            dict(
                id=rid,
                cls=r.arrival.cls,
                priority=r.arrival.priority,
                burst=r.arrival.burst,
                prompt_tokens=len(r.arrival.prompt),
                max_tokens=r.arrival.max_tokens,
                arrival=round(r.arrival.t, 6),
                token_times=[round(t, 6) for t in r.token_times],
                resume_gaps=[k + 1 for k, g in enumerate(r.resume_gap) if g],
                num_preemptions=r.num_preemptions,
                finished=r.finished,
                engine_times=r.engine_times,
            )
            for rid, r in records.items()
        ],
        steps=[
            dict(
                start=round(st.start, 6),
                end=round(st.end, 6),
                tokens=st.num_tokens,
                budget_used=st.budget_used,
                kv=round(st.kv_usage, 4),
                waiting=st.num_waiting,
                swapped=st.num_swapped,
                copied=st.blocks_copied,
            )
            for st in steps
        ],
    )


def check_targets(res: dict, idle: list[float]) -> dict:
    idle_p99 = pct(idle, 99)
    out = dict(idle_ttft_p50=pct(idle, 50), idle_ttft_p99=idle_p99)

    def ratio(a, b):
        return a / b if a is not None and b else None

    for name in ("prio_swap", "fcfs", "prio_recompute"):
        if name in res:
            out[f"{name}_urgent_p99_over_idle"] = ratio(res[name]["ttft"]["urgent"]["p99"], idle_p99)
    out["urgent_ttft_target_met"] = (out.get("prio_swap_urgent_p99_over_idle") or 1e9) <= 2.0
    if "prio_swap" in res:
        full = res["prio_swap"]["full_step"]["median"]
        on = res["prio_swap"]["burst_tbt"]["p99"]
        out["full_step_median"] = full
        out["chunked_burst_tbt_p99_over_full_step"] = ratio(on, full)
        out["chunked_tbt_target_met"] = (out["chunked_burst_tbt_p99_over_full_step"] or 1e9) <= 1.25
        if "prio_swap_nochunk" in res:
            off = res["prio_swap_nochunk"]["burst_tbt"]["p99"]
            out["nochunk_over_chunked_burst_tbt_p99"] = ratio(off, on)
            out["chunking_gain_target_met"] = (out["nochunk_over_chunked_burst_tbt_p99"] or 0) >= 3.0
    return out


# --- output -----------------------------------------------------------------------------------------


def ms(x):
    return "-" if x is None else f"{1000 * x:.0f}"


def print_report(res: dict, targets: dict, idle_full: list[float]) -> None:
    print(
        f"\n{'config':<18}{'class':<8}{'n':>5}{'TTFT p50':>10}{'p99':>8}{'TBT p50':>9}{'p99':>8}"
        f"{'resume gaps':>13}{'unfin':>6}   (ms)"
    )
    for name, r in res.items():
        for c in CLASSES:
            t, b, g = r["ttft"][c], r["tbt"][c], r["resume_gaps"][c]
            print(
                f"{name:<18}{c:<8}{t['n']:>5}{ms(t['p50']):>10}{ms(t['p99']):>8}{ms(b['p50']):>9}"
                f"{ms(b['p99']):>8}{g['n']:>6} {ms(g['max']):>6}{r['unfinished'][c]:>6}"
            )
    print(
        f"\n{'config':<18}{'tok/s':>6}{'steps':>6}{'step p50':>9}{'p99':>6}{'full p50':>9}{'p99':>6}"
        f"{'swap-step p50':>14}{'burst TBT p50':>14}{'p99':>6}{'(+resume)':>10}{'preempt':>8}{'swap-out':>9}"
        f"{'recomp':>7}{'KV use':>7}{'max wait':>9}{'others':>7}"
    )
    for name, r in res.items():
        print(
            f"{name:<18}{r['tok_s'] or 0:>6.0f}{r['step']['n']:>6}{ms(r['step']['median']):>9}"
            f"{ms(r['step']['p99']):>6}{ms(r['full_step']['median']):>9}{ms(r['full_step']['p99']):>6}"
            f"{ms(r['swap_step']['median']):>14}{ms(r['burst_tbt']['p50']):>14}{ms(r['burst_tbt']['p99']):>6}"
            f"{ms(r['burst_tbt_with_resume']['p99']):>10}{r['preemptions'] or 0:>8}"
            f"{r['blocks_swapped_out'] or 0:>9}{r['recomputed_tokens'] or 0:>7}{r['kv_usage_mean'] or 0:>7.0%}"
            f"{r['max_waiting']:>9}{_share(r['others_cpu_share']):>7}"
        )
    print(
        f"\nidle urgent TTFT p50/p99: {ms(targets['idle_ttft_p50'])}/{ms(targets['idle_ttft_p99'])} ms; "
        f"idle prefill-only full-budget step p50: {ms(pct(idle_full, 50))} ms "
        f"(others' CPU share {_share(targets.get('idle_others_cpu_share'))})"
    )

    def fmt(x, unit="x"):
        return "-" if x is None else f"{x:.2f}{unit}"

    print(
        f"[{'PASS' if targets['urgent_ttft_target_met'] else 'FAIL'}] prio_swap urgent p99 TTFT / idle p99: "
        f"{fmt(targets.get('prio_swap_urgent_p99_over_idle'))} (target <= 2x); fcfs: "
        f"{fmt(targets.get('fcfs_urgent_p99_over_idle'))}; prio_recompute: "
        f"{fmt(targets.get('prio_recompute_urgent_p99_over_idle'))}"
    )
    if "chunked_tbt_target_met" in targets:
        print(
            f"[{'PASS' if targets['chunked_tbt_target_met'] else 'FAIL'}] chunked p99 TBT during bursts / median "
            f"full-budget step ({ms(targets['full_step_median'])} ms): "
            f"{fmt(targets['chunked_burst_tbt_p99_over_full_step'])} (target <= 1.25x)"
        )
    if "chunking_gain_target_met" in targets:
        print(
            f"[{'PASS' if targets['chunking_gain_target_met'] else 'FAIL'}] p99 TBT during bursts, chunking off / "
            f"on: {fmt(targets['nochunk_over_chunked_burst_tbt_p99'])} (target >= 3x)"
        )


def _share(x):
    return "-" if x is None else f"{x:.0%}"


def plot(res: dict, targets: dict, idle: list[float], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    fig, axes = plt.subplots(2, 2, figsize=(13, 9))
    axes = axes.ravel()
    colors = dict(zip(CONFIGS, ("tab:gray", "tab:orange", "tab:blue", "tab:red", "tab:green"), strict=True))

    def cdf(ax, xs, **kw):
        if xs:
            xs = np.sort(np.asarray(xs) * 1000)
            ax.plot(xs, np.arange(1, len(xs) + 1) / len(xs), **kw)

    panels = [
        (axes[0], "TTFT, urgent (priority 0)", lambda r: r["_raw"]["ttft"]["urgent"]),
        (axes[1], "TTFT, bulk (priority 9, short)", lambda r: r["_raw"]["ttft"]["bulk"]),
        (axes[2], "time between tokens, all", lambda r: sum(r["_raw"]["tbt"].values(), [])),
        (axes[3], "time between tokens during long-prompt bursts", lambda r: r["_raw"]["burst_tbt"]),
    ]
    for ax, title, get in panels:
        for name, r in res.items():
            cdf(ax, get(r), label=name, color=colors.get(name), drawstyle="steps-post")
        ax.set_xscale("log")
        ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x:g}"))
        ax.set_title(title)
        ax.set_xlabel("ms")
        ax.grid(alpha=0.3, which="both")
    cdf(axes[0], idle, label="idle engine", color="k", linestyle="--", drawstyle="steps-post")
    if targets.get("idle_ttft_p99"):
        axes[0].axvline(2000 * targets["idle_ttft_p99"], color="k", linestyle=":", label="2x idle p99")
    if targets.get("full_step_median"):
        axes[3].axvline(
            1000 * targets["full_step_median"], color="k", linestyle="--", label="median full step"
        )
        axes[3].axvline(1250 * targets["full_step_median"], color="k", linestyle=":", label="1.25x")
    for ax in (axes[0], axes[2]):
        ax.set_ylabel("fraction of requests / gaps")
    for ax in (axes[0], axes[3]):
        ax.legend(fontsize=8, loc="lower right")
    fig.suptitle("genq serving benchmark: latency CDFs per configuration (same Poisson trace)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --- main -------------------------------------------------------------------------------------------


def main(argv=None):
    global BUDGET
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="short trace, smoke run")
    ap.add_argument("--device", default="cpu")
    ap.add_argument(
        "--threads",
        type=int,
        default=max(1, (os.cpu_count() or 1) - 1),
        help="torch intra-op threads (default: one core less than the machine has; see the docstring)",
    )
    ap.add_argument("--model-size", choices=sorted(MODEL_SIZES), default="small")
    ap.add_argument("--duration", type=float, help="seconds of arrivals (default 45; 10 with --quick)")
    ap.add_argument("--rate", type=float, default=8.0, help="short requests per second (Poisson)")
    ap.add_argument("--burst-every", type=float, default=5.0, help="seconds between long-prompt bursts")
    ap.add_argument("--device-blocks", type=int, default=192, help="device KV pool, blocks of 16 tokens")
    ap.add_argument("--host-blocks", type=int, default=2048, help="host KV pool for swap configs")
    ap.add_argument(
        "--idle-samples",
        type=int,
        default=None,
        help="urgent prompts timed on an idle engine (default: all of the trace's, so that both "
        "p99s are over the same prompts)",
    )
    ap.add_argument(
        "--configs",
        default=",".join(DEFAULT_CONFIGS),
        help="comma-separated subset of " + ",".join(CONFIGS),
    )
    ap.add_argument(
        "--wait-quiet",
        type=float,
        default=0.0,
        metavar="S",
        help="before each run wait up to S seconds for other processes to leave the CPU idle",
    )
    ap.add_argument("--budget", type=int, default=BUDGET, help=f"token budget per step (default {BUDGET})")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--json",
        help="write the figures with every request's token times and every step to this file "
        "(default: the figures alone to bench/out/serving.json)",
    )
    ap.add_argument(
        "--png", default=DEFAULT_PNG, help="where the plot goes (the default is copied to bench/)"
    )
    args = ap.parse_args(argv)
    BUDGET = args.budget
    run = run_info()

    torch.set_num_threads(args.threads)
    duration = args.duration or (10.0 if args.quick else 45.0)
    trace = make_trace(duration, args.rate, args.burst_every, args.seed)
    counts = {c: sum(a.cls == c for a in trace) for c in CLASSES}
    model_kwargs = MODEL_SIZES[args.model_size]
    print(
        f"trace: {duration:.0f}s, {len(trace)} requests {counts}, rate {args.rate}/s, bursts of 4 long "
        f"prompts every {args.burst_every}s"
    )
    print(
        f"model: {args.model_size} {model_kwargs}; device {args.device}, torch threads {torch.get_num_threads()}; "
        f"budget {BUDGET}, {args.device_blocks} device blocks x {BLOCK_SIZE}, {args.host_blocks} host blocks"
    )

    results, idle, idle_full, stats, idle_load = {}, [], [], {}, None
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="genq-serving-") as model_dir:
        build_model_dir(model_dir, args.seed, **model_kwargs)
        for name in args.configs.split(","):
            opts = dict(CONFIGS[name])
            fcfs = opts.pop("fcfs", False)
            host = opts.pop("num_host_blocks", args.host_blocks)
            engine = make_engine(model_dir, args.device, args.device_blocks, host, **opts)
            warm_up(engine, 8192)
            settle_for_serving()  # as the worker does once its engine is built (workers/engine_host.py)
            if name == "prio_swap":
                urgent = [a.prompt for a in trace if a.cls == "urgent"][: args.idle_samples]  # None: all
                if args.wait_quiet:
                    wait_for_quiet(args.wait_quiet)
                with Interference() as idle_load:
                    idle = idle_ttft(engine, urgent)
                    idle_full = idle_full_steps(engine, 8192)
                engine.block_manager.reset_prefix_cache()  # the trace must not find its urgent prompts cached
            if args.wait_quiet:
                wait_for_quiet(args.wait_quiet)
            with Interference() as load:
                records, steps, stats[name] = drive(engine, trace, fcfs, time_cap=duration + 40, label=name)
            results[name] = analyse(records, steps, stats[name], budget=BUDGET)
            results[name]["others_cpu_share"] = load.share
            del engine
    targets = check_targets(results, idle)
    targets["idle_others_cpu_share"] = idle_load.share if idle_load is not None else None
    print_report(results, targets, idle_full)
    load = (run["load_avg"], os.getloadavg())
    print(
        "load average (1/5/15 min) at start {:.1f}/{:.1f}/{:.1f}, at end {:.1f}/{:.1f}/{:.1f}".format(
            *load[0], *load[1]
        )
    )
    print(f"total wall time {time.perf_counter() - t_start:.0f}s")

    png = Path(
        args.png
        if not (args.quick and args.png == DEFAULT_PNG)
        else DEFAULT_PNG.replace(".png", "_quick.png")
    )
    plot(results, targets, idle, png)
    print(f"wrote {png}")
    if not args.quick and args.png == DEFAULT_PNG:
        shutil.copyfile(png, BENCH_DIR / "serving.png")
        print(f"wrote {BENCH_DIR / 'serving.png'}")
    fig = dict(
        duration=duration,
        rate=args.rate,
        burst_every=args.burst_every,
        requests=counts,
        model=model_kwargs,
        budget=BUDGET,
        block_size=BLOCK_SIZE,
        device_blocks=args.device_blocks,
        host_blocks=args.host_blocks,
        threads=torch.get_num_threads(),
        device=args.device,
        load_avg=load,
        idle_ttft=idle,
        idle_full_steps=idle_full,
        targets=targets,
        configs={
            k: {kk: vv for kk, vv in v.items() if kk not in ("_raw", "requests", "steps")}
            for k, v in results.items()
        },
        engine_stats=stats,
    )
    if args.json:
        fig["trace"] = {k: dict(requests=v["requests"], steps=v["steps"]) for k, v in results.items()}
    write_result("serving", fig, headline(targets), args.json, run=run)


def headline(targets: dict) -> str:
    """The issue-3 checks as bench/RESULTS.md keeps them."""

    def row(label: str, key: str, target: str, met: str) -> list[str]:
        value = targets.get(key)
        verdict = "-" if met not in targets else ("met" if targets[met] else "not met")
        return [label, "-" if value is None else f"**{value:.2f}x**", target, verdict]

    return markdown_table(
        ["check", "figure", "target", "met"],
        [
            row(
                "urgent p99 TTFT under saturation / idle p99 (priority + swap)",
                "prio_swap_urgent_p99_over_idle",
                "<= 2x",
                "urgent_ttft_target_met",
            ),
            row(
                "p99 time between tokens during bursts / median full-budget step (chunked)",
                "chunked_burst_tbt_p99_over_full_step",
                "<= 1.25x",
                "chunked_tbt_target_met",
            ),
            row(
                "p99 time between tokens during bursts, chunking off / on",
                "nochunk_over_chunked_burst_tbt_p99",
                ">= 3x",
                "chunking_gain_target_met",
            ),
        ],
    )


if __name__ == "__main__":
    main()
