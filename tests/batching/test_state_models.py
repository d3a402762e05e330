"""Issue 30: models with state layers (Mamba, gated delta nets, short convolutions, hybrids with attention).

Their per-sequence state lives in slots beside the KV blocks (state_cache.py), handed out by the block
manager and swapped with the blocks. The model-support walk (test_model_support.py) checks every family
against generate() under the plain schedules; here, for every family genq runs: heavy preemption by swap
and by recomputation and a resume from persisted tokens (tokens and their log probabilities against
generate()'s), seeded sampling alone, batched, preempted both ways and resumed; then the slot
accounting and how a step's tokens reach the state layers.
"""

from __future__ import annotations

import functools
import logging

import pytest
import torch

from batching import Engine, EngineConfig, SamplingParams
from batching.block_manager import BlockManager
from batching.sequence import Sequence
from batching.state_step import build_step
from tests.batching.conftest import greedy, random_prompts, run_to_completion
from tests.batching.test_model_support import documented_statuses
from tests.batching.test_preemption import run_arrivals
from tools import model_support as support

# every state family of issue 30 that genq runs, as tools/model_support.py builds it tiny (a hybrid: one
# state layer, then one attention layer, so each step runs both kinds); the other five are refused at
# load (test_model_support.py checks the refusals)
FAMILIES = [
    "jamba",
    "bamba",
    "falcon_h1",
    "nemotron_h",
    "granitemoehybrid",
    "lfm2",
    "lfm2_moe",
    "mamba",
    "mamba2",
    "falcon_mamba",
    "olmo_hybrid",
    "qwen3_next",
    "qwen3_5_text",
    "kimi_linear",
    "zamba",
    "zamba2",
    "zaya",
]
REFUSED = ["recurrent_gemma", "minimax"]
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


# |genq's log probability - generate()'s| per token: generate() keeps its logits in float32 (genq is within
# 1e-6 of them here); the tiny Nemotron-H, recomputing its generated tokens through the other path of its
# state layer (the whole sequence's, where generate() ran them one at a time), was off by 1e-3
LOGPROB_TOLERANCE = 1e-5


@pytest.mark.parametrize("mode", ["swap", "recompute"])
@pytest.mark.parametrize("model_type", FAMILIES)
def test_exact_under_heavy_preemption(family, model_type, mode):
    """A pool far smaller than the demand, chunked prompts on a 7-token budget: sequences are preempted
    mid-prefill and mid-decode, their state swapped to host slots and back (or recomputed), and every
    request still equals generate(), its tokens and their log probabilities; so does a request resumed
    from persisted tokens (their state recomputed, as generate() computed it: one token at a time)."""
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
    params = greedy(MAX_TOKENS, logprobs=0)
    requests = [(f"r{i}", prompts[i], params, prio, at) for i, (_, prio, at) in enumerate(WORKLOAD)]
    outputs = run_arrivals(engine, requests)  # checks the block and slot invariants after every step
    with support.quiet():
        expected = support.reference_generations(model, prompts, MAX_TOKENS)
    for (req_id, *_), (tokens, logprobs) in zip(requests, expected, strict=True):
        assert outputs[req_id].token_ids == tokens, f"{model_type} {req_id} diverged under {mode}"
        _assert_logprobs(outputs[req_id], logprobs, f"{model_type} {req_id} under {mode}")
    stats = engine.stats()
    assert stats["num_preemptions"] >= 2
    if mode == "swap":
        assert stats["num_blocks_swapped_out"] > 0 and stats["num_recomputed_tokens"] == 0
    else:
        assert stats["num_recomputed_tokens"] > 0
    bm = engine.block_manager
    assert len(bm.free_state_slots) == bm.num_state_slots == 4
    # a crash resume: the persisted tokens are prefilled after the prompt, their log probabilities from it
    tokens, logprobs = expected[1]
    engine.add_request("resumed", prompts[1], params, resume_token_ids=tokens[:6])
    resumed = run_to_completion(engine)["resumed"]
    assert resumed.token_ids == tokens, f"{model_type} diverged after a resume"
    _assert_logprobs(resumed, logprobs, f"{model_type} resumed")


def _assert_logprobs(output, expected: list[float], what: str) -> None:
    got = [lp.logprob for lp in output.logprobs]
    worst = max(abs(g - e) for g, e in zip(got, expected, strict=True))
    assert worst <= LOGPROB_TOLERANCE, f"{what}: log probabilities off by up to {worst:.2g}"


SEEDED = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, seed=7, ignore_eos=True)


