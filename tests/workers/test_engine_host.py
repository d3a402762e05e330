"""EngineHost with the real tiny-llama engine in its own process: many threads share it; it survives
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
from workers import engine_host
from workers.engine_host import EngineHost, EngineLost, EngineRequest, HostStopped


class Submitter:
    """Submits requests to a host and sees them end (its on_end)."""

    def __init__(self, host: EngineHost):
        self.host = host
        self._ended: dict[str, threading.Event] = {}
        host.on_end = lambda request: self._ended[request.request_id].set()

    def submit(self, request_id: str, prompt, params: SamplingParams, priority: int = 5) -> EngineRequest:
        request = EngineRequest(request_id, priority)
        self._ended[request_id] = threading.Event()
        self.host.submit(request, prompt, params)
        return request

    def wait(self, request: EngineRequest, timeout: float) -> bool:
        """Whether the request ended within `timeout` seconds."""
        return self._ended[request.request_id].wait(timeout)


def start(settings, **options) -> Submitter:
    return Submitter(EngineHost(EngineConfig(**settings.engine_options()), **options).start())


@pytest.fixture(scope="module", params=[None, True], ids=["default", "async"])
def host(settings, request):
    """The host on its engine's defaults (on the CPU: one step at a time), and with async scheduling (the
    CUDA default: outputs a step later, tokens in flight dropped on a cancel) run on the CPU. One of each for
    the module's tests that leave it as they found it (their request ids are their own): an engine process
    takes seconds to start, most of these tests' time when each had its own."""
    submitter = start(settings.replace(async_scheduling=request.param))
    yield submitter
    submitter.host.stop()


