"""The ranks of a tensor-parallel engine (EngineConfig.tensor_parallel_size = N > 1).

Rank 0 is the Engine, in the caller's process: one scheduler, one block manager, the sampler, every request.
Ranks 1..N-1 are processes it starts (`RankGroup`): each loads the model, keeps its shard
(tensor_parallel.py), builds a KV cache of its own heads with the engine's own builder, and then runs
every forward rank 0 runs, on the step rank 0 broadcasts (step_broadcast.py), never sampling.

Two process groups join them (collectives.py): "control", gloo on the CPU, carries the steps; "compute"
carries the model's all-reduces: NCCL on CUDA (rank r on cuda:r), the same gloo group on the CPU.

A rank is a fresh interpreter started with subprocess, not multiprocessing: the worker's engine process is a
daemonic multiprocessing child, which may not start children of its own. Rank 0 stops the ranks when the engine
is closed or collected, and at exit. A rank exits on its own when rank 0's process goes (its connection
closes, or its parent changes). A rank that fails records why in the group's store, and rank 0 raises
`RankFailure` with that reason on the next collective that cannot complete: a dead rank's connection fails at
once, a hung one after COLLECTIVE_TIMEOUT. Nothing waits forever on rank 0's side.
"""

from __future__ import annotations

import functools
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
import weakref
from datetime import timedelta

import torch
import torch.distributed as dist

from batching import engine_builder, tensor_parallel
from batching.attention import ATTENTION_NAME
from batching.attention_classes import set_attention
from batching.collectives import Collectives, RankFailure
from batching.config import EngineConfig
from batching.models import load_model_config, resolve_device
from batching.step_broadcast import Command, StepBroadcast
from batching.tensor_parallel import rank_device

COLLECTIVE_TIMEOUT = timedelta(seconds=300)  # rank 0's longest wait on the ranks (their model loads included)
RANK_TIMEOUT = timedelta(days=365)  # a rank waits for rank 0's next step however long the engine idles
STOP_GRACE_SECONDS = 5.0  # a rank asked to stop is killed after this


class RankGroup:
    """Rank 0's handle on the other ranks: starts them, sends them each step (the runner's StepFollowers),
    stops them (`close`, or when it is collected)."""

    @classmethod
    def start(cls, config: EngineConfig) -> RankGroup:
        """Refuse what cannot be sharded (from the model's config alone), then start the ranks."""
        tensor_parallel.check_shardable(load_model_config(config), config)
        return cls(config, rank_device(resolve_device(config.device), 0))

    def __init__(self, config: EngineConfig, device: torch.device):
        n = config.tensor_parallel_size
        self.store = dist.TCPStore(
            "127.0.0.1", 0, n, True, timeout=COLLECTIVE_TIMEOUT, wait_for_workers=False
        )
        self.processes = [_start_rank(config, rank, self.store.port) for rank in range(1, n)]
        self._finalizer = weakref.finalize(self, _stop, self.processes)
        describe = functools.partial(_describe_failure, self.store, self.processes)
        try:
            self.collectives = _join(self.store, n, device, self.processes, describe)
        except BaseException:
            self._finalizer()
            raise
        self.steps = StepBroadcast(self.collectives.broadcast)
        self.send_step = self.steps.send_step
        self.send_reference = self.steps.send_reference

    def close(self) -> None:
        """Stop the ranks: asked, then terminated if they have not exited within STOP_GRACE_SECONDS. Idempotent."""
        if self._finalizer.alive and all(p.poll() is None for p in self.processes):
            try:
                self.steps.send_stop()
                for process in self.processes:
                    process.wait(STOP_GRACE_SECONDS)
            except (RankFailure, subprocess.TimeoutExpired):
                pass
        self._finalizer()


def _start_rank(config: EngineConfig, rank: int, port: int) -> subprocess.Popen:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # where `batching` imports from
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    process = subprocess.Popen(
        [sys.executable, "-c", "from batching.rank_group import rank_main; rank_main()"],
        stdin=subprocess.PIPE,
        env=env,
        start_new_session=True,  # a terminal's Ctrl-C reaches rank 0, which decides when the ranks stop
    )
    assert process.stdin is not None
    process.stdin.write(pickle.dumps((config, rank, port, torch.get_num_threads())))
    process.stdin.close()
    return process


