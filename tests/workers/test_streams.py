"""Token events end to end (worker -> Redis -> the API's hub -> the caller), under gunicorn's gevent
workers, with progress written to Postgres only every 30 s: whatever a caller sees before the end came
through the events, one event per engine step, exactly the engine's own per-step output.

- a streamed /v1 completion sends each step's new text as its own chunk;
- GET /jobs/<id>/events sends each step's tokens as a `delta` event, and a client reconnecting with
  Last-Event-ID gets the rest, nothing twice; GET /jobs/<id>?wait= answers when the job ends;
- 1,000 concurrent streamed completions all finish, none answered 429 or 5xx;
- the hub writes a waiting stream's steps itself, and a client that reads late and slowly gets every chunk
  whole, in order (a socket too full to take a write: tests/webapi/test_gevent_worker.py).
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
import uuid

import openai
import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from batching import SamplingParams
from tests.conftest import serve_api
from tests.workers.conftest import assert_streamed_as_made, generation_seconds, timed, worker_stack

PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def slow_progress(settings, new_key, tmp_path_factory, redis_client):
    """A worker (16 sequences) whose progress reaches Postgres every 30 s, and the API in front of it."""
    with worker_stack(
        settings.replace(progress_interval=30.0, rate_limit="100000/second", max_queued_per_tenant=100000),
        new_key,
        tmp_path_factory.mktemp("workers"),
        max_num_seqs=16,
    ) as stack:
        with serve_api(stack.settings, env={"LOG_LEVEL": "WARNING"}) as url:  # its stderr is a pipe
            yield stack, url


def steps(offline_engine, prompt, max_tokens: int) -> list:
    """The engine's own per-step deltas for a greedy request (one per step that changed it)."""
    engine = offline_engine
    engine.add_request(
        "steps", prompt, SamplingParams(max_tokens=max_tokens, temperature=0, output_kind="delta")
    )
    out = []
    while engine.has_unfinished_requests():
        out += [o for o in engine.step() if o.request_id == "steps"]
    return out


def sse_events(response, arrivals: list[float] | None = None) -> list[tuple[str | None, str, dict]]:
    """(id, event, data) of each server-sent event of a streamed response, as they come; `arrivals` gets the
    time.monotonic() at which each came."""
    events, fields = [], {}
    for line in response.iter_lines(decode_unicode=True):
        if line == "":
            if "data" in fields:
                events.append((fields.get("id"), fields.get("event", "message"), json.loads(fields["data"])))
                if arrivals is not None:
                    arrivals.append(time.monotonic())
                if fields.get("event") == "result":
                    return events
            fields = {}
        elif not line.startswith(":"):
            name, _, value = line.partition(": ")
            fields[name] = value
    return events


def test_a_streamed_completion_sends_each_engine_step_as_it_is_made(slow_progress, offline_engine):
    stack, url = slow_progress
    want = steps(offline_engine, PROMPT, 600)  # long enough for the engine's pace to show over the API's hops
    client = openai.OpenAI(
        base_url=f"{url}/v1", api_key=stack.headers["Authorization"].split()[1], max_retries=0
    )
    started = time.monotonic()
    chunks = timed(
        client.completions.create(
            model="tiny-llama", prompt=PROMPT, max_tokens=600, temperature=0, stream=True
        )
    )
    texts = [(at, c.choices[0].text) for at, c in chunks if c.choices and c.choices[0].text]
    assert [text for _, text in texts] == [d.text for d in want if d.text]  # one chunk per step
    assert chunks[-1][1].choices[0].finish_reason == want[-1].finish_reason
    assert time.monotonic() - started < 30  # not held for a progress write
    made_s = generation_seconds(url, stack.headers, str(uuid.UUID(chunks[0][1].id.removeprefix("cmpl-"))))
    assert_streamed_as_made(started, [at for at, _ in texts], made_s)  # each step as it was made


