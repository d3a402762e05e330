"""The engine process: a worker's batching.Engine in a process of its own, driven over two pipes.

The worker process (workers/engine_host.py) spawns it. It builds the engine, then loops: apply the
commands that came in (add, abort, stats, stop), run one step, send what changed. Nothing else runs
Python here, so no thread of the worker (Celery's delivery, claims, batched database writes, metrics)
takes the GIL from the step loop; the worker process imports no torch at all.

What goes back is one message per step (`StepReport`): for the requests that changed, the fields of a
contract.deltas.Delta each (the step's new token ids and new stable text, at absolute offsets: the engine's
`step_deltas()`, by columns, with no object per request), what else changed for some of them (`RequestNews`),
and the engine's stats and step time. So the bytes sent grow with the tokens made,
never with the output's length, and every step's tokens reach the worker as the step ends. The messages
both ways are workers/engine_protocol.py's.

    worker ──AddRequest | AbortRequest | StatsRequest | Stop──▶ commands ──▶ apply; engine.step()
    worker ◀──Ready | StartFailed | StepReport | Refused | StepFailed | StatsReply── events

This module imports neither torch nor batching's engine at import time: the worker imports it for the
spawn target.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import traceback
from multiprocessing.connection import Connection
from typing import NoReturn

from contract.log_setup import configure
from workers.engine_protocol import (
    AbortRequest,
    AddRequest,
    Ready,
    Refused,
    RequestNews,
    StartFailed,
    StatsReply,
    StatsRequest,
    StepFailed,
    StepReport,
    Stop,
)

log = logging.getLogger(__name__)
PR_SET_PDEATHSIG = 1  # prctl(2): the signal this process gets when the thread that started it ends
PR_SET_NAME = 15  # prctl(2): the name `ps -o comm` and `top` show


class Reporter:
    """Sends each step's deltas (batching's StepDeltas: by columns, with each request's absolute offsets, which
    the engine keeps) as one StepReport: the columns pass through as they are, and only the rows with news or
    log probabilities are looked at one by one."""

    def __init__(self, events: Connection):
        self._events = events

    def send(self, deltas, stats: dict) -> None:
        news = {n.request_id: RequestNews(*n[1:4], _prompt_logprobs(n)) for n in deltas.news}
        fields = None
        if deltas.logprobs is not None:
            fields = [
                None if row is None else {"logprobs": [lp.as_list() for lp in row]} for row in deltas.logprobs
            ]
        report = StepReport(
            deltas.request_ids,
            deltas.token_starts,
            deltas.token_ids,
            deltas.text_starts,
            deltas.texts,
            deltas.finish_reasons,
            fields,
            news,
            stats,
            stats["last_step_time_s"],
        )
        self._events.send(report)


def _prompt_logprobs(news) -> list | None:
    """A prompt's log probabilities as sent: one [token, logprob, top] per prompt token. The engine gives
    those of every token but the first, which has none (nothing comes before it): its logprob is None."""
    if news.prompt_logprobs is None or news.prompt_token_ids is None:
        return None
    return [[token, None, []] for token in news.prompt_token_ids[:1]] + [
        lp.as_list() for lp in news.prompt_logprobs
    ]


def serve(
    config,
    commands: Connection,
    events: Connection,
    log_level: int,
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

        configure("engine")  # LOG_FORMAT=json: JSON lines (contract/log_setup.py), torch's own handlers too
        from batching import Engine
        from workers import process_tuning

        if threads is not None:
            torch.set_num_threads(threads)
        engine = Engine(config)
    except BaseException as exc:  # any build failure goes to the worker, which reports it
        events.send(StartFailed(f"{exc.__class__.__name__}: {exc}\n{traceback.format_exc()}"))
        _exit_now()
    process_tuning.settle_for_serving()  # even steps: no GC walks of this heap, no mmap churn
    events.send(Ready(engine.config, _describe(engine)))
    _loop(engine, commands, events, Reporter(events))
    engine.close()  # its other ranks (tensor parallel)
    _exit_now()


def _exit_now() -> NoReturn:
    """End the process once its logs are out, without the interpreter's teardown: nothing here needs it (the pipe's
    ends and the memory go with the process), and C extensions report their leaks there on stderr (triton's
    nanobind: ~600 lines at every stop), which would break the worker's log lines (LOG_FORMAT=json)."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _loop(engine, commands: Connection, events: Connection, reporter: Reporter) -> None:
    while True:
        idle = not engine.has_unfinished_requests()
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
        match commands.recv():
            case AddRequest() as add:
                add.params.output_kind = "delta"  # (step_deltas reports every request as deltas anyway)
                if add.text_in_worker:  # (this process's copy of the params: the worker's keep their text)
                    add.params.detokenize = False
                try:
                    engine.add_request(
                        add.request_id,
                        add.prompt,
                        add.params,
                        add.priority,
                        add.resume_token_ids,
                        add.arrival_time,
                        predicted_output_tokens=add.predicted_output_tokens,
                        deadline=add.deadline,
                    )
                except ValueError as exc:
                    events.send(Refused(add.request_id, str(exc)))
            case AbortRequest(request_id):
                engine.abort(request_id)
            case StatsRequest(ticket):
                events.send(StatsReply(ticket, engine.stats()))
            case Stop():
                return False
    return True


def _step(engine, reporter: Reporter, events: Connection) -> None:
    """One step; what changed goes to the worker. A failing step fails every request in the engine."""
    try:
        deltas = engine.step_deltas()
    except Exception as exc:
        from batching.collectives import RankFailure  # the engine (and torch) is loaded by now

        if isinstance(
            exc, RankFailure
        ):  # a rank of a tensor-parallel engine is gone: it can never step again
            raise  # the process ends, and the engine host starts another (its jobs resume there)
        log.exception("engine step failed; failing its %d requests", len(engine.requests))
        failed = list(engine.requests)
        for request_id in failed:
            engine.abort(request_id)
        reporter.send(engine.step_deltas(), engine.stats())  # the aborts; runs nothing: every request is gone
        events.send(StepFailed(failed, isinstance(exc, ValueError), f"{exc.__class__.__name__}: {exc}"))
        return
    reporter.send(deltas, engine.stats())


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
        "attention": engine.attention_backend,  # triton, cpu_kernel or torch (the slower fallback)
        "cuda_graphs": engine.runner.graphs is not None,
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
