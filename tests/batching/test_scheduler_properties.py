"""Property-based tests (hypothesis state machines) of scheduling.

1. The Scheduler alone, with a fake runner (pure Python, fast, many examples): token budget, max_num_seqs,
   stall-free decodes, no chunking when it is off, admission in strict urgency order (a preempted
   sequence keeps its place) under each policy within a class (admission_order.py: by arrival, or by
   predicted cost with deadlines at risk first; under "preemptive" by level first, running sequences yielding
   to their class), no deadlock, every block free at the end.
2. The real Engine over a tiny float64 checkpoint (small pools, block sizes 1-4, both preemption modes,
   chunked prefill on and off):
   random add / abort / step never leak or double-own a block, every request finishes exactly once,
   and greedy output stays token-identical to transformers' generate(), with prompts that share
   prefixes (prefix caching on and off).
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from batching import EngineConfig, SamplingParams
from batching.block_manager import BlockManager, blocks_for
from batching.scheduler import Scheduler, SchedulerOutput, _Fill
from batching.sequence import Sequence, SequenceStatus
from tests.batching.conftest import random_prompts


def check_prefill_order(sched: Scheduler) -> None:
    """The order a step reads the prefills, swapped and waiting sequences in (merged from the place-sorted
    queues as read, `Scheduler._prefill_order`) is the full sort by rank, and the sequences ranked apart from
    their place are exactly the waiting and swapped ones whose rank may not follow it."""
    queued = sched.swapped + sched.waiting
    assert list(sched._apart) == [s for s in sched._apart if s in queued]
    assert all((s in sched._apart) == sched._ranked_apart(s) for s in queued)
    order, prefilling = sched._prefill_order(_Fill(SchedulerOutput()))
    order = list(order)

    def key(s):
        return (s.priority, s.status != SequenceStatus.RUNNING, sched.rank(s))

    assert sorted(s.req_id for s in order) == sorted(s.req_id for s in prefilling + queued)
    assert [key(s) for s in order] == sorted(map(key, prefilling + queued))


# --- 1. the scheduler with a fake runner -------------------------------------------------------------


class SchedulerMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.requests: dict[str, Sequence] = {}
        self.finished: dict[str, SequenceStatus] = {}
        self.clock = 0.0

    @initialize(
        block_size=st.integers(1, 4),
        device=st.integers(4, 24),
        host=st.integers(0, 10),
        max_num_seqs=st.integers(1, 4),
        budget=st.integers(1, 16),
        mode=st.sampled_from(["swap", "recompute"]),
        chunked=st.booleans(),
        stateful=st.booleans(),
        policy=st.sampled_from(["fcfs", "predicted", "preemptive"]),
        seconds_per_token=st.sampled_from(
            [0.02, 0.5]
        ),  # 0.5: predicted costs reorder arrivals a second apart
    )
    def configure(
        self,
        block_size,
        device,
        host,
        max_num_seqs,
        budget,
        mode,
        chunked,
        stateful,
        policy,
        seconds_per_token,
    ):
        self.config = EngineConfig(
            block_size=block_size,
            num_device_blocks=device,
            num_host_blocks=host,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=budget,
            preemption_mode=mode,
            enable_chunked_prefill=chunked,
            scheduling_policy=policy,
            cost_seconds_per_token=seconds_per_token,
            aging_seconds=4.0,
            deadline_margin_seconds=3.0,
        )
        self.bm = BlockManager(device, host, block_size)
        self.stateful = stateful  # a model with state layers: no prompt's last token alone in a chunk
        self.sched = Scheduler(self.config, self.bm, stateful=stateful, clock=lambda: self.clock)
        self.sched.quantum_tokens = 1  # "preemptive": yields within a class at these lengths (1-8 tokens)
        # "preemptive": three classes, so that sequences often share one (and yield to each other)
        self.classes = 3 if policy == "preemptive" else 10

    @rule(
        priority=st.integers(0, 9),
        prompt=st.integers(1, 20),
        max_tokens=st.integers(1, 8),
        shared=st.integers(0, 20),
        predicted=st.one_of(st.none(), st.integers(0, 8)),
        deadline=st.one_of(st.none(), st.floats(-2.0, 10.0)),
    )
    def add(self, priority, prompt, max_tokens, shared, predicted, deadline):
        """`shared`: how many leading tokens the prompt has in common with every other (prefix hits)."""
        if blocks_for(prompt + max_tokens - 1, self.bm.block_size) > self.bm.num_device_blocks:
            return  # the engine refuses what the pool can never hold
        req_id = f"r{len(self.requests)}"
        priority %= self.classes
        self.clock += 1.0
        seq = Sequence(
            req_id,
            [5] * min(shared, prompt) + [6 + len(self.requests)] * max(0, prompt - shared),
            SamplingParams(max_tokens=max_tokens, temperature=0),
            priority,
            sample_seed=0,
            arrival_time=self.clock,
            predicted_output_tokens=predicted,
            deadline=None if deadline is None else self.clock + deadline,
        )
        self.requests[req_id] = seq
        self.sched.add(seq)

    @precondition(lambda self: any(not s.finished for s in self.requests.values()))
    @rule(data=st.data())
    def abort(self, data):
        live = sorted(r for r, s in self.requests.items() if not s.finished)
        seq = self.requests[data.draw(st.sampled_from(live))]
        self.sched.finish(seq, SequenceStatus.FINISHED_ABORTED)
        self.finished[seq.req_id] = seq.status

    @rule()
    def step(self):
        sched, bm = self.sched, self.bm
        decoding = [s for s in sched.running if s.is_decoding]
        not_running = set(sched.waiting + sched.swapped)
        uncomputed = {s.req_id: s.num_uncomputed_tokens for s in self.requests.values()}

        self.clock += 0.1  # a step's time: the scheduler's step-time estimate and deadlines follow it
        out = sched.schedule()
        # the order of this step's decisions (its clock reading; levels first under preemptive)
        urgency = sched.rank

        scheduled = dict(zip([s.req_id for s in out.seqs], out.num_scheduled_tokens, strict=True))
        assert len(scheduled) == len(out.seqs), "a sequence was scheduled twice"
        if out.decode_context is not None:  # what the step's cost model is told (step_cost.features)
            decodes = out.seqs[: out.num_decodes]
            assert out.decode_context == sum(s.num_computed_tokens for s in decodes), "a stale decode context"
        assert len(sched.running) <= self.config.max_num_seqs
        budget = self.config.max_num_batched_tokens
        if self.config.enable_chunked_prefill:
            # a state model's one-token chunk that would leave its prompt's last token alone takes it too
            assert out.total_num_scheduled_tokens <= budget + self.stateful
        else:
            # a whole prompt longer than the budget may run as the step's only prefill
            assert (
                out.total_num_scheduled_tokens - max([n for n in scheduled.values() if n > 1], default=0)
                <= budget
            )
            for seq, n in zip(out.seqs, out.num_scheduled_tokens, strict=True):
                # all of what the prefix cache did not give
                assert n == seq.num_uncomputed_tokens, "a prompt was chunked with chunked prefill off"
        for seq in not_running:
            if seq.req_id in scheduled and uncomputed[seq.req_id] == seq.num_tokens:
                # started from scratch: on a cached prefix of whole blocks, at least one token to compute
                assert seq.num_computed_tokens % bm.block_size == 0
                assert seq.num_computed_tokens < seq.num_tokens
        for seq, n in zip(out.seqs, out.num_scheduled_tokens, strict=True):
            assert seq.status == SequenceStatus.RUNNING and seq in sched.running and seq not in out.preempted
            assert 0 < n <= seq.num_uncomputed_tokens
            if self.stateful:
                assert seq.num_computed_tokens + n != seq.num_prompt_tokens - 1, "a lone last prompt token"
            assert len(seq.block_table) * bm.block_size >= seq.num_computed_tokens + n
        # stall-free: every decode runs unless preempted (or there are more decodes than budget)
        if len(decoding) <= budget:
            for seq in decoding:
                assert seq in out.preempted or scheduled.get(seq.req_id) == 1
        # admissions follow strict urgency order: nobody starts ahead of a more urgent sequence that
        # stays out, and a sequence preempted in this step keeps its place
        admitted = [s for s in not_running if s.req_id in scheduled]
        left_out = [s for s in (not_running | set(out.preempted)) if s.req_id not in scheduled]
        for a in admitted:
            for w in left_out:
                assert urgency(a) < urgency(w), f"{a} started ahead of the more urgent {w}"
        # the runner copies swap-outs, then swap-ins: no host block is written before it is read
        assert not {h for h, _ in out.swap_in} & {h for _, h in out.swap_out}, "host block reused in a step"
        for v in out.preempted:
            # never preempted for nothing, nor for less urgent work
            assert any(s.priority <= v.priority for s in out.seqs), f"{v} preempted for nothing more urgent"
            assert v.status in (SequenceStatus.SWAPPED, SequenceStatus.WAITING)
            assert (v.status == SequenceStatus.SWAPPED) == bool(v.host_block_table)
            assert not v.block_table

        # the fake runner: KV computed, one token sampled at the end of each chunk that completes
        for seq, n in zip(out.seqs, out.num_scheduled_tokens, strict=True):
            seq.num_computed_tokens += n
            if seq.num_computed_tokens == seq.num_tokens:
                seq.token_ids.append(7)
                if seq.num_output_tokens >= seq.params.max_tokens:
                    sched.finish(seq, SequenceStatus.FINISHED_LENGTH)
                    assert seq.req_id not in self.finished
                    self.finished[seq.req_id] = seq.status

    @invariant()
    def prefill_order_is_the_rank_order(self):
        if hasattr(self, "sched"):
            check_prefill_order(self.sched)

    @invariant()
    def blocks_are_free_or_owned_once(self):
        if hasattr(self, "bm"):
            self.bm.check_invariants(self.sched.live_sequences())

    def teardown(self):
        if not hasattr(self, "bm"):
            return
        for _ in range(5000):
            if not self.sched.live_sequences():
                break
            self.step()
            self.blocks_are_free_or_owned_once()
        assert not self.sched.live_sequences(), "the scheduler stopped making progress"
        assert sorted(self.finished) == sorted(self.requests)
        assert self.bm.num_free_device_blocks == self.bm.num_device_blocks
        assert self.bm.num_free_host_blocks == self.bm.num_host_blocks


TestSchedulerMachine = SchedulerMachine.TestCase
TestSchedulerMachine.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


def test_a_state_models_last_two_prompt_tokens_preempt_a_less_urgent_decode():
    """Found by the machine above (a CI run, shrunk): a state model's priority-0 prefill at 12 of 14 tokens, one
    block free, a priority-1 decode already in the step. Its next chunk must take both last tokens (one alone
    would run the state layers' single-token path); the room check counted one, found it, made no room, and
    the chunk came out empty, so the prefill yielded its own place (its 12 tokens dropped for recomputation)
    while the less urgent decode kept the block: "preempted for nothing more urgent". The room check now
    counts the two, and the decode yields."""
    state = SchedulerMachine()
    state.configure(
        block_size=1,
        device=19,
        host=0,
        max_num_seqs=2,
        budget=2,
        mode="swap",
        chunked=True,
        stateful=True,
        policy="fcfs",
        seconds_per_token=0.02,
    )
    state.add(deadline=None, max_tokens=1, predicted=None, priority=0, prompt=1, shared=0)
    state.step()
    state.add(deadline=None, max_tokens=1, predicted=None, priority=0, prompt=1, shared=0)
    state.add(deadline=None, max_tokens=1, predicted=None, priority=0, prompt=1, shared=0)
    state.step()
    state.add(deadline=None, max_tokens=1, predicted=None, priority=0, prompt=8, shared=8)
    state.step()
    state.step()
    state.step()
    state.step()
    state.add(deadline=None, max_tokens=1, predicted=None, priority=0, prompt=1, shared=0)
    state.add(deadline=None, max_tokens=6, predicted=None, priority=1, prompt=1, shared=0)
    state.step()
    state.step()
    state.add(deadline=None, max_tokens=1, predicted=None, priority=0, prompt=14, shared=8)
    state.teardown()  # steps to the end, each checked as the machine checks it
    assert state.requests["r6"].num_preemptions == 0 and state.requests["r5"].num_preemptions == 1


def run_fake_step(sched: Scheduler):
    """Schedule one step and play the runner: KV computed, a token sampled where a chunk completes."""
    out = sched.schedule()
    for seq, n in zip(out.seqs, out.num_scheduled_tokens, strict=True):
        seq.num_computed_tokens += n
        if seq.num_computed_tokens == seq.num_tokens:
            seq.token_ids.append(7)
            if seq.num_output_tokens >= seq.params.max_tokens:
                sched.finish(seq, SequenceStatus.FINISHED_LENGTH)
    return out


def test_sequence_preempted_for_blocks_keeps_its_place():
    """Found by the machine above: a prefill that yields its blocks (pool exhausted) was overtaken, in the
    same step, by a later request of the same priority that started in the room it left."""
    config = EngineConfig(
        block_size=4, num_device_blocks=5, num_host_blocks=0, max_num_seqs=2, max_num_batched_tokens=7
    )
    sched = Scheduler(config, BlockManager(5, 0, 4))
    long = Sequence("long", [5] * 17, SamplingParams(max_tokens=1, temperature=0), 1, 0, arrival_time=1.0)
    short = Sequence("short", [5], SamplingParams(max_tokens=1, temperature=0), 1, 0, arrival_time=2.0)
    urgent = Sequence("urgent", [5], SamplingParams(max_tokens=6, temperature=0), 0, 0, arrival_time=3.0)
    for seq in (long, short, urgent):
        sched.add(seq)
    for _ in range(4):  # urgent alone (one class of prefills a step), then urgent's decodes + long's chunks
        run_fake_step(sched)
    out = run_fake_step(sched)  # the pool is full: "long" yields its blocks
    assert out.preempted == [long]
    assert short.status == SequenceStatus.WAITING, "a later request took the preempted one's place"
    out = run_fake_step(sched)
    assert long in out.seqs


@pytest.mark.parametrize(
    "prompt,budget,plain,stateful",
    [
        (5, 4, [4, 1], [3, 2]),  # a chunk that would leave the last token alone takes one less
        (2, 1, [1, 1], [2]),  # a single token takes the last one too, past the budget by one
        (6, 2, [2, 2, 2], [2, 2, 2]),
        (1, 1, [1], [1]),
    ],
)
def test_a_state_model_never_runs_its_last_prompt_token_alone(prompt, budget, plain, stateful):
    """With state layers, a resumed chunk of one token would take the layers' single-token path, which
    generate() takes for generated tokens only (state_layers.py): the prompt's chunks avoid it."""
    config = EngineConfig(block_size=4, num_device_blocks=8, max_num_batched_tokens=budget)
    for is_stateful, chunks in ((False, plain), (True, stateful)):
        sched = Scheduler(config, BlockManager(8, 0, 4), stateful=is_stateful)
        seq = Sequence("s", [5] * prompt, SamplingParams(max_tokens=2, temperature=0), 5, 0)
        sched.add(seq)
        got = []
        while seq.num_output_tokens == 0:
            got.append(run_fake_step(sched).num_scheduled_tokens[0])
        assert got == chunks, f"stateful={is_stateful}"


# --- 2. the real engine ------------------------------------------------------------------------------

PROMPT_LENGTHS = [1, 3, 6, 11, 17, 26]
MAX_TOKENS = 8


class EngineMachine(RuleBasedStateMachine):
    """Set up by test_engine_state_machine: `make_cpu_engine`, `prompts`, `expected` (greedy references)."""

    make_cpu_engine = prompts = expected = None
    engines: dict = {}

    def __init__(self):
        super().__init__()
        self.added: dict[str, tuple[int, SamplingParams]] = {}
        self.finished: dict = {}
        self.aborted: set[str] = set()

    @initialize(
        block_size=st.integers(1, 4),
        mode=st.sampled_from(["swap", "recompute"]),
        host=st.sampled_from([0, 4, 64]),
        chunked=st.booleans(),
        caching=st.booleans(),
        load=st.lists(st.tuples(st.integers(3, 5), st.integers(5, 9)), min_size=2, max_size=3),
    )
    def configure(self, block_size, mode, host, chunked, caching, load):
        host = host if mode == "swap" else 0
        key = (block_size, mode, host, chunked, caching)
        if key not in self.engines:
            # the biggest request (26 + 8 tokens) just fits; two long ones already fill it
            self.engines[key] = self.make_cpu_engine(
                block_size=block_size,
                num_device_blocks=blocks_for(33, block_size) + 1,
                num_host_blocks=host,
                preemption_mode=mode,
                max_num_seqs=3,
                max_num_batched_tokens=8,
                enable_chunked_prefill=chunked,
                enable_prefix_caching=caching,
            )
        self.engine = self.engines[key]
        for req_id in list(self.engine.requests):  # left over by an example that failed
            self.engine.abort(req_id)
        while self.engine.has_unfinished_requests():
            self.engine.step()
        # an example replays the same way: no cached KV left by the one before
        self.engine.block_manager.reset_prefix_cache()
        for prompt, priority in load:  # start with long, mostly low-priority work
            self.add(prompt, priority, MAX_TOKENS, None)

    @rule(
        prompt=st.integers(0, len(PROMPT_LENGTHS) - 1),
        priority=st.integers(0, 9),
        max_tokens=st.integers(1, MAX_TOKENS),
        seed=st.none() | st.integers(0, 3),
    )
    def add(self, prompt, priority, max_tokens, seed):
        req_id = f"r{len(self.added)}"
        if seed is None:
            params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        else:
            params = SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed, ignore_eos=True)
        self.engine.add_request(req_id, self.prompts[prompt], params, priority=priority)
        self.added[req_id] = (prompt, params)

    @precondition(lambda self: any(r not in self.finished and r not in self.aborted for r in self.added))
    @rule(data=st.data())
    def abort(self, data):
        live = sorted(r for r in self.added if r not in self.finished and r not in self.aborted)
        req_id = data.draw(st.sampled_from(live))
        assert self.engine.abort(req_id)
        self.aborted.add(req_id)

    @rule(steps=st.integers(1, 4))
    def step(self, steps):
        for _ in range(steps):
            self._step()

    def _step(self):
        for out in self.engine.step():
            assert out.request_id not in self.finished, f"{out.request_id} reported after finishing"
            prompt, params = self.added[out.request_id]
            assert len(out.token_ids) <= params.max_tokens
            if params.temperature == 0:
                assert out.token_ids == self.expected[prompt][: len(out.token_ids)], "greedy output diverged"
            if out.finished:
                self.finished[out.request_id] = out
                expected_reason = "abort" if out.request_id in self.aborted else "length"
                assert out.finish_reason == expected_reason
                if expected_reason == "length":
                    assert len(out.token_ids) == params.max_tokens

    @invariant()
    def prefill_order_is_the_rank_order(self):
        if hasattr(self, "engine"):
            check_prefill_order(self.engine.scheduler)

    @invariant()
    def blocks_are_free_or_owned_once(self):
        if hasattr(self, "engine"):
            self.engine.check_invariants()
            stats = self.engine.stats()
            assert stats["num_running"] <= 3

    def teardown(self):
        if not hasattr(self, "engine"):
            return
        for _ in range(2000):
            if not self.engine.has_unfinished_requests():
                break
            self._step()
            self.engine.check_invariants()
        assert not self.engine.has_unfinished_requests()
        assert sorted(self.finished) == sorted(self.added), "a request never finished"
        bm = self.engine.block_manager
        assert bm.num_free_device_blocks == bm.num_device_blocks
        assert bm.num_free_host_blocks == bm.num_host_blocks


