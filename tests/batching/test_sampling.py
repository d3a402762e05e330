"""Sampling: seeded requests draw the same tokens alone, in any batch, after preemption and after a resume;
top-k/top-p/temperature filter as documented (checked on the Sampler with known logits)."""

from __future__ import annotations

import collections
import math

import pytest
import torch

from batching import SamplingParams
from batching.sampler import Sampler
from batching.sequence import Sequence
from tests.batching.conftest import greedy, random_prompts, run_to_completion

SEEDED = [
    SamplingParams(max_tokens=16, temperature=0.9, top_k=40, top_p=0.92, seed=7, ignore_eos=True),
    SamplingParams(max_tokens=16, temperature=1.3, seed=123, ignore_eos=True),
    SamplingParams(max_tokens=16, temperature=0.7, top_p=0.5, seed=99, ignore_eos=True),
]


@pytest.fixture(scope="module")
def engine(make_engine):
    return make_engine(block_size=4, num_device_blocks=200, max_num_seqs=8, max_num_batched_tokens=32)


def alone(engine, prompt, params) -> list[int]:
    engine.add_request("alone", prompt, params)
    out = run_to_completion(engine)["alone"]
    assert len(out.token_ids) == params.max_tokens
    return out.token_ids


def test_seeded_sampling_same_alone_and_in_a_batch(engine):
    prompts = random_prompts(70, [6, 13, 40])
    solo = [alone(engine, p, params) for p, params in zip(prompts, SEEDED, strict=True)]
    # a batch with greedy and unseeded sampled neighbours, the seeded ones arriving at different steps
    fillers = random_prompts(71, [3, 25, 9, 60])
    engine.add_request("f0", fillers[0], greedy(20))
    engine.add_request("f1", fillers[1], SamplingParams(max_tokens=20, temperature=1.0, ignore_eos=True))
    engine.add_request("s0", prompts[0], SEEDED[0])
    engine.step()
    engine.add_request("f2", fillers[2], SamplingParams(max_tokens=12, temperature=0.5, top_k=3))
    engine.add_request("s1", prompts[1], SEEDED[1])
    engine.step()
    engine.step()
    engine.add_request("f3", fillers[3], greedy(8))
    engine.add_request("s2", prompts[2], SEEDED[2])
    outs = run_to_completion(engine)
    for i in range(3):
        assert outs[f"s{i}"].token_ids == solo[i], f"seeded request {i} changed in a batch"


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_seeded_sampling_same_after_preemption(make_engine, mode):
    engine = make_engine(
        block_size=2,
        num_device_blocks=40,
        num_host_blocks=40 if mode == "swap" else 0,
        max_num_seqs=2,
        max_num_batched_tokens=16,
        preemption_mode=mode,
    )
    prompts = random_prompts(72, [6, 13])
    solo = [alone(engine, p, params) for p, params in zip(prompts, SEEDED[:2], strict=True)]
    engine.add_request("s0", prompts[0], SEEDED[0], priority=9)
    engine.add_request("s1", prompts[1], SEEDED[1], priority=9)
    for _ in range(4):
        engine.step()
    for k, p in enumerate(random_prompts(73, [5, 8, 7])):
        engine.add_request(f"urgent{k}", p, SamplingParams(max_tokens=5, temperature=1.0), priority=0)
        engine.step()
    outs = run_to_completion(engine)
    assert outs["s0"].num_preemptions + outs["s1"].num_preemptions >= 2
    assert outs["s0"].token_ids == solo[0]
    assert outs["s1"].token_ids == solo[1]


def test_resumed_request_continues_with_the_same_tokens(engine):
    """Token i draws from (seed, i): resuming from persisted tokens gives the rest of the same output."""
    prompt = random_prompts(74, [9])[0]
    full = alone(engine, prompt, SEEDED[1])
    engine.add_request("resumed", prompt, SEEDED[1], resume_token_ids=full[:5])
    out = run_to_completion(engine)["resumed"]
    assert out.token_ids == full


def test_different_seeds_differ(engine):
    prompt = random_prompts(75, [8])[0]
    outputs = {
        tuple(alone(engine, prompt, SamplingParams(max_tokens=12, temperature=1.0, seed=s, ignore_eos=True)))
        for s in range(4)
    }
    assert len(outputs) >= 3


