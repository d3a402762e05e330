"""Engine.step_deltas(): a step's changes by columns (batching/step_deltas.py), what the worker's engine process
sends. Row for row it says what step()'s delta outputs say, at absolute offsets that the engine keeps; its news
(prompt, first token, preemptions) come in a request's first row and when they change, and only then."""

from __future__ import annotations

from batching import SamplingParams
from tests.batching.conftest import random_prompts

# (prompt length, max_tokens, priority, the step it arrives at): more than the small pool holds, so that
# urgent arrivals preempt (recompute) the less urgent ones
WORKLOAD = [(5, 30, 9, 0), (40, 24, 9, 0), (17, 30, 5, 0), (9, 20, 0, 3), (26, 16, 0, 6), (12, 28, 9, 8)]


def params_of(i: int, stop: list[str]) -> SamplingParams:
    """Greedy deltas; some rows with stop strings, some with log probabilities (and a prompt's)."""
    return SamplingParams(
        max_tokens=WORKLOAD[i][1],
        temperature=0,
        ignore_eos=True,
        stop=stop,
        logprobs=1 if i % 3 == 1 else None,
        prompt_logprobs=0 if i == 1 else None,
        output_kind="delta",
    )


def drive(engine, step, stops):
    """Steps the workload to the end (request 5 aborted at step 12) through `step`; each step's result."""
    prompts = random_prompts(17, [n for n, *_ in WORKLOAD])
    results, at = [], 0
    while at <= 12 or engine.has_unfinished_requests():
        for i, (_, _, priority, arrives) in enumerate(WORKLOAD):
            if arrives == at:
                engine.add_request(f"r{i}", prompts[i], params_of(i, stops[i]), priority=priority)
        if at == 12:
            assert engine.abort("r5")
        results.append(step())
        engine.check_invariants()
        at += 1
    return results


def small_engine(make_cpu_engine):
    return make_cpu_engine(
        block_size=2,
        num_device_blocks=40,
        max_num_batched_tokens=16,
        max_num_seqs=4,
        preemption_mode="recompute",
    )


def test_step_deltas_say_row_for_row_what_step_says(make_cpu_engine):
    prompts = random_prompts(17, [n for n, *_ in WORKLOAD])
    plain = make_cpu_engine().generate(
        prompts, [SamplingParams(max_tokens=mt, temperature=0, ignore_eos=True) for _, mt, *_ in WORKLOAD]
    )
    # stop strings cut from near the ends of a plain run's texts: requests 0, 2 and 4 stop on them late enough to be
    # preempted after their first rows (the news of a preemption since a first row is checked below)
    stops = [[out.text[-6:-4]] if i % 2 == 0 and len(out.text) > 10 else [] for i, out in enumerate(plain)]
    outputs_engine, deltas_engine = small_engine(make_cpu_engine), small_engine(make_cpu_engine)
    outputs = drive(outputs_engine, outputs_engine.step, stops)
    deltas = drive(deltas_engine, deltas_engine.step_deltas, stops)
    assert len(outputs) == len(deltas)
    assert outputs_engine.stats()["num_preemptions"] > 0  # the workload preempted some
    assert any(o.finish_reason == "stop" for step in outputs for o in step)  # a stop string cut some text
    assert any(o.finish_reason == "abort" for step in outputs for o in step)

    sent: dict[str, tuple[int, int]] = {}  # request -> (tokens, characters) reported so far
    facts: dict[str, tuple[int, bool]] = {}
    later_news = 0  # news of a request after its first row (a preemption since)
    for outs, step in zip(outputs, deltas, strict=True):
        assert step.request_ids == [o.request_id for o in outs]
        assert step.token_ids == [o.token_ids for o in outs]
        assert step.texts == [o.text for o in outs]
        assert step.finish_reasons == [o.finish_reason for o in outs]
        if any(o.logprobs is not None for o in outs):
            assert step.logprobs == [o.logprobs for o in outs]
        else:
            assert step.logprobs is None
        news = {n.request_id: n for n in step.news}
        for i, o in enumerate(outs):
            tokens, chars = sent.get(o.request_id, (0, 0))
            assert (step.token_starts[i], step.text_starts[i]) == (tokens, chars)
            sent[o.request_id] = (tokens + len(o.token_ids), chars + len(o.text))
            # (the two engines' clocks differ: a first token's time is compared by its presence)
            now = (o.num_preemptions, o.first_token_time is not None)
            if facts.get(o.request_id) != now:  # news exactly when a fact changed, and in the first row
                n = news.pop(o.request_id)
                assert (n.num_preemptions, n.first_token_time is not None) == now
                first = o.request_id not in facts
                later_news += not first
                assert n.prompt_token_ids == (o.prompt_token_ids if first else None)
                assert n.prompt_logprobs == (o.prompt_logprobs if first else None)
                facts[o.request_id] = now
        assert news == {}
    assert any(n for n, _ in facts.values())  # some request's news told of its preemption
    assert later_news  # ... and some after the request's first row


def test_an_aborted_request_is_reported_once_by_the_next_step(make_cpu_engine):
    engine = make_cpu_engine()
    [prompt] = random_prompts(3, [8])
    engine.add_request("a", prompt, SamplingParams(max_tokens=50, temperature=0, ignore_eos=True))
    first = engine.step_deltas()
    assert first.request_ids == ["a"] and first.finish_reasons == [None] and first.token_starts == [0]
    assert first.news[0].prompt_token_ids == prompt
    engine.abort("a")
    step = engine.step_deltas()
    assert step.request_ids == ["a"] and step.finish_reasons == ["abort"] and step.token_ids == [[]]
    assert (step.token_starts, step.text_starts) == ([1], [len(first.texts[0])])
    assert not engine.has_unfinished_requests() and len(engine.step_deltas()) == 0


def test_with_async_scheduling_no_placeholder_is_reported(make_cpu_engine):
    """A step left in flight puts placeholders in its sequences' tokens: the step's columns are made before,
    so they carry each token once, its value, as the same requests run without async scheduling."""
    prompts = random_prompts(23, [6, 13, 9])
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, output_kind="delta")
    engine = make_cpu_engine(async_scheduling=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        step = engine.step_deltas()
        for request_id, start, new in zip(step.request_ids, step.token_starts, step.token_ids, strict=True):
            assert start == len(tokens.setdefault(request_id, []))
            tokens[request_id] += new
    assert engine.stats()["num_overlapped_steps"] > 0
    wants = make_cpu_engine().generate(prompts, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    assert [tokens[f"r{i}"] for i in range(len(prompts))] == [w.token_ids for w in wants]