def _join(store, world_size: int, device, processes: list[subprocess.Popen], describe) -> Collectives:
    """Rank 0's collectives, once every rank has joined; RankFailure as soon as one exits before it does."""
    made: list[Collectives | BaseException] = []

    def make() -> None:
        try:
            made.append(Collectives(store, 0, world_size, device, COLLECTIVE_TIMEOUT, describe))
        except BaseException as exc:  # noqa: BLE001 - reported by the waiting thread
            made.append(exc)

    thread = threading.Thread(target=make, name="genq-tp-join", daemon=True)
    thread.start()
    while thread.is_alive():
        thread.join(0.2)
        if thread.is_alive() and any(p.poll() is not None for p in processes):
            raise RankFailure(describe(RuntimeError("a rank exited before joining the group")))
    result = made[0]
    if isinstance(result, BaseException):
        raise RankFailure(describe(result)) from result
    return result


def _stop(processes: list[subprocess.Popen]) -> None:
    """Terminate the ranks still running, kill those that outlive STOP_GRACE_SECONDS."""
    for process in processes:
        if process.poll() is None:
            process.terminate()
    deadline = time.monotonic() + STOP_GRACE_SECONDS
    for process in processes:
        try:
            process.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _describe_failure(store, processes: list[subprocess.Popen], exc: BaseException) -> str:
    """Which ranks exited, with the reason each recorded, else that one stopped answering; and the error."""
    deadline = time.monotonic() + 2.0  # a rank whose connection closed is exiting: let it finish
    while time.monotonic() < deadline and all(p.poll() is None for p in processes):
        time.sleep(0.05)
    gone = []
    for rank, process in enumerate(processes, 1):
        if process.poll() is None:
            continue
        reason = ""
        try:
            if store.check([_failure_key(rank)]):
                reason = ": " + store.get(_failure_key(rank)).decode(errors="replace")
        except RuntimeError:
            pass
        gone.append(f"rank {rank} exited with code {process.returncode}{reason}")
    what = "; ".join(gone) if gone else "a rank stopped answering"
    first_line = (str(exc).strip().splitlines() or [""])[0]
    return f"tensor parallel: {what} ({type(exc).__name__}: {first_line})"


def _failure_key(rank: int) -> str:
    return f"failure/{rank}"


# --- ranks 1..N-1


def rank_main() -> None:
    """A rank's process: its config and place from stdin, then load, build and follow rank 0 until told to stop."""
    config, rank, port, threads = pickle.load(sys.stdin.buffer)
    # rank 0's stop, even when started by a process that ignores SIGTERM (the worker's engine process)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    torch.set_num_threads(threads)
    _exit_with_parent()
    store = dist.TCPStore("127.0.0.1", port, config.tensor_parallel_size, False, timeout=COLLECTIVE_TIMEOUT)
    try:
        follow(config, rank, store)
    except RankFailure as exc:  # rank 0 went: nobody to tell
        print(exc, file=sys.stderr)
        sys.exit(1)
    except BaseException as exc:
        try:
            store.set(_failure_key(rank), f"{type(exc).__name__}: {exc}")
        except RuntimeError:
            pass  # rank 0 went meanwhile
        raise


def follow(config: EngineConfig, rank: int, store) -> None:
    """Build this rank's model and caches exactly as rank 0 builds its own (engine_builder.py: the same
    collectives in the same order), then run what rank 0 sends until STOP."""
    device = rank_device(resolve_device(config.device), rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    collectives = Collectives(store, rank, config.tensor_parallel_size, device, RANK_TIMEOUT, _error_text)
    loaded = engine_builder.load(config, collectives)
    backend, kernel = engine_builder.choose_attention(config, loaded.device, loaded.dtype)
    runner = engine_builder.build(config, loaded, backend, kernel, collectives).runner
    steps = StepBroadcast(collectives.broadcast)
    model = loaded.model
    with torch.inference_mode():
        while True:
            message = steps.receive()
            if message.command == Command.STOP:
                return
            if message.command == Command.REFERENCE:  # the probe's eager forward (model_probe._check_logits)
                set_attention(model, "eager")
                try:
                    model(input_ids=torch.tensor([message.token_ids], device=device), use_cache=False)
                except Exception:  # noqa: BLE001 - rank 0's fails too, and it goes on without the comparison
                    pass
                finally:
                    set_attention(model, ATTENTION_NAME)
                continue
            runner.follow(message.swap_out, message.swap_in, message.rows)


def _error_text(exc: BaseException) -> str:
    return f"tensor parallel: rank 0 went ({type(exc).__name__}: {exc})"


def _exit_with_parent() -> None:
    """Exit when rank 0's process is gone (this process is re-parented), should its connection stay open."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, name="genq-tp-parent", daemon=True).start()