def test_job_events_are_one_per_step_and_resume_after_the_last_event_id(slow_progress, offline_engine):
    stack, url = slow_progress
    want = steps(offline_engine, PROMPT, 600)
    before = streamed_deltas(url)
    # confirmed before the job is sent (on a busy machine the reply can take more than the default second)
    paused = stack.celery.control.cancel_consumer(
        "generate", reply=True, destination=[stack.node], timeout=10, limit=1
    )
    assert paused, "the worker did not confirm its intake's pause"
    try:  # the job waits in Redis until the stream is open: it is followed from its first token
        job = requests.post(
            f"{url}/jobs", json={"prompt": PROMPT, "max_tokens": 600, "temperature": 0}, headers=stack.headers
        ).json()
        r = requests.get(f"{url}/jobs/{job['id']}/events", headers=stack.headers, stream=True, timeout=60)
    finally:
        stack.celery.control.add_consumer("generate", reply=True, destination=[stack.node])
    started = time.monotonic()  # the worker takes the job from here on
    with r:
        assert r.status_code == 200 and r.headers["Content-Type"].startswith("text/event-stream")
        arrivals: list[float] = []
        events = sse_events(r, arrivals)
    deltas = [data for _, kind, data in events if kind == "delta"]
    assert [kind for _, kind, _ in events[:2]] == ["status", "status"], events  # queued, then running
    assert [d["token_ids"] for d in deltas] == [d.token_ids for d in want]  # one event per engine step
    assert (
        [e[0] for e in events if e[1] == "delta"]
        == [  # each delta's id: the position after it
            f"{sum(len(d.token_ids) for d in want[: i + 1])}.{sum(len(d.text) for d in want[: i + 1])}"
            for i in range(len(want))
        ]
    )
    assert "".join(d["text"] for d in deltas) == "".join(d.text for d in want)
    made_s = generation_seconds(url, stack.headers, job["id"])
    assert_streamed_as_made(started, [at for at, e in zip(arrivals, events) if e[1] == "delta"], made_s)
    statuses = [data["status"] for _, kind, data in events if kind == "status"]
    assert statuses[-1] == "running" and events[-1][1] == "result"
    result = events[-1][2]
    assert result["status"] == "succeeded" and result["output"]["token_ids"] == [
        t for d in want for t in d.token_ids
    ]

    # reconnecting after the 10th delta: the rest, nothing twice
    tenth = next(
        i
        for i, e in enumerate(events)
        if e[1] == "delta" and e[0].startswith(f"{sum(len(d['token_ids']) for d in deltas[:10])}.")
    )
    last_id = events[tenth][0]
    with requests.get(
        f"{url}/jobs/{job['id']}/events",
        headers={**stack.headers, "Last-Event-ID": last_id},
        stream=True,
        timeout=60,
    ) as r:
        rest = sse_events(r)
    tokens = [t for _, kind, data in rest if kind == "delta" for t in data["token_ids"]]
    assert tokens == result["output"]["token_ids"][int(last_id.split(".")[0]) :]
    text = "".join(data["text"] for _, kind, data in rest if kind == "delta")
    assert text == result["output"]["text"][int(last_id.split(".")[1]) :]
    after = streamed_deltas(url)  # the first stream's steps: most written by the hub while it waited
    assert after.get("hub", 0) - before.get("hub", 0) > len(want) / 2, (before, after)


def test_a_job_followed_from_its_middle_and_waited_for(slow_progress):
    stack, url = slow_progress
    job = requests.post(
        f"{url}/jobs", json={"prompt": PROMPT, "max_tokens": 300, "temperature": 0}, headers=stack.headers
    ).json()
    while requests.get(f"{url}/jobs/{job['id']}", headers=stack.headers).json()["status"] == "queued":
        time.sleep(0.05)
    time.sleep(0.3)  # some tokens made, none in Postgres yet (progress every 30 s): the row lags the events
    with requests.get(f"{url}/jobs/{job['id']}/events", headers=stack.headers, stream=True, timeout=120) as r:
        events = sse_events(r)
    result = events[-1][2]
    assert [t for _, kind, d in events if kind == "delta" for t in d["token_ids"]] == result["output"][
        "token_ids"
    ]
    assert "".join(d["text"] for _, kind, d in events if kind == "delta") == result["output"]["text"]
    other = requests.post(
        f"{url}/jobs", json={"prompt": PROMPT, "max_tokens": 200, "temperature": 0}, headers=stack.headers
    ).json()
    done = requests.get(f"{url}/jobs/{other['id']}?wait=60", headers=stack.headers, timeout=90).json()
    assert done["status"] == "succeeded" and len(done["output"]["token_ids"]) == 200
    r = requests.get(f"{url}/jobs/{other['id']}?wait=61", headers=stack.headers)
    assert r.status_code == 422 and "wait" in r.json()["error"]["message"]
    r = requests.get(f"{url}/jobs/{other['id']}/events", headers={**stack.headers, "Last-Event-ID": "x"})
    assert r.status_code == 422 and "Last-Event-ID" in r.json()["error"]["message"]


STREAM_DEADLINE_S = 300  # one stream, alone 45 s for all 1,000 together: a stream still open then has stalled


