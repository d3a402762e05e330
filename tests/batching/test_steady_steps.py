"""The steady step's incremental state (issue 38) against a rebuild from scratch.

A steady decode step (the same sequences as the step before, nothing added, finished or preempted) skips the
per-sequence passes: the scheduler re-plans from its last plan (`Scheduler._steady`), the stop check and the
report take the batch as the last step left it (stopping.py `_PlainBatch`, step_deltas.py `_SteadyRows`), and
the runner its input ids from the last sampled tokens. These tests run random workloads and compare, at every
step, what the incremental path gives with what the from-scratch path gives on the same state:

1. the Scheduler with a fake runner: each step is also scheduled from scratch on a deep copy of the scheduler
   (its steady plan forgotten); both give the same step and leave the same blocks, cache and pools;
2. two Engines over the tiny float64 Llama, one stepping as it does, the other with every memo forgotten
   before each step: the same step_deltas() columns at every step, the same outputs and counters.
"""

from __future__ import annotations

import copy
import random

import pytest

from batching import EngineConfig, SamplingParams
from batching.block_manager import BlockManager, blocks_for
from batching.engine import Engine
from batching.scheduler import Scheduler
from batching.sequence import Sequence, SequenceStatus
from tests.batching.conftest import random_prompts

# --- 1. the scheduler --------------------------------------------------------------------------------


def _fake_run(sched: Scheduler, out, rng: random.Random, finished: set[str]) -> None:
    """The runner and sampler: KV computed, a token where a chunk completes; a sequence ends at its max_tokens
    or, now and then, as if it sampled a stop token."""
    for seq, n in zip(out.seqs, out.num_scheduled_tokens, strict=True):
        seq.num_computed_tokens += n
        if seq.num_computed_tokens == seq.num_tokens:
            seq.token_ids.append(rng.randrange(3, 40))
            if seq.num_output_tokens >= seq.params.max_tokens or rng.random() < 0.01:
                sched.finish(seq, SequenceStatus.FINISHED_LENGTH)
                finished.add(seq.req_id)


def _state(sched: Scheduler) -> tuple:
    """Everything a step decides or leaves, by request id."""
    bm = sched.block_manager
    seqs = {s.req_id: s for s in sched.live_sequences()}
    return (
        sorted(
            (
                r,
                int(s.status),
                list(s.block_table),
                list(s.host_block_table),
                s.num_computed_tokens,
                s.num_cache_offered_blocks,
                list(s.block_hashes),
            )
            for r, s in seqs.items()
        ),
        dict(bm.cached),
        list(bm.hash_of_block),
        list(bm.ref_counts),
        list(bm.free_device),
        list(bm.free_host),
        [s.req_id for s in sched.running],
        sched.num_preemptions,
    )


def _plan(out) -> tuple:
    return (
        [s.req_id for s in out.seqs],
        list(out.num_scheduled_tokens),
        out.num_decodes,
        list(out.swap_out),
        list(out.swap_in),
        [s.req_id for s in out.preempted],
    )


