"""One tokenizer per host (issue 42): gunicorn's arbiter loads the model's tokenizer before it forks its workers
(gunicorn.conf.py, load_tokenizer_before_fork), which share it copy-on-write; API_SHARED_TOKENIZER=false leaves
each worker to load its own. bench/api_memory.py measures the memory; this checks, against a real gunicorn with
several worker processes, that the tokenizer is in the arbiter, that the fork leaves the workers' Rust tokenizer
its threads (it was never used before the fork: a tokenizer used before a fork turns parallelism off in the
children, and says so), and that the workers tokenize as the tokenizer does.
"""

from __future__ import annotations

import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

import pytest
import requests

from batching.tokenizer import load_tokenizer
from tests.conftest import BIN, ROOT, free_port, settings_env

PROMPTS = [f"Request {i}: héllo, wörld ✓" for i in range(24)]


def workers_of(pid: int) -> list[int]:
    return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def maps_tokenizers(pid: int) -> bool:
    """Whether process `pid` has the Rust tokenizers library loaded (a tokenizer was made in it)."""
    return "tokenizers" in Path(f"/proc/{pid}/maps").read_text()


@pytest.mark.parametrize("shared", [True, False])
def test_the_arbiter_loads_the_tokenizer_once_for_its_workers(settings, database, new_key, shared):
    workers = 3
    env = {**settings_env(settings), "API_ACCESS_LOG": "", "API_SHARED_TOKENIZER": str(shared).lower()}
    with gunicorn_arbiter(env, workers) as (url, arbiter, log):
        try:
            # the tokenizer was made in the arbiter (shared), or only in the workers
            assert maps_tokenizers(arbiter.pid) is shared, _tail(log)
            headers = {"Authorization": f"Bearer {new_key()}"}
            tokenizer = load_tokenizer(settings.model)
            for prompt in PROMPTS:  # a new connection each: gunicorn spreads them over its workers
                r = requests.post(f"{url}/tokenize", json={"prompt": prompt}, headers=headers, timeout=10)
                assert r.status_code == 200, r.text
                assert r.json()["tokens"] == tokenizer(prompt)["input_ids"]
        finally:
            arbiter.terminate()
            arbiter.wait(timeout=30)
        text = _tail(log, 100_000)
    assert arbiter.returncode == 0, text
    # tokenizers warns in a child forked after the parent used its thread pool, and turns parallelism off there
    assert "after parallelism has already been used" not in text, text
    assert "MonkeyPatchWarning" not in text, text
    assert ("loaded once for the workers" in text) is shared, text


@contextmanager
def gunicorn_arbiter(env: dict, workers: int) -> Iterator[tuple[str, subprocess.Popen, IO[bytes]]]:
    """`gunicorn "webapi:create_app()"` with `workers` worker processes on a free port, its stderr in a temporary
    file: (its URL, the arbiter, the log) once it answers /healthz and every worker is forked."""
    port = free_port()
    with tempfile.TemporaryFile() as log:
        arbiter = subprocess.Popen(
            [
                BIN / "gunicorn",
                "--bind",
                f"127.0.0.1:{port}",
                "--workers",
                str(workers),
                "webapi:create_app()",
            ],
            cwd=ROOT,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=log,
        )
        try:
            url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 120
            while True:
                assert arbiter.poll() is None and time.monotonic() < deadline, _tail(log)
                try:
                    if requests.get(f"{url}/healthz", timeout=5).status_code == 200:
                        break
                except requests.RequestException:
                    time.sleep(0.1)
            while len(workers_of(arbiter.pid)) < workers:
                assert time.monotonic() < deadline, _tail(log)
                time.sleep(0.1)
            yield url, arbiter, log
        finally:
            if arbiter.poll() is None:
                arbiter.kill()
                arbiter.wait()


def _tail(log, size: int = 3000) -> str:
    log.seek(0)
    return log.read().decode(errors="replace")[-size:]
