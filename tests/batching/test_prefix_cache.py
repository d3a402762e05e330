"""Issue 14: automatic prefix caching. Requests that share a prefix of any length reuse its KV and stay
token-exact against transformers' generate() (float64), under preemption with swap and with recompute;
seeded sampling draws the same tokens with or without hits; stats() reports hits, cached blocks and
evictions; enable_prefix_caching=False turns it all off."""

from __future__ import annotations

import pytest

from batching import SamplingParams
from tests.batching.conftest import greedy, random_prompts, run_to_completion

BLOCK = 4
BASE = random_prompts(140, [24])[0]  # 6 blocks of 4


def sharing(base: list[int], lengths: list[int], seed: int) -> list[list[int]]:
    """Prompts that start with base[:k] (k from `lengths`) and go on with tokens of their own."""
    tails = random_prompts(seed, [5] * len(lengths))
    return [base[:k] + tail for k, tail in zip(lengths, tails, strict=True)]


def test_shared_prefixes_of_every_length_are_reused_and_exact(make_engine, llama_path, reference):
    """Shared inside the first block (no whole block: no hit), inside a later block, on a block
    boundary, the whole prompt (all but its last block reused: one token at least is computed), and a
    prompt that extends another's prompt + generated tokens."""
    engine = make_engine(block_size=BLOCK, num_device_blocks=120, max_num_batched_tokens=16)
    engine.add_request("base", BASE, greedy(8))
    base_out = run_to_completion(engine)["base"]
    assert base_out.token_ids == reference(llama_path, tuple(BASE), 8)
    assert engine.stats()["num_prefix_cache_hit_tokens"] == 0
    assert engine.stats()["num_cached_device_blocks"] == (24 + 8 - 1) // BLOCK  # full, computed blocks

    prompts = {
        "inside_first_block": sharing(BASE, [3], 141)[0],
        "inside_a_block": sharing(BASE, [10], 142)[0],
        "on_a_boundary": sharing(BASE, [16], 143)[0],
        "whole_prompt": list(BASE),
        "prompt_and_output": BASE + base_out.token_ids[:5],
    }
    # what each one finds cached: whole blocks of the shared part, never its last token
    expected_hits = {
        "inside_first_block": 0,
        "inside_a_block": 8,
        "on_a_boundary": 16,
        "whole_prompt": 20,
        "prompt_and_output": 28,
    }
    for req_id, prompt in prompts.items():
        before = engine.stats()["num_prefix_cache_hit_tokens"]
        engine.add_request(req_id, prompt, greedy(8))
        out = run_to_completion(engine)[req_id]
        assert out.token_ids == reference(llama_path, tuple(prompt), 8), f"{req_id} diverged"
        assert engine.stats()["num_prefix_cache_hit_tokens"] - before == expected_hits[req_id], req_id

    # all of them at once, in one batch: blocks shared by running sequences at the same time
    for req_id, prompt in prompts.items():
        engine.add_request(f"batch-{req_id}", prompt, greedy(8))
    outs = run_to_completion(engine)
    for req_id, prompt in prompts.items():
        assert outs[f"batch-{req_id}"].token_ids == reference(llama_path, tuple(prompt), 8), req_id
    s = engine.stats()
    assert s["num_prefix_cache_queried_tokens"] == 2 * sum(len(p) for p in prompts.values()) + 24
    assert s["prefix_cache_hit_rate"] == pytest.approx(
        s["num_prefix_cache_hit_tokens"] / s["num_prefix_cache_queried_tokens"]
    )


def test_turned_off_nothing_is_reused(make_engine, llama_path, reference):
    engine = make_engine(block_size=BLOCK, num_device_blocks=120, enable_prefix_caching=False)
    for i in range(2):
        engine.add_request(f"r{i}", BASE, greedy(6))
        assert run_to_completion(engine)[f"r{i}"].token_ids == reference(llama_path, tuple(BASE), 6)
    s = engine.stats()
    assert s["num_prefix_cache_hit_tokens"] == s["num_cached_device_blocks"] == 0
    assert s["prefix_cache_hit_rate"] == 0.0
    assert s["num_prompt_tokens_computed"] == 2 * 24