@pytest.mark.parametrize("seed", range(12))
def test_steady_schedule_equals_a_schedule_from_scratch(seed):
    """At every step, the scheduler's step (steady when it can be) equals the step scheduled from scratch on a
    copy of the same state, and leaves the same blocks, prefix cache and pools; the steady path ran."""
    rng = random.Random(seed)
    block_size = rng.choice([1, 2, 4])
    width = rng.choice([3, 20])  # a few (positions in a list) or many (in numpy)
    config = EngineConfig(
        block_size=block_size,
        num_device_blocks=rng.choice([width * 6, width * 40]) // block_size,  # scarce: preemptions
        num_host_blocks=rng.choice([0, 40]),
        max_num_seqs=width,
        max_num_batched_tokens=rng.choice([width, 64]),
        preemption_mode=rng.choice(["swap", "recompute"]),
        enable_chunked_prefill=rng.random() < 0.8,
        scheduling_policy=rng.choice(["fcfs", "predicted", "preemptive"]),
        attention_aware_chunks=rng.random() < 0.5,
    )
    clock = [0.0]
    sched = Scheduler(
        config,
        BlockManager(config.num_device_blocks, config.num_host_blocks, block_size),
        clock=lambda: clock[0],
    )
    finished: set[str] = set()
    steady_steps = 0
    added = 0

    def add() -> None:
        nonlocal added
        prompt = [5] * rng.randrange(0, 6) + random_prompts(seed * 1000 + added, [rng.randrange(1, 10)])[0]
        max_tokens = rng.randrange(1, 40)
        if blocks_for(len(prompt) + max_tokens - 1, block_size) > config.num_device_blocks:
            return
        clock[0] += 0.5
        sched.add(
            Sequence(
                f"r{added}",
                prompt,
                SamplingParams(max_tokens=max_tokens, temperature=0),
                rng.randrange(0, 3),
                0,
                arrival_time=clock[0],
            )
        )
        added += 1

    for _ in range(width):
        add()
    for _ in range(300):
        roll = rng.random()
        live = sched.live_sequences()
        if roll < 0.03:
            add()
        elif roll < 0.05 and live:
            victim = rng.choice(live)
            sched.finish(victim, SequenceStatus.FINISHED_ABORTED)
            finished.add(victim.req_id)
        clock[0] += 0.1
        twin = copy.deepcopy(sched)
        twin.forget_steady()
        expected = twin.schedule()
        steady = sched._steady is not None and sched._steady.version == sched.version
        out = sched.schedule()
        assert _plan(out) == _plan(expected)
        if out.decode_context is not None and expected.decode_context is not None:
            assert out.decode_context == expected.decode_context
        assert sched.last_budget_used == twin.last_budget_used
        assert _state(sched) == _state(twin)
        sched.block_manager.check_invariants(sched.live_sequences())
        steady_steps += steady and out.num_decodes == len(out.seqs) > 0
        _fake_run(sched, out, rng, finished)
        if not sched.live_sequences():
            for _ in range(width):
                add()
    assert steady_steps > 20, "the steady path hardly ran"


# --- 2. the engine -----------------------------------------------------------------------------------


def _forget_memos(engine: Engine) -> None:
    """Every step from scratch: the scheduler's plan, the stop check's and the report's batches, the runner's
    last decode batch and the sampler's and engine's memos of the last rows."""
    engine.scheduler.forget_steady()
    engine.stop_checker._plain = None
    engine._report_memo.rows = None
    engine.runner._last_decodes = None
    engine.sampler._plain_seqs = []
    engine._overlappable_seqs = []


def _columns(deltas) -> tuple:
    return (
        deltas.request_ids,
        deltas.token_starts,
        deltas.token_ids,
        deltas.text_starts,
        deltas.texts,
        deltas.finish_reasons,
        deltas.logprobs,
        # (each engine's own clock: whether a first token's time is there, not its value)
        [
            (
                n.request_id,
                n.num_preemptions,
                n.first_token_time is None,
                n.prompt_token_ids,
                n.prompt_logprobs,
            )
            for n in deltas.news
        ],
    )


