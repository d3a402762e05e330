"""Under scheduling_policy "preemptive" (issue 44): within a priority class, a running sequence that has made
more tokens yields its slot to waiting ones that have made fewer (least attained service, batching/scheduler.py).
On the Scheduler with a fake runner and a fake clock: a long sequence yields to short ones of its class after
its quantum, never to a less urgent class, never with a deadline at risk or without room on the host; its
quanta double; a preempted one is overtaken only by sequences arriving within aging_seconds of its stop. On the
real Engine: output identical to transformers' generate() (greedy) and to a run alone (seeded) whatever the
preemptions, nothing recomputed."""

from __future__ import annotations

import pytest

from batching import EngineConfig, SamplingParams
from batching.block_manager import BlockManager
from batching.scheduler import QUANTUM_TOKENS, Scheduler
from batching.sequence import Sequence, SequenceStatus
from tests.batching.conftest import greedy, random_prompts
from tests.batching.test_admission_order import Clock, sequence
from tests.batching.test_scheduler_properties import run_fake_step

AGING = 10.0


def make_scheduler(
    clock: Clock, policy: str = "preemptive", max_num_seqs: int = 1, host: int = 256, **config
) -> Scheduler:
    """One slot by default: a short sequence starts only if the running one yields."""
    cfg = EngineConfig(
        **(
            dict(
                block_size=4,
                num_device_blocks=256,
                num_host_blocks=host,
                max_num_seqs=max_num_seqs,
                max_num_batched_tokens=64,
                scheduling_policy=policy,
                aging_seconds=AGING,
                cost_seconds_per_token=0.01,
            )
            | config
        )
    )
    return Scheduler(cfg, BlockManager(cfg.num_device_blocks or 0, host, 4), clock=clock)


def step(sched: Scheduler, clock: Clock, seconds: float = 0.1):
    out = run_fake_step(sched)
    clock.now += seconds
    return out


def run_until(sched: Scheduler, clock: Clock, seq: Sequence, output_tokens: int) -> None:
    while seq.num_output_tokens < output_tokens:
        step(sched, clock)


@pytest.mark.parametrize("policy", ["preemptive", "predicted"])
def test_a_long_sequence_yields_to_a_short_one_of_its_class_after_its_quantum(policy):
    clock = Clock()
    sched = make_scheduler(clock, policy)
    long = sequence("long", clock.now, output=400)
    sched.add(long)
    run_until(sched, clock, long, 20)
    short = sequence("short", clock.now, output=10)
    sched.add(short)
    # both at level 0 (fewer than QUANTUM_TOKENS made): the short one waits
    run_until(sched, clock, long, QUANTUM_TOKENS - 1)
    assert short.status == SequenceStatus.WAITING and not long.num_preemptions
    out = step(sched, clock)  # the long one makes its QUANTUM_TOKENS-th token
    out = step(sched, clock)
    if policy == "predicted":  # nothing yields within a class: the short one waits for the end
        assert out.preempted == [] and short.status == SequenceStatus.WAITING
        while long.status == SequenceStatus.RUNNING:
            step(sched, clock)
        assert short.num_output_tokens == 0
        return
    assert out.preempted == [long] and out.swap_out, "the long sequence kept its slot"
    assert long.status == SequenceStatus.SWAPPED and short in out.seqs
    while short.status != SequenceStatus.FINISHED_LENGTH:
        assert long.status == SequenceStatus.SWAPPED
        step(sched, clock)
    out = step(sched, clock)
    assert long in out.seqs and out.swap_in, "it resumes from host memory"
    assert long.num_output_tokens == QUANTUM_TOKENS + 1
    while long.status == SequenceStatus.RUNNING:
        step(sched, clock)
    assert long.status == SequenceStatus.FINISHED_LENGTH and long.num_preemptions == 1
    assert sched.num_recomputed_tokens == 0
    sched.block_manager.check_invariants([])


