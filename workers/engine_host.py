"""EngineHost: a worker's one batching.Engine, run in a process of its own (workers/engine_process.py).

Why a process: a small model's step is mostly Python between kernels, and a worker holding hundreds of jobs
runs plenty of Python of its own (Celery's deliveries, claims, batched writes, metrics). In one process they
share one GIL, and the engine's steps ran 1.5-1.8x slower inside the worker than alone (bench/backlog.py at
code 84ff309; the run is in bench/RESULTS.md's git history). In its own process the engine steps at its own
pace; this process imports no torch.

Task threads call `submit()` / `abort()` / `stats()`; a sender thread writes those commands to the engine
process, and a reader thread applies what comes back (per step, each changed request's new tokens) to
the requests' handles as each step ends (and hands the step's new output to `on_step`: token events),
on which the job book waits:

    JobBook ─submit/abort─▶ outbox ─▶ sender ─pipe─▶ engine process: apply, step(), send deltas
    RequestHandle ◀─ reader ◀─pipe─────────────────┘                 ─on_done─▶ JobBook

If the engine process dies (killed for memory, a sticky device error), its requests fail with
`EngineLost` (the job book hands them back to the queue with the tokens they had) and a new engine
process starts; commands sent meanwhile wait for it. Should it die `max_losses` times within
`loss_window` seconds, the host gives up: `on_give_up` is called (the worker shuts down).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import multiprocessing
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from datetime import datetime, timezone

from batching import EngineConfig, RequestOutput, SamplingParams
from contract.deltas import Delta, Gap, Transcript
from workers import engine_process, metrics
from workers.engine_process import RequestNews, StepReport

log = logging.getLogger(__name__)


class HostStopped(RuntimeError):
    """The host stopped (the worker is shutting down) before the request finished."""


class EngineLost(HostStopped):
    """The engine process died while the request was in it; the handle holds the tokens made until then."""


class RequestHandle:
    """A request in the engine, as other threads see it: its transcript so far, and an event when done.

    Written by the reader thread only; the transcript (contract.deltas) lets other threads read a consistent
    prefix of it at any time. `tag` is the caller's name for the request (the job book's: the job id)."""

    def __init__(
        self,
        request_id: str,
        priority: int,
        on_done: Callable[[RequestHandle], None] | None = None,
        transcript: Transcript | None = None,
        tag: str | None = None,
    ):
        self.request_id = request_id
        self.priority = priority
        self.tag = tag
        self.transcript = transcript if transcript is not None else Transcript()
        self.first_token_at: datetime | None = None  # wall clock of the first token (the engine's clock)
        self.prompt_token_ids: list[int] = []  # known from the request's first update
        self.prompt_logprobs: list | None = None  # likewise, when the request asked for them
        self.num_preemptions = 0
        self.updated = False  # the engine reported on it at least once
        self.error: Exception | None = None
        self.done = threading.Event()
        self._on_done = on_done
        self._arrival_time = time.time()

    @property
    def output(self) -> RequestOutput | None:
        """The request's output as of the latest step that changed it (None before its first)."""
        if not self.updated:
            return None
        t = self.transcript
        at = t.position
        first = self.first_token_at.timestamp() if self.first_token_at is not None else None
        return RequestOutput(
            self.request_id,
            self.prompt_token_ids,
            t.token_ids[: at.tokens],
            t.text_since(0, at.chars),
            t.finished,
            t.finish_reason,
            self.num_preemptions,
            self._arrival_time,
            first,
            None,
            self.priority,
        )

    def _apply(self, delta: Delta, news: RequestNews | None) -> Delta | None:
        """A step's delta, trimmed to what this handle lacked (None: nothing new), and its news, if any."""
        if news is not None:
            if news.prompt_token_ids is not None:
                self.prompt_token_ids = news.prompt_token_ids
            if news.prompt_logprobs is not None:
                self.prompt_logprobs = news.prompt_logprobs
            if self.first_token_at is None and news.first_token_time is not None:
                self.first_token_at = datetime.fromtimestamp(news.first_token_time, timezone.utc)
            self.num_preemptions = news.num_preemptions
        self.updated = True
        try:
            return self.transcript.add(delta)
        except Gap:  # cannot happen: the engine reports every step of every request, in order
            log.error("request %s: %s", self.request_id, delta)
            return None

    def _fail(self, error: Exception) -> None:
        self.error = error
        self._end()

    def _end(self) -> None:
        self.done.set()
        if self._on_done is not None:
            self._on_done(self)


