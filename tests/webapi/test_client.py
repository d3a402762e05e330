"""The batch client (batchclient/) against a real stack over HTTP: killed midway, resumed, no duplicates;
results written as they end, in bulk calls and a listing of what ended, not a call per job."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from werkzeug.serving import make_server

from tests.conftest import ROOT
from tests.workers.conftest import worker_stack

N = 40


@pytest.fixture(scope="module")
def served(settings, new_key, tmp_path_factory, redis_client):
    """A worker, and the API on a real HTTP port (werkzeug, threaded) in front of it."""
    settings = settings.replace(rate_limit="2000/second")
    with worker_stack(settings, new_key, tmp_path_factory.mktemp("client"), max_num_seqs=4) as stack:
        with http_server(stack.client.application) as url:
            yield stack, url


@contextmanager
def http_server(app) -> Iterator[str]:
    server = make_server("127.0.0.1", 0, app, threaded=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}"
    finally:
        server.shutdown()
        thread.join()


class CountingCalls:
    """WSGI middleware: every call's (method, path, status), and each bulk item's status."""

    def __init__(self, app):
        self.app, self.calls, self.bulk_items = app, [], []

    def __call__(self, environ, start_response):
        answered = {}

        def start(status, headers, exc_info=None):
            answered["status"] = int(status.split()[0])
            return start_response(status, headers, exc_info)

        body = b"".join(self.app(environ, start))
        self.calls.append((environ["REQUEST_METHOD"], environ["PATH_INFO"], answered["status"]))
        if environ["PATH_INFO"] == "/jobs/bulk" and answered["status"] == 200:
            self.bulk_items += [item["status"] for item in json.loads(body)["results"]]
        return [body]


def client_command(url: str, key: str, tmp_path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "batchclient",
        "submit",
        str(tmp_path / "in.jsonl"),
        "--url",
        url,
        "--key",
        key,
        "--out",
        str(tmp_path / "out.jsonl"),
        "--bulk-size",
        "5",
        "--poll-interval",
        "0.1",
        "--no-progress",
    ]


def list_all_jobs(stack) -> list[dict]:
    jobs, cursor = [], None
    while True:
        r = stack.client.get(
            "/jobs",
            query_string={"limit": 100, **({"cursor": cursor} if cursor else {})},
            headers=stack.headers,
        )
        jobs += r.json["jobs"]
        cursor = r.json["next_cursor"]
        if cursor is None:
            return jobs


def test_killed_client_resumes_in_order_without_duplicates(served, tmp_path):
    stack, url = served
    key = stack.headers["Authorization"].removeprefix("Bearer ")
    items = [
        {
            "custom_id": f"item-{i:03d}",
            "prompt": f"Prompt number {i}",
            "max_tokens": 3 + i % 5,
            "priority": i % 10,
            "temperature": 0.0,
        }
        for i in range(N)
    ]
    items.reverse()  # the output follows the input order, not the ids' order
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(item) + "\n" for item in items))
    state = tmp_path / "out.jsonl.state.jsonl"

    with (tmp_path / "first.log").open("w") as log:
        first = subprocess.Popen(client_command(url, key, tmp_path), cwd=ROOT, stderr=log)
    deadline = time.monotonic() + 60
    while not state.exists() or len(state.read_text().splitlines()) < 10:
        assert first.poll() is None, (tmp_path / "first.log").read_text()
        assert time.monotonic() < deadline
        time.sleep(0.005)
    first.send_signal(signal.SIGKILL)
    first.wait()
    lines = state.read_text().splitlines()
    assert 10 <= len(lines) < N, "the client was not interrupted midway"
    # as if the client had died after the API accepted the last two but before it recorded them
    state.write_text("".join(line + "\n" for line in lines[:-2]))

    done = subprocess.run(
        client_command(url, key, tmp_path), cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    rows = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [row["custom_id"] for row in rows] == [item["custom_id"] for item in items]
    for item, row in zip(items, rows, strict=True):
        assert row["status"] == "succeeded", row
        assert 1 <= row["usage"]["completion_tokens"] <= item["max_tokens"]
        assert row["output"]["token_ids"] and row["error"] is None
    server_jobs = list_all_jobs(stack)
    assert len(server_jobs) == N  # the re-submitted ones got their first job back (Idempotency-Key)
    assert {job["id"] for job in server_jobs} == {row["job_id"] for row in rows}

    again = subprocess.run(
        client_command(url, key, tmp_path), cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert again.returncode == 0, again.stderr
    assert [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()] == rows
    assert len(list_all_jobs(stack)) == N


def test_bad_input_is_refused_before_anything_is_sent(tmp_path):
    (tmp_path / "in.jsonl").write_text(
        '{"custom_id": "a", "prompt": "x"}\n{"custom_id": "a", "prompt": "y"}\n'
    )
    r = subprocess.run(
        client_command("http://127.0.0.1:9", "k", tmp_path),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2 and "custom_id 'a' appears twice" in r.stderr


def test_ctrl_c_stops_cleanly_and_says_what_happened_to_the_jobs(app, new_key, tmp_path):
    """No worker runs here, so the client waits on queued jobs until it is interrupted."""
    server = make_server("127.0.0.1", 0, app, threaded=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    key = new_key()
    items = [{"custom_id": f"c{i}", "prompt": "Hello", "max_tokens": 4} for i in range(5)]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(item) + "\n" for item in items))
    state = tmp_path / "out.jsonl.state.jsonl"
    try:
        with (tmp_path / "client.log").open("w") as log:
            client = subprocess.Popen(
                client_command(f"http://127.0.0.1:{server.server_port}", key, tmp_path),
                cwd=ROOT,
                stderr=log,
                # as a shell starts a foreground command: an ignored SIGINT would be inherited (a background
                # job keeps ignoring it), and this test process may have been left ignoring it
                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
            )
        deadline = time.monotonic() + 60
        while not state.exists() or len(state.read_text().splitlines()) < len(items):
            assert client.poll() is None and time.monotonic() < deadline, (
                tmp_path / "client.log"
            ).read_text()
            time.sleep(0.01)
        client.send_signal(signal.SIGINT)  # what Ctrl-C sends
        assert client.wait(timeout=30) == 130
    finally:
        server.shutdown()
        thread.join()
    err = (tmp_path / "client.log").read_text()
    assert "Traceback" not in err and "KeyboardInterrupt" not in err
    assert "interrupted. 5 of 5 requests are submitted" in err and "nothing was cancelled" in err
    assert str(state) in err
    jobs = app.test_client().get("/jobs", headers={"Authorization": f"Bearer {key}"}).json["jobs"]
    assert sorted(job["status"] for job in jobs) == ["queued"] * 5  # still there, still queued


def test_results_are_written_as_they_end_in_few_calls_without_a_429(served, tmp_path):
    """A cap of 40 queued jobs and the default rate limit: 400 requests go in bulk calls that fit the cap,
    results are followed by GET /jobs/ended (far fewer GETs than jobs), and written while the run goes on."""
    from webapi import create_app

    stack, _ = served
    settings = stack.settings.replace(max_queued_per_tenant=40, rate_limit="50/second;2000/minute")
    app = create_app(settings)
    counting = CountingCalls(app)
    n = 400
    items = [
        {"custom_id": f"s{i}", "prompt": f"Item {i}", "max_tokens": 2 + i % 4, "temperature": 0.0}
        for i in range(n)
    ]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(item) + "\n" for item in items))
    out = tmp_path / "out.jsonl"
    try:
        with http_server(counting) as url:
            command = [*client_command(url, stack.headers["Authorization"][7:], tmp_path)]
            command[command.index("--bulk-size") + 1] = "1000"
            command[command.index("--poll-interval") + 1] = "0.5"  # the default
            with (tmp_path / "client.log").open("w") as log:
                client = subprocess.Popen(command, cwd=ROOT, stderr=log)
            counts_seen = set()
            while client.poll() is None:
                if out.exists():
                    counts_seen.add(len(out.read_text().splitlines()))
                time.sleep(0.05)
            stderr = (tmp_path / "client.log").read_text()
    finally:
        app.extensions["genq"].close()
    assert client.returncode == 0, stderr
    assert any(0 < count < n for count in counts_seen)  # rows appeared while it ran, not all at the end
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [row["custom_id"] for row in rows] == [
        item["custom_id"] for item in items
    ]  # input order at the end
    assert all(row["status"] == "succeeded" for row in rows)
    statuses = [status for _, _, status in counting.calls]
    assert 429 not in statuses and 429 not in counting.bulk_items
    gets = sum(1 for method, _, _ in counting.calls if method == "GET")
    posts = [path for method, path, _ in counting.calls if method == "POST"]
    assert gets < n / 4, gets
    assert set(posts) == {"/jobs/bulk"} and len(posts) >= n / 40  # the cap's room at a time


def test_two_files_reusing_custom_ids_get_their_own_jobs(served, tmp_path):
    stack, url = served
    key = stack.headers["Authorization"][7:]
    ids = []
    for name, prompt in (("one", "First file"), ("two", "Second file")):
        run = tmp_path / name
        run.mkdir()
        (run / "in.jsonl").write_text(
            json.dumps({"custom_id": "q1", "prompt": prompt, "max_tokens": 3}) + "\n"
        )
        done = subprocess.run(
            client_command(url, key, run), cwd=ROOT, capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 0, done.stderr
        row = json.loads((run / "out.jsonl").read_text())
        assert row["status"] == "succeeded", row
        ids.append(row["job_id"])
    assert ids[0] != ids[1]


def test_an_api_that_does_not_answer_is_reported_within_seconds(tmp_path):
    (tmp_path / "in.jsonl").write_text('{"custom_id": "a", "prompt": "x"}\n')
    started = time.monotonic()
    r = subprocess.run(
        client_command("http://127.0.0.1:9", "k", tmp_path),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2 and "the API at http://127.0.0.1:9 does not answer" in r.stderr
    assert time.monotonic() - started < 15


def test_a_key_allowed_no_queued_job_is_told_so(served, tmp_path, new_key, sessions):
    from jobstore.tenant_policy import set_policy

    stack, url = served
    name = f"capped-{time.monotonic_ns()}"
    key = new_key(name)
    with sessions.begin() as session:
        set_policy(session, name, {"max_queued": 0})
    (tmp_path / "in.jsonl").write_text('{"custom_id": "a", "prompt": "x", "max_tokens": 2}\n')
    r = subprocess.run(
        client_command(url, key, tmp_path), cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 2 and "its tenant's max_queued is 0" in r.stderr


def test_the_submitter_sends_once_an_answer_shows_room_not_at_its_next_tick(served, tmp_path, monkeypatch):
    """A submitter waiting for room is woken by the answer that shows it (here the follower's look at what
    ended), not by a timer: with its stop check set to 30 s, each bulk call follows within seconds of the
    answer. Three rounds, each from a cap the client saw full."""
    from tqdm import tqdm

    from batchclient import submit
    from batchclient.api import Client
    from batchclient.follow import Follower
    from batchclient.run_state import Results, State

    monkeypatch.setattr(submit, "STOP_CHECK_SECONDS", 30.0)
    stack, _ = served
    arrivals: list[float] = []

    def timing(environ, start_response):
        if environ["PATH_INFO"] == "/jobs/bulk":
            arrivals.append(time.monotonic())
        return stack.client.application(environ, start_response)

    with http_server(timing) as url:
        client = Client(url, stack.headers["Authorization"].removeprefix("Bearer "))
        state, results = State(tmp_path / "state.jsonl"), Results(tmp_path / "out.jsonl")
        with tqdm(disable=True) as bar:
            follower = Follower(client, state, results, bar)
            for round_ in range(3):
                follower.queue_seen({"queued": 1000, "max_queued": 1000})  # as an answer saying it is full
                items = [{"custom_id": f"r{round_}-{i}", "prompt": "Room", "max_tokens": 2} for i in range(3)]
                submitter = submit.Submitter(client, state, items, follower, bulk_size=1000)
                thread = threading.Thread(target=submitter.run, daemon=True)
                thread.start()
                time.sleep(0.3)
                assert not submitter.done.is_set() and len(arrivals) == round_  # waiting for room
                follower.poll()  # GET /jobs/ended: its answer shows the cap's room
                seen = time.monotonic()
                assert submitter.done.wait(10) and submitter.error is None
                thread.join()
                assert len(arrivals) == round_ + 1
                assert arrivals[-1] - seen < 5.0, (
                    f"round {round_}: the bulk call came {arrivals[-1] - seen:.1f} s later"
                )
        state.close()
        results.close()
    assert len(state.entries) == 9 and all(entry["job_id"] for entry in state.entries.values())


def test_a_job_whose_end_is_recorded_behind_the_cursor_is_still_found(app, new_key, tmp_path, sessions):
    """GET /jobs/ended's cursor trails the API's clock by a second: a job whose end is recorded with an earlier
    time than that (its commit came late) is passed over by the listing, and the follower, finding nothing
    ended for a while with jobs pending, lists again from the oldest pending job's creation."""
    from sqlalchemy import text as sql

    from batchclient.api import Client
    from batchclient.cli import run_batch
    from batchclient.run_state import Results, State

    def end(custom_id: str, finished_at: str) -> None:
        with sessions.begin() as s:
            s.execute(
                sql(
                    "UPDATE jobs SET status = 'succeeded', started_at = created_at, output_text = 'ok', "
                    f"finished_at = {finished_at} WHERE id = :id"
                ),
                {"id": state.entries[custom_id]["job_id"]},
            )

    def wait(what: str, done) -> None:
        deadline = time.monotonic() + 30
        while not done():
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            time.sleep(0.05)

    key = new_key()
    with http_server(app) as url:  # no worker: the jobs stay queued until the test ends them
        client = Client(url, key)
        state, results = State(tmp_path / "state.jsonl"), Results(tmp_path / "out.jsonl")
        items = [{"custom_id": c, "prompt": "Hello", "max_tokens": 4} for c in ("on time", "late")]
        args = dict(bulk_size=5, poll_interval=0.1, progress=False, relist_after=1.5)
        follower = threading.Thread(target=run_batch, args=(items, client, state, results), kwargs=args)
        follower.start()
        try:
            wait("the submissions", lambda: len(state.entries) == 2)
            time.sleep(1.2)
            end(
                "on time", "statement_timestamp()"
            )  # listed: the cursor moves a second behind the API's clock
            wait("the first result", lambda: "on time" in results.rows)
            end("late", "created_at + interval '1 millisecond'")  # behind the cursor now
            follower.join(timeout=20)
            assert not follower.is_alive(), "the late job's result was never found"
        finally:
            client.stopping.set()
            follower.join(timeout=10)
            state.close()
            results.close()
    assert {c: row["status"] for c, row in results.rows.items()} == {
        "on time": "succeeded",
        "late": "succeeded",
    }
