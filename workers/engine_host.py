"""EngineHost: a worker's one batching.Engine, run in a process of its own (workers/engine_process.py).

Why a process: a small model's step is mostly Python between kernels, and a worker holding hundreds of jobs
runs plenty of Python of its own (intake, claims, batched writes, token events, metrics). In one process they
share one GIL, and the engine's steps ran 1.5-1.8x slower inside a worker than alone (bench/backlog.py). In
its own process the engine steps at its own pace; this process imports no torch.

Callers `submit()` an EngineRequest, `abort()` it, ask for `stats()`: each a message of
workers/engine_protocol.py, written to the pipe by the calling thread (or, while the engine process
restarts, by a sender thread, in order). The monitor thread reads what comes back and applies each step's
report to the requests as the step ends: their transcripts grow, `on_step` gets the step's new output (token
events), and `on_end` each request that finished or failed:

    JobBook ─submit/abort─▶ pipe ─▶ engine process: apply, step(), send a StepReport
    EngineRequest (a HeldJob) ◀─ monitor ◀─pipe─┘ ─on_step, on_end─▶ JobBook

If the engine process dies (killed for memory, a sticky device error), its requests fail with
`EngineLost` (the job book hands them back to the queue with the tokens they had) and a new engine
process starts; commands sent meanwhile wait for it. Should it die `max_losses` times within
`loss_window` seconds, the host gives up: `on_give_up` is called (the worker shuts down).
"""

from __future__ import annotations

import itertools
import logging
import multiprocessing
import os
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from datetime import datetime, timezone

from batching import EngineConfig, SamplingParams
from batching.detokenizer import Detokenizer, OutputText
from batching.tokenizer import load_tokenizer
from contract.deltas import Delta, Gap, Transcript
from workers import engine_process, metrics, process_tuning
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


class HostStopped(RuntimeError):
    """The host stopped (the worker is shutting down) before the request finished."""


class EngineLost(HostStopped):
    """The engine process died while the request was in it; its transcript holds the tokens made until then."""


class EngineRequest:
    """A request in the engine as the worker knows it: its output so far (a Transcript: other threads may read a
    consistent prefix of it at any time), what the engine said of it, and its error once it failed.

    Written by the host's reader thread only. The job book's HeldJob is one (workers/held_job.py), so a held job
    is one record from its claim to its end."""

    __slots__ = (
        "request_id",
        "priority",
        "transcript",
        "first_token_at",
        "prompt_token_ids",
        "prompt_logprobs",
        "num_preemptions",
        "updated",
        "error",
        "made_text",
    )

    def __init__(self, request_id: str, priority: int, transcript: Transcript | None = None):
        self.request_id = request_id
        self.priority = priority
        # what is known of its output: empty, or a resumed job's saved tokens and text
        self.transcript = transcript if transcript is not None else Transcript()
        self.first_token_at: datetime | None = None  # wall clock of the first token (the engine's clock)
        self.prompt_token_ids: list[int] = []  # known from the request's first update
        self.prompt_logprobs: list | None = None  # likewise, when the request asked for them
        self.num_preemptions = 0
        self.updated = False  # the engine reported on it at least once
        self.error: Exception | None = None
        # its text as made in this process from the engine's token ids (None: the engine makes it)
        self.made_text: OutputText | None = None

    def apply(self, delta: Delta, news: RequestNews | None) -> Delta | None:
        """A step's delta, trimmed to what this request lacked (None: nothing new), and its news, if any."""
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


