"""Penalties (batching/sampler.py apply_penalties): vLLM's repetition_penalty equals transformers'
RepetitionPenaltyLogitsProcessor, OpenAI's presence and frequency penalties their definition as a logits
processor, greedy in float64 alone, in a batch and under preemption; min_p drops the unlikely tokens. The
sampler's other logits controls against transformers too: logit_bias (sequence_bias) and min_tokens
(min_new_tokens), the latter under preemption and resumed after a crash."""

from __future__ import annotations

import collections
import math

import pytest
import torch
from transformers import AutoModelForCausalLM, LogitsProcessor, LogitsProcessorList

from batching import SamplingParams
from batching.sampler import Sampler
from batching.sequence import Sequence
from tests.batching.conftest import greedy, random_prompts
from tests.batching.test_preemption import WORKLOAD, run_arrivals


class OpenAIPenalties(LogitsProcessor):
    """OpenAI's presence / frequency penalties on the tokens generated so far (after `prompt_len`)."""

    def __init__(self, prompt_len: int, presence: float, frequency: float):
        self.prompt_len, self.presence, self.frequency = prompt_len, presence, frequency

    def __call__(self, input_ids, scores):
        counts = torch.zeros_like(scores).scatter_add_(
            1,
            input_ids[:, self.prompt_len :],
            torch.ones_like(input_ids[:, self.prompt_len :], dtype=scores.dtype),
        )
        return scores - self.frequency * counts - self.presence * (counts > 0)


@pytest.fixture(scope="module")
def hf_greedy(llama_path):
    model = AutoModelForCausalLM.from_pretrained(llama_path, dtype=torch.float64, attn_implementation="eager")

    def run(prompt, max_new_tokens, repetition_penalty=1.0, presence=0.0, frequency=0.0, **generate):
        """generate: more of generate()'s arguments (sequence_bias, min_new_tokens with eos_token_id)."""
        ids = torch.tensor([prompt])
        processors = LogitsProcessorList()
        if presence or frequency:
            processors.append(OpenAIPenalties(len(prompt), presence, frequency))
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            repetition_penalty=repetition_penalty,
            logits_processor=processors,
            **({"eos_token_id": None} | generate),
            pad_token_id=0,
        )
        return out[0, len(prompt) :].tolist()

    return run


PENALTIES = [
    dict(repetition_penalty=1.5),
    dict(repetition_penalty=0.7),
    dict(presence_penalty=1.5),
    dict(frequency_penalty=0.9, presence_penalty=-0.5),
    dict(repetition_penalty=1.2, frequency_penalty=0.4),
    {},
]


def reference(hf_greedy, prompt, n, p: dict):
    return hf_greedy(
        prompt,
        n,
        repetition_penalty=p.get("repetition_penalty", 1.0),
        presence=p.get("presence_penalty", 0.0),
        frequency=p.get("frequency_penalty", 0.0),
    )


def test_penalties_equal_transformers_processors_in_a_batch(make_engine, hf_greedy):
    engine = make_engine(block_size=4, max_num_batched_tokens=9)
    prompts = random_prompts(3, [4, 9, 6, 13, 5, 8])
    params = [greedy(24, **p) for p in PENALTIES]
    outs = engine.generate(prompts, params)
    for out, prompt, p in zip(outs, prompts, PENALTIES, strict=True):
        assert out.token_ids == reference(hf_greedy, prompt, 24, p), p
    # the penalties matter: without them some of these differ
    plain = engine.generate(prompts[:5], greedy(24))
    assert sum(a.token_ids != b.token_ids for a, b in zip(plain, outs, strict=False)) >= 3


def test_penalties_exact_under_preemption(make_engine, hf_greedy):
    engine = make_engine(
        block_size=2, num_device_blocks=25, num_host_blocks=0, max_num_batched_tokens=16, max_num_seqs=4
    )
    prompts = random_prompts(30, [n for n, *_ in WORKLOAD])
    requests = [
        (f"r{i}", prompts[i], greedy(mt, **PENALTIES[i % len(PENALTIES)]), prio, at)
        for i, (_, mt, prio, at) in enumerate(WORKLOAD)
    ]
    outputs = run_arrivals(engine, requests)
    assert engine.stats()["num_preemptions"] >= 2
    for i, (req_id, prompt, params, _, _) in enumerate(requests):
        want = reference(hf_greedy, prompt, params.max_tokens, PENALTIES[i % len(PENALTIES)])
        assert outputs[req_id].token_ids == want, req_id


def test_min_p_drops_the_unlikely_tokens():
    probs = [0.5, 0.3, 0.15, 0.05]
    row = torch.tensor([[math.log(p) for p in probs]], dtype=torch.float64)
    params = SamplingParams(temperature=1.0, min_p=0.2)  # floor 0.1: only tokens 0, 1, 2
    counts = collections.Counter(
        Sampler()(row, [Sequence("r", [1], params, 5, seed)])[0] for seed in range(1500)
    )
    assert set(counts) == {0, 1, 2}
    assert counts[0] / 1500 == pytest.approx(0.5 / 0.95, abs=0.05)


