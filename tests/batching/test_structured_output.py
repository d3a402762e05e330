"""Structured output (batching/grammar.py): with a JSON schema, every output parses and validates against it
and ends ("stop") when its JSON is complete; greedy and seeded, alone and batched with unconstrained rows,
under preemption by recompute and by swap, and resumed from its tokens after a crash."""

from __future__ import annotations

import json

import jsonschema_rs
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from batching import SamplingParams
from batching.grammar import JSON_OBJECT_SCHEMA
from tests.batching.conftest import random_prompts
from tests.batching.test_preemption import WORKLOAD, run_arrivals

FIELD_SCHEMAS = st.one_of(
    st.just({"type": "boolean"}),
    st.builds(
        lambda lo, span: {"type": "integer", "minimum": lo, "maximum": lo + span},
        st.integers(-50, 50),
        st.integers(0, 500),
    ),
    st.builds(lambda n: {"type": "string", "maxLength": n}, st.integers(0, 6)),
    st.lists(st.text("abcxyz", min_size=1, max_size=4), min_size=1, max_size=3, unique=True).map(
        lambda values: {"enum": values}
    ),
)
SCHEMAS = st.dictionaries(
    st.text("abcdefgh", min_size=1, max_size=5), FIELD_SCHEMAS, min_size=1, max_size=3
).map(
    lambda fields: {
        "type": "object",
        "properties": fields,
        "required": sorted(fields),
        "additionalProperties": False,
    }
)
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 5},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "ok"],
    "additionalProperties": False,
}


def constrained(schema, temperature=0.0, seed=None, max_tokens=96) -> SamplingParams:
    text = schema if isinstance(schema, str) else json.dumps(schema)
    return SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed, json_schema=text)


def assert_valid(out, schema) -> None:
    assert out.finish_reason == "stop", out.text
    value = json.loads(out.text)
    assert jsonschema_rs.is_valid(json.loads(schema) if isinstance(schema, str) else schema, value), out.text


@pytest.fixture(scope="module")
def engine(make_cpu_engine):
    return make_cpu_engine()


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(schema=SCHEMAS, seed=st.integers(0, 2**31))
def test_every_output_validates_against_its_schema(engine, schema, seed):
    prompts = random_prompts(seed % 1000, [5, 9])
    greedy_out, sampled_out = engine.generate(
        prompts, [constrained(schema), constrained(schema, temperature=1.0, seed=seed)]
    )
    assert_valid(greedy_out, schema)
    assert_valid(sampled_out, schema)


def test_json_object_is_any_object(engine):
    outs = engine.generate(random_prompts(1, [4, 7]), [constrained(JSON_OBJECT_SCHEMA, max_tokens=200)] * 2)
    for out in outs:
        if out.finish_reason == "stop":  # a free object may outlast max_tokens; what ends is an object
            assert isinstance(json.loads(out.text), dict)
        else:
            assert out.finish_reason == "length"
    assert out.token_ids[0] == engine.tokenizer.encode("{", add_special_tokens=False)[0]


def test_alone_equals_batched_with_unconstrained_rows(engine):
    prompts = random_prompts(2, [6, 11, 4, 8])
    params = [
        constrained(SCHEMA),
        SamplingParams(max_tokens=20, temperature=0, ignore_eos=True),
        constrained(SCHEMA, temperature=0.8, seed=7),
        SamplingParams(max_tokens=20, temperature=1.0, seed=3, ignore_eos=True),
    ]
    together = engine.generate(prompts, params)
    for prompt, p, out in zip(prompts, params, together, strict=True):
        assert engine.generate([prompt], p)[0].token_ids == out.token_ids
    assert_valid(together[0], SCHEMA)
    assert_valid(together[2], SCHEMA)
    # the grammar matters: unconstrained, the same request writes no JSON
    free = engine.generate([prompts[0]], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))[0]
    assert free.token_ids != together[0].token_ids


@pytest.mark.parametrize("host_blocks", [0, 64], ids=["recompute", "swap"])
def test_grammar_state_survives_preemption(make_cpu_engine, engine, host_blocks):
    tight = make_cpu_engine(
        block_size=2,
        num_device_blocks=60,
        num_host_blocks=host_blocks,
        max_num_batched_tokens=16,
        max_num_seqs=4,
        preemption_mode="swap" if host_blocks else "recompute",
    )
    prompts = random_prompts(30, [n for n, *_ in WORKLOAD])
    requests = [
        (
            f"r{i}",
            prompts[i],
            constrained(SCHEMA, temperature=0.0 if i % 2 else 1.0, seed=i, max_tokens=48),
            prio,
            at,
        )
        for i, (_, _, prio, at) in enumerate(WORKLOAD)
    ]
    outputs = run_arrivals(tight, requests)
    stats = tight.stats()
    assert stats["num_preemptions"] >= 2
    if host_blocks:
        assert stats["num_blocks_swapped_out"] > 0
    for req_id, prompt, params, _, _ in requests:
        assert outputs[req_id].token_ids == engine.generate([prompt], params)[0].token_ids, req_id
        assert_valid(outputs[req_id], SCHEMA)


def test_resumed_request_rebuilds_its_grammar(engine):
    prompt = random_prompts(5, [7])[0]
    params = constrained(SCHEMA, temperature=1.0, seed=11)
    whole = engine.generate([prompt], params)[0]
    assert_valid(whole, SCHEMA)
    for k in (1, len(whole.token_ids) // 2, len(whole.token_ids) - 1):
        engine.add_request("resumed", prompt, params, resume_token_ids=whole.token_ids[:k])
        out = None
        while engine.has_unfinished_requests():
            out = next((o for o in engine.step() if o.finished), out)
        assert out is not None and out.token_ids == whole.token_ids, k
        assert out.finish_reason == "stop"


def test_bad_schema_or_resumed_tokens_are_refused_by_name(engine):
    with pytest.raises(ValueError, match="response_format"):
        engine.add_request("bad", [5, 6], constrained({"type": "strin"}))
    with pytest.raises(ValueError, match="resume_token_ids"):
        engine.add_request(
            "bad",
            [5, 6],
            constrained(SCHEMA),
            resume_token_ids=engine.tokenizer.encode("x", add_special_tokens=False),
        )
    assert not engine.has_unfinished_requests()