@pytest.mark.parametrize("model_type", FAMILIES)
def test_seeded_sampling_same_alone_batched_preempted_and_resumed(family, model_type):
    path, _ = family(model_type)
    prompt, others = random_prompts(5, [11]), random_prompts(6, [4, 15, 8])
    engine = engine_for(path, max_num_batched_tokens=7, block_size=2, max_num_seqs=4)
    alone = engine.generate(prompt, SEEDED)[0].token_ids
    batched = engine.generate(
        prompt + others, [SEEDED] + [SamplingParams(max_tokens=12, temperature=1.0)] * 3
    )
    assert batched[0].token_ids == alone
    # preempted, by swap and by recomputation: a tiny pool and urgent requests arriving while it decodes
    for mode, host_blocks in (("swap", 64), ("recompute", 0)):
        small = engine_for(
            path,
            max_num_batched_tokens=7,
            block_size=2,
            num_device_blocks=14,
            num_host_blocks=host_blocks,
            max_num_seqs=4,
            preemption_mode=mode,
        )
        requests = [("seeded", prompt[0], SEEDED, 9, 0)]
        requests += [(f"urgent{i}", p, greedy(8), 0, 3 + i) for i, p in enumerate(others)]
        outputs = run_arrivals(small, requests)
        stats = small.stats()
        assert outputs["seeded"].num_preemptions > 0, mode
        if mode == "swap":
            assert stats["num_blocks_swapped_out"] > 0 and stats["num_recomputed_tokens"] == 0
        else:
            assert stats["num_recomputed_tokens"] > 0
        assert outputs["seeded"].token_ids == alone, f"{model_type} seeded diverged after {mode}"
    # a crash resume: the persisted tokens are prefilled with the prompt (the state recomputed)
    engine.add_request("resumed", prompt[0], SEEDED, resume_token_ids=alone[:5])
    finished = run_to_completion(engine)
    assert finished["resumed"].token_ids == alone


def test_the_families_here_are_the_state_families_the_docs_list_as_running():
    """A family the model-support walk starts running (or stops refusing) is checked here too."""
    documented = documented_statuses()
    assert {t for t in FAMILIES + REFUSED if documented.get(t) == "identical"} == set(FAMILIES)
    assert all(documented.get(t) == "refused" for t in REFUSED)


def test_prefix_caching_is_off_for_state_models_with_a_log_line(family, caplog):
    path, _ = family("mamba")
    with caplog.at_level(logging.INFO, logger="batching.engine_builder"):
        engine = Engine(EngineConfig(model=path, dtype="float64", device="cpu", max_model_len=128))
    assert not engine.block_manager.enable_prefix_caching
    assert "prefix caching is off" in caplog.text
    assert engine.state_cache is not None and not engine.kv_cache.device_pools  # no attention: no KV


def test_each_token_takes_the_path_generate_takes_it_through():
    """How a step's rows reach the state layers: the prompt's tokens through whole-sequence calls (a first
    chunk from no state; later chunks from the state, in layers that resume chunks exactly), every
    generated token one per call, recomputed ones included, in waves across sequences; a layer that does
    not resume chunks takes every token after the first chunk one per call."""

    def seq(name, prompt, generated, computed, slot):
        s = Sequence(name, [3] * prompt, greedy(8), 5, 0, resume_token_ids=[4] * generated)
        s.num_computed_tokens, s.state_slot = computed, slot
        return s

    seqs = [
        seq("recomputed", 5, 3, 0, 0),  # rows 0-7: its prompt in one call, then 3 tokens one by one
        seq("decode", 3, 2, 4, 1),  # row 8
        seq("chunk", 10, 0, 4, 2),  # rows 9-12: a later chunk of its prompt
        seq("across", 6, 2, 4, 3),  # rows 13-16: the prompt's last 2 tokens, then 2 generated
    ]
    step = build_step(None, seqs, [8, 1, 4, 4], torch.device("cpu"))  # type: ignore[arg-type]

    def runs(items):
        return [(start, n, slot.tolist()) for start, n, slot in items]

    def waves(items):
        return [(rows.tolist(), slots.tolist()) for rows, slots in items]

    assert step.num_rows == 17
    assert runs(step.fresh) == [(0, 5, [0])]
    assert runs(step.chunks) == [(9, 4, [2]), (13, 2, [3])]
    assert waves(step.waves) == [([5, 8, 15], [0, 1, 3]), ([6, 16], [0, 3]), ([7], [0])]
    assert waves(step.token_waves) == [
        ([5, 8, 9, 13], [0, 1, 2, 3]),
        ([6, 10, 14], [0, 2, 3]),
        ([7, 11, 15], [0, 2, 3]),
        ([12, 16], [2, 3]),
    ]


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