class EngineHost:
    """Owns the engine process and the two threads that talk to it. `start()` waits until it is built."""

    def __init__(
        self,
        config: EngineConfig,
        *,
        threads: int | None = None,
        on_give_up: Callable[[], None] | None = None,
        max_losses: int = 3,
        loss_window: float = 300.0,
        text_in_worker: bool = True,
    ):
        self.config = config  # the engine's own (resolved) config once it is built
        self.info: dict = {}  # device, dtype, KV blocks, attention path, CUDA graphs (for logs and stats)
        self.pid: int | None = None  # the engine process's
        self.losses: list[float] = []  # monotonic times the engine process died
        self._requested, self._threads = config, threads
        # each step's new output of each request, as the step ends (token events)
        self.on_step: Callable[[list[tuple[EngineRequest, Delta]]], None] | None = None
        self.on_end: Callable[[EngineRequest], None] = lambda request: None  # finished, or failed: `error`
        self._on_give_up, self._max_losses, self._loss_window = on_give_up, max_losses, loss_window
        # the text of requests whose text the engine does not need (no stop strings, no grammar) is made here,
        # by the reader thread, from the token ids each step reports: off the engine's step (None: in the
        # engine, every request's; also when this process cannot load the model's tokenizer)
        self._text_in_worker = text_in_worker
        self._detokenize: Detokenizer | None = None
        self._lock = threading.Condition()
        self._requests: dict[str, EngineRequest] = {}  # in the engine (or on their way)
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
        self._command(Stop())
        self._monitor.join(timeout)
        process = self._process
        if process is not None and process.is_alive():
            log.warning("the engine process did not stop in %ss; killing it", timeout)
            process.kill()
            self._monitor.join(timeout)

    def submit(
        self,
        request: EngineRequest,
        prompt: str | list[int],
        params: SamplingParams,
        resume_token_ids: list[int] | None = None,
        *,
        arrival_time: float | None = None,
        predicted_output_tokens: int | None = None,
        deadline: float | None = None,
    ) -> None:
        """Send a request to the engine; `on_end(request)` is called when it finishes or fails. The keywords
        place it within its priority class (Engine.add_request)."""
        with self._lock:
            stopped = self._stopping
            if not stopped:
                self._requests[request.request_id] = request
        if stopped:
            self._fail([request], HostStopped("the engine is stopping or cannot run"))
            return
        in_worker = (
            self._detokenize is not None
            and params.detokenize
            and not params.stop
            and params.json_schema is None
        )
        request.made_text = OutputText(params) if in_worker else None
        add = AddRequest(
            request.request_id,
            prompt,
            params,
            request.priority,
            resume_token_ids,
            arrival_time,
            predicted_output_tokens,
            deadline,
            in_worker,
        )
        self._command(add, request)

    def abort(self, request_id: str) -> None:
        """Take the request out of the batch at the next step (its KV blocks are freed)."""
        self._command(AbortRequest(request_id))

    def stats(self, timeout: float = 5.0) -> dict:
        """The engine's counters and gauges, read between two steps. TimeoutError at once while the engine
        process (re)starts: nothing answers before it is built, and a control command asking (`celery inspect
        engine_stats`, workers/control.py) would otherwise miss its own reply's timeout waiting."""
        if self._commands is None:
            raise TimeoutError("the engine process is starting")
        ticket, reply = next(self._tickets), Future()
        self._stats[ticket] = reply
        self._command(StatsRequest(ticket))
        try:
            return reply.result(timeout)
        finally:
            self._stats.pop(ticket, None)

    def _command(self, message, request: EngineRequest | None = None) -> None:
        """Send a message to the engine process from the calling thread when the engine is up and nothing
        waits before it (no thread hand-off: the common case); else the sender thread sends it, in order.
        `request`: the request an AddRequest adds (not sent again if it was lost meanwhile)."""
        with self._send_lock:
            connection = self._commands
            if connection is not None and self._queued == 0:
                try:
                    connection.send(message)
                    return
                except (OSError, ValueError):  # the engine process is dying: the sender waits for the next
                    pass
            self._queued += 1
        self._outbox.put((message, request))

    # --- the sender thread: sends what could not be sent at once (the engine restarting), in order -------

    def _send_loop(self) -> None:
        while True:
            message, request = self._outbox.get()
            try:
                if not self._send_one(message, request):
                    return
            finally:
                with self._send_lock:
                    self._queued -= 1
            if isinstance(message, Stop):
                return

    def _send_one(self, message, request: EngineRequest | None) -> bool:
        """False when there is no engine process to send to any more (stopping)."""
        with self._lock:
            while self._commands is None and not self._stopping:
                self._lock.wait()  # the engine process is (re)starting
            connection = self._commands
            if request is not None and self._requests.get(request.request_id) is not request:
                return True  # lost with an engine process while it waited: never re-add it
        if connection is None:  # stopping with no engine process
            return False
        with self._send_lock:
            try:
                connection.send(message)
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
            self.pid = None  # until the next one is built: stats never name a dead process beside a new count
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
        # the spawned interpreter inherits this process's environment, read by libgomp as torch loads it
        added = process_tuning.engine_environment()
        os.environ.update(added)
        try:
            process.start()
        finally:
            for name in added:
                del os.environ[name]
        commands_in.close()  # this process keeps only its own ends, so the engine's death reads as EOF
        events_out.close()
        self._process, self.pid = process, process.pid
        try:
            message = events.recv()
        except (EOFError, OSError):
            process.join(5)
            message = StartFailed(f"the engine process exited while starting (exit code {process.exitcode})")
        if not isinstance(message, Ready):
            process.join(5)
            return process, events, commands, message.error
        self.config, self.info = message.config, message.info
        if self._text_in_worker and self._detokenize is None:
            self._detokenize = _detokenizer(self.config)
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
        """Apply the engine process's messages until it exits."""
        while True:
            try:
                message = events.recv()
            except (EOFError, OSError):
                return
            match message:
                case StepReport():
                    self._publish(message)
                case Refused(request_id, error):
                    self._fail(self._take([request_id]), ValueError(error))
                case StepFailed(request_ids, value_error, error):
                    self._fail(self._take(request_ids), (ValueError if value_error else RuntimeError)(error))
                case StatsReply(ticket, stats):
                    reply = self._stats.pop(ticket, None)
                    if reply is not None:
                        reply.set_result(stats)

    def _publish(self, report: StepReport) -> None:
        """One step's updates to their requests and to `on_step`; requests that finished end (outside the
        lock)."""
        ended, tokens, added = [], [], []
        news = report.news
        # this thread is the only one that takes requests out of _requests (others add): looked up without the
        # lock, and their text made before it is taken (the submitting threads wait on it)
        get = self._requests.get
        rows = [(r, delta) for request_id, delta in report.deltas() if (r := get(request_id)) is not None]
        if (detokenize := self._detokenize) is not None:
            rows = _make_text(rows, detokenize)
        with self._lock:
            for request, delta in rows:
                request_id = request.request_id
                new = request.apply(delta, news.get(request_id) if news else None)
                if new is not None:
                    added.append((request, new))
                finished = delta.finish_reason is not None
                tokens.append((request_id, request.priority, len(delta.token_ids), finished))
                if finished:
                    del self._requests[request_id]
                    ended.append(request)
        if added and self.on_step is not None:
            self.on_step(added)
        for request in ended:
            self.on_end(request)
        metrics.observe_steps(report.stats, (report.step_time,), tokens)

    def _take(self, request_ids) -> list[EngineRequest]:
        with self._lock:
            return [r for r in (self._requests.pop(i, None) for i in request_ids) if r is not None]

    def _take_all(self) -> list[EngineRequest]:
        with self._lock:
            taken, self._requests = list(self._requests.values()), {}
            return taken

    def _fail(self, requests: list[EngineRequest], error: Exception) -> None:
        for request in requests:
            request.error = error
            self.on_end(request)

    def _give_up(self) -> None:
        with self._lock:
            self._stopping = True
            self._lock.notify_all()
        self._fail(self._take_all(), HostStopped("the engine process cannot run"))
        if self._on_give_up is not None:
            self._on_give_up()