def test_cached_blocks_are_evicted_least_recently_used_first(make_engine, llama_path, reference):
    """A pool that holds two prompts' blocks: a third evicts the older cached prompt, and the newer
    one is still a hit (no host tier here: evicted is gone)."""
    engine = make_engine(block_size=BLOCK, num_device_blocks=16, num_host_blocks=0, max_num_batched_tokens=64)
    a, b, c = random_prompts(150, [24, 24, 24])  # 6 full blocks each (+1 block for the decodes)
    for req_id, prompt in (("a", a), ("b", b)):
        engine.add_request(req_id, prompt, greedy(2))
        run_to_completion(engine)
    assert engine.stats()["num_prefix_cache_evictions"] == 0
    engine.add_request("c", c, greedy(2))
    run_to_completion(engine)
    s = engine.stats()
    assert s["num_prefix_cache_evictions"] > 0
    assert s["num_cached_device_blocks"] <= 16
    hits = s["num_prefix_cache_hit_tokens"]
    engine.add_request("b-again", b, greedy(4))
    assert run_to_completion(engine)["b-again"].token_ids == reference(llama_path, tuple(b), 4)
    assert engine.stats()["num_prefix_cache_hit_tokens"] - hits == 20, "b, the more recent, was evicted"
    hits = engine.stats()["num_prefix_cache_hit_tokens"]
    engine.add_request("a-again", a, greedy(4))
    assert run_to_completion(engine)["a-again"].token_ids == reference(llama_path, tuple(a), 4)
    assert engine.stats()["num_prefix_cache_hit_tokens"] - hits < 20, "a, the oldest, was kept"


# (length of the shared system prompt used, tail length, max_tokens, priority, arrival step)
WORKLOAD = [
    (13, 3, 14, 9, 0),
    (13, 9, 12, 9, 0),
    (8, 17, 16, 5, 1),
    (13, 12, 12, 9, 2),
    (13, 5, 16, 0, 4),
    (4, 12, 14, 3, 6),
    (13, 11, 12, 0, 9),
    (0, 7, 16, 9, 11),
]


