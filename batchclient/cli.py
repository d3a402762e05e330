"""Batch client: submit a JSONL file of requests, follow them as they end, write each result as it ends.

    python -m batchclient submit prompts.jsonl --url http://127.0.0.1:8000 --key KEY --out results.jsonl
    genq-batch submit prompts.jsonl ...                                      # the same, installed

Each input line is a JSON object: `custom_id` (unique in the file) and the fields of a POST /jobs body,
e.g. `{"custom_id": "q1", "prompt": "Hello", "max_tokens": 32, "priority": 3}`. Each output line is
`{"custom_id", "job_id", "status", "output", "usage", "error"}`: appended as each request ends (in the
order they end), and the whole file rewritten in input order once every request has ended.

Requests go in bulk (POST /jobs/bulk, up to --bulk-size a call), no more at once than the key's queued-job
cap has room for; results are followed with GET /jobs/ended (what ended since the last look: one call a
poll, whatever the number of jobs waiting), so a 10,000-line file costs a few hundred calls, not 10,000.

Resumable: every accepted submission is appended to a state file (default `<out>.state.jsonl`,
custom_id -> job id) before anything else happens; run the same command again after an interruption and
it submits only what the state file lacks, keeps the results already written, and collects the rest. Each
request carries the Idempotency-Key `<run id>:<custom_id>` (the run id is the state file's first line), so a
request accepted but not yet recorded when the client died is answered with the same job, never a
duplicate, and two files reusing a custom_id never collide. 429 and 503 answers are retried after their
Retry-After; an API that does not answer is reported within seconds. Ctrl-C stops the client cleanly: jobs
already submitted keep running on the server (their ids are in the state file), and the same command
collects them later.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import click
from tqdm import tqdm

from batchclient.api import BatchError, Client
from batchclient.follow import RELIST_AFTER_SECONDS, Follower
from batchclient.run_state import Results, State
from batchclient.submit import Submitter, read_requests

__all__ = ["BatchError", "Client", "main", "read_requests", "run_batch"]


def run_batch(
    items: list[dict],
    client: Client,
    state: State,
    results: Results,
    *,
    bulk_size: int = 1000,
    poll_interval: float = 0.5,
    progress: bool = True,
    relist_after: float = RELIST_AFTER_SECONDS,
) -> None:
    """Submit what the state lacks while following what ends; every request's row is in `results` when
    this returns (KeyboardInterrupt on Ctrl-C, BatchError when going on is pointless)."""
    check_reachable(client)
    with (
        _ctrl_c_sets(client.stopping),
        tqdm(
            total=len(items), initial=len(results.rows), unit="job", disable=not progress, smoothing=0.1
        ) as bar,
    ):
        follower = Follower(client, state, results, bar, relist_after)
        submitter = Submitter(client, state, items, follower, bulk_size)
        thread = threading.Thread(target=submitter.run, name="genq-batch submit", daemon=True)
        thread.start()
        try:
            follower.run(submitter.done, poll_interval)
        finally:
            if not submitter.done.is_set():  # the follower failed or was interrupted
                client.stopping.set()
            thread.join()
        if submitter.error is not None:
            raise submitter.error
    if client.stopping.is_set() and len(results.rows) < len(items):
        raise KeyboardInterrupt


def check_reachable(client: Client) -> None:
    """BatchError within seconds when nothing answers at the URL, or the key is refused."""
    r = client.request("GET", "/jobs", params={"limit": 1})
    if r.status_code == 401:
        raise BatchError("the API key was refused (401)")
    if r.status_code == 404:
        raise BatchError(f"{client.url} answers, but is not genq's API (GET /jobs: 404)")


@contextlib.contextmanager
def _ctrl_c_sets(stopping: threading.Event) -> Iterator[None]:
    """Ctrl-C sets `stopping`, and the loops stop at their next safe point. (A KeyboardInterrupt raised
    anywhere could land between a lock's acquire and its release and hang the exit.)"""
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
    help="results JSONL: each row as it ends, in input order once all have",
)
@click.option(
    "--state",
    type=click.Path(dir_okay=False, path_type=Path),
    help="resume file [default: <out>.state.jsonl]",
)
@click.option(
    "--bulk-size",
    type=click.IntRange(1, 1000),
    default=1000,
    show_default=True,
    help="requests per POST /jobs/bulk",
)
@click.option(
    "--poll-interval",
    type=click.FloatRange(min=0),
    default=0.5,
    show_default=True,
    help="seconds between looks at what ended",
)
@click.option("--no-progress", is_flag=True, help="no progress bar")
def submit(
    input: Path,
    url: str,
    key: str,
    out: Path,
    state: Path | None,
    bulk_size: int,
    poll_interval: float,
    no_progress: bool,
) -> None:
    """Submit a JSONL file of requests (one {custom_id, ...POST /jobs body} per line) and write the results."""
    items: list[dict] = []
    try:
        items = read_requests(input)
    except BatchError as exc:
        click.echo(f"genq-batch: {exc}", err=True)
        sys.exit(2)
    resume, results = State(state or out.with_name(out.name + ".state.jsonl")), Results(out)
    client = Client(url, key)
    try:
        run_batch(
            items,
            client,
            resume,
            results,
            bulk_size=bulk_size,
            poll_interval=poll_interval,
            progress=not no_progress,
        )
    except BatchError as exc:
        results.close()
        click.echo(f"genq-batch: {exc}", err=True)
        sys.exit(2)
    except KeyboardInterrupt:
        results.close()
        submitted = sum(1 for entry in resume.entries.values() if entry.get("job_id"))
        click.echo(
            f"\ngenq-batch: interrupted. {submitted} of {len(items)} requests are submitted and go on running "
            f"on the server (nothing was cancelled; their job ids are in {resume.path}; the {len(results.rows)} "
            f"results so far are in {out}, in the order they ended). Run the same command again to submit the "
            "rest and collect every result.",
            err=True,
        )
        sys.exit(130)
    finally:
        resume.close()
    results.finish([item["custom_id"] for item in items])
    counts: dict[str, int] = {}
    for row in results.rows.values():
        counts[row["status"]] = counts.get(row["status"], 0) + 1
    click.echo(
        f"{len(items)} results written to {out}, in input order: "
        + ", ".join(f"{n} {status}" for status, n in sorted(counts.items()))
        + f"; {client.answers.get('POST', 0)} POST and {client.answers.get('GET', 0)} GET calls, "
        f"{client.throttled} answered 429",
        err=True,
    )