def _params(rng: random.Random, plain: bool) -> SamplingParams:
    """Random params: `plain`, greedy with the text made by the worker (the service's common request), else a mix."""
    kind = rng.random()
    extra: dict = {}
    if plain:
        extra = dict(detokenize=False)
    elif kind < 0.1:
        extra = dict(stop=["ab", "z"])
    elif kind < 0.15:
        extra = dict(logprobs=1)
    elif kind < 0.2:
        extra = dict(min_tokens=3)
    elif kind < 0.3:
        extra = dict(detokenize=False)
    elif kind < 0.35:
        extra = dict(temperature=1.0, seed=rng.randrange(100))
    return SamplingParams(
        max_tokens=rng.randrange(4, 90),
        temperature=extra.pop("temperature", 0),
        ignore_eos=rng.random() < 0.5,
        stop_token_ids=[rng.randrange(3, 259)] if rng.random() < 0.3 else [],
        output_kind="delta",
        **extra,
    )


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("plain", [False, True])
@pytest.mark.parametrize("seed", range(2))
def test_steady_engine_steps_equal_steps_from_scratch(
    make_cpu_engine, seed, plain, async_scheduling, monkeypatch
):
    """Two engines take the same random workload (adds, aborts, stops by token, length and string, log
    probabilities, sampled rows; 20 sequences, so that the runner's many-decode path runs too): the one that
    keeps its memos reports what the one that forgets them before every step reports, step by step."""
    kwargs = dict(
        block_size=4,
        num_device_blocks=600,
        num_host_blocks=40,
        max_num_seqs=24,
        max_num_batched_tokens=64,
        async_scheduling=async_scheduling,
        seed=seed,
        dtype="float32",  # the CPU kernels' path (float32, bfloat16), whose runner packs decodes by columns
        # no decision by the wall clock (budgets priced on step times, a step-time estimate in the order): the two
        # engines' steps take different times, and must schedule the same
        scheduling_policy="fcfs",
        attention_aware_chunks=False,
    )
    fast, slow = make_cpu_engine(**kwargs), make_cpu_engine(**kwargs)
    hits = _count_steady_paths(fast, monkeypatch)
    rng = random.Random(seed)
    prompts = random_prompts(seed, [rng.randrange(2, 12) for _ in range(90)])
    added = 0

    def add() -> None:
        nonlocal added
        params = _params(rng, plain)
        for engine in (fast, slow):
            engine.add_request(f"q{added}", prompts[added % len(prompts)], copy.deepcopy(params), priority=5)
        added += 1

    for _ in range(24):
        add()
    steps = 0
    while (fast.has_unfinished_requests() or added < 90) and steps < 1000:
        roll = rng.random()
        if (
            roll < 0.04 or len(fast.requests) < 18
        ) and added < 90:  # (mostly many running: the runner's path)
            add()
        elif roll < 0.06 and fast.requests:
            victim = rng.choice(sorted(fast.requests))
            assert fast.abort(victim) == slow.abort(victim)
        _forget_memos(slow)
        assert _columns(fast.step_deltas()) == _columns(slow.step_deltas())
        fast.check_invariants()
        steps += 1
    assert not fast.has_unfinished_requests() and not slow.has_unfinished_requests()
    for key in ("num_generated_tokens", "num_preemptions", "num_steps", "num_prompt_tokens_computed"):
        assert fast.stats()[key] == slow.stats()[key], key
    # each incremental path ran (the runner's: sync only, its many-decode path is the CPU's synchronous one)
    assert min(hits["schedule"], hits["stop"], hits["report"]) > 10, hits
    assert hits["input ids"] > 10 or async_scheduling, hits


def _count_steady_paths(engine: Engine, monkeypatch) -> dict[str, int]:
    """Counts the steps that took each incremental path in `engine` (wrappers on its methods)."""
    from batching import step_deltas

    hits = dict(schedule=0, stop=0, report=0)
    hits["input ids"] = 0

    def counted(key, inner, hit=lambda result, *args: result is not None):
        def wrapper(*args):
            result = inner(*args)
            hits[key] += bool(hit(result, *args))
            return result

        return wrapper

    monkeypatch.setattr(
        engine.scheduler,
        "_schedule_steady",
        counted("schedule", engine.scheduler._schedule_steady, lambda r, *a: r),
    )
    monkeypatch.setattr(
        engine.stop_checker, "_advance_plain", counted("stop", engine.stop_checker._advance_plain)
    )
    monkeypatch.setattr(step_deltas._SteadyRows, "report", counted("report", step_deltas._SteadyRows.report))
    many_decodes = engine.runner._many_decodes

    def packed(seqs, last):  # (before the call, which takes the tokens)
        hits["input ids"] += last is not None and last.seqs == seqs and last.tokens is not None
        return many_decodes(seqs, last)

    monkeypatch.setattr(engine.runner, "_many_decodes", packed)
    return hits


def test_a_backlog_that_cannot_start_leaves_the_queues_version():
    """Every slot taken and a less urgent request waiting: each step tries to admit it and cannot, which changes
    nothing, so the queues' version (step_deltas' epoch: its steady rows apply only while it holds) stays; it
    changes once the request starts."""
    config = EngineConfig(block_size=4, num_device_blocks=32, num_host_blocks=0, max_num_seqs=2)
    sched = Scheduler(config, BlockManager(32, 0, 4))
    params = SamplingParams(max_tokens=6, temperature=0)
    running = [Sequence(f"r{i}", [5, 6, 7], params, 1, 0, arrival_time=float(i)) for i in range(2)]
    backlog = Sequence("later", [5, 6], SamplingParams(max_tokens=2, temperature=0), 2, 0, arrival_time=3.0)
    for seq in (*running, backlog):
        sched.add(seq)
    rng, finished = random.Random(0), set()
    _fake_run(sched, sched.schedule(), rng, finished)  # the two start
    versions = []
    while backlog.status == SequenceStatus.WAITING and all(
        s.status == SequenceStatus.RUNNING for s in running
    ):
        versions.append(sched.version)
        out = sched.schedule()
        assert backlog not in out.seqs
        _fake_run(sched, out, rng, finished)
    assert len(versions) >= 3 and len(set(versions)) == 1, versions