def shared_prefix_prompts() -> list[list[int]]:
    """PROMPT_LENGTHS prompts, most of them sharing the beginning of the longest (prefix cache hits on
    blocks that running, swapped and finished sequences hold), at lengths inside and across blocks."""
    own = random_prompts(100, PROMPT_LENGTHS)
    longest = own[-1]
    return [own[0], longest[:3], own[2], longest[:8] + own[3][8:], longest[:17], longest]


def test_engine_state_machine(make_cpu_engine, llama_path, reference):
    prompts = shared_prefix_prompts()
    EngineMachine.make_cpu_engine = staticmethod(make_cpu_engine)
    EngineMachine.prompts = prompts
    EngineMachine.expected = [reference(llama_path, tuple(p), MAX_TOKENS) for p in prompts]
    EngineMachine.engines = {}
    run_state_machine_as_test(
        EngineMachine,
        settings=settings(
            max_examples=50,
            stateful_step_count=30,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
        ),
    )


def test_no_preemption_for_a_whole_prompt_that_cannot_run_this_step():
    """Chunked prefill off: a second urgent prompt longer than the budget left cannot start in this step,
    so nobody is preempted for it (the first urgent one still preempts for its slot)."""
    config = EngineConfig(
        block_size=2,
        num_device_blocks=64,
        num_host_blocks=64,
        max_num_seqs=2,
        max_num_batched_tokens=16,
        enable_chunked_prefill=False,
    )
    sched = Scheduler(config, BlockManager(64, 64, 2))
    low = [
        Sequence(
            f"low{i}", [8 + i] * 4, SamplingParams(max_tokens=20, temperature=0), 9, 0, arrival_time=1.0 + i
        )
        for i in range(2)
    ]
    for seq in low:
        sched.add(seq)
    run_fake_step(sched)
    run_fake_step(sched)
    # prompts of their own: no prefix cache hits
    first = Sequence("first", [6] * 4, SamplingParams(max_tokens=2, temperature=0), 0, 0, arrival_time=3.0)
    second = Sequence("second", [7] * 14, SamplingParams(max_tokens=2, temperature=0), 0, 0, arrival_time=4.0)
    sched.add(first)
    sched.add(second)
    out = run_fake_step(sched)
    assert out.preempted == [low[1]] and first in out.seqs and second not in out.seqs
    assert low[0].status == SequenceStatus.RUNNING


