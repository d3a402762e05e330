"""Batch client: submit a JSONL file of requests, wait for them, write the results in input order.

    python -m batchclient submit prompts.jsonl --url http://127.0.0.1:8000 --key KEY --out results.jsonl
    genq-batch submit prompts.jsonl ...                                      # the same, installed

Each input line is a JSON object: `custom_id` (unique in the file) and the fields of a POST /jobs body,
e.g. `{"custom_id": "q1", "prompt": "Hello", "max_tokens": 32, "priority": 3}`. Each output line is
`{"custom_id", "job_id", "status", "output", "usage", "error"}`, in the order of the input.

Resumable: every accepted submission is appended to a state file (default `<out>.state.jsonl`,
custom_id -> job id) before anything else happens; run the same command again after an interruption
and it submits only what the state file lacks and polls the rest. Each POST carries
`Idempotency-Key: <custom_id>`, so a request that was accepted but not yet recorded when the client
died is answered with the same job, never a duplicate. 429 and 503 answers are retried after their
Retry-After. Ctrl-C stops the client cleanly: jobs already submitted keep running on the server (their
ids are in the state file), and the same command collects them later.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import click
import requests
from tqdm import tqdm

FINAL = ("succeeded", "failed", "cancelled")
RETRY_STATUSES = (429, 502, 503, 504)


class BatchError(Exception):
    """The input or the server's answer makes going on pointless (bad key, bad file)."""


class Client:
    """A small, thread-safe HTTP client for the genq API (one requests.Session per thread)."""

    def __init__(self, url: str, key: str, timeout: float = 30.0, max_wait: float = 300.0):
        self.url = url.rstrip("/")
        self.headers = {"Authorization": f"Bearer {key}"}
        self.timeout = timeout
        self.max_wait = max_wait  # give up on one call after retrying this long
        self.stopping = threading.Event()  # set on Ctrl-C: calls waiting to retry give up at once
        self._local = threading.local()

    def request(self, method: str, path: str, **kwargs) -> requests.Response:
        """Send; retry connection errors, 429 and 5xx-unavailable answers after their Retry-After."""
        deadline = time.monotonic() + self.max_wait
        delay = 0.5
        headers = {**self.headers, **kwargs.pop("headers", {})}
        while True:
            try:
                r = self._session().request(
                    method, self.url + path, headers=headers, timeout=self.timeout, **kwargs
                )
                if r.status_code not in RETRY_STATUSES:
                    return r
                wait = float(r.headers.get("Retry-After") or delay)
            except requests.ConnectionError:
                wait = delay
                r = None
            if time.monotonic() + wait > deadline or self.stopping.is_set():
                if r is None:
                    raise BatchError(f"{method} {path}: the API at {self.url} does not answer")
                return r
            if self.stopping.wait(wait):
                raise BatchError("interrupted")
            delay = min(delay * 2, 10.0)

    def _session(self) -> requests.Session:
        if not hasattr(self._local, "session"):
            self._local.session = requests.Session()
        return self._local.session


def read_requests(path: Path) -> list[dict]:
    """The input lines, checked: each an object with a unique string custom_id."""
    items, seen = [], set()
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as exc:
            raise BatchError(f"{path}:{n}: not JSON: {exc}") from None
        custom_id = item.get("custom_id") if isinstance(item, dict) else None
        if not isinstance(custom_id, str) or not custom_id:
            raise BatchError(f"{path}:{n}: each line needs a non-empty string custom_id")
        if custom_id in seen:
            raise BatchError(f"{path}:{n}: custom_id {custom_id!r} appears twice")
        seen.add(custom_id)
        items.append(item)
    return items