def test_top_k_1_and_tiny_top_p_equal_greedy(engine):
    prompt = random_prompts(76, [10])[0]
    expected = alone(engine, prompt, greedy(16))
    hot = dict(max_tokens=16, temperature=1.5, seed=5, ignore_eos=True)
    assert alone(engine, prompt, SamplingParams(**hot)) != expected  # the filters below do matter
    assert alone(engine, prompt, SamplingParams(top_k=1, **hot)) == expected
    assert alone(engine, prompt, SamplingParams(top_p=1e-6, **hot)) == expected


def test_unseeded_sampled_requests_use_different_seeds(engine):
    prompt = random_prompts(77, [8])[0]
    params = SamplingParams(max_tokens=12, temperature=1.0, ignore_eos=True)
    outs = engine.generate([prompt] * 3, params)
    assert len({tuple(o.token_ids) for o in outs}) >= 2


# --- the Sampler on known logits ---------------------------------------------------------------------


def seq_with(params: SamplingParams, seed: int, index: int = 0) -> Sequence:
    """A sequence about to draw output token `index`."""
    return Sequence("r", [1], params, 5, seed, resume_token_ids=[3] * index)


def draws(logits: list[float], params: SamplingParams, n: int = 1500) -> collections.Counter:
    row = torch.tensor([logits], dtype=torch.float64)
    sampler = Sampler()
    return collections.Counter(sampler(row, [seq_with(params, seed)])[0] for seed in range(n))


PROBS = [0.5, 0.3, 0.2]
LOGITS = [math.log(p) for p in PROBS] + [-1e9] * 5  # five tokens that are never possible


def test_sampler_draws_from_the_softmax():
    counts = draws(LOGITS, SamplingParams(temperature=1.0))
    assert set(counts) == {0, 1, 2}
    for token, p in enumerate(PROBS):
        assert counts[token] / 1500 == pytest.approx(p, abs=0.05)


def test_sampler_temperature_sharpens():
    counts = draws(LOGITS, SamplingParams(temperature=0.2))
    assert counts[0] / 1500 > 0.85  # p^5 renormalised: 0.92


def test_sampler_top_k():
    counts = draws([3.0, 2.9, 2.8, 2.7, 2.6], SamplingParams(temperature=1.0, top_k=2))
    assert set(counts) == {0, 1}


@pytest.mark.parametrize("top_p,allowed", [(0.5, {0}), (0.6, {0, 1}), (0.8, {0, 1}), (0.81, {0, 1, 2})])
def test_sampler_top_p_keeps_the_smallest_set_reaching_p(top_p, allowed):
    counts = draws(LOGITS, SamplingParams(temperature=1.0, top_p=top_p), n=600)
    assert set(counts) == allowed


def test_sampler_row_does_not_depend_on_the_batch():
    """A sampled row gives the same token whatever the other rows are and where it sits."""
    params = SamplingParams(temperature=1.0)
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 50, generator=gen, dtype=torch.float64)
    seqs = [seq_with(params, seed=s, index=s % 3) for s in range(5)]
    together = Sampler()(logits, seqs)
    for i in range(5):
        assert Sampler()(logits[i : i + 1], [seqs[i]]) == [together[i]]
    assert Sampler()(logits.flip(0), seqs[::-1]) == together[::-1]


def test_sampler_greedy_rows_take_the_argmax():
    logits = torch.tensor([[0.1, 0.9, 0.3], [2.0, -1.0, 1.0]], dtype=torch.float64)
    seqs = [seq_with(SamplingParams(temperature=0), seed=s) for s in range(2)]
    assert Sampler()(logits, seqs) == [1, 0]


def test_sampler_token_index_changes_the_draw():
    row = torch.zeros(1, 100, dtype=torch.float64)  # uniform over 100 tokens
    params = SamplingParams(temperature=1.0)
    tokens = {Sampler()(row, [seq_with(params, seed=1, index=i)])[0] for i in range(20)}
    assert len(tokens) >= 10


def test_the_noise_is_a_function_of_seed_index_and_token_only():
    """The exponential race's noise (sampler.exponential_noise): each element depends on its row's key and
    its vocabulary id alone, and is Exp(1)-distributed."""
    from batching.sampler import exponential_noise, token_seed

    keys = torch.tensor(
        [token_seed(s, i) for s, i in [(1, 0), (1, 1), (2, 0), (2**62, 7)]], dtype=torch.int64
    )
    together = exponential_noise(keys, 5000)
    for r in range(4):
        assert torch.equal(exponential_noise(keys[r : r + 1], 5000)[0], together[r])
    assert torch.equal(exponential_noise(keys, 100), together[:, :100])
    assert (together > 0).all() and abs(together.mean().item() - 1.0) < 0.02
    assert len({tuple(row[:8].tolist()) for row in together}) == 4
