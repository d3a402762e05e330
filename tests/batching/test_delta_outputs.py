"""SamplingParams(output_kind="delta"): each output holds only what changed since the request's previous
one. Concatenated, the deltas are the cumulative output, token for token and character for character; a
running request's text never reaches into what a stop string may still cut, so no delta is ever taken back."""

from __future__ import annotations

from batching import SamplingParams
from tests.batching.conftest import random_prompts


def run(engine, prompts, params_of, resume=None):
    """Step the prompts to the end; per request, the list of its outputs in order."""
    outs: dict[str, list] = {}
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params_of(i), resume_token_ids=(resume or {}).get(i))
    while engine.has_unfinished_requests():
        for out in engine.step():
            outs.setdefault(out.request_id, []).append(out)
    return [outs[f"r{i}"] for i in range(len(prompts))]


def test_deltas_add_up_to_the_cumulative_output_and_are_never_taken_back(tiny_engine):
    prompts = random_prompts(3, [5, 40, 17, 90])
    plain = run(tiny_engine, prompts, lambda i: SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
    # stop strings taken from each plain text, so that some requests stop on them mid-way
    stops = [[out[-1].text[12:15]] if len(out[-1].text) > 20 else [] for out in plain]
    cumulative = run(
        tiny_engine,
        prompts,
        lambda i: SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, stop=stops[i]),
    )
    deltas = run(
        tiny_engine,
        prompts,
        lambda i: SamplingParams(
            max_tokens=40, temperature=0, ignore_eos=True, stop=stops[i], output_kind="delta"
        ),
    )
    assert any(c[-1].finish_reason == "stop" for c in cumulative)  # a stop string cut some text
    for prompt, whole, parts, stop in zip(prompts, cumulative, deltas, stops):
        final = whole[-1]
        assert [t for d in parts for t in d.token_ids] == final.token_ids
        assert "".join(d.text for d in parts) == final.text
        assert parts[0].prompt_token_ids == prompt and all(d.prompt_token_ids == [] for d in parts[1:])
        assert [d.finished for d in parts] == [False] * (len(parts) - 1) + [True]
        assert parts[-1].finish_reason == final.finish_reason
        held = max(map(len, stop), default=1) - 1
        for d, w in zip(parts, whole):  # while running, the text sent so far stops `held` short of the text
            sent = "".join(p.text for p in parts[: parts.index(d) + 1])
            assert w.text.startswith(sent) and (w.finished or len(sent) == max(0, len(w.text) - held))


def test_a_resumed_request_reports_its_resumed_tokens_in_its_first_delta(tiny_engine):
    [prompt] = random_prompts(5, [12])
    params = dict(max_tokens=24, temperature=0, ignore_eos=True)
    [whole] = run(tiny_engine, [prompt], lambda i: SamplingParams(**params))
    final = whole[-1]
    [parts] = run(
        tiny_engine,
        [prompt],
        lambda i: SamplingParams(**params, output_kind="delta"),
        resume={0: final.token_ids[:10]},
    )
    assert parts[0].token_ids == final.token_ids[:11]  # the 10 resumed and the first new one
    assert [t for d in parts for t in d.token_ids] == final.token_ids
    assert "".join(d.text for d in parts) == final.text