class State:
    """custom_id -> job id (or a submission error), appended one line per entry, fsynced: survives a kill."""

    def __init__(self, path: Path):
        self.path = path
        self.entries: dict[str, dict] = {}
        if path.exists():
            for line in path.read_text().splitlines():
                try:
                    entry = json.loads(line)
                except json.JSONDecodeError:  # a line cut short by a crash
                    continue
                self.entries[entry["custom_id"]] = entry
        self._lock = threading.Lock()
        self._file = path.open("a")

    def record(self, entry: dict) -> None:
        with self._lock:
            self._file.write(json.dumps(entry) + "\n")
            self._file.flush()
            os.fsync(self._file.fileno())
            self.entries[entry["custom_id"]] = entry

    def close(self) -> None:
        self._file.close()


def submit_one(client: Client, item: dict) -> dict:
    """POST one request; the state entry for it: its job id, or the error the API gave."""
    body = {k: v for k, v in item.items() if k != "custom_id"}
    r = client.request("POST", "/jobs", json=body, headers={"Idempotency-Key": item["custom_id"]})
    if r.status_code == 401:
        raise BatchError("the API key was refused (401)")
    if r.status_code == 202:
        return {"custom_id": item["custom_id"], "job_id": r.json()["id"]}
    return {"custom_id": item["custom_id"], "job_id": None, "error": _error(r)}


def poll_one(client: Client, job_id: str) -> dict:
    r = client.request("GET", f"/jobs/{job_id}")
    if r.status_code != 200:
        return {"id": job_id, "status": "failed", "error": _error(r)}
    return r.json()


def _error(r: requests.Response) -> dict:
    try:
        return r.json()["error"]
    except (ValueError, KeyError, TypeError):
        return {"code": f"http_{r.status_code}", "message": r.text[:500]}


def run_batch(
    items: list[dict],
    client: Client,
    state: State,
    *,
    concurrency: int = 8,
    poll_interval: float = 0.5,
    progress: bool = True,
) -> list[dict]:
    """Submit what the state lacks, poll until every job is final; the result rows in input order."""
    todo = [item for item in items if item["custom_id"] not in state.entries]
    with ThreadPoolExecutor(concurrency) as pool, _ctrl_c_sets(client.stopping):
        try:
            return _submit_and_poll(items, todo, client, state, pool, poll_interval, progress)
        except (KeyboardInterrupt, BatchError) as exc:
            if isinstance(exc, BatchError) and not client.stopping.is_set():
                raise
            client.stopping.set()  # requests in flight finish; queued ones are dropped
            pool.shutdown(wait=True, cancel_futures=True)
            raise KeyboardInterrupt from None


@contextlib.contextmanager
def _ctrl_c_sets(stopping: threading.Event) -> Iterator[None]:
    """Ctrl-C sets `stopping`, and the loops stop at their next safe point. (A KeyboardInterrupt raised
    anywhere could land between a lock's acquire and its release in the thread pool and hang the exit.)"""
    if (
        threading.current_thread() is not threading.main_thread()
        or signal.getsignal(signal.SIGINT) is signal.SIG_IGN  # started in the background: keep ignoring it
    ):
        yield
        return
    previous = signal.signal(signal.SIGINT, lambda signum, frame: stopping.set())
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _stop_if_interrupted(client: Client) -> None:
    if client.stopping.is_set():
        raise KeyboardInterrupt


def _submit_and_poll(
    items: list[dict],
    todo: list[dict],
    client: Client,
    state: State,
    pool: ThreadPoolExecutor,
    poll_interval: float,
    progress: bool,
) -> list[dict]:
    with tqdm(
        total=len(items),
        initial=len(items) - len(todo),
        desc="submitted",
        unit="job",
        disable=not progress,
    ) as bar:
        for entry in pool.map(lambda item: submit_one(client, item), todo):
            state.record(entry)
            bar.update()
            _stop_if_interrupted(client)
    jobs: dict[str, dict] = {}
    pending = [e["job_id"] for e in state.entries.values() if e.get("job_id")]
    with tqdm(total=len(pending), desc="finished", unit="job", disable=not progress) as bar:
        while pending:
            started = time.monotonic()
            for job in pool.map(lambda job_id: poll_one(client, job_id), pending):
                jobs[job["id"]] = job
            _stop_if_interrupted(client)
            done = [job_id for job_id in pending if jobs[job_id]["status"] in FINAL]
            bar.update(len(done))
            pending = [job_id for job_id in pending if jobs[job_id]["status"] not in FINAL]
            if pending:
                client.stopping.wait(max(0.0, poll_interval - (time.monotonic() - started)))
                _stop_if_interrupted(client)
    return [result_row(item["custom_id"], state.entries[item["custom_id"]], jobs) for item in items]


