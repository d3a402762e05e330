"""Greedy output is token-identical to transformers' model.generate() in float64, whatever the batch."""

from __future__ import annotations

import random

import pytest

from batching import Engine, EngineConfig, SamplingParams
from tests.batching.conftest import VOCAB, run_to_completion

MAX_NEW = 12


def mixed_prompts(seed: int, lengths=(1, 2, 5, 17, 40, 130, 300)) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(n)] for n in lengths]


def assert_matches_reference(path, reference, engine_path, **engine_kwargs):
    engine = Engine(EngineConfig(model=path, dtype="float64", **engine_path, **engine_kwargs))
    prompts = mixed_prompts(len(engine_kwargs))
    if engine_kwargs.get("max_num_batched_tokens") == 1:
        # one token a step: every prompt token is a chunk and a step of its own, and the 130-token prompt (nine
        # blocks of 16, 130 chunks) covers what the 300-token one would; with it these were the engine suite's
        # slowest tests (~13 s each on a Zen 4, ~30 on a Zen 3)
        prompts = [p for p in prompts if len(p) <= 130]
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    outputs = run_to_completion(engine)
    for i, p in enumerate(prompts):
        expected = reference(path, tuple(p), MAX_NEW)
        assert outputs[f"r{i}"].token_ids == expected, f"prompt of {len(p)} tokens diverged ({engine_kwargs})"
        assert outputs[f"r{i}"].finish_reason == "length"
    return engine


@pytest.mark.parametrize("budget", [1, 7, 64, 512])
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("max_num_seqs", [1, 3, 64])
def test_llama_matches_generate(checkpoint, reference, engine_path, budget, block_size, max_num_seqs):
    assert_matches_reference(
        checkpoint("llama"),
        reference,
        engine_path,
        max_num_batched_tokens=budget,
        block_size=block_size,
        max_num_seqs=max_num_seqs,
    )


@pytest.mark.parametrize("model_type", ["qwen2", "gpt2", "mistral", "gemma2"])
@pytest.mark.parametrize("budget,block_size,max_num_seqs", [(7, 1, 3), (64, 16, 64), (512, 16, 3)])
def test_other_architectures_match_generate(
    checkpoint, reference, engine_path, model_type, budget, block_size, max_num_seqs
):
    assert_matches_reference(
        checkpoint(model_type),
        reference,
        engine_path,
        max_num_batched_tokens=budget,
        block_size=block_size,
        max_num_seqs=max_num_seqs,
    )


def test_chunked_prefill_interleaves_decodes(checkpoint, reference, engine_path):
    """A long prompt arriving mid-decode is split over steps while the others decode every step."""
    path = checkpoint("llama")
    engine = Engine(EngineConfig(model=path, dtype="float64", max_num_batched_tokens=32, **engine_path))
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True)
    short, long = mixed_prompts(1, lengths=(5, 200))
    engine.add_request("short", short, params)
    engine.step()  # prefill of the short prompt; it decodes from now on
    engine.add_request("long", long, params)
    steps_with_short_decoding = 0
    while engine.has_unfinished_requests():
        sched_tokens_before = engine.stats()["num_generated_tokens"]
        outs = {o.request_id: o for o in engine.step()}
        if "short" in outs and "long" not in outs:
            steps_with_short_decoding += 1
        assert engine.stats()["last_step_num_tokens"] <= 32
        del sched_tokens_before
    # the long prompt needs ceil(200 / 31) = 7 steps of prefill, during which "short" kept decoding
    assert steps_with_short_decoding >= 6