def test_urgent_prefill_in_progress_is_not_starved_by_a_less_urgent_decode():
    """Found by the machine: the decodes take blocks first, so a priority-0 prompt halfway through its
    prefill found the pool empty and preempted itself (losing its KV) while a priority-1 sequence kept
    decoding. Now the less urgent one is preempted and the urgent prefill goes on."""
    config = EngineConfig(
        block_size=1,
        num_device_blocks=16,
        num_host_blocks=0,
        max_num_seqs=2,
        max_num_batched_tokens=5,
        preemption_mode="recompute",
    )
    sched = Scheduler(config, BlockManager(16, 0, 1))
    low = Sequence("low", [5] * 10, SamplingParams(max_tokens=3, temperature=0), 1, 0, arrival_time=1.0)
    # a prompt of its own (no prefix shared with "low": all of it is computed)
    urgent = Sequence("urgent", [6] * 5, SamplingParams(max_tokens=1, temperature=0), 0, 0, arrival_time=2.0)
    sched.add(low)
    run_fake_step(sched)
    run_fake_step(sched)
    sched.add(urgent)
    run_fake_step(sched)  # urgent takes a first chunk of 4; one block is left
    assert urgent.num_computed_tokens == 4
    out = run_fake_step(sched)  # low's decode needs that block, urgent's last token too
    assert out.preempted == [low] and urgent in out.seqs
    assert urgent.status == SequenceStatus.FINISHED_LENGTH and urgent.num_preemptions == 0