def result_row(custom_id: str, entry: dict, jobs: dict[str, dict]) -> dict:
    job = jobs.get(entry.get("job_id"))
    if job is None:
        return {
            "custom_id": custom_id,
            "job_id": None,
            "status": "rejected",
            "output": None,
            "usage": None,
            "error": entry.get("error"),
        }
    return {
        "custom_id": custom_id,
        "job_id": job["id"],
        "status": job["status"],
        "output": job.get("output"),
        "usage": job.get("usage"),
        "error": job.get("error"),
    }


def write_results(path: Path, rows: list[dict]) -> None:
    """Write the rows atomically (a reader never sees half a file)."""
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    tmp.replace(path)


@click.group(name="batch", help=__doc__.split("\n\n")[0])
def main() -> None:
    pass


@main.command()
@click.argument("input", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option(
    "--url", envvar="GENQ_URL", default="http://127.0.0.1:8000", show_default=True, help="the API ($GENQ_URL)"
)
@click.option("--key", envvar="GENQ_API_KEY", required=True, help="API key ($GENQ_API_KEY)")
@click.option(
    "--out",
    type=click.Path(dir_okay=False, path_type=Path),
    required=True,
    help="results JSONL, in input order",
)
@click.option(
    "--state",
    type=click.Path(dir_okay=False, path_type=Path),
    help="resume file [default: <out>.state.jsonl]",
)
@click.option(
    "--concurrency", type=click.IntRange(min=1), default=8, show_default=True, help="requests in flight"
)
@click.option(
    "--poll-interval",
    type=click.FloatRange(min=0),
    default=0.5,
    show_default=True,
    help="seconds between polls",
)
@click.option("--no-progress", is_flag=True, help="no progress bars")
def submit(
    input: Path,
    url: str,
    key: str,
    out: Path,
    state: Path | None,
    concurrency: int,
    poll_interval: float,
    no_progress: bool,
) -> None:
    """Submit a JSONL file of requests (one {custom_id, ...POST /jobs body} per line) and write the results."""
    resume = State(state or out.with_name(out.name + ".state.jsonl"))
    items: list[dict] = []
    try:
        items = read_requests(input)
        rows = run_batch(
            items,
            Client(url, key),
            resume,
            concurrency=concurrency,
            poll_interval=poll_interval,
            progress=not no_progress,
        )
    except BatchError as exc:
        click.echo(f"genq-batch: {exc}", err=True)
        sys.exit(2)
    except KeyboardInterrupt:
        submitted = sum(1 for entry in resume.entries.values() if entry.get("job_id"))
        click.echo(
            f"\ngenq-batch: interrupted. {submitted} of {len(items)} requests are submitted and go on running "
            f"on the server (nothing was cancelled; their job ids are in {resume.path}). Run the same command "
            "again to submit the rest and collect every result.",
            err=True,
        )
        sys.exit(130)
    finally:
        resume.close()
    write_results(out, rows)
    counts: dict[str, int] = {}
    for row in rows:
        counts[row["status"]] = counts.get(row["status"], 0) + 1
    click.echo(
        f"{len(rows)} results written to {out}: "
        + ", ".join(f"{n} {status}" for status, n in sorted(counts.items())),
        err=True,
    )
