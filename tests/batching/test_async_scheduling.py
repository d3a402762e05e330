"""Async scheduling (engine.py): the next step is scheduled and launched while this step's tokens are still
on the device, and its outputs come with the next call. What a user sees is the same as without it: the
same tokens, text, finish reasons and log probabilities, for stops that only the host can see (stop strings,
EOS), cancels of a request whose token is in flight, and requests whose next step needs their tokens on the
host (grammars, penalties, log probabilities: those steps are finished at once). The parity, preemption,
swap and prefix-cache suites also run on this path (conftest.ENGINE_PATHS: cpu-kernel-async)."""

from __future__ import annotations

import json

import pytest

from batching import SamplingParams
from batching.sequence import PENDING_TOKEN
from batching.tokenizer import EOS_ID
from tests.batching.conftest import greedy, random_prompts


@pytest.fixture(scope="module")
def engines(make_cpu_engine):
    """(sync, async) engines alike in all else."""
    make = lambda overlap: make_cpu_engine(  # noqa: E731
        async_scheduling=overlap,
        block_size=4,
        num_device_blocks=400,
        max_num_batched_tokens=32,
        max_num_seqs=8,
    )
    return make(False), make(True)


def drive(engine, requests, aborts=None):
    """Add `requests` [(id, prompt, params)] and step until idle; `aborts` {step: id} cancels a request before
    that step. Returns ({id: final RequestOutput built from its deltas}, {id: [output per step]})."""
    aborts = aborts or {}
    for req_id, prompt, params in requests:
        engine.add_request(req_id, prompt, params)
    finals, per_step, step = {}, {}, 0
    while engine.has_unfinished_requests():
        if step in aborts:
            engine.abort(aborts[step])
        for out in engine.step():
            assert PENDING_TOKEN not in out.token_ids, f"{out.request_id}: a placeholder reached an output"
            assert out.request_id not in finals, f"{out.request_id}: an output after its last"
            per_step.setdefault(out.request_id, []).append(out)
            if out.finished:
                finals[out.request_id] = out
        engine.check_invariants()
        step += 1
    assert engine.block_manager.num_free_device_blocks == engine.block_manager.num_device_blocks
    return finals, per_step


def joined(outs) -> tuple[list[int], str]:
    return [t for o in outs for t in o.token_ids], "".join(o.text for o in outs)


def delta(**kwargs) -> SamplingParams:
    return SamplingParams(output_kind="delta", **kwargs)


def mixed_requests(reference_tokens) -> list[tuple[str, list[int], SamplingParams]]:
    """Requests that stop every way, sampled and greedy; `reference_tokens` [id -> greedy tokens] of the
    prompts picks stop tokens and strings they actually meet."""
    prompts = random_prompts(300, [5 + 3 * i for i in range(10)])
    ref = reference_tokens
    return [
        ("length", prompts[0], delta(max_tokens=17, temperature=0, ignore_eos=True)),
        ("stop-id", prompts[1], delta(max_tokens=40, temperature=0, stop_token_ids=[ref[1][6]])),
        ("eos", prompts[2], delta(max_tokens=40, temperature=0)),
        (
            "min-tokens",
            prompts[3],
            delta(max_tokens=30, temperature=0, stop_token_ids=[ref[3][2]], min_tokens=9),
        ),
        ("sampled", prompts[4], delta(max_tokens=25, temperature=0.9, top_p=0.8, seed=11, ignore_eos=True)),
        ("sampled-k", prompts[5], delta(max_tokens=25, temperature=1.3, top_k=20, seed=5, ignore_eos=True)),
        ("bias", prompts[6], delta(max_tokens=12, temperature=0, logit_bias={7: 5.0}, ignore_eos=True)),
        ("stop-at-eos", prompts[7], delta(max_tokens=30, temperature=0, stop_token_ids=[EOS_ID])),
        ("one", prompts[8], delta(max_tokens=1, temperature=0)),
        ("cut", prompts[9], delta(max_tokens=30, temperature=0, ignore_eos=True, stop=["e", "a", "o"])),
    ]


@pytest.fixture(scope="module")
def reference_tokens(engines):
    sync, _ = engines
    prompts = random_prompts(300, [5 + 3 * i for i in range(10)])
    return [o.token_ids for o in sync.generate(prompts, greedy(40))]


def test_every_stop_gives_what_it_gives_without_async(engines, reference_tokens):
    sync, overlapped = engines
    requests = mixed_requests(reference_tokens)
    want, _ = drive(sync, requests)
    before = overlapped.stats()["num_overlapped_steps"]
    got, got_steps = drive(overlapped, requests)
    assert overlapped.stats()["num_overlapped_steps"] - before > 10, "the steps did not overlap"
    _, want_steps = drive(sync, requests)
    for req_id, _, _ in requests:
        w, g = want[req_id], got[req_id]
        assert joined(got_steps[req_id]) == joined(want_steps[req_id]), req_id
        assert (g.finish_reason, g.num_preemptions) == (w.finish_reason, w.num_preemptions), req_id
    assert {w.finish_reason for w in want.values()} == {"stop", "length"}