def test_concurrent_submissions_equal_generate(host, offline_engine):
    prompts = [f"thread {i} says" for i in range(6)]
    params = [SamplingParams(max_tokens=8 + i, temperature=0.0 if i % 2 else 0.9, seed=i) for i in range(6)]
    requests = [None] * 6

    def task(i):
        requests[i] = host.submit(f"r{i}", prompts[i], params[i], priority=i)
        assert host.wait(requests[i], 60)

    threads = [threading.Thread(target=task, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    expected = offline_engine.generate(prompts, params)
    assert [r.transcript.token_ids for r in requests] == [e.token_ids for e in expected]
    assert all(r.error is None and r.first_token_at is not None for r in requests)


def test_abort_frees_the_request(host):
    request = host.submit("long", "A long story", SamplingParams(max_tokens=1000, temperature=0.0))
    while not request.transcript.token_ids:
        host.wait(request, 0.01)
    host.host.abort("long")
    assert host.wait(request, 10) and request.transcript.finish_reason == "abort"
    stats = host.host.stats()
    assert stats["num_running"] == stats["num_waiting"] == 0 and stats["num_aborted"] == 1


def test_bad_request_fails_that_request_only(host):
    bad = host.submit("bad", "x", SamplingParams(max_tokens=5000))
    good = host.submit("good", "y", SamplingParams(max_tokens=2))
    assert host.wait(bad, 10) and isinstance(bad.error, ValueError) and "max_tokens" in str(bad.error)
    assert host.wait(good, 10) and good.error is None and len(good.transcript.token_ids) == 2


def test_stop_fails_pending_requests_with_host_stopped(settings):
    host = start(settings)
    request = host.submit("pending", "A long story", SamplingParams(max_tokens=1000, temperature=0.0))
    host.host.stop()
    assert host.wait(request, 0) and isinstance(request.error, HostStopped)


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
    requests = [host.submit(f"x{i}", p, params[i]) for i, p in enumerate(prompts)]
    for request, want in zip(requests, expected):
        assert host.wait(request, 60) and request.error is None
        got = request.transcript
        assert (got.token_ids, got.text, got.finish_reason, request.prompt_token_ids) == (
            want.token_ids,
            want.text,
            want.finish_reason,
            want.prompt_token_ids,
        )
    assert requests[1].transcript.finish_reason == "stop"


def test_text_made_in_the_worker_is_the_engines(host, offline_engine, monkeypatch):
    """A request without stop strings or a grammar gets its text from the worker, made from the token ids the
    engine reports (which sends no text for it): the text the engine makes, through broken UTF-8 (sampled
    bytes), special tokens kept, and stop tokens with and without their text; one with stop strings keeps
    its text in the engine."""
    prompts = [f"worker text {i}" for i in range(7)]
    params = [
        SamplingParams(
            max_tokens=48,
            temperature=1.0,
            seed=i,
            skip_special_tokens=i % 2 == 1,
            stop_token_ids=list(range(100, 150)) if i % 3 == 0 else [],
            include_stop_str_in_output=i == 3,
        )
        for i in range(6)
    ] + [SamplingParams(max_tokens=20, temperature=0.0, stop=["zz"])]
    expected = offline_engine.generate(prompts, params)
    sent: list[str] = []  # the text the engine sent for requests whose text the worker makes
    make_text = engine_host._make_text

    def seen(rows, detokenize):
        sent.extend(delta.text for request, delta in rows if request.made_text is not None)
        return make_text(rows, detokenize)

    monkeypatch.setattr(engine_host, "_make_text", seen)
    requests = [host.submit(f"t{i}", p, params[i]) for i, p in enumerate(prompts)]
    for request, want in zip(requests, expected):
        assert host.wait(request, 60) and request.error is None
        got = request.transcript
        assert (got.token_ids, got.text, got.finish_reason) == (want.token_ids, want.text, want.finish_reason)
    assert [r.made_text is not None for r in requests] == [True] * 6 + [False]
    assert sent and not any(sent)
    assert any("\ufffd" in r.transcript.text for r in requests)
    assert requests[0].transcript.finish_reason == requests[3].transcript.finish_reason == "stop"


def test_a_dead_engine_process_loses_its_requests_and_a_new_one_starts(settings):
    submitter = start(settings)
    host = submitter.host
    try:
        first_pid = host.pid
        with open(f"/proc/{first_pid}/comm") as comm:  # what top and ps show
            assert comm.read().strip() == "genq-engine"
        request = submitter.submit("long", "A long story", SamplingParams(max_tokens=1000, temperature=0.0))
        while len(request.transcript.token_ids) < 3:
            assert not submitter.wait(request, 0)
            time.sleep(0.01)
        os.kill(first_pid, signal.SIGKILL)
        assert submitter.wait(request, 30) and isinstance(request.error, EngineLost)
        assert len(request.transcript.token_ids) >= 3  # what it made is kept for the hand-back
        after = submitter.submit("after", "y", SamplingParams(max_tokens=2))  # waits for the new engine
        assert submitter.wait(after, 120) and after.error is None and len(after.transcript.token_ids) == 2
        assert host.pid != first_pid and len(host.losses) == 1
    finally:
        host.stop()


def test_an_engine_process_that_keeps_dying_gives_up(settings):
    gave_up = threading.Event()
    submitter = start(settings, on_give_up=gave_up.set, max_losses=1)
    request = submitter.submit("long", "A long story", SamplingParams(max_tokens=1000, temperature=0.0))
    os.kill(submitter.host.pid, signal.SIGKILL)
    assert gave_up.wait(30) and submitter.wait(request, 5) and isinstance(request.error, EngineLost)
    late = submitter.submit("late", "y", SamplingParams(max_tokens=2))
    assert submitter.wait(late, 0) and isinstance(late.error, HostStopped)
    submitter.host.stop()


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


def engine_environ(pid: int) -> dict[str, str]:
    """The environment a process started with, as Linux keeps it."""
    with open(f"/proc/{pid}/environ", "rb") as environ:
        pairs = [entry.split(b"=", 1) for entry in environ.read().split(b"\0") if b"=" in entry]
    return {name.decode(): value.decode() for name, value in pairs}


def test_the_engine_process_spins_briefly_for_openmp_work_unless_the_user_says_otherwise(
    settings, monkeypatch
):
    # GOMP_SPINCOUNT=10000: on a CPU that other processes share, long-spinning OpenMP threads stall every step
    # (workers/process_tuning.py); a wait policy the user set is theirs, and the worker's environment is unchanged
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    host = start(settings).host
    try:
        assert engine_environ(host.pid)["GOMP_SPINCOUNT"] == "10000"
        assert "GOMP_SPINCOUNT" not in os.environ
    finally:
        host.stop()
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    host = start(settings).host
    try:
        environ = engine_environ(host.pid)
        assert environ["OMP_WAIT_POLICY"] == "ACTIVE" and "GOMP_SPINCOUNT" not in environ
    finally:
        host.stop()
