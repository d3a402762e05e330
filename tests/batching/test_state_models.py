"""Issue 30: models with state layers (Mamba, gated delta nets, short convolutions, hybrids with attention).

Their per-sequence state lives in slots beside the KV blocks (state_cache.py), handed out by the block
manager and swapped with the blocks. The model-support walk (test_model_support.py) checks every family
against generate() under the plain schedules; here: heavy preemption by swap and by recomputation,
seeded sampling alone, batched and preempted, a resume from persisted tokens, and the slot accounting.
"""

from __future__ import annotations

import functools
import logging

import pytest

from batching import Engine, EngineConfig, SamplingParams
from batching.block_manager import BlockManager
from batching.sequence import Sequence
from tests.batching.conftest import greedy, random_prompts, run_to_completion
from tests.batching.test_preemption import run_arrivals
from tools import model_support as support

# a pure state model (token-by-token chunk resume), a short-convolution hybrid, a gated-delta-net hybrid
FAMILIES = ["mamba", "lfm2", "qwen3_next"]
MAX_TOKENS = 10
# (prompt length, priority, step at which it arrives)
WORKLOAD = [(3, 9, 0), (9, 9, 0), (17, 5, 1), (12, 9, 2), (5, 0, 4), (20, 3, 6)]


@functools.cache
def tiny_state_model(model_type: str, directory: str):
    with support.quiet():
        model = support.build_tiny_model(support.tiny_config(model_type))
        model.save_pretrained(directory)
    return model


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    """family(model_type) -> (checkpoint path, its float64 model for generate())."""

    @functools.cache
    def make(model_type: str):
        path = str(tmp_path_factory.mktemp(model_type))
        return path, tiny_state_model(model_type, path)

    return make


def engine_for(path: str, **options) -> Engine:
    with support.quiet():
        return Engine(EngineConfig(model=path, dtype="float64", device="cpu", max_model_len=128, **options))


@pytest.mark.parametrize("mode", ["swap", "recompute"])
@pytest.mark.parametrize("model_type", FAMILIES)
def test_exact_under_heavy_preemption(family, model_type, mode):
    """A pool far smaller than the demand, chunked prompts on a 7-token budget: sequences are preempted
    mid-prefill and mid-decode, their state swapped to host slots and back (or recomputed), and every
    request still equals generate()."""
    path, model = family(model_type)
    engine = engine_for(
        path,
        block_size=2,
        num_device_blocks=17,  # the largest request alone (20 + 10 tokens) and two blocks more
        num_host_blocks=64 if mode == "swap" else 0,
        max_num_batched_tokens=7,
        max_num_seqs=4,
        preemption_mode=mode,
    )
    prompts = random_prompts(30, [n for n, _, _ in WORKLOAD])
    requests = [
        (f"r{i}", prompts[i], greedy(MAX_TOKENS), prio, at) for i, (_, prio, at) in enumerate(WORKLOAD)
    ]
    outputs = run_arrivals(engine, requests)  # checks the block and slot invariants after every step
    with support.quiet():
        expected = support.reference_tokens(model, prompts, MAX_TOKENS)
    for (req_id, *_), want in zip(requests, expected, strict=True):
        assert outputs[req_id].token_ids == want, f"{model_type} {req_id} diverged under {mode}"
    stats = engine.stats()
    assert stats["num_preemptions"] >= 2
    if mode == "swap":
        assert stats["num_blocks_swapped_out"] > 0 and stats["num_recomputed_tokens"] == 0
    else:
        assert stats["num_recomputed_tokens"] > 0
    bm = engine.block_manager
    assert len(bm.free_state_slots) == bm.num_state_slots == 4


SEEDED = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, seed=7, ignore_eos=True)


def test_seeded_sampling_same_alone_batched_preempted_and_resumed(family):
    path, _ = family("qwen3_next")
    prompt, others = random_prompts(5, [11]), random_prompts(6, [4, 15, 8])
    engine = engine_for(path, max_num_batched_tokens=7, block_size=2, max_num_seqs=4)
    alone = engine.generate(prompt, SEEDED)[0].token_ids
    batched = engine.generate(
        prompt + others, [SEEDED] + [SamplingParams(max_tokens=12, temperature=1.0)] * 3
    )
    assert batched[0].token_ids == alone
    # preempted by swap: a tiny pool and urgent requests arriving while it decodes
    small = engine_for(path, max_num_batched_tokens=7, block_size=2, num_device_blocks=14, max_num_seqs=4)
    requests = [("seeded", prompt[0], SEEDED, 9, 0)]
    requests += [(f"urgent{i}", p, greedy(8), 0, 3 + i) for i, p in enumerate(others)]
    outputs = run_arrivals(small, requests)
    assert outputs["seeded"].num_preemptions > 0 and small.stats()["num_blocks_swapped_out"] > 0
    assert outputs["seeded"].token_ids == alone
    # a crash resume: the persisted tokens are prefilled with the prompt (the state recomputed)
    engine.add_request("resumed", prompt[0], SEEDED, resume_token_ids=alone[:5])
    finished = run_to_completion(engine)
    assert alone[:5] + finished["resumed"].token_ids[5:] == alone
    assert finished["resumed"].token_ids == alone


def test_prefix_caching_is_off_for_state_models_with_a_log_line(family, caplog):
    path, _ = family("mamba")
    with caplog.at_level(logging.INFO, logger="batching.engine"):
        engine = Engine(EngineConfig(model=path, dtype="float64", device="cpu", max_model_len=128))
    assert not engine.block_manager.enable_prefix_caching
    assert "prefix caching is off" in caplog.text
    assert engine.state_cache is not None and not engine.kv_cache.device_pools  # no attention: no KV


def test_state_slots_follow_the_sequence(family):
    """Torch-free accounting: a running sequence holds one slot, a swapped one a host slot (its state
    copied with its blocks), and none is lost or shared."""
    bm = BlockManager(8, 8, 2, enable_prefix_caching=False, num_state_slots=2, num_host_state_slots=1)
    a, b, c = (Sequence(n, [3, 4, 5], greedy(4), 5, 0) for n in "abc")
    assert bm.allocate(a, 3) is not None and bm.allocate(b, 3) is not None
    assert {a.state_slot, b.state_slot} == {0, 1}
    assert not bm.can_allocate(c, 3) and bm.allocate(c, 3) is None  # blocks left, but no state slot
    a.num_computed_tokens = 3
    slot = a.state_slot
    assert bm.swap_out(a) is not None
    assert bm.take_state_copies() == ([(slot, a.host_state_slot)], []) and a.state_slot is None
    b.num_computed_tokens = 3
    assert not bm.can_swap_out(b) and bm.swap_out(b) is None  # the one host slot is a's
    assert bm.allocate(c, 3) is not None  # a's slot went back to the pool
    bm.free(c)
    host = a.host_state_slot
    assert bm.swap_in(a) is not None
    assert bm.take_state_copies() == ([], [(host, a.state_slot)])
    bm.check_invariants([a, b])
    bm.start_step()
    bm.free(a)
    bm.free(b)
    bm.check_invariants([])
    assert sorted(bm.free_state_slots) == [0, 1] and bm.free_host_state_slots == [0]
