"""EngineHost with the real tiny-llama engine: many task threads share one engine thread."""

from __future__ import annotations

import threading

import pytest

from batching import Engine, EngineConfig, SamplingParams
from workers.engine_host import EngineHost, HostStopped


@pytest.fixture()
def host(settings):
    host = EngineHost(lambda: Engine(EngineConfig(**settings.engine_options()))).start()
    yield host
    host.stop()


def test_concurrent_submissions_equal_generate(host, offline_engine):
    prompts = [f"thread {i} says" for i in range(6)]
    params = [SamplingParams(max_tokens=8 + i, temperature=0.0 if i % 2 else 0.9, seed=i) for i in range(6)]
    handles = [None] * 6

    def task(i):
        handles[i] = host.submit(f"r{i}", prompts[i], params[i], priority=i)
        assert handles[i].done.wait(60)

    threads = [threading.Thread(target=task, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    expected = offline_engine.generate(prompts, params)
    assert [h.output.token_ids for h in handles] == [e.token_ids for e in expected]
    assert all(h.error is None and h.first_token_at is not None for h in handles)


def test_abort_frees_the_request(host):
    handle = host.submit("long", "A long story", SamplingParams(max_tokens=1000, temperature=0.0), priority=5)
    while handle.output is None or not handle.output.token_ids:
        handle.done.wait(0.01)
    host.abort("long")
    assert handle.done.wait(10) and handle.output.finish_reason == "abort"
    stats = host.stats()
    assert stats["num_running"] == stats["num_waiting"] == 0 and stats["num_aborted"] == 1


def test_bad_request_fails_its_handle_only(host):
    bad = host.submit("bad", "x", SamplingParams(max_tokens=5000), priority=5)
    good = host.submit("good", "y", SamplingParams(max_tokens=2), priority=5)
    assert bad.done.wait(10) and isinstance(bad.error, ValueError) and "max_tokens" in str(bad.error)
    assert good.done.wait(10) and good.error is None and len(good.output.token_ids) == 2


def test_stop_fails_pending_requests_with_host_stopped(settings):
    host = EngineHost(lambda: Engine(EngineConfig(**settings.engine_options()))).start()
    handle = host.submit("pending", "A long story", SamplingParams(max_tokens=1000, temperature=0.0), priority=5)
    host.stop()
    assert handle.done.is_set() and isinstance(handle.error, HostStopped)


def test_a_build_failure_is_raised_by_start():
    with pytest.raises(RuntimeError, match="could not be built"):
        EngineHost(lambda: Engine(EngineConfig(model="/no/such/model"))).start()
