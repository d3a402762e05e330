"""Batch client: submit a JSONL file of requests, wait for them, write the results in input order.

    python -m webapi.client submit prompts.jsonl --url http://127.0.0.1:8000 --key KEY --out results.jsonl
    genq-batch submit prompts.jsonl ...                                      # the same, installed

Each input line is a JSON object: `custom_id` (unique in the file) and the fields of a POST /jobs body,
e.g. `{"custom_id": "q1", "prompt": "Hello", "max_tokens": 32, "priority": 3}`. Each output line is
`{"custom_id", "job_id", "status", "output", "usage", "error"}`, in the order of the input.

Resumable: every accepted submission is appended to a state file (default `<out>.state.jsonl`,
custom_id -> job id) before anything else happens; run the same command again after an interruption
and it submits only what the state file lacks and polls the rest. Each POST carries
`Idempotency-Key: <custom_id>`, so a request that was accepted but not yet recorded when the client
died is answered with the same job, never a duplicate. 429 and 503 answers are retried after their
Retry-After.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

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
            if time.monotonic() + wait > deadline:
                if r is None:
                    raise BatchError(f"{method} {path}: the API at {self.url} does not answer")
                return r
            time.sleep(wait)
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
    with ThreadPoolExecutor(concurrency) as pool:
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
        jobs: dict[str, dict] = {}
        pending = [e["job_id"] for e in state.entries.values() if e.get("job_id")]
        with tqdm(total=len(pending), desc="finished", unit="job", disable=not progress) as bar:
            while pending:
                started = time.monotonic()
                for job in pool.map(lambda job_id: poll_one(client, job_id), pending):
                    jobs[job["id"]] = job
                done = [job_id for job_id in pending if jobs[job_id]["status"] in FINAL]
                bar.update(len(done))
                pending = [job_id for job_id in pending if jobs[job_id]["status"] not in FINAL]
                if pending:
                    time.sleep(max(0.0, poll_interval - (time.monotonic() - started)))
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="genq-batch", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    submit = commands.add_parser("submit", help="submit a JSONL file of requests and write the results")
    submit.add_argument("input", type=Path, help="JSONL: one {custom_id, ...POST /jobs body} per line")
    submit.add_argument(
        "--url",
        default=os.environ.get("GENQ_URL", "http://127.0.0.1:8000"),
        help="the API (default $GENQ_URL or http://127.0.0.1:8000)",
    )
    submit.add_argument(
        "--key", default=os.environ.get("GENQ_API_KEY"), help="API key (default $GENQ_API_KEY)"
    )
    submit.add_argument("--out", type=Path, required=True, help="results JSONL, in input order")
    submit.add_argument("--state", type=Path, help="resume file (default <out>.state.jsonl)")
    submit.add_argument("--concurrency", type=int, default=8, help="requests in flight (default 8)")
    submit.add_argument(
        "--poll-interval", type=float, default=0.5, help="seconds between polls (default 0.5)"
    )
    submit.add_argument("--no-progress", action="store_true", help="no progress bars")
    args = parser.parse_args(argv)
    if not args.key:
        parser.error("an API key is needed: --key or GENQ_API_KEY")
    state = State(args.state or args.out.with_name(args.out.name + ".state.jsonl"))
    try:
        items = read_requests(args.input)
        rows = run_batch(
            items,
            Client(args.url, args.key),
            state,
            concurrency=args.concurrency,
            poll_interval=args.poll_interval,
            progress=not args.no_progress,
        )
    except BatchError as exc:
        print(f"genq-batch: {exc}", file=sys.stderr)
        return 2
    finally:
        state.close()
    write_results(args.out, rows)
    counts: dict[str, int] = {}
    for row in rows:
        counts[row["status"]] = counts.get(row["status"], 0) + 1
    print(
        f"{len(rows)} results written to {args.out}: "
        + ", ".join(f"{n} {status}" for status, n in sorted(counts.items())),
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