@pytest.mark.parametrize(
    "mode,block_size,budget,host_blocks,chunked",
    [
        ("swap", 2, 16, 64, True),
        ("swap", 4, 7, 64, True),
        ("recompute", 2, 16, 0, True),
        ("recompute", 1, 5, 0, True),
        ("swap", 2, 16, 64, False),
        ("recompute", 4, 16, 0, False),
    ],
)
def test_exact_under_preemption_with_shared_blocks(
    make_engine, llama_path, reference, mode, block_size, budget, host_blocks, chunked
):
    """Urgent requests preempt sequences whose blocks others share: swapped out and in, recomputed (on
    their own cached blocks), every request stays token-exact and every block is accounted for."""
    from tests.batching.test_preemption import run_arrivals

    system = random_prompts(160, [13])[0]
    tails = random_prompts(161, [t for _, t, *_ in WORKLOAD])
    prompts = [system[:k] + tail for (k, *_), tail in zip(WORKLOAD, tails, strict=True)]
    num_blocks = -(-(13 + 12 + 16) // block_size) + 3  # little more than the largest request alone
    engine = make_engine(
        block_size=block_size,
        num_device_blocks=num_blocks,
        num_host_blocks=host_blocks,
        max_num_batched_tokens=budget,
        max_num_seqs=4,
        preemption_mode=mode,
        enable_chunked_prefill=chunked,
    )
    requests = [
        (f"r{i}", prompts[i], greedy(mt), prio, at) for i, (_, _, mt, prio, at) in enumerate(WORKLOAD)
    ]
    outputs = run_arrivals(engine, requests)
    for req_id, prompt, params, _, _ in requests:
        assert outputs[req_id].token_ids == reference(llama_path, tuple(prompt), params.max_tokens), req_id
    s = engine.stats()
    assert s["num_preemptions"] >= 2
    assert s["num_prefix_cache_hit_tokens"] > 0
    if mode == "swap":
        assert s["num_blocks_swapped_out"] > 0
        assert s["num_blocks_swapped_in"] == s["num_blocks_swapped_out"]


def test_resumed_request_reuses_its_prompt_and_is_exact(make_engine, llama_path, reference):
    """A request resumed from persisted tokens finds the KV of its prompt and of its tokens so far."""
    engine = make_engine(block_size=BLOCK, num_device_blocks=60)
    engine.add_request("first", BASE, greedy(10))
    full = run_to_completion(engine)["first"].token_ids
    engine.add_request("resumed", BASE, greedy(10), resume_token_ids=full[:6])
    hits = engine.stats()["num_prefix_cache_hit_tokens"]
    out = run_to_completion(engine)["resumed"]
    assert out.token_ids == full == reference(llama_path, tuple(BASE), 10)
    assert engine.stats()["num_prefix_cache_hit_tokens"] - hits == 28  # 24 + 6 - 1 tokens: 7 blocks


SEEDED = SamplingParams(max_tokens=12, temperature=1.1, top_p=0.9, seed=31, ignore_eos=True)


def test_seeded_sampling_unchanged_by_hits(make_engine):
    prompt = sharing(BASE, [20], 170)[0]
    cold = make_engine(block_size=BLOCK, num_device_blocks=60, enable_prefix_caching=False)
    cold.add_request("s", prompt, SEEDED)
    expected = run_to_completion(cold)["s"].token_ids

    warm = make_engine(block_size=BLOCK, num_device_blocks=60)
    warm.add_request("warm-up", BASE, greedy(3))
    run_to_completion(warm)
    warm.add_request("s", prompt, SEEDED)
    assert run_to_completion(warm)["s"].token_ids == expected
    assert warm.stats()["num_prefix_cache_hit_tokens"] == 20


def test_abort_of_a_sequence_sharing_blocks_leaves_the_others_exact(make_engine, llama_path, reference):
    engine = make_engine(block_size=BLOCK, num_device_blocks=60, max_num_batched_tokens=8)
    prompts = sharing(BASE, [20, 20, 20], 180)
    engine.add_request("warm", BASE, greedy(2))
    run_to_completion(engine)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, greedy(8))
    engine.step()
    engine.step()
    assert engine.abort("r1")
    engine.check_invariants()
    outs = run_to_completion(engine)
    for i in (0, 2):
        assert outs[f"r{i}"].token_ids == reference(llama_path, tuple(prompts[i]), 8)
    assert outs["r1"].finish_reason == "abort"


def test_evicted_blocks_come_back_from_the_host_tier(make_engine, llama_path, reference):
    """A device pool that holds two prompts: a third evicts the first one's blocks, which the host pool
    keeps; the first prompt again copies them back instead of recomputing them, and stays exact."""
    engine = make_engine(
        block_size=BLOCK, num_device_blocks=16, num_host_blocks=32, max_num_batched_tokens=64
    )
    a, b, c = random_prompts(190, [24, 24, 24])
    for req_id, prompt in (("a", a), ("b", b), ("c", c)):
        engine.add_request(req_id, prompt, greedy(4))
        run_to_completion(engine)
    s = engine.stats()
    assert s["num_prefix_cache_evictions"] > 0
    assert s["num_prefix_cache_offloaded_blocks"] == s["num_prefix_cache_evictions"]
    assert s["num_cached_host_blocks"] == s["num_prefix_cache_offloaded_blocks"]
    computed = s["num_prompt_tokens_computed"]
    engine.add_request("a-again", a, greedy(4))
    assert run_to_completion(engine)["a-again"].token_ids == reference(llama_path, tuple(a), 4)
    s = engine.stats()
    assert s["num_prefix_cache_host_hit_tokens"] > 0
    # whole blocks of a came from the device or the host: only the last block's tokens were computed
    assert s["num_prompt_tokens_computed"] - computed == 24 - 20


