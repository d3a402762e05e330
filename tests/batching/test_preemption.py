"""Issue 3: priority preemption. Exact greedy output under heavy preemption (swap and recompute), the
victim rule, urgent requests starting in the very next step, no thrashing, arrival time kept."""

from __future__ import annotations

import pytest

from batching.sequence import SequenceStatus
from tests.batching.conftest import greedy, random_prompts, run_to_completion

# (prompt length, max_tokens, priority, step at which it arrives)
WORKLOAD = [
    (3, 14, 9, 0),
    (9, 12, 9, 0),
    (17, 16, 5, 1),
    (30, 12, 9, 2),
    (5, 16, 0, 4),
    (12, 14, 3, 6),
    (24, 12, 0, 9),
    (7, 16, 9, 11),
]


def run_arrivals(engine, requests):
    """requests: [(req_id, prompt, params, priority, arrival_step)]. Steps until idle, adding each request
    at its step; checks block invariants after every step. Returns the finished outputs by id."""
    finished, step = {}, 0
    last_arrival = max(r[4] for r in requests)
    while step <= last_arrival or engine.has_unfinished_requests():
        for req_id, prompt, params, priority, at in requests:
            if at == step:
                engine.add_request(req_id, prompt, params, priority=priority)
        for out in engine.step():
            if out.finished:
                assert out.request_id not in finished, f"{out.request_id} finished twice"
                finished[out.request_id] = out
        engine.check_invariants()
        step += 1
    assert engine.block_manager.num_free_device_blocks == engine.block_manager.num_device_blocks
    assert engine.block_manager.num_free_host_blocks == engine.block_manager.num_host_blocks
    return finished


