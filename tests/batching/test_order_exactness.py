"""Output does not depend on the order within a class (batching/admission_order.py): the same requests,
greedy and seeded, under "fcfs" and under "predicted" with predictions and deadlines that reorder them (and
force preemptions), give every request the same tokens, the greedy ones those of transformers' generate()."""

from __future__ import annotations

import time

import pytest

from batching import SamplingParams
from tests.batching.conftest import random_prompts, run_to_completion

LENGTHS = [3, 17, 6, 30, 1, 11, 24, 8]
MAX_TOKENS = [12, 4, 20, 6, 16, 9, 5, 14]


def requests():
    """(id, prompt, params, priority): half greedy, half seeded samples; two priority classes."""
    prompts = random_prompts(44, LENGTHS)
    out = []
    for i, (prompt, n) in enumerate(zip(prompts, MAX_TOKENS, strict=True)):
        params = (
            SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
            if i % 2 == 0
            else SamplingParams(max_tokens=n, temperature=0.9, top_p=0.9, seed=100 + i, ignore_eos=True)
        )
        out.append((f"r{i}", prompt, params, 5 if i < 6 else 3))
    return out


ORDERINGS = {
    "fcfs": ("fcfs", lambda i, n: {}),
    "predicted": ("predicted", lambda i, n: {"predicted_output_tokens": n}),
    "predicted-reversed": ("predicted", lambda i, n: {"predicted_output_tokens": 20 - n}),
    "deadlines": (  # every third at risk (slack < the margin), the later ones' deadlines earliest
        "predicted",
        lambda i, n: (
            {"deadline": time.time() + 500.0 - 10 * i} if i % 3 == 0 else {"predicted_output_tokens": 1}
        ),
    ),
}


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_every_request_gets_the_same_tokens_whatever_the_order(make_engine, llama_path, reference, mode):
    results = {}
    for name, (policy, extra) in ORDERINGS.items():
        engine = make_engine(
            scheduling_policy=policy,
            cost_seconds_per_token=1.0,  # places far apart: the predictions reorder the class
            aging_seconds=1000.0,
            deadline_margin_seconds=1000.0,
            block_size=2,
            num_device_blocks=24,  # 48 tokens: preemptions
            num_host_blocks=48 if mode == "swap" else 0,
            preemption_mode=mode,
            max_num_seqs=3,
            max_num_batched_tokens=16,
        )
        for i, (req_id, prompt, params, priority) in enumerate(requests()):
            engine.add_request(
                req_id, prompt, params, priority, arrival_time=1000.0 + i, **extra(i, params.max_tokens)
            )
        outputs = run_to_completion(engine)
        first_tokens = sorted(outputs, key=lambda k: (outputs[k].first_token_time, k))
        results[name] = (
            {k: o.token_ids for k, o in outputs.items()},
            engine.stats()["num_preemptions"],
            first_tokens,
        )
    tokens = {name: r[0] for name, r in results.items()}
    for name in ORDERINGS:
        assert tokens[name] == tokens["fcfs"], f"{name} changed a request's output"
    for req_id, prompt, params, _ in requests():
        if params.temperature == 0:
            assert tokens["fcfs"][req_id] == reference(llama_path, tuple(prompt), params.max_tokens)
    assert len({tuple(r[2]) for r in results.values()}) == len(ORDERINGS), (
        "two orderings ran in the same order"
    )
    assert all(r[1] for r in results.values()), "a run without preemption: the pool is too large to test that"