async def _stream_completion(port: int, key: str, body: bytes) -> tuple[int, str]:
    """One streamed /v1/completions call over a raw connection: (status, the text of its chunks), or (-1, what
    arrived) where the stream is still open after STREAM_DEADLINE_S (a stall reported as one, not as the test's
    timeout, whose killed sockets then warn in whatever test the worker runs next)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    received = bytearray()

    async def read_all() -> None:
        while chunk := await reader.read(65536):
            received.extend(chunk)

    try:
        writer.write(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Authorization: Bearer {key}\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
            + body
        )
        await writer.drain()
        await asyncio.wait_for(read_all(), STREAM_DEADLINE_S)
    except asyncio.TimeoutError:
        return -1, f"<stalled after {len(received)} bytes, ending {bytes(received[-300:])!r}>"
    finally:
        writer.close()
    raw = bytes(received)
    head, _, payload = raw.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    if b"chunked" in head.lower():  # undo the chunked transfer coding
        out, rest = b"", payload
        while rest:
            size, _, rest = rest.partition(b"\r\n")
            n = int(size, 16)
            if n == 0:
                break
            out, rest = out + rest[:n], rest[n + 2 :]
        payload = out
    text = ""
    for line in payload.decode().splitlines():
        if line.startswith("data: {"):
            text += "".join(c.get("text", "") for c in json.loads(line[6:]).get("choices", []))
    return status, text if payload.rstrip().endswith(b"data: [DONE]") else text + "<unfinished>"


def test_a_thousand_concurrent_streams_all_finish(slow_progress, offline_engine):
    stack, url = slow_progress
    [want] = offline_engine.generate([PROMPT], SamplingParams(max_tokens=4, temperature=0))
    body = json.dumps(
        {"model": "tiny-llama", "prompt": PROMPT, "max_tokens": 4, "temperature": 0, "stream": True}
    )
    port, key = int(url.rsplit(":", 1)[1]), stack.headers["Authorization"].split()[1]

    async def all_at_once():
        return await asyncio.gather(*(_stream_completion(port, key, body.encode()) for _ in range(1000)))

    results = asyncio.run(all_at_once())
    statuses = [status for status, _ in results]
    stalled = [text for status, text in results if status == -1]
    assert statuses.count(200) == 1000, ({s: statuses.count(s) for s in set(statuses)}, stalled[:3])
    assert all(text == want.text for _, text in results)


def streamed_deltas(url: str) -> dict[str, float]:
    """genq_streamed_deltas_total by writer, summed over the API's processes (its /metrics)."""
    families = text_string_to_metric_families(requests.get(f"{url}/metrics", timeout=10).text)
    return {
        sample.labels["writer"]: sample.value
        for family in families
        if family.name == "genq_streamed_deltas"
        for sample in family.samples
        if sample.name.endswith("_total")
    }


def test_the_hub_writes_a_waiting_streams_steps_and_a_slow_reader_gets_every_byte(
    slow_progress, offline_engine
):
    stack, url = slow_progress
    want = steps(offline_engine, PROMPT, 1500)  # ~200 kB of chunks
    before = streamed_deltas(url)
    body = json.dumps(
        {"model": "tiny-llama", "prompt": PROMPT, "max_tokens": 1500, "temperature": 0, "stream": True}
    ).encode()
    host, port = url.removeprefix("http://").rsplit(":", 1)
    with socket.socket() as client:
        client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a small window
        client.connect((host, int(port)))
        client.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Authorization: {stack.headers['Authorization']}\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
            + body
        )
        raw = bytearray(client.recv(4096))
        time.sleep(3)  # reads nothing while the job goes on
        while piece := client.recv(512):  # then reads slowly
            raw += piece
    head, _, payload = bytes(raw).partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200") and b"chunked" in head.lower(), head
    events, rest = [], payload
    while True:  # the chunked coding: every chunk whole, in order
        size, _, rest = rest.partition(b"\r\n")
        n = int(size, 16)
        if n == 0:
            break
        assert rest[n : n + 2] == b"\r\n"
        events += [e for e in rest[:n].decode().split("\n\n") if e.strip()]
        rest = rest[n + 2 :]
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    pieces = [c["choices"][0]["text"] for c in chunks if c["choices"][0]["text"]]
    assert pieces == [d.text for d in want if d.text]  # one chunk per engine step, none lost or repeated
    assert chunks[-1]["choices"][0]["finish_reason"] == want[-1].finish_reason
    deadline = time.monotonic() + 10
    while (after := streamed_deltas(url)).get("hub", 0) == before.get(
        "hub", 0
    ) and time.monotonic() < deadline:
        time.sleep(0.1)  # counted when the response closes, just after its last byte
    assert after.get("hub", 0) - before.get("hub", 0) > len(want) / 2, (before, after)  # most steps: the hub
