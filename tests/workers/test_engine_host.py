"""EngineHost with the real tiny-llama engine in its own process: many task threads share it; it survives
its engine process dying, and does not outlive its worker."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from batching import EngineConfig, SamplingParams
from tests.conftest import ROOT
from workers.engine_host import EngineHost, EngineLost, HostStopped


@pytest.fixture(params=[None, True], ids=["default", "async"])
def host(settings, request):
    """The host on its engine's defaults (on the CPU: one step at a time), and with async scheduling (the
    CUDA default: outputs a step later, tokens in flight dropped on a cancel) run on the CPU."""
    settings = settings.replace(async_scheduling=request.param)
    host = EngineHost(EngineConfig(**settings.engine_options())).start()
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
    host = EngineHost(EngineConfig(**settings.engine_options())).start()
    handle = host.submit(
        "pending", "A long story", SamplingParams(max_tokens=1000, temperature=0.0), priority=5
    )
    host.stop()
    assert handle.done.is_set() and isinstance(handle.error, HostStopped)


def test_a_build_failure_is_raised_by_start():
    with pytest.raises(RuntimeError, match="could not be built"):
        EngineHost(EngineConfig(model="/no/such/model")).start()


def test_outputs_cross_the_process_boundary_whole(host, offline_engine):
    """Tokens, text (stop strings included), finish reasons and prompt ids arrive as the engine made them."""
    prompts = ["The river", "A stone", "Light song"]
    expected = offline_engine.generate(prompts, SamplingParams(max_tokens=40, temperature=0.0))
    stop = expected[1].text[5:9]  # a stop string the second request meets: its text's tail is cut
    params = [
        SamplingParams(max_tokens=40, temperature=0.0),
        SamplingParams(max_tokens=40, temperature=0.0, stop=[stop]),
        SamplingParams(max_tokens=40, temperature=0.8, seed=3),
    ]
    expected = offline_engine.generate(prompts, params)
    handles = [host.submit(f"x{i}", p, params[i], priority=5) for i, p in enumerate(prompts)]
    for handle, want in zip(handles, expected):
        assert handle.done.wait(60) and handle.error is None
        got = handle.output
        assert (got.token_ids, got.text, got.finish_reason, got.prompt_token_ids) == (
            want.token_ids,
            want.text,
            want.finish_reason,
            want.prompt_token_ids,
        )
    assert handles[1].output.finish_reason == "stop"


def test_a_dead_engine_process_loses_its_requests_and_a_new_one_starts(settings):
    host = EngineHost(EngineConfig(**settings.engine_options())).start()
    try:
        first_pid = host.pid
        with open(f"/proc/{first_pid}/comm") as comm:  # what top and ps show
            assert comm.read().strip() == "genq-engine"
        handle = host.submit(
            "long", "A long story", SamplingParams(max_tokens=1000, temperature=0.0), priority=5
        )
        while handle.output is None or len(handle.output.token_ids) < 3:
            assert not handle.done.is_set()
            time.sleep(0.01)
        os.kill(first_pid, signal.SIGKILL)
        assert handle.done.wait(30) and isinstance(handle.error, EngineLost)
        assert len(handle.output.token_ids) >= 3  # what it made is kept for the hand-back
        after = host.submit(
            "after", "y", SamplingParams(max_tokens=2), priority=5
        )  # waits for the new engine
        assert after.done.wait(120) and after.error is None and len(after.output.token_ids) == 2
        assert host.pid != first_pid and len(host.losses) == 1
    finally:
        host.stop()


def test_an_engine_process_that_keeps_dying_gives_up(settings):
    gave_up = threading.Event()
    host = EngineHost(EngineConfig(**settings.engine_options()), on_give_up=gave_up.set, max_losses=1).start()
    handle = host.submit("long", "A long story", SamplingParams(max_tokens=1000, temperature=0.0), priority=5)
    os.kill(host.pid, signal.SIGKILL)
    assert gave_up.wait(30) and handle.done.wait(5) and isinstance(handle.error, EngineLost)
    late = host.submit("late", "y", SamplingParams(max_tokens=2), priority=5)
    assert late.done.is_set() and isinstance(late.error, HostStopped)
    host.stop()


def test_a_killed_worker_takes_its_engine_process_with_it(tmp_path, settings):
    """A worker killed with SIGKILL leaves no engine process behind (it would hold memory or a GPU)."""
    script = tmp_path / "worker.py"
    script.write_text(
        "import time\n"
        "from batching import EngineConfig\n"
        "from workers.engine_host import EngineHost\n"
        "if __name__ == '__main__':  # the engine process is spawned: it imports this file too\n"
        f"    host = EngineHost(EngineConfig(**{settings.engine_options()!r})).start()\n"
        "    print(host.pid, flush=True)\n"
        "    time.sleep(600)\n"
    )
    worker = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    with worker.stdout:
        engine_pid = int(worker.stdout.readline())
    worker.kill()
    worker.wait()
    deadline = time.monotonic() + 10
    while _alive(engine_pid):
        assert time.monotonic() < deadline, "the engine process outlived its worker"
        time.sleep(0.05)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False
