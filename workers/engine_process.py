"""The engine process: a worker's batching.Engine in a process of its own, driven over two pipes.

The worker process (workers/engine_host.py) spawns it. It builds the engine, then loops: apply the
commands that came in (add, abort, stats, stop), run one step, send what changed. Nothing else runs
Python here, so no thread of the worker (Celery's delivery, claims, batched database writes, metrics)
takes the GIL from the step loop; the worker process imports no torch at all.

What goes back is one message per step or per report interval (workers/engine_process.Reporter): a
`Delta` per request that changed (new tokens only, the text's new tail), the engine's stats and the
steps' times. So the bytes sent grow with the tokens made, not with the square of the output length,
and a wide batch costs the worker one update per request per interval.

    worker ──("add" | "abort" | "stats" | "stop", ...)──▶ commands ──▶ apply; engine.step()
    worker ◀──("ready" | "step" | "refused" | "step_failed" | "stats" | "start_failed", ...)── events

This module imports neither torch nor batching's engine at import time: the worker imports it for
`Delta` and for the spawn target.
"""

from __future__ import annotations

import ctypes
import logging
import signal
import sys
import time
import traceback
from multiprocessing.connection import Connection
from typing import NamedTuple

log = logging.getLogger(__name__)
PR_SET_PDEATHSIG = 1  # prctl(2): the signal this process gets when the thread that started it ends
PR_SET_NAME = 15  # prctl(2): the name `ps -o comm` and `top` show


class Delta(NamedTuple):
    """What changed for one request in one step."""

    request_id: str
    new_token_ids: list[int]  # generated since the request's last Delta
    text_tail: str  # appended to the text sent so far, or the whole text when `text_reset`
    text_reset: bool  # the text's tail changed (a stop string cut it, a character completed)
    finished: bool
    finish_reason: str | None
    num_preemptions: int
    first_token_time: float | None  # time.time() of the request's first token in this engine
    finish_time: float | None
    prompt_token_ids: list[int] | None  # in the request's first delta only


class Reporter:
    """Collects the steps' outputs and sends them as Deltas, coalesced.

    A request's first token and its end go out at once (they decide TTFT, results and free slots; a
    refusal is its own message); plain progress waits up to `interval`, so a wide batch of short steps costs the worker one
    message and one update per request per interval, not per step. Only the latest output of a request
    matters: a Delta is what changed since the last one sent.
    """

    def __init__(self, events: Connection, interval: float):
        self._events, self._interval = events, interval
        self._sent: dict[str, tuple[int, str]] = {}  # request id -> (tokens sent, text sent)
        self._latest: dict[str, object] = {}  # request id -> its latest RequestOutput not sent yet
        self._step_times: list[float] = []
        self._stats: dict = {}
        self._urgent = False
        self._last_flush = time.monotonic()

    def add(self, outputs, stats: dict) -> None:
        for out in outputs:
            self._latest[out.request_id] = out
            self._urgent = self._urgent or out.finished or out.request_id not in self._sent
        self._step_times.append(stats["last_step_time_s"])
        self._stats = stats
        if self._urgent or time.monotonic() - self._last_flush >= self._interval:
            self.flush()

    def flush(self) -> None:
        if self._step_times:
            self._events.send(
                ("step", [self._encode(out) for out in self._latest.values()], self._stats, self._step_times)
            )
        self._latest, self._step_times, self._urgent = {}, [], False
        self._last_flush = time.monotonic()

    def forget(self, request_ids) -> None:
        for request_id in request_ids:
            self._sent.pop(request_id, None)

    def _encode(self, out) -> Delta:
        first = out.request_id not in self._sent
        n, text = self._sent.pop(out.request_id, (0, ""))
        reset = not out.text.startswith(text)
        tail = out.text if reset else out.text[len(text) :]
        if not out.finished:
            self._sent[out.request_id] = (len(out.token_ids), out.text)
        return Delta(
            out.request_id,
            out.token_ids[n:],
            tail,
            reset,
            out.finished,
            out.finish_reason,
            out.num_preemptions,
            out.first_token_time,
            out.finish_time,
            out.prompt_token_ids if first else None,
        )


