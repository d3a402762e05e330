"""Attention-aware chunk sizing (Scheduler._chunk): a chunk deep in a long prompt, whose attention spans
more context, gets fewer tokens of the budget, so full steps take about the same time."""

from __future__ import annotations

import pytest

from batching import EngineConfig, SamplingParams
from batching.block_manager import BlockManager
from batching.scheduler import Scheduler
from batching.sequence import Sequence
from tests.batching.test_scheduler_properties import run_fake_step

BUDGET = 64


def chunks_of_a_long_prompt(context_per_token: float | None, aware: bool = True) -> list[int]:
    config = EngineConfig(
        block_size=4,
        num_device_blocks=200,
        num_host_blocks=0,
        max_num_batched_tokens=BUDGET,
        attention_aware_chunks=aware,
    )
    sched = Scheduler(config, BlockManager(200, 0, 4), context_per_token)
    sched.add(
        Sequence("long", [5] * 600, SamplingParams(max_tokens=1, temperature=0), 5, 0, arrival_time=1.0)
    )
    sizes = []
    while sched.live_sequences():
        out = run_fake_step(sched)
        sizes.extend(out.num_scheduled_tokens)
    return sizes


def cost(start: int, n: int, c: float) -> float:
    return n * (1 + (start + n / 2) / c)


def test_chunks_shrink_as_the_context_grows_and_each_costs_about_the_budget():
    c = 200.0
    sizes = chunks_of_a_long_prompt(c)
    assert sum(sizes) == 600
    assert sizes[0] == 56  # 56 * (1 + 28/200) = 63.8; 57 would cost 65.1
    assert all(a >= b for a, b in zip(sizes, sizes[1:]))  # later chunks attend over more: fewer tokens
    assert sizes[-2] < BUDGET / 3
    start = 0
    for n in sizes[:-1]:  # every chunk but the last fills the budget, no more
        assert round(cost(start, n, c)) <= BUDGET < round(cost(start, n + 1, c)), (start, n)
        start += n


@pytest.mark.parametrize("c", [None, 1e12])
def test_plain_token_budget_without_a_cost_model(c):
    assert chunks_of_a_long_prompt(c)[:-1] == [BUDGET] * (600 // BUDGET)


def test_switched_off_by_the_config():
    assert chunks_of_a_long_prompt(200.0, aware=False)[:-1] == [BUDGET] * (600 // BUDGET)


def test_a_chunk_always_makes_progress():
    """Even when one token's attention costs more than the whole budget, a prefill moves a token a step."""
    sizes = chunks_of_a_long_prompt(0.5)
    assert sum(sizes) == 600 and min(sizes) >= 1


def test_the_models_cost_constant_is_its_linear_weights_over_attention_per_key(llama_path):
    """C = (linear weights of one decoder layer) / (2 x heads x head_dim): for a Llama layer that is
    (q + k + v + o projections + the 3 MLP matrices) over the multiply-adds of q.k and p.v per key."""
    from transformers import AutoModelForCausalLM

    from batching.step_cost import attention_context_per_token

    model = AutoModelForCausalLM.from_pretrained(llama_path)
    mc = model.config
    head_dim = mc.hidden_size // mc.num_attention_heads
    q_o = 2 * mc.hidden_size * mc.num_attention_heads * head_dim
    k_v = 2 * mc.hidden_size * mc.num_key_value_heads * head_dim
    mlp = 3 * mc.hidden_size * mc.intermediate_size
    expected = (q_o + k_v + mlp) / (2 * mc.num_attention_heads * head_dim)
    # the norms (a few hidden-sized vectors per layer) are counted too: within 2%
    assert attention_context_per_token(model) == pytest.approx(expected, rel=0.02)
