"""bench/worker_text.py times what the worker does with a step: the text made in the worker is the text the
engine would have sent (so the two timings compare the same outcome)."""

from __future__ import annotations

from batching import EngineConfig
from bench import worker_text
from workers import engine_host
from workers.engine_host import EngineHost


def test_both_ways_give_each_request_the_same_text(monkeypatch):
    monkeypatch.setattr(engine_host.metrics, "observe_steps", lambda *a: None)
    host = EngineHost(EngineConfig(model="tiny-llama"))
    texts = []
    for in_worker in (False, True):
        assert worker_text.publish_us(host, 4, 30, in_worker) > 0
        texts.append({i: r.transcript.text for i, r in host._requests.items()})
        assert all(r.made_text is not None for r in host._requests.values()) == in_worker
    assert texts[0] == texts[1] and len(texts[0]["r1"]) == 30


def test_it_prints_the_cost_a_token(capsys, monkeypatch):
    monkeypatch.setattr(
        engine_host.metrics, "observe_steps", engine_host.metrics.observe_steps
    )  # restored after
    assert worker_text.main(["--width", "2", "--steps", "5"]) == 0
    assert capsys.readouterr().out.count("us a token") == 3