def serve(
    config,
    commands: Connection,
    events: Connection,
    log_level: int,
    report_interval: float,
    threads: int | None,
) -> None:
    """The engine process's main: build the engine from `config` (an EngineConfig) with `threads` torch
    threads (None: torch's default), then serve commands."""
    _detach_from_terminal_signals()
    _die_with_parent()
    logging.basicConfig(
        level=log_level, stream=sys.stderr, format="[%(asctime)s: %(levelname)s/engine] %(name)s: %(message)s"
    )
    try:
        import torch

        from batching import Engine
        from workers import process_tuning

        if threads is not None:
            torch.set_num_threads(threads)
        engine = Engine(config)
    except BaseException as exc:  # any build failure goes to the worker, which reports it
        events.send(("start_failed", f"{exc.__class__.__name__}: {exc}\n{traceback.format_exc()}"))
        return
    process_tuning.settle_for_serving()  # even steps: no GC walks of this heap, no mmap churn
    events.send(("ready", engine.config, _describe(engine)))
    _loop(engine, commands, events, Reporter(events, report_interval))


def _loop(engine, commands: Connection, events: Connection, reporter: Reporter) -> None:
    while True:
        idle = not engine.has_unfinished_requests()
        if idle:
            reporter.flush()
        try:
            if not _apply_commands(engine, commands, events, block=idle):
                return
        except (EOFError, OSError):  # the worker is gone
            return
        if engine.has_unfinished_requests():
            _step(engine, reporter, events)


def _apply_commands(engine, commands: Connection, events: Connection, block: bool) -> bool:
    """Apply every command that came in (waiting for one if `block`); False once asked to stop."""
    while block or commands.poll():
        block = False
        command = commands.recv()
        kind = command[0]
        if kind == "add":
            _, request_id, prompt, params, priority, resume_token_ids = command
            try:
                engine.add_request(request_id, prompt, params, priority, resume_token_ids)
            except ValueError as exc:
                events.send(("refused", request_id, str(exc)))
        elif kind == "abort":
            engine.abort(command[1])
        elif kind == "stats":
            events.send(("stats", command[1], engine.stats()))
        elif kind == "stop":
            return False
    return True


def _step(engine, reporter: Reporter, events: Connection) -> None:
    """One step; what changed goes to the worker. A failing step fails every request in the engine."""
    try:
        outputs = engine.step()
    except Exception as exc:
        log.exception("engine step failed; failing its %d requests", len(engine.requests))
        failed = list(engine.requests)
        for request_id in failed:
            engine.abort(request_id)
        engine.step()  # reports the aborts, runs nothing: every request is gone
        reporter.flush()
        reporter.forget(failed)
        events.send(("step_failed", failed, isinstance(exc, ValueError), f"{exc.__class__.__name__}: {exc}"))
        return
    reporter.add(outputs, engine.stats())


def _describe(engine) -> dict:
    stats = engine.stats()
    import torch

    return {
        "device": str(engine.device),
        "dtype": str(engine.dtype).removeprefix("torch."),
        "torch_threads": torch.get_num_threads(),
        "device_blocks": stats["num_device_blocks"],
        "host_blocks": stats["num_host_blocks"],
        "max_model_len": engine.max_model_len,
        "decode_attention": "cpu kernel" if engine.runner.attention_kernel is not None else "torch",
    }


def _detach_from_terminal_signals() -> None:
    """Ctrl-C in a terminal signals the whole process group: the worker decides when its engine stops
    (it hands its jobs back first), so this process ignores SIGINT and SIGTERM and ends on "stop" or when
    the worker's end of the pipe closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def _die_with_parent() -> None:
    """On Linux, a worker killed with SIGKILL takes its engine process with it at once (the closed pipe
    would end it too, but only between two steps); `ps` and `top` name it genq-engine."""
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        prctl(PR_SET_NAME, b"genq-engine")
    except (OSError, AttributeError):  # not Linux: the pipe's EOF ends it
        pass
