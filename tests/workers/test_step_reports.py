"""workers/engine_process.py's Reporter: a step's outputs as one StepReport, by columns; each request's deltas at
absolute offsets across steps, its news (prompt, first token, preemptions) only when they change."""

from __future__ import annotations

import pickle
from types import SimpleNamespace

from contract.deltas import Delta, Position, Transcript
from workers.engine_process import Reporter
from workers.engine_protocol import RequestNews, StepReport


class Pipe:
    """The events connection: what the reporter sent, through pickle as a real pipe does."""

    def __init__(self):
        self.sent: list[StepReport] = []

    def send(self, message) -> None:
        self.sent.append(pickle.loads(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)))


def output(request_id, token_ids, text, *, finish=None, preemptions=0, first=None, logprobs=None):
    return SimpleNamespace(
        request_id=request_id,
        token_ids=token_ids,
        text=text,
        finish_reason=finish,
        finished=finish is not None,
        num_preemptions=preemptions,
        first_token_time=first,
        prompt_token_ids=[1, 2, 3],
        prompt_logprobs=None,
        logprobs=logprobs,
    )


def lp(token, value):
    return SimpleNamespace(as_list=lambda: [token, value, []])


STATS = {"last_step_time_s": 0.01}


def test_steps_rebuild_each_output_and_news_come_when_they_change():
    pipe = Pipe()
    reporter = Reporter(pipe)
    reporter.send([output("a", [], ""), output("b", [7], "x", first=5.0)], STATS)  # a: a prompt's chunk
    reporter.send([output("a", [4], "he", first=6.0), output("b", [8], "y", first=5.0)], STATS)
    reporter.send(
        [output("a", [5], "llo", first=6.0, preemptions=1), output("b", [9], "", finish="stop", first=5.0)],
        STATS,
    )
    reporter.send([output("a", [6], "!", finish="length", first=6.0, preemptions=1)], STATS)

    transcripts = {"a": Transcript(), "b": Transcript()}
    for report in pipe.sent:
        assert report.step_time == 0.01 and report.fields is None
        for request_id, delta in report.deltas():
            assert type(delta) is Delta
            assert transcripts[request_id].add(delta) is not None or not (delta.token_ids or delta.text)
    assert transcripts["a"].token_ids == [4, 5, 6] and transcripts["a"].text == "hello!"
    assert transcripts["a"].finish_reason == "length" and transcripts["a"].position == Position(3, 6)
    assert transcripts["b"].token_ids == [7, 8, 9] and transcripts["b"].text == "xy"

    news = [report.news for report in pipe.sent]
    assert news[0] == {
        "a": RequestNews(0, None, [1, 2, 3], None),
        "b": RequestNews(0, 5.0, [1, 2, 3], None),
    }
    assert news[1] == {"a": RequestNews(0, 6.0, None, None)}  # its first token; b: nothing new
    assert news[2] == {"a": RequestNews(1, 6.0, None, None)}  # preempted once
    assert news[3] == {}


def test_per_token_fields_ride_along_only_when_some_request_has_them():
    pipe = Pipe()
    reporter = Reporter(pipe)
    reporter.send([output("a", [4], "x", logprobs=[lp(4, -0.5)]), output("b", [9], "y")], STATS)
    [report] = pipe.sent
    deltas = dict(report.deltas())
    assert deltas["a"].fields == {"logprobs": [[4, -0.5, []]]} and deltas["b"].fields is None


def test_a_forgotten_request_starts_again_from_its_first_update():
    pipe = Pipe()
    reporter = Reporter(pipe)
    reporter.send([output("a", [4], "x", first=1.0)], STATS)
    reporter.forget(["a"])
    reporter.send([output("a", [5], "y", first=1.0)], STATS)
    [(_, delta)] = pipe.sent[1].deltas()
    assert delta.start == 0 and pipe.sent[1].news["a"].prompt_token_ids == [1, 2, 3]


def test_a_prompts_log_probabilities_name_each_prompt_token_the_first_without_one():
    pipe = Pipe()
    reporter = Reporter(pipe)
    first = output("a", [4], "x")
    first.prompt_logprobs = [lp(2, -1.5), lp(3, -0.25)]  # the engine's: every prompt token but the first
    reporter.send([first], STATS)
    assert pipe.sent[0].news["a"].prompt_logprobs == [[1, None, []], [2, -1.5, []], [3, -0.25, []]]