def test_logit_bias_equals_transformers_sequence_bias_greedy(make_engine, hf_greedy):
    """OpenAI's logit_bias is added to the logits before greedy's argmax: transformers' sequence_bias of
    single tokens, in float64, in a batch with unbiased and penalized rows."""
    engine = make_engine(block_size=4, max_num_batched_tokens=9)
    prompts = random_prompts(5, [4, 9, 6, 13])
    plain = engine.generate(prompts, greedy(16))
    biases = [
        {plain[0].token_ids[1]: -100.0, 7: 2.5},  # a banned token, a favoured one
        {plain[1].token_ids[3]: -4.0, plain[1].token_ids[0]: -1.5},
        {},
        {11: 1.0, 12: 1.25, 13: -0.5},
    ]
    params = [greedy(16, logit_bias=b) for b in biases]
    params[3] = greedy(16, logit_bias=biases[3], repetition_penalty=1.3)
    outs = engine.generate(prompts, params)
    for out, prompt, bias, p in zip(outs, prompts, biases, params, strict=True):
        want = hf_greedy(
            prompt,
            16,
            repetition_penalty=p.repetition_penalty,
            sequence_bias={(t,): b for t, b in bias.items()} or None,
        )
        assert out.token_ids == want, bias
    assert outs[0].token_ids != plain[0].token_ids and plain[0].token_ids[1] not in outs[0].token_ids
    assert outs[1].token_ids != plain[1].token_ids


def test_logit_bias_refuses_what_it_cannot_apply(make_cpu_engine):
    for bias, message in (({-1: 1.0}, "keys must be token ids"), ({3: 100.5}, "from -100 to 100")):
        with pytest.raises(ValueError, match=message):
            SamplingParams(logit_bias=bias)
    engine = make_cpu_engine()
    with pytest.raises(ValueError, match=r"logit_bias: token id 100000 is outside the vocabulary"):
        engine.add_request("r", [1, 2], SamplingParams(logit_bias={100000: 1.0}))


def test_min_tokens_equals_transformers_min_new_tokens_preempted_and_resumed(make_engine, hf_greedy):
    """min_tokens with a stop token id that greedy draws early: the engine's output equals generate() with that
    token as its end of sequence and min_new_tokens, alone, under preemption, and resumed from tokens saved
    before min_tokens was reached (the count includes them)."""
    engine = make_engine(
        block_size=2, num_device_blocks=25, num_host_blocks=0, max_num_batched_tokens=16, max_num_seqs=4
    )
    prompts = random_prompts(31, [n for n, *_ in WORKLOAD])
    plain = engine.generate(prompts, [greedy(mt) for _, mt, _, _ in WORKLOAD])
    requests, wants = [], {}
    for i, ((_, mt, prio, at), prompt, out) in enumerate(zip(WORKLOAD, prompts, plain, strict=True)):
        stop, least = out.token_ids[1], 4 + i % 5
        params = greedy(mt, stop_token_ids=[stop], min_tokens=least)
        requests.append((f"r{i}", prompt, params, prio, at))
        wants[f"r{i}"] = hf_greedy(prompt, mt, eos_token_id=stop, min_new_tokens=least)
        assert len(wants[f"r{i}"]) >= least
    outputs = run_arrivals(engine, requests)
    assert engine.stats()["num_preemptions"] >= 2
    for req_id, want in wants.items():
        assert outputs[req_id].token_ids == want, req_id
    req_id, prompt, params, _, _ = requests[3]
    engine.add_request("resumed", prompt, params, resume_token_ids=wants[req_id][:2])
    assert _finish(engine, "resumed").token_ids == wants[req_id]


def _finish(engine, req_id):
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished and out.request_id == req_id:
                return out
    raise AssertionError(f"{req_id} did not finish")


def test_token_counts_on_the_device_follow_the_tokens():
    """The sampler's per-row counts (token_counts.py), updated with each step's sampled ids, equal counts of
    the sequences' tokens made afresh: across steps, with rows joining and leaving, a sequence whose token was
    not appended (rebuilt), and the table growing."""
    vocab = 40
    gen = torch.Generator().manual_seed(3)
    sampler = Sampler()
    params = SamplingParams(max_tokens=100, temperature=1.0, repetition_penalty=1.3, frequency_penalty=0.5)
    live = [Sequence(f"r{i}", [i + 1, i + 2, i + 1], params, 5, i) for i in range(3)]
    for step in range(30):
        if step % 4 == 0:  # one joins (the table grows past 8 rows), and now and then one leaves
            live.append(Sequence(f"j{step}", [step % vocab] * 3, params, 5, step, resume_token_ids=[1, 1]))
        if step % 7 == 6:
            sampler.forget(live.pop(0))
        tokens = sampler(torch.randn(len(live), vocab, generator=gen, dtype=torch.float64), live)
        for i, (seq, token) in enumerate(zip(live, tokens, strict=True)):
            if not (step == 11 and i == 1):  # this one's token is dropped: its row must be built again
                seq.token_ids.append(token)
        _, seen, counts = sampler.token_counts.gather(live, vocab, torch.device("cpu"))
        for seq, seen_row, count_row in zip(live, seen, counts, strict=True):
            assert set(seen_row.nonzero().flatten().tolist()) == set(seq.token_ids), step
            want = collections.Counter(seq.output_token_ids)
            assert {t: c for t, c in enumerate(count_row.tolist()) if c} == dict(want), step
    assert len(sampler.token_counts.rows) == len(live)
    assert sampler.token_counts.seen.shape[0] > 8  # grown from its first 8 rows