class EngineHost:
    """Owns the engine process and the two threads that talk to it. `start()` waits until it is built."""

    def __init__(
        self,
        config: EngineConfig,
        *,
        threads: int | None = None,
        on_step: Callable[[list[tuple[RequestHandle, Delta]]], None] | None = None,
        on_give_up: Callable[[], None] | None = None,
        max_losses: int = 3,
        loss_window: float = 300.0,
    ):
        self.config = config  # the engine's own (resolved) config once it is built
        self.info: dict = {}  # device, dtype, KV blocks, attention path, CUDA graphs (for logs and stats)
        self.pid: int | None = None  # the engine process's
        self.losses: list[float] = []  # monotonic times the engine process died
        self._requested, self._threads = config, threads
        self.on_step = on_step  # each step's new output of each request, as the step ends (token events)
        self._on_give_up, self._max_losses, self._loss_window = on_give_up, max_losses, loss_window
        self._lock = threading.Condition()
        self._handles: dict[str, RequestHandle] = {}  # requests in the engine (or on their way)
        self._commands = None  # the pipe to the engine process; None while it (re)starts
        self._process: multiprocessing.Process | None = None
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._send_lock = threading.Lock()  # one writer of the command pipe at a time
        self._queued = 0  # commands in the outbox or being sent by the sender thread
        self._stats: dict[int, Future] = {}
        self._tickets = itertools.count()
        self._stopping = False
        self._ready = threading.Event()
        self._startup_error: str | None = None
        self._monitor = threading.Thread(target=self._run, name="engine-monitor", daemon=True)
        self._sender = threading.Thread(target=self._send_loop, name="engine-sender", daemon=True)

    def start(self) -> EngineHost:
        self._monitor.start()
        self._sender.start()
        self._ready.wait()
        if self._startup_error is not None:
            raise RuntimeError(f"the engine could not be built: {self._startup_error}")
        return self

    def stop(self, timeout: float | None = 10.0) -> None:
        """Stop the engine process; requests still in it fail with HostStopped."""
        with self._lock:
            self._stopping = True
            self._lock.notify_all()
        self._command(("stop",))
        self._monitor.join(timeout)
        process = self._process
        if process is not None and process.is_alive():
            log.warning("the engine process did not stop in %ss; killing it", timeout)
            process.kill()
            self._monitor.join(timeout)

    def submit(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        priority: int,
        resume_token_ids: list[int] | None = None,
        on_done: Callable[[RequestHandle], None] | None = None,
        transcript: Transcript | None = None,
        tag: str | None = None,
    ) -> RequestHandle:
        """Queue a request for the engine; the handle's `done` is set (and `on_done` called) when it ends.
        `transcript`: what is known of its output already (a resumed job's saved tokens and text)."""
        params = dataclasses.replace(params, output_kind="delta")
        handle = RequestHandle(request_id, priority, on_done, transcript, tag)
        with self._lock:
            stopped = self._stopping
            if not stopped:
                self._handles[request_id] = handle
        if stopped:
            handle._fail(HostStopped("the engine is stopping or cannot run"))
            return handle
        self._command(("add", request_id, prompt, params, priority, resume_token_ids, handle))
        return handle

    def abort(self, request_id: str) -> None:
        """Take the request out of the batch at the next step (its KV blocks are freed)."""
        self._command(("abort", request_id))

    def stats(self, timeout: float = 5.0) -> dict:
        """The engine's counters and gauges, read between two steps."""
        ticket, reply = next(self._tickets), Future()
        self._stats[ticket] = reply
        self._command(("stats", ticket))
        try:
            return reply.result(timeout)
        finally:
            self._stats.pop(ticket, None)

    def _command(self, command: tuple) -> None:
        """Send a command to the engine process from the calling thread when the engine is up and nothing
        waits before it (no thread hand-off: the common case); else the sender thread sends it, in order."""
        with self._send_lock:
            connection = self._commands
            if connection is not None and self._queued == 0:
                try:
                    connection.send(command[:-1] if command[0] == "add" else command)
                    return
                except (OSError, ValueError):  # the engine process is dying: the sender waits for the next
                    pass
            self._queued += 1
        self._outbox.put(command)

    # --- the sender thread: sends what could not be sent at once (the engine restarting), in order -------

    def _send_loop(self) -> None:
        while True:
            command = self._outbox.get()
            try:
                if not self._send_one(command):
                    return
            finally:
                with self._send_lock:
                    self._queued -= 1
            if command[0] == "stop":
                return

    def _send_one(self, command: tuple) -> bool:
        """False when there is no engine process to send to any more (stopping)."""
        with self._lock:
            while self._commands is None and not self._stopping:
                self._lock.wait()  # the engine process is (re)starting
            connection = self._commands
            if command[0] == "add":
                if self._handles.get(command[1]) is not command[-1]:
                    return True  # lost with an engine process while it waited: never re-add it
                command = command[:-1]
        if connection is None:  # stopping with no engine process
            return False
        with self._send_lock:
            try:
                connection.send(command)
            except (OSError, ValueError):  # the engine process is gone: the monitor fails its requests
                pass
        return True

    # --- the monitor thread: starts the engine process, reads its events, restarts it ------------------

    def _run(self) -> None:
        while True:
            process, events, commands, failure = self._spawn()
            if failure is not None:
                if not self._ready.is_set():
                    self._startup_error = failure
                    self._ready.set()
                else:
                    log.critical("the engine process could not be rebuilt: %s", failure)
                    self._give_up()
                break
            with self._lock:
                stopping = self._stopping
                if not stopping:
                    self._commands = commands
                    self._lock.notify_all()
            self._ready.set()
            if stopping:  # stopped while it (re)started: nothing was sent to it
                process.kill()
                process.join()
                self._fail(self._take_all(), HostStopped("the worker is shutting down"))
                break
            self._read(events)
            process.join(5)
            with self._lock:
                self._commands = None
                lost = self._take_all()
                stopping = self._stopping
            commands.close()
            events.close()
            if stopping:
                self._fail(lost, HostStopped("the worker is shutting down"))
                break
            self.losses.append(time.monotonic())
            log.error(
                "the engine process (pid %s) died (exit code %s) with %d requests; they go back to the queue "
                "with their tokens, and a new engine process starts",
                process.pid,
                process.exitcode,
                len(lost),
            )
            self._fail(lost, EngineLost(f"the engine process died (exit code {process.exitcode})"))
            if len([t for t in self.losses if t > time.monotonic() - self._loss_window]) >= self._max_losses:
                log.critical(
                    "the engine process died %d times in %.0fs; giving up",
                    self._max_losses,
                    self._loss_window,
                )
                self._give_up()
                break
        for ticket in list(self._stats):
            reply = self._stats.pop(ticket, None)
            if reply is not None:
                reply.set_exception(HostStopped("the engine is not running"))

    def _spawn(self):
        """Start an engine process; (process, events, commands, None) once it is built, or a failure message."""
        context = multiprocessing.get_context("spawn")  # a fresh interpreter: no fork of a threaded worker
        commands_in, commands = context.Pipe(duplex=False)
        events, events_out = context.Pipe(duplex=False)
        process = context.Process(
            target=engine_process.serve,
            name="genq-engine",
            daemon=True,
            args=(
                self._requested,
                commands_in,
                events_out,
                logging.getLogger().getEffectiveLevel(),
                self._threads,
            ),
        )
        process.start()
        commands_in.close()  # this process keeps only its own ends, so the engine's death reads as EOF
        events_out.close()
        self._process, self.pid = process, process.pid
        try:
            message = events.recv()
        except (EOFError, OSError):
            process.join(5)
            message = (
                "start_failed",
                f"the engine process exited while starting (exit code {process.exitcode})",
            )
        if message[0] != "ready":
            process.join(5)
            return process, events, commands, message[1]
        _, self.config, self.info = message
        metrics.set_attention_path(self.info["attention"])
        log.info("engine process %d ready: %s", process.pid, self.describe())
        return process, events, commands, None

    def describe(self) -> str:
        """What the engine runs, for a person: model, device, dtype, threads, KV blocks, attention path."""
        return (
            f"{self.config.model} on {self.info['device']}/{self.info['dtype']} "
            f"({self.info['torch_threads']} torch threads), {self.info['device_blocks']} device + "
            f"{self.info['host_blocks']} host KV blocks, max_model_len {self.info['max_model_len']}, "
            f"attention: {self.info['attention']}" + (", CUDA graphs" if self.info["cuda_graphs"] else "")
        )

    def _read(self, events) -> None:
        """Apply the engine process's events until it exits."""
        while True:
            try:
                message = events.recv()
            except (EOFError, OSError):
                return
            if isinstance(message, StepReport):
                self._publish(message)
                continue
            kind = message[0]
            if kind == "refused":
                self._fail(self._take([message[1]]), ValueError(message[2]))
            elif kind == "step_failed":
                _, request_ids, is_value_error, text = message
                self._fail(self._take(request_ids), (ValueError if is_value_error else RuntimeError)(text))
            elif kind == "stats":
                reply = self._stats.pop(message[1], None)
                if reply is not None:
                    reply.set_result(message[2])

    def _publish(self, report: StepReport) -> None:
        """One step's updates to their handles and to `on_step`; handles of finished requests end (outside
        the lock)."""
        ended, tokens, added = [], [], []
        news = report.news
        with self._lock:
            for request_id, delta in report.deltas():
                handle = self._handles.get(request_id)
                if handle is None:
                    continue
                new = handle._apply(delta, news.get(request_id) if news else None)
                if new is not None:
                    added.append((handle, new))
                finished = delta.finish_reason is not None
                tokens.append((request_id, handle.priority, len(delta.token_ids), finished))
                if finished:
                    del self._handles[request_id]
                    ended.append(handle)
        if added and self.on_step is not None:
            self.on_step(added)
        for handle in ended:
            handle._end()
        metrics.observe_steps(report.stats, (report.step_time,), tokens)

    def _take(self, request_ids) -> list[RequestHandle]:
        with self._lock:
            return [h for h in (self._handles.pop(r, None) for r in request_ids) if h is not None]

    def _take_all(self) -> list[RequestHandle]:
        with self._lock:
            taken, self._handles = list(self._handles.values()), {}
            return taken

    @staticmethod
    def _fail(handles: list[RequestHandle], error: Exception) -> None:
        for handle in handles:
            handle._fail(error)

    def _give_up(self) -> None:
        with self._lock:
            self._stopping = True
            self._lock.notify_all()
        self._fail(self._take_all(), HostStopped("the engine process cannot run"))
        if self._on_give_up is not None:
            self._on_give_up()
