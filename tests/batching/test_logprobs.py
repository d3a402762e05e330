"""Log probabilities (batching/logprobs.py): of output tokens (SamplingParams.logprobs) and prompt tokens
(prompt_logprobs), equal in float64 to the log-softmax of transformers' own logits for the same tokens,
whatever the batch, the chunking, preemption (swap or recompute), the prefix cache or a resume.

The model is GPT-2's (learned positions): transformers computes rotary tables in float32 even in a float64
model, and a position's cos/sin then rounds differently between two forwards of different lengths (the
vectorised and the scalar cos), which moves a llama's log probabilities by ~1e-6; GPT-2's agree to 1e-15."""

from __future__ import annotations

import functools

import pytest
import torch
from transformers import AutoModelForCausalLM

from batching import SamplingParams
from tests.batching.conftest import greedy, random_prompts, run_to_completion
from tests.batching.test_preemption import WORKLOAD, run_arrivals

TOL = 1e-9


@pytest.fixture(scope="module")
def gpt2_path(checkpoint) -> str:
    return checkpoint("gpt2")


@pytest.fixture(scope="module")
def hf_logprobs(gpt2_path):
    """hf_logprobs(token_ids) -> [T, V] float64 log-softmax of transformers' logits at every position."""
    model = AutoModelForCausalLM.from_pretrained(gpt2_path, dtype=torch.float64, attn_implementation="eager")

    @functools.cache
    def run(ids: tuple[int, ...]) -> torch.Tensor:
        with torch.inference_mode():
            return model(torch.tensor([ids])).logits[0].log_softmax(-1)

    return lambda ids: run(tuple(ids))


def check(out, prompt, params: SamplingParams, hf_logprobs) -> None:
    """The output's log probabilities are transformers' for its prompt and tokens."""
    full = hf_logprobs(list(prompt) + list(out.token_ids))  # position q ranks token q + 1
    wanted = []
    if params.prompt_logprobs is not None:
        assert [lp.token_id for lp in out.prompt_logprobs] == list(prompt[1:])
        wanted += [(q, lp, params.prompt_logprobs) for q, lp in enumerate(out.prompt_logprobs)]
    if params.logprobs is not None:
        assert [lp.token_id for lp in out.logprobs] == out.token_ids
        wanted += [(len(prompt) - 1 + j, lp, params.logprobs) for j, lp in enumerate(out.logprobs)]
    assert wanted
    for q, lp, k in wanted:
        assert abs(lp.logprob - full[q, lp.token_id].item()) < TOL, (q, lp.logprob, full[q, lp.token_id])
        values, ids = full[q].topk(k)
        assert [t for t, _ in lp.top] == ids.tolist() and len(lp.top) == k
        assert max((abs(v - w) for (_, v), w in zip(lp.top, values.tolist())), default=0) < TOL


def test_logprobs_in_a_chunked_batch(make_engine, gpt2_path, hf_logprobs):
    engine = make_engine(model=gpt2_path, block_size=4, max_num_batched_tokens=7, max_num_seqs=4)
    prompts = random_prompts(7, [3, 11, 20, 6])
    params = [
        greedy(9, logprobs=2, prompt_logprobs=3),
        greedy(5, logprobs=0),
        greedy(6, prompt_logprobs=1),
        SamplingParams(max_tokens=8, temperature=0.8, top_k=20, seed=3, logprobs=4),  # sampled
    ]
    outs = engine.generate(prompts, params)
    for out, prompt, p in zip(outs, prompts, params, strict=True):
        check(out, prompt, p, hf_logprobs)
        assert (out.logprobs is None) == (p.logprobs is None)
        assert (out.prompt_logprobs is None) == (p.prompt_logprobs is None)


@pytest.mark.parametrize("mode,host_blocks", [("swap", 64), ("recompute", 0)])
def test_logprobs_exact_under_preemption(make_engine, gpt2_path, hf_logprobs, mode, host_blocks):
    engine = make_engine(
        model=gpt2_path,
        block_size=2,
        num_device_blocks=25,
        num_host_blocks=host_blocks,
        max_num_batched_tokens=16,
        max_num_seqs=4,
        preemption_mode=mode,
    )
    prompts = random_prompts(30, [n for n, *_ in WORKLOAD])
    requests = [
        (f"r{i}", prompts[i], greedy(mt, logprobs=1, prompt_logprobs=i % 2 or None), prio, at)
        for i, (_, mt, prio, at) in enumerate(WORKLOAD)
    ]
    outputs = run_arrivals(engine, requests)
    assert engine.stats()["num_preemptions"] >= 2
    for req_id, prompt, params, _, _ in requests:
        check(outputs[req_id], prompt, params, hf_logprobs)


def test_prompt_logprobs_skip_the_prefix_cache_and_a_resume_recomputes_its_tokens(
    make_cpu_engine, gpt2_path, hf_logprobs
):
    engine = make_cpu_engine(model=gpt2_path, block_size=4, enable_prefix_caching=True)
    [prompt] = random_prompts(11, [17])
    [first] = engine.generate([prompt], greedy(6))  # its full blocks are cached
    params = greedy(6, prompt_logprobs=2, logprobs=2)
    [again] = engine.generate([prompt], params)
    check(again, prompt, params, hf_logprobs)
    # a request resumed after a crash, with the tokens it made before: their log probabilities come
    # from their prefill, the rest from sampling, all as if it had never stopped
    engine.add_request("resumed", prompt, params, resume_token_ids=first.token_ids[:4])
    resumed = run_to_completion(engine)["resumed"]
    assert resumed.token_ids == first.token_ids
    check(resumed, prompt, params, hf_logprobs)


def test_delta_outputs_carry_each_tokens_logprob_once(make_cpu_engine):
    engine = make_cpu_engine()
    [prompt] = random_prompts(5, [9])
    params = greedy(7, logprobs=1, prompt_logprobs=0, output_kind="delta")
    engine.add_request("d", prompt, params)
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert [len(o.logprobs) for o in outs] == [len(o.token_ids) for o in outs]
    assert [o.prompt_logprobs is not None for o in outs] == [True] + [False] * (len(outs) - 1)
    [whole] = make_cpu_engine().generate([prompt], greedy(7, logprobs=1, prompt_logprobs=0))
    assert [lp for o in outs for lp in o.logprobs] == whole.logprobs
    assert outs[0].prompt_logprobs == whole.prompt_logprobs