def test_it_never_yields_to_a_less_urgent_class_and_a_more_urgent_one_still_preempts_at_once():
    clock = Clock()
    sched = make_scheduler(clock)
    long = sequence("long", clock.now, output=300)
    sched.add(long)
    run_until(sched, clock, long, 2 * QUANTUM_TOKENS)
    later = sequence("later", clock.now, output=10, priority=6)
    sched.add(later)
    run_until(sched, clock, long, 4 * QUANTUM_TOKENS)
    assert later.status == SequenceStatus.WAITING and not long.num_preemptions
    urgent = sequence("urgent", clock.now, output=10, priority=4)
    sched.add(urgent)
    out = step(sched, clock)
    assert out.preempted == [long] and urgent in out.seqs  # between classes: as before, no quantum
    finished: list[str] = []
    while sched.live_sequences():
        step(sched, clock)
        finished += [s.req_id for s in (urgent, long, later) if s.finished and s.req_id not in finished]
    assert finished == ["urgent", "long", "later"]
    assert long.num_preemptions == 1 and later.num_preemptions == 0


def test_no_yield_without_room_on_the_host_or_with_a_deadline_at_risk():
    clock = Clock()
    for case in ("no host", "recompute", "deadline"):
        host = 0 if case == "no host" else 256
        mode = "recompute" if case == "recompute" else "swap"
        sched = make_scheduler(clock, host=host, preemption_mode=mode)
        # at 0.1 s a step, 300 tokens take 30 s: a deadline 32 s away is at risk (margin 5 s), 200 s away is not
        deadline = clock.now + (32.0 if case == "deadline" else 200.0)
        long = sequence("long", clock.now, output=300, deadline=deadline, predicted=300)
        sched.add(long)
        run_until(sched, clock, long, 2 * QUANTUM_TOKENS)
        short = sequence("short", clock.now, output=5)
        sched.add(short)
        for _ in range(10):
            assert not step(sched, clock).preempted, case
        assert short.status == SequenceStatus.WAITING, case
        while sched.live_sequences():
            step(sched, clock)
    # the same with room and no deadline at risk: it yields (what the cases above differ in)
    sched = make_scheduler(clock)
    long = sequence("long", clock.now, output=300, deadline=clock.now + 200.0, predicted=300)
    sched.add(long)
    run_until(sched, clock, long, 2 * QUANTUM_TOKENS)
    sched.add(sequence("short", clock.now, output=5))
    assert step(sched, clock).preempted == [long]


def test_quanta_double_and_a_preempted_sequence_is_overtaken_only_within_aging_seconds_of_its_stop():
    """A stream of short sequences, one a step, more than the one slot can serve: the long one runs
    QUANTUM_TOKENS x 2^k tokens at least between its k-th and k+1-th yield, and every sequence that starts
    while it is out arrived before its stop + aging_seconds; it ends while the stream goes on."""
    clock = Clock()
    sched = make_scheduler(clock, cost_seconds_per_token=0.001)
    long = sequence("long", clock.now, output=6 * QUANTUM_TOKENS, predicted=6 * QUANTUM_TOKENS)
    sched.add(long)
    stopped_at, runs, made_at_start, started = None, [], 0, {long}
    for n in range(100_000):
        if long.status == SequenceStatus.FINISHED_LENGTH:
            break
        if n % 3 == 0:  # a short one every 3 steps (each takes 2): the stream drains while the long one waits
            sched.add(sequence(f"s{n}", clock.now, output=2, predicted=2))
        made = long.num_output_tokens
        out = step(sched, clock, seconds=0.5)
        if long in out.preempted:
            runs.append(made - made_at_start)
            stopped_at = clock.now - 0.5
        elif long in out.seqs and stopped_at is not None:
            made_at_start, stopped_at = made, None
        for s in out.seqs:
            if s not in started and stopped_at is not None:
                assert s.arrival_time < stopped_at + AGING, f"{s.req_id} overtook the long one too late"
            started.add(s)
    assert long.status == SequenceStatus.FINISHED_LENGTH, "the long sequence never finished"
    assert len(runs) >= 2
    for k, ran in enumerate(runs):
        assert ran >= QUANTUM_TOKENS << k, f"yielded after {ran} tokens in its run {k}"


