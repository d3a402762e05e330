"""EngineHost: one batching.Engine per worker process, stepped by its own thread.

The engine is not thread-safe, so only the engine thread touches it. Celery task threads call
`submit()` / `abort()`, which put commands on a queue; the engine thread applies them between steps
and publishes each step's outputs to the requests' handles, on which the task threads wait.

    JobBook ──submit/abort──▶ commands ──▶ engine thread: apply, step(), publish ──▶ RequestHandle ──on_done──▶

A handle holds the request's latest output; `on_done(handle)`, called on the engine thread when the
request finishes or fails, must be quick (the job book queues the handle for its writer thread).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from datetime import datetime, timezone

from batching import Engine, RequestOutput, SamplingParams
from workers import metrics, process_tuning

log = logging.getLogger(__name__)


class HostStopped(RuntimeError):
    """The host stopped (the worker is shutting down) before the request finished."""


class RequestHandle:
    """A request in the engine, as other threads see it: the latest output, and an event when done."""

    def __init__(self, request_id: str, on_done: Callable[[RequestHandle], None] | None = None):
        self.request_id = request_id
        self.output: RequestOutput | None = None
        self.first_token_at: datetime | None = None  # wall clock, when the first token was seen
        self.error: Exception | None = None
        self.done = threading.Event()
        self._on_done = on_done

    def _publish(self, output: RequestOutput) -> None:
        if self.first_token_at is None and output.token_ids:
            self.first_token_at = datetime.now(timezone.utc)
        self.output = output
        if output.finished:
            self._end()

    def _fail(self, error: Exception) -> None:
        self.error = error
        self._end()

    def _end(self) -> None:
        self.done.set()
        if self._on_done is not None:
            self._on_done(self)


class EngineHost:
    """Owns the engine and its thread. `start()` builds the engine (in the thread) and waits for it."""

    def __init__(self, make_engine: Callable[[], Engine]):
        self._make_engine = make_engine
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._handles: dict[str, RequestHandle] = {}
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._ready = threading.Event()
        self._startup_error: BaseException | None = None
        self.config = None  # the engine's EngineConfig, once built

    def start(self) -> EngineHost:
        self._thread.start()
        self._ready.wait()
        if self._startup_error is not None:
            raise RuntimeError("the engine could not be built") from self._startup_error
        return self

    def stop(self, timeout: float | None = 10.0) -> None:
        """Stop stepping; requests still in the engine fail with an error."""
        self._commands.put(("stop",))
        self._thread.join(timeout)

    def submit(self, request_id: str, prompt: str | list[int], params: SamplingParams, priority: int,
               resume_token_ids: list[int] | None = None,
               on_done: Callable[[RequestHandle], None] | None = None) -> RequestHandle:
        """Queue a request for the engine; the handle's `done` is set (and `on_done` called) when it ends."""
        handle = RequestHandle(request_id, on_done)
        self._commands.put(("add", handle, (request_id, prompt, params, priority, resume_token_ids)))
        return handle

    def abort(self, request_id: str) -> None:
        """Take the request out of the batch at the next step (its KV blocks are freed)."""
        self._commands.put(("abort", request_id))

    def stats(self, timeout: float = 5.0) -> dict:
        """The engine's counters and gauges, read between two steps."""
        reply: Future = Future()
        self._commands.put(("stats", reply))
        return reply.result(timeout)

    # --- the engine thread --------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            engine = self._make_engine()
        except BaseException as exc:  # report any build failure to start(), then end the thread
            self._startup_error = exc
            self._ready.set()
            return
        process_tuning.settle_for_serving()   # even steps: no GC walks of this heap, no mmap churn
        self.config = engine.config
        self._ready.set()
        log.info("engine ready: %s", engine.config)
        while self._apply_commands(engine, block=not engine.has_unfinished_requests()):
            if engine.has_unfinished_requests():
                self._step(engine)
        for handle in self._handles.values():
            handle._fail(HostStopped("the worker is shutting down"))

    def _apply_commands(self, engine: Engine, block: bool) -> bool:
        """Apply every waiting command (waiting for one if `block`); False once asked to stop."""
        while True:
            try:
                command = self._commands.get(block=block, timeout=1.0 if block else None)
            except queue.Empty:
                return True
            block = False
            if command[0] == "stop":
                return False
            if command[0] == "add":
                _, handle, args = command
                try:
                    engine.add_request(*args)
                except ValueError as exc:
                    handle._fail(exc)
                else:
                    self._handles[handle.request_id] = handle
            elif command[0] == "abort":
                engine.abort(command[1])
            elif command[0] == "stats":
                command[1].set_result(engine.stats())

    def _step(self, engine: Engine) -> None:
        """One engine step; its outputs go to their handles. A failing step fails every request in it."""
        try:
            outputs = engine.step()
        except Exception as exc:
            log.exception("engine step failed; failing its %d requests", len(self._handles))
            for request_id, handle in self._handles.items():
                engine.abort(request_id)
                handle._fail(exc)
            self._handles.clear()
            return
        for output in outputs:
            handle = self._handles.get(output.request_id)
            if handle is not None:
                handle._publish(output)
                if output.finished:
                    del self._handles[output.request_id]
        metrics.observe_step(engine.stats(), outputs)