@pytest.mark.parametrize(
    "mode,block_size,budget,host_blocks,chunked",
    [
        ("swap", 2, 16, 64, True),
        ("recompute", 2, 16, 0, True),
        ("swap", 3, 7, 64, True),
        ("recompute", 1, 5, 8, True),
        ("swap", 2, 16, 64, False),
        ("recompute", 4, 16, 0, False),
    ],
)
def test_exact_under_heavy_preemption(
    make_engine, llama_path, reference, mode, block_size, budget, host_blocks, chunked
):
    """A pool far smaller than the demand: many preemptions, yet every request is token-exact."""
    num_blocks = -(-46 // block_size) + 2  # just enough for the largest request alone (30 + 16 tokens)
    engine = make_engine(
        block_size=block_size,
        num_device_blocks=num_blocks,
        num_host_blocks=host_blocks,
        max_num_batched_tokens=budget,
        max_num_seqs=4,
        preemption_mode=mode,
        enable_chunked_prefill=chunked,
    )
    prompts = random_prompts(30, [n for n, *_ in WORKLOAD])
    requests = [(f"r{i}", prompts[i], greedy(mt), prio, at) for i, (_, mt, prio, at) in enumerate(WORKLOAD)]
    outputs = run_arrivals(engine, requests)

    assert sorted(outputs) == sorted(r[0] for r in requests)
    for req_id, prompt, params, _, _ in requests:
        out = outputs[req_id]
        assert out.token_ids == reference(llama_path, tuple(prompt), params.max_tokens), f"{req_id} diverged"
        assert out.finish_reason == "length"
    stats = engine.stats()
    assert stats["num_preemptions"] >= 4
    assert stats["num_preemptions"] == sum(o.num_preemptions for o in outputs.values())
    # the p0 request that arrives first finds room by preempting, it is never a victim itself
    assert outputs["r4"].num_preemptions == 0
    if mode == "swap":
        assert stats["num_blocks_swapped_out"] > 0
        assert stats["num_blocks_swapped_in"] == stats["num_blocks_swapped_out"]  # all came back
        assert stats["num_recomputed_tokens"] == 0
    else:
        assert stats["num_blocks_swapped_out"] == stats["num_blocks_swapped_in"] == 0
        assert stats["num_recomputed_tokens"] > 0


def fill_with_low_priority(engine, prompts, max_tokens=40):
    for i, p in enumerate(prompts):
        engine.add_request(f"low{i}", p, greedy(max_tokens), priority=9)
    while not all(engine.requests[f"low{i}"].is_decoding for i in range(len(prompts))):
        engine.step()


@pytest.mark.parametrize("mode", ["swap", "recompute"])
@pytest.mark.parametrize("full", ["slots", "blocks", "slots_and_blocks"])
def test_urgent_request_gets_first_token_in_next_step(make_engine, llama_path, reference, mode, full):
    """The engine is full of priority-9 decodes; a priority-0 request with a prompt within the budget
    gets its first token from the very next step, by preempting."""
    slots = 3 if "slots" in full else 16
    blocks = 30 if "blocks" in full else 200
    engine = make_engine(
        async_scheduling=False,  # which step an output comes from: async delivers it a step later
        block_size=2,
        num_device_blocks=blocks,
        num_host_blocks=64 if mode == "swap" else 0,
        max_num_batched_tokens=16,
        max_num_seqs=slots,
        preemption_mode=mode,
    )
    low = random_prompts(40, [12, 10, 14])
    fill_with_low_priority(engine, low)
    if "blocks" in full:
        while engine.block_manager.num_free_device_blocks > 2:  # the urgent prompt needs 4 blocks
            engine.step()
    bm = engine.block_manager
    assert len(engine.scheduler.running) == 3
    if "slots" in full:
        assert len(engine.scheduler.running) == engine.config.max_num_seqs
    if "blocks" in full:
        assert bm.num_free_device_blocks < 4

    urgent = random_prompts(41, [8])[0]
    engine.add_request("urgent", urgent, greedy(6), priority=0)
    outs = {o.request_id: o for o in engine.step()}
    assert "urgent" in outs and len(outs["urgent"].token_ids) == 1, "urgent request did not start at once"
    assert engine.stats()["num_preemptions"] >= 1
    assert outs["urgent"].num_preemptions == 0

    results = run_to_completion(engine)
    assert results["urgent"].token_ids == reference(llama_path, tuple(urgent), 6)
    for i, p in enumerate(low):
        assert results[f"low{i}"].token_ids == reference(llama_path, tuple(p), 40)


def test_urgent_request_overtakes_a_low_priority_prefill_in_progress(make_engine, llama_path, reference):
    """A long priority-9 prompt whose prefill takes the whole budget for many steps must not hold back a
    priority-0 request: the urgent one gets its first token from the next step."""
    engine = make_engine(
        async_scheduling=False,  # which step an output comes from: async delivers it a step later
        block_size=4,
        num_device_blocks=100,
        max_num_batched_tokens=16,
        max_num_seqs=8,
    )
    long_prompt, urgent = random_prompts(42, [150, 8])
    engine.add_request("long", long_prompt, greedy(4), priority=9)
    engine.step()
    assert 0 < engine.requests["long"].num_computed_tokens < len(long_prompt)
    engine.add_request("urgent", urgent, greedy(4), priority=0)
    outs = {o.request_id: o for o in engine.step()}
    assert "urgent" in outs and len(outs["urgent"].token_ids) == 1
    results = run_to_completion(engine)
    assert results["urgent"].token_ids == reference(llama_path, tuple(urgent), 4)
    assert results["long"].token_ids == reference(llama_path, tuple(long_prompt), 4)


def test_urgent_request_preempts_swapped_in_order(make_engine):
    """Victims are taken least urgent first, latest arrival among equals."""
    engine = make_engine(
        block_size=2, num_device_blocks=200, num_host_blocks=200, max_num_seqs=4, max_num_batched_tokens=64
    )
    prompts = random_prompts(43, [6, 6, 6, 6, 6, 6, 6, 6, 6])
    for req_id, prio, t in [("p3", 3, 1.0), ("p9-early", 9, 2.0), ("p9-late", 9, 3.0), ("p7", 7, 4.0)]:
        engine.add_request(req_id, prompts.pop(), greedy(30), priority=prio, arrival_time=t)
    for _ in range(3):  # one priority class of prefills a step: p3, then p7, then both p9s
        engine.step()
    assert all(
        engine.requests[r].status == SequenceStatus.RUNNING for r in ("p3", "p9-early", "p9-late", "p7")
    )
    expected_victims = ["p9-late", "p9-early", "p7", "p3"]
    for k, victim in enumerate(expected_victims):
        engine.add_request(f"urgent{k}", prompts.pop(), greedy(30), priority=0, arrival_time=10.0 + k)
        engine.step()
        assert engine.requests[victim].status == SequenceStatus.SWAPPED, f"{victim} should be the victim"
        preempted = {s.req_id for s in engine.requests.values() if s.num_preemptions}
        assert preempted == set(expected_victims[: k + 1])
    # all four slots now hold priority-0 work: another priority 0 preempts nobody
    engine.add_request("urgent-last", prompts.pop(), greedy(30), priority=0, arrival_time=20.0)
    engine.step()
    assert engine.stats()["num_preemptions"] == 4
    assert engine.requests["urgent-last"].status == SequenceStatus.WAITING
    run_to_completion(engine)


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_no_preemption_for_equal_priority(make_engine, mode):
    """Slots full of priority-5 work: a new priority-5 request waits for a slot instead of preempting;
    a priority-4 one preempts (strictly more urgent)."""
    engine = make_engine(
        async_scheduling=False,  # which step an output comes from: async delivers it a step later
        block_size=2,
        num_device_blocks=200,
        num_host_blocks=100 if mode == "swap" else 0,
        max_num_seqs=2,
        preemption_mode=mode,
    )
    a, b, c, d = random_prompts(44, [5, 7, 6, 4])
    engine.add_request("a", a, greedy(10), priority=5)
    engine.add_request("b", b, greedy(20), priority=5)
    engine.step()
    engine.add_request("c", c, greedy(5), priority=5)
    started_c_at = None
    step = 1
    while engine.has_unfinished_requests():
        outs = {o.request_id: o for o in engine.step()}
        step += 1
        assert engine.stats()["num_preemptions"] == 0
        if "c" in outs and started_c_at is None:
            started_c_at = step
            assert engine.requests.get("a") is None, "c started before a slot was free"
    assert started_c_at is not None
    # contrast: one step more urgent does preempt
    engine.add_request("a", a, greedy(10), priority=5)
    engine.add_request("b", b, greedy(20), priority=5)
    engine.step()
    engine.add_request("d", d, greedy(5), priority=4)
    outs = {o.request_id: o for o in engine.step()}
    assert "d" in outs and engine.stats()["num_preemptions"] == 1
    run_to_completion(engine)


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_preempted_sequence_keeps_arrival_time_and_place(make_engine, llama_path, reference, mode):
    """A preempted request keeps its arrival time, so it resumes before a same-priority request that
    arrived after it (first come, first served within the class: under "predicted" the shorter "d" may
    go first, and the victim is the one placed last, tests/batching/test_admission_order.py)."""
    engine = make_engine(
        scheduling_policy="fcfs",
        async_scheduling=False,  # which step an output comes from: async delivers it a step later
        block_size=2,
        num_device_blocks=200,
        num_host_blocks=100 if mode == "swap" else 0,
        max_num_seqs=2,
        preemption_mode=mode,
    )
    a, b, c, d = random_prompts(45, [5, 7, 6, 4])
    engine.add_request("a", a, greedy(30), priority=9)
    engine.add_request("b", b, greedy(12), priority=9)
    first = {o.request_id: o for o in engine.step()}
    arrival_b = first["b"].arrival_time
    engine.add_request("c", c, greedy(4), priority=0)
    engine.step()
    assert engine.requests["b"].num_preemptions == 1 and engine.requests["a"].num_preemptions == 0
    engine.add_request("d", d, greedy(4), priority=9)
    assert engine.requests["d"].arrival_time > arrival_b
    b_resumed = d_started = None
    step = 0
    results = {}
    while engine.has_unfinished_requests():
        step += 1
        for out in engine.step():
            if out.request_id == "b" and b_resumed is None and len(out.token_ids) > 1:
                b_resumed = step
            if out.request_id == "d" and d_started is None:
                d_started = step
            if out.finished:
                results[out.request_id] = out
        engine.check_invariants()
    assert b_resumed is not None and d_started is not None and b_resumed < d_started
    assert results["b"].arrival_time == arrival_b
    assert results["b"].num_preemptions == 1
    for req_id, prompt, n in [("a", a, 30), ("b", b, 12), ("c", c, 4), ("d", d, 4)]:
        assert results[req_id].token_ids == reference(llama_path, tuple(prompt), n)


def test_an_urgent_prefill_runs_in_a_short_step(make_engine, llama_path, reference):
    """A step that carries an urgent prefill carries no less urgent prefill chunk: only the decodes and the
    urgent chunk, so the urgent first token is not held back by a budget padded with bulk prompt tokens.
    The bulk prompt's chunks resume in the next step, and every output stays exact."""
    engine = make_engine(
        async_scheduling=False,  # which step an output comes from: async delivers it a step later
        block_size=4,
        num_device_blocks=200,
        max_num_batched_tokens=32,
        max_num_seqs=8,
        attention_aware_chunks=False,
    )  # plain token budget: the chunk sizes below are exact
    short = random_prompts(44, [5, 5])
    long_prompt, urgent = random_prompts(45, [150])[0], random_prompts(46, [7])[0]
    for k, prompt in enumerate(short):
        engine.add_request(f"bulk-decode-{k}", prompt, greedy(40), priority=9)
    engine.step()  # both short prompts prefilled
    engine.add_request("bulk-long", long_prompt, greedy(4), priority=9)
    engine.step()  # 2 decodes + a 30-token chunk of the long prompt
    assert engine.stats()["last_step_num_tokens"] == 32
    engine.add_request("urgent", urgent, greedy(4), priority=0)
    outs = {o.request_id: o for o in engine.step()}
    assert len(outs["urgent"].token_ids) == 1  # its first token, from this very step
    assert engine.stats()["last_step_num_tokens"] == 2 + 7, "a bulk chunk rode along with the urgent prefill"
    assert engine.requests["bulk-long"].num_computed_tokens == 30
    engine.step()  # 3 decodes + the next bulk chunk
    assert engine.stats()["last_step_num_tokens"] == 32
    assert engine.requests["bulk-long"].num_computed_tokens == 59
    finished = run_to_completion(engine)
    for req_id, prompt, n in [
        ("bulk-decode-0", short[0], 40),
        ("bulk-decode-1", short[1], 40),
        ("bulk-long", long_prompt, 4),
        ("urgent", urgent, 4),
    ]:
        assert finished[req_id].token_ids == reference(llama_path, tuple(prompt), n), req_id
