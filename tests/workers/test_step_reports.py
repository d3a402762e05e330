"""workers/engine_process.py's Reporter: a step's deltas (batching's StepDeltas, by columns, at the absolute
offsets the engine keeps) sent as one StepReport; news only for the requests the engine says have some, and
per-token fields only when some row has them. That the engine's columns say what its delta outputs say:
tests/batching/test_step_deltas.py."""

from __future__ import annotations

import pickle
from types import SimpleNamespace

import pytest

from batching import Engine, EngineConfig, SamplingParams
from batching.step_deltas import StepDeltas, StepNews
from contract.deltas import Delta, Position, Transcript
from workers.engine_process import Reporter
from workers.engine_protocol import RequestNews, StepReport


class Pipe:
    """The events connection: what the reporter sent, through pickle as a real pipe does."""

    def __init__(self):
        self.sent: list[StepReport] = []

    def send(self, message) -> None:
        self.sent.append(pickle.loads(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)))


def lp(token, value):
    return SimpleNamespace(as_list=lambda: [token, value, []])


STATS = {"last_step_time_s": 0.01}


@pytest.fixture(scope="module")
def tiny_engine():
    """The built-in tiny-llama engine in float32 on the CPU."""
    return Engine(EngineConfig(model="tiny-llama", dtype="float32", device="cpu"))


def deltas(*rows, news=(), logprobs=None) -> StepDeltas:
    """rows: (request id, token start, token ids, text start, text, finish reason)."""
    step = StepDeltas(news=list(news), logprobs=logprobs)
    for request_id, start, token_ids, text_start, text, reason in rows:
        step.request_ids.append(request_id)
        step.token_starts.append(start)
        step.token_ids.append(token_ids)
        step.text_starts.append(text_start)
        step.texts.append(text)
        step.finish_reasons.append(reason)
    return step


def test_the_columns_pass_through_and_news_come_as_the_engine_gives_them():
    pipe = Pipe()
    reporter = Reporter(pipe)
    reporter.send(
        deltas(
            ("a", 0, [], 0, "", None),  # a prompt's chunk
            ("b", 0, [7], 0, "x", None),
            news=[StepNews("a", 0, None, [1, 2, 3], None), StepNews("b", 0, 5.0, [1, 2, 3], None)],
        ),
        STATS,
    )
    reporter.send(
        deltas(
            ("a", 0, [4, 5], 0, "hel", None),
            ("b", 1, [8], 1, "y", "stop"),
            news=[StepNews("a", 1, 6.0, None, None)],
        ),
        STATS,
    )
    reporter.send(deltas(("a", 2, [6], 3, "lo!", "length")), STATS)

    transcripts = {"a": Transcript(), "b": Transcript()}
    for report in pipe.sent:
        assert report.step_time == 0.01 and report.fields is None
        for request_id, delta in report.deltas():
            assert type(delta) is Delta
            assert transcripts[request_id].add(delta) is not None or not (delta.token_ids or delta.text)
    assert transcripts["a"].token_ids == [4, 5, 6] and transcripts["a"].text == "hello!"
    assert transcripts["a"].finish_reason == "length" and transcripts["a"].position == Position(3, 6)
    assert transcripts["b"].token_ids == [7, 8] and transcripts["b"].text == "xy"
    assert [report.news for report in pipe.sent] == [
        {"a": RequestNews(0, None, [1, 2, 3], None), "b": RequestNews(0, 5.0, [1, 2, 3], None)},
        {"a": RequestNews(1, 6.0, None, None)},
        {},
    ]


def test_per_token_fields_ride_along_only_when_some_request_has_them():
    pipe = Pipe()
    reporter = Reporter(pipe)
    reporter.send(
        deltas(("a", 0, [4], 0, "x", None), ("b", 0, [9], 0, "y", None), logprobs=[[lp(4, -0.5)], None]),
        STATS,
    )
    [report] = pipe.sent
    found = dict(report.deltas())
    assert found["a"].fields == {"logprobs": [[4, -0.5, []]]} and found["b"].fields is None


def test_a_prompts_log_probabilities_name_each_prompt_token_the_first_without_one():
    pipe = Pipe()
    reporter = Reporter(pipe)
    news = StepNews("a", 0, 1.0, [1, 2, 3], [lp(2, -1.5), lp(3, -0.25)])  # the engine's: all but the first
    reporter.send(deltas(("a", 0, [4], 0, "x", None), news=[news]), STATS)
    assert pipe.sent[0].news["a"].prompt_logprobs == [[1, None, []], [2, -1.5, []], [3, -0.25, []]]


def test_an_engines_steps_rebuild_each_requests_output(tiny_engine):
    """A real engine's step_deltas through the Reporter and the worker's Transcripts: each request's tokens
    and text are what its cumulative output says, its prompt in its first news."""
    pipe = Pipe()
    reporter = Reporter(pipe)
    prompts = {"s": "Hello there", "t": "The quick brown fox"}
    for request_id, prompt in prompts.items():
        tiny_engine.add_request(
            request_id, prompt, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, stop=["e t"])
        )
    while tiny_engine.has_unfinished_requests():
        reporter.send(tiny_engine.step_deltas(), tiny_engine.stats())
    transcripts = {request_id: Transcript() for request_id in prompts}
    prompt_ids = {}
    for report in pipe.sent:
        for request_id, delta in report.deltas():
            transcripts[request_id].add(delta)
        for request_id, news in report.news.items():
            if news.prompt_token_ids is not None:
                prompt_ids[request_id] = news.prompt_token_ids
    wants = tiny_engine.generate(
        list(prompts.values()), SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, stop=["e t"])
    )
    for request_id, want in zip(prompts, wants, strict=True):
        got = transcripts[request_id]
        assert (got.token_ids, got.text, got.finish_reason) == (want.token_ids, want.text, want.finish_reason)
        assert prompt_ids[request_id] == want.prompt_token_ids