def test_a_resumed_sequence_ages_back_to_level_0_as_a_preempted_one_does():
    """A sequence queued with QUANTUM_TOKENS x 4 tokens made before (a worker restarted) waits behind new short
    ones at its level, until aging_seconds after it was queued: then it starts ahead of those sent later."""
    clock = Clock()
    sched = make_scheduler(clock)
    resumed = Sequence(
        "resumed",
        [5, 5],
        SamplingParams(max_tokens=8 * QUANTUM_TOKENS, temperature=0, ignore_eos=True),
        5,
        sample_seed=0,
        resume_token_ids=[7] * (4 * QUANTUM_TOKENS),
        arrival_time=clock.now - 100.0,
    )
    sched.add(resumed)
    started_at = None
    for n in range(400):  # a short one every 2 steps of 0.5 s (each takes 2): the slot is never free
        if n % 2 == 0:
            sched.add(sequence(f"s{n}", clock.now, output=2, predicted=2))
        if resumed in step(sched, clock, seconds=0.5).seqs:
            started_at = clock.now - 0.5
            break
    assert started_at is not None, "the resumed sequence never started under the stream"
    assert 1000.0 + AGING <= started_at <= 1000.0 + AGING + 1.0


@pytest.mark.parametrize("chunked", [True, False])
def test_exact_whatever_the_in_class_preemptions(make_engine, llama_path, reference, chunked):
    """Long requests of one class yield to short ones arriving after their first quantum (greedy and
    seeded), swapped to host memory and back: every output token-identical to generate() in float64 (greedy)
    and to the same request run alone (seeded); nothing recomputed."""
    engine = make_engine(
        scheduling_policy="preemptive",
        max_num_seqs=2,
        block_size=4,
        num_device_blocks=160,
        num_host_blocks=160,
        max_num_batched_tokens=32,
        enable_chunked_prefill=chunked,
    )
    prompts = random_prompts(44, [9, 14, 5, 7, 11, 6])
    sampled = SamplingParams(max_tokens=2 * QUANTUM_TOKENS + 20, temperature=0.9, top_p=0.9, seed=7)
    longs = [("long0", prompts[0], greedy(2 * QUANTUM_TOKENS + 30)), ("long1", prompts[1], sampled)]
    shorts = [(f"short{i}", p, greedy(12)) for i, p in enumerate(prompts[2:])]
    for req_id, prompt, params in longs:
        engine.add_request(req_id, prompt, params)
    outputs, steps, order = {}, 0, []
    while engine.has_unfinished_requests():
        if steps == QUANTUM_TOKENS + 10:
            for req_id, prompt, params in shorts:
                engine.add_request(req_id, prompt, params)
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out
                order.append(out.request_id)
        engine.check_invariants()
        steps += 1
    assert set(order[:4]) == {r for r, _, _ in shorts}, f"the short requests waited: {order}"
    assert outputs["long0"].num_preemptions >= 1 and outputs["long1"].num_preemptions >= 1
    stats = engine.stats()
    assert stats["num_recomputed_tokens"] == 0 and stats["num_blocks_swapped_out"] > 0
    for req_id, prompt, params in [longs[0], *shorts]:
        expected = reference(llama_path, tuple(prompt), params.max_tokens)
        assert outputs[req_id].token_ids == expected, f"{req_id} diverged"
    alone = make_engine(block_size=4, num_device_blocks=160, num_host_blocks=0).generate(
        [prompts[1]], sampled
    )
    assert outputs["long1"].token_ids == alone[0].token_ids, "the seeded request diverged after preemption"