def _detokenizer(config: EngineConfig) -> Detokenizer | None:
    """A Detokenizer of the engine's model's tokenizer (the one the engine decodes with), or None (the engine
    makes every text) when this process cannot load it, or the model has none."""
    try:
        tokenizer = load_tokenizer(config.model, config.revision, config.trust_remote_code)
    except Exception:  # any failure: the engine makes the text, as before
        log.warning(
            "cannot load %s's tokenizer in the worker: the engine makes the text", config.model, exc_info=True
        )
        return None
    return None if tokenizer is None else Detokenizer(tokenizer)


def _make_text(
    rows: list[tuple[EngineRequest, Delta]], detokenize: Detokenizer
) -> list[tuple[EngineRequest, Delta]]:
    """The step's rows (a list of this step's, changed in place) with the text of the requests whose text is
    made here: one Detokenizer pass over them, as the engine's step would have run it (OutputText), each
    row then all its request's new text. A row at a time, so kept flat: deltas by index, built in C."""
    to_decode: list[OutputText] = []
    made: list[tuple[int, OutputText, int]] = []
    decode_it, made_it = to_decode.append, made.append
    for i, (request, delta) in enumerate(rows):
        text = request.made_text
        if text is not None:
            made_it((i, text, len(text.text)))
            if text.take(delta[1], delta[4]):  # (token_ids, finish_reason)
                decode_it(text)
    if not made:
        return rows
    detokenize(to_decode)
    new = tuple.__new__
    for i, text, start in made:
        request, d = rows[i]
        rows[i] = (request, new(Delta, (d[0], d[1], start, text.text[start:], d[4], d[5])))
    return rows