def test_reset_forgets_host_blocks_the_last_step_read(make_engine):
    """reset_prefix_cache right after a host-tier hit (the engine idle, the hit's host blocks not yet
    back in the free pool) forgets those too: the same prompt then reuses nothing."""
    engine = make_engine(
        block_size=BLOCK, num_device_blocks=16, num_host_blocks=32, max_num_batched_tokens=64
    )
    a, b, c = random_prompts(191, [24, 24, 24])
    for req_id, prompt in (("a", a), ("b", b), ("c", c)):
        engine.add_request(req_id, prompt, greedy(4))
        run_to_completion(engine)
    engine.add_request("a-again", a, greedy(1))  # done in the step that reads the host tier
    run_to_completion(engine)
    assert engine.stats()["num_prefix_cache_host_hit_tokens"] > 0
    engine.block_manager.reset_prefix_cache()
    assert engine.stats()["num_cached_host_blocks"] == 0
    engine.add_request("a-third", a, greedy(4))
    run_to_completion(engine)
    assert engine.stats()["num_prefix_cache_hit_tokens"] == 0
    engine.check_invariants()


def test_host_tier_under_swap_preemption_stays_exact(make_engine, llama_path, reference):
    """Swapped-out sequences and cached blocks share the host pool: the cache never takes a swapped-out
    sequence's blocks, and everything stays exact."""
    from tests.batching.test_preemption import run_arrivals

    system = random_prompts(191, [13])[0]
    tails = random_prompts(192, [t for _, t, *_ in WORKLOAD])
    prompts = [system[:k] + tail for (k, *_), tail in zip(WORKLOAD, tails, strict=True)]
    engine = make_engine(
        block_size=2,
        num_device_blocks=-(-(13 + 12 + 16) // 2) + 3,
        num_host_blocks=40,
        max_num_batched_tokens=16,
        max_num_seqs=4,
        preemption_mode="swap",
    )
    requests = [
        (f"r{i}", prompts[i], greedy(mt), prio, at) for i, (_, _, mt, prio, at) in enumerate(WORKLOAD)
    ]
    # twice: the second round finds the first's blocks on the device or the host
    outputs = run_arrivals(engine, requests)
    outputs2 = run_arrivals(engine, [(f"again-{r}", p, sp, prio, at) for r, p, sp, prio, at in requests])
    for req_id, prompt, params, _, _ in requests:
        expected = reference(llama_path, tuple(prompt), params.max_tokens)
        assert outputs[req_id].token_ids == expected, req_id
        assert outputs2[f"again-{req_id}"].token_ids == expected, req_id
    s = engine.stats()
    assert s["num_blocks_swapped_out"] > 0 and s["num_prefix_cache_offloaded_blocks"] > 0
    assert s["num_prefix_cache_host_hit_tokens"] > 0


@pytest.mark.parametrize("budget", [64, 8])  # the prompt in one step, or chunked over three
def test_a_prompts_n_choices_compute_it_once(make_engine, budget):
    """n choices of one prompt arriving together (the API's one job per choice): the later ones wait for the
    first's prefill and start on its blocks, so the engine's counter of prefilled tokens shows the prompt
    once, plus one token for each later choice (its last prompt token gives its first logits: at most a
    block); each choice draws what it draws alone."""
    prompt = random_prompts(150, [5 * BLOCK + 1])[0]
    params = [SamplingParams(max_tokens=6, temperature=1.0, seed=40 + j, ignore_eos=True) for j in range(4)]
    engine = make_engine(block_size=BLOCK, num_device_blocks=120, max_num_batched_tokens=budget)
    alone = [engine.generate([prompt], p)[0].token_ids for p in params]
    engine.block_manager.reset_prefix_cache()
    before = engine.stats()["num_prompt_tokens_computed"]
    for j, p in enumerate(params):
        engine.add_request(f"choice-{j}", prompt, p)
    outs = run_to_completion(engine)
    assert [outs[f"choice-{j}"].token_ids for j in range(4)] == alone
    computed = engine.stats()["num_prompt_tokens_computed"] - before
    assert computed == len(prompt) + 3, computed  # without waiting: 84 when the prompt fits one step
    assert engine.stats()["num_prefix_cache_hit_tokens"] == 3 * 5 * BLOCK