def test_a_sequence_is_not_run_past_a_last_token_still_on_the_device(engines):
    """max_tokens is known ahead: a request is never scheduled after the step that samples its last token
    (only stops the host finds, EOS and stop strings, cost a moot row)."""
    sync, overlapped = engines
    prompt = random_prompts(301, [9])[0]
    rows = []
    for engine in (sync, overlapped):
        hook = engine.model.register_forward_pre_hook(
            lambda m, a, kw: rows.append(kw["input_ids"].shape[1]), with_kwargs=True
        )
        try:
            drive(engine, [("alone", prompt, delta(max_tokens=6, temperature=0, ignore_eos=True))])
        finally:
            hook.remove()
    # a 9-token prompt in one chunk, then 5 decodes: the same forwards either way
    assert rows == [9, 1, 1, 1, 1, 1] * 2


def test_outputs_come_one_call_later(engines):
    sync, overlapped = engines
    prompts = random_prompts(302, [6, 11])
    requests = [
        (f"r{i}", p, delta(max_tokens=5, temperature=0, ignore_eos=True)) for i, p in enumerate(prompts)
    ]
    for engine in (sync, overlapped):
        for req_id, prompt, params in requests:
            engine.add_request(req_id, prompt, params)
    sync_calls, async_calls = [], []
    while sync.has_unfinished_requests() or overlapped.has_unfinished_requests():
        sync_calls.append(sorted((o.request_id, tuple(o.token_ids)) for o in sync.step()))
        async_calls.append(sorted((o.request_id, tuple(o.token_ids)) for o in overlapped.step()))
    assert async_calls[0] == [] and sync_calls[0] != []
    assert async_calls[1:] == sync_calls[: len(async_calls) - 1]
    assert sync_calls[len(async_calls) - 1 :] in ([], [[]])


def test_a_cancel_drops_the_token_in_flight(engines):
    """A request cancelled while its last token is on the device: its cancel output holds the tokens it had
    on the host, the token in flight is never delivered, and the others are untouched."""
    sync, overlapped = engines
    prompts = random_prompts(303, [7, 8, 9])
    requests = [
        (f"c{i}", p, delta(max_tokens=20, temperature=0, ignore_eos=True)) for i, p in enumerate(prompts)
    ]
    _, want_steps = drive(sync, requests)
    want = {req_id: joined(outs)[0] for req_id, outs in want_steps.items()}
    for req_id, prompt, params in requests:
        overlapped.add_request(req_id, prompt, params)
    delivered: dict[str, list[int]] = {}
    for _ in range(6):
        for out in overlapped.step():
            delivered.setdefault(out.request_id, []).extend(out.token_ids)
    victim = overlapped.requests["c1"]
    assert victim.pending_row >= 0, "c1 has a token in flight"
    in_flight = len(victim.token_ids) - victim.num_prompt_tokens  # with its placeholder
    assert overlapped.abort("c1")
    _, steps = drive(overlapped, [])
    (cancelled,) = steps["c1"]
    assert cancelled.finish_reason == "abort" and cancelled.token_ids == []
    assert delivered["c1"] == want["c1"][: in_flight - 1], "what it had on the host, not the token in flight"
    assert PENDING_TOKEN not in victim.token_ids
    for req_id in ("c0", "c2"):
        assert delivered[req_id] + joined(steps[req_id])[0] == want[req_id]


def test_requests_that_need_their_tokens_on_the_host_run_exactly(engines):
    """Log probabilities, penalties and a grammar in the same batch as plain requests: their steps are
    finished at once, and everything matches the engine without async."""
    sync, overlapped = engines
    prompts = random_prompts(304, [6, 9, 12, 7])
    schema = json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})
    requests = [
        ("plain", prompts[0], delta(max_tokens=20, temperature=0, ignore_eos=True)),
        (
            "logprobs",
            prompts[1],
            delta(max_tokens=12, temperature=0, ignore_eos=True, logprobs=3, prompt_logprobs=2),
        ),
        (
            "penalized",
            prompts[2],
            delta(max_tokens=15, temperature=0, ignore_eos=True, repetition_penalty=1.5),
        ),
        ("grammar", prompts[3], delta(max_tokens=30, temperature=0, json_schema=schema)),
    ]
    want, want_steps = drive(sync, requests)
    got, got_steps = drive(overlapped, requests)
    for req_id, _, _ in requests:
        assert joined(got_steps[req_id]) == joined(want_steps[req_id]), req_id
        assert got[req_id].finish_reason == want[req_id].finish_reason
    lp = lambda steps: [x for o in steps for x in o.logprobs]  # noqa: E731
    assert lp(got_steps["logprobs"]) == lp(want_steps["logprobs"])
    assert got_steps["logprobs"][0].prompt_logprobs == want_steps["logprobs"][0].prompt_logprobs
    assert joined(got_steps["grammar"])[1].startswith("{")  # held to its grammar


def test_the_setting_is_checked(make_cpu_engine):
    from batching import EngineConfig

    with pytest.raises(ValueError, match="async_scheduling"):
        EngineConfig(async_scheduling="yes")
    engine = make_cpu_engine(num_device_blocks=64)
    assert engine.async_scheduling is False  # auto: on with CUDA only
